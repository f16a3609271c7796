"""The ``local`` and ``server`` backends: a Qdrant collection through qdrant-client.

Local mode (``QdrantClient(path=...)``) is pure Python: a linear scan, each point pickled into
SQLite, its folder locked to one process (qdrant/qdrant-client#1018). Server mode
(``QdrantClient(url=...)``) runs the same code against a Qdrant server.
"""
from __future__ import annotations

import logging
import uuid
from typing import Iterable, Sequence

import numpy as np
from qdrant_client import QdrantClient, models

from workers import screen
from workers.vector_store import (DEFAULT_STRATEGY, UPSERT_BATCH, Hit, Point, VectorStore, average_vector,
                                  candidate_pool, check_diversity, check_examples, check_neighbours, mismatch, others,
                                  require_usable, usable_hits, usable_vectors)
from workers.vector_store.filters import Where, payload_indexes, to_client

log = logging.getLogger(__name__)


def open_client(*, url: str | None, path: str | None) -> QdrantClient:
    """Server mode when ``url`` is set, else embedded mode in folder ``path`` (created if needed).

    Raises:
        ValueError: neither is given.
        RuntimeError: the embedded folder is already owned by another process.
    """
    if url:
        return QdrantClient(url=url, timeout=30)
    if not path:
        raise ValueError("either a Qdrant url or an embedded-mode folder path is needed")
    return QdrantClient(path=path)


class QdrantClientStore(VectorStore):
    """A cosine collection of ``dim``-dimensional points through qdrant-client (local or server).

    Args:
        client: a :class:`QdrantClient` (:func:`open_client`).
        collection: collection name.
        dim: vector size D (512 for ViT-B-32).
        indexed_fields: metadata field → index type (``filters.INDEX_TYPES``): server mode keeps a
            payload index on ``items[].m.<field>`` for each (local mode scans and has none).

    Raises:
        ValueError: a bad field name or index type in ``indexed_fields``.
    """

    def __init__(self, client: QdrantClient, collection: str, dim: int, *,
                 indexed_fields: dict[str, str] | None = None) -> None:
        self.client = client
        self.collection = collection
        self.dim = dim
        self.kind = "local" if client._client.__class__.__name__ == "QdrantLocal" else "server"
        self.indexes = {"owner_ids": "integer", "job_ids": "keyword", **payload_indexes(indexed_fields)}

    def ensure_collection(self) -> None:
        """Create the collection if missing; check size and distance if present; in server mode,
        create the payload indexes it lacks (``owner_ids``, ``job_ids``, ``items[].owner``, the
        declared metadata fields) or whose declared type changed.

        Raises:
            CollectionMismatch: the collection exists with another size or distance.
        """
        if not self.client.collection_exists(self.collection):
            self.client.create_collection(
                self.collection,
                vectors_config=models.VectorParams(size=self.dim, distance=models.Distance.COSINE),
            )
            log.info("created collection %s (size %d, cosine)", self.collection, self.dim)
            info = None
        else:
            info = self.client.get_collection(self.collection)
            params = info.config.params.vectors
            if params.size != self.dim or params.distance != models.Distance.COSINE:
                raise mismatch(self.collection, params.size, params.distance.value, self.dim)
        if self.kind != "server":  # local mode has no payload indexes (it scans)
            return
        have = {path: schema.data_type.value for path, schema in (info.payload_schema if info else {}).items()}
        for path, schema in self.indexes.items():
            if have.get(path) != schema:  # creating over an existing index of another type replaces it
                self.client.create_payload_index(self.collection, path, field_schema=schema, wait=True)

    def upsert(self, points: Sequence[Point]) -> None:
        """Write points (idempotent per id), in requests of at most :data:`UPSERT_BATCH`.

        Raises:
            UnusableVector: a vector that is not finite or is all zeros (nothing of the call is
                written; local mode would refuse NaN mid-call and keep an infinity as NaN).
        """
        require_usable(points)
        for i in range(0, len(points), UPSERT_BATCH):
            chunk = points[i : i + UPSERT_BATCH]
            self.client.upsert(
                self.collection,
                points=[
                    models.PointStruct(id=str(p.id), vector=np.asarray(p.vector, np.float32).tolist(), payload=p.payload)
                    for p in chunk
                ],
                wait=True,
            )

    def search(
        self,
        vector: np.ndarray,
        *,
        k: int,
        owner_id: int | None = None,
        job_id: str | None = None,
        exclude: Iterable[uuid.UUID] = (),
        where: Where | None = None,
        with_vectors: bool = False,
        diversity: float = 0.0,
        candidates: int | None = None,
    ) -> list[Hit]:
        """Top-``k`` points by cosine similarity to ``vector`` ``(D,) float32`` (see
        :meth:`VectorStore.search`: owner, job, exclusions and ``where`` inside the query;
        ``diversity`` > 0: ``NearestQuery(mmr=Mmr(diversity, candidates_limit))``)."""
        screen.require_usable(vector, "query vector")
        check_diversity(diversity, candidates)
        flt = to_client(where, owner_id=owner_id, job_id=job_id, exclude=exclude)
        if k <= 0 or not self.client.collection_exists(self.collection):
            return []
        return self._query(query_request(vector, k=k, diversity=diversity, candidates=candidates), flt, k,
                           with_vectors)

    def recommend(self, positive: Sequence[np.ndarray], negative: Sequence[np.ndarray] = (), *, k: int,
                  strategy: str = DEFAULT_STRATEGY, owner_id: int | None = None, job_id: str | None = None,
                  exclude: Iterable[uuid.UUID] = (), where: Where | None = None, with_vectors: bool = False,
                  diversity: float = 0.0, candidates: int | None = None) -> list[Hit]:
        """Top-``k`` points for several examples (see :meth:`VectorStore.recommend`): qdrant-client's
        ``RecommendQuery`` of ``strategy`` (:func:`recommend_request`)."""
        check_examples(positive, negative, strategy, diversity, candidates)
        flt = to_client(where, owner_id=owner_id, job_id=job_id, exclude=exclude)
        if k <= 0 or not self.client.collection_exists(self.collection):
            return []
        return self._query(recommend_request(positive, negative, strategy=strategy, k=k, diversity=diversity,
                                             candidates=candidates, where=flt), flt, k, with_vectors)

    def _query(self, request: dict, flt, k: int, with_vectors: bool) -> list[Hit]:
        if isinstance(request.get("prefetch"), models.Prefetch):
            request["prefetch"].filter = flt  # the pool is drawn from the matching points only
        res = self.client.query_points(self.collection, **request, limit=k, query_filter=flt, with_payload=True,
                                       with_vectors=with_vectors)
        # local mode scores a stored NaN vector NaN, and ranks it first
        return usable_hits(Hit(id=uuid.UUID(str(p.id)), score=float(p.score), payload=p.payload or {},
                               vector=np.asarray(p.vector, np.float32) if with_vectors else None) for p in res.points)

    def neighbours(self, queries: Sequence[tuple[uuid.UUID, np.ndarray]], *, k: int, threshold: float,
                   owner_id: int | None = None) -> list[list[Hit]]:
        """Near neighbours of each query point (see :meth:`VectorStore.neighbours`): one
        ``query_batch_points`` of queries with ``score_threshold`` under the owner filter, ``k + 1``
        each with the query's own point dropped (as :class:`~workers.vector_store.edge.EdgeStore`)."""
        check_neighbours(queries, threshold)
        if k <= 0 or not queries or not self.client.collection_exists(self.collection):
            return [[] for _ in queries]
        flt = to_client(None, owner_id=owner_id)
        requests = [models.QueryRequest(query=np.asarray(v, np.float32).tolist(), limit=k + 1, score_threshold=threshold,
                                        filter=flt, with_payload=False) for _, v in queries]
        got = self.client.query_batch_points(self.collection, requests=requests)
        return [others(pid, usable_hits(Hit(id=uuid.UUID(str(p.id)), score=float(p.score), payload={})
                                        for p in res.points), k)
                for (pid, _), res in zip(queries, got)]

    def page(self, *, limit: int, offset: uuid.UUID | None = None,
             owner_id: int | None = None) -> tuple[list[Point], uuid.UUID | None]:
        """One page of points in id order (see :meth:`VectorStore.page`)."""
        if not self.client.collection_exists(self.collection):
            return [], None
        flt = to_client(None, owner_id=owner_id) if owner_id is not None else None
        got, nxt = self.client.scroll(self.collection, limit=limit, offset=None if offset is None else str(offset),
                                      scroll_filter=flt, with_payload=True, with_vectors=True)
        return ([Point(uuid.UUID(str(p.id)), np.asarray(p.vector, np.float32), p.payload or {}) for p in got],
                None if nxt is None else uuid.UUID(str(nxt)))

    def vectors(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, np.ndarray]:
        """Stored vectors by point id; ids not present, and unusable vectors
        (``VectorStore.vectors``), are absent from the result."""
        if not ids or not self.client.collection_exists(self.collection):
            return {}
        got = self.client.retrieve(self.collection, ids=[str(i) for i in ids], with_vectors=True)
        return usable_vectors({uuid.UUID(str(p.id)): np.asarray(p.vector, np.float32) for p in got})

    def payloads(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, dict]:
        """Stored payloads by point id; ids not present are absent from the result."""
        if not ids or not self.client.collection_exists(self.collection):
            return {}
        got = self.client.retrieve(self.collection, ids=[str(i) for i in ids], with_payload=True)
        return {uuid.UUID(str(p.id)): p.payload or {} for p in got}

    def scroll(self, *, batch: int = UPSERT_BATCH) -> Iterable[list[Point]]:
        """Every stored point with its vector and payload, in batches of at most ``batch``."""
        if not self.client.collection_exists(self.collection):
            return
        offset = None
        while True:
            got, offset = self.client.scroll(self.collection, limit=batch, offset=offset, with_payload=True,
                                              with_vectors=True)
            if got:
                yield [Point(uuid.UUID(str(p.id)), np.asarray(p.vector, np.float32), p.payload or {}) for p in got]
            if offset is None:
                return

    def delete(self, ids: Sequence[uuid.UUID]) -> None:
        """Remove points by id (absent ids are ignored)."""
        if ids and self.client.collection_exists(self.collection):
            self.client.delete(self.collection, points_selector=models.PointIdsList(points=[str(i) for i in ids]))

    def set_payloads(self, payloads: dict[uuid.UUID, dict]) -> None:
        """Replace the payload of existing points."""
        for pid, payload in payloads.items():
            self.client.overwrite_payload(self.collection, payload=payload, points=[str(pid)])

    def count(self) -> int:
        """Exact number of points (0 when the collection does not exist)."""
        if not self.client.collection_exists(self.collection):
            return 0
        return self.client.count(self.collection, exact=True).count


def query_request(vector: np.ndarray, *, k: int, diversity: float = 0.0, candidates: int | None = None) -> dict:
    """``query_points`` arguments of a top-``k`` search by ``vector``: the vector itself, or with
    ``diversity`` > 0 a ``NearestQuery`` with ``Mmr(diversity, candidates_limit)`` (the pool:
    :func:`candidate_pool`)."""
    v = np.asarray(vector, np.float32).tolist()
    if diversity <= 0:
        return {"query": v}
    return {"query": models.NearestQuery(nearest=v, mmr=models.Mmr(diversity=diversity,
                                                                   candidates_limit=candidate_pool(k, candidates)))}


def recommend_request(positive: Sequence[np.ndarray], negative: Sequence[np.ndarray], *, strategy: str, k: int,
                      diversity: float = 0.0, candidates: int | None = None, where=None) -> dict:
    """``query_points`` arguments of a multi-example query (``VectorStore.recommend``): a
    ``RecommendQuery`` of raw vectors and ``strategy``; with ``diversity`` > 0 that query becomes a
    ``Prefetch`` of the candidate pool (filtered by ``where``, a qdrant-client ``Filter``) re-ranked
    by ``NearestQuery(average_vector, mmr=Mmr(...))``, as :class:`~workers.vector_store.edge.EdgeStore` does."""
    recommend = models.RecommendQuery(recommend=models.RecommendInput(
        positive=[np.asarray(v, np.float32).tolist() for v in positive],
        negative=[np.asarray(v, np.float32).tolist() for v in negative],
        strategy=models.RecommendStrategy(strategy)))
    if diversity <= 0:
        return {"query": recommend}
    relevance = average_vector(positive, negative)
    pool = candidate_pool(k, candidates)
    return {"prefetch": models.Prefetch(query=recommend, limit=pool, filter=where),
            "query": models.NearestQuery(nearest=relevance.tolist(),
                                         mmr=models.Mmr(diversity=diversity, candidates_limit=pool))}
