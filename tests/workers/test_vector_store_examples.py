"""Multi-example queries and diverse results in every backend (edge, local, server when one answers):
the engine's own recommend and MMR queries agree with a brute-force numpy reference of Qdrant's
documented formulas on small random data.

- ``best_score``: ``s(best positive)`` when it beats the best negative, else ``-s(best negative)``,
  ``s(x) = (x / (1 + |x|) + 1) / 2`` (Qdrant's ``scaled_fast_sigmoid``, ``reco_query.rs``);
  ``sum_scores``: Σ cos(positives) − Σ cos(negatives); ``average_vector``: cos to 2·mean(P) − mean(N).
- MMR (``diversity`` d): the hits are drawn from the plain candidate pool; the first is the most
  relevant, each next one maximises ``(1 − d)·relevance − d·max cos(p, picked)`` (within float32
  rounding); d = 0 is the plain top-k.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.vector_store import Point, STRATEGIES, UnusableVector, average_vector
from tests.workers.test_vector_store import open_backend

N, DIM = 60, 8
#: Scores are float32 in the engines: ties and near-ties are compared with this slack.
TOL = 2e-4

_rng = np.random.default_rng(45)
X = _rng.normal(size=(N, DIM)).astype(np.float32)
X /= np.linalg.norm(X, axis=1, keepdims=True)
IDS = [uuid.UUID(int=i + 1) for i in range(N)]
ROW = {pid: i for i, pid in enumerate(IDS)}
OWNER = [1 + i % 2 for i in range(N)]


@pytest.fixture(scope="module", params=["edge", "local", "server"])
def store(request, tmp_path_factory):
    s = open_backend(request.param, tmp_path_factory.mktemp(request.param), f"examples_{uuid.uuid4().hex[:8]}", dim=DIM)
    s.ensure_collection()
    s.upsert([Point(IDS[i], X[i], {"owner_ids": [OWNER[i]], "job_ids": [], "sha256": str(i)}) for i in range(N)])
    yield s
    s.close()


def _sig(x: np.ndarray) -> np.ndarray:
    return (x / (1 + np.abs(x)) + 1) / 2


def reference_scores(positive, negative, strategy: str) -> np.ndarray:
    """Every stored point's score under ``strategy`` (Qdrant's formulas, float64)."""
    unit = X.astype(np.float64)
    norm = lambda v: np.asarray(v, np.float64) / np.linalg.norm(v)  # noqa: E731 - cosine normalises
    if strategy == "average_vector":
        return unit @ norm(average_vector(positive, negative))
    pos = unit @ np.stack([norm(v) for v in positive]).T
    neg = unit @ np.stack([norm(v) for v in negative]).T if len(negative) else np.zeros((N, 0))
    if strategy == "sum_scores":
        return pos.sum(1) - neg.sum(1)
    best_p = pos.max(1)
    best_n = neg.max(1) if len(negative) else np.full(N, -2.0)  # below every cosine
    return np.where(best_p > best_n, _sig(best_p), -_sig(best_n))


def assert_top_k(hits, scores: np.ndarray, allowed: np.ndarray, k: int) -> None:
    """``hits`` are the top-``k`` of ``scores`` among rows ``allowed`` (bool mask), best first;
    points tied within :data:`TOL` may come in either order."""
    want = np.sort(scores[allowed])[::-1][:k]
    got = np.array([h.score for h in hits])
    assert len(hits) == len(want)
    np.testing.assert_allclose(got, want, atol=TOL)
    for h in hits:
        assert allowed[ROW[h.id]]
        assert h.score == pytest.approx(scores[ROW[h.id]], abs=TOL)


def assert_mmr(hits, pool: list, relevance: np.ndarray, diversity: float, k: int) -> None:
    """``hits`` are a greedy MMR selection of ``k`` from ``pool`` (point ids) with ``relevance``
    (per row): each pick within :data:`TOL` of the best MMR value left."""
    rows = [ROW[p] for p in pool]
    picked: list[int] = []
    assert len(hits) == min(k, len(rows))
    for h in hits:
        r = ROW[h.id]
        assert r in rows and r not in picked
        left = [c for c in rows if c not in picked]

        def value(c: int) -> float:
            near = max((float(X[c] @ X[p]) for p in picked), default=0.0)
            return relevance[c] if not picked else (1 - diversity) * relevance[c] - diversity * near
        assert value(r) >= max(value(c) for c in left) - TOL
        picked.append(r)


examples = st.lists(st.integers(0, N - 1), min_size=1, max_size=4, unique=True)
negatives = st.lists(st.integers(0, N - 1), min_size=0, max_size=3, unique=True)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(pos=examples, neg=negatives, strategy=st.sampled_from(STRATEGIES), k=st.integers(1, 12),
       owner=st.sampled_from([None, 1, 2]), raw=st.booleans())
def test_recommend_matches_the_formulas(store, pos, neg, strategy, k, owner, raw):
    """Top-k of each strategy, owner filter inside the query, examples as stored vectors or as new
    raw vectors (a perturbed copy, as an uploaded image or a text would be)."""
    jitter = np.random.default_rng(len(pos) * 100 + len(neg)).normal(scale=0.3, size=(N, DIM)).astype(np.float32)
    vec = (lambda i: X[i] + jitter[i]) if raw else (lambda i: X[i])
    P, Q = [vec(i) for i in pos], [vec(i) for i in neg if i not in pos]
    hits = store.recommend(P, Q, k=k, strategy=strategy, owner_id=owner)
    allowed = np.array([owner is None or o == owner for o in OWNER])
    assert_top_k(hits, reference_scores(P, Q, strategy), allowed, k)


@SETTINGS
@given(pos=examples, neg=negatives, strategy=st.sampled_from(STRATEGIES), k=st.integers(1, 8),
       diversity=st.floats(0.05, 1.0), pool=st.integers(1, 30))
def test_diverse_recommend_reranks_the_pool(store, pos, neg, strategy, k, diversity, pool):
    """MMR's hits come from the strategy's own top-``pool`` and follow the greedy rule, relevance
    being the cosine to the examples' average vector (also each hit's score)."""
    P, Q = [X[i] for i in pos], [X[i] for i in neg if i not in pos]
    rel_v = average_vector(P, Q)
    if np.linalg.norm(rel_v) < 1e-3:
        return
    hits = store.recommend(P, Q, k=k, strategy=strategy, diversity=diversity, candidates=pool)
    candidates = [h.id for h in store.recommend(P, Q, k=max(k, pool), strategy=strategy)]
    relevance = X.astype(np.float64) @ (rel_v / np.linalg.norm(rel_v))
    assert_mmr(hits, candidates, relevance, diversity, k)
    for h in hits:
        assert h.score == pytest.approx(relevance[ROW[h.id]], abs=TOL)


@SETTINGS
@given(q=st.integers(0, N - 1), k=st.integers(1, 10), diversity=st.floats(0.05, 1.0),
       pool=st.one_of(st.none(), st.integers(1, 40)), owner=st.sampled_from([None, 2]))
def test_diverse_search_reranks_the_pool(store, q, k, diversity, pool, owner):
    hits = store.search(X[q], k=k, diversity=diversity, candidates=pool, owner_id=owner)
    from workers.vector_store import candidate_pool

    candidates = [h.id for h in store.search(X[q], k=candidate_pool(k, pool), owner_id=owner)]
    assert_mmr(hits, candidates, X.astype(np.float64) @ X[q].astype(np.float64), diversity, k)
    assert all(owner is None or OWNER[ROW[h.id]] == owner for h in hits)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_diversity_zero_is_the_plain_top_k(store, strategy):
    P, Q = [X[0], X[5]], [X[7]]
    plain = store.recommend(P, Q, k=10, strategy=strategy)
    assert [h.id for h in store.recommend(P, Q, k=10, strategy=strategy, diversity=0.0, candidates=50)] \
        == [h.id for h in plain]
    assert [h.id for h in store.search(X[3], k=10, diversity=0.0)] == [h.id for h in store.search(X[3], k=10)]


def test_full_diversity_spreads_the_hits(store):
    """diversity 1 picks, after the nearest, the points least like those already picked: the
    hits' largest pairwise cosine drops below the plain top-k's."""
    plain = store.search(X[0], k=6)
    diverse = store.search(X[0], k=6, diversity=1.0, candidates=N)

    def closest_pair(hits):
        v = X[[ROW[h.id] for h in hits]]
        sims = v @ v.T - 2 * np.eye(len(hits))
        return sims.max()
    assert diverse[0].id == plain[0].id == IDS[0]
    assert closest_pair(diverse) < closest_pair(plain)


def test_filters_and_exclusions_apply_inside(store):
    hits = store.recommend([X[0], X[1]], [X[2]], k=N, strategy="best_score", owner_id=1,
                           exclude=[IDS[0], IDS[4]])
    rows = {ROW[h.id] for h in hits}
    assert rows == {i for i in range(N) if OWNER[i] == 1} - {0, 4}
    diverse = store.recommend([X[0], X[1]], [X[2]], k=N, diversity=0.5, candidates=N, owner_id=1, exclude=[IDS[0]])
    assert {ROW[h.id] for h in diverse} == {i for i in range(N) if OWNER[i] == 1} - {0}


def test_bad_arguments_are_refused(store):
    with pytest.raises(ValueError, match="positive"):
        store.recommend([], [X[1]], k=3)
    with pytest.raises(ValueError, match="strategy"):
        store.recommend([X[0]], k=3, strategy="median")
    for d in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="diversity"):
            store.search(X[0], k=3, diversity=d)
        with pytest.raises(ValueError, match="diversity"):
            store.recommend([X[0]], k=3, diversity=d)
    with pytest.raises(UnusableVector):
        store.recommend([X[0], np.full(DIM, np.nan, np.float32)], k=3)
    with pytest.raises(UnusableVector):  # the examples cancel out: no direction left
        store.recommend([X[0]], [X[0] * 2], k=3, strategy="average_vector")


def test_server_requests_are_built_from_qdrant_client_models():
    """Server mode's requests (no server needed): a RecommendQuery of raw vectors and strategy; with
    diversity, a prefetch of the pool under the same filter, re-ranked by a NearestQuery with Mmr."""
    from qdrant_client import models

    from workers.vector_store.client import query_request, recommend_request

    req = recommend_request([X[0]], [X[1]], strategy="sum_scores", k=5)
    assert req["query"].recommend.strategy == models.RecommendStrategy.SUM_SCORES
    assert req["query"].recommend.positive == [pytest.approx(X[0].tolist())]
    flt = models.Filter(must=[models.FieldCondition(key="owner_ids", match=models.MatchValue(value=3))])
    req = recommend_request([X[0]], [X[1]], strategy="best_score", k=5, diversity=0.25, candidates=40, where=flt)
    assert req["prefetch"].limit == 40 and req["prefetch"].filter == flt
    assert req["query"].mmr == models.Mmr(diversity=0.25, candidates_limit=40)
    assert req["query"].nearest == pytest.approx((2 * X[0] - X[1]).tolist(), abs=1e-6)
    assert query_request(X[0], k=10) == {"query": pytest.approx(X[0].tolist())}
    assert query_request(X[0], k=10, diversity=0.5)["query"].mmr.candidates_limit == 100
