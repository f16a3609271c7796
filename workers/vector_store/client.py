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
from workers.vector_store import (UPSERT_BATCH, Hit, Point, VectorStore, mismatch, require_usable, usable_hits,
                                  usable_vectors)
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
    ) -> list[Hit]:
        """Top-``k`` points by cosine similarity to ``vector`` ``(D,) float32`` (see
        :meth:`VectorStore.search`: owner, job, exclusions and ``where`` inside the query)."""
        screen.require_usable(vector, "query vector")
        flt = to_client(where, owner_id=owner_id, job_id=job_id, exclude=exclude)
        if k <= 0 or not self.client.collection_exists(self.collection):
            return []
        res = self.client.query_points(
            self.collection,
            query=np.asarray(vector, np.float32).tolist(),
            limit=k,
            query_filter=flt,
            with_payload=True,
            with_vectors=with_vectors,
        )
        # local mode scores a stored NaN vector NaN, and ranks it first
        return usable_hits(Hit(id=uuid.UUID(str(p.id)), score=float(p.score), payload=p.payload or {},
                               vector=np.asarray(p.vector, np.float32) if with_vectors else None) for p in res.points)

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
