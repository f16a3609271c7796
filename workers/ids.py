"""Deterministic point ids: the same bytes embedded by the same model always get the same id.

So a redelivered chunk rewrites its points instead of adding duplicates (Qdrant upsert is
idempotent per id), and Qdrant's id rule (unsigned integer or UUID, qdrant/qdrant-client#293) holds.
"""
from __future__ import annotations

import hashlib
import uuid

#: Fixed namespace for uuid5 point ids (uuid5(NAMESPACE_URL, "clip-embeddings/points")). Never change.
POINT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "clip-embeddings/points")


def point_id(sha256: str, model_id: str) -> uuid.UUID:
    """UUIDv5 of ``"<model_id>:<sha256>"``.

    Args:
        sha256: 64 lowercase hex characters of the image bytes.
        model_id: :attr:`workers.config.PipelineConfig.model_id`.

    Raises:
        ValueError: ``sha256`` is not 64 hex characters.
    """
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"sha256 must be 64 lowercase hex characters, got {sha256!r}")
    return uuid.uuid5(POINT_NAMESPACE, f"{model_id}:{sha256}")


def sha256_hex(data: bytes) -> str:
    """Lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
