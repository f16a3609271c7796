"""Admission: what may enter a lane, and when: the Redis side.

Two parts, both reading or writing the broker's Redis (kombu's Redis transport, ``REDIS_URL``).
The wait model they feed (``wait_s = overhead_s + scale × work_s`` and what each of its terms
measures) is pure and lives in :mod:`queueing.wait_model`; bulk work, which is never
refused but yields (bulk turns, migration slots, the lane gate), in
:mod:`embeddings.lane_control.bulk_yield`.

1. **Web side, interactive lane** (:func:`interactive_admit`). A request is refused at once with
   429 and ``Retry-After`` when the predicted wait for its answer (plus a margin) is longer than
   its deadline: such work would only expire in the queue (the batcher drops it unseen), after
   having cost a database row, a blob and a queue slot, and after having pushed every later
   request further back. The prediction (:func:`wait_model.decide`) is made from what Redis holds
   (:func:`interactive_load`): the interactive queue's lists (:func:`queue_keys`), the images in
   flight (:data:`INFLIGHT_KEY`), the forward passes running now (:data:`PASSES_KEY`), the live
   workers' entries (:data:`WORKERS_KEY`), the recent answers (:data:`ANSWERS_KEY`), the admitted
   requests not answered yet (:data:`PENDING_KEY`) and lone requests' overheads (:data:`LONE_KEY`).

   All of it is read in one Redis round trip (a pipeline) per request. With no worker
   measurement yet every request is admitted: there is nothing to predict with. A Redis error
   admits too (the enqueue that follows reports the outage). Eager Celery (tests) queues nothing,
   so admission is skipped there. A refused request's ``extra.wait_ahead_s`` (s, 3 decimals) is
   about the wait of a request admitted at that moment. First estimate
   (``extra.first_wait_ahead_s``): the admission edge, the longest predicted wait admitted now
   (``wait_model.admission_edge_s``: under overload the next request admitted is admitted there),
   or the time the backlog needs to drain to it where that is longer, and at least the wait of a
   request of its size in an empty lane (``extra.wait_ahead_from``: ``edge``, ``drain`` or
   ``alone``); beside bulk chunks that yield to this lane, what the quiet lane they park for
   predicts (``parks``: the backlog of the moment, ``wait_model.parked_wait_ahead``). Then learnt
   (:mod:`queueing.wait_ahead`, ``extra.wait_ahead_samples`` refusals; 0: the first
   estimate as is; within ×1.3 of it, ``wait_ahead.CLAMP``): every refusal's features go to
   :data:`REFUSALS_KEY`, and once the requests admitted around it are answered, their waits label
   it; a refusal learns only from those of its own deadline band. ``Retry-After`` is that
   plus its margin (its upper bound, as admission bounds a wait) rounded **up** to whole seconds
   (RFC 9110 delay-seconds, ≥ 1), so a client never retries too early.

2. **Worker side, interactive lane**: the in-flight hash, the per-worker entries
   (:data:`WORKERS_KEY`: capacity, per-batch-size service times, refreshed every
   :data:`HEARTBEAT_S` s), the running passes, and the dynamic batcher's batch records, appended to
   a capped list (:data:`BATCHES_KEY`) that ``benchmarks/lanes.py`` reads to show the batch sizes
   formed and the queue delays.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import threading
import time
import uuid
from typing import Iterator, Sequence

from django.conf import settings

from queueing import wait_ahead
from embeddings.errors import ApplicationError
from queueing.wait_model import (
    Decision,
    LaneLoad,
    batch_ms,
    bulk_overlap_s,
    decide,
    drain_rate,
    fit_regime,
    lane_load,
    parse_bulk_activity,
    running_passes,
    update_batch_curve,
)
from project import lanes

log = logging.getLogger(__name__)

#: Batches of the interactive worker's dynamic batcher that the service-time means cover.
WINDOW = 32
#: Hash ``{task id: "images started_unix_s"}`` of interactive tasks running now.
INFLIGHT_KEY = f"lanes:{lanes.INTERACTIVE}:inflight"
#: Capped list of JSON batch records (newest last), for benchmarks and diagnosis.
BATCHES_KEY = f"lanes:{lanes.INTERACTIVE}:batches"
BATCHES_KEPT = 20_000
#: Hash ``{worker hostname: JSON}`` written by every interactive worker: its measured capacity
#: (images/s), service figures and when it last reported (:func:`interactive_report`, heartbeat).
WORKERS_KEY = f"lanes:{lanes.INTERACTIVE}:workers"
#: How often (s) a worker refreshes its :data:`WORKERS_KEY` entry (:class:`_Tracker`'s heartbeat);
#: the web stops counting one whose entry is older than ``wait_model.WORKER_TTL_S``.
HEARTBEAT_S = 5.0
#: Capped list of JSON records of answered interactive requests, newest last (:func:`interactive_answered`).
ANSWERS_KEY = f"lanes:{lanes.INTERACTIVE}:answers"
ANSWERS_KEPT = 5_000
#: Newest answers the web reads on each admission (the fit only uses those of
#: :data:`wait_model.FIT_WINDOW_S`).
ANSWERS_READ = 128
#: Hash ``{token: JSON}`` of admitted requests not answered yet (``admitted``, ``work_s``,
#: ``predicted_s``, ``deadline_s``): one that has waited longer than predicted is a lower bound of
#: its wait, known before its answer (:func:`wait_model.fit_wait`'s ``pending``), so a machine that
#: slows is seen after the predicted wait instead of after the whole, longer one.
PENDING_KEY = f"lanes:{lanes.INTERACTIVE}:pending"
#: Hash ``{batcher: "images started_unix_s expected_ms"}`` of the forward passes the interactive
#: workers' dynamic batchers run now (:func:`interactive_pass`); ``expected_ms`` 0: not known yet.
PASSES_KEY = f"lanes:{lanes.INTERACTIVE}:passes"
#: Capped list of ``wait − work_s`` (s) of the last :data:`LONE_KEPT` requests answered 200 that had
#: nothing ahead of them (``ahead`` 0): the overhead every request pays, measured where nothing else
#: explains the wait; the fit's intercept is pulled to their mean (:func:`wait_model._solve`).
LONE_KEY = f"lanes:{lanes.INTERACTIVE}:lone"
LONE_KEPT = 16
#: Same as :data:`LONE_KEY` for lone requests that computed beside bulk passes
#: (:func:`wait_model.beside_bulk`): the overhead of a lone request while the cores are shared.
LONE_BULK_KEY = f"lanes:{lanes.INTERACTIVE}:lone-bulk"
#: Hash ``{bulk process: "since_unix_s"}`` of the bulk chunks computing now (decoding or in a forward
#: pass), written by :class:`bulk_yield.BulkActivity`: cleared while a chunk waits for the
#: interactive lane (parked) and when it ends. The web reads it on each admission
#: (``LaneLoad.beside_bulk``) to pick the wait fit learnt in the same regime.
BULK_ACTIVITY_KEY = f"lanes:{lanes.BULK}:activity"
#: Capped list of ``"start end"`` (Unix s) of the bulk chunks' finished computing intervals, newest
#: last: an answer's wait is labelled with its overlap with them (``bulk_s``,
#: :func:`interactive_answered`).
BULK_RUNS_KEY = f"lanes:{lanes.BULK}:runs"
BULK_RUNS_KEPT = 256
#: Newest computing intervals read to label an answer (a minute of micro-batches and more).
BULK_RUNS_READ = 64
#: Capped list of JSON records of the interactive lane's refusals, newest last: when (``t``, Unix
#: s) and their :data:`wait_ahead.FEATURES`, which :func:`wait_ahead.fit_wait_ahead` labels with
#: the waits of the requests admitted around them to learn what a 429 says (a minute at the ~8
#: refusals/s of a 2× overload on the 2-core machine is ~500).
REFUSALS_KEY = f"lanes:{lanes.INTERACTIVE}:refusals"
REFUSALS_KEPT = 1_024
#: Newest answers read to label refusals (:data:`wait_ahead.FIT_WINDOW_S` of them at up to ~17
#: answers/s).
LABEL_ANSWERS_READ = 1_024
#: A web process refits what a 429 says at most this often (s): the fit parses up to
#: :data:`REFUSALS_KEPT` + :data:`LABEL_ANSWERS_READ` records, and refusals come several a second.
WAIT_AHEAD_REFIT_S = 1.0


@functools.cache
def _client(url: str):
    import redis

    # Short timeouts: admission must never be what makes a request slow.
    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, decode_responses=True)


def redis_client():
    """The process's Redis client for ``settings.REDIS_URL`` (the broker's server)."""
    return _client(settings.REDIS_URL)


def queue_keys(queue: str) -> list[str]:
    """Redis list names kombu uses for ``queue``, one per priority step, highest priority first.

    Mirrors ``kombu.transport.redis.Channel._q_for_pri``: step 0 is the bare queue name, the others
    are ``f"{queue}{Channel.sep}{step}"``.
    """
    from kombu.transport.redis import Channel

    steps = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("priority_steps", [0, 3, 6, 9])
    return [queue if step == 0 else f"{queue}{Channel.sep}{step}" for step in steps]


def vectors_interactive_waiting(client=None) -> int:
    """Interactive messages (priority step 0: searches, interactive index writes) waiting in the
    ``vectors`` queue now; bulk index writes travel at steps 6/9, so they are never counted.

    Read by the vectors worker between slices of a bulk chunk's write (``pipeline.chunk_index``).
    Returns 0 when Redis cannot be read (the chunk then simply carries on) or under eager Celery.
    """
    from project.celery import app

    if app.conf.task_always_eager:
        return 0
    try:
        return int((client or redis_client()).llen(queue_keys(lanes.VECTORS)[0]))
    except Exception as e:  # noqa: BLE001 - a probe: never what fails a write
        log.warning("cannot read the vectors queue's length: %s", e)
        return 0


def _stale_after_s() -> float:
    # An interactive task ends within its deadline (the batcher drops it after) plus decode time;
    # anything much older belongs to a worker that died.
    return 2 * settings.INTERACTIVE_DEADLINE_S + 30



def _bulk_stale_after_s() -> float:
    # A chunk refreshes its mark before each micro-batch (BULK_YIELD_MICRO_BATCH images, seconds);
    # a chunk that computes in one pass (an urgent job's 64 images on 2 cores: ~10-20 s) must not
    # be taken for dead either. A mark older than this belongs to a killed process.
    return max(_stale_after_s(), 120.0)


def interactive_load(client=None) -> LaneLoad:
    """Read the interactive lane's :class:`LaneLoad` from Redis (one round trip).

    Raises:
        redis.RedisError: Redis cannot be reached.
    """
    client = client or redis_client()
    keys = queue_keys(lanes.INTERACTIVE)
    with client.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.llen(k)
        pipe.hgetall(INFLIGHT_KEY)
        pipe.hgetall(WORKERS_KEY)
        pipe.lrange(ANSWERS_KEY, -ANSWERS_READ, -1)
        pipe.hgetall(PENDING_KEY)
        pipe.hgetall(PASSES_KEY)
        pipe.lrange(LONE_KEY, 0, -1)
        pipe.lrange(LONE_BULK_KEY, 0, -1)
        pipe.hgetall(BULK_ACTIVITY_KEY)
        *lengths, inflight, workers, answers, pending, passes, lone, lone_bulk, bulk = pipe.execute()
    now, stale = time.time(), _stale_after_s()
    inflight_images, dead = 0, []
    for task_id, value in inflight.items():
        images, started = value.split()
        if now - float(started) > stale:
            dead.append(task_id)
        else:
            inflight_images += int(images)
    if dead:
        client.hdel(INFLIGHT_KEY, *dead)
    gone = [token for token, raw in pending.items() if now - json.loads(raw)["admitted"] > stale]
    if gone:  # admitted by a web process that died before answering
        client.hdel(PENDING_KEY, *gone)
    running, dead_passes = running_passes(passes, now=now, stale_s=stale)
    if dead_passes:  # a worker that died mid-pass
        client.hdel(PASSES_KEY, *dead_passes)
    computing, dead_chunks, yielding = parse_bulk_activity(bulk, now=now, stale_s=_bulk_stale_after_s())
    if dead_chunks:  # a bulk process killed while computing
        client.hdel(BULK_ACTIVITY_KEY, *dead_chunks)
    return lane_load(queued_messages=sum(lengths), inflight_images=inflight_images, workers=workers,
                     answers=answers, now=now, pending=[v for k, v in pending.items() if k not in gone],
                     passes=running, lone=lone_bulk if computing else lone, beside_bulk_now=bool(computing),
                     bulk_yields=yielding, lone_quiet=lone, margin_quantile=settings.ADMISSION_MARGIN_QUANTILE)


def interactive_admit(*, deadline_s: float, images: int = 1) -> Decision:
    """Admit a request of ``images`` with ``deadline_s`` to the interactive lane, or refuse it.

    Returns:
        The :class:`Decision` (admitted; ``admitted_at`` set unless admission is off or eager, and
        then also recorded as pending in :data:`PENDING_KEY` until :func:`interactive_answered`).

    Raises:
        ApplicationError: ``overloaded`` (429) with a ``Retry-After`` header (s) when the predicted
            wait plus margin exceeds the deadline; ``extra`` carries the numbers the decision used.
    """
    from project.celery import app

    if app.conf.task_always_eager or not settings.ADMISSION_CONTROL:
        return Decision(True, None)
    try:
        load = interactive_load()
    except Exception as e:  # Redis down: admit; the enqueue that follows reports the outage
        log.warning("admission skipped, Redis unreadable: %s", e)
        return Decision(True, None)
    decision = decide(load, deadline_s=deadline_s, images=images, min_margin_share=settings.ADMISSION_MIN_MARGIN_SHARE,
                      max_margin_share=settings.ADMISSION_MAX_MARGIN_SHARE)
    if not decision.admitted:
        decision = _refused(decision, load, deadline_s=deadline_s)
        about = {"edge": "a request admitted next waits about",
                 "drain": "the work ahead drains to what this deadline admits in about",
                 "alone": "a request of its size waits about, even in an empty lane,",
                 "parks": "bulk work yields to this lane within a pass; a request admitted then waits about",
                 }[decision.wait_ahead_from]
        if decision.wait_ahead_samples:
            about = f"learnt from {decision.wait_ahead_samples} earlier refusals, a request admitted now waits about"
        first = decision.wait_ahead_s if decision.first_wait_ahead_s is None else decision.first_wait_ahead_s
        raise ApplicationError(
            f"the interactive lane is overloaded: predicted wait {decision.predicted_wait_s:.2f} s plus a margin of "
            f"{decision.margin_s:.2f} s is longer than the deadline {deadline_s:.2f} s; {about} "
            f"{decision.wait_ahead_s:.2f} s: retry after {decision.retry_after_s} s or use POST /api/jobs/",
            code="overloaded", status=429, headers={"Retry-After": str(decision.retry_after_s)},
            extra={"predicted_wait_s": round(decision.predicted_wait_s, 3), "deadline_s": round(deadline_s, 3),
                   # Retry-After (whole seconds: wait_ahead_s + retry_margin_s, rounded up) and about
                   # what a request admitted now waits: learnt from earlier refusals' outcomes
                   # (wait_ahead_samples of them; 0: not yet) from decide's first estimate
                   # (first_wait_ahead_s: which one, wait_ahead_from; what the work queued now
                   # needs, work_ahead_wait_s)
                   "retry_after_s": decision.retry_after_s, "wait_ahead_s": round(decision.wait_ahead_s, 3),
                   "first_wait_ahead_s": round(first, 3), "wait_ahead_samples": decision.wait_ahead_samples,
                   "wait_ahead_from": decision.wait_ahead_from,
                   "work_ahead_wait_s": round(decision.work_ahead_wait_s, 3),
                   "queued_messages": load.queued_messages, "inflight_images": load.inflight_images,
                   "running_pass_images": sum(n for n, _ in load.passes),
                   "running_pass_left_s": round(max((x for _, x in load.passes), default=0.0), 3),
                   "capacity_ips": round(load.capacity_ips, 2), "workers": load.workers,
                   "overhead_s": round(load.fit.overhead_s, 3), "scale": round(load.fit.scale, 3),
                   "margin_s": round(decision.margin_s, 3), "retry_margin_s": round(decision.retry_margin_s, 3),
                   "learnt_margin_s": round(load.fit.margin_s, 3), "beside_bulk": load.beside_bulk},
        )
    decision = dataclasses.replace(decision, admitted_at=time.time(), token=uuid.uuid4().hex,
                                   admitted_beside_bulk=load.beside_bulk)
    if decision.work_s is not None:
        try:  # a lower bound of its wait for its regime's fit until it is answered (fit_wait's pending)
            redis_client().hset(PENDING_KEY, decision.token, json.dumps(
                {"admitted": round(decision.admitted_at, 4), "work_s": round(decision.work_s, 4),
                 "predicted_s": round(decision.predicted_wait_s, 4), "deadline_s": round(deadline_s, 3),
                 "bulk_at_admission": load.beside_bulk}))
        except Exception as e:
            log.warning("could not record a pending interactive request: %s", e)
    return decision


#: This process's learnt :class:`wait_ahead.WaitAheadFit` per deadline band
#: (:func:`wait_ahead.deadline_band`) and when it was fitted (Unix s); each refit every
#: :data:`WAIT_AHEAD_REFIT_S` s at most. Replaced whole, never mutated (web threads share it); at
#: most one entry per band, and deadlines are bounded (0.001 s to the default), so it stays small.
_wait_ahead_cache: dict[int, tuple[float, wait_ahead.WaitAheadFit | None]] = {}
#: The records the fits are made from, parsed (refusals, answers, pending requests' admission
#: times), and when they were read (Unix s): read at most every :data:`WAIT_AHEAD_REFIT_S` s per
#: process, whatever the number of bands refitted from them. Replaced whole, never mutated.
_wait_ahead_records: tuple[float, tuple[list, list, list]] = (-math.inf, ([], [], []))


def _refused(decision: Decision, load: LaneLoad, *, deadline_s: float) -> Decision:
    """A refusal with what its 429 says learnt (:func:`wait_ahead.learnt`) from the refusals of the
    last minute at deadlines of its band (:func:`wait_ahead.deadline_band`) and the answers around
    them, recorded in :data:`REFUSALS_KEY` (with ``deadline_s``) to label later; the refusal as
    :func:`wait_model.decide` made it when Redis fails (never raises)."""
    global _wait_ahead_cache, _wait_ahead_records
    now = time.time()
    state = wait_ahead.features(decision, load)
    band = wait_ahead.deadline_band(deadline_s)
    try:
        client = redis_client()
        fitted_at, fit = _wait_ahead_cache.get(band, (-math.inf, None))
        read_at, records = _wait_ahead_records
        refit = now - fitted_at >= WAIT_AHEAD_REFIT_S
        read = refit and now - read_at >= WAIT_AHEAD_REFIT_S  # another band's refit may have read them
        with client.pipeline(transaction=False) as pipe:
            pipe.rpush(REFUSALS_KEY, json.dumps({"t": round(now, 4), "deadline_s": round(deadline_s, 3),
                                                 **{k: round(v, 4) for k, v in state.items()}}))
            pipe.ltrim(REFUSALS_KEY, -REFUSALS_KEPT, -1)
            if read:
                pipe.lrange(REFUSALS_KEY, 0, -1)
                pipe.lrange(ANSWERS_KEY, -LABEL_ANSWERS_READ, -1)
                pipe.hvals(PENDING_KEY)
            replies = pipe.execute()
        if read:
            refusals, answers, pending = replies[2:]
            records = ([json.loads(r) for r in refusals], [json.loads(a) for a in answers],
                       [json.loads(p)["admitted"] for p in pending])
            _wait_ahead_records = (now, records)
        if refit:
            refusals, answers, pending = records
            fit = wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=pending, now=now, deadline_s=deadline_s)
            _wait_ahead_cache = {**_wait_ahead_cache, band: (now, fit)}
    except Exception as e:  # noqa: BLE001 - what a 429 says is never what fails it
        log.warning("what the 429 says is not learnt, Redis failed: %s", e)
        return decision
    return wait_ahead.learnt(decision, load, fit, min_share=settings.ADMISSION_MIN_MARGIN_SHARE,
                             max_margin_s=settings.ADMISSION_MAX_MARGIN_SHARE * deadline_s)


def _bulk_overlap(client, *, start: float, end: float) -> float:
    """Seconds of ``[start, end]`` (Unix s) during which a bulk chunk computed
    (:func:`wait_model.bulk_overlap_s` of :data:`BULK_RUNS_KEY`'s newest :data:`BULK_RUNS_READ`
    intervals and the live marks of :data:`BULK_ACTIVITY_KEY`, parsed by
    :func:`wait_model.parse_bulk_activity`); an unreadable interval is skipped. One round trip; a Redis
    error propagates (the caller logs it)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.lrange(BULK_RUNS_KEY, -BULK_RUNS_READ, -1)
        pipe.hgetall(BULK_ACTIVITY_KEY)
        raw_runs, marks = pipe.execute()
    runs = []
    for raw in raw_runs:
        with contextlib.suppress(ValueError):
            lo, hi = map(float, raw.split())
            runs.append((lo, hi))
    computing, _, _ = parse_bulk_activity(marks, now=time.time(), stale_s=_bulk_stale_after_s())
    return bulk_overlap_s(runs, computing, start=start, end=end)


def interactive_answered(decision: Decision, *, images: int, status: int, answered_at: float | None = None) -> None:
    """Record an admitted request's answer for the wait model (web side; never raises).

    Appends ``{"admitted", "answered", "images", "work_s", "predicted_s", "status", "ahead",
    "bulk_s", "bulk_at_admission"}`` to :data:`ANSWERS_KEY` (capped at :data:`ANSWERS_KEPT`) and
    removes it from :data:`PENDING_KEY`; ``bulk_s`` (s) is how long bulk chunks computed during its
    wait (:func:`wait_model.bulk_overlap_s` of :data:`BULK_RUNS_KEY` and :data:`BULK_ACTIVITY_KEY`),
    which with ``bulk_at_admission`` (``decision.admitted_beside_bulk``; absent when unknown) decides
    the regime whose fit and lone overheads it feeds, if any (:func:`wait_model.fit_regime`).
    ``status`` 200: answered within the
    deadline; anything else (202, 504): the deadline passed first. Nothing is recorded for a request
    that admission did not see (``admitted_at`` is ``None``) or that put no work on the lane.
    """
    if decision.admitted_at is None:
        return
    if images <= 0:
        if decision.token:
            with contextlib.suppress(Exception):
                redis_client().hdel(PENDING_KEY, decision.token)
        return
    record = {"admitted": round(decision.admitted_at, 4), "answered": round(answered_at or time.time(), 4),
              "images": images, "status": status,
              "work_s": None if decision.work_s is None else round(decision.work_s, 4),
              "predicted_s": None if decision.predicted_wait_s is None else round(decision.predicted_wait_s, 4),
              "ahead": None if decision.ahead_images is None else round(decision.ahead_images, 2)}
    if decision.admitted_beside_bulk is not None:
        record["bulk_at_admission"] = decision.admitted_beside_bulk
    try:
        client = redis_client()
        record["bulk_s"] = round(_bulk_overlap(client, start=record["admitted"], end=record["answered"]), 4)
        regime = fit_regime(record)
        lone = LONE_BULK_KEY if regime else LONE_KEY
        with client.pipeline(transaction=False) as pipe:
            pipe.rpush(ANSWERS_KEY, json.dumps(record))
            pipe.ltrim(ANSWERS_KEY, -ANSWERS_KEPT, -1)
            if status == 200 and record["ahead"] == 0 and record["work_s"] is not None and regime is not None:
                pipe.rpush(lone, round(record["answered"] - record["admitted"] - record["work_s"], 4))
                pipe.ltrim(lone, -LONE_KEPT, -1)
            if decision.token:
                pipe.hdel(PENDING_KEY, decision.token)
            pipe.execute()
    except Exception as e:
        log.warning("could not record an interactive answer: %s", e)


def answer_records(client=None, *, since: float = 0.0) -> list[dict]:
    """Answers (:func:`interactive_answered`) recorded at or after ``since`` (Unix s), oldest first."""
    client = client or redis_client()
    rows = [json.loads(x) for x in client.lrange(ANSWERS_KEY, 0, -1)]
    return [r for r in rows if r["answered"] >= since]


# --- worker side ---------------------------------------------------------------------------------

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
    process when it ends (:func:`drain_rate`); never raises."""
    client = redis_client()
    started = time.time()
    try:
        client.hset(INFLIGHT_KEY, task_id, f"{images} {started:.3f}")
    except Exception as e:
        log.warning("could not record in-flight work: %s", e)
    try:
        yield
    finally:
        _tracker().finished(started, time.time(), images)
        with contextlib.suppress(Exception):
            client.hdel(INFLIGHT_KEY, task_id)


def interactive_pass(batcher: str, images: int, at: float) -> None:
    """Record in :data:`PASSES_KEY` that dynamic batcher ``batcher`` (unique per process and
    space) started a forward pass of ``images`` at ``at`` (Unix s), with its expected time at this
    worker's per-batch-size service times (0: none measured yet); ``images`` 0: the pass ended,
    clear it. The batcher's ``on_pass`` hook, on its model thread; never raises."""
    try:
        if images:
            curve = _tracker().curve  # replaced whole by _report, never mutated: safe to read
            expected = batch_ms(curve, images) if curve else 0.0
            redis_client().hset(PASSES_KEY, batcher, f"{images} {at:.3f} {expected:.1f}")
        else:
            redis_client().hdel(PASSES_KEY, batcher)
    except Exception as e:
        log.warning("could not record a running forward pass: %s", e)


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


@functools.cache
def _max_batch() -> int:
    """The dynamic batcher's largest batch: ``INTERACTIVE_MAX_BATCH_SIZE`` read as the worker's own
    configuration reads it (``workers.config.PipelineConfig``, default 8)."""
    raw = os.environ.get("INTERACTIVE_MAX_BATCH_SIZE")
    if raw:
        return int(raw)
    from workers.config import PipelineConfig

    return PipelineConfig.interactive_max_batch_size


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

