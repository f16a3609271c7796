"""Near-duplicate groups from near-neighbour edges, and the similarity threshold that defines them.

No Django and no engine here: the scan (``embeddings.services.duplicates``) asks the store for each
point's neighbours above the threshold (``VectorStore.neighbours``, the engine's batched queries)
and hands the edges (each with its cosine) to :func:`group`, which reads no vector: the cost here
grows with the duplicates found, not with the catalogue.

Why not plain connected components: similarity is not transitive. A chain of merely similar
pictures (a product shot from five angles, a burst of a moving scene) links into one component of
hundreds whose two ends share nothing (immich-app/immich#31487: about 4,000 false groups). Each
group is therefore cut around a *representative*: every member is within the threshold of the
representative itself, so a group is never wider than one threshold from its centre, whatever the
chain.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Hashable, Iterable, Sequence

import numpy as np

#: Neighbours asked per point in a scan: a point with more near-copies than this still joins its
#: group through them (each of them finds it); 16 keeps a 100,000-point scan's edges ≤ 1.6 M.
NEIGHBOURS_K = 16

#: Query points per batched store request (``VectorStore.neighbours``): the time per query is flat
#: from 64 up (about 4 ms at 100,000 points, exact: docs/duplicates-benchmarks.md), and 256 keeps
#: one request's answer small.
QUERY_BATCH = 256

#: Calibration: the threshold is this quantile of the copies' similarity to their originals
#: (recall first among copies like the calibration's: 95 % of them are at or above it) ...
POSITIVE_QUANTILE = 0.05
#: ... unless more than this share of the sample's pairs (each sampled image with each other, almost
#: never copies of each other) reach it too: the model cannot tell copies from strangers, and the
#: threshold becomes the pairs' :data:`PAIR_QUANTILE`, so that such a model groups nothing rather
#: than everything. A catalogue's copies make a few of the pairs copy-like (an original and its
#: copy both sampled): a quarter is far above that.
MAX_COPY_LIKE_PAIRS = 0.25
PAIR_QUANTILE = 0.999

#: Fewest copies, and pairs, for a calibration to stand (5 sampled images give 20 copies and 10
#: pairs; 4 only 6 pairs); below it the configured default threshold is used
#: (``DUPLICATES_DEFAULT_THRESHOLD``).
MIN_CALIBRATION_SAMPLE = 8


@dataclasses.dataclass(frozen=True)
class Group:
    """A near-duplicate group: its ``representative`` and every member with its cosine to the
    representative (the representative itself with 1.0 first, then best first)."""

    representative: Hashable
    members: tuple[tuple[Hashable, float], ...]


def pair(a: Hashable, b: Hashable) -> frozenset:
    """An unordered pair (the key of a "not duplicates" decision)."""
    return frozenset((a, b))


def group(edges: Iterable[tuple[Hashable, Hashable, float]], *, nodes: Iterable[Hashable] = (),
          dismissed: set[frozenset] = frozenset()) -> list[Group]:
    """Near-duplicate groups of the points linked by ``edges`` ``(a, b, cosine)`` (each at or above
    the threshold they were found at), cut around representatives.

    Repeatedly: the representative is the remaining point with the most remaining neighbours (ties:
    the larger sum of their cosines, then the smaller ``str(id)``); its group is it and those
    neighbours, best first, less any that a person marked "not duplicates" with a member already
    taken; a point with no remaining neighbour is left alone. Every member is linked to the
    representative itself, so a chain of merely similar pictures is never one group. A lazy heap
    keeps it O(E log E) in the edges, with no vector read and no matrix of a component.

    Args:
        nodes: points to regroup even without an edge here (they group only through edges).
        dismissed: pairs a person marked "not duplicates" (:func:`pair`): never linked, never in
            one group.

    Returns:
        Groups of at least two members, largest first (then by representative).
    """
    adj: dict[Hashable, dict[Hashable, float]] = {n: {} for n in nodes}
    for a, b, score in edges:
        if a == b or pair(a, b) in dismissed:
            continue
        for x, y in ((a, b), (b, a)):
            near = adj.setdefault(x, {})
            near[y] = max(near.get(y, -1.0), float(score))
    left = set(adj)
    heap = [(-len(near), -sum(near.values()), str(n), n) for n, near in adj.items() if near]
    heapq.heapify(heap)
    out: list[Group] = []
    while heap:
        degree, _, key, n = heapq.heappop(heap)
        if n not in left:
            continue
        live = {m: score for m, score in adj[n].items() if m in left}
        if len(live) != -degree:  # a neighbour was taken since it was pushed: its place moved down
            if live:
                heapq.heappush(heap, (-len(live), -sum(live.values()), key, n))
            continue
        taken = [n]
        for m, _ in sorted(live.items(), key=lambda e: (-e[1], str(e[0]))):
            if not any(pair(m, t) in dismissed for t in taken):
                taken.append(m)
        left.difference_update(taken)
        if len(taken) > 1:
            out.append(Group(n, ((n, 1.0), *((m, live[m]) for m in taken[1:]))))
    return sorted(out, key=lambda g: (-len(g.members), str(g.representative)))


def edges_of(store, queries: Sequence[tuple[Hashable, np.ndarray]], *, threshold: float, owner_id: int | None,
             k: int = NEIGHBOURS_K, batch: int = QUERY_BATCH) -> list[tuple[Hashable, Hashable, float]]:
    """The pairs above ``threshold`` that link ``queries`` ``(point id, (D,) float32)`` to the
    owner's other points, by the store's batched neighbour queries (``VectorStore.neighbours``,
    :data:`QUERY_BATCH` queries a request): ``(a, b, cosine)`` with ``str(a) < str(b)``, each pair
    once, sorted.

    Raises:
        whatever ``store.neighbours`` raises (``UnusableVector``, ``StoreError``).
    """
    found: dict[tuple, float] = {}
    for i in range(0, len(queries), batch):
        part = list(queries[i:i + batch])
        for (pid, _), hits in zip(part, store.neighbours(part, k=k, threshold=threshold, owner_id=owner_id)):
            for h in hits:
                a, b = sorted((pid, h.id), key=str)
                found[(a, b)] = max(found.get((a, b), -1.0), h.score)
    return sorted(((a, b, s) for (a, b), s in found.items()), key=lambda e: (str(e[0]), str(e[1])))


def links_within(vectors: dict[Hashable, np.ndarray], threshold: float) -> list[tuple[Hashable, Hashable, float]]:
    """Every pair of a small set of points (id → ``(D,) float32`` unit vector) at or above
    ``threshold``: ``(a, b, cosine)`` with ``str(a) < str(b)``, sorted. An incremental update
    regroups the new points, their neighbours and the groups they touch, tens of points: their
    cosines are one matrix product here rather than store queries.

    Raises:
        ValueError: vectors of different sizes.
    """
    ids = sorted(vectors, key=str)
    if len(ids) < 2:
        return []
    x = np.stack([np.asarray(vectors[i], np.float32) for i in ids])
    sims = x @ x.T
    a, b = np.nonzero(np.triu(sims >= threshold, k=1))
    return [(ids[i], ids[j], float(sims[i, j])) for i, j in zip(a.tolist(), b.tolist())]


def calibrate(positives: Sequence[float], pairs: Sequence[float], *, neighbours: Sequence[float] = (),
              default: float) -> dict:
    """The near-duplicate threshold from a sample of the owner's images.

    Args:
        positives: cosines between sampled images and their own copies (re-encoded, resized,
            watermarked: the copies a person calls "the same photo"): clean positive pairs.
        pairs: cosines between sampled images, each with each other: pairs that are almost never
            copies of each other (clean, if easy, negatives).
        neighbours: each sampled image's cosine to its nearest other image in the catalogue: a
            mixture of copies already there and merely similar images, so it only informs the
            report (``neighbours_above``: how many images would have a group).

    The threshold is ``q(positives, POSITIVE_QUANTILE)``, rounded down to 4 decimals (so the share
    of copies at or above it stays at least 1 − POSITIVE_QUANTILE); when more than
    :data:`MAX_COPY_LIKE_PAIRS` of the pairs are at or above it (``separable`` False), it is
    ``q(pairs, PAIR_QUANTILE)`` instead. The catalogue's own nearest neighbours never set it: in a
    catalogue that needs this feature many of them *are* copies, and any quantile of theirs would
    follow them.

    Returns:
        ``{"threshold", "source": "calibrated" | "default", "positives", "pairs", "neighbours":
        {"n", "min", "q05", "q50", "q95", "max"}, "separable", "recall_copies" (share of positives ≥ threshold),
        "pairs_above" (share of pairs ≥ threshold), "neighbours_above"}``; ``source`` ``default`` (and
        ``threshold`` = ``default``) with fewer than :data:`MIN_CALIBRATION_SAMPLE` positives or
        pairs.
    """
    pos, prs, nbr = (np.asarray([x for x in xs if np.isfinite(x)], np.float64) for xs in (positives, pairs, neighbours))

    def stats(x: np.ndarray) -> dict:
        if not len(x):
            return {"n": 0}
        q = np.quantile(x, [0.05, 0.5, 0.95])
        return {"n": int(len(x)), "min": round(float(x.min()), 6), "q05": round(float(q[0]), 6),
                "q50": round(float(q[1]), 6), "q95": round(float(q[2]), 6), "max": round(float(x.max()), 6)}

    def above(x: np.ndarray, t: float) -> float | None:
        return round(float((x >= t).mean()), 4) if len(x) else None

    separable = None
    if len(pos) < MIN_CALIBRATION_SAMPLE or len(prs) < MIN_CALIBRATION_SAMPLE:
        threshold, source = float(default), "default"
    else:
        t = float(np.quantile(pos, POSITIVE_QUANTILE, method="lower"))  # a value the copies reach
        separable = bool((prs >= t).mean() <= MAX_COPY_LIKE_PAIRS)
        if not separable:
            t = float(np.quantile(prs, PAIR_QUANTILE))
        threshold, source = min(1.0, float(np.floor(t * 10_000) / 10_000)), "calibrated"
    return {"threshold": threshold, "source": source, "separable": separable, "positives": stats(pos),
            "pairs": stats(prs),
            "neighbours": stats(nbr), "recall_copies": above(pos, threshold), "pairs_above": above(prs, threshold),
            "neighbours_above": above(nbr, threshold)}
