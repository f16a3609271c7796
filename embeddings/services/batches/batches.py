"""Batches of ``/v1/batches`` (OpenAI's Batch API, docs/batch-api.md): made, read, listed, cancelled
and expired here; validated in :mod:`.validation`, finalised in :mod:`.finalize`, their parts run in
:mod:`.parts`, the JSONL lines all of them read and write in :mod:`.lines`.

A batch is a bulk job (``Job`` of kind ``batch``, its deadline the end of the completion window).
Its input file is checked line by line on the fetch worker (``validation.batch_validate``, bounded memory:
one line at a time); problems of the file (a line that is not JSON or not an object, a repeated or
missing ``custom_id``, another method or endpoint, lines naming different models) fail the batch with
``errors``. Otherwise its lines are cut into parts of about ``chunk_size`` inputs, each one message
on the bulk queue (``parts.part_run``). When no part is left to run, ``finalize.batch_finalize`` (fetch
worker) joins the parts' output and error lines into the two files, adds a ``batch_cancelled`` /
``batch_expired`` error line for every line that never ran, and emits the batch's webhook event.
A part whose message was lost is queued again by the reconciler (:func:`parts_resend`).

State machine (OpenAI's): ``validating`` → ``in_progress`` → ``finalizing`` → ``completed`` |
``expired``; ``validating`` → ``failed``; ``validating`` | ``in_progress`` → ``cancelling`` →
``cancelled``.
"""
from __future__ import annotations

import datetime as dt
import logging
import re
import time
import uuid

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from embeddings import dispatch, runtime
from embeddings.errors import ApplicationError
from embeddings.models import (
    Batch,
    BatchPart,
    BatchStatus,
    FilePurpose,
    Job,
    JobKind,
    JobPriority,
    PartState,
)
from embeddings.services.batches import files as file_services
from embeddings.services.batches.owned import owned_get, page_after
from embeddings.services.webhooks import events as webhook_events

log = logging.getLogger(__name__)

#: The one endpoint whose requests a batch runs.
ENDPOINT = "/v1/embeddings"
#: ``completion_window``: a number and a unit (``24h``, ``90m``, ``3600s``).
WINDOW = re.compile(r"(\d{1,7})([smh])\Z")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
#: OpenAI's metadata bounds: 16 pairs, keys of 64 characters, values of 512.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
#: Parts still running or queued.
OPEN_PARTS = (PartState.PENDING, PartState.RUNNING)
#: Batch states that end.
FINISHED = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


#: A batch's id as :func:`batch_id_new` makes it; any other text names no batch and is never sent to
#: the database (``files.FILE_ID``).
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


def batch_id_new() -> str:
    """``batch_`` + 32 hex digits."""
    return f"batch_{uuid.uuid4().hex}"


def window_seconds(window) -> float:
    """The seconds of a ``completion_window`` (``"24h"``), within ``BATCH_WINDOW_MIN_S`` ..
    ``BATCH_WINDOW_MAX_S``.

    Raises:
        ApplicationError: ``invalid_completion_window`` (400, ``param`` completion_window).
    """
    m = WINDOW.match(window) if isinstance(window, str) else None
    lo, hi = settings.BATCH_WINDOW_MIN_S, settings.BATCH_WINDOW_MAX_S
    seconds = int(m[1]) * _UNIT_S[m[2]] if m else None
    if seconds is None or not lo <= seconds <= hi:
        raise ApplicationError(f"completion_window {str(window)[:40]!r}: a duration such as '24h' between "
                               f"{lo:g} s and {hi:g} s (BATCH_WINDOW_MIN_S, BATCH_WINDOW_MAX_S)",
                               code="invalid_completion_window",
                               extra={"param": "completion_window", "min_s": lo, "max_s": hi})
    return float(seconds)


def metadata_check(metadata) -> dict | None:
    """OpenAI's ``metadata``: null, or at most 16 string pairs (keys ≤ 64, values ≤ 512 characters),
    none holding a NUL (PostgreSQL's jsonb cannot store one: the row would not save).

    Raises:
        ApplicationError: ``invalid_metadata`` (400, ``param`` metadata).
    """
    if metadata is None:
        return None
    ok = isinstance(metadata, dict) and len(metadata) <= METADATA_PAIRS and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= METADATA_KEY and len(v) <= METADATA_VALUE
        and "\x00" not in k + v for k, v in metadata.items())
    if not ok:
        raise ApplicationError(f"metadata: at most {METADATA_PAIRS} pairs of strings (keys of at most {METADATA_KEY} "
                               f"characters, values of at most {METADATA_VALUE}; no NUL)", code="invalid_metadata",
                               extra={"param": "metadata"})
    return metadata


def batch_create(*, owner, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict | None = None, key_prefix: str = "") -> Batch:
    """Make a batch of the owner's input file and its bulk job (its usage metered to API key
    ``key_prefix``), and queue its validation.

    Raises:
        ApplicationError: ``unsupported_endpoint`` (400: only ``/v1/embeddings``),
            ``invalid_completion_window`` (400), ``invalid_metadata`` (400), ``not_found`` (404, the
            file is not the owner's), ``invalid_purpose`` (400, a file that is not a batch input).
    """
    if endpoint != ENDPOINT:
        raise ApplicationError(f"endpoint {str(endpoint)[:80]!r}: this service runs batches of {ENDPOINT} only",
                               code="unsupported_endpoint", extra={"param": "endpoint"})
    seconds = window_seconds(completion_window)
    metadata = metadata_check(metadata)
    try:
        f = file_services.file_get(owner=owner, file_id=input_file_id)
    except ApplicationError as e:
        e.extra = {**e.extra, "param": "input_file_id"}
        raise
    if f.purpose != FilePurpose.BATCH:
        raise ApplicationError(f"{f.id} has purpose {f.purpose!r}: a batch reads files of purpose 'batch'",
                               code="invalid_purpose", extra={"param": "input_file_id"})
    now = timezone.now()  # created_at and, plus the window, expires_at: one reading of the clock
    batch_id = batch_id_new()
    with transaction.atomic():
        job = Job.objects.create(owner=owner, name=f"{batch_id} ({f.filename})"[:200], kind=JobKind.BATCH,
                                 priority=JobPriority.BACKGROUND, deadline=now + dt.timedelta(seconds=seconds),
                                 model_id=runtime.model_id(), chunk_size=settings.PIPELINE.batch_size, total=f.lines,
                                 key_prefix=key_prefix)
        batch = Batch.objects.create(id=batch_id, owner=owner, job=job, input_file=f, input_file_name=f.id,
                                     input_key=f.storage_key, input_sha256=f.sha256, endpoint=endpoint,
                                     completion_window=completion_window, metadata=metadata,
                                     created_at=now, expires_at=job.deadline, total=0)
        transaction.on_commit(lambda: dispatch.send_batch_validate(batch_id=batch_id))
    return batch


def batch_get(*, owner, batch_id: str) -> Batch:
    """The owner's batch ``batch_id``.

    Raises:
        ApplicationError: ``not_found`` (404): no such batch, or another owner's.
    """
    return owned_get(Batch, BATCH_ID, owner=owner, pk=batch_id, noun="batch", param="batch_id")


def batches_list(*, owner, after: str | None = None, limit: int = 20) -> tuple[list[Batch], bool]:
    """The owner's batches, newest first, those older than batch ``after`` only, at most ``limit``.
    Returns ``(batches, has_more)``.

    Raises:
        ApplicationError: ``not_found`` (404, ``param`` after): ``after`` names no batch of the owner.
    """
    return page_after(Batch.objects.filter(owner=owner), BATCH_ID, owner=owner, after=after, limit=limit,
                      noun="batch")


def request_counts(batch: Batch) -> dict[str, int]:
    """``{"total", "completed", "failed"}``: the lines finished so far (the parts done), or, once the
    batch has ended, every line (the never-run ones counted failed)."""
    if batch.status in (BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED):
        done = BatchPart.objects.filter(batch=batch).aggregate(c=Sum("completed"))
        completed = done["c"] or 0
        return {"total": batch.total, "completed": completed, "failed": batch.total - completed}
    sums = BatchPart.objects.filter(batch=batch, state=PartState.DONE).aggregate(c=Sum("completed"), f=Sum("failed"))
    return {"total": batch.total, "completed": sums["c"] or 0, "failed": sums["f"] or 0}


def batch_cancel(*, batch: Batch) -> Batch:
    """Cancel a batch: ``cancelling`` now; its queued parts never run (their lines become
    ``batch_cancelled`` error lines), running parts finish and are kept; ``cancelled`` once
    finalised.

    Raises:
        ApplicationError: ``invalid_transition`` (409): the batch has ended, or is finalising or cancelling.
    """
    now = timezone.now()
    changed = Batch.objects.filter(id=batch.id, status__in=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)).update(
        status=BatchStatus.CANCELLING, cancelling_at=now)
    if not changed:
        batch.refresh_from_db()
        raise ApplicationError(f"a {batch.status} batch cannot be cancelled", code="invalid_transition", status=409,
                               extra={"from": batch.status, "to": BatchStatus.CANCELLING.value})
    BatchPart.objects.filter(batch=batch, state=PartState.PENDING).update(state=PartState.CANCELLED)
    batch_finish_check(batch_id=batch.id)
    batch.refresh_from_db()
    return batch


def batch_finish_check(*, batch_id: str) -> bool:
    """Queue the batch's finalisation when it has parts and none is queued or running (after each
    part, a cancel, an expiry). Several may queue it: the first to claim it finalises
    (``finalize.batch_finalize``). Returns whether it was queued."""
    batch = Batch.objects.filter(id=batch_id).first()
    if batch is None or batch.status not in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING) \
            or batch.finalizing_at is not None:
        return False
    if not BatchPart.objects.filter(batch_id=batch_id).exists():  # validation has not made them yet
        return False
    if BatchPart.objects.filter(batch_id=batch_id, state__in=OPEN_PARTS).exists():
        return False
    transaction.on_commit(lambda: dispatch.send_batch_finalize(batch_id=batch_id))
    return True


#: A batch still validating this long after it was made, with no part yet, has lost its message
#: (reading a 200 MB file's lines takes a minute or two): the reconciler queues it again.
VALIDATE_LEASE = dt.timedelta(minutes=15)
#: A finalisation claimed longer ago than this whose batch has not ended is taken to have lost its
#: worker (a 200 MB input's files are written in minutes): the reconciler queues it again.
FINALIZE_LEASE = dt.timedelta(minutes=30)
#: A part queued or claimed longer ago than this has lost its message (a broker restart, a worker
#: killed before its ack): the reconciler queues it again. A part is one chunk of inputs (at most a
#: few minutes fetched and computed on a loaded CPU); the rest is its wait in the queue, where a
#: resent part's first message finds it claimed and is skipped (:func:`parts.part_run`).
PART_LEASE = dt.timedelta(minutes=30)


def batches_expire(*, now: dt.datetime | None = None) -> int:
    """The reconciler's round over batches: queue again the parts open past :data:`PART_LEASE`
    (:func:`parts_resend`); expire the queued parts of every batch past its window and queue the
    finalisation of those with nothing left running; queue again a validation not done
    :data:`VALIDATE_LEASE` after the batch was made, and a finalisation claimed more than
    :data:`FINALIZE_LEASE` ago that never ended (its claim released first).
    Returns the batches touched."""
    now = now or timezone.now()
    resent = parts_resend(now=now)
    late = list(Batch.objects.filter(status__in=(BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING),
                                     expires_at__lte=now, finalizing_at__isnull=True).values_list("id", flat=True))
    for batch_id in late:
        BatchPart.objects.filter(batch_id=batch_id, state=PartState.PENDING).update(state=PartState.EXPIRED)
        batch_finish_check(batch_id=batch_id)
    lost_validations = list(Batch.objects.filter(status=BatchStatus.VALIDATING, created_at__lt=now - VALIDATE_LEASE)
                            .exclude(parts__isnull=False).values_list("id", flat=True))
    for batch_id in lost_validations:  # its message lost (a broker restart): validation is idempotent
        dispatch.send_batch_validate(batch_id=batch_id)
    stale = now - FINALIZE_LEASE
    lost = list(Batch.objects.filter(status__in=(BatchStatus.FINALIZING, BatchStatus.CANCELLING),
                                     finalizing_at__lt=stale).values_list("id", "status"))
    for batch_id, status in lost:
        back = BatchStatus.IN_PROGRESS if status == BatchStatus.FINALIZING else BatchStatus.CANCELLING
        if Batch.objects.filter(id=batch_id, status=status, finalizing_at__lt=stale).update(
                status=back, finalizing_at=None):
            batch_finish_check(batch_id=batch_id)
    return len(resent | set(late)) + len(lost_validations) + len(lost)


def parts_resend(*, now: dt.datetime | None = None) -> set[str]:
    """Queue again every part of a running batch that is still ``pending`` or ``running``
    :data:`PART_LEASE` after it was last queued or claimed: its message was lost, or its worker died
    before the ack. It goes back to ``pending`` (a new lease) and to the fetch queue, which fetches
    what is not staged yet and queues it on the bulk queue. A part of a batch being cancelled, or
    past its window, is settled unrun instead (``cancelled``, ``expired``).

    Exactly once in effect: a part is claimed ``pending`` → ``running`` by one delivery, and its
    lines are recorded only by the ``running`` → ``done`` change, which one finisher wins; a
    delivery that finds it done (a worker thought dead that finishes late) writes nothing
    (:func:`parts.part_run`). Returns the ids of the batches touched."""
    now = now or timezone.now()
    stale = now - PART_LEASE
    rows = list(BatchPart.objects.filter(state__in=OPEN_PARTS, leased_at__lt=stale, batch__finalizing_at__isnull=True,
                                         batch__status__in=(BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING))
                .values_list("id", "batch_id", "index", "state", "batch__status", "batch__expires_at",
                             "batch__job__priority"))
    touched = set()
    for part_id, batch_id, index, state, status, expires_at, priority in rows:
        unrun = PartState.CANCELLED if status == BatchStatus.CANCELLING else \
            PartState.EXPIRED if expires_at <= now else None
        # compare-and-set on the state and lease read: a part claimed or finished meanwhile is left alone
        claim = BatchPart.objects.filter(id=part_id, state=state, leased_at__lt=stale)
        if unrun is not None:
            if claim.update(state=unrun):
                batch_finish_check(batch_id=batch_id)
                touched.add(batch_id)
            continue
        if claim.update(state=PartState.PENDING, leased_at=now):
            log.warning("batch %s part %s %s since before %s: queued again", batch_id, index, state, stale)
            dispatch.send_batch_part_fetch(batch_id=batch_id, index=index, priority=priority)
            touched.add(batch_id)
    return touched


# --- webhooks ------------------------------------------------------------------------------------------

def batch_event_emit(*, batch: Batch, event: str) -> int:
    """Emit a ``batch.*`` event to the owner's account endpoints (and the batch job's own), once per
    batch and type, with OpenAI's event body: ``{"id": "evt_…", "object": "event", "created_at": Unix
    s, "type", "data": {"id": batch id}}``, signed as every message (Standard Webhooks). Returns
    messages made."""
    endpoints = webhook_events.job_recipients(batch.job)
    if not endpoints:
        return 0
    body = {"id": f"evt_{uuid.uuid4().hex}", "object": "event", "created_at": int(time.time()), "type": event,
            "data": {"id": batch.id}}
    return len(webhook_events.event_emit(event=event, key=f"{event}:{batch.id}", data=body["data"],
                                         endpoints=endpoints, body=body))


def staged_keys(part: BatchPart) -> list[str]:
    """The blob keys of the images fetched ahead for a part (``BatchPart.staged``)."""
    return [v["key"] for v in (part.staged or {}).values() if isinstance(v, dict) and v.get("key")]
