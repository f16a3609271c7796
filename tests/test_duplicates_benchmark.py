"""The near-duplicate benchmark's core (``benchmarks.duplicates``, issue 45 item 3) at a tiny size:
planted clusters in a real edge store, the full scan and the incremental step recover them exactly,
and the scores count pairs as defined."""
from __future__ import annotations

import numpy as np

from benchmarks import duplicates as bench
from workers.vector_store import open_store


def test_pairwise_and_recovery_count_pairs_and_exact_clusters():
    label = {"a": 1, "b": 1, "c": 1, "d": 2, "e": 2, "f": 3}  # true pairs: 3 + 1 = 4
    groups = [["a", "b"], ["c", "d", "e"]]  # pairs a-b (right), c-d, c-e (wrong), d-e (right)
    got = bench.pairwise(groups, label)
    assert got == {"predicted_pairs": 4, "true_pairs": 4, "correct_pairs": 2, "precision": 0.5, "recall": 0.5,
                   "mixed_groups": 1}
    assert bench.recovery([["d", "e"], ["a", "b"]], [["a", "b", "c"], ["e", "d"]]) == {
        "planted": 2, "predicted": 2, "exact": 1, "recall": 0.5, "precision": 0.5}
    assert bench.pairwise([], label)["precision"] == 1.0


def test_planted_clusters_are_recovered_exactly_by_the_scan_and_the_increment(tmp_path):
    n, clusters, decoys, new = 2_000, 50, 50, 100
    x, truth, centres = bench.planted(n, clusters, decoys)
    sizes = [len(c) for c in truth]
    assert x.shape == (n, 512) and x.dtype == np.float32 and len(truth) == clusters
    assert set(sizes) <= {2, 3, 4, 5, 6} and len({r for c in truth for r in c}) == sum(sizes)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)
    assert min((x[c] @ x[c].T).min() for c in truth) > bench.SCAN_THRESHOLD + 0.01

    store = open_store("edge", collection="t", dim=512, path=str(tmp_path))
    store.ensure_collection()
    bench.fill(store, x)
    res = bench.scan(store, threshold=bench.SCAN_THRESHOLD, slice_=700)  # three pages, the last one short
    assert res["points"] == n
    assert len(res["edges"]) == sum(s * (s - 1) // 2 for s in sizes)  # every pair inside a cluster, nothing else
    row = {pid: i for i, pid in enumerate(bench.point_ids(0, n + new))}
    got = [[row[m] for m in g] for g in bench.members(res["groups"])]
    assert bench.recovery(got, truth) == {"planted": 50, "predicted": 50, "exact": 50, "recall": 1.0, "precision": 1.0}

    extra, after = bench.new_points(new, truth, centres, n)
    grown = [i for i, c in enumerate(after[:clusters]) if len(c) > len(truth[i])]
    assert len(grown) == 30 and len(after) == 55  # 3/10 new copies, 1/10 as 5 new pairs, 60 unrelated
    inc = bench.increment(store, res["groups"], extra, start=n, threshold=bench.SCAN_THRESHOLD)
    assert inc["edges"] == sum(len(truth[i]) for i in grown) + 5 and inc["touched"] == 30
    got = [[row[m] for m in g] for g in bench.members(inc["groups"])]
    assert bench.recovery(got, after) == {"planted": 55, "predicted": 55, "exact": 55, "recall": 1.0, "precision": 1.0}
    store.close()


def test_the_chain_is_one_component_that_group_cuts_into_short_groups():
    from workers import duplicates

    n = 300
    edges = bench.chain_edges(n, bench.SCAN_THRESHOLD)
    pairs = {(a, b) for a, b, _ in edges}
    assert len(pairs) == len(edges) and all(a < b for a, b in pairs)
    assert {(i, i + 1) for i in range(n - 1)} <= pairs  # every step linked: one component of all 300
    assert min(s for _, _, s in edges) >= bench.SCAN_THRESHOLD
    assert max(b - a for a, b in pairs) < 20  # ~10 steps each side, never the far ends
    degree = {}
    for a, b in pairs:
        degree[a], degree[b] = degree.get(a, 0) + 1, degree.get(b, 0) + 1
    assert len(degree) == n
    groups = duplicates.group(edges)
    # cut around representatives: each group a short stretch of the walk, every member linked to it
    for g in groups:
        ids = [m for m, _ in g.members]
        assert all((min(g.representative, m), max(g.representative, m)) in pairs for m in ids[1:])
        assert max(ids) - min(ids) < 40
    assert len({m for g in groups for m, _ in g.members}) == sum(len(g.members) for g in groups)
