"""Stored vectors for image rows: which point of an embedding space holds a row's vector, and
reading those points' vectors from the store, one store call for a whole page of rows.

The web process never opens the embedded store: the read is the ``point_vectors`` store task,
run by the vectors worker (or here, against a Qdrant server: ``embeddings.sink.store_call``).
Used by ``include=vector`` on the image endpoints and by the exports (``services.exports``).
"""
from __future__ import annotations

import uuid
from typing import Iterable, Sequence

import numpy as np
from django.db.models import Q, QuerySet

from embeddings import sink
from embeddings.messages import decode_vector
from embeddings.models import Image, ImageStatus
from workers.ids import point_id

#: The rows that hold a vector: embedded ones, and skipped duplicates whose original is embedded
#: (they share its point: same bytes, same model). A skipped row whose original is still queued,
#: or gone, has none yet.
HOLDS_VECTOR = Q(status=ImageStatus.EMBEDDED) | Q(status=ImageStatus.SKIPPED,
                                                 duplicate_of__status=ImageStatus.EMBEDDED)


def holding_vectors(images: QuerySet[Image]) -> QuerySet[Image]:
    """``images`` restricted to the rows that hold a vector (:data:`HOLDS_VECTOR`)."""
    return images.filter(HOLDS_VECTOR)


def holds_vector(im: Image) -> bool:
    """:data:`HOLDS_VECTOR` for one row (reads ``im.duplicate_of`` for a skipped row)."""
    if im.status == ImageStatus.EMBEDDED:
        return True
    return (im.status == ImageStatus.SKIPPED and im.duplicate_of_id is not None
            and im.duplicate_of.status == ImageStatus.EMBEDDED)


def points_in_space(rows: Iterable[tuple[str, str, str]], *, model_id: str) -> dict[str, uuid.UUID]:
    """The point of each row in space ``model_id``, for rows that hold a vector there.

    A row's point in a space is ``uuid5(space, sha256)`` (``workers.ids.point_id``). A row embedded
    in that space has it; a row from another space (before a model switch) has it once some row of
    the same bytes is embedded in that space (its migration copy, or another upload of the bytes),
    the rule ``services.interactive.search`` applies to a search by id. One query for all the rows of another
    space, none when every row is of ``model_id``.

    Args:
        rows: ``(image id, sha256, the row's model_id)`` of rows that hold a vector (:data:`HOLDS_VECTOR`).

    Returns:
        ``{image id: point id}``; rows with no vector in the space are absent.
    """
    rows = list(rows)
    foreign = {sha for _, sha, m in rows if m != model_id}
    present = set(Image.objects.filter(model_id=model_id, sha256__in=foreign, status=ImageStatus.EMBEDDED)
                  .values_list("sha256", flat=True).distinct()) if foreign else set()
    return {i: point_id(sha, model_id) for i, sha, m in rows if m == model_id or sha in present}


def point_vectors(point_ids: Sequence[uuid.UUID], *, model_id: str) -> dict[uuid.UUID, np.ndarray]:
    """The stored vectors of ``point_ids`` in space ``model_id``: one store call (none for no ids).

    Returns:
        ``{point id: (D,) float32}``, exactly the stored values (bit for bit); points not in the
        store are absent.

    Raises:
        ApplicationError: the store or its worker is unavailable (503 ``vectors_unavailable``,
            ``broker_unavailable``, ``worker_error``: ``embeddings.sink.store_call``).
    """
    wanted = list(dict.fromkeys(str(p) for p in point_ids))  # shared points asked once, order kept
    if not wanted:
        return {}
    out = sink.store_call("point_vectors", wanted, model_id)
    matrix = decode_vector(out["vectors"]).reshape(len(out["ids"]), out["dim"])
    return {uuid.UUID(p): matrix[i] for i, p in enumerate(out["ids"])}


def image_vectors(images: Sequence[Image], *, model_id: str) -> dict[str, np.ndarray]:
    """The vectors of ``images`` (rows, any owner) in space ``model_id``, one store call for all.

    Returns:
        ``{image id (str): (D,) float32}``; an image with no vector in the space (not embedded yet,
        failed, embedded only in another space, or its point gone) is absent. No store call when
        none holds one.

    Raises:
        ApplicationError: the store is unavailable (503: :func:`point_vectors`).
    """
    points = points_in_space(((str(im.id), im.sha256, im.model_id) for im in images if holds_vector(im)),
                             model_id=model_id)
    vectors = point_vectors(list(points.values()), model_id=model_id)
    return {i: vectors[p] for i, p in points.items() if p in vectors}
