"""Copies of the catalogue in another embedding space: the rows a migration re-embeds, and the copy
of each new upload in every candidate and standby space (dual embedding).

A copy is an ``Image`` row under the other space's ``model_id``: same owner, bytes, storage key and
name; ``source`` = the user's row; ``point_id`` = uuid5(space, sha256). The model lifecycle
(``services.lifecycle.model_migrations``) decides when copies are made; this module makes them.
"""
from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef

from embeddings import dispatch
from embeddings.models import LIVE_ORIGINAL_STATUSES, EmbeddingSpace, Image, Job, JobKind, JobPriority, JobStatus, Lane
from workers.ids import point_id

#: Name of the per-owner job that embeds new uploads' copies in a candidate or standby space.
DUAL_JOB = "dual embedding"

def catalogue(space: EmbeddingSpace):
    """The users' live originals that ``space`` must hold a copy of: rows with no ``source`` and no
    ``duplicate_of``, queued or embedded, in any other space, and no copy in ``space`` yet. A
    catalogue row not fetched yet (no bytes, so no sha256) is not one: its copy is made when its
    bytes arrive (``fetching.rows_resolve`` → ``images.dual_copies``).

    "No copy yet" is a ``NOT EXISTS`` probe of the ``source`` index per row, not ``NOT IN`` over
    every copy: the fill reads the catalogue a batch at a time while it adds copies, and a hashed
    ``NOT IN`` re-reads all copies made so far for every batch (quadratic in the catalogue)."""
    have = Image.objects.filter(model_id=space.model_id, source=OuterRef("pk"))
    return (Image.objects.filter(source__isnull=True, duplicate_of__isnull=True, status__in=LIVE_ORIGINAL_STATUSES)
            .exclude(model_id=space.model_id).filter(~Exists(have)).exclude(sha256=""))


def copy_of(row: Image, *, space: EmbeddingSpace, job: Job) -> Image:
    return Image(owner_id=row.owner_id, job=job, lane=Lane.BULK, sha256=row.sha256, size_bytes=row.size_bytes,
                 storage_key=row.storage_key, original_name=row.original_name, model_id=space.model_id,
                 point_id=point_id(row.sha256, space.model_id), source_id=row.id,
                 key_prefix=row.key_prefix)  # metered for the key that brought the image in (docs/usage.md)


def copies_insert(copies: list[Image]) -> list[str]:
    """Insert copy rows; one whose (owner, space, bytes) has an original there already (a concurrent
    fill or upload) is left out (``ignore_conflicts``). Returns the ids inserted."""
    if not copies:
        return []
    Image.objects.bulk_create(copies, batch_size=500, ignore_conflicts=True)
    return [str(i) for i in Image.objects.filter(id__in=[c.id for c in copies]).values_list("id", flat=True)]


def catalogue_size(model_id: str) -> int:
    """How many copies a migration to ``model_id`` would create now."""
    return catalogue(EmbeddingSpace(model_id=model_id)).count()


def dual_embed(*, space: EmbeddingSpace, originals: list[Image]) -> list[str]:
    """In the caller's transaction: a copy of each new original in ``space`` (a candidate or a
    standby), in the owner's open :data:`DUAL_JOB` job of that space (reopened when done), queued on
    the bulk lane at background priority after commit. Returns the copies' ids."""
    made: list[str] = []
    by_owner: dict[int, list[Image]] = {}
    for im in originals:
        if im.model_id != space.model_id:
            by_owner.setdefault(im.owner_id, []).append(im)
    for owner_id, rows in by_owner.items():
        job = (Job.objects.select_for_update().filter(owner_id=owner_id, kind=JobKind.MIGRATION, name=DUAL_JOB,
                                                      model_id=space.model_id).exclude(status=JobStatus.CANCELLED)
               .order_by("-created_at").first())
        if job is None:
            job = Job.objects.create(owner_id=owner_id, name=DUAL_JOB, kind=JobKind.MIGRATION, model_id=space.model_id,
                                     priority=JobPriority.BACKGROUND, chunk_size=settings.PIPELINE.batch_size)
        ids = copies_insert([copy_of(im, space=space, job=job) for im in rows])
        Job.objects.filter(pk=job.pk).update(total=F("total") + len(ids))
        if job.status in (JobStatus.DONE,):
            Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, finished_at=None)
        if ids and job.status != JobStatus.PAUSED:
            transaction.on_commit(lambda job=job, ids=ids: dispatch.send_job_chunks(job=job, image_ids=ids))
        made += ids
    return made
