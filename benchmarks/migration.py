"""Migration benchmark (issue 13): what re-embedding the catalogue with another model costs the
people using the service meanwhile, on a real stack.

    python -m benchmarks.migration [--images 500] [--seconds 60] [--rate 2] [--model ViT-S-32]
    make bench-migration [BENCH_ARGS="..."]

Starts the whole service with ``scripts.stack.Stack`` (private Redis, embedded Qdrant, the real
ViT-B-32 architecture with seeded random weights, and ``CLIP_MODELS`` naming the target model, so
the workers may load it) and measures, in this order:

1. a catalogue of ``--images`` distinct pictures (the real photos of ../shared/data/images/photos,
   then seeded crops and mirror images of them: :func:`picture`) ingested as a bulk job into the
   active space;
2. interactive load alone for ``--seconds``: open loop at ``--rate`` requests per second, uploads of
   one new image (``POST /api/images/``, k=5) and text searches (``POST /api/search/``) taking turns;
3. the same load while a migration (``POST /api/migrations/``) re-embeds the catalogue with
   ``--model`` (seeded random weights) on the bulk lane at background priority, until its job is done
   (new uploads are embedded in both spaces meanwhile);
4. the quality gate the finished migration starts (re-encoded copies must find their original
   first: ``embeddings/services/lifecycle/gate.py``), then ``promote``; promote→visible is the time from the
   promote request until a search answers from the new space (its ``model_id``), searches sent
   back to back.

Reported: interactive p50/p95 of both phases and their ratio (target: p95 with the migration
≤ 1.2 × without), errors (anything but 200), the migration's images/s (its job's throughput), the
gate's rate, promote→visible latency, the CPU line. Writes ``results.json``, ``table.md`` and
``migration-latency.png`` to ``--out`` and, with ``--docs``, the plot to docs/bench/.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ROOT, machine, machine_line, pyplot  # noqa: E402
from benchmarks._common import wait_for, write_folder  # noqa: E402
from benchmarks.lanes import (  # noqa: E402
    Client,
    Sample,
    base_images,
    ingest,
    percentile,
    scratch_database,
    wait_job,
)
from benchmarks.lanes import fmt as lanes_fmt  # noqa: E402
from scripts.stack import Stack  # noqa: E402

#: Words the search half of the load picks from (any text: the scores are not the point here).
QUERIES = ("a dog on a beach", "red car", "mountain lake at dawn", "a bowl of fruit", "city street at night",
           "a cat asleep", "people at a table", "snow on trees")


def picture(bases: list, index: int) -> bytes:
    """Image ``index``: photo ``index % len(bases)`` itself the first time, then a different view of
    it each time round (a crop of 45-85 % of each side at a seeded position, mirrored every other
    time), at most 640 px wide, JPEG quality 90. Views of one photo are related pictures, not
    twins: a catalogue of copies differing in a few pixels (``benchmarks.lanes.distinct_jpeg``)
    would make the probe's copies find their twins and the cutoffs measure twins
    (docs/benchmarks-migration.md, first run)."""
    import cv2

    im = bases[index % len(bases)]
    view = index // len(bases)
    if view:
        rng = np.random.default_rng(index)
        h, w = im.shape[:2]
        ch, cw = int(h * rng.uniform(0.45, 0.85)), int(w * rng.uniform(0.45, 0.85))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        im = im[y : y + ch, x : x + cw]
        if view % 2:
            im = im[:, ::-1]
    if im.shape[1] > 640:
        im = cv2.resize(im, (640, max(1, round(im.shape[0] * 640 / im.shape[1]))), interpolation=cv2.INTER_AREA)
    ok, data = cv2.imencode(".jpg", np.ascontiguousarray(im), [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return data.tobytes()


class LoadClient(Client):
    """:class:`benchmarks.lanes.Client` plus text searches (``min_score=0``: every search returns
    its top-k, so the cost measured is the same before and after a calibration)."""

    def search(self, text: str) -> tuple[Sample, dict]:
        sent = time.time()
        t0 = time.perf_counter()
        r = self.s.post(self.base + "/api/search/", json={"text": text, "k": 5, "min_score": 0}, timeout=120)
        ms = (time.perf_counter() - t0) * 1000
        body = r.json()
        status = "ok" if r.status_code == 200 else body.get("code", "?")
        return Sample(sent=sent, latency_ms=ms, http=r.status_code, status=status), body


def mixed_load(client: LoadClient, images, rate: float, *, seconds: float | None = None, until=None) -> list[dict]:
    """Open loop at ``rate`` requests/s, an upload of the next of ``images`` and a text search taking
    turns, for ``seconds`` or until ``until()``; each request on its own thread.

    Returns:
        ``[{"kind": "upload"|"search", "sent", "latency_ms", "http", "status"}]`` in sending order.
    """
    futures = []
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        for i in range(10**9):
            now = time.perf_counter()
            if (seconds is not None and now - t0 >= seconds) or (until is not None and until()):
                break
            delay = t0 + i / rate - now
            if delay > 0:
                time.sleep(delay)
            if i % 2 == 0:
                name, data = next(images)
                futures.append(("upload", pool.submit(client.upload, data, name)))
            else:
                futures.append(("search", pool.submit(lambda q=QUERIES[i // 2 % len(QUERIES)]: client.search(q)[0])))
        out = []
        for kind, f in futures:
            try:
                s = f.result()
                out.append({"kind": kind, "sent": s.sent, "latency_ms": s.latency_ms, "http": s.http, "status": s.status})
            except Exception as e:  # noqa: BLE001 - a connection error is an error to report, not a crash
                out.append({"kind": kind, "sent": None, "latency_ms": None, "http": 0, "status": type(e).__name__})
    return out


def summary(samples: list[dict]) -> dict:
    """p50/p95/p99 (ms) of the answered (200) requests, per kind and together; outcomes; errors."""
    def pct(rows):
        ok = [r["latency_ms"] for r in rows if r["http"] == 200]
        return {"n": len(rows), "ok": len(ok), "p50_ms": percentile(ok, 50), "p95_ms": percentile(ok, 95),
                "p99_ms": percentile(ok, 99)}

    outcomes: dict[str, int] = {}
    for r in samples:
        key = f"{r['kind']} {r['http']} {r['status']}"
        outcomes[key] = outcomes.get(key, 0) + 1
    return {"all": pct(samples), "upload": pct([r for r in samples if r["kind"] == "upload"]),
            "search": pct([r for r in samples if r["kind"] == "search"]), "outcomes": outcomes,
            # errors: 5xx, a lost connection, a 4xx other than admission's 429; 429 (refused at once
            # because the predicted wait passes the deadline) and 202 (answered late) are counted apart
            "errors": sum(1 for r in samples if r["http"] not in (200, 202, 429)),
            "refused_429": sum(1 for r in samples if r["http"] == 429),
            "late_202": sum(1 for r in samples if r["http"] == 202)}


def fmt(v, spec=".0f") -> str:
    """``benchmarks.lanes.fmt`` with whole milliseconds by default."""
    return lanes_fmt(v, spec)


def table(res: dict) -> str:
    a, b = res["load_alone"], res["load_migrating"]
    c = res["config"]
    lines = [
        f"catalogue {c['images']} images in {c['active_model']}, migration to {c['target_model']}; load: "
        f"{c['rate']}/s open loop (uploads and text searches taking turns), {c['seconds']} s alone; "
        f"{c['database']}, {c['cores']} cores, bulk processes {c['bulk_processes']}",
        "",
        "| phase | requests | errors | 429 / 202 | p50 ms | p95 ms | p99 ms | upload p95 ms | search p95 ms | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, s, wall in (("interactive load alone", a, res["wall_alone_s"]),
                           ("same load, migration running", b, res["wall_migrating_s"])):
        lines.append(f"| {label} | {s['all']['n']} | {s['errors']} | {s['refused_429']} / {s['late_202']} | "
                     f"{fmt(s['all']['p50_ms'])} | "
                     f"{fmt(s['all']['p95_ms'])} | {fmt(s['all']['p99_ms'])} | {fmt(s['upload']['p95_ms'])} | "
                     f"{fmt(s['search']['p95_ms'])} | {fmt(wall, '.1f')} |")
    m, g = res["migration"], res["gate"]
    lines += [
        "",
        "| migration | value |",
        "| --- | --- |",
        f"| p95 ratio (migrating / alone) | {fmt(res['p95_ratio'], '.2f')} (target ≤ 1.20) |",
        f"| images re-embedded | {m['embedded']} of {m['total']} ({m['failed']} failed) |",
        f"| migration throughput | {fmt(m['throughput'], '.2f')} images/s over {fmt(m['elapsed_s'], '.1f')} s |",
        f"| quality gate | {g.get('hits')}/{g.get('judged')} judged copies found their original first (rate "
        f"{fmt(g.get('rate'), '.3f')}, threshold {g.get('threshold')}); {g.get('twins')} of {g.get('sample')} "
        f"found a twin first (judged so by {g.get('reference')}); raw {g.get('raw_hits')}/{g.get('sample')}; "
        f"{fmt(g.get('duration_s'), '.1f')} s |",
        f"| cutoffs of the new space | image {fmt(res['cutoffs']['image'], '.4f')}, text "
        f"{fmt(res['cutoffs']['text'], '.4f')} ({res['cutoffs']['pairs']}) |",
        f"| promote request sent → a search answers from the new space | {fmt(res['promote_visible_ms'], '.0f')} ms "
        f"({res['promote_searches']} searches{', promote forced past the gate' if res['promote_forced'] else ''}) |",
        "",
        f"outcomes alone: {a['outcomes']}",
        f"outcomes migrating: {b['outcomes']}",
        "",
    ]
    for t in res["targets"]:
        lines.append(f"- {'PASS' if t['pass'] else 'FAIL'}: {t['name']}: {t['detail']}")
    return "\n".join(lines)


def plot(res: dict, alone: list[dict], migrating: list[dict], t_migration: tuple[float, float], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in (("alone", alone), ("migration running", migrating)):
        lat = np.sort([r["latency_ms"] for r in rows if r["http"] == 200])
        if len(lat):
            ax1.plot(lat, np.arange(1, len(lat) + 1) / len(lat),
                     label=f"{label}: p50 {np.percentile(lat, 50):.0f}, p95 {np.percentile(lat, 95):.0f} ms")
    ax1.set_xlabel("interactive latency, uploads and text searches (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("interactive latency (CDF)")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    t0 = min(r["sent"] for r in alone + migrating if r["sent"] is not None)
    for kind, marker in (("upload", "o"), ("search", "x")):
        rows = [r for r in alone + migrating if r["kind"] == kind and r["http"] == 200]
        ax2.scatter([r["sent"] - t0 for r in rows], [r["latency_ms"] for r in rows], s=10, marker=marker, label=kind)
    ax2.axvspan(t_migration[0] - t0, t_migration[1] - t0, color="tab:orange", alpha=0.12, label="migration job")
    ax2.set_xlabel("time since the load began (s)")
    ax2.set_ylabel("latency (ms)")
    ax2.set_title("every request over time")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right")
    fig.suptitle(f"migration {res['config']['active_model']} → {res['config']['target_model']}: p95 ratio "
                 f"{fmt(res['p95_ratio'], '.2f')}, {fmt(res['migration']['throughput'], '.1f')} images/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(res: dict) -> list[dict]:
    """The issue's targets, each ``{"name", "pass", "detail"}``."""
    out = []
    p_a, p_b = res["load_alone"]["all"]["p95_ms"], res["load_migrating"]["all"]["p95_ms"]
    ratio = res["p95_ratio"]
    out.append({"name": "interactive p95 with the migration <= 1.2 x without", "pass": ratio is not None and ratio <= 1.2,
                "detail": f"{fmt(p_b)} ms vs {fmt(p_a)} ms: {fmt(ratio, '.2f')} x"})
    errors = res["load_alone"]["errors"] + res["load_migrating"]["errors"]
    refused = res["load_alone"]["refused_429"] + res["load_migrating"]["refused_429"]
    out.append({"name": "zero errors (5xx, lost connections, 4xx but 429)", "pass": errors == 0,
                "detail": f"{errors} errors; {refused} refused with 429 (alone "
                          f"{res['load_alone']['refused_429']}, migrating {res['load_migrating']['refused_429']})"})
    m = res["migration"]
    out.append({"name": "every image re-embedded", "pass": m["embedded"] == m["total"] and not m["failed"],
                "detail": f"{m['embedded']}/{m['total']}, {m['failed']} failed"})
    g = res["gate"]
    out.append({"name": "the quality gate passes", "pass": bool(g.get("passed")),
                "detail": f"rate {g.get('rate')} (threshold {g.get('threshold')})"})
    v = res["promote_visible_ms"]
    out.append({"name": "promote visible within 1 s", "pass": v is not None and v <= 1000, "detail": f"{fmt(v)} ms"})
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.migration", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Results: docs/benchmarks-migration.md.")
    ap.add_argument("--images", type=int, default=500, help="catalogue size (default 500)")
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the load-alone phase (default 60 s)")
    ap.add_argument("--rate", type=float, default=2.0, help="interactive requests per second (default 2)")
    ap.add_argument("--model", default="ViT-S-32", help="the migration's target architecture (seeded random weights)")
    ap.add_argument("--bulk-processes", default="",
                    help="BULK_PROCESSES: prefork children of the bulk worker (default: the project's)")
    ap.add_argument("--postgres", metavar="URL", nargs="?", const="postgres://postgres@127.0.0.1:5432/postgres",
                    default="", help="run on PostgreSQL (a scratch database on this server) instead of SQLite")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench-migration"), help="output folder")
    ap.add_argument("--docs", action="store_true", help="also copy the plot to docs/bench/migration-latency.png")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    bases = base_images()
    shutil.rmtree(out / "images", ignore_errors=True)
    catalogue = write_folder(out / "images" / "catalogue", ((f"img{i:06d}.jpg", picture(bases, i))
                                                             for i in range(args.images)))
    next_id = iter(range(args.images, 10**9))

    def uploads():
        while True:
            i = next(next_id)
            yield f"u{i}.jpg", picture(bases, i)

    stack_dir = out / "stack"
    shutil.rmtree(stack_dir, ignore_errors=True)
    target = f"{args.model}:random:fp32"
    env = {"CLIP_PRETRAINED": "random", "CLIP_PRECISION": "fp32", "CLIP_MODELS": target, "DJANGO_DEBUG": "0"}
    if args.bulk_processes:
        env["BULK_PROCESSES"] = args.bulk_processes
    hardware = machine()
    load_before = res_load()
    print(machine_line(hardware) + f"; load average {load_before}", flush=True)
    database = scratch_database(args.postgres) if args.postgres else contextlib.nullcontext("")
    with database as database_url, Stack(stack_dir, {**env, "DATABASE_URL": database_url}, private_redis=True,
                                         log=lambda *a: None) as stack:
        client = LoadClient(stack.web_url, stack.manage("apiuser", "bench", "--staff").strip())
        s = client.s
        print(f"(1) catalogue: {args.images} images ...", flush=True)
        t = time.time()
        job = wait_job(client, ingest(stack, catalogue))
        print(f"    {job['embedded']} embedded in {time.time() - t:.0f} s", flush=True)
        # The reconciler calibrates the grown catalogue's cutoffs (text tower on the bulk lane): wait
        # for it, so it does not fall into the measured "alone" phase (it did in an earlier run).
        print("    waiting for the catalogue's calibration (background work, not measured) ...", flush=True)
        active = wait_for(lambda: s.get(stack.web_url + "/api/migrations/", timeout=60).json()[0],
                          lambda sp: (sp.get("calibration") or {}).get("at"), timeout=600, every=2)
        for _ in range(3):  # warm-up: models loaded, connections open; not measured
            client.upload(*reversed(next(uploads())))
            client.search("warm up")

        print(f"(2) interactive load alone: {args.seconds:.0f} s at {args.rate}/s ...", flush=True)
        t0 = time.time()
        stream = uploads()
        alone = mixed_load(client, stream, args.rate, seconds=args.seconds)
        wall_alone = time.time() - t0

        print(f"(3) the same load while migrating to {args.model} ...", flush=True)
        r = s.post(stack.web_url + "/api/migrations/", json={"model": args.model, "pretrained": "random",
                                                              "precision": "fp32", "seed": 0}, timeout=120)
        assert r.status_code == 202, r.text
        migration = r.json()
        url = stack.web_url + migration["url"]
        done = threading.Event()
        got: dict = {}

        def watch():
            try:
                got["space"] = wait_for(lambda: s.get(url, timeout=60).json(),
                                        lambda m: m["job"] and m["job"]["status"] in ("done", "cancelled"),
                                        timeout=7200)
            finally:
                done.set()

        t1 = time.time()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        migrating = mixed_load(client, stream, args.rate, until=done.is_set)
        watcher.join()
        t2 = time.time()
        job = got["space"]["job"]
        print(f"    migration job {job['status']}: {job['embedded']}/{job['total']} in {t2 - t1:.0f} s", flush=True)

        print("(4) quality gate, then promote ...", flush=True)
        space = wait_for(lambda: s.get(url, timeout=60).json(),
                         lambda m: (m["gate_report"] or {}).get("state") in ("done", "error")
                         and (m["calibration"] or {}).get("at"), timeout=1800)
        t_promote = time.time()
        p = s.post(url + "promote/", json={"force": False}, timeout=60)
        forced = False
        if p.status_code == 409 and p.json().get("code") in ("gate_failed", "gate_missing"):
            print(f"    promote refused ({p.json()['code']}): forced, to measure promote -> visible", flush=True)
            t_promote, forced = time.time(), True
            p = s.post(url + "promote/", json={"force": True}, timeout=60)
        visible_ms, searches = None, 0
        if p.status_code == 200:
            while time.time() - t_promote < 30:
                sample, body = client.search("promoted?")
                searches += 1
                if sample.http == 200 and body.get("model_id") == space["model_id"]:
                    visible_ms = (time.time() - t_promote) * 1000
                    break
        else:
            print(f"    promote refused: {p.status_code} {p.text[:300]}", flush=True)

    cal = space.get("calibration") or {}
    res = {
        "machine": hardware,
        "config": {"images": args.images, "seconds": args.seconds, "rate": args.rate, "cores": os.cpu_count(),
                   "bulk_processes": args.bulk_processes or "default",
                   "active_model": active["model_id"], "target_model": space["model_id"],
                   "database": "postgresql" if args.postgres else "sqlite"},
        "load_alone": summary(alone), "load_migrating": summary(migrating),
        "wall_alone_s": wall_alone, "wall_migrating_s": t2 - t1,
        "migration": {"embedded": job["embedded"], "failed": job["failed"], "total": job["total"],
                      "throughput": job.get("throughput_images_per_s"), "elapsed_s": job.get("elapsed_s")},
        "gate": {k: space["gate_report"].get(k) for k in (
            "state", "reference", "sample", "judged", "hits", "rate", "twins", "raw_hits", "raw_rate",
            "threshold", "passed", "duration_s", "failed_count", "failures")},
        "cutoffs": {"image": space.get("cutoff_image"), "text": space.get("cutoff_text"),
                    "pairs": f"{cal.get('image_pairs')} image pairs, {cal.get('text_pairs')} text pairs, "
                             f"{cal.get('points')} points, p{cal.get('percentile')}"},
        "promote_http": p.status_code, "promote_forced": forced, "promote_visible_ms": visible_ms,
        "promote_searches": searches,
    }
    pa, pb = res["load_alone"]["all"]["p95_ms"], res["load_migrating"]["all"]["p95_ms"]
    res["p95_ratio"] = pb / pa if pa and pb else None
    res["targets"] = targets(res)
    res["load_average"] = {"before": load_before, "after": res_load()}
    text = machine_line(hardware) + f"\nload average (1/5/15 min) before: {load_before}, after: {res_load()}\n\n" \
        + table(res)
    print("\n" + text)
    (out / "results.json").write_text(json.dumps({**res, "samples_alone": alone, "samples_migrating": migrating},
                                                 indent=1))
    (out / "table.md").write_text(text + "\n")
    plot(res, alone, migrating, (t1, t2), out / "migration-latency.png")
    if args.docs:
        (ROOT / "docs" / "bench").mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "migration-latency.png", ROOT / "docs" / "bench" / "migration-latency.png")
    print(f"\nwrote {out}/results.json, table.md, migration-latency.png")
    return 0 if all(t["pass"] for t in res["targets"]) else 1


def res_load() -> str:
    """The 1/5/15-minute load averages now (the machine is shared: say how busy it was)."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
