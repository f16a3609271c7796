"""Booting a Celery worker: the signal handlers that prepare each worker process before and as it
starts taking tasks. Connected in every process that loads the app (``EmbeddingsConfig.ready``);
the web process never receives these signals, and nothing here imports torch at import time.

- ``celeryd_init`` (before the pool starts; children inherit it): :func:`refuse_a_second_store_owner`
  (a worker whose queues contradict ``STORE_OWNER``), :func:`lower_cpu_priority`, the
  niceness and ``SCHED_IDLE`` of a bulk-only worker (docs/lanes.md), and the malloc thresholds that
  keep a bulk chunk's memory for the next one (``workers.memory``).
- ``worker_ready``: :func:`warn_emulated_precision` (bulk worker), :func:`warm_model` and the
  space warmer thread (interactive worker), :func:`warn_configured_model_not_active` (every
  worker), :func:`start_reconciler` and :func:`freeze_start_up_heap` (the vectors worker),
  :func:`start_health` (every worker: its presence for ``/readyz``, and leaving the pool after
  failed passes).
- ``worker_process_init`` (each prefork child): :func:`child_health`.
- ``worker_shutting_down``: :func:`end_presence`.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time

from celery.signals import celeryd_init, worker_process_init, worker_ready, worker_shutting_down
from django.conf import settings

from embeddings import lane_control, runtime, worker_health
from embeddings.checks import EX_CONFIG
from embeddings.services import readiness, reconcile
from project import lanes
from workers.config import emulated_precision_warning
from workers.memory import keep_batch_memory

log = logging.getLogger(__name__)

#: Seconds between two looks for spaces an interactive worker should hold loaded.
WARM_SPACES_INTERVAL_S = 1.0
#: Niceness of the thread that loads those models (the worker's request threads stay at 0).
WARM_SPACES_NICE = 19


def _queue_names(queues) -> set[str]:
    """``-Q`` queues (a list or a comma-separated string) as a set of names."""
    return {q.strip() for q in (queues.split(",") if isinstance(queues, str) else queues or ()) if q.strip()}


def _consumed(sender) -> set[str]:
    """The queue names a started worker (``worker_ready``'s sender) consumes; empty without a consumer."""
    consumer = getattr(sender, "task_consumer", None)
    return {q.name for q in consumer.queues} if consumer else set()


# --- CPU priority (celeryd_init) -----------------------------------------------------------------

def worker_niceness(queues) -> int:
    """Niceness for a worker consuming ``queues`` (``-Q``: a list or a comma-separated string):
    ``WORKER_NICE`` when set, else ``BULK_WORKER_NICE`` for a worker of bulk work only (the bulk
    queue, the fetch queue, or both: nobody waits for either, so neither may take a core from the
    interactive lane), else 0."""
    if settings.WORKER_NICE:
        return settings.WORKER_NICE
    names = _queue_names(queues)
    return settings.BULK_WORKER_NICE if names and names <= {lanes.BULK, lanes.FETCH} else 0


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


def store_owner_refusal(queues) -> str | None:
    """Why a worker consuming ``queues`` must not start under this deployment's ``STORE_OWNER``,
    or None. With ``interactive`` and an embedded store the interactive worker owns the folder and
    consumes the vectors queue: a worker that takes one of the two queues without the other would
    meet the owner at the folder's lock (a vectors-only worker holding it, the owner refused every
    write), or leave the vectors queue to a process that cannot open the store."""
    names = _queue_names(queues)
    if not lane_control.owner_runs_threads():
        return None
    if lanes.VECTORS in names and lanes.INTERACTIVE not in names:
        return ("STORE_OWNER=interactive: the interactive worker owns the embedded store and consumes the vectors "
                "queue; a worker of the vectors queue alone must not run (project.processes has none)")
    if lanes.INTERACTIVE in names and lanes.VECTORS not in names:
        return ("STORE_OWNER=interactive: the interactive worker owns the embedded store and must consume the "
                f"vectors queue too (-Q {lanes.INTERACTIVE},{lanes.VECTORS}: project.processes)")
    return None


@celeryd_init.connect(dispatch_uid="embeddings.worker_boot.refuse_a_second_store_owner")
def refuse_a_second_store_owner(options=None, **kwargs) -> None:
    """Stop before the pool starts (``EX_CONFIG``) when this worker's queues contradict
    ``STORE_OWNER`` (:func:`store_owner_refusal`): two processes would contend for one embedded store."""
    reason = store_owner_refusal((options or {}).get("queues"))
    if reason:
        log.critical("refusing to start: %s", reason)
        raise SystemExit(EX_CONFIG)


@celeryd_init.connect(dispatch_uid="embeddings.worker_boot.lower_cpu_priority")
def lower_cpu_priority(options=None, **kwargs) -> None:
    """Lower this worker's CPU priority before it starts its pool (children inherit it):
    :func:`worker_niceness` of its ``-Q`` queues, and ``SCHED_IDLE`` for a bulk-only worker
    (:func:`worker_idle_policy`, docs/lanes.md). A worker that consumes the bulk queue also keeps
    its chunks' memory between chunks (``workers.memory.keep_batch_memory``, inherited by the
    children too: ``BULK_BATCH_MEMORY_MB``)."""
    queues = (options or {}).get("queues")
    nice = worker_niceness(queues)
    if nice:
        os.nice(nice)
    if worker_idle_policy(queues):
        set_idle_policy()
    if lanes.BULK in _queue_names(queues):
        keep_batch_memory(settings.BULK_BATCH_MEMORY_MB)


# --- the model (worker_ready) --------------------------------------------------------------------

@worker_ready.connect(dispatch_uid="embeddings.worker_boot.warn_emulated_precision")
def warn_emulated_precision(sender, **kwargs) -> None:
    """Warn loudly at the start of a bulk worker whose bf16 this hardware only emulates (up to 10x
    slower than fp32: ``workers.config.emulated_precision_warning``). Its prefork children load the
    model on their first chunk; an interactive worker gets the same warning from the model load in
    :func:`warm_model`. Reads ``/proc/cpuinfo`` (and NVML): no torch, no CUDA in the parent."""
    queues = _consumed(sender)
    if lanes.BULK in queues and lanes.INTERACTIVE not in queues:

        if (warning := emulated_precision_warning(settings.PIPELINE)) is not None:
            log.warning("%s", warning)


@worker_ready.connect(dispatch_uid="embeddings.worker_boot.warm_model")
def warm_model(sender, **kwargs) -> None:
    """Load the model as soon as an interactive worker is up, so no waiting person pays for it, then
    keep the models of upcoming spaces loaded (:func:`_start_space_warmer`).

    Only for the ``threads``/``solo`` pools, where this process is the one that runs tasks; a
    prefork child loads lazily on its first chunk (never the parent: celery/celery#3402).

    Raises:
        SystemExit: status ``EX_CONFIG`` (78) when the model cannot be loaded (weights missing or
            not downloadable, unknown tag): the worker stops instead of looking ready.
    """
    pool = type(sender.pool).__module__ if getattr(sender, "pool", None) else ""
    if lanes.INTERACTIVE in _consumed(sender) and ("thread" in pool or "solo" in pool):

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


def _start_space_warmer() -> None:
    """Start a daemon thread of an interactive worker that, every :data:`WARM_SPACES_INTERVAL_S`,
    loads the model of each candidate / standby / active space this worker is configured for
    (``runtime.warm_spaces``), so a promotion or a rollback never makes a waiting person pay for a
    model load. A failed round is logged and retried. The thread runs at nice
    :data:`WARM_SPACES_NICE` (Linux sets a thread's own niceness): loading a model when a migration
    starts must not slow the requests this worker is answering."""

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


@worker_ready.connect(dispatch_uid="embeddings.worker_boot.warn_configured_model_not_active")
def warn_configured_model_not_active(sender, **kwargs) -> None:
    """At a worker's start: say so loudly when CLIP_MODEL is not the active space's model (the
    active row decides; changing the variables is a migration: docs/operations.md)."""

    try:
        warning = runtime.configured_model_warning()
    except Exception:  # noqa: BLE001 - no database yet: the first read creates the space
        return
    if warning is not None:
        log.warning("%s", warning)


# --- the reconciler (worker_ready) ---------------------------------------------------------------

@worker_ready.connect(dispatch_uid="embeddings.worker_boot.start_reconciler")
def start_reconciler(sender, **kwargs) -> None:
    """Run the reconciler in the worker that owns the vector store (one per deployment), every
    ``RECONCILE_INTERVAL_S``; a Redis lock keeps rounds from overlapping wherever else it runs."""
    if lanes.VECTORS in _consumed(sender) and settings.RECONCILE_INTERVAL_S > 0:

        reconcile.reconciler_start(interval_s=settings.RECONCILE_INTERVAL_S)


# --- the vectors worker's heap (worker_ready) ------------------------------------------------------

@worker_ready.connect(dispatch_uid="embeddings.worker_boot.freeze_start_up_heap")
def freeze_start_up_heap(sender, **kwargs) -> None:
    """In the worker that owns the vector store (``-P solo``: its tasks run in this process):
    :func:`freeze_heap` once it consumes."""
    if lanes.VECTORS in _consumed(sender):
        freeze_heap()


def freeze_heap() -> None:
    """Collect the start-up garbage, then move every object still alive (Django, Celery, the
    store's modules: a few hundred thousand) to the permanent generation (``gc.freeze``).

    Why: a full collection walks every tracked object, and a bulk chunk's write allocates enough
    (its items, payloads and points) to set one off every few chunks; with the start-up heap in
    it, that pass took about 110 ms inside a 512-point chunk's write of about 170 ms
    (``benchmarks/writer.py``, docs/scaling.md). Frozen objects are never collected: they live as
    long as the process anyway."""
    gc.collect()
    gc.freeze()


# --- health (worker_ready, worker_process_init, worker_shutting_down) ---------------------------------

@worker_ready.connect(dispatch_uid="embeddings.worker_boot.start_health")
def start_health(sender, **kwargs) -> None:
    """In a worker's main process once it consumes: say which lanes it serves, every few seconds, for
    ``/readyz`` (``services.readiness.presence_start``), and let failed passes stop it
    (``worker_health.enable``: the threads and solo pools run tasks here)."""
    worker_health.enable()
    queues = _consumed(sender)
    if queues:
        readiness.presence_start(queues=queues, worker=sender.hostname)


@worker_process_init.connect(dispatch_uid="embeddings.worker_boot.child_health")
def child_health(**kwargs) -> None:
    """In each prefork child: failed passes there stop the whole worker (its parent)."""
    worker_health.enable()


@worker_shutting_down.connect(dispatch_uid="embeddings.worker_boot.end_presence")
def end_presence(sender=None, **kwargs) -> None:
    """A stopping worker leaves ``/readyz``'s count of its lanes' workers at once (``sender``: its
    hostname; the lanes: every queue, as the signal does not say which it consumed)."""
    if sender:
        readiness.presence_end(queues=set(lanes.ALL_QUEUES), worker=str(sender))
