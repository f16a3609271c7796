"""Bulk work is never refused: it yields (priorities, the gate below, pause).

**Worker side, one worker for both lanes** (deployment (b)): the worker holds at most
:data:`BULK_HELD` bulk messages (:class:`LaneGateCycle`: while it holds them, its ``BRPOP`` asks
Redis for interactive messages only) and computes one chunk at a time (:func:`bulk_turn`): one
chunk runs, the next waits on deck so the bulk lane never idles between chunks, and every other
thread stays free for interactive work, which therefore never waits behind more than the one
bulk batch being computed.

A migration yields further: at most ``MIGRATION_BULK_SLOTS`` of its chunks compute at once per
host (:func:`migration_slot`), and each of its micro-batches first waits while the interactive lane
has work (:func:`migration_yield`, :func:`interactive_busy`). A background ingest job's chunks
wait the same way while the lane is at capacity (:func:`ingest_yielder`, ``BULK_YIELD_MAX_S``).

Every bulk chunk also marks when it computes (:class:`BulkActivity`, :func:`bulk_computing`): the
interactive lane's wait model keeps one fit for waits beside bulk work and one for the others, and
a parked chunk is not computing.

The Redis keys and the client are lane control's (:mod:`.keys`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Iterator

import redis
from celery.worker import state
from django.conf import settings
from kombu.utils.scheduling import priority_cycle

from embeddings.lane_control.keys import (
    BULK_ACTIVITY_KEY,
    BULK_RUNS_KEPT,
    BULK_RUNS_KEY,
    INFLIGHT_KEY,
    MIGRATION_SLOT_KEY,
    PENDING_KEY,
    REFUSALS_KEY,
    queue_keys,
    redis_client,
    stale_after_s,
)
from project import lanes
from project.processes import VECTORS_HELD

log = logging.getLogger(__name__)

# --- bulk turns; deployment (b): one worker for both lanes ----------------------------------------

#: Bulk messages a worker consuming both lanes holds at most: one computing, one on deck.
BULK_HELD = 2


@dataclasses.dataclass
class Turn:
    """A bulk chunk's turn: ``started`` (Unix s) when it got it, after ``waited_ms`` on deck;
    ``ended`` (Unix s) just before it was handed on (set when the block exits)."""

    started: float
    waited_ms: float
    ended: float | None = None


@functools.cache
def _bulk_lock() -> threading.Lock:
    return threading.Lock()


@contextlib.contextmanager
def bulk_turn() -> Iterator[Turn]:
    """Hold this process's bulk turn while the block runs: one bulk chunk computes at a time.

    Uncontended in a worker that runs one task at a time (prefork child, solo). In the shared worker
    (threads pool) the on-deck chunk waits here, holding a thread but no CPU, and starts the moment
    the running one ends.
    """
    t0 = time.perf_counter()
    with _bulk_lock():
        turn = Turn(started=time.time(), waited_ms=(time.perf_counter() - t0) * 1000)
        try:
            yield turn
        finally:
            turn.ended = time.time()


class BulkActivity:
    """When one bulk chunk computes, as the interactive lane's wait model sees it.

    :meth:`start` marks the chunk computing in :data:`BULK_ACTIVITY_KEY` (``"since"``, Unix s,
    and `` y`` when it ``yields``: its passes wait while the interactive lane refuses,
    :func:`ingest_yielder` or :func:`migration_yield`, so a refusal parks it within a pass and the
    web says what the quiet lane will then wait, ``wait_model.parked_wait_ahead``); :meth:`stop`
    (the chunk parks for the interactive lane, or ends) removes the mark and appends the interval to
    :data:`BULK_RUNS_KEY`. The web fits the interactive wait apart for requests that
    waited beside bulk work and those that did not (``wait_model.lane_load``), and picks the fit by
    whether a chunk computes now: an overload parks the bulk job, and the waits learnt beside it no
    longer hold. One object per chunk, used from the chunk's thread; never raises (Redis errors are
    logged: the chunk computes on).
    """

    def __init__(self, *, yields: bool = False) -> None:
        self.field = f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"
        self.since: float | None = None
        self.yields = yields

    def start(self) -> None:
        """The chunk computes from now (no-op while it already does)."""
        if self.since is not None:
            return
        self.since = time.time()
        try:
            redis_client().hset(BULK_ACTIVITY_KEY, self.field, f"{self.since:.4f}{' y' if self.yields else ''}")
        except Exception as e:  # noqa: BLE001 - bookkeeping: never what stops a chunk
            log.warning("bulk activity not recorded (Redis: %s)", e)

    def stop(self) -> None:
        """The chunk stopped computing now (no-op while it does not compute)."""
        if self.since is None:
            return
        since, self.since = self.since, None
        try:
            with redis_client().pipeline(transaction=False) as pipe:
                pipe.hdel(BULK_ACTIVITY_KEY, self.field)
                pipe.rpush(BULK_RUNS_KEY, f"{since:.4f} {time.time():.4f}")
                pipe.ltrim(BULK_RUNS_KEY, -BULK_RUNS_KEPT, -1)
                pipe.execute()
        except Exception as e:  # noqa: BLE001
            log.warning("bulk activity not recorded (Redis: %s)", e)


@contextlib.contextmanager
def bulk_computing(*, yields: bool = False) -> Iterator[BulkActivity]:
    """A chunk's :class:`BulkActivity`, computing from the start of the block to its end, except
    while its yields wait (pass it to :func:`ingest_yielder` or :func:`migration_yield`, and
    ``yields`` true)."""
    activity = BulkActivity(yields=yields)
    activity.start()
    try:
        yield activity
    finally:
        activity.stop()


#: How often (s) a migration chunk waiting for a slot looks again.
MIGRATION_SLOT_POLL_S = 0.2


@contextlib.contextmanager
def migration_slot(slots: int | None = None, *, hold_s: float | None = None) -> Iterator[float]:
    """Hold one of this host's ``slots`` migration slots while the block runs (yields the ms waited).

    A migration re-embeds the whole catalogue at background priority; on a host whose embedding
    workers share cores, two bulk processes computing migration chunks at once cost the interactive
    lane far more than one, for little more migration speed (docs/benchmarks-migration.md). So at
    most ``MIGRATION_BULK_SLOTS`` (default 1) migration chunks compute at once per host; ingest
    jobs are not limited. Slots are Redis locks that expire
    after ``hold_s`` (the bulk task's time limit), so a process killed while holding one frees it.
    ``slots`` 0, or Redis unreachable: no limit (a migration must never stall on its own throttle).
    """

    slots = settings.MIGRATION_BULK_SLOTS if slots is None else slots
    if slots <= 0:
        yield 0.0
        return
    hold_s = float(settings.CELERY_BULK_TIME_LIMIT_S if hold_s is None else hold_s)
    host = socket.gethostname()
    t0 = time.perf_counter()
    lock = None
    try:
        client = redis_client()
        while lock is None:
            for n in range(slots):
                candidate = client.lock(f"{MIGRATION_SLOT_KEY}{host}:{n}", timeout=hold_s, blocking=False)
                if candidate.acquire():
                    lock = candidate
                    break
            else:
                time.sleep(MIGRATION_SLOT_POLL_S)
    except redis.RedisError as e:
        log.warning("migration slot not taken (Redis: %s): computing without it", e)
    try:
        yield (time.perf_counter() - t0) * 1000
    finally:
        if lock is not None:
            try:
                lock.release()
            except redis.RedisError:  # expired or Redis gone: the slot frees itself
                pass


#: How soon (s) a bulk micro-batch waiting for the interactive lane to fall idle first looks again;
#: each further look waits twice as long, up to :data:`YIELD_POLL_MAX_S`.
YIELD_POLL_S = 0.02
#: The longest wait (s) between two looks. Each look is one Redis pipeline and a JSON parse per
#: pending request: polled every 20 ms through a whole overload, bulk processes that do nothing else
#: burn a tenth of a core (docs/benchmarks-load.md). Up to 0.2 s late to resume is little beside an
#: interactive pass of 8, and a migration's waits between two requests (a few hundred ms) still end
#: within 20-160 ms of the lane falling idle.
YIELD_POLL_MAX_S = 0.2


def interactive_busy(client=None, *, refused_within_s: float = 0.0) -> bool:
    """Whether the interactive lane has work now (one Redis round trip): a message in its queue, a
    task a worker is running (:data:`INFLIGHT_KEY`), or an admitted request not answered yet
    (:data:`PENDING_KEY`: from admission to the answer, the vectors worker's search included).
    Entries older than the stale bound (a dead web process or worker) do not count.

    With ``refused_within_s`` > 0, only while admission has also refused a request within that many
    seconds (the newest of :data:`REFUSALS_KEY`): the lane is at its capacity, not merely in use.

    Raises:
        redis.RedisError: Redis cannot be reached.
    """
    client = client or redis_client()
    with client.pipeline(transaction=False) as pipe:
        for k in queue_keys(lanes.INTERACTIVE):
            pipe.llen(k)
        pipe.hvals(INFLIGHT_KEY)
        pipe.hvals(PENDING_KEY)
        pipe.lindex(REFUSALS_KEY, -1)
        *lengths, inflight, pending, refusal = pipe.execute()
    now = time.time()
    if refused_within_s > 0 and (refusal is None or now - json.loads(refusal)["t"] > refused_within_s):
        return False
    if any(lengths):
        return True
    stale = stale_after_s()
    return (any(now - float(v.split()[1]) <= stale for v in inflight)
            or any(now - json.loads(raw)["admitted"] <= stale for raw in pending))


def yield_to_interactive(max_pause_s: float, *, refused_within_s: float = 0.0,
                         activity: BulkActivity | None = None) -> float:
    """Wait while the interactive lane is busy (:func:`interactive_busy`, looked at after
    :data:`YIELD_POLL_S` s, then twice as long each time up to :data:`YIELD_POLL_MAX_S`; with
    ``refused_within_s`` > 0 only while admission is also refusing requests), at most
    ``max_pause_s`` s; returns the milliseconds waited.

    A bulk micro-batch calls it (through :func:`migration_yield` or :func:`ingest_yielder`, as
    ``BatchRunner.run``'s ``before_pass``) so that on cores shared with the interactive worker a
    person's request never computes beside more than the one micro-batch already running. Nice 19
    alone is not enough: a bulk forward pass still takes its share of the cores, caches and memory
    bandwidth, so the interactive pass beside it is slower and less regular than alone
    (docs/benchmarks-migration.md, docs/benchmarks-load.md). The bound keeps bulk work moving
    under a lane that is never idle: after ``max_pause_s`` one micro-batch runs anyway.
    ``max_pause_s`` ≤ 0, or Redis unreachable: no wait. The chunk's ``activity`` (when given) is
    stopped while it waits and started again when it goes on.
    """

    if max_pause_s <= 0:
        return 0.0
    t0 = time.perf_counter()
    poll_s = YIELD_POLL_S
    try:
        client = redis_client()
        while (interactive_busy(client, refused_within_s=refused_within_s)
               and (left := max_pause_s - (time.perf_counter() - t0)) > 0):
            if activity is not None:
                activity.stop()
            time.sleep(min(poll_s, left))
            poll_s = min(2 * poll_s, YIELD_POLL_MAX_S)
    except redis.RedisError as e:
        log.warning("bulk work not yielding (Redis: %s)", e)
    finally:
        if activity is not None:
            activity.start()
    return (time.perf_counter() - t0) * 1000


def migration_yield(max_pause_s: float | None = None, *, activity: BulkActivity | None = None) -> float:
    """:func:`yield_to_interactive` for a migration chunk's micro-batch (``MIGRATION_MICRO_BATCH``
    images), at most ``max_pause_s`` (default ``MIGRATION_YIELD_MAX_S``, 2 s); returns the ms waited.
    A migration re-embeds the catalogue in the interactive lane's idle time."""
    return yield_to_interactive(settings.MIGRATION_YIELD_MAX_S if max_pause_s is None else max_pause_s,
                                activity=activity)


#: A migration chunk's passes look at the interactive lane at most this often (s) while it is idle:
#: a real CPU pass of MIGRATION_MICRO_BATCH images takes 100+ ms, so each still looks before it runs,
#: while fast passes (a GPU, previews) make at most 1 / this many Redis round trips a second instead of
#: one per pass of 4 images (issue 43: no Redis round trip per image). A request arriving meanwhile
#: waits at most this long plus the passes begun in it.
MIGRATION_LOOK_EVERY_S = 0.05


def migration_yielder(max_pause_s: float | None = None, *, activity: BulkActivity | None = None,
                      look_every_s: float = MIGRATION_LOOK_EVERY_S) -> Callable[[], float]:
    """The ``before_pass`` of one migration chunk: :func:`migration_yield` before a pass, except
    within ``look_every_s`` s of a look that found the lane idle (then 0.0 at once, no round trip).
    Returns a callable that returns the ms it waited."""
    last_idle = [float("-inf")]

    def before_pass() -> float:
        if time.monotonic() - last_idle[0] < look_every_s:
            return 0.0
        waited = migration_yield(max_pause_s, activity=activity)
        last_idle[0] = time.monotonic()
        return waited

    return before_pass


def ingest_yielder(budget_s: float | None = None, *, activity: BulkActivity | None = None) -> Callable[[], float]:
    """The ``before_pass`` of one background ingest chunk (passes of ``BULK_YIELD_MICRO_BATCH``
    images): each call is :func:`yield_to_interactive` for at most ``BULK_YIELD_MAX_S`` s while the
    lane has work and admission has refused a request within ``BULK_YIELD_REFUSED_S`` s (the lane at
    its capacity; 0: whenever it has work), and all of the chunk's calls together wait at most
    ``budget_s`` s (default half the bulk task's time limit, ``CELERY_BULK_TIME_LIMIT_S``: a chunk
    that gave way all the time must still finish before Celery kills it). Returns a callable that
    returns the ms it waited.

    Why only at capacity: below it the lane has room and nice 19 keeps its latency (docs/benchmarks.md,
    "The two lanes under load"); waiting there too would cost the bulk job every gap between
    requests. At capacity every bulk pass is requests refused and waits told wrong
    (docs/benchmarks-load.md).

    Who gets one is the chunk's business (``queues.bulk.chunk_embed``): a background job not at risk of
    missing its deadline; an urgent job's chunks never wait.
    """
    budget_s = settings.CELERY_BULK_TIME_LIMIT_S / 2 if budget_s is None else budget_s
    ends = time.monotonic() + budget_s

    def before_pass() -> float:
        return yield_to_interactive(min(settings.BULK_YIELD_MAX_S, ends - time.monotonic()),
                                    refused_within_s=settings.BULK_YIELD_REFUSED_S, activity=activity)

    return before_pass


def _messages_held(queue: str = lanes.BULK) -> int:
    """Messages of ``queue`` this worker process has reserved and not finished (running or waiting)."""

    held = 0
    for req in tuple(state.reserved_requests):  # a copy: pool threads remove finished requests
        info = getattr(req, "delivery_info", None) or {}
        held += info.get("routing_key") == queue
    return held


class LaneGateCycle(priority_cycle):
    """kombu queue cycle (``broker_transport_options["queue_order_strategy"]``) that gates bulk.

    kombu's Redis transport asks this object which queues the next ``BRPOP`` covers
    (``Channel._brpop_start`` → ``consume``); its keys are ordered priority step first, then the
    queues in the listed order, so interactive step-0 messages always come out first. On top of
    kombu's ``priority`` strategy, when the process consumes both lanes and already holds
    :data:`BULK_HELD` bulk messages (reserved, running or on deck), the bulk queue is left out: the
    worker's other threads then only ever take interactive work, and no further bulk message is
    hoarded in the process (celery/celery#3434). A worker consuming one lane (deployment (a))
    behaves exactly as with ``"priority"``.

    The bulk queue returns to the ``BRPOP`` once the one in flight returns (at the latest after
    ``polling_interval`` s); the on-deck chunk hides that delay while a chunk takes longer.

    The same gate holds the vectors queue in an interactive worker that owns the embedded store
    (``STORE_OWNER=interactive``): at most ``processes.VECTORS_HELD`` vectors messages, one writing
    and one on deck, so a bulk write backlog never takes the threads interactive work runs on.
    """

    def consume(self, n: int) -> list[str]:
        queues = self.items[:n]
        if lanes.INTERACTIVE not in queues:
            return queues
        if lanes.BULK in queues and _messages_held(lanes.BULK) >= BULK_HELD:
            queues = [q for q in queues if q != lanes.BULK]
        if lanes.VECTORS in queues and _messages_held(lanes.VECTORS) >= VECTORS_HELD:
            queues = [q for q in queues if q != lanes.VECTORS]
        return queues
