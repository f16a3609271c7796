"""Changing the model without downtime (issue 13): migrations, dual embedding, promote, rollback, drop.

An embedding space (``EmbeddingSpace``) is one model's collection. A *migration* to model M makes
M's space a ``candidate`` and re-embeds the catalogue into it with the ordinary bulk machinery:

- for every live original the users hold (``source`` null, ``duplicate_of`` null, queued or
  embedded, in any other space) a *copy* row is created under M: same owner, bytes, storage key,
  name; ``source`` = the user's row; ``job`` = the migration job (``Job.kind`` ``migration``, bulk
  lane, background priority); ``point_id`` = uuid5(M, sha256). Chunks of ``chunk_size`` (``MIGRATION_CHUNK_SIZE``, 512) go to
  the bulk queue as the copies are created (:func:`migration_fill`), so the first chunk never waits
  for the whole catalogue; progress, ETA, pause/resume/cancel and per-image failures are the job's.
- every new upload gets a copy in each candidate and standby space in the creating transaction
  (``catalogue.copies.dual_embed``, called by ``images.images_create``), embedded on the bulk lane in a small
  per-owner "dual embedding" job, so the answer to the upload never waits for it.
- :func:`promote` moves ``active`` in one transaction (every process sees it within
  ``SPACE_CACHE_S``: ``spaces.active``); the old active space becomes ``standby`` and keeps
  receiving new uploads, so :func:`rollback` (promoting it again) loses nothing.
- :func:`space_drop` deletes a non-active space's collection (one call to the store's owner, not
  one per point) and its copy rows.

Users never see copies: lists and look-ups show rows with ``source`` null; search hits map to the
user's row by owner and sha256 (``selectors.hits_to_results``), so image ids never change.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from embeddings import dispatch, sink, spaces
from embeddings.errors import ApplicationError
from embeddings.models import (
    EmbeddingSpace,
    Image,
    ImageStatus,
    Job,
    JobKind,
    JobPriority,
    JobStatus,
    SpaceState,
    WebhookEvent,
)
from embeddings.services.catalogue import copies
from embeddings.services.catalogue.images import DROPPING
from embeddings.services.catalogue.jobs import job_refresh, job_transition
from embeddings.services.lifecycle import gate
from embeddings.services.webhooks import events as webhook_events

log = logging.getLogger(__name__)

#: User rows read per batch while the copies are created (8 chunks of 64).
FILL_BATCH = 512


def _error(message: str, code: str, status: int = 409, **extra) -> ApplicationError:
    return ApplicationError(message, code=code, status=status, extra=extra or None)


def migration_start(*, owner, model_name: str, pretrained: str, precision: str | None = None,
                    seed: int | None = None, fill: bool = True) -> EmbeddingSpace:
    """Start re-embedding the catalogue with another model: its space becomes the ``candidate``
    (new uploads are embedded in it from now on), a migration job is created, and the copies are
    created and queued by :func:`migration_fill` (a bulk-queue task, so the request returns at once;
    ``fill`` False: the caller runs it).

    Args:
        model_name, pretrained, precision, seed: the model (precision: CLIP_PRECISION; seed:
            CLIP_SEED when None).

    Raises:
        ApplicationError: ``invalid`` (400: unknown architecture, missing checkpoint file, bad
            precision), ``model_not_configured`` (400: no worker may load it: neither CLIP_MODEL nor
            CLIP_MODELS), ``already_active`` (409), ``migration_running`` (409: another candidate
            exists), ``space_exists`` (409: a standby of that model exists: promote it instead).
    """
    base = settings.PIPELINE
    try:
        cfg = base.replace(model_name=model_name, pretrained=pretrained, precision=precision or base.precision,
                           seed=base.seed if seed is None else seed)
        fields = spaces.space_for_config(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise ApplicationError(f"cannot use model {model_name}:{pretrained}: {e}", code="invalid") from e
    try:
        configured = spaces.configured_configs()
    except (ValueError, FileNotFoundError) as e:
        raise ApplicationError(f"CLIP_MODELS cannot be read in this process: {e}", code="invalid") from e
    if fields["model_id"] not in configured:
        raise _error(f"no worker is configured for {fields['model_id']}: add {model_name}:{pretrained}:"
                     f"{cfg.precision} to CLIP_MODELS on every worker and restart them",
                     spaces.MODEL_NOT_CONFIGURED, 400, model_id=fields["model_id"], configured=sorted(configured))
    source = spaces.active(fresh=True)
    with transaction.atomic():
        existing = {s.model_id: s for s in EmbeddingSpace.objects.select_for_update()}
        space = existing.get(fields["model_id"])
        if space is not None and space.state == SpaceState.ACTIVE:
            raise _error(f"{space.model_id} is the active space already", "already_active", model_id=space.model_id)
        running = [s for s in existing.values() if s.state == SpaceState.CANDIDATE]
        if running:
            raise _error(f"a migration to {running[0].model_id} is under way: promote or drop it first",
                         "migration_running", model_id=running[0].model_id)
        if space is not None and space.state == SpaceState.STANDBY:
            raise _error(f"{space.model_id} is the standby space (kept up to date): roll back to it instead",
                         "space_exists", model_id=space.model_id)
        job = Job.objects.create(owner=owner, name=f"migrate to {fields['model_id']}"[:200], kind=JobKind.MIGRATION,
                                 priority=JobPriority.BACKGROUND, model_id=fields["model_id"],
                                 chunk_size=settings.MIGRATION_CHUNK_SIZE, total=copies.catalogue_size(fields["model_id"]))
        if space is None:
            space = EmbeddingSpace.objects.create(**fields, state=SpaceState.CANDIDATE, job=job, source=source)
        else:  # a dropped space started again: an empty collection, a new job
            EmbeddingSpace.objects.filter(pk=space.pk).update(
                state=SpaceState.CANDIDATE, job=job, source=source, dropped_at=None, promoted_at=None,
                gate_report={}, cutoff_image=None, cutoff_text=None, calibration={})
            space.refresh_from_db()
    if fill:

        transaction.on_commit(lambda: dispatch.send("migration_fill", (space.id,), **dispatch.bulk_options("urgent")))
    return space


def migration_fill(*, space_id: int) -> int:
    """Create the copy rows of a candidate space's migration job a batch at a time
    (:data:`FILL_BATCH`), each batch committed on its own, and send each chunk of ``chunk_size``
    ids to the bulk queue as soon as it is complete (``dispatch.send_job_chunks``). At least one queued
    copy stays unsent until the end (as ``job_create`` does), so the job cannot be called done while
    copies are still being created. Idempotent: rows that have a copy already are skipped, so running
    it again (a worker died part way) completes the job. The job's ``total`` ends as the number of
    copies it holds.

    Returns:
        The number of copies created.
    """

    space = EmbeddingSpace.objects.select_related("job").get(pk=space_id)
    job = space.job
    if space.state != SpaceState.CANDIDATE or job is None or job.status == JobStatus.CANCELLED:
        return 0
    size = job.chunk_size
    pending: list[str] = []
    made = 0
    for _ in range(2):  # a second pass catches uploads committed before they saw the candidate
        last = None
        while True:
            rows = copies.catalogue(space).order_by("id")
            batch = list((rows if last is None else rows.filter(id__gt=last))[:FILL_BATCH])
            if not batch:
                break
            last = batch[-1].id
            with transaction.atomic():
                ids = copies.copies_insert([copies.copy_of(row, space=space, job=job) for row in batch])
                made += len(ids)
                pending += ids
                while len(pending) > size:
                    chunk, pending = pending[:size], pending[size:]
                    transaction.on_commit(lambda chunk=chunk: dispatch.send_job_chunks(job=job, image_ids=chunk))
    Job.objects.filter(pk=job.pk).update(total=Image.objects.filter(job=job).count())
    if pending:
        dispatch.send_job_chunks(job=job, image_ids=pending)
    else:
        job_refresh(job_id=job.id)
    log.info("migration to %s: %d copies created", space.model_id, made)
    return made


def migration_incomplete(space: EmbeddingSpace) -> dict | None:
    """Why ``space`` cannot be promoted yet, or None: its migration job still has queued copies,
    is paused or cancelled, or users' originals have no copy in it yet (a fill still running).

    Returns:
        ``{"queued": n, "uncopied": n, "job_status": s}`` when incomplete.
    """
    queued = Image.objects.filter(model_id=space.model_id, source__isnull=False, status=ImageStatus.QUEUED)
    if space.job_id is not None:
        queued = queued.filter(job_id=space.job_id)
    n_queued, uncopied = queued.count(), copies.catalogue(space).count()
    status = space.job.status if space.job_id is not None else None
    if n_queued or uncopied or status in (JobStatus.PAUSED, JobStatus.CANCELLED):
        return {"queued": n_queued, "uncopied": uncopied, "job_status": status}
    return None


def promote(space: EmbeddingSpace, *, force: bool = False, by: str = "") -> EmbeddingSpace:
    """Make ``space`` the active one in one transaction: the current active space becomes
    ``standby`` (still receiving new uploads, kept for a rollback), ``space`` becomes ``active``
    with ``promoted_at`` now. Every process sees it within ``SPACE_CACHE_S`` (``spaces.active``).

    A space that was active before (a standby) is not asked through the gate again: that is a
    rollback. A candidate must be complete and pass the quality gate, unless ``force`` (recorded
    in ``gate_report["forced"]``).

    Raises:
        ApplicationError: ``already_active`` (409), ``space_dropped`` (409),
            ``migration_incomplete`` (409: copies still queued or not created yet; ``force`` does
            not override it: a half-filled collection would hide images), ``gate_failed`` /
            ``gate_missing`` (409) unless ``force``.
    """
    space.refresh_from_db()
    if space.state == SpaceState.ACTIVE:
        raise _error(f"{space.model_id} is active already", "already_active", model_id=space.model_id)
    if space.state == SpaceState.DROPPED:
        raise _error(f"{space.model_id} was dropped: start a migration to it again", "space_dropped",
                     model_id=space.model_id)
    report = dict(space.gate_report or {})
    if space.state == SpaceState.CANDIDATE:
        missing = migration_incomplete(space)
        if missing is not None:
            raise _error(f"the migration to {space.model_id} is not finished: {missing['queued']} copies queued, "
                         f"{missing['uncopied']} images without a copy (job {missing['job_status']})",
                         "migration_incomplete", model_id=space.model_id, **missing)
        ok, code, detail = gate.gate_verdict(space)
        if not ok and not force:
            raise _error(f"the quality gate refuses {space.model_id}: {detail}", code or "gate_failed",
                         model_id=space.model_id, gate_report=space.gate_report or None)
        if not ok:
            report["forced"] = {"code": code, "detail": detail, "at": timezone.now().isoformat(), "by": by}
    now = timezone.now()
    with transaction.atomic():
        rows = {s.pk: s for s in EmbeddingSpace.objects.select_for_update().filter(
            state__in=(SpaceState.ACTIVE, SpaceState.CANDIDATE, SpaceState.STANDBY))}
        if space.pk not in rows:
            raise _error(f"{space.model_id} changed state meanwhile", "invalid_transition", model_id=space.model_id)
        previous = next((s for s in rows.values() if s.state == SpaceState.ACTIVE), None)
        EmbeddingSpace.objects.filter(state=SpaceState.ACTIVE).update(state=SpaceState.STANDBY, demoted_at=now)
        EmbeddingSpace.objects.filter(pk=space.pk).update(state=SpaceState.ACTIVE, promoted_at=now, gate_report=report)
        # webhooks: a standby made active again is a rollback; a candidate, a promotion
        event = WebhookEvent.MIGRATION_ROLLED_BACK if rows[space.pk].state == SpaceState.STANDBY \
            else WebhookEvent.MIGRATION_PROMOTED
        webhook_events.event_emit(event=event, key=f"{event}:{space.pk}:{now.isoformat()}", at=now,
                                  endpoints=webhook_events.staff_recipients(), data={
                                      **gate.migration_event_data(EmbeddingSpace.objects.get(pk=space.pk)),
                                      "previous_model_id": previous.model_id if previous else None, "by": by,
                                      "forced": bool(force and report.get("forced"))})
    spaces.forget_cache()
    space.refresh_from_db()
    log.warning("embedding space %s promoted (by %s, force=%s)", space.model_id, by or "?", force)
    return space


def rollback(*, by: str = "") -> EmbeddingSpace:
    """Promote the standby space that was active most recently (the gate is not asked again).

    Raises:
        ApplicationError: ``no_standby`` (409) when there is none.
    """
    standby = EmbeddingSpace.objects.filter(state=SpaceState.STANDBY).order_by(F("demoted_at").desc(nulls_last=True),
                                                                               "-created_at").first()
    if standby is None:
        raise _error("there is no standby space to roll back to", "no_standby")
    return promote(standby, by=by)


def space_drop(space: EmbeddingSpace) -> EmbeddingSpace:
    """Drop a non-active space: its migration job is cancelled if still running, its state becomes
    ``dropped`` (no more dual embedding), its copy rows are deleted (their points go with the
    collection: no forget message per row) and its collection is deleted by the store's owner.
    Users' own rows created while it was active stay (their copies in the other spaces hold their
    vectors). The row is kept as a record.

    Raises:
        ApplicationError: ``space_active`` (409) for the active space; ``vectors_unavailable`` (503)
            when the store's owner does not answer (the space is dropped already; dropping it again
            retries the collection's deletion).
    """

    space.refresh_from_db()
    if space.state == SpaceState.ACTIVE:
        raise _error(f"{space.model_id} is the active space: promote another one first", "space_active",
                     model_id=space.model_id)
    if space.job_id is not None and space.job.status not in (JobStatus.DONE, JobStatus.CANCELLED):
        job_transition(job=space.job, to=JobStatus.CANCELLED)
    EmbeddingSpace.objects.filter(pk=space.pk).update(state=SpaceState.DROPPED, dropped_at=timezone.now())
    for job in Job.objects.filter(kind=JobKind.MIGRATION, name=copies.DUAL_JOB, model_id=space.model_id).exclude(
            status__in=(JobStatus.DONE, JobStatus.CANCELLED)):
        Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED, finished_at=timezone.now())
    DROPPING.add(space.model_id)
    try:
        with transaction.atomic():
            Image.objects.filter(model_id=space.model_id, source__isnull=False).delete()
    finally:
        DROPPING.discard(space.model_id)
    sink.store_call("drop_collection", space.model_id, space.collection, space.dim)
    space.refresh_from_db()
    return space


def migration_job_done(job: Job) -> None:
    """A migration job finished: start the quality gate on its space (``gate.gate_start``, which
    also calibrates the cutoff)."""
    space = EmbeddingSpace.objects.filter(job=job, state=SpaceState.CANDIDATE).first()
    if space is None:
        return
    gate.gate_start(space.id)

