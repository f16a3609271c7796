"""Sink stage: the collection that holds the embeddings, and similarity search over it.

One interface, :class:`VectorStore`, three backends chosen by ``kind`` (``VECTOR_STORE``):

- ``edge`` (default): Qdrant's own engine in-process (``qdrant-edge-py``, :mod:`.edge`): segments,
  HNSW, payload indexes, a write-ahead log. One shard folder per collection.
- ``local``: qdrant-client's local mode (:mod:`.client`): pure Python, a linear scan, points
  pickled into SQLite. Kept for installations that have not moved yet (``manage.py store_migrate``).
- ``server``: a Qdrant server through qdrant-client (``QDRANT_URL``).

All three take the same point ids (UUIDs), payloads (``sha256``, ``owner_ids``, ``job_ids``, ``items``:
one per image the point stands for), filters (owner, job, excluded ids, and a metadata filter on
the items, :mod:`.filters`, applied inside the vector query) and collection name (``PipelineConfig.collection_name``:
model, weights and precision; cosine distance). An existing collection with another vector size or
distance is a :class:`CollectionMismatch` naming both; nothing is ever recreated (recreate drops
data: qdrant/qdrant#2312). The embedded backends lock their folder to one process
(qdrant/qdrant-client#1018, the edge WAL lock); the ``vectors`` Celery worker is that process.

Every backend keeps one rule on vectors that are not finite or are all zeros (``workers.screen``):
it never writes one (``upsert`` refuses the call), never searches with one (``search`` refuses
it), and never hands one out (``vectors`` leaves such a point out as if absent, ``search`` drops a
hit whose score or vector is not finite), so a point written before that rule existed breaks
neither a search nor an export. ``scroll`` alone gives every point as stored (copies decide).
"""
from __future__ import annotations

import abc
import dataclasses
import uuid
from typing import Iterable, Sequence

import numpy as np

from workers import screen
from workers.screen import UnusableVector
from workers.vector_store.filters import Where

#: Points per write request: 256 × 512 float32 ≈ 0.5 MiB, far below the server's 32 MiB request
#: limit (qdrant/qdrant#1822) while amortising the per-request overhead.
UPSERT_BATCH = 256

#: Backend names accepted by :func:`open_store` (``VECTOR_STORE``).
KINDS = ("edge", "local", "server")

#: How a multi-example query (:meth:`VectorStore.recommend`) scores a point, Qdrant's names
#: (``RecommendStrategy``): ``best_score``: the best similarity to a positive when it beats the best
#: to a negative, mapped into (0, 1) by ``s(x) = (x / (1 + |x|) + 1) / 2``, else ``-s(best negative)``
#: (so every point nearer a negative ranks below every point nearer a positive); ``sum_scores``: the
#: sum of cosines to the positives minus the sum to the negatives; ``average_vector``: plain cosine to
#: ``2·mean(positives) − mean(negatives)`` (``mean(positives)`` without negatives).
STRATEGIES = ("best_score", "sum_scores", "average_vector")

#: A multi-example query's strategy when none is given: ``best_score`` keeps several distinct
#: positives apart (a point near any one of them ranks high) and pushes away whatever is nearer a
#: negative than to every positive, where averaging blurs distinct examples into one direction.
DEFAULT_STRATEGY = "best_score"


def average_vector(positive: Sequence[np.ndarray], negative: Sequence[np.ndarray]) -> np.ndarray:
    """Qdrant's ``average_vector`` query (``avg_vector_for_recommendation``): ``mean(positive)``
    without negatives, else ``2·mean(positive) − mean(negative)``; ``(D,) float32``. It is also the
    relevance direction MMR uses for a diverse multi-example query.

    Raises:
        ValueError: ``positive`` is empty.
    """
    if not len(positive):
        raise ValueError("a multi-example query needs at least one positive example")
    pos = np.mean(np.asarray(positive, np.float32), axis=0)
    if not len(negative):
        return pos.astype(np.float32)
    return (pos + pos - np.mean(np.asarray(negative, np.float32), axis=0)).astype(np.float32)


def check_examples(positive: Sequence[np.ndarray], negative: Sequence[np.ndarray], strategy: str,
                   diversity: float, candidates: int | None) -> None:
    """Check a multi-example query's arguments before any engine call.

    Raises:
        ValueError: no positive, an unknown strategy, ``diversity`` outside [0, 1], ``candidates`` < 1.
        UnusableVector: an example vector that is not finite or is all zeros; with
            ``average_vector`` or a diversity, their :func:`average_vector` (examples that cancel out).
    """
    if not len(positive):
        raise ValueError("a multi-example query needs at least one positive example")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    check_diversity(diversity, candidates)
    for i, v in enumerate(positive):
        screen.require_usable(v, f"positive example {i}")
    for i, v in enumerate(negative):
        screen.require_usable(v, f"negative example {i}")
    if strategy == "average_vector" or diversity > 0:  # the query (or MMR's relevance) direction
        screen.require_usable(average_vector(positive, negative), "the examples' average vector")


def check_diversity(diversity: float, candidates: int | None) -> None:
    """Raises ValueError for ``diversity`` outside [0, 1] or ``candidates`` below 1."""
    if not 0.0 <= diversity <= 1.0:
        raise ValueError(f"diversity must be in [0, 1], got {diversity}")
    if candidates is not None and candidates < 1:
        raise ValueError(f"candidates must be at least 1, got {candidates}")


def candidate_pool(k: int, candidates: int | None) -> int:
    """The points MMR re-ranks: ``candidates`` when given, else :func:`default_candidates`;
    never fewer than ``k``."""
    return max(k, candidates if candidates is not None else default_candidates(k))


def default_candidates(k: int) -> int:
    """The default MMR candidate pool of a top-``k`` query: ``max(100, 10·k)``: wide enough that
    MMR can trade a near-duplicate for a different point (Qdrant's own default, ``limit``, only
    reorders the top k), small enough that its pairwise similarities stay ≤ 100·k."""
    return max(100, 10 * k)


class CollectionMismatch(RuntimeError):
    """An existing collection's vector size or distance differs from what the model produces."""


class StoreError(OSError):
    """The store could not do a write or read for a systemic reason (I/O, lock, engine error).

    An ``OSError``, so the pipeline's retry-with-backoff path (``queues.store_writes.STORE_ERRORS``) treats it
    like a lost connection to a server.
    """


@dataclasses.dataclass(frozen=True)
class Point:
    """One embedding to store: ``id`` (UUID), ``vector`` ``(D,) float32``, ``payload`` (JSON)."""

    id: uuid.UUID
    vector: np.ndarray
    payload: dict


@dataclasses.dataclass(frozen=True)
class Hit:
    """A search result: point ``id``, cosine ``score`` in [-1, 1], the point's ``payload``, and its
    stored ``vector`` ``(D,) float32`` when the search asked for it (``with_vectors``), else None."""

    id: uuid.UUID
    score: float
    payload: dict
    vector: np.ndarray | None = None


def mismatch(collection: str, size: int, distance: str, dim: int) -> CollectionMismatch:
    """The error for an existing collection of ``size``/``distance`` where ``dim``/Cosine is needed."""
    return CollectionMismatch(
        f"collection {collection!r} has vectors of size {size} with distance {distance}, but this model "
        f"produces size {dim} with distance Cosine; use another collection (model/weights/precision) or "
        f"migrate it, it is never recreated"
    )


class VectorStore(abc.ABC):
    """A cosine collection of ``dim``-dimensional points (the contract every backend keeps).

    Attributes:
        collection: collection name. ``dim``: vector size D (512 for ViT-B-32). ``kind``: one of
        :data:`KINDS`. ``client``: the engine handle (``QdrantClient`` or ``qdrant_edge.EdgeShard``);
        both have ``close()``.
    """

    kind: str
    collection: str
    dim: int

    @abc.abstractmethod
    def ensure_collection(self) -> None:
        """Create the collection if missing (with its payload indexes); check size and distance if present.

        Raises:
            CollectionMismatch: the collection exists with another size or distance.
        """

    @abc.abstractmethod
    def upsert(self, points: Sequence[Point]) -> None:
        """Write points (idempotent per id). Returns once the points are durable as the backend's
        contract says (docs/operations.md, "Vector store durability"): searchable and kept across a
        crash of this process.

        Raises:
            StoreError / ConnectionError: a systemic failure (retried by the pipeline).
            ValueError: a vector of the wrong size; :class:`UnusableVector` (a ``ValueError``,
                raised before anything is written): a vector that is not finite or is all zeros.
        """

    @abc.abstractmethod
    def search(self, vector: np.ndarray, *, k: int, owner_id: int | None = None, job_id: str | None = None,
               exclude: Iterable[uuid.UUID] = (), where: Where | None = None,
               with_vectors: bool = False, diversity: float = 0.0, candidates: int | None = None) -> list[Hit]:
        """Top-``k`` points by cosine similarity to ``vector`` ``(D,) float32``, best first.

        ``diversity`` > 0: the engine's maximal marginal relevance (Qdrant ``Mmr``, lambda =
        1 − diversity) picks the ``k`` among the ``candidates`` nearest matching points
        (:func:`candidate_pool`): first the nearest, then each time the one maximising
        ``(1 − diversity)·cos(query, p) − diversity·max cos(p, picked)``; hits keep their cosine to
        ``vector`` as score, in the order picked. 0: the plain top-k (no MMR stage at all).

        Every condition is part of the vector query (a Qdrant payload filter), never applied to its
        results: ``k`` hits whenever at least ``k`` points match (exact search; see the backend).

        Args:
            owner_id: only points with an image of this owner (None: all owners).
            job_id: only points with an image of this job.
            exclude: point ids to leave out (e.g. the query image itself).
            where: a metadata filter (:mod:`.filters`). With it, a point matches when ONE of its
                ``items`` has the owner (if given), the job (if given) and satisfies ``where``;
                :func:`.filters.matching_items` tells which. Without it, the payload's top-level
                ``owner_ids`` / ``job_ids`` decide.
            with_vectors: each hit carries its stored vector (read by the same query: no second
                look-up), exactly as :meth:`vectors` returns it.

        A hit whose score or vector is not finite (a point written before ``workers.screen``) is
        left out.

        Raises:
            UnusableVector: ``vector`` is not finite or is all zeros (no similarity is defined).
            ValueError: ``diversity`` outside [0, 1], ``candidates`` < 1.
        """

    @abc.abstractmethod
    def recommend(self, positive: Sequence[np.ndarray], negative: Sequence[np.ndarray] = (), *, k: int,
                  strategy: str = DEFAULT_STRATEGY, owner_id: int | None = None, job_id: str | None = None,
                  exclude: Iterable[uuid.UUID] = (), where: Where | None = None, with_vectors: bool = False,
                  diversity: float = 0.0, candidates: int | None = None) -> list[Hit]:
        """Top-``k`` points for several examples (each ``(D,) float32``), by the engine's own
        recommend query of ``strategy`` (:data:`STRATEGIES`), best first; owner, job, exclusions and
        ``where`` inside the query as in :meth:`search`.

        Scores are the strategy's: ``best_score`` in (-1, 1), ``sum_scores`` in
        [-(P+N), P+N], ``average_vector`` a cosine. ``diversity`` > 0: the ``candidates`` best
        points by the strategy (:func:`candidate_pool`) re-ranked by MMR as in :meth:`search`,
        relevance being the cosine to :func:`average_vector` of the examples, which then is each
        hit's score. 0: the plain top-k of the strategy.

        Raises:
            ValueError: no positive, an unknown strategy, ``diversity`` outside [0, 1].
            UnusableVector: an example, or (``average_vector``, or with diversity) the examples'
                average vector, is not finite or is all zeros.
        """

    @abc.abstractmethod
    def neighbours(self, queries: Sequence[tuple[uuid.UUID, np.ndarray]], *, k: int, threshold: float,
                   owner_id: int | None = None) -> list[list[Hit]]:
        """For each query ``(point id, vector (D,) float32)``, the at most ``k`` other points whose
        cosine to the vector is at least ``threshold``, best first (the query's own point left out
        by the filter), as one batched engine request (edge ``query_batch``, qdrant-client
        ``query_batch_points``): the near-duplicate scan's only similarity computation
        (``workers.duplicates``). ``owner_id``: only points with an image of this owner.

        Raises:
            UnusableVector: a query vector that is not finite or is all zeros.
            ValueError: ``threshold`` outside [-1, 1].
        """

    @abc.abstractmethod
    def page(self, *, limit: int, offset: uuid.UUID | None = None,
             owner_id: int | None = None) -> tuple[list[Point], uuid.UUID | None]:
        """One page of at most ``limit`` points (vector and payload) in point-id order from
        ``offset`` (None: the first), only those with an image of ``owner_id`` when given, and the
        offset of the next page (None after the last): a scan that is resumed task by task."""

    @abc.abstractmethod
    def vectors(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, np.ndarray]:
        """Stored vectors ``(D,) float32`` by point id; ids not present, and points whose stored
        vector is not finite or is all zeros, are absent from the result."""

    @abc.abstractmethod
    def payloads(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, dict]:
        """Stored payloads by point id; ids not present are absent from the result."""

    @abc.abstractmethod
    def delete(self, ids: Sequence[uuid.UUID]) -> None:
        """Remove points by id (absent ids are ignored)."""

    @abc.abstractmethod
    def set_payloads(self, payloads: dict[uuid.UUID, dict]) -> None:
        """Replace the payload of existing points."""

    @abc.abstractmethod
    def count(self) -> int:
        """Exact number of points (0 when the collection does not exist)."""

    @abc.abstractmethod
    def scroll(self, *, batch: int = UPSERT_BATCH) -> Iterable[list[Point]]:
        """Every stored point with its vector and payload, in batches of at most ``batch`` (for
        copies), as stored: unusable vectors included (:func:`usable_points` tells them apart)."""

    def close(self) -> None:
        """Release the engine (and, embedded, the folder lock)."""
        self.client.close()


def require_usable(points: Sequence[Point]) -> np.ndarray | None:
    """Check every point's vector before a write (nothing is written unless all pass).

    Returns:
        The vectors stacked, ``(len(points), D) float32`` (what a store sends on), or ``None`` when
        their sizes differ (or there are none): each is screened alone, and the store names the size.

    Raises:
        UnusableVector: a vector that is not finite or is all zeros (naming its point).
    """
    if not points:
        return None
    # one screen of the whole call (a chunk's slice: tens to hundreds of points), then the first
    # refused point named as screen.require_usable names it
    rows = [np.asarray(p.vector, np.float32).reshape(-1) for p in points]
    matrix = None
    if len({r.shape for r in rows}) == 1:
        matrix = np.stack(rows)
        reasons = screen.faults(matrix)
        points = [p for p, r in zip(points, reasons) if r is not None]
    for p in points:  # the refused ones (every one when the sizes differ: the store names the size)
        screen.require_usable(p.vector, f"point {p.id}")
    return matrix


def usable_points(points: Sequence[Point]) -> tuple[list[Point], list[Point]]:
    """``(points whose vector is usable, the others)``, each in the given order."""
    reasons = screen.faults(np.stack([np.asarray(p.vector, np.float32) for p in points])) if points else []
    return [p for p, r in zip(points, reasons) if r is None], [p for p, r in zip(points, reasons) if r is not None]


def usable_hits(hits: Iterable[Hit]) -> list[Hit]:
    """``hits`` without those whose score, or vector when it was read, is not finite."""
    return [h for h in hits if np.isfinite(h.score) and (h.vector is None or bool(np.isfinite(h.vector).all()))]


def usable_vectors(found: dict[uuid.UUID, np.ndarray]) -> dict[uuid.UUID, np.ndarray]:
    """``found`` without the vectors that are not finite or are all zeros."""
    return {pid: v for pid, v in found.items() if screen.usable(v)}


def check_neighbours(queries: Sequence[tuple[uuid.UUID, np.ndarray]], threshold: float) -> None:
    """Check a :meth:`VectorStore.neighbours` call before any engine call.

    Raises:
        ValueError: ``threshold`` outside [-1, 1]. UnusableVector: a query vector that is not
            finite or is all zeros.
    """
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"a cosine threshold must be in [-1, 1], got {threshold}")
    for pid, v in queries:
        screen.require_usable(v, f"point {pid}")


def others(point: uuid.UUID, hits: list[Hit], k: int) -> list[Hit]:
    """The first ``k`` of ``hits`` that are not ``point`` itself (a neighbour query asks ``k + 1``
    under one filter shared by the whole batch, and drops the query's own point here)."""
    return [h for h in hits if h.id != point][:k]


def open_store(kind: str, *, collection: str, dim: int, url: str | None = None, path: str | None = None,
               fsync: bool = False, indexed_fields: dict[str, str] | None = None) -> VectorStore:
    """The :class:`VectorStore` of backend ``kind``, not yet checked (call ``ensure_collection``).

    Args:
        kind: ``edge`` (folder ``path``, one shard per collection under it), ``local`` (qdrant-client
            local mode in folder ``path``) or ``server`` (``url``).
        fsync: edge only: flush to disk before a write returns (survives a power loss, not only a
            killed process; docs/operations.md). Off: a write returns after the WAL append.
        indexed_fields: metadata field → index type (:data:`.filters.INDEX_TYPES`; the
            ``METADATA_INDEXES`` declaration, :func:`.filters.parse_indexed_fields`): ``edge`` and
            ``server`` create a payload index on ``items[].m.<field>`` for each (local mode scans
            and has none).

    Raises:
        ValueError: an unknown ``kind``, the folder / url it needs is missing, or a bad indexed field.
        StoreError: the embedded folder is already owned by another process.
    """
    if kind == "edge":
        if not path:
            raise ValueError("the edge vector store needs a folder (QDRANT_PATH)")
        from workers.vector_store.edge import EdgeStore

        return EdgeStore(path, collection, dim, fsync=fsync, indexed_fields=indexed_fields)
    if kind in ("local", "server"):
        from workers.vector_store.client import QdrantClientStore, open_client

        if kind == "server" and not url:
            raise ValueError("VECTOR_STORE=server needs QDRANT_URL")
        client = open_client(url=url if kind == "server" else None, path=path)
        return QdrantClientStore(client, collection, dim, indexed_fields=indexed_fields)
    raise ValueError(f"unknown vector store {kind!r}: expected one of {', '.join(KINDS)}")


__all__ = ["DEFAULT_STRATEGY", "KINDS", "STRATEGIES", "UPSERT_BATCH", "average_vector", "candidate_pool",
           "check_diversity", "check_examples", "check_neighbours", "others", "default_candidates", "CollectionMismatch", "Hit", "Point", "StoreError", "UnusableVector",
           "VectorStore", "mismatch", "open_store", "require_usable", "usable_hits", "usable_points", "usable_vectors"]
