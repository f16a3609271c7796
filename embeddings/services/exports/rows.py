"""Which rows a vector export writes, and its pages: a job's, or all of a caller's (staff:
everyone's), read in keyset order (by id, :data:`PAGE_ROWS` at a time), each page's vectors from
the store in one call (``services.vectors.point_vectors``). Which rows, and what a long export sees
of concurrent changes, is :func:`export_start`'s docstring (docs/exports.md says it for users).
The files they are written into: ``exports.formats``.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator

import numpy as np
from django.db.models import QuerySet
from django.utils import timezone

from embeddings import spaces
from embeddings.errors import ApplicationError
from embeddings.models import EmbeddingSpace, Image, SpaceState
from embeddings.selectors import images_visible_to, jobs_visible_to
from embeddings.services.vectors import holding_vectors, point_vectors, points_in_space
from workers.model_config import preprocess_config

#: Rows per page: one database query and one store call each (1,000 × 512 float32 = 2 MiB of
#: vectors in a task result, well inside a Redis reply), and one Parquet row group each.
PAGE_ROWS = 1000


@dataclasses.dataclass
class Page:
    """One page of exported rows, all holding a vector: ``ids`` (UUID strings), ``external_ids``
    (None when the row has none), ``sha256s``, ``metadata`` (dicts), ``vectors`` ``(n, D) float32``."""

    ids: list[str]
    external_ids: list[str | None]
    sha256s: list[str]
    metadata: list[dict]
    vectors: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass
class VectorExport:
    """What :func:`export_start` chose: the ``space``, the ``rows`` (not yet restricted to those
    with a vector in it), the moment it began (``as_of``) and the job filter (``job_id``)."""

    space: EmbeddingSpace
    rows: QuerySet[Image]
    as_of: dt.datetime
    job_id: str | None = None
    page_rows: int = PAGE_ROWS

    def space_info(self) -> dict:
        """The space the vectors are in, written into every export: ``model_id``, ``model_name``,
        ``pretrained``, ``seed``, ``precision``, ``dim``, ``dtype`` (float32), ``distance`` (cosine),
        ``normalized`` (unit length: Qdrant stores cosine vectors normalised), ``preprocess`` (the
        architecture's open_clip preprocessing: ``workers.model_config.preprocess_config``),
        ``collection``, ``state``, ``as_of`` (ISO 8601) and ``job_id`` (None: all rows)."""

        sp = self.space
        try:
            preprocess = preprocess_config(sp.model_name)
        except ValueError:  # an architecture this installation's open_clip does not know
            preprocess = None
        return {"model_id": sp.model_id, "model_name": sp.model_name, "pretrained": sp.pretrained, "seed": sp.seed,
                "precision": sp.precision, "dim": sp.dim, "dtype": "float32", "distance": "cosine",
                "normalized": True, "preprocess": preprocess, "collection": sp.collection, "state": sp.state,
                "as_of": self.as_of.isoformat(), "job_id": self.job_id}

    def pages(self) -> Iterator[Page]:
        """The rows with a vector in the space, :attr:`page_rows` at a time in id order, each page
        with its vectors (one query and one store call per page).

        Raises:
            ApplicationError: the store is unavailable (503, ``services.vectors.point_vectors``).
        """
        model_id = self.space.model_id
        rows = holding_vectors(self.rows).order_by("id")
        after = None
        while True:
            batch = list((rows if after is None else rows.filter(id__gt=after))
                         .values_list("id", "external_id", "sha256", "model_id", "metadata")[:self.page_rows])
            if not batch:
                return
            after = batch[-1][0]
            points = points_in_space(((str(r[0]), r[2], r[3]) for r in batch), model_id=model_id)
            vectors = point_vectors(list(points.values()), model_id=model_id)
            # a row whose point is not in the store (deleted meanwhile, or not written yet) is left
            # out: every row written carries its own bytes' vector, never a placeholder
            kept = [(r, vectors[points[str(r[0])]]) for r in batch if points.get(str(r[0])) in vectors]
            if kept:
                yield Page(ids=[str(r[0]) for r, _ in kept], external_ids=[r[1] or None for r, _ in kept],
                           sha256s=[r[2] for r, _ in kept], metadata=[r[4] or {} for r, _ in kept],
                           vectors=np.stack([v for _, v in kept]).astype(np.float32, copy=False))
            if len(batch) < self.page_rows:
                return


def export_start(*, user, job_id: str | None = None, model_id: str | None = None,
                 page_rows: int = PAGE_ROWS) -> VectorExport:
    """Choose what an export writes.

    Rows: the caller's images (staff: everyone's; never migration copies), of job ``job_id`` when
    given, ``embedded`` or ``skipped`` duplicates of an embedded original (their own id, external id
    and metadata, their original's vector), that have a vector in the space, created before the
    export began (``as_of``). Rows created after it are left out; a row deleted while the export
    runs is written if its page was read before the deletion, and left out after it (its page's
    store read then finds no point, or the database no row); a ``PATCH`` shows in the rows read after
    it. No row is ever written without its vector.

    Args:
        job_id: one of the caller's jobs (any job for staff).
        model_id: the space (default: the active one); any space that is not dropped.

    Raises:
        ApplicationError: ``not_found`` (404): no such job visible to the caller, or no such space
            (or a dropped one).
    """
    if job_id is not None and not jobs_visible_to(user).filter(id=job_id).exists():
        raise ApplicationError("no such job", code="not_found", status=404, extra={"job": job_id})
    if model_id is None:
        space = spaces.active()
    else:
        space = EmbeddingSpace.objects.exclude(state=SpaceState.DROPPED).filter(model_id=model_id).first()
        if space is None:
            raise ApplicationError(f"no embedding space {model_id!r}", code="not_found", status=404,
                                   extra={"space": model_id})
    as_of = timezone.now()
    rows = images_visible_to(user).filter(created_at__lte=as_of)
    if job_id is not None:
        rows = rows.filter(job_id=job_id)
    return VectorExport(space=space, rows=rows, as_of=as_of, job_id=job_id, page_rows=page_rows)
