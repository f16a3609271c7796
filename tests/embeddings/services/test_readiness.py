"""Readiness (``/readyz``, ``services.readiness``): lane states from the workers' presence and canary
answers in Redis, the canaries sent, the answers computed by the real model. The real processes
(workers answering canaries, a poisoned worker leaving the pool) are in tests/e2e/test_drain.py."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from embeddings import lane_control, worker_health
from embeddings.services import readiness
from project import lanes

pytestmark = pytest.mark.django_db


@pytest.fixture
def health_keys(settings):
    """Readiness's Redis keys and the lanes' queues empty before and after the test."""
    client = lane_control.redis_client()

    def clear():
        client.delete(lane_control.PRESENCE_KEY, lane_control.CANARY_KEY,
                      *(lane_control.CANARY_SENT_KEY + q for q in lanes.ALL_QUEUES),
                      *(k for q in lanes.ALL_QUEUES for k in lane_control.queue_keys(q)))

    clear()
    yield client
    clear()


def present(client, lane: str, worker: str, at: float) -> None:
    client.hset(lane_control.PRESENCE_KEY, f"{lane}|{worker}", str(at))


def answered(client, lane: str, worker: str, at: float, ok: bool = True, reason: str = "") -> None:
    client.hset(lane_control.CANARY_KEY, f"{lane}|{worker}",
                json.dumps({"ok": ok, "at": at, "seconds": 0.1, "reason": reason, "sent_at": at - 1}))


def test_each_lane_says_whether_a_worker_works(settings, health_keys):
    settings.READY_LANES = [lanes.INTERACTIVE, lanes.VECTORS, lanes.FETCH]
    settings.CANARY_MAX_AGE_S = 60
    now = time.time()
    client = health_keys
    # interactive: one broken worker and one working one: the lane works
    present(client, lanes.INTERACTIVE, "interactive@a", now)
    present(client, lanes.INTERACTIVE, "interactive@b", now)
    answered(client, lanes.INTERACTIVE, "interactive@a", now - 5, ok=False, reason="non_finite_embedding")
    answered(client, lanes.INTERACTIVE, "interactive@b", now - 10)
    # bulk (not required): workers whose every recent answer failed
    present(client, lanes.BULK, "bulk@a", now)
    answered(client, lanes.BULK, "bulk@a", now - 3, ok=False, reason="RuntimeError: CUDA error")
    answered(client, lanes.BULK, "bulk@old", now - 600)  # an answer too old to count
    # vectors: a worker that has not answered within CANARY_MAX_AGE_S
    present(client, lanes.VECTORS, "vectors@a", now)
    answered(client, lanes.VECTORS, "vectors@a", now - 90)
    # fetch: nobody, and a worker whose presence went stale
    present(client, lanes.FETCH, "fetch@gone", now - 100)

    states = readiness.lane_states(now=now)
    assert states[lanes.INTERACTIVE]["ok"] and states[lanes.INTERACTIVE]["last_ok_s"] == 10
    assert states[lanes.INTERACTIVE]["workers"] == 2
    assert states[lanes.BULK]["code"] == readiness.LANE_CANARY_FAILED and "CUDA error" in states[lanes.BULK]["detail"]
    assert states[lanes.VECTORS]["code"] == readiness.LANE_CANARY_STALE
    assert states[lanes.FETCH]["code"] == readiness.LANE_NO_WORKER and states[lanes.FETCH]["workers"] == 0
    assert not client.hexists(lane_control.PRESENCE_KEY, f"{lanes.FETCH}|fetch@gone")  # stale entries go

    # a lane left out of READY_LANES with no worker is idle, not broken (the bulk lane at zero pods)
    client.delete(lane_control.PRESENCE_KEY)
    settings.READY_LANES = []
    states = readiness.lane_states(now=now)
    assert all(s["ok"] for s in states.values()), states


def test_readyz_names_the_lane_that_fails_then_passes_once_every_lane_answers(settings, health_keys, client):
    settings.READY_LANES = [lanes.INTERACTIVE, lanes.BULK, lanes.VECTORS]
    settings.VECTOR_STORE = "edge"
    r = client.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["ready"] is False and body["checks"]["database"]["ok"] and body["checks"]["redis"]["ok"]
    failed = {f["check"]: f["code"] for f in body["failed"]}
    assert failed == {"store": readiness.STORE_UNAVAILABLE, "lane:interactive": readiness.LANE_NO_WORKER,
                      "lane:bulk": readiness.LANE_NO_WORKER, "lane:vectors": readiness.LANE_NO_WORKER}
    assert body["checks"]["lanes"]["fetch"]["ok"]  # not required, no worker

    now = time.time()
    for lane in (lanes.INTERACTIVE, lanes.BULK, lanes.VECTORS):
        present(health_keys, lane, f"{lane}@a", now)
        answered(health_keys, lane, f"{lane}@a", now)
    answered(health_keys, lanes.BULK, "bulk@b", now, ok=False, reason="non_finite_embedding")
    r = client.get("/readyz")
    assert r.status_code == 200, r.json()
    assert r.json()["failed"] == [] and r.json()["checks"]["store"]["ok"]

    health_keys.hdel(lane_control.CANARY_KEY, "bulk|bulk@a")  # the working bulk worker is gone
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["failed"] == [{"check": "lane:bulk", "code": readiness.LANE_CANARY_FAILED,
                                   "detail": "no worker of the lane works: its last canary failed: "
                                             "non_finite_embedding"}]


def test_canaries_go_once_an_interval_to_required_and_served_lanes_only(settings, health_keys):
    settings.READY_LANES = [lanes.INTERACTIVE]
    settings.CANARY_INTERVAL_S = 30
    present(health_keys, lanes.FETCH, "fetch@a", time.time())
    readiness.readiness()
    readiness.readiness()  # within the interval: nothing more is sent

    depth = {q: sum(health_keys.llen(k) for k in lane_control.queue_keys(q)) for q in lanes.ALL_QUEUES}
    # the bulk lane (not required, no worker) gets none: a canary would wake a lane scaled to zero
    assert depth == {lanes.INTERACTIVE: 1, lanes.BULK: 0, lanes.VECTORS: 0, lanes.FETCH: 1}
    message = json.loads(health_keys.lindex(lane_control.queue_keys(lanes.INTERACTIVE)[0], 0))
    assert message["headers"]["task"] == "embeddings.tasks.canary" and message["headers"]["expires"]
    assert message["properties"]["priority"] == lanes.PRIORITY_INTERACTIVE


def test_a_vector_must_be_finite_and_of_unit_length():
    v = np.zeros(512, np.float32)
    v[0] = 1
    assert readiness.vector_fault(v) is None
    assert readiness.vector_fault(v * 0.5).startswith("vector_not_unit")
    assert readiness.vector_fault(v * 0) == "zero_embedding"
    v[1] = np.nan
    assert readiness.vector_fault(v) == "non_finite_embedding"


@pytest.mark.parametrize("lane", [lanes.INTERACTIVE, lanes.BULK, lanes.VECTORS, lanes.FETCH])
def test_a_worker_answers_the_canary_with_its_lane_path(service, health_keys, lane):
    answer = readiness.canary_answer(lane=lane, worker=f"{lane}@test", sent_at=time.time())
    assert answer["ok"], answer
    stored = json.loads(health_keys.hget(lane_control.CANARY_KEY, f"{lane}|{lane}@test"))
    assert stored == answer


def test_a_poisoned_model_fails_its_canary_and_its_worker_leaves_once(service, health_keys, monkeypatch, encoder):
    left: list[str] = []
    streak = worker_health.FailureStreak(limit=2, leave=left.append)
    monkeypatch.setattr(worker_health, "streak", lambda: streak)
    monkeypatch.setattr(encoder, "encode_images", lambda x: np.full((len(x), 512), np.nan, np.float32))
    answer = readiness.canary_answer(lane=lanes.BULK, worker="bulk@test", sent_at=time.time())
    assert not answer["ok"] and "non_finite_embedding" in answer["reason"]
    assert streak.failures == 1 and left == []
    # the interactive lane's picture goes through the dynamic batcher, which judges the pass (a failure);
    # the text tower still works, and its pass succeeds
    answer = readiness.canary_answer(lane=lanes.INTERACTIVE, worker="interactive@test", sent_at=time.time())
    assert not answer["ok"] and "non_finite_embedding" in answer["reason"], answer
    assert len(left) == 1 and "2 forward passes failed in a row" in left[0]
    assert streak.failures == 0
    for _ in range(3):
        readiness.canary_answer(lane=lanes.BULK, worker="bulk@test", sent_at=time.time())
    assert len(left) == 1  # it leaves once


def test_a_streak_counts_failures_in_a_row_only():
    left: list[str] = []
    streak = worker_health.FailureStreak(limit=3, leave=left.append)
    for _ in range(2):
        streak.failed("boom")
    streak.passed()
    assert [streak.failed("boom") for _ in range(3)] == [False, False, True] and len(left) == 1
    assert worker_health.FailureStreak(limit=0, leave=left.append).failed("x") is False  # 0: never


def test_outside_a_worker_leaving_only_logs(caplog):
    worker_health.leave_pool("a test")  # the test process is no Celery worker: it must not stop
    assert "not leaving (not a Celery worker): a test" in caplog.text
