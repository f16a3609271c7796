"""The bulk queue's worker side: :func:`chunk_embed` embeds one chunk of a bulk job (ingest or
migration) and writes its vectors itself against a Qdrant server, else hands them to the vectors
queue (``vectors.chunk_index``).
"""
from __future__ import annotations

import contextlib
import logging
import time
import uuid

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from embeddings import dispatch, lane_control, metrics, runtime, sink, worker_health
from embeddings.models import (
    BatchStat,
    Image,
    ImageStatus,
    Job,
    JobKind,
    JobPriority,
    JobStatus,
    Lane,
)
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.queues.blobs import (
    Previews,
    count_previews,
    originals_loader,
    thumbnailer,
)
from embeddings.services.queues.store_writes import (
    batch_stat,
    images_wait_for_store,
    vector_item,
)
from embeddings.services.queues.vectors import chunk_index
from embeddings.spaces import ModelNotConfigured
from workers import screen
from workers.errors import Reason

log = logging.getLogger(__name__)


def chunk_embed(*, job_id: str, image_ids: list[str]) -> dict:
    """Embed one chunk of a bulk job and write its vectors: itself against a Qdrant server
    (``services.sink``: :func:`chunk_index` in this process), else through the vectors worker.

    Images no longer queued (already embedded by an earlier delivery, cancelled) are left alone, so a
    redelivered chunk redoes only what is missing. Bad images fail alone with their reason. A
    migration chunk (a re-embed) reads each image's preview where the model's input fits in it, the
    original otherwise (``workers.preview``, docs/previews.md). A chunk of a paused job is parked
    instead of run (``job_chunk_park``): resuming the job queues it again.

    Returns:
        ``{"embedded": n, "failed": n, "skipped": n, "stat_id": id | None}`` (``embedded`` counts
        vectors handed over; they are marked embedded once written), plus ``"parked": n`` when parked
        and ``"paused_ms"`` when it computed (a migration chunk, or a background one while the
        interactive lane was at capacity: time given to the interactive lane); a migration chunk
        also ``"previews"``: ``workers.preview.PreviewTally`` as a dict (what it read).
    """
    job = Job.objects.filter(id=job_id).first()
    if (settled := _settled_by_job(job, job_id=job_id, image_ids=image_ids)) is not None:
        return settled
    rows, exhausted = _queued_rows(image_ids)
    rows, unfetched = _fetch_first(job, rows, job_id=job_id)
    if not rows:
        if not unfetched:
            job_services.job_refresh(job_id=job_id)
        return {"embedded": 0, "failed": 0, "skipped": len(image_ids) - len(unfetched), "stat_id": None}
    job_services.job_mark_started(job_id=job_id, status=job.status)
    try:  # the chunk's model is its job's (a migration job: the space it fills)
        runner = runtime.batch_runner(job.model_id)
    except ModelNotConfigured as e:
        image_services.images_mark_failed([(i, Reason.MODEL_NOT_CONFIGURED.value, str(e)) for i in rows])
        job_services.job_refresh(job_id=job_id)
        return {"embedded": 0, "failed": len(rows), "skipped": len(image_ids) - len(rows), "stat_id": None}
    if exhausted:  # a poison chunk (its worker dies every time) must not be redelivered forever
        rows = _fail_exhausted(rows, exhausted)
        if not rows:
            job_services.job_refresh(job_id=job_id)
            return {"embedded": 0, "failed": len(exhausted), "skipped": len(image_ids) - len(exhausted),
                    "stat_id": None}
    Image.objects.filter(id__in=list(rows)).update(attempts=F("attempts") + 1)
    ordered = [i for i in image_ids if i in rows]
    result, since, previews = _compute(job, runner, rows, ordered)
    stat = _record(job_id, result, previews=previews, ordered=ordered, skipped=len(image_ids) - len(ordered),
                   since=since)
    items = [vector_item(m, v, rows[m.key][2], rows[m.key][1], job.model_id)
             for m, v in zip(result.metas, result.vectors)]
    _hand_over(job, stat, items, job_id=job_id)
    out = {"embedded": len(items), "failed": len(result.failed), "skipped": len(image_ids) - len(ordered),
           "stat_id": stat.id, "paused_ms": round(result.paused_ms, 1)}
    if previews is not None:
        out["previews"] = result.previews.as_dict()
    return out


def _settled_by_job(job: Job | None, *, job_id: str, image_ids: list[str]) -> dict | None:
    """The result of a chunk its job's state settles without computing: a missing job (all skipped), a
    cancelled one (its images fail ``cancelled``), a paused one (the chunk parked,
    ``job_chunk_park``); ``None``: the chunk runs."""
    if job is None:
        return {"embedded": 0, "failed": 0, "skipped": len(image_ids), "stat_id": None}
    if job.status == JobStatus.CANCELLED:
        image_services.images_mark_failed([(i, Reason.CANCELLED.value, "the job was cancelled") for i in image_ids])
        return {"embedded": 0, "failed": 0, "skipped": len(image_ids), "stat_id": None}
    if job.status == JobStatus.PAUSED and job_services.job_chunk_park(job_id=job_id, image_ids=image_ids):
        return {"embedded": 0, "failed": 0, "skipped": 0, "parked": len(image_ids), "stat_id": None}
    return None


def _queued_rows(image_ids: list[str]) -> tuple[dict[str, tuple[str, str, str]], set[uuid.UUID]]:
    """One read gives the chunk's queued rows and their attempts: ``({image id: (storage key,
    sha256, point id)}, ids of those delivered ``BULK_MAX_ATTEMPTS`` times already)``."""
    rows, exhausted = {}, set()
    for i, key, sha, pid, attempts in Image.objects.filter(id__in=image_ids, status=ImageStatus.QUEUED).values_list(
        "id", "storage_key", "sha256", "point_id", "attempts"
    ):
        rows[str(i)] = (key, sha, str(pid))
        if attempts >= settings.BULK_MAX_ATTEMPTS:
            exhausted.add(i)
    return rows, exhausted


def _fetch_first(job: Job, rows: dict[str, tuple[str, str, str]], *,
                 job_id: str) -> tuple[dict[str, tuple[str, str, str]], list[str]]:
    """Send the rows without their bytes yet (a catalogue row of a resumed job: no sha256) to the
    fetch worker first; returns ``(the rows that have their bytes, the ids sent)``."""

    unfetched = [i for i, (_, sha, _) in rows.items() if not sha]
    if unfetched:
        dispatch.send_fetch_chunk(job_id=job_id, image_ids=unfetched, priority=job.priority)
        rows = {i: v for i, v in rows.items() if v[1]}
    return rows, unfetched


def _fail_exhausted(rows: dict[str, tuple[str, str, str]],
                    exhausted: set[uuid.UUID]) -> dict[str, tuple[str, str, str]]:
    """Fail the images delivered ``BULK_MAX_ATTEMPTS`` times (``attempts_exhausted``); the other rows."""
    detail = f"delivered {settings.BULK_MAX_ATTEMPTS} times without finishing"
    image_services.images_mark_failed([(str(i), Reason.ATTEMPTS_EXHAUSTED.value, detail) for i in exhausted])
    return {k: v for k, v in rows.items() if uuid.UUID(k) not in exhausted}


def _compute(job: Job, runner, rows: dict[str, tuple[str, str, str]], ordered: list[str]):
    """Run the chunk's images ``ordered`` through ``runner`` in the bulk lane's turn: a migration
    chunk in its slot and reading previews, a background ingest chunk yielding while the interactive
    lane is at capacity. Returns ``(workers.runner.BatchResult, the utilisation window's start (Unix
    s), the Previews read or None)``."""

    sampler = metrics.worker_sampler()  # CPU/GPU utilisation once a second while chunks run
    slot = contextlib.nullcontext(0.0)
    migration = job.kind == JobKind.MIGRATION
    # a re-embed (migration, dual embedding): these bytes were decoded before, their preview is read
    # when the model fits in it (docs/previews.md); a first embedding draws it instead
    previews = Previews({k: v[1] for k, v in rows.items()}) if migration else None
    if migration:  # background priority: one chunk computing per host
        slot = lane_control.migration_slot()  # (MIGRATION_BULK_SLOTS), small passes in the interactive lane's idle time
    # waits while the interactive lane is at capacity: a migration, or a background job on time
    ingest_yields = (not migration and job.priority == JobPriority.BACKGROUND and settings.BULK_YIELD_MAX_S > 0
                     and not job_services.job_deadline_at_risk(job))
    # the interactive lane's wait model is told while the chunk computes, and whether it yields
    # (lane_control.bulk_yield.BulkActivity)
    with slot, lane_control.bulk_computing(yields=migration or ingest_yields) as activity:
        passes = {}
        if migration:
            passes = {"micro_batch": settings.MIGRATION_MICRO_BATCH or None, "pass_ms": settings.MIGRATION_PASS_MS,
                      "before_pass": lane_control.migration_yielder(activity=activity)}
        elif ingest_yields:
            passes = {"micro_batch": settings.BULK_YIELD_MICRO_BATCH or None,
                      "before_pass": lane_control.ingest_yielder(activity=activity)}
        chunk_started = time.time()
        try:
            result = runner.run(ordered, originals_loader({k: v[:2] for k, v in rows.items()}),
                                thumbnailer({k: v[1] for k, v in rows.items()}), previews=previews, **passes)
        except Exception as e:  # the model (or the store of its blobs) failed: the chunk is retried elsewhere
            worker_health.pass_failed(f"bulk chunk of job {job.id}: {type(e).__name__}: {e}")
            raise
    _judge(result)
    return result, chunk_started - sampler.interval_s, previews


def _judge(result) -> None:
    """Report the chunk's passes to ``worker_health``: failed when the model gave vectors and every
    one was refused (``workers.screen``), succeeded when one vector is usable; a chunk whose images
    all failed before the model (undecodable files) says nothing about the model."""
    refused = [f for f in result.failed if f.reason in {r.value for r in screen.REASONS}]
    if len(result.metas):
        worker_health.pass_succeeded()
    elif refused:
        worker_health.pass_failed(f"every vector of a bulk chunk refused ({refused[0].reason})")


def _record(job_id: str, result, *, previews: Previews | None, ordered: list[str], skipped: int,
            since: float) -> BatchStat:
    """Record a computed chunk: its previews read, its failed images, its ``BatchStat`` row, its
    counts and the job's utilisation since ``since`` (Unix s). Returns the row."""
    if previews is not None:
        count_previews(result.previews, job_id=job_id)
    if result.paused_ms:
        log.info("chunk of job %s: %d images, paused %.0f ms for interactive work", job_id,
                 len(ordered), result.paused_ms)
    image_services.images_mark_failed([(f.key, f.reason, f.detail) for f in result.failed])
    metrics.count_refused_embeddings(lane=Lane.BULK, reasons=[f.reason for f in result.failed])
    stat = batch_stat(job_id=job_id, lane=Lane.BULK, images=len(ordered), failed=len(result.failed),
                      timings=result.timings)
    metrics.count_images(lane=Lane.BULK, status="failed", n=len(result.failed))
    metrics.count_images(lane=Lane.BULK, status="skipped", n=skipped)
    metrics.job_record_utilisation(job_id=job_id, since=since, config=settings.PIPELINE)
    return stat


def _hand_over(job: Job, stat: BatchStat, items: list[dict], *, job_id: str) -> None:
    """Write the chunk's ``items``: here against a Qdrant server (no vector crosses Redis), else as
    an ``index_chunk`` message to the vectors worker, the images waiting visibly meanwhile; a chunk
    with none finishes its ``BatchStat`` and refreshes the job."""

    if items and sink.is_direct():
        chunk_index(job_id=job_id, stat_id=stat.id, items=items, priority=job.priority)
    elif items:
        dispatch.send_index_chunk(job_id=job_id, stat_id=stat.id, items=items, priority=job.priority)
        images_wait_for_store([it["id"] for it in items],
                              "vector computed; waiting for the vectors worker to write it")
    else:
        BatchStat.objects.filter(id=stat.id).update(finished_at=timezone.now())
        job_services.job_refresh(job_id=job_id)
