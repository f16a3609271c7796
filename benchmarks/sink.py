"""The whole write path without a model: precomputed vectors → Redis → vectors worker → store → marks.

A private Redis and one real vectors worker (``scripts/stack.py``, embedded store: edge by default)
are started; ``N`` queued bulk images are created in the database and their precomputed random unit
vectors are sent as ``index_chunk`` messages of 64 items, exactly what the bulk workers send after
embedding. The clock runs from the first message sent to the last image marked embedded. Round trips
per point: Redis (commands the Redis server processed during the run, every client included: the
worker's polling too), SQL (statements one 64-point chunk costs, counted in-process with Django's
``CaptureQueriesContext`` on the same ``pipeline.chunk_index``), and store calls (same chunk).

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
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks._common import ROOT, markdown_table, write_json

CHUNK = 64


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

    from embeddings import tasks
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
    """Queue each chunk as an ``index_chunk`` message (what ``pipeline.chunk_embed`` sends)."""
    from embeddings import tasks

    for items in chunks:
        tasks.index_chunk.apply_async(args=(job_id, None, items), kwargs={"priority": "background"},
                                      **tasks.vectors_options(interactive=False, priority="background"))


def round_trips_per_point() -> dict:
    """SQL statements and store calls per point of one 64-point ``pipeline.chunk_index`` (after a
    first one that warms imports and caches), in this (Django) process, on a scratch store folder
    (``QDRANT_PATH`` must point at one); with the chunk's wall time and its SQL and store parts (ms)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from embeddings import runtime
    from embeddings.services import pipeline

    out = seed_and_send(2 * CHUNK, send=False, first=10**9)
    store = runtime.vector_store()
    pipeline.chunk_index(job_id=out["job_id"], stat_id=None, items=out["chunks"][1])  # warm: imports, caches
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
        pipeline.chunk_index(job_id=out["job_id"], stat_id=None, items=out["chunks"][0])
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--store", default="edge", choices=["edge", "local"])
    ap.add_argument("--slice", type=int, default=None, help="VECTORS_WRITE_SLICE (default: the setting's)")
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench-sink")
    a = ap.parse_args(argv)
    import redis

    from benchmarks._common import machine, machine_line
    from scripts.stack import Stack

    env = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "VECTOR_STORE": a.store, "RECONCILE_INTERVAL_S": "0",
           "DATABASE_URL": ""}
    if a.slice:
        env["VECTORS_WRITE_SLICE"] = str(a.slice)
    info = machine()
    with tempfile.TemporaryDirectory() as tmp, Stack(Path(tmp) / "var", env, private_redis=True,
                                                     only=("worker-vectors",), log=lambda *x: None) as stack:
        trips = django_call(stack, "import json; from benchmarks.sink import round_trips_per_point as f; "
                                   "print(json.dumps(f()))", QDRANT_PATH=str(Path(tmp) / "scratch"))
        r = redis.Redis.from_url(stack.env["REDIS_URL"])
        before = r.info("stats")["total_commands_processed"]
        sent = django_call(stack, f"import json; from benchmarks.sink import seed_and_send as f; "
                                  f"o = f({a.points}); print(json.dumps({{'job_id': o['job_id'], 'sent_at': o['sent_at']}}))")
        db = stack.var_dir / "db.sqlite3"
        while (done := embedded_count(db, sent["job_id"])) < a.points:
            time.sleep(0.2)
        seconds = time.time() - sent["sent_at"]
        redis_cmds = r.info("stats")["total_commands_processed"] - before
    result = {"machine": info, "store": a.store, "points": a.points, "seconds": seconds,
              "points_per_s": a.points / seconds, "redis_commands_per_point": redis_cmds / a.points, **trips,
              "slice": a.slice or "default"}
    table = markdown_table(["store", "points", "slice", "seconds", "points/s", "Redis cmds/point", "SQL/point",
                            "store calls/point", "one chunk ms: all / SQL / store"],
                           [[a.store, a.points, result["slice"], seconds, round(result["points_per_s"]),
                             result["redis_commands_per_point"], result["sql_per_point"],
                             result["store_calls_per_point"],
                             f"{trips['chunk_ms']:.0f} / {trips['chunk_sql_ms']:.0f} / {trips['chunk_store_ms']:.0f}"]])
    print(f"{machine_line(info)}\nmachine: {info}\n{table}")
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / f"sink-{a.store}.json", result)
    (a.out / f"sink-{a.store}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
