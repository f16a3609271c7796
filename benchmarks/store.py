"""The embedded vector stores side by side: qdrant-edge (the default) and qdrant-client local mode.

Same data, same run: N random unit 512-d points (seed 0) with an ``owner_ids`` payload (one of
``--owners`` owners) and a ``job_ids`` payload, written through ``workers.vector_store`` in batches
of 64 exactly as the vectors worker writes them (edge: acknowledged after the WAL append, the
default; the cost of a flush per write, ``VECTOR_STORE_FSYNC=1``, is measured apart). Then top-10 and
owner-filtered top-10 latency (p50/p95 over ``--queries`` random unit queries), recall@10 against an
exact numpy search with the same filter, and the process's memory growth. Edge is measured twice:
as written (plain segments + payload indexes) and after ``optimize()`` (HNSW), and during the
optimisation a search is sent every 50 ms to measure how long a request waits for it.

Each (engine, N) runs in its own process (clean memory figures). Usage::

    python -m benchmarks.store                       # N = 20,000 and 100,000, both engines
    python -m benchmarks.store --sizes 2000 --queries 20   # a quick check
    python -m benchmarks.store --filtered            # metadata filters in edge at N = 100,000

``--filtered`` (:func:`run_filtered`) measures the metadata filter (``workers.vector_store.filters``,
a nested condition on the payload's ``items``) at the first of ``--sizes`` (default 100,000): each
point stands for one image (a tenth for two, of two owners) with metadata ``cat`` (one of 100
values: each matches 1 % of points), ``group`` (one of 25) and ``price``; ``cat``, ``group`` and
``price`` are indexed, ``optimize()`` has run; top-10 latency and recall@10 (exact numpy with the
same filter) for unfiltered queries, the owner alone, ``cat`` AND owner, and ``group`` AND owner
(together 1 % of points). The issue's target: p95 <= 20 ms for the filter matching 1 %.

Results: table, JSON and PNG in ``var/bench-store/`` (``--out``); docs/benchmarks.md has a run.
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
import uuid
from pathlib import Path

import numpy as np

from benchmarks._common import ROOT, markdown_table, pyplot, write_json

DIM = 512
BATCH = 64


def rss_mib() -> float:
    """Resident memory of this process (MiB)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def dataset(n: int, owners: int, queries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(X (n, 512) float32 unit rows, owner per row (n,) int, Q (queries, 512) unit)``, seed 0."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    owner = rng.integers(0, owners, size=n)
    q = np.random.default_rng(1).normal(size=(queries, DIM)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return x, owner, q


def pct(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 95))


def measure_searches(store, x, owner, q, ids, owners: int) -> dict:
    """Latency (ms) and recall@10 of unfiltered and owner-filtered top-10 for every query in ``q``."""
    out = {}
    for name, filtered in (("top10", False), ("filtered_top10", True)):
        lat, recall = [], []
        for i, v in enumerate(q):
            o = i % owners if filtered else None
            t0 = time.perf_counter()
            hits = store.search(v, k=10, owner_id=o)
            lat.append((time.perf_counter() - t0) * 1000)
            scores = x @ v
            if filtered:
                scores = np.where(owner == o, scores, -np.inf)
            top = np.argpartition(-scores, 10)[:10]
            exact = {ids[j] for j in top if np.isfinite(scores[j])}  # an owner may have fewer than 10
            recall.append(len(exact & {h.id for h in hits}) / max(1, len(exact)))
        p50, p95 = pct(lat)
        out[name] = {"p50_ms": p50, "p95_ms": p95, "recall10": float(np.mean(recall)), "queries": len(q)}
    return out


def run_one(engine: str, n: int, owners: int, queries: int, local_queries: int, optimize: bool = True) -> dict:
    """One engine at one N, in this process; returns the figures."""
    from workers.vector_store import Point, open_store

    x, owner, q = dataset(n, owners, queries)
    ids = [uuid.UUID(int=i + 1) for i in range(n)]
    if engine == "local":
        q = q[:local_queries]  # a linear scan in Python: seconds per filtered query at 100k
    base = rss_mib()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        store = open_store(engine, collection="bench", dim=DIM, path=tmp)
        store.ensure_collection()
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            store.upsert([Point(ids[j], x[j], {"sha256": str(j), "owner_ids": [int(owner[j])], "job_ids": [f"j{j % 10}"]})
                          for j in range(i, min(i + BATCH, n))])
        upsert_s = time.perf_counter() - t0
        res = {"engine": engine, "n": n, "upsert_points_per_s": n / upsert_s, "upsert_s": upsert_s,
               "count": store.count(), "as_written": measure_searches(store, x, owner, q, ids, owners)}
        res["memory_mib"] = rss_mib() - base
        if engine == "edge":  # what VECTOR_STORE_FSYNC=1 adds to each write: a flush after it
            flush = []
            for i in range(0, 20 * BATCH, BATCH):
                store.upsert([Point(ids[j % n], x[j % n], {"sha256": str(j % n), "owner_ids": [int(owner[j % n])],
                                                          "job_ids": [f"j{j % n % 10}"]}) for j in range(i, i + BATCH)])
                t0 = time.perf_counter()
                store.client.flush()
                flush.append((time.perf_counter() - t0) * 1000)
            res["flush_ms_p50"], res["flush_ms_p95"] = pct(flush)
            res.update(optimize_with_probe(store, q, owners))
            res["optimized"] = measure_searches(store, x, owner, q, ids, owners)
            res["memory_optimized_mib"] = rss_mib() - base
        store.close()
        res["disk_mib"] = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file()) / 2**20
    return res


def optimize_with_probe(store, q, owners: int) -> dict:
    """Run ``store.optimize()`` in a background thread (as the worker does) while the main thread
    sends an owner-filtered search every 50 ms: how long a request waits for an optimisation."""
    done, result, waits = threading.Event(), {}, []

    def work():
        result["changed"], result["seconds"] = store.optimize()
        done.set()

    th = threading.Thread(target=work)
    th.start()
    i, due = 0, time.perf_counter()
    while True:
        # A search is due every 50 ms; its wait counts from when it was due, so a search that could
        # not even start (the optimisation holds the GIL) counts its whole delay.
        store.search(q[i % len(q)], k=10, owner_id=i % owners)
        waits.append(max(0.0, time.perf_counter() - due) * 1000)  # one sent early when it ended: 0
        if done.is_set():
            break
        i += 1
        due += 0.05
        done.wait(max(0.0, due - time.perf_counter()))
    th.join()
    return {"optimize_s": result["seconds"], "probe_searches": len(waits),
            "probe_max_ms": max(waits) if waits else 0.0,
            "probe_p50_ms": float(np.percentile(waits, 50)) if waits else 0.0}


#: ``--filtered``: owners (a quarter of the points each) and ``cat`` values (1 % of the points each).
FILTER_OWNERS, FILTER_CATS, FILTER_GROUPS = 4, 100, 25


def filtered_dataset(n: int, seed: int = 0) -> tuple[list, np.ndarray]:
    """Payloads of ``n`` points and their items as columns ``(point, owner, cat, group)`` ``(I, 4) int``.

    Every point has one item; every tenth a second one of the next owner (a shared image).
    """
    rng = np.random.default_rng(seed)
    owner, cat, group = (rng.integers(0, m, size=n) for m in (FILTER_OWNERS, FILTER_CATS, FILTER_GROUPS))
    price = rng.uniform(0, 100, size=n).round(2)
    payloads, rows = [], []
    for j in range(n):
        items = [{"image": str(uuid.UUID(int=j + 1)), "owner": int(owner[j]),
                  "m": {"cat": f"c{cat[j]}", "group": f"g{group[j]}", "price": float(price[j])}}]
        rows.append((j, owner[j], cat[j], group[j]))
        if j % 10 == 0:
            o2, c2, g2 = (owner[j] + 1) % FILTER_OWNERS, (cat[j] * 7 + 3) % FILTER_CATS, (group[j] + 5) % FILTER_GROUPS
            items.append({"image": str(uuid.UUID(int=n + j + 1)), "owner": int(o2),
                          "m": {"cat": f"c{c2}", "group": f"g{g2}", "price": float(price[j])}})
            rows.append((j, o2, c2, g2))
        payloads.append({"sha256": f"{j:064x}", "owner_ids": sorted({it["owner"] for it in items}), "job_ids": [],
                         "items": items})
    return payloads, np.array(rows, dtype=np.int64)


def run_filtered(n: int, queries: int) -> dict:
    """Filtered top-10 in an optimised edge store of ``n`` points (module docstring); returns the figures."""
    from workers.vector_store import Point
    from workers.vector_store.edge import EdgeStore
    from workers.vector_store.filters import Eq

    x, _, q = dataset(n, FILTER_OWNERS, queries)
    payloads, rows = filtered_dataset(n)
    ids = [uuid.UUID(int=i + 1) for i in range(n)]
    res = {"n": n, "queries": len(q), "items": len(rows)}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        store = EdgeStore(tmp, "bench", DIM, indexed_fields={"cat": "keyword", "group": "keyword", "price": "float"})
        store.ensure_collection()
        t0 = time.perf_counter()
        store.upsert([Point(ids[j], x[j], payloads[j]) for j in range(n)])
        res["upsert_s"] = time.perf_counter() - t0
        res["optimize_s"] = store.optimize()[1]
        res["segments"] = store.client.info().segments_count

        def case(name: str, i: int):
            """``(owner_id, where, matching points (n,) bool)`` of query ``i`` in row ``name``: one item
            must have both the owner and the value."""
            o, c, g = i % FILTER_OWNERS, (i * 37) % FILTER_CATS, (i * 11) % FILTER_GROUPS
            if name == "top10":
                return None, None, np.ones(n, bool)
            sel = rows[:, 1] == o
            where = None
            if name == "cat_and_owner":
                sel, where = sel & (rows[:, 2] == c), Eq("cat", f"c{c}")
            elif name == "group_and_owner":
                sel, where = sel & (rows[:, 3] == g), Eq("group", f"g{g}")
            return o, where, np.bincount(rows[sel, 0], minlength=n) > 0

        for name in ("top10", "owner", "cat_and_owner", "group_and_owner"):
            lat, recall, full, share = [], [], [], []
            for i, v in enumerate(q):
                owner_id, where, ok = case(name, i)
                t0 = time.perf_counter()
                hits = store.search(v, k=10, owner_id=owner_id, where=where)
                lat.append((time.perf_counter() - t0) * 1000)
                scores = np.where(ok, x @ v, -np.inf)
                top = np.argpartition(-scores, 10)[:10]
                exact = {ids[j] for j in top if np.isfinite(scores[j])}
                recall.append(len(exact & {h.id for h in hits}) / max(1, len(exact)))
                full.append(len(hits) == min(10, int(ok.sum())))
                share.append(ok.mean())
            res[name] = {"p50_ms": float(np.percentile(lat, 50)), "p95_ms": float(np.percentile(lat, 95)),
                         "max_ms": max(lat), "recall10": float(np.mean(recall)), "full": float(np.mean(full)),
                         "matching_pct": 100 * float(np.mean(share))}
        store.close()
    return res


def main_filtered(a) -> None:
    """``--filtered``: run :func:`run_filtered`, print the table, write ``filtered.json`` / ``.md``."""
    from benchmarks._common import machine, machine_line

    info = machine()
    print(f"{machine_line(info)}\nmachine: {info}", flush=True)
    n = a.sizes[0] if a.sizes_given else 100_000
    r = run_filtered(n, a.queries)
    names = {"top10": "no filter", "owner": "owner (payload owner_ids)", "cat_and_owner": "cat (1 % of points) AND owner",
             "group_and_owner": "group AND owner (1 % of points)"}
    table = markdown_table([f"top-10 query (edge, N = {n}, optimised)", "points matching %", "p50 ms", "p95 ms",
                            "max ms", "recall@10", "hits = min(10, matching)"],
                           [[names[k], r[k]["matching_pct"], r[k]["p50_ms"], r[k]["p95_ms"], r[k]["max_ms"],
                             r[k]["recall10"], r[k]["full"]] for k in names])
    print(f"{table}\n\n{r['queries']} queries per row; {r['items']} items; upsert {r['upsert_s']:.0f} s, "
          f"optimize {r['optimize_s']:.1f} s, {r['segments']} segments")
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "filtered.json", {"machine": info, "result": r})
    (a.out / "filtered.md").write_text(machine_line(info) + "\n\n" + table + "\n")
    print(f"wrote {a.out}/filtered.json, filtered.md")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="default 20,000 and 100,000 (--filtered: 100,000)")
    ap.add_argument("--engines", nargs="+", default=["edge", "local"], choices=["edge", "local"])
    ap.add_argument("--owners", type=int, default=100, help="distinct owners (a filtered query keeps 1/owners)")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--local-queries", type=int, default=20, help="queries for local mode (it scans in Python)")
    ap.add_argument("--local-max", type=int, default=None,
                    help="skip local mode above this N (it writes ~50-500 points/s: 100,000 take minutes to an hour)")
    ap.add_argument("--optimize-max", type=int, default=None,
                    help="skip edge's optimize() above this N (one index thread: minutes per 100,000 points)")
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench-store")
    ap.add_argument("--filtered", action="store_true", help="metadata-filtered search in edge (run_filtered)")
    ap.add_argument("--one", nargs=2, metavar=("ENGINE", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.sizes_given = a.sizes is not None
    a.sizes = a.sizes or [20_000, 100_000]
    if a.filtered:
        main_filtered(a)
        return
    if a.one:
        print(json.dumps(run_one(a.one[0], int(a.one[1]), a.owners, a.queries, a.local_queries,
                                 optimize=a.optimize_max is None or int(a.one[1]) <= a.optimize_max)))
        return
    from benchmarks._common import machine, machine_line

    info = machine()
    print(f"{machine_line(info)}\nmachine: {info}", flush=True)
    results = []
    for n in a.sizes:
        for engine in a.engines:
            if engine == "local" and a.local_max is not None and n > a.local_max:
                continue
            cmd = [sys.executable, "-m", "benchmarks.store", "--one", engine, str(n), "--owners", str(a.owners),
                   "--queries", str(a.queries), "--local-queries", str(a.local_queries)]
            if a.optimize_max is not None:
                cmd += ["--optimize-max", str(a.optimize_max)]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{engine} N={n} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{engine} N={n}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for r in results:
        phases = [("as written", r["as_written"])] + ([("optimized", r["optimized"])] if "optimized" in r else [])
        for phase, m in phases:
            rows.append([r["engine"] + (f" ({phase})" if r["engine"] == "edge" else ""), r["n"],
                         round(r["upsert_points_per_s"]) if phase == "as written" else "",
                         m["top10"]["p50_ms"], m["top10"]["p95_ms"], m["filtered_top10"]["p50_ms"],
                         m["filtered_top10"]["p95_ms"], m["top10"]["recall10"], m["filtered_top10"]["recall10"],
                         round(r["memory_optimized_mib"] if phase == "optimized" else r["memory_mib"]),
                         round(r["disk_mib"])])
    table = markdown_table(["engine", "N", "upsert points/s", "top-10 p50 ms", "top-10 p95 ms", "filtered p50 ms",
                            "filtered p95 ms", "recall@10", "filtered recall@10", "memory MiB", "disk MiB"], rows)
    opt = markdown_table(["N", "optimize s", "searches sent during it", "search p50 ms", "longest wait ms",
                          "flush after 64 points p50 / p95 ms"],
                         [[r["n"], r.get("optimize_s", "skipped"), r.get("probe_searches", ""), r.get("probe_p50_ms", ""),
                           r.get("probe_max_ms", ""), f"{r['flush_ms_p50']:.1f} / {r['flush_ms_p95']:.1f}"]
                          for r in results if r["engine"] == "edge"])
    print(table + "\n\nEdge optimisation in a background thread, a filtered search every 50 ms meanwhile:\n\n" + opt)
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "store.json", {"machine": info, "results": results})
    (a.out / "store.md").write_text(table + "\n\n" + opt + "\n")
    plot(results, a.out / "store.png")
    print(f"wrote {a.out}/store.json, store.md, store.png")


def plot(results: list[dict], path: Path) -> None:
    """Upsert rate and filtered p95 per engine and N (log scales)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    series = {}
    for r in results:
        series.setdefault(r["engine"], []).append(r)
    for engine, rs in series.items():
        ns = [r["n"] for r in rs]
        ax1.plot(ns, [r["upsert_points_per_s"] for r in rs], "o-", label=engine)
        ax2.plot(ns, [r["as_written"]["filtered_top10"]["p95_ms"] for r in rs], "o-", label=f"{engine} (as written)")
        opt = [r for r in rs if "optimized" in r]
        if opt:
            ax2.plot([r["n"] for r in opt], [r["optimized"]["filtered_top10"]["p95_ms"] for r in opt], "o--",
                     label=f"{engine} (optimized)")
        ax2.plot(ns, [r["as_written"]["top10"]["p95_ms"] for r in rs], "s:", label=f"{engine} top-10 (as written)")
    ax1.set(xscale="log", yscale="log", xlabel="points", ylabel="upsert points/s", title="write (batches of 64)")
    ax2.set(xscale="log", yscale="log", xlabel="points", ylabel="ms", title="top-10 p95 (owner-filtered unless marked)")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
