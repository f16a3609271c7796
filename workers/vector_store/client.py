"""Sink stage: the Qdrant collection that holds the embeddings, and similarity search over it.

One collection per embedding space (``PipelineConfig.collection_name``: model, weights and
precision), cosine distance. An existing collection with another vector size or distance is an
error naming both; it is never recreated (recreate drops data: qdrant/qdrant#2312).

Embedded mode (``QdrantClient(path=...)``) locks its folder to one process
(qdrant/qdrant-client#1018); the ``vectors`` Celery worker is that process. Server mode
(``QdrantClient(url=...)``) runs the same code.
"""
from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Iterable, Sequence

import numpy as np
from qdrant_client import QdrantClient, models

log = logging.getLogger(__name__)

#: Points per upsert request: 256 × 512 float32 ≈ 0.5 MiB, far below the server's 32 MiB request
#: limit (qdrant/qdrant#1822) while amortising the per-request overhead.
UPSERT_BATCH = 256


class CollectionMismatch(RuntimeError):
    """An existing collection's vector size or distance differs from what the model produces."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One embedding to store: ``id`` (UUID), ``vector`` ``(D,) float32``, ``payload`` (JSON)."""

    id: uuid.UUID
    vector: np.ndarray
    payload: dict


@dataclasses.dataclass(frozen=True)
class Hit:
    """A search result: point ``id``, cosine ``score`` in [-1, 1], and the point's ``payload``."""

    id: uuid.UUID
    score: float
    payload: dict


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


class VectorStore:
    """A cosine collection of ``dim``-dimensional points.

    Args:
        client: a :class:`QdrantClient`.
        collection: collection name.
        dim: vector size D (512 for ViT-B-32).
    """

    def __init__(self, client: QdrantClient, collection: str, dim: int) -> None:
        self.client = client
        self.collection = collection
        self.dim = dim

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
            if getattr(self.client, "_client", None).__class__.__name__ != "QdrantLocal":
                for field, schema in (("owner_ids", "integer"), ("job_ids", "keyword")):
                    self.client.create_payload_index(self.collection, field, field_schema=schema)
            log.info("created collection %s (size %d, cosine)", self.collection, self.dim)
            return
        params = self.client.get_collection(self.collection).config.params.vectors
        if params.size != self.dim or params.distance != models.Distance.COSINE:
            raise CollectionMismatch(
                f"collection {self.collection!r} has vectors of size {params.size} with distance "
                f"{params.distance.value}, but this model produces size {self.dim} with distance Cosine; "
                f"use another collection (model/weights/precision) or migrate it, it is never recreated"
            )

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
        if not self.client.collection_exists(self.collection):
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
