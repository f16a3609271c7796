"""The whole write path without a model: precomputed vectors → Redis → vectors worker → store → marks.

A private Redis and one real vectors worker (``scripts/stack.py``, embedded store: edge by default)
are started; ``N`` queued bulk images are created in the database and their precomputed random unit
vectors are sent as ``index_chunk`` messages of 64 items, exactly what the bulk workers send after
embedding. The clock runs from the first message sent to the last image marked embedded. Round trips
per point: Redis (commands the Redis server processed during the run, every client included: the
worker's polling too), SQL (statements one 64-point chunk costs, counted in-process with Django's
``CaptureQueriesContext`` on the same ``vectors.chunk_index``), and store calls (same chunk).

Usage::

    python -m benchmarks.sink                  # N = 20,000 into the edge store
    python -m benchmarks.sink --points 2000 --store local

Results: JSON and markdown in ``var/bench-sink/`` (``--out``); docs/benchmarks.md has a run.
``seed_and_send`` is also what tests/e2e/test_store_durability.py uses to feed the worker.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks._common import ROOT, markdown_table, pyplot, write_json

CHUNK = 64
#: Points written (and not measured) before a run, so that it measures a warm worker.
WARM_UP = 10 * CHUNK


def unit_vector(i: int, dim: int) -> np.ndarray:
    """The precomputed vector of image number ``i``: random unit ``(dim,) float32``, seeded by ``i``."""
    v = np.random.default_rng(i).normal(size=dim).astype(np.float32)
    return v / np.linalg.norm(v)


def seed_and_send(n: int, *, owners: int = 10, send: bool = True, first: int = 0) -> dict:
    """In a Django process with the stack's settings: create a running job of ``n`` queued bulk
    images (``owners`` users, distinct sha256s) and, with ``send``, queue their vectors as
    ``index_chunk`` messages of :data:`CHUNK` items. Image number ``i`` gets ``unit_vector(first + i)``
    and point id ``uuid5(model id, sha256)`` as the service derives it.

    Returns:
        ``{"job_id", "collection", "dim", "chunks": [[items...], ...], "sent_at"}``.
    """
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from embeddings.messages import encode_vector
    from embeddings.models import Image, ImageStatus, Job, JobStatus, Lane
    from workers.ids import point_id
    from workers.model_config import embed_dim

    cfg = settings.PIPELINE
    model_id, dim = cfg.model_id, embed_dim(cfg.model_name)
    users = [get_user_model().objects.get_or_create(username=f"sink{o}")[0] for o in range(owners)]
    job = Job.objects.create(owner=users[0], name="sink", status=JobStatus.RUNNING, model_id=model_id, total=n,
                             chunk_size=CHUNK)
    rows = []
    for i in range(n):
        sha = f"{first + i:064x}"
        rows.append(Image(owner=users[i % owners], job=job, lane=Lane.BULK, status=ImageStatus.QUEUED, sha256=sha,
                          size_bytes=0, storage_key=f"sink/{sha}", model_id=model_id,
                          point_id=point_id(sha, model_id)))
    Image.objects.bulk_create(rows, batch_size=1000)
    items = [{"id": str(im.id), "point_id": str(im.point_id), "sha256": im.sha256, "width": 224, "height": 224,
              "format": "JPEG", "vector": encode_vector(unit_vector(first + i, dim))} for i, im in enumerate(rows)]
    chunks = [items[i : i + CHUNK] for i in range(0, n, CHUNK)]
    sent_at = time.time()
    if send:
        send_chunks(str(job.id), chunks)
    return {"job_id": str(job.id), "collection": cfg.collection_name, "dim": dim, "chunks": chunks, "sent_at": sent_at}


def send_chunks(job_id: str, chunks: list[list[dict]]) -> None:
    """Queue each chunk as an ``index_chunk`` message (what ``bulk.chunk_embed`` sends)."""
    from embeddings import tasks

    for items in chunks:
        tasks.index_chunk.apply_async(args=(job_id, None, items), kwargs={"priority": "background"},
                                      **tasks.vectors_options(interactive=False, priority="background"))


def round_trips_per_point() -> dict:
    """SQL statements and store calls per point of one 64-point ``vectors.chunk_index`` (after a
    first one that warms imports and caches), in this (Django) process, on a scratch store folder
    (``QDRANT_PATH`` must point at one); with the chunk's wall time and its SQL and store parts (ms)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from embeddings import runtime
    from embeddings.services.queues import vectors

    out = seed_and_send(2 * CHUNK, send=False, first=10**9)
    store = runtime.vector_store()
    # warm: imports, caches
    vectors.chunk_index(job_id=out["job_id"], stat_id=None, items=out["chunks"][1], priority="background")
    calls = {"n": 0, "s": 0.0}
    for name in ("upsert", "delete", "set_payloads", "search", "vectors", "payloads", "count"):
        real = getattr(store, name)

        def counted(*a, _real=real, **kw):
            calls["n"] += 1
            t0 = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                calls["s"] += time.perf_counter() - t0

        setattr(store, name, counted)
    t0 = time.perf_counter()
    with CaptureQueriesContext(connection) as q:
        vectors.chunk_index(job_id=out["job_id"], stat_id=None, items=out["chunks"][0], priority="background")
    total_ms = (time.perf_counter() - t0) * 1000
    store.close()
    sql_ms = sum(float(x["time"]) for x in q.captured_queries) * 1000
    return {"sql_per_point": len(q.captured_queries) / CHUNK, "store_calls_per_point": calls["n"] / CHUNK,
            "chunk_ms": total_ms, "chunk_store_ms": calls["s"] * 1000, "chunk_sql_ms": sql_ms}


def embedded_count(db: Path, job_id: str) -> int:
    """Images of ``job_id`` marked embedded, read straight from the stack's SQLite file."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
        return con.execute("SELECT COUNT(*) FROM embeddings_image WHERE job_id = ? AND status = 'embedded'",
                           (uuid.UUID(job_id).hex,)).fetchone()[0]


def django_call(stack, code: str, **env) -> dict:
    """Run ``code`` (which prints one JSON line last) in ``manage.py shell`` with the stack's settings."""
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "shell", "-c", code], cwd=ROOT, text=True,
                         capture_output=True, env={**stack.env, **env})
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(points: int, store: str, slice_: int | None) -> dict:
    """One sink run on a fresh stack (private Redis, one vectors worker, scratch SQLite and store).

    Returns:
        ``{"seconds", "points_per_s", "redis_commands_per_point", "redis_commands" (per point, by
        command), "worker_cpu_ms_per_point", "redis_cpu_ms_per_point", "load_average_1m", ...}``
        plus :func:`round_trips_per_point`'s figures (measured in-process on the same settings).
    """
    import redis

    from scripts.stack import Stack

    env = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "VECTOR_STORE": store, "RECONCILE_INTERVAL_S": "0",
           "DATABASE_URL": ""}
    if slice_:
        env["VECTORS_WRITE_SLICE"] = str(slice_)
    with tempfile.TemporaryDirectory() as tmp, Stack(Path(tmp) / "var", env, private_redis=True,
                                                     only=("worker-vectors",), log=lambda *x: None) as stack:
        trips = django_call(stack, "import json; from benchmarks.sink import round_trips_per_point as f; "
                                   "print(json.dumps(f()))", QDRANT_PATH=str(Path(tmp) / "scratch"))
        r = redis.Redis.from_url(stack.env["REDIS_URL"])
        worker = stack.pid("worker-vectors")
        db = stack.var_dir / "db.sqlite3"
        warm = django_call(stack, f"import json; from benchmarks.sink import seed_and_send as f; "
                                  f"print(json.dumps({{'job_id': f({WARM_UP}, first=2 * 10**9)['job_id']}}))")
        while embedded_count(db, warm["job_id"]) < WARM_UP:  # the worker's first chunks load the store
            time.sleep(0.05)
        before, cmds = r.info("stats")["total_commands_processed"], r.info("commandstats")
        cpu = r.info("cpu")
        worker_cpu, load = _cpu_s(worker), os.getloadavg()[0]  # idle while the rows are created
        sent = django_call(stack, f"import json, time; from benchmarks.sink import seed_and_send as f; "
                                  f"o = f({points}); print(json.dumps({{'job_id': o['job_id'], 'sent_at': o['sent_at'], "
                                  f"'send_s': time.time() - o['sent_at']}}))")
        while embedded_count(db, sent["job_id"]) < points:
            time.sleep(0.05)
        seconds = time.time() - sent["sent_at"]
        worker_cpu = _cpu_s(worker) - worker_cpu
        redis_cmds = r.info("stats")["total_commands_processed"] - before
        after, cpu2 = r.info("commandstats"), r.info("cpu")
    by_command = {k.removeprefix("cmdstat_"): (v["calls"] - cmds.get(k, {}).get("calls", 0)) / points
                  for k, v in after.items() if v["calls"] - cmds.get(k, {}).get("calls", 0)}
    redis_cpu = sum(cpu2[k] - cpu[k] for k in ("used_cpu_sys", "used_cpu_user"))
    return {"seconds": seconds, "points_per_s": points / seconds, "send_s": sent["send_s"],
            "redis_commands_per_point": redis_cmds / points, "redis_commands": by_command,
            "worker_cpu_ms_per_point": worker_cpu * 1000 / points, "redis_cpu_ms_per_point": redis_cpu * 1000 / points,
            "load_average_1m": round(load, 2), **trips}


def run_in(checkout: Path, points: int, store: str, slice_: int | None) -> dict:
    """:func:`run_once` in a new process that imports ``checkout``'s code (this file's harness, that
    checkout's services, worker and stack): the same measurement of the code before a change
    (``git worktree add``) as of this one."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    if not (checkout / ".env").exists():  # its settings need a secret key; this checkout's has one
        from django.conf import settings

        env.setdefault("DJANGO_SECRET_KEY", settings.SECRET_KEY)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run-once", "--points", str(points),
                          "--store", store, "--slice", str(slice_ or "")], cwd=checkout, env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--store", default="edge", choices=["edge", "local"])
    ap.add_argument("--slice", default="", help="VECTORS_WRITE_SLICE values to compare, comma-separated "
                                                "(default: the setting's)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each configuration, taking turns")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout (the code before a change) measured in turn with this one")
    ap.add_argument("--run-once", action="store_true", help=argparse.SUPPRESS)  # run_in's child: JSON on stdout
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench-sink")
    ap.add_argument("--docs", action="store_true", help="also write the plot to docs/bench/sink.png")
    a = ap.parse_args(argv)
    if a.run_once:
        print(json.dumps(run_once(a.points, a.store, int(a.slice) if a.slice else None)))
        return
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from django.conf import settings

    from benchmarks._common import machine, machine_line

    slices = [int(x) for x in a.slice.split(",") if x.strip()] or [None]
    configs = ([("before", None)] if a.baseline else []) + [("after" if a.baseline else "this", s) for s in slices]
    a.baseline = a.baseline.resolve() if a.baseline else None
    info = machine()
    print(machine_line(info), flush=True)
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for rep in range(a.repeat):  # configurations take turns, so the machine's load hits them alike
        for code, slice_ in configs:
            r = run_in(a.baseline if code == "before" else ROOT, a.points, a.store, slice_)
            runs[(code, slice_)].append(r)
            print(f"run {rep + 1}/{a.repeat} {code} slice {slice_ or 'default'}: {r['points_per_s']:.0f} points/s "
                  f"(load {r['load_average_1m']})", flush=True)
    rows, results = [], []
    for (code, slice_), rs in runs.items():
        med = lambda key: statistics.median(r[key] for r in rs if r.get(key) is not None) \
            if any(r.get(key) is not None for r in rs) else None  # noqa: E731
        slice_label = slice_ or ("its default" if code == "before" else settings.VECTORS_WRITE_SLICE)
        pps = [r["points_per_s"] for r in rs]
        results.append({"code": code, "slice": slice_label, "runs": rs, "points_per_s_median": med("points_per_s")})
        rows.append([code, a.store, a.points, slice_label, round(med("points_per_s")),
                     f"{round(min(pps))}–{round(max(pps))}", med("redis_commands_per_point"), med("sql_per_point"),
                     med("store_calls_per_point"), med("worker_cpu_ms_per_point"),
                     f"{med('chunk_ms'):.1f} / {med('chunk_sql_ms'):.1f} / {med('chunk_store_ms'):.1f}",
                     "–".join(f"{x:.1f}" for x in sorted({min(r['load_average_1m'] for r in rs),
                                                          max(r['load_average_1m'] for r in rs)}))])
    table = markdown_table(["code", "store", "points", "slice", "points/s (median)", "range", "Redis cmds/point",
                            "SQL/point", "store calls/point", "worker CPU ms/point",
                            "one warm chunk ms: all / SQL / store", "load 1 min"], rows)
    if a.baseline:  # medians of runs taking turns: the machine's load hits both alike
        cpu = [statistics.median(run["worker_cpu_ms_per_point"] for run in r["runs"]) for r in results]
        table += "\n\n" + "\n".join(
            f"after (slice {r['slice']}) / before: points/s {r['points_per_s_median'] / results[0]['points_per_s_median']:.2f}x, "
            f"worker CPU per point {c / cpu[0]:.2f}x" for r, c in zip(results[1:], cpu[1:]))
        table += f" ({a.repeat} runs each, taking turns)"
    print(f"\n{machine_line(info)}\n{table}")
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / f"sink-{a.store}.json", {"machine": info, "store": a.store, "points": a.points,
                                                "results": results})
    (a.out / f"sink-{a.store}.md").write_text(f"{machine_line(info)}\n\n{table}\n")
    plot(results, a.out / "sink.png", title=f"{a.points:,} points, {a.store} store, {info['cpu']}")
    if a.docs:
        plot(results, ROOT / "docs" / "bench" / "sink.png", title=f"{a.points:,} points, {a.store} store, {info['cpu']}")


def plot(results: list[dict], path: Path, *, title: str) -> None:
    """Points/s of every run, one column per configuration, the median marked, the 3,000 target drawn."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for x, r in enumerate(results):
        ys = [run["points_per_s"] for run in r["runs"]]
        ax.plot([x] * len(ys), ys, "o", alpha=0.6)
        ax.plot([x - 0.2, x + 0.2], [r["points_per_s_median"]] * 2, "k-")
    ax.axhline(3000, color="grey", ls="--", label="target 3,000 points/s")
    ax.set_xticks(range(len(results)), [f"{r['code']}\nslice {r['slice']}" for r in results])
    ax.set_ylabel("points/s, Redis → vectors worker → store → marks")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
