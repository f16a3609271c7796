"""``workers.duplicates``: near pairs from the store's batched queries equal numpy's brute force,
groups are cut around representatives (a chain never becomes one group), "not duplicates" pairs
stay apart, and the threshold rule of the calibration."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers import duplicates
from workers.vector_store import Point, open_store


def _unit(x):
    x = np.asarray(x, np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _clustered(n_clusters: int, size: int, alone: int, dim: int = 32, noise: float = 0.05, seed: int = 0):
    """Unit vectors: ``n_clusters`` clusters of ``size`` (centre plus noise) and ``alone`` unrelated ones."""
    rng = np.random.default_rng(seed)
    centres = _unit(rng.standard_normal((n_clusters, dim)))
    members = [_unit(c + noise * rng.standard_normal(dim) / np.sqrt(dim)) for c in centres for _ in range(size)]
    rows = members + list(_unit(rng.standard_normal((alone, dim))))
    return np.stack(rows) if rows else np.zeros((0, dim), np.float32)


@pytest.mark.parametrize("kind", ["edge", "local"])
def test_edges_are_numpy_pairs_above_the_threshold_of_the_owner(tmp_path, kind):
    x = _clustered(5, 3, 20)
    ids = [uuid.UUID(int=i + 1) for i in range(len(x))]
    store = open_store(kind, collection="c", dim=x.shape[1], path=str(tmp_path))
    store.ensure_collection()
    # the last five unrelated points belong to another owner: never a neighbour of the first's
    store.upsert([Point(ids[i], x[i], {"owner_ids": [1 if i < len(x) - 5 else 2], "job_ids": [], "items": []})
                  for i in range(len(x))])
    mine = [(ids[i], x[i]) for i in range(len(x) - 5)]
    sims = x @ x.T
    t = 0.95
    want = {(ids[i], ids[j]) for i in range(len(x) - 5) for j in range(i + 1, len(x) - 5) if sims[i, j] >= t}
    got = duplicates.edges_of(store, mine, threshold=t, owner_id=1, batch=4)
    assert {(a, b) for a, b, _ in got} == want
    assert len(want) == 15  # 5 clusters of 3: 3 pairs each, nothing else that close
    for a, b, s in got:
        assert s == pytest.approx(float(sims[a.int - 1, b.int - 1]), abs=1e-5)
    store.close()


def test_a_chain_is_cut_around_representatives():
    # a - b - c - d - e: neighbours at cos ≈ 0.985, the ends far apart; one component, not one group
    angles = np.radians([0, 10, 20, 30, 40])
    x = np.stack([[np.cos(a), np.sin(a), 0.0] for a in angles]).astype(np.float32)
    names = list("abcde")
    edges = [(names[i], names[i + 1], float(x[i] @ x[i + 1])) for i in range(4)]
    groups = duplicates.group(edges)
    for g in groups:  # every member within the threshold of its representative
        rep = x[names.index(g.representative)]
        assert all(float(rep @ x[names.index(m)]) >= np.cos(np.radians(10.5)) for m, _ in g.members)
    assert sorted(len(g.members) for g in groups) == [2, 3]
    assert sum(len(g.members) for g in groups) == 5


def test_not_duplicates_pairs_never_share_a_group():
    edges = [("a", "b", 0.99), ("a", "c", 0.99), ("b", "c", 0.99)]
    assert [len(g.members) for g in duplicates.group(edges)] == [3]
    got = duplicates.group(edges, dismissed={duplicates.pair("a", "b")})
    assert [len(g.members) for g in got] == [2]
    assert duplicates.pair("a", "b") not in {duplicates.pair(*(m for m, _ in g.members)) for g in got}


@settings(max_examples=40, deadline=None)
@given(n_clusters=st.integers(0, 6), size=st.integers(2, 5), alone=st.integers(0, 12), seed=st.integers(0, 1000))
def test_planted_clusters_are_found_exactly(n_clusters, size, alone, seed):
    x = _clustered(n_clusters, size, alone, seed=seed)
    ids = list(range(len(x)))
    sims = x @ x.T
    edges = [(i, j, float(sims[i, j])) for i in ids for j in ids if i < j and sims[i, j] >= 0.95]
    groups = duplicates.group(edges)
    # an update finds the same pairs with the same cosines (each pair once, its ids in str order)
    assert {(frozenset((a, b)), s) for a, b, s in duplicates.links_within(dict(zip(ids, x)), 0.95)} == \
        {(frozenset((a, b)), s) for a, b, s in edges}
    got = sorted(sorted(m for m, _ in g.members) for g in groups)
    assert got == [list(range(c * size, (c + 1) * size)) for c in range(n_clusters)]


def test_calibration_rule():
    pos = list(np.linspace(0.90, 1.0, 101))
    pairs = list(np.linspace(0.10, 0.80, 1000))
    out = duplicates.calibrate(pos, pairs, neighbours=[0.85, 0.95, 0.99, 0.999], default=0.8)
    # q05 of the positives, 0.905: no pair reaches it
    assert out["source"] == "calibrated" and out["threshold"] == pytest.approx(0.905) and out["separable"]
    assert out["recall_copies"] == pytest.approx(96 / 101, abs=1e-4)  # 0.905 ... 1.0
    assert out["pairs_above"] == 0.0 and out["neighbours_above"] == pytest.approx(0.75)
    # a few copy-like pairs (an original and its copy both sampled) change nothing
    some = duplicates.calibrate(pos, pairs[:990] + [0.999] * 10, default=0.8)
    assert some["threshold"] == pytest.approx(0.905) and some["pairs_above"] == pytest.approx(0.01)
    # a model that cannot tell copies from strangers: the pairs' q99.9 (0.99995) decides, nothing groups
    broken = duplicates.calibrate(pos, list(np.linspace(0.95, 1.0, 1000)), default=0.8)
    assert not broken["separable"] and broken["threshold"] == pytest.approx(0.9999) and broken["recall_copies"] <= 0.01
    small = duplicates.calibrate(pos[:5], pairs, default=0.8)
    assert small["source"] == "default" and small["threshold"] == 0.8
