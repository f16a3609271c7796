"""The CPU cost of the bulk path without the model (issue 43 item 3), on the real service.

    python -m benchmarks.bulk_path [--images 20000] [--originals 336] [--postgres [URL]]
    make bench-path [BENCH_ARGS="..."]

Every worker of a real stack (``scripts.stack.Stack``: Celery, a private Redis, the embedded store,
PostgreSQL with ``--postgres``) runs :class:`benchmarks.fixed_encoder.FixedEncoder`, a model that
costs nothing, so what is measured is everything else: reading bytes, decoding, previews and
thumbnails, Celery, SQL, the vectors worker and the store. In this order:

1. **decode bound of the originals**: the 84 photos (``--originals`` images: the photos repeated, each
   copy with new bytes) decoded and preprocessed exactly as a bulk worker does
   (``workers.decode.decode_image`` with DCT scaling, ``workers.preprocess.resize_and_crop``), one
   process per core, nothing else: the most images/s any pipeline could make of them here;
2. **first embedding of the originals**: the same images as a bulk job (upload, decode, preview,
   thumbnail, vectors, store); its images/s against (1), target ≥ 0.85 ×;
3. a catalogue of ``--images`` pictures (views of the photos, at most 640 px wide, JPEG q90) as a
   bulk job: first embeddings that draw their previews;
4. **re-embedding from previews**: a model migration to ``--model`` over the whole catalogue (every
   image read from its preview), target ≥ 1,500 images/s; with the SQL statements of each chunk
   task, the Redis commands per image, the store's points/s and each process's CPU.

Images/s of a job come from its own timestamps (``GET /api/jobs/{id}/``: started → finished). The
CPU, its flags and the load average are printed first; results go to ``--out`` (``results.json``,
``table.md``, ``bulk-path.png``).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ROOT, distinct_photos, machine, machine_line, pyplot, write_folder  # noqa: E402
from benchmarks.lanes import Client, base_images, ingest, scratch_database, wait_job  # noqa: E402
from benchmarks.migration import picture  # noqa: E402
from scripts.stack import Stack  # noqa: E402

#: The issue's targets (issue 43 item 3).
TARGET_REEMBED_PER_S = 1500.0
TARGET_FIRST_RATIO = 0.85


class FixedEncoderStack(Stack):
    """A :class:`Stack` whose Celery workers start through ``benchmarks.fixed_encoder`` (their model
    costs nothing); web and the other processes are the product's own."""

    def _spawn(self, name, cmd):
        argv = cmd.split() if isinstance(cmd, str) else list(cmd)
        if argv and argv[0] == "celery":
            argv = [sys.executable, "-m", "benchmarks.fixed_encoder", *argv[1:]]
        return super()._spawn(name, argv)


def _decode_one(data: bytes, min_side: int, size: tuple[int, int]) -> int:
    from workers.decode import decode_image
    from workers.preprocess import PreprocessConfig, resize_and_crop

    cfg = PreprocessConfig(size=size, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    decoded = decode_image(data, min_side=min_side)
    resize_and_crop(decoded.rgb, cfg)
    return 1


def _decode_share(datas: list[bytes]) -> float:
    """Decode + preprocess ``datas`` in this process; returns the seconds it took."""
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    for d in datas:
        _decode_one(d, 224, (224, 224))
    return time.perf_counter() - t0


def _preview_share(datas: list[bytes]) -> float:
    """Read + preprocess ``datas`` (previews) as a re-embed does; returns the seconds it took."""
    import cv2
    import torch

    from workers.preprocess import PreprocessConfig, resize_and_crop
    from workers.preview import preview_read

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    cfg = PreprocessConfig(size=(224, 224), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    t0 = time.perf_counter()
    for d in datas:
        resize_and_crop(preview_read(d).rgb, cfg)
    return time.perf_counter() - t0


def preview_bound(originals: list[bytes], n: int, processes: int) -> dict:
    """Images/s of reading ``n`` previews (those of ``originals``, repeated) and preprocessing them,
    nothing else, ``processes`` processes: the most a re-embed from previews could make here."""
    from workers.decode import decode_image
    from workers.preview import preview_bytes

    previews = []
    for data in originals[:84]:
        d = decode_image(data, min_side=224)
        previews.append(preview_bytes(d.rgb, width=d.width, height=d.height, format=d.format)[0])
    datas = [previews[i % len(previews)] for i in range(n)]
    _preview_share(datas[:8])
    shares = [datas[i::processes] for i in range(processes)]
    with concurrent.futures.ProcessPoolExecutor(processes) as pool:
        seconds = list(pool.map(_preview_share, shares))
    return {"images": n, "processes": processes, "wall_s": round(max(seconds), 3),
            "mean_kb": round(float(np.mean([len(p) for p in previews])) / 1024, 1),
            "images_per_s": round(n / max(seconds), 1)}


def decode_bound(datas: list[bytes], processes: int) -> dict:
    """Images/s of decode + preprocess alone over ``datas``, ``processes`` processes each taking
    every ``processes``-th image (one warm-up pass over a few images first)."""
    _decode_share(datas[:8])
    shares = [datas[i::processes] for i in range(processes)]
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(processes) as pool:
        seconds = list(pool.map(_decode_share, shares))
    wall = time.perf_counter() - t0
    return {"images": len(datas), "processes": processes, "wall_s": round(wall, 3),
            "per_process_s": [round(s, 3) for s in seconds],
            # the bound: the slowest share's decoding time, no pool start-up
            "images_per_s": round(len(datas) / max(seconds), 1)}


def _job_rate(j: dict) -> dict:
    return {"total": j.get("total"), "embedded": j.get("embedded"), "failed": j.get("failed"),
            "skipped": j.get("skipped"), "elapsed_s": j.get("elapsed_s"),
            "images_per_s": j.get("throughput_images_per_s")}


def redis_commands(url: str) -> int:
    import redis

    info = redis.Redis.from_url(url).info("commandstats")
    return sum(v["calls"] for v in info.values())


class CpuSampler:
    """CPU seconds of each of the stack's processes (children included) between ``start`` and ``stop``."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def _times(self) -> dict[str, float]:
        import psutil

        out = {}
        for name, p in self.stack.procs.items():
            try:
                proc = psutil.Process(p.pid)
                procs = [proc, *proc.children(recursive=True)]
                out[name] = sum(sum(x.cpu_times()[:2]) for x in procs)
            except psutil.Error:
                out[name] = 0.0
        return out

    def start(self) -> None:
        self.t0, self.c0 = time.perf_counter(), self._times()

    def stop(self) -> dict[str, float]:
        wall, c1 = time.perf_counter() - self.t0, self._times()
        return {name: round(100 * (c1.get(name, 0) - self.c0.get(name, 0)) / wall, 1) for name in c1}


def sql_per_task(folder: Path, since: float) -> dict:
    """``{task: {"tasks", "statements_per_task" (median), "writes", "sql_ms", "images"}}`` from the
    fixed-encoder workers' SQL counts."""
    rows = []
    for f in folder.glob("sql-*.jsonl"):
        rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["t"] >= since]
    out = {}
    for task in sorted({r["task"] for r in rows}):
        rs = [r for r in rows if r["task"] == task]
        out[task.rsplit(".", 1)[-1]] = {
            "tasks": len(rs), "images_median": float(np.median([r["images"] for r in rs])),
            "statements_median": float(np.median([r["statements"] for r in rs])),
            "statements_max": max(r["statements"] for r in rs),
            "writes_median": float(np.median([r["writes"] for r in rs])),
            "sql_ms_median": float(np.median([r["sql_ms"] for r in rs])),
            "wall_ms_median": float(np.median([r["wall_ms"] for r in rs])),
            "wall_s_total": round(sum(r["wall_ms"] for r in rs) / 1000, 3),
            "images_total": sum(r["images"] for r in rs)}
    return out


def run_job(client: Client, stack: Stack, folder: Path) -> tuple[dict, dict]:
    cpu = CpuSampler(stack)
    cpu.start()
    job = wait_job(client, ingest(stack, folder))
    return _job_rate(job), cpu.stop()


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    hardware = machine()
    print(machine_line(hardware) + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    res: dict = {"machine": hardware, "config": vars(args)}

    originals = distinct_photos(args.originals)
    res["decode_bound"] = decode_bound([d for _, d in originals], args.processes or os.cpu_count())
    print(f"decode bound, {len(originals)} originals: {res['decode_bound']['images_per_s']} images/s", flush=True)
    res["preview_bound"] = preview_bound([d for _, d in originals], 4096, args.processes or os.cpu_count())
    print(f"preview bound: {res['preview_bound']['images_per_s']} images/s "
          f"(mean preview {res['preview_bound']['mean_kb']} KB)", flush=True)

    images = out / "images"
    shutil.rmtree(images, ignore_errors=True)
    write_folder(images / "originals", originals)
    bases = base_images()
    write_folder(images / "catalogue", ((f"p{i:06d}.jpg", picture(bases, i + 1000)) for i in range(args.images)))
    print(f"{args.images} catalogue pictures written", flush=True)

    stack_dir = out / "stack"
    shutil.rmtree(stack_dir, ignore_errors=True)
    sql_dir = out / "sql"
    shutil.rmtree(sql_dir, ignore_errors=True)
    sql_dir.mkdir(parents=True)
    target = f"{args.model}:random:fp32"
    # MIGRATION_BULK_SLOTS=0: every bulk process may compute a migration chunk, as on a host whose
    # lanes do not share cores (a GPU host); the default 1 protects a CPU host's interactive lane
    env = {"CLIP_PRETRAINED": "random", "CLIP_PRECISION": "fp32", "CLIP_MODELS": target, "DJANGO_DEBUG": "0",
           "MIGRATION_BULK_SLOTS": "0", "BENCH_SQL_DIR": str(sql_dir), **dict(kv.split("=", 1) for kv in args.env)}
    database = scratch_database(args.postgres) if args.postgres else contextlib.nullcontext("")
    with database as database_url, FixedEncoderStack(stack_dir, {**env, "DATABASE_URL": database_url},
                                                     private_redis=True, log=lambda *a: None) as stack:
        client = Client(stack.web_url, stack.manage("apiuser", "bench", "--staff").strip())
        t = time.time()
        res["first_originals"], res["first_originals_cpu"] = run_job(client, stack, images / "originals")
        res["first_originals"]["sql"] = sql_per_task(sql_dir, t)
        print(f"first embedding, originals: {res['first_originals']}", flush=True)
        t = time.time()
        res["first_catalogue"], res["first_catalogue_cpu"] = run_job(client, stack, images / "catalogue")
        res["first_catalogue"]["sql"] = sql_per_task(sql_dir, t)
        print(f"first embedding, catalogue: {res['first_catalogue']}", flush=True)

        cpu = CpuSampler(stack)
        r0, t = redis_commands(stack.env["REDIS_URL"]), time.time()
        cpu.start()
        model, _, _ = target.split(":")
        r = client.s.post(client.base + "/api/migrations/", json={"model": model, "pretrained": "random"}, timeout=60)
        if r.status_code not in (201, 202):
            raise SystemExit(f"migration refused: {r.status_code} {r.text}")
        space = r.json()
        job_id = space["job"] if isinstance(space.get("job"), str) else space["job"]["id"]
        job = wait_job(client, job_id)
        res["reembed_cpu"] = cpu.stop()
        res["reembed"] = _job_rate(job)
        res["reembed"]["redis_commands_per_image"] = round(
            (redis_commands(stack.env["REDIS_URL"]) - r0) / max(1, job.get("embedded") or 1), 3)
        res["reembed"]["sql"] = sql_per_task(sql_dir, t)
        res["reembed"]["previews"] = space_previews(stack)
        print(f"re-embedding from previews: {res['reembed']}", flush=True)
    res["targets"] = targets(res)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    text = table(res)
    (out / "table.md").write_text(text + "\n")
    print(text)
    plot(res, out / "bulk-path.png")
    return 0 if all(t["pass"] for t in res["targets"]) else 1


def space_previews(stack: Stack) -> dict:
    """The preview reads the workers counted (``clip_preview_reads_total`` at the web's /metrics)."""
    import requests

    text = requests.get(stack.web_url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("clip_preview_reads_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("clip_preview_reads_total"):]] = float(value)
    return out


def targets(res: dict) -> list[dict]:
    bound = res["decode_bound"]["images_per_s"]
    first = res["first_originals"]["images_per_s"] or 0.0
    re = res["reembed"]["images_per_s"] or 0.0
    pb = res["preview_bound"]["images_per_s"]
    return [
        {"name": f"re-embedding from previews >= {TARGET_REEMBED_PER_S:,.0f} images/s", "pass": re >= TARGET_REEMBED_PER_S,
         "detail": f"{re:,.0f} images/s ({res['reembed']['embedded']} of {res['reembed']['total']}); "
                   f"{re / pb if pb else 0:.2f} x the previews' read + preprocess bound of {pb:,.0f} images/s"},
        {"name": f"first embedding of the originals >= {TARGET_FIRST_RATIO} x their decode bound",
         "pass": first >= TARGET_FIRST_RATIO * bound,
         "detail": f"{first:,.1f} vs {bound:,.1f} images/s: {first / bound if bound else 0:.2f} x"},
    ]


def table(res: dict) -> str:
    lines = [machine_line(res["machine"]), "",
             "| phase | images | images/s | elapsed s | CPU % by process |", "| --- | --- | --- | --- | --- |",
             f"| decode bound, originals ({res['decode_bound']['processes']} processes, nothing else) | "
             f"{res['decode_bound']['images']} | {res['decode_bound']['images_per_s']:,.1f} | "
             f"{res['decode_bound']['wall_s']} | - |"]
    pb = res["preview_bound"]
    lines.append(f"| read + preprocess bound, previews ({pb['processes']} processes, nothing else; mean "
                 f"{pb['mean_kb']} KB) | {pb['images']} | {pb['images_per_s']:,.1f} | {pb['wall_s']} | - |")
    for key, label in (("first_originals", "first embedding, originals"), ("first_catalogue", "first embedding, catalogue"),
                       ("reembed", "re-embedding from previews (migration)")):
        r, cpu = res[key], res.get(f"{key}_cpu", {})
        cpu_text = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 1)
        lines.append(f"| {label} | {r['embedded']} of {r['total']} | {(r['images_per_s'] or 0):,.1f} | "
                     f"{r['elapsed_s']} | {cpu_text} |")
    lines += ["", "| phase | task | tasks | images per task | SQL statements per task (median / max) | of which writes | "
              "SQL ms per task | task wall ms |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in ("first_originals", "first_catalogue", "reembed"):
        for task, s in res[key].get("sql", {}).items():
            lines.append(f"| {key} | {task} | {s['tasks']} | {s['images_median']:.0f} | {s['statements_median']:.0f} / "
                         f"{s['statements_max']} | {s['writes_median']:.0f} | {s['sql_ms_median']:.1f} | "
                         f"{s['wall_ms_median']:.0f} |")
    ix = res["reembed"].get("sql", {}).get("index_chunk")
    if ix and ix["wall_s_total"]:
        lines += ["", f"The vectors worker (the embedded store's single writer) during the re-embed: "
                      f"{ix['images_total']} points in {ix['wall_s_total']} s of index_chunk tasks = "
                      f"{ix['images_total'] / ix['wall_s_total']:,.0f} points/s while busy"]
    lines += ["", f"Redis commands per re-embedded image (every client): {res['reembed']['redis_commands_per_image']}",
              f"Preview reads: {res['reembed'].get('previews')}", ""]
    for t in res["targets"]:
        lines.append(f"- {'PASS' if t['pass'] else 'FAIL'}: {t['name']}: {t['detail']}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = ["decode bound\n(originals)", "first embedding\n(originals)", "first embedding\n(catalogue)",
              "read bound\n(previews)", "re-embedding\n(previews)"]
    values = [res["decode_bound"]["images_per_s"], res["first_originals"]["images_per_s"] or 0,
              res["first_catalogue"]["images_per_s"] or 0, res["preview_bound"]["images_per_s"],
              res["reembed"]["images_per_s"] or 0]
    ax.bar(labels, values, color=["tab:gray", "tab:blue", "tab:blue", "tab:gray", "tab:green"])
    ax.axhline(TARGET_REEMBED_PER_S, color="tab:green", ls="--", lw=1, label="re-embed target")
    ax.axhline(TARGET_FIRST_RATIO * values[0], color="tab:blue", ls=":", lw=1, label="0.85 x decode bound")
    ax.set_ylabel("images/s")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("bulk path without the model (fixed-vector encoder)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bulk_path", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Results: docs/scaling.md.")
    ap.add_argument("--images", type=int, default=20000, help="catalogue pictures to re-embed (default 20,000)")
    ap.add_argument("--originals", type=int, default=336, help="originals: the 84 photos repeated (default 336)")
    ap.add_argument("--processes", type=int, default=0, help="decode-bound processes (default: the cores)")
    ap.add_argument("--model", default="ViT-B-16", help="the migration's target architecture (default ViT-B-16)")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="extra environment for the stack")
    ap.add_argument("--postgres", metavar="URL", nargs="?", const="postgres://postgres@127.0.0.1:5432/postgres",
                    default="", help="run on PostgreSQL (a scratch database on this server) instead of SQLite")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "bulk-path"), help="output folder")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
