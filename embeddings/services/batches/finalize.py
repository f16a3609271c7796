"""A batch's finalisation on the fetch worker, once no part is left to run: the parts' output and
error lines joined into the batch's two files, a ``batch_cancelled`` / ``batch_expired`` error line
for every line that never ran, the staged blobs released and the batch's webhook event emitted:
``batch_finalize``. Several may queue it; the first to claim it finalises."""
from __future__ import annotations

import json

from django.db import transaction
from django.utils import timezone

from embeddings import runtime
from embeddings.models import Batch, BatchPart, BatchStatus, Job, JobStatus, PartState, WebhookEvent
from embeddings.services.batches import files as file_services
from embeddings.services.batches.batches import OPEN_PARTS, batch_event_emit, staged_keys
from embeddings.services.batches.lines import iter_lines, result_line


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
