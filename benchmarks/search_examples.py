"""Multi-example and diverse search in the embedded edge store against a plain top-10 (issue 45).

N random unit 512-d points (seed 0; ``owner_ids`` one of ``--owners``, written in batches of 64
through ``workers.vector_store`` as the vectors worker writes them; not optimised: below
``INDEXING_THRESHOLD_KB`` the product searches exactly, as here). For each of ``--queries`` rounds,
interleaved so that every kind meets the same machine state, one query of each kind:

- ``plain``: top-10 by one vector (``VectorStore.search``);
- ``mmr``: the same with ``diversity`` 0.5 (pool ``max(100, 10·k)`` = 100);
- ``best_score`` / ``sum_scores`` / ``average_vector``: top-10 for 3 positive and 2 negative
  examples (``VectorStore.recommend``);
- ``best_score+mmr``: best_score with ``diversity`` 0.5.

Two scopes: ``all`` (every point matches: one user with all N images, or staff) and ``owner`` (the
owner filter keeps 1/owners). p50/p95 in ms per kind and the ratio of each p95 to the plain
top-10's p95 of the same scope, in one run. The issue's target: p95 within 2× of a plain top-10.

Usage::

    flock /tmp/bench.lock .venv/bin/python -m benchmarks.search_examples            # N = 100,000
    python -m benchmarks.search_examples --n 5000 --queries 20                      # a quick check

Results: table and JSON in ``var/bench/search-examples/`` (``--out``); docs/search.md has a run.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks._common import ROOT, machine, machine_line, markdown_table, write_json

DIM = 512
BATCH = 64
KINDS = ("plain", "mmr", "best_score", "sum_scores", "average_vector", "best_score+mmr")


def run(n: int, owners: int, queries: int) -> dict:
    from workers.vector_store import Point, open_store

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    owner = rng.integers(0, owners, size=n)
    ids = [uuid.UUID(int=i + 1) for i in range(n)]
    examples = np.random.default_rng(1).normal(size=(queries, 5, DIM)).astype(np.float32)
    examples /= np.linalg.norm(examples, axis=2, keepdims=True)
    out: dict = {"n": n, "owners": owners, "queries": queries, "machine": machine()}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        store = open_store("edge", collection="bench", dim=DIM, path=tmp)
        store.ensure_collection()
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            store.upsert([Point(ids[j], x[j], {"sha256": str(j), "owner_ids": [int(owner[j])], "job_ids": []})
                          for j in range(i, min(i + BATCH, n))])
        out["upsert_s"] = time.perf_counter() - t0

        def query(kind: str, e: np.ndarray, owner_id):
            pos, neg = list(e[:3]), list(e[3:])
            if kind == "plain":
                return store.search(e[0], k=10, owner_id=owner_id)
            if kind == "mmr":
                return store.search(e[0], k=10, owner_id=owner_id, diversity=0.5)
            if kind == "best_score+mmr":
                return store.recommend(pos, neg, k=10, strategy="best_score", owner_id=owner_id, diversity=0.5)
            return store.recommend(pos, neg, k=10, strategy=kind, owner_id=owner_id)

        for scope in ("all", "owner"):
            lat: dict[str, list[float]] = {k: [] for k in KINDS}
            for i in range(queries):
                o = None if scope == "all" else i % owners
                for kind in KINDS:
                    t0 = time.perf_counter()
                    hits = query(kind, examples[i], o)
                    lat[kind].append((time.perf_counter() - t0) * 1000)
                    assert len(hits) == 10, (kind, len(hits))
            base = float(np.percentile(lat["plain"], 95))
            out[scope] = {k: {"p50_ms": float(np.percentile(v, 50)), "p95_ms": float(np.percentile(v, 95)),
                              "p95_vs_plain": float(np.percentile(v, 95)) / base} for k, v in lat.items()}
        store.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--owners", type=int, default=100, help="the owner scope keeps 1/owners of the points")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "search-examples")
    a = ap.parse_args(argv)
    res = run(a.n, a.owners, a.queries)
    print(machine_line(res["machine"]))
    print(f"edge store, N = {a.n:,} unit 512-d points, {a.queries} queries per kind, upsert {res['upsert_s']:.1f} s")
    rows = []
    for scope, label in (("all", f"all {a.n:,} match"), ("owner", f"owner filter (1/{a.owners})")):
        for kind in KINDS:
            r = res[scope][kind]
            rows.append([label, kind, f"{r['p50_ms']:.2f}", f"{r['p95_ms']:.2f}", f"{r['p95_vs_plain']:.2f}×"])
    table = markdown_table(["scope", "query (top-10)", "p50 ms", "p95 ms", "p95 / plain p95"], rows)
    print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "results.json", res)
    (a.out / "results.md").write_text(machine_line(res["machine"]) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
