"""Admission: what may enter a lane, and when.

Three parts, all reading or writing the broker's Redis (kombu's Redis transport, ``REDIS_URL``):

1. **Web side, interactive lane** (:func:`interactive_admit`). A request is refused at once with
   429 and ``Retry-After`` when the predicted wait before its images reach the model is longer than
   its deadline: such work would only expire in the queue (the batcher drops it unseen), after
   having cost a database row, a blob and a queue slot, and after having pushed every later
   request further back. The prediction is::

       wait_s = (queued messages × images per request + images in flight) × service s per image

   - *queued messages*: ``LLEN`` of the interactive queue's lists in Redis. kombu keeps one list per
     priority step: ``interactive`` for step 0 and ``interactive\\x06\\x16{3,6,9}`` for the others
     (``Channel._q_for_pri``, separator ``Channel.sep``).
   - *images in flight*: images of interactive tasks that a worker has started and not finished, a
     hash the worker keeps (:func:`interactive_in_flight`). Entries older than a stale bound are
     ignored, so a killed worker cannot block admission forever.
   - *service time per image* and *images per request*: means over the interactive worker's last
     :data:`WINDOW` dynamic-batcher batches (forward-pass ms / images; images / requests), written
     by that worker after every task (:func:`interactive_report`). They are measured under whatever
     else shares the machine (a bulk lane on the same CPU or GPU makes them larger), so the
     prediction follows contention without knowing about it.

   With no measurement yet (no interactive work since the Redis started) every request is admitted:
   there is nothing to predict with. A Redis error admits too (the enqueue that follows reports the
   outage). Eager Celery (tests) queues nothing, so admission is skipped there.

2. **Worker side, interactive lane**: the in-flight hash and the batch reports above; the reports
   are also appended to a capped list (:data:`BATCHES_KEY`) that ``benchmarks/lanes.py`` reads to
   show the batch sizes formed and the queue delays.

3. **Worker side, one worker for both lanes** (deployment (b)): the worker holds at most
   :data:`BULK_HELD` bulk messages (:class:`LaneGateCycle`: while it holds them, its ``BRPOP`` asks
   Redis for interactive messages only) and computes one chunk at a time (:func:`bulk_turn`): one
   chunk runs, the next waits on deck so the bulk lane never idles between chunks, and every other
   thread stays free for interactive work, which therefore never waits behind more than the one
   bulk batch being computed.

Bulk work is never refused: it yields (priorities, the gate above, pause).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import threading
import time
from typing import Iterator, Sequence

from django.conf import settings
from kombu.utils.scheduling import priority_cycle

from embeddings.services.errors import ApplicationError
from project import lanes

log = logging.getLogger(__name__)

#: Batches of the interactive worker's dynamic batcher that the service-time means cover.
WINDOW = 32
#: Hash written by the interactive worker: the window means (see :func:`interactive_report`).
SERVICE_KEY = f"lanes:{lanes.INTERACTIVE}:service"
#: Hash ``{task id: "images started_unix_s"}`` of interactive tasks running now.
INFLIGHT_KEY = f"lanes:{lanes.INTERACTIVE}:inflight"
#: Capped list of JSON batch records (newest last), for benchmarks and diagnosis.
BATCHES_KEY = f"lanes:{lanes.INTERACTIVE}:batches"
BATCHES_KEPT = 20_000


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


@dataclasses.dataclass(frozen=True)
class LaneLoad:
    """What the interactive lane holds now and how fast it drains.

    Attributes:
        queued_messages: messages waiting in Redis (every priority step).
        inflight_images: images of tasks a worker has started and not finished.
        ms_per_image: measured forward-pass time per image (ms); ``None`` before any measurement.
        images_per_request: measured mean images per request (1.0 before any measurement).
    """

    queued_messages: int
    inflight_images: int
    ms_per_image: float | None
    images_per_request: float = 1.0

    @property
    def backlog_images(self) -> float:
        """Images ahead of a request arriving now."""
        return self.queued_messages * self.images_per_request + self.inflight_images

    @property
    def predicted_wait_s(self) -> float | None:
        """Seconds before a request arriving now reaches the model; ``None`` when unknown."""
        if self.ms_per_image is None:
            return None
        return self.backlog_images * self.ms_per_image / 1000


@dataclasses.dataclass(frozen=True)
class Decision:
    """``admitted``, the ``predicted_wait_s`` it was based on (``None``: unknown), and when refused
    ``retry_after_s``: whole seconds until the backlog has drained enough to fit the deadline."""

    admitted: bool
    predicted_wait_s: float | None
    retry_after_s: int | None = None


def decide(load: LaneLoad, *, deadline_s: float) -> Decision:
    """Admit unless the predicted wait is longer than ``deadline_s`` (s). Pure: no I/O."""
    wait = load.predicted_wait_s
    if wait is None or wait <= deadline_s:
        return Decision(True, wait)
    return Decision(False, wait, max(1, math.ceil(wait - deadline_s)))


def _stale_after_s() -> float:
    # An interactive task ends within its deadline (the batcher drops it after) plus decode time;
    # anything much older belongs to a worker that died.
    return 2 * settings.INTERACTIVE_DEADLINE_S + 30


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
        pipe.hgetall(SERVICE_KEY)
        *lengths, inflight, service = pipe.execute()
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
    ms = float(service["ms_per_image"]) if "ms_per_image" in service else None
    per_request = float(service.get("images_per_request", 1.0))
    return LaneLoad(queued_messages=sum(lengths), inflight_images=inflight_images, ms_per_image=ms,
                    images_per_request=per_request)


def interactive_admit(*, deadline_s: float) -> Decision:
    """Admit a request with ``deadline_s`` to the interactive lane, or refuse it.

    Returns:
        The :class:`Decision` (admitted).

    Raises:
        ApplicationError: ``overloaded`` (429) with a ``Retry-After`` header (s) when the predicted
            wait exceeds the deadline; ``extra`` carries the numbers the decision used.
    """
    from project.celery import app

    if app.conf.task_always_eager or not settings.ADMISSION_CONTROL:
        return Decision(True, None)
    try:
        load = interactive_load()
    except Exception as e:  # Redis down: admit; the enqueue that follows reports the outage
        log.warning("admission skipped, Redis unreadable: %s", e)
        return Decision(True, None)
    decision = decide(load, deadline_s=deadline_s)
    if not decision.admitted:
        raise ApplicationError(
            f"the interactive lane is overloaded: predicted wait {decision.predicted_wait_s:.2f} s is longer "
            f"than the deadline {deadline_s:.2f} s; retry after {decision.retry_after_s} s or use POST /api/jobs/",
            code="overloaded", status=429, headers={"Retry-After": str(decision.retry_after_s)},
            extra={"predicted_wait_s": round(decision.predicted_wait_s, 3), "deadline_s": round(deadline_s, 3),
                   "retry_after_s": decision.retry_after_s, "queued_messages": load.queued_messages,
                   "inflight_images": load.inflight_images, "ms_per_image": round(load.ms_per_image, 2)},
        )
    return decision


# --- worker side ---------------------------------------------------------------------------------

@contextlib.contextmanager
def interactive_in_flight(task_id: str, images: int) -> Iterator[None]:
    """Count ``images`` of task ``task_id`` as in flight while the block runs (never raises)."""
    client = redis_client()
    try:
        client.hset(INFLIGHT_KEY, task_id, f"{images} {time.time():.3f}")
    except Exception as e:
        log.warning("could not record in-flight work: %s", e)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            client.hdel(INFLIGHT_KEY, task_id)


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


class _Reporter:
    """Sends the batcher's new records to Redis; remembers the last one sent (per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = None

    def report(self, records) -> int:
        with self._lock:
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
                if rec is self._last:
                    break
                new.append(rec)
            new.reverse()
            stats = window_stats(snapshot)
            if not new and stats is None:
                return 0
            now = time.time()
            client = redis_client()
            with client.pipeline(transaction=False) as pipe:
                if new:
                    pipe.rpush(BATCHES_KEY, *(json.dumps({"t": round(now, 3), **dataclasses.asdict(r)}) for r in new))
                    pipe.ltrim(BATCHES_KEY, -BATCHES_KEPT, -1)
                if stats is not None:
                    pipe.hset(SERVICE_KEY, mapping={**stats, "updated": now})
                pipe.execute()
            if snapshot:
                self._last = snapshot[-1]
            return len(new)


@functools.cache
def _reporter() -> _Reporter:
    return _Reporter()


def interactive_report(records) -> int:
    """Publish the dynamic batcher's new ``records`` and the window means (never raises).

    Returns:
        How many new batch records were sent.
    """
    try:
        return _reporter().report(records)
    except Exception as e:
        log.warning("could not report interactive batches: %s", e)
        return 0


def batch_records(client=None, *, since: float = 0.0) -> list[dict]:
    """Batch records reported at or after ``since`` (Unix s), oldest first: ``{"t", "size",
    "requests", "queue_delay_ms", "service_ms", "expired"}`` (``t``: when reported, ≥ batch end)."""
    client = client or redis_client()
    rows = [json.loads(x) for x in client.lrange(BATCHES_KEY, 0, -1)]
    return [r for r in rows if r["t"] >= since]


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


def _bulk_messages_held() -> int:
    """Bulk messages this worker process has reserved and not finished (running or waiting)."""
    from celery.worker import state

    held = 0
    for req in tuple(state.reserved_requests):  # a copy: pool threads remove finished requests
        info = getattr(req, "delivery_info", None) or {}
        held += info.get("routing_key") == lanes.BULK
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
    """

    def consume(self, n: int) -> list[str]:
        queues = self.items[:n]
        if lanes.BULK in queues and lanes.INTERACTIVE in queues and _bulk_messages_held() >= BULK_HELD:
            return [q for q in queues if q != lanes.BULK]
        return queues
