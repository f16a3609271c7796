"""Image services: create rows from sources (store bytes, dedupe, refuse obvious non-images), record
outcomes, delete. The database is the source of truth for every image's state."""
from __future__ import annotations

import datetime as dt
import hashlib
import logging
from typing import Iterable, Sequence

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from embeddings import runtime
from embeddings.models import Image, ImageStatus, Job
from embeddings.services.sources import SourceFile, iter_blocks
from embeddings.storage import file_key
from workers.decode import sniff_format
from workers.errors import ImageRejected, Reason
from workers.ids import point_id

log = logging.getLogger(__name__)

#: Bytes read to sniff the format before storing (magic numbers sit in the first 32 bytes).
_SNIFF_BYTES = 64


def _store(source: SourceFile) -> tuple[str, str, int, bytes]:
    """Store (or hash in place) one source → ``(storage key, sha256, size, first bytes)``.

    A source larger than ``max_image_bytes`` is hashed but not stored (key ``""``): it is refused
    ``too_large`` anyway, and must not fill the disk first.

    Raises:
        ImageRejected: the source cannot be read (a damaged zip entry).
    """
    if source.in_place is None and source.size > settings.PIPELINE.max_image_bytes:
        h, size, f = hashlib.sha256(), 0, source.open()
        for block in iter_blocks(f):
            h.update(block)
            size += len(block)
        return "", h.hexdigest(), size, b""
    f = source.open()
    head = b""

    def blocks():
        nonlocal head
        for block in iter_blocks(f):
            if len(head) < _SNIFF_BYTES:
                head += block[: _SNIFF_BYTES - len(head)]
            yield block

    try:
        if source.in_place is not None:
            h, size = hashlib.sha256(), 0
            for block in blocks():
                h.update(block)
                size += len(block)
            return file_key(source.in_place), h.hexdigest(), size, head
        key, sha, size = runtime.blob_store().put(blocks())
        return key, sha, size, head
    finally:
        if source.in_place is not None:
            f.close()


def quick_check(head: bytes, size: int) -> ImageRejected | None:
    """Refusals that need no decoding: ``empty``, ``too_large``, ``not_an_image`` (by content)."""
    if size == 0:
        return ImageRejected(Reason.EMPTY, "the file has zero bytes")
    if size > settings.PIPELINE.max_image_bytes:
        return ImageRejected(Reason.TOO_LARGE, f"{size} bytes > limit {settings.PIPELINE.max_image_bytes} bytes")
    if sniff_format(head) is None:
        return ImageRejected(Reason.NOT_AN_IMAGE, "content matches no known image format")
    return None


def images_create(
    *,
    owner,
    sources: Iterable[SourceFile],
    lane: str,
    job: Job | None = None,
    deadline: dt.datetime | None = None,
) -> list[Image]:
    """Store each source and create its :class:`Image` row, in input order.

    - Obvious non-images (empty, too large, unknown magic bytes) are created ``failed`` with the
      reason and never queued.
    - Bytes this owner already has queued or embedded under the same model are created ``skipped``
      with ``duplicate_of`` (also within the same request).
    - Everything else is ``queued``; the caller dispatches it after the transaction commits.
    """
    model_id = runtime.model_id()
    rows: list[Image] = []
    seen: dict[str, Image] = {}
    stored, unreadable = [], {}
    for src in sources:
        try:
            stored.append((src, *_store(src)))
        except ImageRejected as e:  # bad input is data: this file fails alone, with its reason
            sha = hashlib.sha256(f"unreadable:{src.name}".encode()).hexdigest()
            unreadable[len(stored)] = e
            stored.append((src, "", sha, src.size, b""))
    existing = {
        im.sha256: im
        for im in Image.objects.filter(
            owner=owner, model_id=model_id, sha256__in={s[2] for s in stored},
            status__in=(ImageStatus.QUEUED, ImageStatus.EMBEDDED),
        ).order_by("-created_at")
    }
    for n, (src, key, sha, size, head) in enumerate(stored):
        im = Image(
            owner=owner, job=job, lane=lane, sha256=sha, size_bytes=size, storage_key=key,
            original_name=src.name[:255], model_id=model_id, point_id=point_id(sha, model_id), deadline=deadline,
        )
        rejected = unreadable.get(n) or quick_check(head, size)
        original = seen.get(sha) or existing.get(sha)
        if rejected is not None:
            im.status, im.reason, im.reason_detail = ImageStatus.FAILED, rejected.reason.value, rejected.detail
        elif original is not None:
            im.status, im.duplicate_of = ImageStatus.SKIPPED, original
            im.width, im.height, im.format = original.width, original.height, original.format
        else:
            seen[sha] = im
        rows.append(im)
    with transaction.atomic():
        Image.objects.bulk_create(rows, batch_size=500)
    return rows


def images_mark_failed(failures: Sequence[tuple[str, str, str]]) -> None:
    """Record ``(image id, reason code, detail)`` for images that will not be embedded.

    Images already embedded are left alone (a redelivered task must not undo a success).
    """
    for image_id, reason, detail in failures:
        status = {
            Reason.EXPIRED.value: ImageStatus.EXPIRED,
            Reason.CANCELLED.value: ImageStatus.CANCELLED,
        }.get(reason, ImageStatus.FAILED)
        Image.objects.filter(id=image_id).exclude(status=ImageStatus.EMBEDDED).update(
            status=status, reason=reason, reason_detail=detail[:2000]
        )


def images_still_queued(image_ids: Iterable[str]) -> set[str]:
    """The ids among ``image_ids`` whose images are still ``queued``: nothing has decided them since
    their work was handed out (not cancelled, expired, failed, nor embedded by another delivery)."""
    return {str(i) for i in Image.objects.filter(id__in=list(image_ids), status=ImageStatus.QUEUED)
            .values_list("id", flat=True)}


def images_mark_embedded(items: Sequence[dict]) -> set[str]:
    """Mark images embedded after their points are written, each only if it is still ``queued``:
    a job cancelled (or an interactive request expired) while its vectors were being written keeps
    its decision. ``items``: ``{"id", "width", "height", "format"}`` dicts.

    Returns:
        The ids marked embedded now.
    """
    now = timezone.now()
    marked: set[str] = set()
    with transaction.atomic():
        for it in items:
            if Image.objects.filter(id=it["id"], status=ImageStatus.QUEUED).update(
                status=ImageStatus.EMBEDDED, reason="", reason_detail="", width=it["width"],
                height=it["height"], format=it["format"], embedded_at=now,
            ):
                marked.add(str(it["id"]))
    return marked


def point_payloads(*, model_id: str, shas: Iterable[str], including: Iterable[str] = ()) -> dict[str, dict]:
    """Qdrant payload per sha256, recomputed from the database: ``{"sha256", "owner_ids", "job_ids"}``.

    Owners and jobs come from every embedded row with those bytes under ``model_id``, plus the rows
    in ``including`` (being embedded now), so a shared point lists every owner that may see it.
    """
    shas = set(shas)
    payloads = {s: {"sha256": s, "owner_ids": set(), "job_ids": set()} for s in shas}
    rows = Image.objects.filter(model_id=model_id, sha256__in=shas).filter(
        Q(status=ImageStatus.EMBEDDED) | Q(id__in=list(including))
    ).values_list("sha256", "owner_id", "job_id")
    for sha, owner_id, job_id in rows:
        payloads[sha]["owner_ids"].add(owner_id)
        if job_id:
            payloads[sha]["job_ids"].add(str(job_id))
    return {s: {"sha256": s, "owner_ids": sorted(p["owner_ids"]), "job_ids": sorted(p["job_ids"])}
            for s, p in payloads.items()}


def image_delete(*, image: Image) -> None:
    """Delete an image row, then its vector (or its share of a vector other rows still use) and
    its blob when nothing else references it."""
    from embeddings import tasks  # the vectors worker owns the store
    from embeddings.services.calls import vectors_call

    key, was_embedded = image.storage_key, image.status == ImageStatus.EMBEDDED
    pid, sha = image.point_id, image.sha256
    image.delete()
    if was_embedded:
        vectors_call(tasks.forget_point, str(pid), sha)
    if not Image.objects.filter(storage_key=key).exists():
        runtime.blob_store().delete(key)




def images_retry(*, images) -> int:
    """Queue failed images again on the bulk lane (their job, or a new "retry" job for interactive
    uploads). Returns how many were queued."""
    from embeddings.models import Job, JobStatus
    from embeddings.services.jobs import job_dispatch

    by_job: dict = {}
    for im in images.filter(status=ImageStatus.FAILED):
        by_job.setdefault((im.job_id, im.owner_id), []).append(im)
    n = 0
    for (job_id, owner_id), group in by_job.items():
        with transaction.atomic():
            if job_id is None:
                job = Job.objects.create(owner_id=owner_id, name="retry", model_id=runtime.model_id(),
                                         chunk_size=settings.PIPELINE.batch_size, total=len(group))
            else:
                job = Job.objects.get(id=job_id)
                Job.objects.filter(id=job_id).update(status=JobStatus.RUNNING, finished_at=None)
            ids = [im.id for im in group]
            Image.objects.filter(id__in=ids).update(status=ImageStatus.QUEUED, reason="", reason_detail="", job=job)
        transaction.on_commit(lambda job=job, ids=ids: job_dispatch(job=job, image_ids=[str(i) for i in ids]))
        n += len(group)
    return n
