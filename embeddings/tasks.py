"""Celery tasks: thin adapters. JSON primitives in (ids, storage keys, base64 vectors), one call to a
service, retry policy on the decorator. Which queue each runs on is decided by the ``*_options``
helpers of ``embeddings.dispatch`` (re-exported here), from ``project.lanes``; services send work
through that module and never import this one.

- ``interactive`` queue (interactive worker, threads pool + dynamic batcher): ``embed_interactive``,
  ``embed_query``, ``encode_text``; ``embed_index_interactive`` with a Qdrant server.
- ``bulk`` queue (bulk worker, one chunk at a time): ``embed_chunk``.
- ``vectors`` queue (the vector store's owner): ``index_*``, ``search_*``, ``forget_point``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

from celery import shared_task
from celery.signals import celeryd_init, task_revoked, worker_ready
from django.conf import settings

# the message options live with the sending (``embeddings.dispatch``); re-exported for callers here
from embeddings.dispatch import (  # noqa: F401
    bulk_options,
    expires_at,
    interactive_options,
    vectors_options,
)
from embeddings.services import pipeline
from embeddings.lane_control import admission
from embeddings.lane_control import bulk_yield
from project import lanes
from workers.errors import Reason

log = logging.getLogger(__name__)

#: Systemic failures talking to the vector store: retried with exponential backoff (never a bad
#: image, which is recorded, not retried): connection errors, timeouts, Qdrant 5xx.
_STORE_ERRORS = pipeline.STORE_ERRORS


@shared_task(acks_late=True, reject_on_worker_lost=True, time_limit=settings.CELERY_BULK_TIME_LIMIT_S)
def embed_chunk(job_id: str, image_ids: list[str]) -> dict:
    """Embed one bulk chunk (≤ ``BULK_BATCH_SIZE`` image ids), one chunk at a time per process (a
    worker serving both lanes holds a second one on deck: ``bulk_yield.bulk_turn``). The result adds
    ``started``/``ended`` (Unix s: its turn to compute) and ``waited_ms`` (on deck before it)."""
    with bulk_yield.bulk_turn() as turn:
        out = pipeline.chunk_embed(job_id=job_id, image_ids=image_ids)
    return {**out, "started": turn.started, "ended": turn.ended, "waited_ms": round(turn.waited_ms, 3)}


def _in_flight(task, images: int):
    """Count an interactive task's images as in flight for admission control (not when eager)."""
    if task.request.is_eager:
        return contextlib.nullcontext()
    return admission.interactive_in_flight(task.request.id, images)


@shared_task(bind=True)
def embed_interactive(self, image_ids: list[str], deadline_ts: float) -> dict:
    """Embed an interactive request's images (deadline as Unix time, s); then report the dynamic
    batcher's batches (service time for admission control, batch sizes and queue delays)."""
    return _embed_interactive(self, image_ids, deadline_ts)


@shared_task(bind=True)
def embed_index_interactive(self, image_ids: list[str], deadline_ts: float, owner_id: int | None, k: int,
                            skipped_ids: list[str]) -> dict:
    """With a Qdrant server (``services.sink``: direct): embed an interactive request's images, then
    write their points and find their neighbours here (:func:`index_interactive` in this process):
    no vector crosses Redis, no vectors worker on the path. Same result as that chain's."""
    return index_interactive(_embed_interactive(self, image_ids, deadline_ts), owner_id, k, skipped_ids)


def _embed_interactive(task, image_ids: list[str], deadline_ts: float) -> dict:
    with _in_flight(task, len(image_ids)):
        out = pipeline.interactive_embed(image_ids=image_ids, deadline_ts=deadline_ts)
    if not task.request.is_eager:
        from embeddings import runtime

        # heartbeat: this worker's capacity keeps counting while it idles, and stops when it dies
        admission.interactive_report(runtime.dynamic_batcher().records, worker=task.request.hostname or "",
                                     heartbeat=True)
    return out


def _end_if_expired(task, out: dict, deadline_ts: float | None) -> dict:
    """A query refused because its deadline passed, or finished after it, ends its chain here:
    the search that would follow is for nobody (its message would be sent already expired, which
    Celery also warns about at length)."""
    refused = out.get("reason") == Reason.EXPIRED.value
    if refused:
        log.info("%s[%s] not computed: %s", task.name, task.request.id, out.get("detail", "deadline passed"))
    elif deadline_ts is not None and time.time() > deadline_ts:
        log.info("%s[%s] finished %.3f s after its deadline: its search is not sent", task.name, task.request.id,
                 time.time() - deadline_ts)
    else:
        return out
    if not task.request.is_eager:  # eager chains run their links themselves
        task.request.chain = None
    return out


@shared_task(bind=True)
def embed_query(self, storage_key: str, sha256: str, deadline_ts: float | None = None,
                model_id: str | None = None) -> dict:
    """Embed a query image with space ``model_id``'s model (None: this worker's configured model) →
    ``{"vector": base64}`` or ``{"reason", "detail"}``; reason ``expired`` without running the
    model once ``deadline_ts`` (Unix s) has passed."""
    with _in_flight(self, 1):
        return _end_if_expired(self, pipeline.query_embed(storage_key=storage_key, sha256=sha256,
                                                          deadline_ts=deadline_ts, model_id=model_id), deadline_ts)


@shared_task(bind=True)
def encode_text(self, text: str, deadline_ts: float | None = None, model_id: str | None = None) -> dict:
    """Embed a text query with space ``model_id``'s model (None: this worker's configured model) →
    ``{"vector": base64}``; ``{"reason": "expired", "detail"}`` without running the model once
    ``deadline_ts`` (Unix s) has passed."""
    with _in_flight(self, 1):
        return _end_if_expired(self, pipeline.text_embed(text=text, deadline_ts=deadline_ts, model_id=model_id),
                               deadline_ts)


@task_revoked.connect
def expire_discarded_upload(sender=None, request=None, expired=False, **kwargs) -> None:
    """An ``embed_interactive`` message discarded unrun because it expired in the broker (the worker
    was down or busy past its deadline): its images are ``expired`` at once, as the task would
    have recorded them, instead of waiting for the reconciler to find them."""
    if not expired or getattr(sender, "name", None) not in (embed_interactive.name, embed_index_interactive.name) \
            or request is None:
        return
    args, kwargs = list(request.args or ()), dict(request.kwargs or {})
    image_ids = list(kwargs.get("image_ids", args[0] if args else ()))
    deadline_ts = kwargs.get("deadline_ts", args[1] if len(args) > 1 else None)
    if not image_ids:
        return
    from embeddings import metrics
    from embeddings.services.catalogue.images import images_mark_failed

    late = f"{time.time() - float(deadline_ts):.1f} s " if deadline_ts is not None else ""
    images_mark_failed([(i, Reason.EXPIRED.value, f"deadline passed {late}before a worker took it") for i in image_ids])
    metrics.count_images(lane=lanes.INTERACTIVE, status="expired", n=len(image_ids))


# ignore_result: nobody reads a chunk's result (its outcome is in the database), so neither the
# worker (GET, SETEX, PUBLISH per task) nor its sender (SUBSCRIBE) talks to the result backend.
@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=None, ignore_result=True)
def index_chunk(job_id: str, stat_id: int | None, items: list[dict], priority: str = "background",
                upsert_ms: float = 0.0) -> dict:
    """Write a bulk chunk's points and mark its images embedded, yielding to interactive work
    between slices (``pipeline.chunk_index``)."""
    return pipeline.chunk_index(job_id=job_id, stat_id=stat_id, items=items, priority=priority, upsert_ms=upsert_ms)


@shared_task
def index_interactive(embedded: dict, owner_id: int | None, k: int, skipped_ids: list[str]) -> dict:
    """Write an interactive request's points; return each image's neighbours."""
    out = pipeline.interactive_index(embedded=embedded, owner_id=owner_id, k=k, skipped_ids=skipped_ids)
    from embeddings import metrics

    metrics.count_images(lane=lanes.INTERACTIVE, status="embedded", n=len(embedded.get("items", [])))
    failed = embedded.get("failed", [])
    expired = sum(1 for f in failed if f[1] == "expired")
    metrics.count_images(lane=lanes.INTERACTIVE, status="expired", n=expired)
    metrics.count_images(lane=lanes.INTERACTIVE, status="failed", n=len(failed) - expired)
    return out


@shared_task
def search_vector(query: dict, owner_id: int | None, k: int, job_id: str | None, model_id: str | None = None) -> dict:
    """Top-k by a query ``{"vector": base64}`` in space ``model_id`` (None: this worker's configured model) →
    ``{"results": [...]}`` (refusals pass through)."""
    return pipeline.vector_search(query=query, owner_id=owner_id, k=k, job_id=job_id, model_id=model_id)


@shared_task
def search_point(point_id: str, owner_id: int | None, k: int, job_id: str | None,
                 model_id: str | None = None) -> list[dict] | None:
    """Top-k by a stored point's vector in space ``model_id`` (None when the point does not exist)."""
    return pipeline.point_search(point_id=point_id, owner_id=owner_id, k=k, job_id=job_id, model_id=model_id)


@shared_task
def forget_point(point_id: str, sha256: str, model_id: str | None = None) -> str:
    """Delete a point of space ``model_id`` (or its deleted row's share of it)."""
    return pipeline.point_forget(point_id=point_id, sha256=sha256, model_id=model_id)


@shared_task
def drop_collection(model_id: str, collection: str, dim: int) -> bool:
    """Delete a dropped space's collection with its points (``services.migrations.space_drop``)."""
    from embeddings import runtime

    return runtime.drop_collection(model_id, collection, dim)


def _queue_names(queues) -> set[str]:
    """``-Q`` queues (a list or a comma-separated string) as a set of names."""
    return {q.strip() for q in (queues.split(",") if isinstance(queues, str) else queues or ()) if q.strip()}


def worker_niceness(queues) -> int:
    """Niceness for a worker consuming ``queues`` (``-Q``: a list or a comma-separated string):
    ``WORKER_NICE`` when set, else ``BULK_WORKER_NICE`` for a bulk-only worker, else 0."""
    if settings.WORKER_NICE:
        return settings.WORKER_NICE
    return settings.BULK_WORKER_NICE if _queue_names(queues) == {lanes.BULK} else 0


def worker_idle_policy(queues) -> bool:
    """Whether a worker consuming ``queues`` runs under ``SCHED_IDLE``: a bulk-only worker when
    ``BULK_WORKER_SCHED_IDLE`` is on (off by default)."""
    return settings.BULK_WORKER_SCHED_IDLE and _queue_names(queues) == {lanes.BULK}


def set_idle_policy() -> bool:
    """Put every thread of this process under Linux's ``SCHED_IDLE`` scheduling policy (threads and
    processes started later inherit it); returns whether it was set.

    ``SCHED_IDLE`` (sched(7)): a thread runs only when no normal thread wants its core, and a normal
    thread waking on that core preempts it at once; lowering a policy needs no privilege. Applied
    to each thread of ``/proc/self/task`` because Linux sets the policy per thread. Where the OS has
    no ``SCHED_IDLE`` (macOS) or refuses it, logs a warning and returns False: niceness still holds.
    """
    import os

    if not hasattr(os, "SCHED_IDLE"):
        log.warning("SCHED_IDLE is not available here: the bulk worker keeps niceness only")
        return False
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # that thread ended meanwhile
                pass
    except OSError as e:
        log.warning("SCHED_IDLE not set (%s): the bulk worker keeps niceness only", e)
        return False
    return True


@celeryd_init.connect
def lower_cpu_priority(options=None, **kwargs) -> None:
    """Lower this worker's CPU priority before it starts its pool (children inherit it):
    :func:`worker_niceness` of its ``-Q`` queues, and ``SCHED_IDLE`` for a bulk-only worker
    (:func:`worker_idle_policy`, docs/lanes.md)."""
    import os

    queues = (options or {}).get("queues")
    nice = worker_niceness(queues)
    if nice:
        os.nice(nice)
    if worker_idle_policy(queues):
        set_idle_policy()


@worker_ready.connect
def warn_emulated_precision(sender, **kwargs) -> None:
    """Warn loudly at the start of a bulk worker whose bf16 this hardware only emulates (up to 10x
    slower than fp32: ``workers.config.emulated_precision_warning``). Its prefork children load the
    model on their first chunk; an interactive worker gets the same warning from the model load in
    :func:`warm_model`. Reads ``/proc/cpuinfo`` (and NVML): no torch, no CUDA in the parent."""
    queues = {q.name for q in sender.task_consumer.queues} if getattr(sender, "task_consumer", None) else set()
    if lanes.BULK in queues and lanes.INTERACTIVE not in queues:
        from workers.config import emulated_precision_warning

        if (warning := emulated_precision_warning(settings.PIPELINE)) is not None:
            log.warning("%s", warning)


@worker_ready.connect
def warm_model(sender, **kwargs) -> None:
    """Load the model as soon as an interactive worker is up, so no waiting person pays for it.

    Only for the ``threads``/``solo`` pools, where this process is the one that runs tasks; a
    prefork child loads lazily on its first chunk (never the parent: celery/celery#3402).

    Raises:
        SystemExit: status ``EX_CONFIG`` (78) when the model cannot be loaded (weights missing or
            not downloadable, unknown tag): the worker stops instead of looking ready.
    """
    queues = {q.name for q in sender.task_consumer.queues} if getattr(sender, "task_consumer", None) else set()
    pool = type(sender.pool).__module__ if getattr(sender, "pool", None) else ""
    if lanes.INTERACTIVE in queues and ("thread" in pool or "solo" in pool):
        from embeddings import runtime
        from embeddings.checks import EX_CONFIG

        try:
            runtime.dynamic_batcher()
            runtime.batch_runner().preprocess_config  # noqa: B018 - loads the model
        except Exception as e:  # noqa: BLE001 - weights unavailable, missing checkpoint, unknown tag
            # A worker that cannot embed must not look ready: every request would wait for its
            # deadline and expire. Stop (Celery's warm shutdown hands back what it fetched) with
            # EX_CONFIG, so the process manager shows a configuration error.
            log.critical("refusing to serve the interactive lane: %s", e)
            raise SystemExit(EX_CONFIG) from e
        _start_space_warmer()


#: Seconds between two looks for spaces an interactive worker should hold loaded (issue 13).
WARM_SPACES_INTERVAL_S = 1.0
#: Niceness of the thread that loads those models (the worker's request threads stay at 0).
WARM_SPACES_NICE = 19


def _start_space_warmer() -> None:
    """A daemon thread of an interactive worker: every :data:`WARM_SPACES_INTERVAL_S` it loads the
    model of each candidate / standby / active space this worker is configured for
    (``runtime.warm_spaces``), so a promotion or a rollback never makes a waiting person pay for a
    model load. A failed round is logged and retried. The thread runs at nice
    :data:`WARM_SPACES_NICE` (Linux sets a thread's own niceness): loading a model (~0.5 s of CPU
    for ViT-S-32) when a migration starts must not slow the requests this worker is answering."""
    import threading

    from embeddings import runtime

    def loop() -> None:
        with contextlib.suppress(AttributeError, OSError):  # os.setpriority: POSIX; per thread on Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_SPACES_NICE)
        failures = 0
        while True:
            try:
                for model_id in runtime.warm_spaces():
                    log.info("loaded the model of space %s ahead of a promotion", model_id)
                failures = 0
            except Exception:  # noqa: BLE001 - database down, weights missing: keep the worker serving
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.exception("warming the embedding spaces' models failed (%d in a row)", failures)
            time.sleep(WARM_SPACES_INTERVAL_S)

    threading.Thread(target=loop, name="space-warmer", daemon=True).start()


@worker_ready.connect
def warn_configured_model_not_active(sender, **kwargs) -> None:
    """At a worker's start: say so loudly when CLIP_MODEL is not the active space's model (the
    active row decides; changing the variables is a migration: docs/operations.md)."""
    from embeddings import runtime

    try:
        warning = runtime.configured_model_warning()
    except Exception:  # noqa: BLE001 - no database yet: the first read creates the space
        return
    if warning is not None:
        log.warning("%s", warning)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def migration_fill(space_id: int) -> int:
    """Create and queue a migration's copy rows, a batch at a time (``services.migrations``)."""
    from embeddings.services.lifecycle.model_migrations import migration_fill as fill

    return fill(space_id=space_id)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def job_done(job_id: str) -> None:
    """A job has just finished: a finished migration job's space gets its quality gate
    (``services.lifecycle.model_migrations.migration_job_done``)."""
    from embeddings.models import Job
    from embeddings.services.lifecycle import model_migrations

    job = Job.objects.filter(id=job_id).first()
    if job is not None:
        model_migrations.migration_job_done(job)


@shared_task
def collection_stats(model_id: str | None = None) -> dict:
    """Space ``model_id``'s collection name and exact point count (None: this worker's configured model)."""
    return pipeline.point_count(model_id)


@shared_task
def reconcile() -> dict | None:
    """One reconciler round (``embeddings/services/reconcile.py``); ``None`` if a round is running."""
    from embeddings.services import reconcile as reconcile_services

    report = reconcile_services.reconcile_once()
    return None if report is None else dataclasses.asdict(report)


@worker_ready.connect
def start_reconciler(sender, **kwargs) -> None:
    """Run the reconciler in the worker that owns the vector store (one per deployment), every
    ``RECONCILE_INTERVAL_S``; a Redis lock keeps rounds from overlapping wherever else it runs."""
    queues = {q.name for q in sender.task_consumer.queues} if getattr(sender, "task_consumer", None) else set()
    if lanes.VECTORS in queues and settings.RECONCILE_INTERVAL_S > 0:
        from embeddings.services.reconcile import reconciler_start

        reconciler_start(interval_s=settings.RECONCILE_INTERVAL_S)


# --- quality gate and cutoff (issue 13B: embeddings/services/lifecycle/gate.py, cutoff.py) -----------------

@shared_task(acks_late=True, reject_on_worker_lost=True, time_limit=settings.CELERY_BULK_TIME_LIMIT_S)
def gate_embed(model_id: str, picks: list[dict], reference: str | None = None) -> dict:
    """Embed the quality gate's re-encoded copies with space ``model_id``'s model and the
    ``reference`` space's (bulk queue, one bulk turn: it computes like a chunk)."""
    from embeddings.services.lifecycle import gate

    with bulk_yield.bulk_turn():
        return gate.gate_embed(model_id=model_id, picks=picks, reference=reference)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=5)
def gate_check(embedded: dict, model_id: str, run: str) -> dict:
    """Search each copy's top-1 in space ``model_id``'s collection and record the gate report."""
    from embeddings.services.lifecycle import gate

    return gate.gate_check(embedded=embedded, model_id=model_id, run=run)


@shared_task(acks_late=True, reject_on_worker_lost=True)
def cutoff_encode_texts(model_id: str) -> dict:
    """The calibration prompts through space ``model_id``'s text tower (bulk queue)."""
    from embeddings.services.lifecycle import cutoff

    return cutoff.encode_prompts(model_id=model_id)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=5)
def cutoff_compute(texts: dict, model_id: str) -> dict:
    """Compute and store space ``model_id``'s cutoffs from its stored vectors (vectors queue)."""
    from embeddings.services.lifecycle import cutoff

    return cutoff.calibrate(model_id=model_id, texts=texts)
