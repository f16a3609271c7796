"""Bulk job services: create and split into chunks, progress, state transitions.

A job's counts are never stored: they are derived from its images' statuses, so they cannot drift
from the truth when a chunk is redelivered or a worker dies.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from typing import Iterable

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Min, Q, Sum
from django.utils import timezone
from kombu.exceptions import OperationalError

from embeddings import bulk_schedule, dispatch, metrics, runtime
from embeddings.errors import ApplicationError
from embeddings.models import (
    LIVE_ORIGINAL_STATUSES,
    TERMINAL_IMAGE_STATUSES,
    BatchStat,
    Image,
    ImageStatus,
    Job,
    JobKind,
    JobPriority,
    JobStatus,
    Lane,
    WebhookEvent,
)
from embeddings.selectors import stage_summary
from embeddings.services.catalogue.images import images_cancelled, images_create
from embeddings.services.catalogue.sources import SourceFile
from embeddings.services.webhooks import endpoints as webhook_endpoints
from embeddings.services.webhooks import events as webhook_events

log = logging.getLogger(__name__)

#: Allowed transitions of the job state machine (HackSoftware style: a service guards them).
_TRANSITIONS = {
    JobStatus.QUEUED: {JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.CANCELLED, JobStatus.DONE},
    JobStatus.RUNNING: {JobStatus.PAUSED, JobStatus.CANCELLED, JobStatus.DONE},
    JobStatus.PAUSED: {JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLED},
    JobStatus.CANCELLED: set(),
    JobStatus.DONE: set(),
}


def job_create(
    *,
    owner,
    sources: Iterable[SourceFile],
    name: str = "",
    priority: str = JobPriority.BACKGROUND,
    deadline: dt.datetime | None = None,
    callbacks: Iterable = (),
    key_prefix: str = "",
) -> Job:
    """Create the job (its usage metered to API key ``key_prefix``, ``""``: none), then store its sources a slice at a time, sending each chunk as soon as its
    images are stored (issue 11 item 6: the workers start on a big upload's first images while the
    rest is still being stored, instead of after the whole request).

    Each slice is stored and committed on its own (``images_create``); its queued images join a
    pending list, and whenever more than ``chunk_size`` (``PIPELINE.batch_size``, 64 by default)
    are pending, one chunk of ``chunk_size`` is sent (after the slice's commit). At least one queued
    image stays unsent until every source is stored: a committed, queued row is what stops
    ``job_refresh`` from calling the job ``done`` when the chunks sent so far finish before the
    upload's later slices exist. The first slice holds ``chunk_size + 1`` sources, so the first
    chunk leaves as soon as its 64 images (and that one more) are stored; the rest go at the end.

    ``total`` is the number of sources from the start (every source becomes one image row,
    duplicates and refusals included). If storing fails part way, ``total`` becomes the number of
    rows made, what was stored is still sent, and the error propagates.

    ``callbacks``: the job's own webhook endpoints, unsaved (``webhooks.endpoints.job_callbacks_prepare``),
    saved with the job before any of its work is sent.

    Returns:
        The job (``total`` = number of sources, duplicates and refusals included).
    """

    sources = list(sources)
    job = Job.objects.create(
        owner=owner, name=name[:200], priority=priority, deadline=deadline, model_id=runtime.model_id(),
        chunk_size=settings.PIPELINE.batch_size, total=len(sources), key_prefix=key_prefix,
    )
    webhook_endpoints.job_endpoints_attach(job=job, endpoints=callbacks)
    size = job.chunk_size
    pending: list[str] = []
    made = 0

    def send(ids: list[str]) -> None:
        transaction.on_commit(lambda: _chunks_send(job=job, image_ids=ids))

    try:
        start = 0
        while start < len(sources):
            end = start + (size + 1 if start == 0 else size)
            images = images_create(owner=owner, sources=sources[start:end], lane=Lane.BULK, job=job)
            made += len(images)
            start = end
            pending += [str(im.id) for im in images if im.status == ImageStatus.QUEUED]
            while len(pending) > size:
                send(pending[:size])
                pending = pending[size:]
    except BaseException:
        Job.objects.filter(id=job.id).update(total=made)
        job.total = made
        raise
    finally:
        if pending:
            send(pending)
    if made and not pending:  # nothing to embed (duplicates, refusals): the job is done already
        job_refresh(job_id=job.id)
    return job


def _chunks_send(*, job: Job, image_ids: list[str]) -> None:
    """Send a new job's chunks. A broker that refuses them (full, or down: kombu's
    ``OperationalError``) leaves their rows queued and committed, which the reconciler sends again
    once they are older than ``RECONCILE_GRACE_S`` (as after a Redis restart): the upload goes on,
    and the job is answered as accepted, for that is what it is."""
    try:
        dispatch.send_job_chunks(job=job, image_ids=image_ids)
    except OperationalError as e:
        log.warning("job %s: %d images not queued now (%s); the reconciler sends them again", job.id,
                    len(image_ids), e)


def job_delete(*, job: Job) -> None:
    """Delete a job and its images (the admin's delete): each image goes through
    ``images.image_deleted`` (points, blobs and copies elsewhere settled), as for any deletion."""
    job.delete()


def job_counts(job: Job) -> dict[str, int]:
    """``{status: count}`` over the job's images, every status present (0 when none)."""
    counts = {s.value: 0 for s in ImageStatus}
    for row in Image.objects.filter(job=job).values("status").annotate(n=Count("id")):
        counts[row["status"]] = row["n"]
    return counts


def job_refresh(*, job_id) -> Job:
    """Move the job to ``running`` on its first result and to ``done`` when no image is queued.

    A job whose manifest or prefix is still being read (``reading``) is never ``done``: its later
    rows do not exist yet. Called once per written chunk, so its cost must not grow with the job: "is any image still
    queued?" is an ``EXISTS`` that the ``(job, status)`` index answers by one index seek (a count of
    the job's images per chunk would make a job's database work quadratic in its size: issue 11).
    At most four queries, whatever the job's size, and one more at its end (the webhook endpoints
    that hear of it).
    """
    job = Job.objects.get(id=job_id)
    if job.status in (JobStatus.DONE, JobStatus.CANCELLED):
        return job
    now = timezone.now()
    if not job.reading and not Image.objects.filter(job_id=job_id, status=ImageStatus.QUEUED).exists():
        listeners = job_listeners(job)
        # the end and its webhook messages commit together; a job nobody listens to needs no transaction
        with transaction.atomic() if listeners else contextlib.nullcontext():
            changed = Job.objects.filter(id=job.id).exclude(status__in=(JobStatus.DONE, JobStatus.CANCELLED)).update(
                status=JobStatus.DONE, finished_at=now, started_at=job.started_at or now
            )
            if changed:
                job.refresh_from_db()
                if listeners:
                    job_event_emit(job=job, event=None, endpoints=listeners)
    elif job.status == JobStatus.QUEUED:
        changed = Job.objects.filter(id=job.id, status=JobStatus.QUEUED).update(status=JobStatus.RUNNING, started_at=now)
        if changed:
            job.refresh_from_db()
    else:
        changed = 0
    if changed:
        if job.status == JobStatus.DONE and job.kind == JobKind.MIGRATION:  # the lifecycle gates the new space
            transaction.on_commit(lambda: dispatch.send_job_done(job_id=str(job.id)))
    return job


def job_mark_started(*, job_id, status: str | None = None) -> None:
    """Record the start of the first chunk (idempotent). ``status``: the job's status as the caller
    just read it; when it is not ``queued`` there is nothing to record and no query is made."""
    if status is not None and status != JobStatus.QUEUED:
        return
    Job.objects.filter(id=job_id, status=JobStatus.QUEUED).update(status=JobStatus.RUNNING, started_at=timezone.now())


#: ``Image.reason`` of a queued image whose chunk reached a worker while its job was paused.
PARKED = "paused"


def job_chunk_park(*, job_id, image_ids: list[str]) -> bool:
    """Park a chunk of a paused job instead of running it: its queued images keep their status and
    get the reason ``paused``; :func:`job_transition` to ``queued`` (resume) dispatches them again.

    Parking is how a paused job yields: its chunks leave the queue (nothing spins or holds a worker
    thread while the job is paused) and the database, not the broker, remembers them. The check and
    the marking share one transaction holding the job row, as resume does, so a chunk is either
    parked before a resume (and re-dispatched by it) or sees the resumed job and runs.

    Returns:
        True when parked; False when the job is no longer paused (the caller runs the chunk).
    """
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(id=job_id).first()
        if job is None or job.status != JobStatus.PAUSED:
            return False
        Image.objects.filter(id__in=image_ids, job_id=job_id, status=ImageStatus.QUEUED).update(
            reason=PARKED, reason_detail="the job was paused; resuming it queues this image again"
        )
    return True


def job_transition(*, job: Job, to: str) -> Job:
    """Pause, resume (→ queued) or cancel a job.

    Pause lets running chunks finish and parks the others when they reach a worker
    (:func:`job_chunk_park`). Resume dispatches the parked images again, in chunks, at the back of
    the job's priority queue; chunks still in the queue simply run. Cancel marks every queued image
    ``cancelled`` (its chunks then do nothing when they run); the job's own skipped duplicates of
    them are cancelled too, and copies of those bytes uploaded elsewhere take the original's place
    (``images_cancelled``), so they stay searchable.

    Raises:
        ApplicationError: ``invalid_transition`` (409).
    """
    to = JobStatus(to)
    if to not in _TRANSITIONS[JobStatus(job.status)]:
        raise ApplicationError(
            f"a {job.status} job cannot become {to}", code="invalid_transition", status=409,
            extra={"from": job.status, "to": to.value},
        )
    with transaction.atomic():
        Job.objects.select_for_update().filter(id=job.id).first()  # serialises with job_chunk_park
        Job.objects.filter(id=job.id).update(status=to, finished_at=timezone.now() if to == JobStatus.CANCELLED else None)
        if to == JobStatus.CANCELLED:
            Image.objects.filter(job=job, status=ImageStatus.QUEUED).update(
                status=ImageStatus.CANCELLED, reason="cancelled", reason_detail="the job was cancelled"
            )
            images_cancelled(job=job)
            job_event_emit(job=Job.objects.get(id=job.id), event=WebhookEvent.JOB_CANCELLED)
        elif to in (JobStatus.QUEUED, JobStatus.RUNNING):  # resumed
            parked = Image.objects.filter(job=job, status=ImageStatus.QUEUED, reason=PARKED)
            ids = [str(i) for i in parked.order_by("created_at").values_list("id", flat=True)]
            parked.update(reason="", reason_detail="")
            if ids:
                transaction.on_commit(lambda: dispatch.send_job_chunks(job=job, image_ids=ids))
            else:  # the fair scheduler's unsent chunks wait in the database: the window takes them again
                transaction.on_commit(dispatch.bulk_pump)
    job.refresh_from_db()
    return job


#: The statuses of a job's settled rows, what its rate counts: embedded, skipped (its bytes were
#: stored already: a re-imported catalogue settles most rows this way, and they take the job's time
#: like any other), failed and expired. Cancelled rows are left out: a cancel settles them, not work.
SETTLED_STATUSES = (ImageStatus.EMBEDDED, ImageStatus.SKIPPED, ImageStatus.FAILED, ImageStatus.EXPIRED)


def _pace(job: Job, counts: dict[str, int]) -> tuple[float | None, dt.datetime | None, bool]:
    """``(throughput rows/s, ETA, at risk)`` of ``job`` from its image ``counts``.

    - throughput: settled rows (:data:`SETTLED_STATUSES`) per second since the job started (until it
      finished); None before a row settled or before it started.
    - ETA: now plus the rows still queued at that rate; None with nothing queued or no rate yet.
    - at risk: it has a deadline, rows still queued, and either the ETA is past the deadline or,
      with no rate yet, even the fastest rate it could have (no row settled in the ``waited``
      seconds since it started, or was made when it has not started: under one row per ``waited``
      seconds) leaves its queued rows past the deadline. A job that has just begun is not at risk
      merely for having no rate yet (that made every job with a deadline at risk in its first
      seconds, and ``job.at_risk`` is sent once per job).
    """
    now = timezone.now()
    settled = sum(counts[s] for s in SETTLED_STATUSES)
    end = job.finished_at or now
    elapsed = (end - job.started_at).total_seconds() if job.started_at else 0.0
    throughput = settled / elapsed if elapsed > 0 and settled else None
    remaining = counts[ImageStatus.QUEUED]
    eta = now + dt.timedelta(seconds=remaining / throughput) if remaining and throughput else None
    if not (job.deadline and remaining):
        return throughput, eta, False
    if eta is not None:
        return throughput, eta, eta > job.deadline
    waited = max(0.0, (now - (job.started_at or job.created_at)).total_seconds())
    return throughput, eta, now + dt.timedelta(seconds=remaining * waited) > job.deadline


#: ``{job id: (monotonic s when read, at risk)}`` of this process (:func:`job_deadline_at_risk`).
_at_risk_read: dict[str, tuple[float, bool]] = {}


def job_deadline_at_risk(job: Job, *, max_age_s: float = 30.0) -> bool:
    """Whether ``job`` misses its deadline at the rate it has run so far (every settled row counts:
    :func:`_pace`; what ``GET /api/jobs/{id}/`` shows as ``at_risk``: :func:`job_progress`). A job
    without a deadline is never at risk.

    Read at most once every ``max_age_s`` seconds per job in this process (its chunks ask before
    each one runs; the count over the job's images would otherwise make a job's database work grow
    with its size squared, issue 11).
    """
    if job.deadline is None:
        return False
    now = time.monotonic()
    read = _at_risk_read.get(str(job.id))
    if read is not None and now - read[0] < max_age_s:
        return read[1]
    at_risk = _pace(job, job_counts(job))[2]
    if len(_at_risk_read) > 1024:  # a long-lived worker forgets old jobs
        _at_risk_read.clear()
    _at_risk_read[str(job.id)] = (now, at_risk)
    return at_risk


#: Seconds of the bulk lane's recent chunks (``BatchStat``) whose images give its rate (:func:`lane_rate`).
LANE_RATE_WINDOW_S = 60.0


def lane_rate(*, own_rate: float | None = None) -> float | None:
    """The bulk lane's images/s: the images of its chunks recorded in the last
    :data:`LANE_RATE_WINDOW_S` seconds over the time they span (one query); ``own_rate`` (a job's
    own throughput) when none was recorded; None when neither is known."""
    now = timezone.now()
    row = BatchStat.objects.filter(lane=Lane.BULK, created_at__gte=now - dt.timedelta(seconds=LANE_RATE_WINDOW_S)
                                   ).aggregate(images=Sum("images"), first=Min("created_at"))
    if row["images"] and row["first"] is not None:
        span = max((now - row["first"]).total_seconds(), 1.0)
        return row["images"] / span
    return own_rate


def job_lane(job: Job, *, own_rate: float | None = None) -> dict | None:
    """Where ``job`` stands in the bulk lane under the fair scheduler (``BULK_SCHEDULER=fair``;
    ``queueing.bulk_order.outlook``): ``{"position": jobs expected to finish before it, "jobs": jobs
    in the lane, "share": its fraction of the lane's images/s now, "eta": datetime or None,
    "at_risk", "infeasible": its deadline cannot be met any more, "rate_images_per_s": the lane's}``.
    None under ``fifo``, or when none of its chunks is unsent or in flight. Two queries."""
    if not bulk_schedule.enabled() or job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
        return None
    rate = lane_rate(own_rate=own_rate)
    outlooks, _ = bulk_schedule.lane_outlook(rate=rate)
    mine = outlooks.get(str(job.id))
    if mine is None:
        return None
    return {"position": mine.position, "jobs": mine.jobs, "share": mine.share,
            "eta": dt.datetime.fromtimestamp(mine.eta, tz=dt.timezone.utc) if mine.eta is not None else None,
            "at_risk": mine.at_risk, "infeasible": mine.infeasible,
            "rate_images_per_s": round(rate, 3) if rate else None}


def job_progress(job: Job) -> dict:
    """Everything ``GET /api/jobs/{id}/`` shows: counts, throughput (settled rows/s: :func:`_pace`),
    ETA, at risk, timings; under the fair scheduler its place in the lane (:func:`job_lane`), whose
    ETA (the lane's order over the other jobs) replaces the one from its own pace, and ``at_risk``
    is judged on it."""

    counts = job_counts(job)
    finished = sum(counts[s] for s in TERMINAL_IMAGE_STATUSES)
    end = job.finished_at or timezone.now()
    elapsed = (end - job.started_at).total_seconds() if job.started_at else 0.0
    throughput, eta, at_risk = _pace(job, counts)
    lane = job_lane(job, own_rate=throughput)
    if lane is not None and lane["eta"] is not None:  # the lane's order decides when it ends, not its past pace
        eta, at_risk = lane["eta"], lane["at_risk"]
    batches = BatchStat.objects.filter(job=job)
    failed = Image.objects.filter(job=job, status=ImageStatus.FAILED)
    failures = list(failed.order_by("row", "created_at").values("id", "original_name", "reason", "reason_detail", "row",
                                                                 "origin")[:1000])
    reasons = dict(failed.order_by().values("reason").annotate(n=Count("id")).values_list("reason", "n"))
    return {
        "counts": counts,
        "total": job.total,
        "embedded": counts[ImageStatus.EMBEDDED],
        "skipped": counts[ImageStatus.SKIPPED],
        "failed": counts[ImageStatus.FAILED],
        "finished": finished,
        "elapsed_s": round(elapsed, 3),
        "throughput_images_per_s": round(throughput, 3) if throughput else None,
        "eta": eta,
        "at_risk": at_risk,
        "lane": lane,
        "failures": failures,
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "timings_ms": stage_summary(batches),
        "batches": batches.count(),
        # CPU % / GPU % / GPU MiB once a second while its chunks ran: min/avg/p95/max + the samples
        "utilisation": metrics.job_utilisation(job),
        "pipeline": job.pipeline,
    }


def images_retry(*, images) -> int:
    """Queue failed images again on the bulk lane (their job, or a new "retry" job for interactive
    uploads). A failed image whose bytes have an original meanwhile (the owner uploaded them again)
    becomes its ``skipped`` duplicate instead (constraint ``image_one_original``). Returns how many
    were queued."""
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
            ids = [im.id for im in sorted(group, key=lambda im: im.sha256) if _requeue_failed(im, job)]
            if not ids:
                job_refresh(job_id=job.id)
        transaction.on_commit(
            lambda job=job, ids=ids: dispatch.send_job_chunks(job=job, image_ids=[str(i) for i in ids]))
        n += len(ids)
    return n


def _requeue_failed(im: Image, job: Job) -> bool:
    """Queue one failed image in ``job`` as an original; if its bytes have one, skip it instead.
    Returns True when queued."""
    try:
        with transaction.atomic():
            Image.objects.filter(id=im.id).update(status=ImageStatus.QUEUED, reason="", reason_detail="", job=job,
                                                  duplicate_of=None)
        return True
    except IntegrityError:
        winner = Image.objects.filter(owner_id=im.owner_id, model_id=im.model_id, sha256=im.sha256,
                                      status__in=LIVE_ORIGINAL_STATUSES, duplicate_of__isnull=True).first()
        if winner is None:  # gone meanwhile: nothing to point at; it stays failed for another retry
            return False
        Image.objects.filter(id=im.id).update(status=ImageStatus.SKIPPED, reason="", reason_detail="", job=job,
                                              duplicate_of=winner, width=winner.width, height=winner.height,
                                              format=winner.format)
        return False


# --- webhooks (issue 42, docs/webhooks.md) ----------------------------------------------------------

def job_outcome(job: Job, counts: dict[str, int]) -> dict | None:
    """Why a ``done`` job counts as failed (``job.failed``), or None when it succeeded (``job.done``).

    A done job failed when its manifest or prefix could not be read to the end (``source.error``,
    even if some rows were embedded before), or when it embedded nothing: no image ``embedded`` or
    ``skipped`` (a skipped duplicate shares a stored vector, so it counts as a success), including
    a job with no image at all (an empty manifest or prefix).

    Returns:
        ``{"code", "message"}``: the source's error, or ``no_image_embedded``.
    """
    error = (job.source or {}).get("error")
    if error:
        return {"code": error.get("code", "source_error"), "message": error.get("message", "")}
    if counts[ImageStatus.EMBEDDED] + counts[ImageStatus.SKIPPED] == 0:
        n = sum(counts.values())
        return {"code": "no_image_embedded", "message": f"none of its {n} images was embedded" if n
                else "it had no image"}
    return None


def job_event_data(job: Job, counts: dict[str, int]) -> dict:
    """A job event's ``data``: id, name, status, counts, failure reasons, deadline, times, URL."""
    reasons = dict(Image.objects.filter(job=job, status=ImageStatus.FAILED).order_by().values("reason")
                   .annotate(n=Count("id")).values_list("reason", "n"))

    def iso(t):
        return t.isoformat() if t else None

    return {
        "job_id": str(job.id), "name": job.name, "status": job.status, "priority": job.priority,
        "counts": {"total": job.total, **{s: counts[s] for s in ImageStatus.values}},
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "deadline": iso(job.deadline), "created_at": iso(job.created_at), "started_at": iso(job.started_at),
        "finished_at": iso(job.finished_at), "url": f"/api/jobs/{job.id}/",
    }


def job_listeners(job: Job) -> list:
    """The active webhook endpoints that hear of ``job`` (``webhooks.events.job_recipients``: one query);
    none for a migration job, whose events are the lifecycle's (``migration.*``)."""
    return webhook_events.job_recipients(job) if job.kind == JobKind.INGEST else []


def job_event_emit(*, job: Job, event: str | None, extra: dict | None = None, endpoints: list | None = None) -> int:
    """Emit a job event to its endpoints and its owner's (``webhooks.events.event_emit``, once per job and
    type). ``event`` None: the end of a done job, ``job.done`` or ``job.failed`` (:func:`job_outcome`).
    ``endpoints``: :func:`job_listeners` when the caller has read them. Migration jobs are the
    lifecycle's (``migration.*`` events): nothing. Returns messages made."""
    if endpoints is None:
        endpoints = job_listeners(job)
    if not endpoints:
        return 0
    counts = job_counts(job)
    data = {**job_event_data(job, counts), **(extra or {})}
    if event is None:
        failure = job_outcome(job, counts)
        event = WebhookEvent.JOB_DONE if failure is None else WebhookEvent.JOB_FAILED
        if failure is not None:
            data["failure"] = failure
    return len(webhook_events.event_emit(event=event, key=f"{event}:{job.id}", data=data, endpoints=endpoints))


def jobs_at_risk_notify() -> int:
    """Emit ``job.at_risk`` for each unfinished job with a deadline that now misses it
    (:func:`_pace`: what ``GET /api/jobs/{id}/`` shows as ``at_risk``), once per job: the
    reconciler calls it every round. Only jobs someone listens to are read (one count each).

    Returns:
        Messages made.
    """

    listened = Q(webhooks__active=True) | Q(owner__webhooks__active=True, owner__webhooks__job__isnull=True)
    jobs = Job.objects.filter(listened, kind=JobKind.INGEST, deadline__isnull=False,
                              status__in=(JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED)).distinct()
    made = 0
    outlooks = bulk_schedule.lane_outlook(rate=lane_rate())[0] if bulk_schedule.enabled() else {}
    for job in jobs:
        counts = job_counts(job)
        throughput, eta, at_risk = _pace(job, counts)
        lane = outlooks.get(str(job.id))
        if lane is not None and lane.eta is not None:  # the lane's order, as GET /api/jobs/{id}/ says
            eta, at_risk = dt.datetime.fromtimestamp(lane.eta, tz=dt.timezone.utc), lane.at_risk
        if at_risk:
            made += job_event_emit(job=job, event=WebhookEvent.JOB_AT_RISK, extra={
                "eta": eta.isoformat() if eta else None,
                "throughput_images_per_s": round(throughput, 3) if throughput else None})
    return made
