"""Batches of ``/v1/batches`` (OpenAI's Batch API, docs/batch-api.md): made, read, listed, cancelled,
validated, expired and finalised.

A batch is a bulk job (``Job`` of kind ``batch``, its deadline the end of the completion window).
Its input file is checked line by line on the fetch worker (:func:`batch_validate`, bounded memory:
one line at a time); problems of the file (a line that is not JSON or not an object, a repeated or
missing ``custom_id``, another method or endpoint, lines naming different models) fail the batch with
``errors``. Otherwise its lines are cut into parts of about ``chunk_size`` inputs, each one message
on the bulk queue (``parts.part_run``). When no part is left to run, :func:`batch_finalize` (fetch
worker) joins the parts' output and error lines into the two files, adds a ``batch_cancelled`` /
``batch_expired`` error line for every line that never ran, and emits the batch's webhook event.
A part whose message was lost is queued again by the reconciler (:func:`parts_resend`).

State machine (OpenAI's): ``validating`` → ``in_progress`` → ``finalizing`` → ``completed`` |
``expired``; ``validating`` → ``failed``; ``validating`` | ``in_progress`` → ``cancelling`` →
``cancelled``.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
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
    JobStatus,
    PartState,
    WebhookEvent,
)
from embeddings.services.batches import files as file_services
from embeddings.services.batches.owned import owned_get, page_after
from embeddings.services.interactive import embed as embed_services
from embeddings.services.webhooks import events as webhook_events

log = logging.getLogger(__name__)

#: The one endpoint whose requests a batch runs.
ENDPOINT = "/v1/embeddings"
#: ``completion_window``: a number and a unit (``24h``, ``90m``, ``3600s``).
WINDOW = re.compile(r"(\d{1,7})([smh])\Z")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
#: OpenAI's metadata bounds: 16 pairs, keys of 64 characters, values of 512.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
#: A ``custom_id``'s longest (characters).
CUSTOM_ID_MAX = 512
#: Validation errors listed on a failed batch (the rest are counted in the last one's message).
ERRORS_LISTED = 100
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
    (:func:`batch_finalize`). Returns whether it was queued."""
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


# --- validation (fetch worker) ------------------------------------------------------------------------

class _Errors:
    """A failed validation's ``errors``: the first :data:`ERRORS_LISTED` listed, the rest counted."""

    def __init__(self) -> None:
        self.listed: list[dict] = []
        self.count = 0

    def add(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        """One problem of 1-based ``line`` (None: of the file as a whole)."""
        self.count += 1
        if len(self.listed) < ERRORS_LISTED:
            self.listed.append({"code": code, "message": message, "param": param, "line": line})

    def as_list(self) -> list[dict]:
        if self.count > len(self.listed):
            last = dict(self.listed[-1])
            last["message"] += f" ({self.count - len(self.listed)} more errors not listed)"
            return self.listed[:-1] + [last]
        return self.listed


def line_inputs(body: dict) -> int:
    """How many inputs a line's body asks for (its share of a part): a list's length, else 1."""
    value = body.get("input")
    return max(1, len(value)) if isinstance(value, list) else 1


def line_fetches(body: dict) -> bool:
    """Whether a line's body names an image to fetch (an http(s) URL read as an image: the rule of
    ``embed.openai_inputs``)."""
    value = body.get("input")
    strings = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return body.get("modality", "auto") != "text" and any(
        isinstance(x, str) and embed_services.HTTP_URL.fullmatch(x) for x in strings)


def _line_problem(line, endpoint: str) -> tuple[str, str, str | None] | None:
    """``(code, message, param)`` of a parsed line that the file may not hold, else None."""
    if not isinstance(line, dict):
        return "invalid_line", "the line is not a JSON object", None
    cid = line.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "missing_custom_id", "custom_id: a non-empty string is required", "custom_id"
    if len(cid) > CUSTOM_ID_MAX:
        return "invalid_custom_id", f"custom_id: at most {CUSTOM_ID_MAX} characters", "custom_id"
    if line.get("method") != "POST":
        return "invalid_method", f"method {str(line.get('method'))[:20]!r}: only POST", "method"
    if line.get("url") != endpoint:
        return ("mismatched_endpoint", f"url {str(line.get('url'))[:80]!r}: this batch's endpoint is {endpoint}",
                "url")
    if not isinstance(line.get("body"), dict):
        return "invalid_body", "body: a JSON object (a /v1/embeddings request) is required", "body"
    return None


def _raw_lines(f, block: int = 1 << 20):
    """The lines of a binary file from where it stands, each with its newline (``f.read`` in blocks:
    Django's ``File`` iterates from byte 0 whatever was sought)."""
    pending = b""
    while True:
        data = f.read(block)
        if not data:
            break
        pending += data
        *whole, pending = pending.split(b"\n")
        for raw in whole:
            yield raw + b"\n"
    if pending:
        yield pending


def iter_lines(f, *, offset: int = 0, size: int | None = None):
    """``(physical line number, byte offset, raw bytes)`` of each non-blank line of a binary file,
    from ``offset`` for ``size`` bytes (the whole rest: None); one line (and a read block) in memory
    at a time. Line numbers count from the offset."""
    f.seek(offset)
    number, pos, end = 0, offset, None if size is None else offset + size
    for raw in _raw_lines(f):
        number += 1
        start = pos
        pos += len(raw)
        if raw.strip():
            yield number, start, raw
        if end is not None and pos >= end:
            break


def batch_validate(*, batch_id: str) -> dict:
    """Check a batch's input file line by line and cut it into parts (or fail the batch with
    ``errors``), then queue the parts on the bulk lane. Runs once: a batch no longer ``validating``
    or ``cancelling`` without parts is left alone.

    Returns:
        ``{"status", "total", "parts", "errors"}``.
    """
    batch = Batch.objects.filter(id=batch_id).first()
    if batch is None or batch.status not in (BatchStatus.VALIDATING, BatchStatus.CANCELLING) or \
            BatchPart.objects.filter(batch=batch).exists():
        return {"status": getattr(batch, "status", None), "total": 0, "parts": 0, "errors": 0}
    errors, seen, models = _Errors(), set(), set()
    parts: list[BatchPart] = []
    size_goal = batch.job.chunk_size
    current = None  # [first request index, lines, offset, end, inputs]
    total = 0
    try:
        f = runtime.blob_store().open(batch.input_key)
    except Exception as e:  # noqa: BLE001 - the file's blob is gone: the batch fails with the reason
        errors.add(None, "file_missing", f"the input file cannot be read: {e}")
        f = None
    if f is not None:
        with f:
            for number, start, raw in iter_lines(f):
                try:
                    line = json.loads(raw)
                except (ValueError, RecursionError) as e:
                    errors.add(number, "invalid_json_line", f"line {number} is not JSON: {str(e)[:200]}")
                    continue
                problem = _line_problem(line, batch.endpoint)
                if problem is not None:
                    errors.add(number, problem[0], f"line {number}: {problem[1]}", problem[2])
                    continue
                digest = hashlib.sha256(line["custom_id"].encode("utf-8", "surrogatepass")).digest()
                if digest in seen:
                    errors.add(number, "duplicate_custom_id",
                               f"line {number}: custom_id {line['custom_id'][:80]!r} is used by an earlier line "
                               f"(custom_id is unique per batch)", "custom_id")
                    continue
                seen.add(digest)
                model = line["body"].get("model")
                if isinstance(model, str):
                    models.add(model)
                if errors.count:  # counting problems only from here on
                    continue
                if current is None:
                    current = [total, 0, start, start, 0, False]
                current[1] += 1
                current[3] = start + len(raw)
                current[4] += line_inputs(line["body"])
                current[5] = current[5] or line_fetches(line["body"])
                total += 1
                if current[4] >= size_goal:
                    parts.append(_part(batch, len(parts), current))
                    current = None
        if current is not None and not errors.count:
            parts.append(_part(batch, len(parts), current))
    if len(models) > 1:
        errors.add(None, "mismatched_model", f"the lines name {len(models)} models ({', '.join(sorted(models)[:5])}): "
                                          f"one batch runs one model", "body.model")
    if not errors.count and not total:
        errors.add(None, "empty_file", "the input file has no request")
    now = timezone.now()
    if errors.count:
        with transaction.atomic():
            Batch.objects.filter(id=batch.id).update(status=BatchStatus.FAILED, failed_at=now,
                                                     errors=errors.as_list())
            Job.objects.filter(id=batch.job_id).update(status=JobStatus.DONE, finished_at=now, started_at=now)
            batch.refresh_from_db()
            batch_event_emit(batch=batch, event=WebhookEvent.BATCH_FAILED)
        return {"status": BatchStatus.FAILED.value, "total": total, "parts": 0, "errors": errors.count}
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(id=batch.id)
        cancelled = locked.status == BatchStatus.CANCELLING
        if cancelled:  # cancelled while validating: no line runs, each becomes batch_cancelled
            for p in parts:
                p.state = PartState.CANCELLED
        BatchPart.objects.bulk_create(parts)
        fields = {"total": total}
        if models:
            fields["model_id"] = next(iter(models))
        if not cancelled:
            fields.update(status=BatchStatus.IN_PROGRESS, in_progress_at=now)
        Batch.objects.filter(id=batch.id).update(**fields)
        Job.objects.filter(id=batch.job_id).update(total=total, status=JobStatus.RUNNING, started_at=now)
        if cancelled:
            batch_finish_check(batch_id=batch.id)
        else:
            priority = batch.job.priority
            # a part with image URLs is fetched first on the fetch worker (as a manifest job's chunk),
            # so that the bulk worker computes one part while the next one's images arrive
            sends = [(dispatch.send_batch_part_fetch if p.fetches else dispatch.send_batch_part, p.index)
                     for p in parts]
            transaction.on_commit(lambda: [send(batch_id=batch.id, index=i, priority=priority) for send, i in sends])
    return {"status": BatchStatus.CANCELLING.value if cancelled else BatchStatus.IN_PROGRESS.value,
            "total": total, "parts": len(parts), "errors": 0}


def _part(batch: Batch, index: int, current: list) -> BatchPart:
    """A part of ``current`` = ``[first request, lines, offset, end, inputs, fetches]``; its
    ``fetches`` (an attribute, not stored): whether a line names an image URL."""
    first, lines, offset, end, _, fetches = current
    part = BatchPart(batch=batch, index=index, first_line=first, lines=lines, offset=offset, size=end - offset)
    part.fetches = fetches
    return part


# --- finalisation (fetch worker) -------------------------------------------------------------------

def _claim_finalize(batch_id: str) -> Batch | None:
    """Claim the batch's finalisation (one claimant wins): ``in_progress`` → ``finalizing``; a
    ``cancelling`` batch stays so (OpenAI's cancelled batches never show ``finalizing``), its
    ``finalizing_at`` marking the claim. Parts still open are settled first (expired, or cancelled),
    so that a late part cannot add lines after the files are written."""
    now = timezone.now()
    won = Batch.objects.filter(id=batch_id, status=BatchStatus.IN_PROGRESS, finalizing_at__isnull=True).update(
        status=BatchStatus.FINALIZING, finalizing_at=now)
    won = won or Batch.objects.filter(id=batch_id, status=BatchStatus.CANCELLING, finalizing_at__isnull=True).update(
        finalizing_at=now)
    if not won:
        return None
    batch = Batch.objects.get(id=batch_id)
    leftover = PartState.CANCELLED if batch.status == BatchStatus.CANCELLING else PartState.EXPIRED
    BatchPart.objects.filter(batch=batch, state__in=OPEN_PARTS).update(state=leftover)
    return batch


def _blob_blocks(key: str):
    with runtime.blob_store().open(key) as f:
        yield from iter(lambda: f.read(1 << 20), b"")


def unrun_lines(batch: Batch, part: BatchPart, code: str, message: str):
    """The error lines (bytes, one JSON line each) of a part that never ran: one per input line,
    ``{"id", "custom_id", "response": null, "error": {"code", "message"}}``."""
    with runtime.blob_store().open(batch.input_key) as f:
        for _, _, raw in iter_lines(f, offset=part.offset, size=part.size):
            try:
                line = json.loads(raw)
                cid = line.get("custom_id") if isinstance(line, dict) else None
            except ValueError:
                cid = None
            yield result_line(cid, response=None, error={"code": code, "message": message})


def result_line(custom_id, *, response: dict | None, error: dict | None) -> bytes:
    """One line of an output or error file (OpenAI's shape): ``{"id": "batch_req_…", "custom_id",
    "response", "error"}`` as compact JSON and a newline."""
    return (json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                        "error": error}, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def batch_finalize(*, batch_id: str) -> dict:
    """Write a batch's output and error files from its parts, in line order, one part in memory at
    a time, and end it: ``completed`` (every line ran), ``expired`` (the window passed before some
    lines ran: each is a ``batch_expired`` error line) or ``cancelled`` (``batch_cancelled``).
    The output file exists only when a line succeeded, the error file only when one failed. Emits
    ``batch.completed`` / ``batch.expired`` / ``batch.cancelled``.

    Returns:
        ``{"status", "completed", "failed"}``, or ``{"status": None}`` when another claimed it.
    """
    batch = _claim_finalize(batch_id)
    if batch is None:
        return {"status": None}
    parts = list(BatchPart.objects.filter(batch=batch).order_by("index"))
    completed = sum(p.completed for p in parts if p.state == PartState.DONE)
    failed = batch.total - completed
    why = {PartState.CANCELLED: ("batch_cancelled", "the batch was cancelled before this request ran"),
           PartState.EXPIRED: ("batch_expired", "the batch's completion window ended before this request ran")}

    def outputs():
        for p in parts:
            if p.state == PartState.DONE and p.output_key:
                yield from _blob_blocks(p.output_key)

    def errors():
        for p in parts:
            if p.state == PartState.DONE and p.error_key:
                yield from _blob_blocks(p.error_key)
            elif p.state in why:
                yield from unrun_lines(batch, p, *why[p.state])

    owner = batch.owner
    out = file_services.file_write(owner=owner, filename=f"{batch.id}_output.jsonl", chunks=outputs(),
                                   lines=completed) if completed else None
    err = file_services.file_write(owner=owner, filename=f"{batch.id}_error.jsonl", chunks=errors(),
                                   lines=failed) if failed else None
    now = timezone.now()
    if batch.status == BatchStatus.CANCELLING:
        status, stamp, event = BatchStatus.CANCELLED, "cancelled_at", WebhookEvent.BATCH_CANCELLED
    elif any(p.state == PartState.EXPIRED for p in parts):
        status, stamp, event = BatchStatus.EXPIRED, "expired_at", WebhookEvent.BATCH_EXPIRED
    else:
        status, stamp, event = BatchStatus.COMPLETED, "completed_at", WebhookEvent.BATCH_COMPLETED
    with transaction.atomic():
        Batch.objects.filter(id=batch.id).update(status=status, output_file=out, error_file=err, **{stamp: now})
        Job.objects.filter(id=batch.job_id).update(
            status=JobStatus.CANCELLED if status == BatchStatus.CANCELLED else JobStatus.DONE, finished_at=now)
        batch.refresh_from_db()
        batch_event_emit(batch=batch, event=event)
    keep = {k for k in (out.storage_key if out else "", err.storage_key if err else "") if k}
    for p in parts:  # the parts' blobs are in the files now; images fetched ahead for parts that never ran
        for key in (p.output_key, p.error_key, *staged_keys(p)):
            if key and key not in keep:
                file_services.blob_release(key)
    return {"status": status.value, "completed": completed, "failed": failed}


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
