"""Reports, the worker side of the interactive lane: what admission predicts from.

Each interactive worker keeps in Redis (:mod:`.keys`) the tasks it runs (``INFLIGHT_KEY``,
:func:`interactive_in_flight`), the forward pass each dynamic batcher runs now (``PASSES_KEY``,
:func:`interactive_pass`) and its own entry (``WORKERS_KEY``, :func:`interactive_report`): its
measured capacity and per-batch-size service times, refreshed every :data:`HEARTBEAT_S` s so that
an idle live worker keeps counting and a dead one stops. The batcher's batch records go to a capped
list (``BATCHES_KEY``) that ``benchmarks/lanes.py`` reads to show the batch sizes formed and the
queue delays. Nothing here raises: a report that fails is logged, the work goes on.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
from typing import Iterator, Sequence

from django.conf import settings

from embeddings.lane_control import background
from embeddings.lane_control.keys import (
    BATCHES_KEPT,
    BATCHES_KEY,
    INFLIGHT_KEY,
    PASSES_KEY,
    WORKERS_KEY,
    redis_client,
)
from queueing.wait_model import batch_ms, drain_rate, update_batch_curve

log = logging.getLogger(__name__)

#: Batches of the interactive worker's dynamic batcher that the service-time means cover.
WINDOW = 32
#: How often (s) a worker refreshes its ``WORKERS_KEY`` entry (:class:`_Tracker`'s heartbeat); the
#: web stops counting one whose entry is older than ``wait_model.WORKER_TTL_S`` (three beats).
HEARTBEAT_S = 5.0


class _Tracker:
    """Per worker process: finished interactive tasks (for :func:`drain_rate`), the last batch record
    sent, the last entry written to :data:`WORKERS_KEY`, and the heartbeat thread that keeps it live."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tasks: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=2_000)
        self.last_record = None
        self.curve: dict[int, float] = {}
        self.entry: dict | None = None
        self.worker: str | None = None
        self.heartbeat: threading.Thread | None = None
        self.heartbeat_stop = threading.Event()

    def finished(self, started: float, ended: float, images: int) -> None:
        with self.lock:
            self.tasks.append((started, ended, images))

    def beat(self, client) -> None:
        while not self.heartbeat_stop.wait(HEARTBEAT_S):
            with self.lock:
                entry, worker = self.entry, self.worker
            if entry is not None:
                with contextlib.suppress(Exception):
                    client.hset(WORKERS_KEY, worker, json.dumps({**entry, "updated": time.time()}))


@functools.cache
def _tracker() -> _Tracker:
    return _Tracker()


@contextlib.contextmanager
def interactive_in_flight(task_id: str, images: int) -> Iterator[None]:
    """Count ``images`` of task ``task_id`` as in flight while the block runs, and as drained by this
    process when it ends (:func:`drain_rate`); never raises. Both writes leave from the process's
    writer thread (``background``), in order: neither is a round trip on the task's own path."""
    started = time.time()
    background.write(lambda pipe: pipe.hset(INFLIGHT_KEY, task_id, f"{images} {started:.3f}"))
    try:
        yield
    finally:
        _tracker().finished(started, time.time(), images)
        background.write(lambda pipe: pipe.hdel(INFLIGHT_KEY, task_id))


def interactive_pass(batcher: str, images: int, at: float) -> None:
    """Record in :data:`PASSES_KEY` that dynamic batcher ``batcher`` (unique per process and
    space) started a forward pass of ``images`` at ``at`` (Unix s), with its expected time at this
    worker's per-batch-size service times (0: none measured yet); ``images`` 0: the pass ended,
    clear it. The batcher's ``on_pass`` hook, on its model thread; never raises. Written by the
    process's writer thread (``background``): the pass does not wait for Redis, and its start
    lands well within the pass, which is what a bulk worker looking for running passes needs."""
    if images:
        curve = _tracker().curve  # replaced whole by _report, never mutated: safe to read
        expected = batch_ms(curve, images) if curve else 0.0
        value = f"{images} {at:.3f} {expected:.1f}"
        background.write(lambda pipe: pipe.hset(PASSES_KEY, batcher, value))
    else:
        background.write(lambda pipe: pipe.hdel(PASSES_KEY, batcher))


def window_stats(records: Sequence) -> dict[str, float] | None:
    """Means over the last :data:`WINDOW` non-empty batches (``workers.batcher.BatchRecord``).

    Returns:
        ``{"ms_per_image", "images_per_request", "batch_ms", "batch_size", "queue_delay_ms",
        "batches"}``, or ``None`` when no batch ran a forward pass yet.
    """
    recent = []
    for r in reversed(records):  # newest first; stop once the window is full
        if r.size:
            recent.append(r)
            if len(recent) == WINDOW:
                break
    if not recent:
        return None
    images = sum(r.size for r in recent)
    return {
        "ms_per_image": sum(r.service_ms for r in recent) / images,
        "images_per_request": images / sum(r.requests for r in recent),
        "batch_ms": sum(r.service_ms for r in recent) / len(recent),
        "batch_size": images / len(recent),
        "queue_delay_ms": sum(r.queue_delay_ms for r in recent) / len(recent),
        "batches": len(recent),
    }


def worker_entry(stats: dict | None, tasks: Sequence[tuple[float, float, int]], *, now: float,
                 previous: dict | None = None, curve: dict[int, float] | None = None,
                 max_batch: int | None = None) -> dict | None:
    """A worker's :data:`WORKERS_KEY` entry. Pure.

    ``capacity_ips`` is :func:`drain_rate` over ``tasks``; with no task in the window, the previous
    entry's figure (an idle worker keeps its last measurement); with none, the forward pass alone
    (``1000 / ms_per_image``, an over-estimate the web's fitted scale then corrects). ``curve``
    (per-batch-size forward pass ms, :func:`update_batch_curve`) and ``max_batch`` (the batcher's
    largest batch) are passed on as ``batch_ms`` and ``max_batch``.

    Returns:
        ``{"capacity_ips", "ms_per_image", "images_per_request", "batch_size", "updated"}`` (and
        ``"batch_ms", "max_batch"`` when given), or ``None`` when nothing was measured yet.
    """
    rate = drain_rate(tasks, now=now)
    if rate is None and previous is not None:
        rate = previous["capacity_ips"]
    if rate is None and stats is not None:
        rate = 1000 / stats["ms_per_image"]
    if rate is None:
        return None
    stats = stats or previous or {}
    entry = {"capacity_ips": round(rate, 4), "ms_per_image": round(stats.get("ms_per_image", 0.0), 3),
             "images_per_request": round(stats.get("images_per_request", 1.0), 4),
             "batch_size": round(stats.get("batch_size", 0.0), 3), "updated": round(now, 3)}
    if curve and max_batch:
        entry["batch_ms"] = {str(k): round(v, 2) for k, v in sorted(curve.items())}
        entry["max_batch"] = int(max_batch)
    return entry


def _max_batch() -> int:
    """The dynamic batcher's largest batch: ``settings.PIPELINE.interactive_max_batch_size``, the one
    value ``runtime`` builds the batcher with (``INTERACTIVE_MAX_BATCH_SIZE``)."""
    return int(settings.PIPELINE.interactive_max_batch_size)


def interactive_report(records, *, worker: str = "", heartbeat: bool = False) -> int:
    """Publish the dynamic batcher's new ``records`` (:data:`BATCHES_KEY`) and this worker's entry
    (:data:`WORKERS_KEY`, field ``worker``: its Celery hostname); never raises.

    Args:
        records: the batcher's ``BatchRecord`` deque (copied here; the model thread may append).
        worker: this worker's name; every interactive worker has its own entry, summed by the web.
        heartbeat: start (once per process) a thread that refreshes the entry every
            :data:`HEARTBEAT_S` s, so an idle live worker keeps counting and a dead one stops.

    Returns:
        How many new batch records were sent.
    """
    try:
        return _report(records, worker=worker, heartbeat=heartbeat)
    except Exception as e:
        log.warning("could not report interactive batches: %s", e)
        return 0


def _report(records, *, worker: str, heartbeat: bool) -> int:
    tracker = _tracker()
    with tracker.lock:
        for _ in range(3):  # the model thread may append while we copy
            try:
                snapshot = list(records)
                break
            except RuntimeError:
                continue
        else:
            return 0
        new = []
        for rec in reversed(snapshot):
            if rec is tracker.last_record:
                break
            new.append(rec)
        new.reverse()
        now = time.time()
        tracker.curve = update_batch_curve(tracker.curve, new)
        entry = worker_entry(window_stats(snapshot), list(tracker.tasks), now=now,
                             previous=tracker.entry if tracker.worker == worker else None,
                             curve=tracker.curve, max_batch=_max_batch())
        if not new and entry is None:
            return 0
        client = redis_client()
        with client.pipeline(transaction=False) as pipe:
            if new:
                pipe.rpush(BATCHES_KEY, *(json.dumps({"t": round(now, 3), **dataclasses.asdict(r)}) for r in new))
                pipe.ltrim(BATCHES_KEY, -BATCHES_KEPT, -1)
            if entry is not None:
                pipe.hset(WORKERS_KEY, worker, json.dumps(entry))
            pipe.execute()
        if snapshot:
            tracker.last_record = snapshot[-1]
        tracker.entry, tracker.worker = entry, worker
        if heartbeat and tracker.heartbeat is None:
            tracker.heartbeat = threading.Thread(target=tracker.beat, args=(client,),
                                                 name="admission-heartbeat", daemon=True)
            tracker.heartbeat.start()
        return len(new)


def batch_records(client=None, *, since: float = 0.0) -> list[dict]:
    """Batch records reported at or after ``since`` (Unix s), oldest first: ``{"t", "size",
    "requests", "queue_delay_ms", "service_ms", "expired"}`` (``t``: when reported, ≥ batch end)."""
    client = client or redis_client()
    rows = [json.loads(x) for x in client.lrange(BATCHES_KEY, 0, -1)]
    return [r for r in rows if r["t"] >= since]

