"""Vector exports through the real view: MB/s and the web process's memory, by row count and format.

For each row count (``--rows``, default 10,000 and 100,000) a fresh process (its own SQLite database
and embedded edge store under a temporary ``VAR_DIR``) is filled without a model: random unit
vectors written straight into the active space's collection, the image rows bulk-created. It then
streams ``GET /api/exports/vectors.{parquet,jsonl,npz}`` through the real URL, view and service
(Django's test client, eager Celery: the ``point_vectors`` store task runs in the same process,
one call per page of 1,000 rows) and reads every byte. A thread samples the process's RSS every
5 ms (psutil). Reported per format: MB/s of file written, seconds, RSS before the export and its
peak during it (the store's own memory is resident before: it was filled by the same process),
and the growth (peak - before): bounded memory means the growth does not follow the row count.

Prints the machine (CPU model, flags), the table, and writes ``--out`` (JSON) and a plot beside it.
docs/benchmarks-export.md has the figures. ``make bench-export`` (``BENCH_ARGS="--rows 2000"`` for
a quick check).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks._common import ROOT, machine, machine_line, markdown_table, pyplot, write_json

FORMATS = ("parquet", "jsonl", "npz")


class RssSampler(threading.Thread):
    """Samples this process's resident set size (bytes) every ``every`` seconds until stopped."""

    def __init__(self, every: float = 0.005) -> None:
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process()
        self.every = every
        self.peak = self.process.memory_info().rss
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> int:
        """Stop sampling; the peak RSS seen (bytes)."""
        self.stopped.set()
        self.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        return self.peak


def fill(rows: int, *, seed: int = 0) -> tuple[object, float]:
    """``rows`` embedded images of one new user in the active space, their points in the store
    (random unit vectors). Returns ``(user, seconds)``."""
    import hashlib

    import numpy as np
    from django.contrib.auth import get_user_model

    from embeddings import runtime, spaces
    from embeddings.models import Image, ImageStatus, Lane
    from workers.ids import point_id
    from workers.vector_store import Point

    t0 = time.perf_counter()
    user = get_user_model().objects.create_user("bench", password="pw")
    model_id = spaces.active().model_id
    store = runtime.vector_store(model_id)
    rng = np.random.default_rng(seed)
    batch = 5000
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        shas = [hashlib.sha256(f"bench-{start + i}".encode()).hexdigest() for i in range(n)]
        vectors = rng.standard_normal((n, store.dim)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        store.upsert([Point(point_id(sha, model_id), vectors[i], {"sha256": sha}) for i, sha in enumerate(shas)])
        Image.objects.bulk_create([
            Image(owner=user, lane=Lane.BULK, status=ImageStatus.EMBEDDED, sha256=sha, size_bytes=1000,
                  storage_key=f"blob/{sha[:2]}/{sha[2:4]}/{sha}", model_id=model_id, point_id=point_id(sha, model_id),
                  external_id=f"sku-{start + i}", metadata={"category": f"c{(start + i) % 50}", "price": start + i})
            for i, sha in enumerate(shas)], batch_size=1000)
    return user, time.perf_counter() - t0


def export_once(client, fmt: str) -> dict:
    """Stream one export through the view, reading every byte; its size, time and memory."""
    import gc

    gc.collect()
    sampler = RssSampler()
    before = sampler.peak
    sampler.start()
    t0 = time.perf_counter()
    r = client.get(f"/api/exports/vectors.{fmt}")
    assert r.status_code == 200, r.content[:500]
    first = None
    size = 0
    for piece in r.streaming_content:
        if first is None:
            first = time.perf_counter() - t0
        size += len(piece)
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    return {"format": fmt, "bytes": size, "seconds": round(seconds, 3), "first_byte_s": round(first or seconds, 3),
            "mb_per_s": round(size / 1e6 / seconds, 1), "rss_before_mb": round(before / 2**20, 1),
            "rss_peak_mb": round(peak / 2**20, 1), "rss_growth_mb": round((peak - before) / 2**20, 1)}


def child(rows: int) -> dict:
    """In a fresh process (env set by :func:`run_size`): fill, then export in every format."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    import embeddings.tasks  # noqa: F401 - registers the tasks run eagerly
    from project.celery import app

    call_command("migrate", verbosity=0)
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    user, fill_s = fill(rows)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    export_once(client, "parquet")  # warm: imports (pyarrow, zipfile), the store's first reads
    return {"rows": rows, "fill_s": round(fill_s, 1), "exports": [export_once(client, f) for f in FORMATS]}


def run_size(rows: int) -> dict:
    """:func:`child` in a new process with its own ``VAR_DIR`` (SQLite, edge store)."""
    with tempfile.TemporaryDirectory(prefix="bench-export-") as var:
        env = {**os.environ, "VAR_DIR": var, "DATABASE_URL": "", "CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0",
               "METRICS_DIR": "", "VECTOR_STORE": "edge", "VECTOR_STORE_OPTIMIZE_IDLE_S": "0",
               "DJANGO_SETTINGS_MODULE": "project.settings"}
        out = subprocess.run([sys.executable, "-m", "benchmarks.export", "--child", str(rows)], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"the {rows}-row run failed:\n{out.stderr[-4000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    rows = [(f"{r['rows']:,}", e["format"], f"{e['bytes'] / 1e6:,.1f}", e["seconds"], e["first_byte_s"], e["mb_per_s"],
             f"{e['rows_per_s']:,}", e["rss_before_mb"], e["rss_peak_mb"], e["rss_growth_mb"])
            for r in results for e in r["exports"]]
    return markdown_table(["rows", "format", "MB", "s", "first byte s", "MB/s", "rows/s", "RSS before MiB",
                           "RSS peak MiB", "growth MiB"], rows)


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["rows"] for r in results]
    for fmt in FORMATS:
        runs = [next(e for e in r["exports"] if e["format"] == fmt) for r in results]
        ax1.plot(xs, [e["mb_per_s"] for e in runs], "o-", label=fmt)
        ax2.plot(xs, [e["rss_growth_mb"] for e in runs], "o-", label=fmt)
    for ax, title in ((ax1, "MB/s written"), (ax2, "RSS growth during the export (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("rows")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000], help="row counts, one process each")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "export.json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    info = machine()
    print(machine_line(info), flush=True)
    results = []
    for rows in args.rows:
        r = run_size(rows)
        for e in r["exports"]:
            e["rows_per_s"] = int(rows / e["seconds"])
        results.append(r)
        print(f"{rows:,} rows: filled in {r['fill_s']} s", flush=True)
    print(table(results))
    write_json(args.out, {"machine": info, "results": results})
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
