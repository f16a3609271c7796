"""The fetch stage of a catalogue job (issue 41): unfetched rows get their bytes, then go to the model.

A row made from a manifest or a prefix (``services.catalogue.reading``) starts queued with no bytes:
``origin`` is its http(s) URL or ``s3://bucket/key``. The fetch worker (``fetch`` queue, threads,
no model) takes a chunk of such rows (:func:`chunk_fetch`):

1. fetches every URL of the chunk at once (``workers.fetch``: timeouts, size cap while streaming,
   retries honouring ``Retry-After``, every hop's address checked against server-side request
   forgery) and reads every object (``SOURCE_COPY``: copied into the blob store; else read where it
   lives, its sha256 checked on every later read, ``source_changed`` as for folders);
2. stores fetched bytes content-addressed like uploads, so the same image behind two URLs is one
   blob and, for one owner, one original: the other row is its skipped duplicate;
3. resolves the rows in one transaction (:func:`rows_resolve`): sha256, size, point, original or
   duplicate, obvious non-images refused, the caller's id claims settled
   (``identity.claims_settle``);
4. sends the chunk's new originals to the bulk queue as an ``embed_chunk`` of the job.

A URL that cannot be fetched fails its row alone with a ``fetch_*`` reason; the chunk goes on.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time

from django.conf import settings
from django.db import IntegrityError, transaction

from embeddings import dispatch, runtime
from embeddings.models import LIVE_ORIGINAL_STATUSES, Image, ImageStatus, Job, JobStatus
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.identity import claims_settle, payloads_refresh
from embeddings.services.catalogue.images import (
    dual_copies,
    images_mark_failed,
    lock_bytes,
    make_duplicate,
    quick_check,
)
from workers.errors import ImageRejected, Reason
from workers.ids import point_id

log = logging.getLogger(__name__)

#: First bytes kept to sniff the format (magic numbers sit in the first 32 bytes).
_HEAD = 64
#: ``storage_key`` prefix of an object read where it lives (``embeddings.storage``).
OBJECT_PREFIX = "s3://"


def _fetch_one(origin: str) -> tuple[str, str, int, bytes]:
    """Bytes of one origin, stored → ``(storage key, sha256, size, first bytes)``.

    Raises:
        ImageRejected: a ``fetch_*`` reason, ``source_missing`` or ``too_large``.
    """

    store = runtime.blob_store()
    if origin.startswith(OBJECT_PREFIX):
        bucket, _, key = origin[len(OBJECT_PREFIX):].partition("/")
        data = runtime.source_object(bucket, key)
        if not settings.SOURCE_COPY:
            return origin, hashlib.sha256(data).hexdigest(), len(data), data[:_HEAD]
    else:
        data = runtime.fetcher().fetch(origin).data
    key, sha, size = store.put([data])
    return key, sha, size, data[:_HEAD]


def _fetch_all(rows: list[Image]) -> dict[str, tuple | ImageRejected]:
    """Fetch every row's origin at once (``FETCH_THREADS`` at a time; the fetcher bounds each host)
    → ``{image id: (key, sha256, size, head) | ImageRejected}``. Nothing raised here fails another row."""
    out: dict[str, tuple | ImageRejected] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(settings.FETCH_THREADS, len(rows)))) as pool:
        futures = {pool.submit(_fetch_one, r.origin): str(r.id) for r in rows}
        for f in concurrent.futures.as_completed(futures):
            try:
                out[futures[f]] = f.result()
            except ImageRejected as e:
                out[futures[f]] = e
            except Exception as e:  # a storage or client error of one object: that row's failure, with its words
                log.warning("fetching image %s failed: %s: %s", futures[f], type(e).__name__, e)
                out[futures[f]] = ImageRejected(Reason.SOURCE_MISSING, f"{type(e).__name__}: {e}")
    return out


def rows_resolve(fetched: list[tuple[Image, str, str, int, bytes]]) -> list[str]:
    """Give fetched rows their bytes' facts and decide each one, in one transaction (under the
    bytes' locks, as ``images_create`` takes them, so an upload of the same bytes at the same time
    yields one original):

    - empty, too large, or not an image by its first bytes: ``failed`` with the reason;
    - bytes the owner already has queued or embedded in the row's space (or an earlier row of this
      batch has): a ``skipped`` duplicate of that original;
    - otherwise the original of its bytes, still ``queued``, for the model.

    Rows no longer queued (cancelled meanwhile, deleted) are left alone.

    Args:
        fetched: ``(row, storage key, sha256, size, first bytes)`` per row, rows as read (queued,
            no sha256 yet).

    Returns:
        The ids of the rows that are originals to embed.
    """
    if not fetched:
        return []
    with transaction.atomic():
        lock_bytes(sha for _, _, sha, _, _ in fetched)
        still = set(Image.objects.select_for_update().filter(
            id__in=[r.id for r, *_ in fetched], status=ImageStatus.QUEUED, sha256="").values_list("id", flat=True))
        fetched = [f for f in fetched if f[0].id in still]
        existing = {}
        for im in Image.objects.select_for_update().filter(
                owner_id=fetched[0][0].owner_id if fetched else None, model_id__in={r.model_id for r, *_ in fetched},
                sha256__in={sha for _, _, sha, _, _ in fetched}, status__in=LIVE_ORIGINAL_STATUSES,
                duplicate_of__isnull=True):
            existing[(im.model_id, im.sha256)] = im
        seen: dict[tuple[str, str], Image] = {}
        for row, key, sha, size, head in fetched:
            row.sha256, row.size_bytes, row.storage_key, row.point_id = sha, size, key, point_id(sha, row.model_id)
            rejected = quick_check(head, size)
            original = seen.get((row.model_id, sha)) or existing.get((row.model_id, sha))
            if rejected is not None:
                row.status, row.reason, row.reason_detail = ImageStatus.FAILED, rejected.reason.value, rejected.detail
            elif original is not None:
                make_duplicate(row, original)
            else:
                seen[(row.model_id, sha)] = row
        rows = [r for r, *_ in fetched]
        changed = claims_settle(rows)
        originals = _save_resolved(rows)
        dual_copies([r for r in rows if r.id in originals])
    if changed:
        transaction.on_commit(lambda: payloads_refresh(changed, wait=False))
    return [str(r.id) for r in rows if r.id in originals]


_RESOLVED_FIELDS = ("sha256", "size_bytes", "storage_key", "point_id", "status", "reason", "reason_detail",
                    "duplicate_of", "width", "height", "format", "external_id", "claimed_external_id")


def _save_resolved(rows: list[Image]) -> set:
    """Write the resolved rows (one UPDATE each, in sha256 order so two fetchers sharing bytes take
    the index entries in the same order). A row that would be a second original of its bytes (an
    upload committed them first despite the locks: a path that takes none) becomes the winner's
    skipped duplicate. Returns the ids of the rows that stay originals."""
    originals = set()
    for row in sorted(rows, key=lambda r: r.sha256):
        values = {f: getattr(row, f) for f in _RESOLVED_FIELDS}
        try:
            with transaction.atomic():
                Image.objects.filter(id=row.id).update(**values)
        except IntegrityError:
            winner = Image.objects.select_for_update().filter(
                owner_id=row.owner_id, model_id=row.model_id, sha256=row.sha256,
                status__in=LIVE_ORIGINAL_STATUSES, duplicate_of__isnull=True).first()
            if winner is None:
                raise
            make_duplicate(row, winner)
            Image.objects.filter(id=row.id).update(**{f: getattr(row, f) for f in _RESOLVED_FIELDS})
        if row.status == ImageStatus.QUEUED and row.duplicate_of_id is None:
            originals.add(row.id)
    return originals


def chunk_fetch(*, job_id: str, image_ids: list[str]) -> dict:
    """Fetch one chunk of a catalogue job's unfetched rows and send its originals to the model.

    A chunk of a cancelled job cancels its rows; one of a paused job is parked (resuming the job
    sends it again, as an ``embed_chunk``, which hands unfetched rows back here). Rows fetched
    already (a redelivered chunk) are sent on without fetching again.

    Returns:
        ``{"fetched": n, "failed": n, "skipped": n, "queued": n, "fetch_ms": ms}``: rows whose
        bytes arrived, rows that failed (fetch or refusal), rows now skipped duplicates, and rows
        sent to the model; ``"parked": n`` when parked.
    """
    job = Job.objects.filter(id=job_id).first()
    if job is None:
        return {"fetched": 0, "failed": 0, "skipped": 0, "queued": 0, "fetch_ms": 0.0}
    if job.status == JobStatus.CANCELLED:
        images_mark_failed([(i, Reason.CANCELLED.value, "the job was cancelled") for i in image_ids])
        return {"fetched": 0, "failed": 0, "skipped": 0, "queued": 0, "fetch_ms": 0.0}
    if job.status == JobStatus.PAUSED and job_services.job_chunk_park(job_id=job_id, image_ids=image_ids):
        return {"fetched": 0, "failed": 0, "skipped": 0, "queued": 0, "fetch_ms": 0.0, "parked": len(image_ids)}
    rows = list(Image.objects.filter(id__in=image_ids, status=ImageStatus.QUEUED))
    ready = [str(r.id) for r in rows if r.sha256]
    todo = [r for r in rows if not r.sha256 and r.origin]
    job_services.job_mark_started(job_id=job_id, status=job.status)
    started = time.perf_counter()
    results = _fetch_all(todo)
    fetch_ms = (time.perf_counter() - started) * 1000
    failures = [(str(r.id), e.reason.value, e.detail) for r in todo if isinstance(e := results[str(r.id)], ImageRejected)]
    images_mark_failed(failures)
    fetched = [(r, *results[str(r.id)]) for r in todo if not isinstance(results[str(r.id)], ImageRejected)]
    originals = rows_resolve(fetched)
    ready += originals
    if ready:
        dispatch.send_chunk(job_id=job_id, image_ids=ready, priority=job.priority)
    else:
        job_services.job_refresh(job_id=job_id)
    skipped = Image.objects.filter(id__in=[r.id for r, *_ in fetched], status=ImageStatus.SKIPPED).count()
    refused = len(fetched) - len(originals) - skipped
    return {"fetched": len(fetched), "failed": len(failures) + refused, "skipped": skipped, "queued": len(ready),
            "fetch_ms": round(fetch_ms, 1)}
