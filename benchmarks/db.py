"""Database time per chunk against the job's size, on SQLite and PostgreSQL (issue 11, item 4).

For each backend a scratch database is made (a temporary SQLite file; a PostgreSQL database
``clip_bench_<pid>`` created on ``--pg-url`` and dropped afterwards), migrated, and for each job
size ``N`` a job of ``N`` synthetic queued bulk rows is inserted. Then ``--chunks`` chunks of 64
images, taken from evenly spaced positions in the job, run through the real
``queues.bulk.chunk_embed`` and ``queues.vectors.chunk_index``, with everything that is not the database
replaced by something free: the model returns zero vectors at once, the vector store accepts
points and does nothing, messages are captured instead of sent. What remains is every SQL
statement a real chunk makes, at the job's real size.

Reported per backend and size: SQL statements per chunk (embed + index; writes among them; the
index part writes ``VECTORS_WRITE_SLICE`` points per slice, set it in the environment), the database time per
chunk (min, median and p95, ms, wall time of both calls; the sizes take turns chunk by chunk so
a change in the machine's load hits them alike), what the count the old per-chunk
``job_refresh`` made over the job's images costs at that size (ms), and the cost of opening a
connection (what ``CONN_MAX_AGE`` saves each task).

Usage::

    python -m benchmarks.db                          # sizes 1,000 / 10,000 / 100,000, both backends
    python -m benchmarks.db --sizes 1000 10000 --backends sqlite

Results: JSON and markdown in ``var/bench-db/`` (``--out``); docs/scaling.md has a run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks._common import ROOT, markdown_table, write_json

CHUNK = 64


# --- in the child process (Django set up on the scratch database) ---------------------------------

def _free_components() -> None:
    """Replace the model, the vector store and the broker with instant stand-ins (database only)."""
    import numpy as np

    from embeddings import runtime, tasks
    from embeddings import lane_control
    from workers.runner import BatchResult, ImageMeta
    from workers.timing import StageTimings

    class Runner:
        def run(self, keys, loader, on_decoded=None, **_pass_options):  # micro_batch, before_pass: one pass here
            return BatchResult(vectors=np.zeros((len(keys), 512), np.float32),
                               metas=[ImageMeta(k, 64, 64, "jpeg") for k in keys], failed=[], timings=StageTimings())

    class Store:
        collection = "bench"

        def upsert(self, points):
            return None

    sent: list = []
    runtime.batch_runner = lambda model_id=None: Runner()
    runtime.vector_store = lambda model_id=None: Store()
    runtime.blob_store = lambda: None
    runtime.model_id = lambda: "bench/model"
    lane_control.vectors_interactive_waiting = lambda: False
    tasks.embed_chunk.apply_async = lambda *a, **kw: None
    tasks.index_chunk.apply_async = lambda args=(), **kw: sent.append(args)
    _free_components.sent = sent


def _job(n: int, owner):
    """A running job of ``n`` synthetic queued bulk images; returns ``(job, [image ids in order])``."""
    import hashlib

    from embeddings.models import Image, ImageStatus, Job, JobStatus, Lane
    from workers.ids import point_id

    job = Job.objects.create(owner=owner, model_id="bench/model", chunk_size=CHUNK, total=n, status=JobStatus.QUEUED)
    rows = []
    for i in range(n):
        sha = hashlib.sha256(f"{job.id}-{i}".encode()).hexdigest()
        rows.append(Image(owner=owner, job=job, lane=Lane.BULK, status=ImageStatus.QUEUED, sha256=sha, size_bytes=1000,
                          storage_key=f"blob/{sha}", model_id="bench/model", point_id=point_id(sha, "bench/model")))
        if len(rows) == 5000:
            Image.objects.bulk_create(rows)
            rows = []
    Image.objects.bulk_create(rows)
    ids = [str(i) for i in Image.objects.filter(job=job).order_by("created_at", "id").values_list("id", flat=True)]
    return job, ids


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure(sizes: list[int], chunks: int) -> list[dict]:
    """In a Django process on a migrated scratch database: one row per job size (see module doc)."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from embeddings.services.catalogue import jobs as job_services
    from embeddings.services.queues import bulk, vectors

    _free_components()
    sent = _free_components.sent
    owner = get_user_model().objects.create_user(f"bench-{uuid.uuid4().hex[:8]}")
    jobs = {}
    for n in sizes:
        t0 = time.perf_counter()
        job, ids = _job(n, owner)
        # chunks + 1 disjoint chunks (the first one warms up), spread evenly over the job
        count = min(chunks + 1, n // CHUNK)
        jobs[n] = {"job": job, "ids": ids, "insert_s": time.perf_counter() - t0,
                   "starts": [k * (n // count) for k in range(count)], "ms": [], "queries": [], "writes": []}
    # the sizes take turns, chunk by chunk, so the machine's load changes hit every size alike
    for k in range(max(len(j["starts"]) for j in jobs.values())):
        for n, j in jobs.items():
            if k >= len(j["starts"]):
                continue
            sent.clear()
            chunk = j["ids"][j["starts"][k] : j["starts"][k] + CHUNK]
            t0 = time.perf_counter()
            with CaptureQueriesContext(connection) as q:
                bulk.chunk_embed(job_id=str(j["job"].id), image_ids=chunk)
                for args in list(sent):
                    vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
            ms = (time.perf_counter() - t0) * 1000
            if k:
                j["ms"].append(ms)
                j["queries"].append(len(q.captured_queries))
                j["writes"].append(sum(x["sql"].lstrip().upper().startswith(("UPDATE", "INSERT", "DELETE"))
                                       for x in q.captured_queries))

    def reconnect():
        connection.close()
        connection.ensure_connection()

    out = []
    for n, j in jobs.items():
        per_chunk = sorted(j["ms"])
        out.append({
            "job_images": n, "chunks": len(per_chunk), "insert_s": round(j["insert_s"], 2),
            "write_slice": settings.VECTORS_WRITE_SLICE,
            "sql_per_chunk": statistics.median(j["queries"]), "sql_per_chunk_max": max(j["queries"]),
            "sql_writes_per_chunk": statistics.median(j["writes"]),
            "chunk_db_ms_min": round(per_chunk[0], 2),
            "chunk_db_ms_median": round(statistics.median(per_chunk), 2),
            "chunk_db_ms_p95": round(per_chunk[min(len(per_chunk) - 1, int(0.95 * len(per_chunk)))], 2),
            "old_count_per_chunk_ms": round(_median_ms(lambda: job_services.job_counts(j["job"]), 5), 2),
            "connect_ms": round(_median_ms(reconnect, 10), 2),
        })
        print(json.dumps({"progress": out[-1]}), file=sys.stderr, flush=True)
    return out


def child(sizes: list[int], chunks: int) -> None:
    """Entry point of the per-backend process: migrate, measure, print the rows as JSON (last line)."""
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    print(json.dumps(measure(sizes, chunks)))


# --- the parent -------------------------------------------------------------------------------------

def run_backend(backend: str, db_url: str, sizes: list[int], chunks: int, var_dir: Path) -> list[dict]:
    env = {**os.environ, "DATABASE_URL": db_url, "VAR_DIR": str(var_dir), "METRICS_DIR": "",
           "CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "DJANGO_SETTINGS_MODULE": "project.settings",
           "DJANGO_SECRET_KEY": os.environ.get("DJANGO_SECRET_KEY") or "bench-db-" + uuid.uuid4().hex}
    cmd = [sys.executable, "-m", "benchmarks.db", "--child", "--chunks", str(chunks), "--sizes", *map(str, sizes)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return [{"backend": backend, **row} for row in json.loads(p.stdout.strip().splitlines()[-1])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--chunks", type=int, default=20, help="chunks timed per size (one more warms up)")
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    ap.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                    help="a PostgreSQL server where a scratch database may be created and dropped")
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench-db")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.sizes, a.chunks)

    from benchmarks._common import machine, machine_line

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-db-") as tmp:
        for backend in a.backends:
            if backend == "sqlite":
                rows += run_backend("sqlite", f"sqlite:///{tmp}/bench.sqlite3", a.sizes, a.chunks, Path(tmp))
                continue
            import psycopg

            name = f"clip_bench_{os.getpid()}"
            with psycopg.connect(a.pg_url, autocommit=True) as admin:
                admin.execute(f'CREATE DATABASE "{name}"')
            try:
                url = a.pg_url.rsplit("/", 1)[0] + f"/{name}"
                rows += run_backend("postgres", url, a.sizes, a.chunks, Path(tmp))
            finally:
                with psycopg.connect(a.pg_url, autocommit=True) as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    info = machine()
    headers = ["backend", "job images", "SQL / chunk", "of which writes", "DB ms / chunk: min", "median", "p95",
               "old count ms / chunk", "connect ms"]
    table = markdown_table(headers, [[r["backend"], f"{r['job_images']:,}", r["sql_per_chunk"],
                                      r["sql_writes_per_chunk"],
                                      r["chunk_db_ms_min"], r["chunk_db_ms_median"], r["chunk_db_ms_p95"],
                                      r["old_count_per_chunk_ms"],
                                      r["connect_ms"]] for r in rows])
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "db.json", {"machine": info, "chunk": CHUNK, "rows": rows})
    (a.out / "db.md").write_text(f"{machine_line(info)}\n\n{table}\n")
    print(f"{machine_line(info)}\n{table}")


if __name__ == "__main__":
    main()
