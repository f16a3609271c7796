"""The vectors writer alone, stage by stage (issue 58 item 2): ``vectors.chunk_index`` on chunks of
512 points (a re-embed chunk), in-process, on a scratch PostgreSQL database and a scratch embedded
store, with each stage's time per chunk and the SQL statements per chunk.

    python -m benchmarks.writer [--points 2048] [--chunk 512] [--rounds 2] [--before PATH]
    make bench-writer [BENCH_ARGS="..."]

``--before PATH``: a checkout of the code before a change (``git worktree add /tmp/before main``);
each round then measures it and this checkout one after the other, on the same machine and load, so
their ratio holds where the absolute figures move with other work on the cores. Every row carries
the 1-minute load average. Stages: ``queued_payloads`` (the one read before writing),
``write_slices`` (decoding and screening the vectors, building the points, the store's upsert,
one slice of ``VECTORS_WRITE_SLICE`` at a time), ``store.upsert`` (the store's own part of that),
``interactive_waiting`` (the look at the vectors queue between slices), ``mark_embedded`` (the
marking UPDATEs), ``payloads_settle`` (the read after the mark). Results: docs/scaling.md,
"The vectors writer".
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ROOT, machine, machine_line  # noqa: E402
from benchmarks.lanes import scratch_database  # noqa: E402

#: The stages timed, as (module path, attribute, label).
SPANS = (("embeddings.services.queues.vectors", "queued_payloads", "queued_payloads"),
         ("embeddings.services.queues.vectors", "_write_slice", "write_slices"),
         ("embeddings.services.catalogue.images", "images_mark_embedded", "mark_embedded"),
         ("embeddings.services.queues.vectors", "payloads_settle", "payloads_settle"),
         ("embeddings.lane_control", "vectors_interactive_waiting", "interactive_waiting"))


def measure(points: int, chunk: int) -> dict:
    """In a Django process whose settings name a scratch database and store: create ``points`` +
    ``chunk`` queued images, write one chunk to warm up, then the rest chunk by chunk, timing each
    stage (:data:`SPANS`). Returns ``{"points_per_s", "ms_per_chunk", "sql_per_chunk", "stages_ms"
    (per chunk), "load_1m"}``."""
    import importlib

    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    call_command("migrate", verbosity=0)
    from benchmarks.sink import seed_and_send
    from embeddings import runtime
    from embeddings.services.queues import vectors

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name, label):
        real = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(owner, name, wrapper)

    for module, name, label in SPANS:
        timed(importlib.import_module(module), name, label)
    timed(type(runtime.vector_store()), "upsert", "store.upsert")
    # what the vectors worker does once it consumes (worker_boot.freeze_heap), where that code has it
    from embeddings import worker_boot
    if hasattr(worker_boot, "freeze_heap"):
        worker_boot.freeze_heap()
    out = seed_and_send(points + chunk, send=False)
    items = [it for c in out["chunks"] for it in c]
    chunks = [items[i : i + chunk] for i in range(0, len(items), chunk)]
    vectors.chunk_index(job_id=out["job_id"], stat_id=None, items=chunks[0], priority="background")
    spent.clear()
    load = os.getloadavg()[0]
    statements = []
    t0 = time.perf_counter()
    for c in chunks[1:]:
        with CaptureQueriesContext(connection) as q:
            vectors.chunk_index(job_id=out["job_id"], stat_id=None, items=c, priority="background")
        statements.append(len(q.captured_queries))
    seconds = time.perf_counter() - t0
    n = len(chunks) - 1
    return {"points_per_s": round(points / seconds, 1), "ms_per_chunk": round(1000 * seconds / n, 1),
            "sql_per_chunk": max(statements), "stages_ms": {k: round(1000 * v / n, 1) for k, v in spent.items()},
            "load_1m": round(max(load, os.getloadavg()[0]), 2)}


def run_in(checkout: Path, points: int, chunk: int, server: str) -> dict:
    """:func:`measure` in a new process importing ``checkout``'s code, on a fresh scratch database
    and store folder."""
    with scratch_database(server) as url, tempfile.TemporaryDirectory() as var:
        env = {**os.environ, "PYTHONPATH": str(checkout), "DJANGO_SETTINGS_MODULE": "project.settings",
               "DATABASE_URL": url, "VAR_DIR": var, "CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0"}
        if not (checkout / ".env").exists():  # its settings need a secret key; this checkout's has one
            env.setdefault("DJANGO_SECRET_KEY", os.environ.get("DJANGO_SECRET_KEY", "bench-writer"))
        code = (f"import json; from benchmarks.writer import measure; "
                f"print(json.dumps(measure({points}, {chunk})))")
        # the harness is this file, whatever the checkout: copied in front of the checkout on the path
        # (-P: the working directory, the checkout, is not put before it)
        harness = Path(var) / "harness"
        (harness / "benchmarks").mkdir(parents=True)
        for name in ("__init__.py", "writer.py", "sink.py", "_common.py", "lanes.py"):
            src = Path(__file__).resolve().parent / name
            (harness / "benchmarks" / name).write_text(src.read_text())
        env["PYTHONPATH"] = f"{harness}{os.pathsep}{checkout}"
        out = subprocess.run([sys.executable, "-P", "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                             check=False)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    labels = ["queued_payloads", "write_slices", "store.upsert", "interactive_waiting", "mark_embedded",
              "payloads_settle"]
    lines = ["| round | code | points/s | ms per chunk | SQL statements per chunk | " + " | ".join(labels)
             + " | load average |", "| --- " * (6 + len(labels)) + "|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['code']} | {r['points_per_s']:,.0f} | {r['ms_per_chunk']} | "
                     f"{r['sql_per_chunk']} | " + " | ".join(str(r["stages_ms"].get(k, "-")) for k in labels)
                     + f" | {r['load_1m']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.writer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=2048, help="points measured per run (default 2,048)")
    ap.add_argument("--chunk", type=int, default=512, help="points per index_chunk (default 512, a re-embed chunk)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each checkout, alternated (default 2)")
    ap.add_argument("--before", metavar="PATH", help="a checkout of the code before a change, measured alongside")
    ap.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432/postgres",
                    help="the PostgreSQL server for the scratch databases")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "writer"), help="output folder")
    args = ap.parse_args(argv)
    print(machine_line(machine()) + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    checkouts = ([("before", Path(args.before).resolve())] if args.before else []) + [("this", ROOT)]
    rows = []
    for n in range(1, args.rounds + 1):
        for name, path in checkouts:
            rows.append({"round": n, "code": name, **run_in(path, args.points, args.chunk, args.postgres)})
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows)
    if args.before:
        mean = {name: sum(r["points_per_s"] for r in rows if r["code"] == name) / args.rounds for name, _ in checkouts}
        text += f"\n\nthis / before, mean points/s: {mean['this'] / mean['before']:.2f} x"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
