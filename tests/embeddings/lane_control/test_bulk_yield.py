"""Bulk work yielding to the interactive lane (embeddings/lane_control/bulk_yield.py): one bulk turn
at a time, migration slots per host, waits while the lane has work (backing off), the ingest
chunk's budget, the marks of when a chunk computes, and the kombu cycle that gates bulk messages.

Real Redis (``conftest``) where the behaviour is Redis's; a clock only ``sleep`` moves where it is
the waiting itself.
"""
from __future__ import annotations

import json
import threading
import time
import types

import pytest

from embeddings import runtime, tasks  # noqa: F401 - registers the tasks the eager chains run by name
from embeddings.lane_control import bulk_yield, keys
from embeddings.models import Image, ImageStatus
from project import lanes
from tests.embeddings.lane_control.conftest import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)


def test_one_bulk_chunk_computes_at_a_time_and_the_next_waits_on_deck():
    """``bulk_turn``: a second chunk's turn starts only once the first has handed it on, and says how
    long it waited; each turn's ``ended`` is set when its block exits, even by an exception."""
    order: list[str] = []
    inside = threading.Event()
    turns: list[bulk_yield.Turn] = []

    def second():
        with bulk_yield.bulk_turn() as turn:
            order.append("second")
            turns.append(turn)

    with bulk_yield.bulk_turn() as first:
        assert first.ended is None and first.waited_ms < 50
        waiter = threading.Thread(target=lambda: (inside.set(), second()))
        waiter.start()
        assert inside.wait(5)
        time.sleep(0.2)
        order.append("first")
    waiter.join(5)
    assert order == ["first", "second"]
    assert first.started <= first.ended and turns[0].started >= first.ended - 1e-3
    assert turns[0].waited_ms >= 150
    with pytest.raises(RuntimeError), bulk_yield.bulk_turn() as failed:
        raise RuntimeError("a chunk that fails")
    assert failed.ended is not None
    with bulk_yield.bulk_turn() as after:  # the turn was handed on
        assert after.waited_ms < 50


def _held(*routing_keys: str) -> list:
    return [types.SimpleNamespace(delivery_info={"routing_key": k}) for k in routing_keys]


def test_the_lane_gate_leaves_bulk_out_while_a_worker_holds_two_bulk_messages(monkeypatch):
    """``LaneGateCycle`` (kombu's ``queue_order_strategy``): a worker consuming both lanes stops
    asking Redis for bulk messages while it holds ``BULK_HELD`` (one computing, one on deck);
    interactive messages it holds do not count. A worker of one lane is never gated."""
    from celery.worker import state

    both = bulk_yield.LaneGateCycle([lanes.INTERACTIVE, lanes.BULK])
    monkeypatch.setattr(state, "reserved_requests", _held(lanes.BULK, lanes.INTERACTIVE, lanes.INTERACTIVE))
    assert bulk_yield._messages_held() == 1
    assert both.consume(2) == [lanes.INTERACTIVE, lanes.BULK]
    monkeypatch.setattr(state, "reserved_requests", _held(lanes.BULK, lanes.BULK))
    assert bulk_yield._messages_held() == bulk_yield.BULK_HELD == 2
    assert both.consume(2) == [lanes.INTERACTIVE]
    assert both.consume(1) == [lanes.INTERACTIVE]  # kombu asked for the first queue only
    assert bulk_yield.LaneGateCycle([lanes.BULK]).consume(1) == [lanes.BULK]
    monkeypatch.setattr(state, "reserved_requests", _held())
    assert both.consume(2) == [lanes.INTERACTIVE, lanes.BULK]


def test_the_lane_gate_holds_two_vectors_messages_in_an_interactive_worker_that_owns_the_store(monkeypatch):
    """With ``STORE_OWNER=interactive`` the interactive worker consumes the vectors queue after its
    own: it stops asking Redis for vectors messages while it holds ``VECTORS_HELD`` (one writing,
    one on deck), so a backlog of bulk writes never takes the threads interactive work needs. The
    solo vectors worker (one queue) is never gated."""
    from celery.worker import state

    from project.processes import VECTORS_HELD

    owner = bulk_yield.LaneGateCycle([lanes.INTERACTIVE, lanes.VECTORS])
    monkeypatch.setattr(state, "reserved_requests", _held(lanes.VECTORS, lanes.INTERACTIVE, lanes.INTERACTIVE))
    assert owner.consume(2) == [lanes.INTERACTIVE, lanes.VECTORS]
    monkeypatch.setattr(state, "reserved_requests", _held(*[lanes.VECTORS] * VECTORS_HELD))
    assert VECTORS_HELD == 2 and bulk_yield._messages_held(lanes.VECTORS) == 2
    assert owner.consume(2) == [lanes.INTERACTIVE]
    assert bulk_yield.LaneGateCycle([lanes.VECTORS]).consume(1) == [lanes.VECTORS]
    monkeypatch.setattr(state, "reserved_requests", _held(lanes.BULK, lanes.BULK, lanes.VECTORS))
    assert owner.consume(2) == [lanes.INTERACTIVE, lanes.VECTORS]  # bulk messages do not count against it


def test_migration_chunks_take_one_host_slot_at_a_time(lane_redis, settings):
    """Two bulk processes with migration chunks: the second computes only once the first is done;
    a slot whose holder died expires; 0 slots, or no Redis, limit nothing."""
    import threading

    client, _ = lane_redis
    order: list[str] = []
    first_in = threading.Event()
    release_first = threading.Event()

    def first():
        with bulk_yield.migration_slot(1, hold_s=30):
            order.append("first in")
            first_in.set()
            release_first.wait(10)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(10)
    waiter = threading.Thread(target=lambda: _second(order))
    waiter.start()
    time.sleep(0.5)
    assert order == ["first in"]  # the second chunk waits for the slot
    release_first.set()
    t.join(10)
    waiter.join(10)
    assert order == ["first in", "first out", "second in"]
    assert not client.keys(keys.MIGRATION_SLOT_KEY + "*")  # both slots handed back

    # a holder killed mid-chunk: its slot expires after hold_s
    client.set(f"{keys.MIGRATION_SLOT_KEY}{__import__('socket').gethostname()}:0", "dead", px=300)
    with bulk_yield.migration_slot(1, hold_s=30) as waited_ms:
        assert waited_ms >= 100
    with bulk_yield.migration_slot(0) as waited_ms:
        assert waited_ms == 0.0
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens: computing goes on without a slot
    with bulk_yield.migration_slot(1, hold_s=30) as waited_ms:
        assert waited_ms >= 0


def _second(order: list[str]) -> None:
    with bulk_yield.migration_slot(1, hold_s=30):
        order.append("second in")


def test_a_migration_waits_while_the_interactive_lane_has_work(lane_redis, settings):
    """migration_yield blocks while a request is admitted and unanswered, a task runs or a message
    waits, returns as soon as the lane is idle, gives up after its bound, and ignores stale entries;
    asked for the lane at capacity (``refused_within_s``), busy only after a recent refusal."""
    import threading

    client, app = lane_redis
    assert bulk_yield.interactive_busy(client) is False
    assert bulk_yield.migration_yield(2.0) < 100  # idle lane: one look

    # an admitted request not answered yet: the migration waits until its answer
    client.hset(keys.PENDING_KEY, "tok", json.dumps({"admitted": time.time(), "work_s": 0.3,
                                                          "predicted_s": 0.5, "deadline_s": 2.0}))
    assert bulk_yield.interactive_busy(client) is True
    threading.Timer(0.4, lambda: client.hdel(keys.PENDING_KEY, "tok")).start()
    waited = bulk_yield.migration_yield(5.0)
    assert 350 <= waited < 2000

    # a task a worker runs, then a queued message: busy; the bound lets one micro-batch through
    client.hset(keys.INFLIGHT_KEY, "task-1", f"1 {time.time():.3f}")
    assert bulk_yield.interactive_busy(client) is True
    assert 300 <= bulk_yield.migration_yield(0.3) < 1500
    client.delete(keys.INFLIGHT_KEY)
    app.send_task("embeddings.tasks.embed_interactive", queue="interactive")
    assert bulk_yield.interactive_busy(client) is True
    for k in keys.queue_keys("interactive"):
        client.delete(k)

    # entries of a dead web process or worker (older than the stale bound) do not hold a migration
    old = time.time() - keys.stale_after_s() - 5
    client.hset(keys.PENDING_KEY, "dead", json.dumps({"admitted": old, "work_s": 0.3,
                                                           "predicted_s": 0.5, "deadline_s": 2.0}))
    client.hset(keys.INFLIGHT_KEY, "dead-task", f"1 {old:.3f}")
    assert bulk_yield.interactive_busy(client) is False
    client.delete(keys.PENDING_KEY, keys.INFLIGHT_KEY)

    # refused_within_s: busy only while admission refused a request that recently (at capacity)
    client.hset(keys.INFLIGHT_KEY, "task-2", f"1 {time.time():.3f}")
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is False  # never refused
    client.rpush(keys.REFUSALS_KEY, json.dumps({"t": time.time() - 20, "deadline_s": 2.0}))
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is False  # 20 s ago
    assert bulk_yield.interactive_busy(client, refused_within_s=30) is True
    client.rpush(keys.REFUSALS_KEY, json.dumps({"t": time.time(), "deadline_s": 2.0}))
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is True
    client.delete(keys.INFLIGHT_KEY)
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is False  # refusing, but idle now
    client.delete(keys.REFUSALS_KEY)

    assert bulk_yield.migration_yield(0) == 0.0  # MIGRATION_YIELD_MAX_S=0: never waits
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # Redis gone: computing goes on
    assert bulk_yield.migration_yield(2.0) < 1000


class _FakeClock:
    """``time`` for :mod:`bulk_yield` with a clock that only ``sleep`` moves; the sleeps it was asked for."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(round(s, 6))
        self.now += s


@pytest.mark.parametrize("busy_for_s, max_pause_s, sleeps, waited_ms", [
    # the looks back off 20, 40, 80, 160 ms, then every 200 ms; the lane idles at 1.0 s, seen at 1.1 s
    (1.0, 60.0, [0.02, 0.04, 0.08, 0.16, 0.2, 0.2, 0.2, 0.2], 1100.0),
    # the bound cuts the last sleep short: exactly max_pause_s
    (10.0, 0.5, [0.02, 0.04, 0.08, 0.16, 0.2], 500.0),
    (0.0, 60.0, [], 0.0),  # idle: one look, no sleep
])
def test_a_waiting_bulk_pass_looks_less_often_the_longer_it_waits(monkeypatch, busy_for_s, max_pause_s, sleeps,
                                                                  waited_ms):
    """yield_to_interactive's looks at the lane back off from YIELD_POLL_S to YIELD_POLL_MAX_S: a bulk
    job waiting out a 60 s overload makes ~5 Redis round trips a second, not 50."""
    clock = _FakeClock()
    looks = []
    monkeypatch.setattr(bulk_yield, "time", clock)
    monkeypatch.setattr(bulk_yield, "redis_client", lambda: None)
    monkeypatch.setattr(bulk_yield, "interactive_busy",
                        lambda client, refused_within_s: looks.append(clock.now) or clock.now < busy_for_s)
    assert bulk_yield.yield_to_interactive(max_pause_s, refused_within_s=10) == pytest.approx(waited_ms)
    assert clock.sleeps == pytest.approx(sleeps)
    assert len(looks) == len(sleeps) + 1
    assert (bulk_yield.YIELD_POLL_S, bulk_yield.YIELD_POLL_MAX_S) == (0.02, 0.2)


@pytest.mark.parametrize("priority, max_pause_s, deadline_in_s, refused, passes, waits", [
    ("background", 5.0, None, True, [2, 2, 1], True),  # at capacity: passes of 2, the first after the answer
    ("background", 5.0, None, False, [2, 2, 1], False),  # busy but nothing refused: room left, it computes
    ("background", 5.0, -60, True, [5], False),  # its deadline has passed: at risk, it does not wait
    ("urgent", 5.0, None, True, [5], False),  # an urgent job's deadline comes first: one pass, no wait
    ("background", 0.0, None, True, [5], False),  # BULK_YIELD_MAX_S 0 (off): one pass, no wait
])
def test_a_background_ingest_chunk_computes_in_the_interactive_lanes_idle_time(
        lane_redis, service, user, monkeypatch, priority, max_pause_s, deadline_in_s, refused, passes, waits):
    """With ``BULK_YIELD_MAX_S`` > 0 a background ingest job's chunk (5 images) runs as forward
    passes of ``BULK_YIELD_MICRO_BATCH`` (2) images, and while a request is admitted and unanswered
    (its answer comes 0.4 s later) and admission refused one a moment ago, neither decodes nor
    computes; with no refusal within ``BULK_YIELD_REFUSED_S`` it computes at once, and so does an
    urgent job's chunk, a job at risk of missing its deadline, or the setting at 0. Every image ends
    embedded either way."""
    import datetime as dt
    import io
    import threading

    from django.db import transaction
    from django.utils import timezone

    from embeddings.models import JobStatus
    from embeddings.services.catalogue import jobs as job_services
    from embeddings.services.catalogue.sources import SourceFile

    client, _ = lane_redis
    service.BULK_SCHEDULER = "fifo"  # the chunk is sent by hand below, not by the fair scheduler's resume
    service.BULK_YIELD_MAX_S, service.BULK_YIELD_MICRO_BATCH, service.BULK_YIELD_REFUSED_S = max_pause_s, 2, 10.0
    service.PIPELINE = service.PIPELINE.replace(batch_size=5)
    encoder = runtime.encoder_holder().get()
    calls: list[int] = []
    real = encoder.encode_images
    monkeypatch.setattr(encoder, "encode_images", lambda px: calls.append(len(px)) or real(px))
    files = [SourceFile(name=f"{i}.jpg", size=len(d), open=lambda d=d: io.BytesIO(d))
             for i, d in enumerate(jpeg_bytes(70 + i) for i in range(5))]
    deadline = None if deadline_in_s is None else timezone.now() + dt.timedelta(seconds=deadline_in_s)
    with transaction.atomic():  # paused before its chunk is sent: parked, sent below by hand
        job = job_services.job_create(owner=user, sources=files, name="catalogue", priority=priority,
                                      deadline=deadline)
        job_services.job_transition(job=job, to=JobStatus.PAUSED)
    Image.objects.filter(job=job).update(reason="")  # as if still queued, never parked
    job_services.job_transition(job=job, to=JobStatus.QUEUED)
    ids = [str(i) for i in Image.objects.filter(job=job).order_by("created_at").values_list("id", flat=True)]

    if refused:
        client.rpush(keys.REFUSALS_KEY, json.dumps({"t": time.time(), "deadline_s": 2.0}))
    client.hset(keys.PENDING_KEY, "tok", json.dumps({"admitted": time.time(), "work_s": 0.3,
                                                          "predicted_s": 0.5, "deadline_s": 2.0}))
    answer = threading.Timer(0.4, lambda: client.hdel(keys.PENDING_KEY, "tok"))
    answer.start()
    out = tasks.embed_chunk.apply(args=(str(job.id), ids)).get()
    answer.join(5)
    assert calls == passes
    # the chunk told the web when it computed: one interval, or two around its wait when it waited
    runs = [tuple(map(float, r.split())) for r in client.lrange(keys.BULK_RUNS_KEY, 0, -1)]
    assert client.hlen(keys.BULK_ACTIVITY_KEY) == 0 and len(runs) == (2 if waits else 1)
    if waits:
        assert 350 <= out["paused_ms"] < 5000
        assert runs[1][0] - runs[0][1] == pytest.approx(out["paused_ms"] / 1000, abs=0.1)
    else:  # no before_pass at all, or one look at the lane per pass
        assert out["paused_ms"] == 0.0 if passes == [5] else out["paused_ms"] < 300
    job.refresh_from_db()
    assert out["embedded"] == 5 and job.status == JobStatus.DONE
    assert Image.objects.filter(job=job, status=ImageStatus.EMBEDDED).count() == 5



class _Activity:
    """A chunk's :class:`bulk_yield.BulkActivity` as far as a wait sees it: what it was told."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")


def test_a_chunk_that_waits_stops_computing_while_it_waits(monkeypatch):
    """``yield_to_interactive`` with the chunk's activity: stopped before every sleep (a parked chunk
    is not computing, whatever the web reads meanwhile), started again when it goes on; a lane idle
    at the first look starts it (a no-op for a chunk already computing) and never stops it."""
    clock = _FakeClock()
    monkeypatch.setattr(bulk_yield, "time", clock)
    monkeypatch.setattr(bulk_yield, "redis_client", lambda: None)
    monkeypatch.setattr(bulk_yield, "interactive_busy", lambda client, refused_within_s: clock.now < 0.05)
    activity = _Activity()
    assert bulk_yield.yield_to_interactive(5.0, activity=activity) == pytest.approx(60.0)  # 20 + 40 ms
    assert activity.calls == ["stop", "stop", "start"]
    idle = _Activity()
    assert bulk_yield.yield_to_interactive(5.0, activity=idle) == 0.0
    assert idle.calls == ["start"]
    assert bulk_yield.yield_to_interactive(0.0, activity=idle) == 0.0 and idle.calls == ["start"]  # off: not looked at


def test_an_ingest_chunks_waits_share_one_budget_and_migrations_wait_their_own_bound(monkeypatch, settings):
    """``ingest_yielder``: each pass waits at most ``BULK_YIELD_MAX_S``, and only while admission
    refused within ``BULK_YIELD_REFUSED_S``; all the chunk's passes together at most its budget (by
    default half the bulk task's time limit). ``migration_yield``: ``MIGRATION_YIELD_MAX_S`` a pass,
    whenever the lane has work."""
    asked: list[tuple[float, float]] = []
    monkeypatch.setattr(bulk_yield, "yield_to_interactive",
                        lambda max_pause_s, *, refused_within_s=0.0, activity=None:
                        asked.append((max_pause_s, refused_within_s)) or 0.0)
    settings.BULK_YIELD_MAX_S, settings.BULK_YIELD_REFUSED_S = 5.0, 10.0
    settings.CELERY_BULK_TIME_LIMIT_S, settings.MIGRATION_YIELD_MAX_S = 600, 2.0
    before_pass = bulk_yield.ingest_yielder()
    before_pass()
    short = bulk_yield.ingest_yielder(0.3)
    short()
    time.sleep(0.1)
    short()
    assert asked[0] == (5.0, 10.0)
    assert 0.25 < asked[1][0] <= 0.3 and asked[1][1] == 10.0
    assert 0.0 < asked[2][0] <= 0.2  # what the budget has left after 0.1 s and more
    asked.clear()
    bulk_yield.ingest_yielder(budget_s=0.0)()
    assert asked[0][0] <= 0.0  # spent: no wait at all (yield_to_interactive returns at once)
    asked.clear()
    bulk_yield.migration_yield()
    bulk_yield.migration_yield(0.5)
    assert asked == [(2.0, 0.0), (0.5, 0.0)]


def test_a_chunks_activity_marks_survive_a_redis_outage(settings):
    """``BulkActivity`` is bookkeeping: with Redis unreachable starting and stopping raise nothing,
    and stop after stop (or before any start) is a no-op."""
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens
    activity = bulk_yield.BulkActivity(yields=True)
    activity.stop()
    activity.start()
    assert activity.since is not None
    activity.stop()
    assert activity.since is None
    with bulk_yield.bulk_computing() as computing:
        assert computing.since is not None
    assert computing.since is None


def test_a_migration_looks_at_the_lane_at_most_every_interval_while_it_is_idle(monkeypatch):
    """``migration_yielder``: the first pass looks (one ``migration_yield``); passes within
    ``look_every_s`` of a look that found the lane idle do not look again (no Redis round trip per
    pass of a few images); the next one after the interval looks again; a look that waited restarts
    the interval from its end."""
    clock = [100.0]
    looks: list[float] = []
    monkeypatch.setattr(bulk_yield.time, "monotonic", lambda: clock[0])

    def look(max_pause_s=None, *, activity=None):
        looks.append(clock[0])
        return 0.0

    monkeypatch.setattr(bulk_yield, "migration_yield", look)
    before_pass = bulk_yield.migration_yielder(look_every_s=0.05)
    for t in (100.0, 100.01, 100.049, 100.051, 100.06, 100.2):
        clock[0] = t
        before_pass()
    assert looks == [100.0, 100.051, 100.2]
    assert bulk_yield.MIGRATION_LOOK_EVERY_S == 0.05
