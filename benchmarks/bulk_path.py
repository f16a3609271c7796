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
   image read from its preview), target ≥ 1,500 images/s and ≥ 0.85 × the previews' read +
   preprocess bound; with the SQL statements of each chunk task, the Redis commands per image, the
   vectors worker's points/s while busy (target ≥ 5,000, issue 58 item 2) beside the embedded
   store's own upsert rate measured in the same run, and each process's CPU.

Every bound and phase carries the cores other work held while it ran (the machine's busy CPU
seconds from the kernel's counters minus those of this benchmark's own process tree, over the wall
time: ``OtherWork``) and the 1-minute load average before and after it; a bound during which other
work held more than ``QUIET_OTHER_CORES`` cores is flagged as unreliable (the cores were shared, so
it reads low and flatters the ratios). First embeddings also print their chunks' median stage times (``BatchStat``).

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

from benchmarks._common import ROOT, begin, distinct_photos, machine_line, pyplot, write_folder  # noqa: E402
from benchmarks.lanes import Client, base_images, ingest, scratch_database, wait_job  # noqa: E402
from benchmarks.migration import picture  # noqa: E402
from scripts.stack import Stack  # noqa: E402

#: The issue's targets (issue 43 item 3; issue 58 items 2 and 3).
TARGET_REEMBED_PER_S = 1500.0
TARGET_FIRST_RATIO = 0.85
TARGET_REEMBED_RATIO = 0.85
TARGET_WRITER_POINTS_PER_S = 5000.0

#: CPU of other work (cores: CPU seconds of the machine's processes outside this benchmark's own
#: process tree, per second of wall time) above which a bound or a phase is flagged as unreliable:
#: other work then held the cores, so a bound measured "alone" was not alone and reads too low.
#: Read from the kernel's counters, not the load average: a 1-minute average lags by a minute and
#: counts the benchmark's own previous phase as "load".
QUIET_OTHER_CORES = 0.2


def load_now() -> dict:
    """``{"load_1m", "per_core"}``: the 1-minute load average, and per core (printed beside every
    figure; the verdicts use :class:`OtherWork`)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return {"load_1m": round(load, 2), "per_core": round(load / cores, 2)}


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``: user, nice, system,
    irq, softirq, and steal: time a hypervisor gave another guest)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def _own_s(database: bool = False) -> float:
    """CPU seconds of this process and its descendants: alive ones directly, exited ones through
    their parents' children times (a delta of two readings counts each second once). ``database``:
    the PostgreSQL server's processes too (the stack's database: a server the benchmark does not
    start, but whose work is the stack's; a backend that exits between readings is lost)."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    if database:
        procs += [p for p in psutil.process_iter(["name"]) if p.info["name"] in ("postgres", "postmaster")]
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # exited between the listing and the reading
            pass
    return total


class OtherWork:
    """How many cores other work held while something of ours ran: the machine's busy CPU seconds
    minus those of this process and its descendants (the stack's processes, a bound's pool) and,
    with ``database``, of the PostgreSQL server, over the wall time, between :meth:`start` and
    :meth:`stop`."""

    def __init__(self, database: bool = False) -> None:
        self.database = database

    def start(self) -> OtherWork:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_s(), _own_s(self.database)
        return self

    def stop(self) -> float:
        """Cores of other work (0 on an otherwise idle machine; at most the core count)."""
        wall = max(1e-9, time.perf_counter() - self.t0)
        return round(max(0.0, (_busy_s() - self.busy0) - (_own_s(self.database) - self.own0)) / wall, 3)


def _load_text(r: dict) -> str:
    return _load_of(r) + ("" if r["quiet"] else " WARNING: this figure is not reliable")


def measured(fn, *args) -> dict:
    """``fn(*args)`` (a dict) with the load average before and after it (:func:`load_now`) added as
    ``load_before``/``load_after``, the cores other work held meanwhile (``other_cores``,
    :class:`OtherWork`), and ``quiet`` (at most :data:`QUIET_OTHER_CORES` of them)."""
    before, other = load_now(), OtherWork().start()
    out = fn(*args)
    cores = other.stop()
    return {**out, "load_before": before, "load_after": load_now(), **_quiet(cores)}


def store_upsert_rate(points: int = 4096, dim: int = 512, slice_: int = 32) -> dict:
    """Points/s of the embedded store alone (edge, a scratch folder) upserting ``points`` points with
    payloads shaped as the service writes them (one owner, one job, one item), ``slice_`` points a
    call as the vectors worker writes a chunk (``VECTORS_WRITE_SLICE``): the rate the writer is
    compared with, in the same run."""
    import tempfile
    import uuid

    from workers.vector_store import Point, open_store

    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(points, dim)).astype(np.float32)
    job = str(uuid.uuid4())
    pts = [Point(uuid.uuid4(), vectors[i], {"sha256": f"{i:064x}", "owner_ids": [1], "job_ids": [job],
                                            "items": [{"image": str(uuid.uuid4()), "owner": 1, "job": job, "m": {}}]})
           for i in range(points)]
    with tempfile.TemporaryDirectory() as folder:
        store = open_store("edge", collection="bench", dim=dim, path=folder, indexed_fields={})
        store.ensure_collection()
        store.upsert(pts[:slice_])  # warm
        t0 = time.perf_counter()
        for i in range(0, points, slice_):
            store.upsert(pts[i : i + slice_])
        seconds = time.perf_counter() - t0
        store.close()
    return {"points": points, "slice": slice_, "seconds": round(seconds, 3), "points_per_s": round(points / seconds, 1)}


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
    """CPU % (100 = one core) of each of the stack's processes (children included) between ``start``
    and ``stop``; with ``database`` also the PostgreSQL server's processes (``postgres``), and the
    whole machine's busy time (``machine``, ``/proc/stat``): what every part of a phase cost the cores."""

    def __init__(self, stack: Stack, database: bool = False) -> None:
        self.stack, self.database = stack, database

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
        if self.database:
            out["postgres"] = 0.0
            for p in psutil.process_iter(["name"]):
                if p.info["name"] in ("postgres", "postmaster"):
                    try:
                        out["postgres"] += sum(p.cpu_times()[:2])
                    except psutil.Error:  # a backend that exits between readings is lost
                        pass
        out["machine"] = _busy_s()
        return out

    def start(self) -> None:
        self.t0, self.c0 = time.perf_counter(), self._times()

    def stop(self) -> dict[str, float]:
        self.wall_s = wall = time.perf_counter() - self.t0
        c1 = self._times()
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


def run_job(client: Client, stack: Stack, folder: Path, database_url: str = "") -> tuple[dict, dict]:
    """Ingest ``folder`` as a bulk job and wait for it: ``(its rate with the load average before and
    after and its chunks' stage times, each process's CPU %)``."""
    cpu = CpuSampler(stack, database=bool(database_url))
    before, other = load_now(), OtherWork(database=bool(database_url)).start()
    cpu.start()
    job_id = ingest(stack, folder)
    job = wait_job(client, job_id)
    rate = {**_job_rate(job), "load_before": before, "load_after": load_now(), **_quiet(other.stop())}
    rate["stages_ms"] = chunk_stages(database_url, stack, job_id)
    return rate, cpu.stop()


#: ``BatchStat`` columns of a bulk chunk's stages (ms), as ``embed_chunk`` records them.
STAGES = ("load_ms", "decode_ms", "decode_wait_ms", "preprocess_ms", "embed_ms", "total_ms")


def chunk_stages(database_url: str, stack: Stack, job_id: str) -> dict:
    """Median stage times (ms) of job ``job_id``'s chunks (its ``BatchStat`` rows, read straight from
    the stack's database) with their median image count: where a chunk's wall time goes."""
    import uuid

    cols = ", ".join(("images", *STAGES))
    if database_url:
        import psycopg

        with psycopg.connect(database_url) as con:
            rows = con.execute(f"SELECT {cols} FROM embeddings_batchstat WHERE job_id = %s",
                               (uuid.UUID(job_id),)).fetchall()
    else:
        import sqlite3

        with sqlite3.connect(f"file:{stack.var_dir / 'db.sqlite3'}?mode=ro", uri=True, timeout=30) as con:
            rows = con.execute(f"SELECT {cols} FROM embeddings_batchstat WHERE job_id = ?",
                               (uuid.UUID(job_id).hex,)).fetchall()
    if not rows:
        return {}
    a = np.asarray(rows, dtype=np.float64)
    return {"chunks": len(rows), **{name: round(float(np.median(a[:, i])), 1) for i, name in enumerate(("images", *STAGES))}}


def main(argv=None) -> int:
    args = parse_args(argv)
    out, hardware = begin(args.out)
    res: dict = {"machine": hardware, "config": vars(args)}

    originals = distinct_photos(args.originals)
    res["decode_bound"] = measured(decode_bound, [d for _, d in originals], args.processes or os.cpu_count())
    print(f"decode bound, {len(originals)} originals: {res['decode_bound']['images_per_s']} images/s; "
          f"{_load_text(res['decode_bound'])}", flush=True)
    res["preview_bound"] = measured(preview_bound, [d for _, d in originals], 4096, args.processes or os.cpu_count())
    print(f"preview bound: {res['preview_bound']['images_per_s']} images/s "
          f"(mean preview {res['preview_bound']['mean_kb']} KB); "
          f"{_load_text(res['preview_bound'])}", flush=True)
    res["store_upsert"] = measured(store_upsert_rate)
    print(f"embedded store alone: {res['store_upsert']['points_per_s']:,.0f} points/s upserted; "
          f"{_load_text(res['store_upsert'])}", flush=True)

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
        res["first_originals"], res["first_originals_cpu"] = run_job(client, stack, images / "originals", database_url)
        res["first_originals"]["sql"] = sql_per_task(sql_dir, t)
        print(f"first embedding, originals: {res['first_originals']}", flush=True)
        t = time.time()
        res["first_catalogue"], res["first_catalogue_cpu"] = run_job(client, stack, images / "catalogue", database_url)
        res["first_catalogue"]["sql"] = sql_per_task(sql_dir, t)
        print(f"first embedding, catalogue: {res['first_catalogue']}", flush=True)

        cpu = CpuSampler(stack, database=bool(database_url))
        r0, t = redis_commands(stack.env["REDIS_URL"]), time.time()
        before, other = load_now(), OtherWork(database=bool(database_url)).start()
        cpu.start()
        model, _, _ = target.split(":")
        r = client.s.post(client.base + "/api/migrations/", json={"model": model, "pretrained": "random"}, timeout=60)
        if r.status_code not in (201, 202):
            raise SystemExit(f"migration refused: {r.status_code} {r.text}")
        space = r.json()
        job_id = space["job"] if isinstance(space.get("job"), str) else space["job"]["id"]
        job = wait_job(client, job_id)
        res["reembed_cpu"] = cpu.stop()
        res["reembed_cpu_wall_s"] = round(cpu.wall_s, 3)
        res["reembed"] = {**_job_rate(job), "load_before": before, "load_after": load_now(), **_quiet(other.stop())}
        res["reembed"]["redis_commands_per_image"] = round(
            (redis_commands(stack.env["REDIS_URL"]) - r0) / max(1, job.get("embedded") or 1), 3)
        res["reembed"]["sql"] = sql_per_task(sql_dir, t)
        res["reembed"]["previews"] = space_previews(stack)
        res["reembed"]["stages_ms"] = chunk_stages(database_url, stack, job_id)
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


def writer_rate(phase: dict) -> float | None:
    """Points/s of the vectors worker while busy in one phase: the points of its ``index_chunk``
    tasks over their summed wall time (None when it ran none)."""
    ix = phase.get("sql", {}).get("index_chunk")
    return ix["images_total"] / ix["wall_s_total"] if ix and ix["wall_s_total"] else None


def _quiet(other_cores: float) -> dict:
    return {"other_cores": other_cores, "quiet": other_cores <= QUIET_OTHER_CORES}


def _load_of(r: dict) -> str:
    shared = "" if r["quiet"] else f" (above {QUIET_OTHER_CORES}: other work shared the cores)"
    return (f"other work {r['other_cores']} cores{shared}, "
            f"load average {r['load_before']['load_1m']} -> {r['load_after']['load_1m']}")


def _bound_note(b: dict) -> str:
    return (f"bound measured with {_load_of(b)}" + ("" if b["quiet"] else
            f"; WARNING: other work held more than {QUIET_OTHER_CORES} cores, the bound is unreliable (reads low), "
            f"so this is no PASS whatever the ratio"))


def targets(res: dict) -> list[dict]:
    bound = res["decode_bound"]["images_per_s"]
    first = res["first_originals"]["images_per_s"] or 0.0
    re = res["reembed"]["images_per_s"] or 0.0
    pb = res["preview_bound"]["images_per_s"]
    store = res["store_upsert"]["points_per_s"]
    out = [
        {"name": f"re-embedding from previews >= {TARGET_REEMBED_PER_S:,.0f} images/s", "pass": re >= TARGET_REEMBED_PER_S,
         "detail": f"{re:,.0f} images/s ({res['reembed']['embedded']} of {res['reembed']['total']}), {_load_of(res['reembed'])}"},
        {"name": f"re-embedding from previews >= {TARGET_REEMBED_RATIO} x the previews' read + preprocess bound",
         # a bound measured on shared cores reads low: no PASS on it (the issue asks for quiet cores)
         "pass": bool(pb) and re >= TARGET_REEMBED_RATIO * pb and res["preview_bound"]["quiet"],
         "detail": f"{re:,.0f} vs {pb:,.0f} images/s: {re / pb if pb else 0:.2f} x; {_bound_note(res['preview_bound'])}"},
        {"name": f"first embedding of the originals >= {TARGET_FIRST_RATIO} x their decode + preprocess bound",
         "pass": first >= TARGET_FIRST_RATIO * bound and res["decode_bound"]["quiet"],
         "detail": f"{first:,.1f} vs {bound:,.1f} images/s: {first / bound if bound else 0:.2f} x, "
                   f"{_load_of(res['first_originals'])}; {_bound_note(res['decode_bound'])}"},
    ]
    for key, label in (("reembed", "re-embed"), ("first_catalogue", "first embedding")):
        rate = writer_rate(res[key])
        out.append({"name": f"vectors writer >= {TARGET_WRITER_POINTS_PER_S:,.0f} points/s while busy ({label})",
                    "pass": rate is not None and rate >= TARGET_WRITER_POINTS_PER_S,
                    "detail": f"{rate or 0:,.0f} points/s, SQL statements per chunk "
                              f"{res[key].get('sql', {}).get('index_chunk', {}).get('statements_max', '-')} (max); "
                              f"the embedded store alone {store:,.0f} points/s in this run; {_load_of(res[key])}"})
    return out


def table(res: dict) -> str:
    lines = [machine_line(res["machine"]) + f"; {os.cpu_count()} cores seen", "",
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
    lines += ["", "| phase | vectors writer points/s while busy | the embedded store alone, points/s (same run) | other work, load average |",
              "| --- | --- | --- | --- |"]
    for key in ("first_originals", "first_catalogue", "reembed"):
        rate = writer_rate(res[key])
        lines.append(f"| {key} | {f'{rate:,.0f}' if rate else '-'} | {res['store_upsert']['points_per_s']:,.0f} | "
                     f"{_load_of(res[key])} |")
    lines += ["", "| phase | chunks | images per chunk | load ms | decode ms | decode wait ms | preprocess ms | "
              "embed ms | total ms (median per chunk) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in ("first_originals", "first_catalogue", "reembed"):
        st = res[key].get("stages_ms") or {}
        if st:
            lines.append(f"| {key} | {st['chunks']} | {st['images']:.0f} | " + " | ".join(
                f"{st[name]:,.1f}" for name in STAGES) + " |")
    lines += ["", core_seconds(res), "",
              f"Redis commands per re-embedded image (every client): {res['reembed']['redis_commands_per_image']}",
              f"Preview reads: {res['reembed'].get('previews')}", ""]
    for t in res["targets"]:
        lines.append(f"- {'PASS' if t['pass'] else 'FAIL'}: {t['name']}: {t['detail']}")
    return "\n".join(lines)


def core_seconds(res: dict) -> str:
    """Where the re-embed's core-seconds went (its CPU % by process over its elapsed time) against
    what the previews' read + preprocess bound spends on as many images: the ratio target needs
    everything else (SQL, the vectors writer, the fill, the server) to fit in what is left."""
    r, cpu = res["reembed"], res.get("reembed_cpu", {})
    elapsed, images = res.get("reembed_cpu_wall_s") or r.get("elapsed_s") or 0.0, r.get("embedded") or 0
    pb = res["preview_bound"]
    if not elapsed or not images or not pb.get("images_per_s"):
        return "Core-seconds of the re-embed: not measured."
    bound = images / pb["images_per_s"] * pb["processes"]
    parts = ", ".join(f"{k} {v * elapsed / 100:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])
                      if k != "machine" and v * elapsed / 100 >= 0.05)
    return (f"Core-seconds of the re-embed ({images} images, {elapsed} s from the migration's request to its "
            f"job's end, {pb['processes']} cores): machine "
            f"{cpu.get('machine', 0) * elapsed / 100:.1f} ({parts}); the bound's read + preprocess of as many "
            f"previews: {bound:.1f}")


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
