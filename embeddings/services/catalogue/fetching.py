"""The fetch stage of a catalogue job (issue 41): unfetched rows get their bytes, then go to the model.

A row made from a manifest or a prefix (``services.catalogue.reading``) starts queued with no bytes:
``origin`` is its http(s) URL or ``s3://bucket/key``. The fetch worker (``fetch`` queue, threads,
no model) takes a chunk of such rows (:func:`chunk_fetch`):

1. fetches every URL of the chunk at once (``workers.fetch``: timeouts, size cap while streaming,
   retries honouring ``Retry-After``, every hop's address checked against server-side request
   forgery) and reads every object (``SOURCE_COPY``: copied into the blob store; else read where it
   lives, its sha256 checked on every later read, ``source_changed`` as for folders);
2. settles the rows as their bytes arrive, never waiting for the chunk's slowest URL: the rows
   whose fetch finished (those finishing within :data:`SETTLE_LINGER_S` of each other together) are
   stored, resolved and sent on while the others are still fetching, so a URL that trickles a byte
   a second holds only its own row (until ``FETCH_TOTAL_TIMEOUT_S`` fails it ``fetch_timeout``);
3. stores fetched bytes content-addressed like uploads, so the same image behind two URLs is one
   blob and, for one owner, one original: the other row is its skipped duplicate;
4. resolves the settled rows in one transaction (:func:`rows_resolve`): sha256, size, point,
   original or duplicate, obvious non-images refused, the caller's id claims settled
   (``identity.claims_settle``);
5. sends those rows' new originals to the bulk queue as an ``embed_chunk`` of the job.

A URL that cannot be fetched fails its row alone with a ``fetch_*`` reason; the chunk goes on.
Nothing is lost when the worker dies part-way: a row settled is in the database (failed, or
queued with its bytes and sent on); the redelivered chunk fetches only the rows without bytes and
sends on the queued ones that have them.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from collections.abc import Iterator

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
from embeddings.services.usage import meter as usage_meter
from workers.errors import ImageRejected, Reason
from workers.ids import point_id

log = logging.getLogger(__name__)

#: First bytes kept to sniff the format (magic numbers sit in the first 32 bytes).
_HEAD = 64
#: ``storage_key`` prefix of an object read where it lives (``embeddings.storage``).
OBJECT_PREFIX = "s3://"
#: Seconds the fetches that finish just after one another join one group (one transaction, one
#: ``embed_chunk``) before it is settled: a chunk of fast URLs stays one chunk for the model, while a
#: slow URL never delays a row that finished before it by more than this.
SETTLE_LINGER_S = 0.25


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


def _fetch_as_they_finish(rows: list[Image]) -> Iterator[dict[str, tuple | ImageRejected]]:
    """Fetch every row's origin at once (``FETCH_THREADS`` at a time; the fetcher bounds each host)
    and yield the results as they finish, ``{image id: (key, sha256, size, head) | ImageRejected}``
    per group: the first result finished and every other one that finishes within
    :data:`SETTLE_LINGER_S` (so a chunk of fast URLs is one group, one ``embed_chunk``), never
    waiting for a slower one. Every row is in exactly one group. Nothing raised here fails another row."""
    if not rows:
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(settings.FETCH_THREADS, len(rows)))) as pool:
        origins = {str(r.id): r.origin for r in rows}
        pending = {pool.submit(_fetch_one, r.origin): str(r.id) for r in rows}
        while pending:
            done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            more, _ = concurrent.futures.wait(set(pending) - done, timeout=SETTLE_LINGER_S)
            group: dict[str, tuple | ImageRejected] = {}
            for f in done | more:
                image_id = pending.pop(f)
                try:
                    group[image_id] = f.result()
                except ImageRejected as e:
                    group[image_id] = e
                except Exception as e:  # a storage or client error of one object: that row's failure
                    # the library's words may name the storage endpoint (an internal host name): the log only
                    log.warning("fetching image %s failed: %s: %s", image_id, type(e).__name__, e)
                    group[image_id] = ImageRejected(Reason.SOURCE_MISSING, f"{origins[image_id]}: {type(e).__name__} "
                                                    "while reading it (the fetch worker's log has the details)")
            yield group


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
        usage_meter.rows_fetched(rows)  # in this transaction: rows that had no bytes, once
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
    position = {str(i): n for n, i in enumerate(image_ids)}
    rows.sort(key=lambda r: position.get(str(r.id), len(position)))
    todo = {str(r.id): r for r in rows if not r.sha256 and r.origin}
    job_services.job_mark_started(job_id=job_id, status=job.status)
    counts = {"fetched": 0, "failed": 0, "skipped": 0, "queued": 0}
    if ready:  # a redelivered chunk's rows that have their bytes: sent on at once, not behind the fetches
        dispatch.send_chunk(job_id=job_id, image_ids=ready, priority=job.priority)
        counts["queued"] += len(ready)
    started = time.perf_counter()
    for group in _fetch_as_they_finish(list(todo.values())):
        # in the chunk's order (its rows' order in the source), so that of two rows of one group with
        # the same bytes the earlier row is the original; across groups, the first bytes to arrive
        _group_settle(job, [(r, group[i]) for i, r in todo.items() if i in group], counts)
    fetch_ms = (time.perf_counter() - started) * 1000
    if not ready and not todo:  # nothing sent, nothing settled: the job may have ended already
        job_services.job_refresh(job_id=job_id)
    return {**counts, "fetch_ms": round(fetch_ms, 1)}


def _group_settle(job: Job, group: list[tuple[Image, tuple | ImageRejected]], counts: dict[str, int]) -> None:
    """Settle rows whose fetch finished: failures marked, fetched bytes resolved
    (:func:`rows_resolve`), the originals sent to the model as one ``embed_chunk``; a group that
    sends nothing refreshes the job (its last rows may have ended it). Adds to ``counts``."""
    failures = [(str(r.id), res.reason.value, res.detail) for r, res in group if isinstance(res, ImageRejected)]
    images_mark_failed(failures)
    fetched = [(r, *res) for r, res in group if not isinstance(res, ImageRejected)]
    originals = rows_resolve(fetched)
    if originals:
        dispatch.send_chunk(job_id=str(job.id), image_ids=originals, priority=job.priority)
    else:
        job_services.job_refresh(job_id=str(job.id))
    skipped = Image.objects.filter(id__in=[r.id for r, *_ in fetched], status=ImageStatus.SKIPPED).count()
    counts["fetched"] += len(fetched)
    counts["failed"] += len(failures) + len(fetched) - len(originals) - skipped
    counts["skipped"] += skipped
    counts["queued"] += len(originals)
