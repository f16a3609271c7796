"""A batch's input file checked line by line on the fetch worker (bounded memory: one line at a
time), then cut into parts of about ``chunk_size`` inputs, each queued on the bulk queue (or the fetch
queue first when its lines name URLs): ``batch_validate``. Problems of the file (a line that is not
JSON or not an object, a repeated or missing ``custom_id``, another method or endpoint, lines naming
different models) fail the batch with ``errors``."""
from __future__ import annotations

import hashlib
import json

from django.db import transaction
from django.utils import timezone

from embeddings import dispatch, runtime
from embeddings.models import Batch, BatchPart, BatchStatus, Job, JobStatus, PartState, WebhookEvent
from embeddings.services.batches.batches import batch_event_emit, batch_finish_check
from embeddings.services.batches.lines import iter_lines, line_fetches, line_inputs


#: Validation errors listed on a failed batch (the rest are counted in the last one's message).
ERRORS_LISTED = 100


#: A ``custom_id``'s longest (characters).
CUSTOM_ID_MAX = 512


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
