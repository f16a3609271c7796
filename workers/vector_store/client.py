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

from workers.vector_store import UPSERT_BATCH, Hit, Point, VectorStore, mismatch

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
    """

    def __init__(self, client: QdrantClient, collection: str, dim: int) -> None:
        self.client = client
        self.collection = collection
        self.dim = dim
        self.kind = "local" if client._client.__class__.__name__ == "QdrantLocal" else "server"

    def ensure_collection(self) -> None:
        """Create the collection if missing; check size and distance if present.

        Raises:
            CollectionMismatch: the collection exists with another size or distance.
        """
        if not self.client.collection_exists(self.collection):
            self.client.create_collection(
                self.collection,
                vectors_config=models.VectorParams(size=self.dim, distance=models.Distance.COSINE),
            )
            if self.kind == "server":  # local mode has no payload indexes (it scans)
                for field, schema in (("owner_ids", "integer"), ("job_ids", "keyword")):
                    self.client.create_payload_index(self.collection, field, field_schema=schema)
            log.info("created collection %s (size %d, cosine)", self.collection, self.dim)
            return
        params = self.client.get_collection(self.collection).config.params.vectors
        if params.size != self.dim or params.distance != models.Distance.COSINE:
            raise mismatch(self.collection, params.size, params.distance.value, self.dim)

    def upsert(self, points: Sequence[Point]) -> None:
        """Write points (idempotent per id), in requests of at most :data:`UPSERT_BATCH`."""
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
    ) -> list[Hit]:
        """Top-``k`` points by cosine similarity to ``vector`` ``(D,) float32``.

        Args:
            owner_id: only points whose payload ``owner_ids`` contains it (None: all owners).
            job_id: only points whose payload ``job_ids`` contains it.
            exclude: point ids to leave out (e.g. the query image itself).
        """
        must = []
        if owner_id is not None:
            must.append(models.FieldCondition(key="owner_ids", match=models.MatchValue(value=owner_id)))
        if job_id is not None:
            must.append(models.FieldCondition(key="job_ids", match=models.MatchValue(value=str(job_id))))
        must_not = [models.HasIdCondition(has_id=[str(i) for i in exclude])] if exclude else []
        flt = models.Filter(must=must or None, must_not=must_not or None) if (must or must_not) else None
        if k <= 0 or not self.client.collection_exists(self.collection):
            return []
        res = self.client.query_points(
            self.collection,
            query=np.asarray(vector, np.float32).tolist(),
            limit=k,
            query_filter=flt,
            with_payload=True,
        )
        return [Hit(id=uuid.UUID(str(p.id)), score=float(p.score), payload=p.payload or {}) for p in res.points]

    def vectors(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, np.ndarray]:
        """Stored vectors by point id; ids not present are absent from the result."""
        if not ids or not self.client.collection_exists(self.collection):
            return {}
        got = self.client.retrieve(self.collection, ids=[str(i) for i in ids], with_vectors=True)
        return {uuid.UUID(str(p.id)): np.asarray(p.vector, np.float32) for p in got}

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
