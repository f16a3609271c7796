"""Lane control's Redis (embeddings/lane_control/keys.py): kombu's per-priority lists, the probe of
the vectors queue, and the key names the load benchmark's driver (no Django) names alike.

A private redis-server and real Celery messages (``conftest``).
"""
from __future__ import annotations

import json
import time

import pytest
from django.conf import settings

from embeddings.lane_control import keys
from project import lanes
from queueing import wait_ahead
from tests.embeddings.lane_control.conftest import publish

pytestmark = pytest.mark.django_db(transaction=True)


def test_every_priority_step_has_its_list_and_the_bare_name_comes_first(settings):
    """``queue_keys``: one list per priority step of the broker's transport options, step 0 the bare
    queue name, the others kombu's ``{queue}\\x06\\x16{step}``, each under the deployment's prefix
    (``"clip:"``, kombu's ``global_keyprefix``)."""
    assert keys.queue_keys("interactive") == ["clip:interactive", "clip:interactive\x06\x163",
                                              "clip:interactive\x06\x166", "clip:interactive\x06\x169"]
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {"priority_steps": [0, 5]}
    assert keys.queue_keys("bulk") == ["clip:bulk", "clip:bulk\x06\x165"]


def test_an_entry_is_stale_after_twice_the_deadline_and_a_bulk_mark_after_two_minutes_at_least(settings):
    settings.INTERACTIVE_DEADLINE_S = 2.0
    assert (keys.stale_after_s(), keys.bulk_stale_after_s()) == (34.0, 120.0)
    settings.INTERACTIVE_DEADLINE_S = 60.0
    assert (keys.stale_after_s(), keys.bulk_stale_after_s()) == (150.0, 150.0)


def test_vectors_worker_sees_only_interactive_messages_waiting_on_its_queue(lane_redis):
    """What a bulk chunk's write looks at between slices: step-0 messages of the ``vectors`` queue
    (searches, interactive writes), never bulk writes at 6/9 nor other lanes."""
    client, app = lane_redis
    assert keys.vectors_interactive_waiting() == 0
    for queue, priority, n in ((lanes.VECTORS, 9, 4), (lanes.VECTORS, 6, 2), (lanes.INTERACTIVE, 0, 3),
                               (lanes.VECTORS, 0, 2)):
        for _ in range(n):
            app.send_task("embeddings.tasks.index_chunk", args=("job", None, []), queue=queue, priority=priority)
    assert keys.vectors_interactive_waiting() == 2
    assert keys.vectors_interactive_waiting(client) == client.llen("clip:" + lanes.VECTORS) == 2


def test_the_load_benchmarks_depth_sampler_reads_the_lanes_as_lane_control_does(lane_redis):
    """``benchmarks.load.QueueSampler`` (which imports no Django) names the same Redis keys as
    lane control and counts every priority list: 3 + 2 interactive messages at two priorities, one
    interactive message on the vectors queue, 2 tasks in flight, 1 pending request, 1 running pass,
    1 bulk chunk computing."""
    from benchmarks import load
    from benchmarks.load import QueueSampler

    client, app = lane_redis
    assert (load.ANSWERS_KEY, load.BATCHES_KEY, load.REFUSALS_KEY) == (
        keys.ANSWERS_KEY, keys.BATCHES_KEY, keys.REFUSALS_KEY)
    assert load.WAIT_AHEAD_WINDOW_S == wait_ahead.FIT_WINDOW_S
    assert QueueSampler.lists(lanes.INTERACTIVE) == keys.queue_keys(lanes.INTERACTIVE)
    assert QueueSampler.lists(lanes.VECTORS)[0] == keys.queue_keys(lanes.VECTORS)[0] == "clip:vectors"
    assert QueueSampler.KEYS == {"inflight": keys.INFLIGHT_KEY, "pending": keys.PENDING_KEY,
                                 "passes": keys.PASSES_KEY, "bulk": keys.BULK_ACTIVITY_KEY}
    publish(app, lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE, n=3)
    publish(app, lanes.INTERACTIVE, lanes.PRIORITY_BULK_BACKGROUND, n=2)
    publish(app, lanes.VECTORS, lanes.PRIORITY_INTERACTIVE)
    client.hset(keys.INFLIGHT_KEY, mapping={"a": "1 1.0", "b": "1 1.0"})
    client.hset(keys.PENDING_KEY, "t", "{}")
    client.hset(keys.PASSES_KEY, "w", "1 1.0 300.0")
    client.hset(keys.BULK_ACTIVITY_KEY, "h:1:2", "1.0")
    sampler = QueueSampler(settings.REDIS_URL, every=0.01)
    sampler.start()
    deadline = time.time() + 10
    while len(sampler.samples) < 2 and time.time() < deadline:
        time.sleep(0.01)
    sampler.stop.set()
    sampler.join()
    last = sampler.samples[-1]
    assert {k: last[k] for k in ("queued", "inflight", "vectors", "pending", "passes", "bulk")} == {
        "queued": 5, "inflight": 2, "vectors": 1, "pending": 1, "passes": 1, "bulk": 1}
    client.rpush(keys.BATCHES_KEY, json.dumps({"t": 5.0, "size": 2}), json.dumps({"t": 9.0, "size": 3}))
    assert load.records_since(settings.REDIS_URL, load.BATCHES_KEY, "t", 6.0) == [{"t": 9.0, "size": 3}]
    # what a phase's first 429s learn from: the last minute's refusals and answers before it, none after
    client.rpush(keys.REFUSALS_KEY, *(json.dumps({"t": t, "wait_ahead_s": 1.0}) for t in (30.0, 50.0, 99.0, 100.0)))
    client.rpush(keys.ANSWERS_KEY, *(json.dumps({"admitted": t, "answered": t + 1}) for t in (39.0, 41.0, 99.5, 101.0)))
    before = load.records_before(settings.REDIS_URL, 100.0)
    assert [r["t"] for r in before["refusals"]] == [50.0, 99.0]
    assert [r["admitted"] for r in before["web_records"]] == [41.0, 99.5]



def test_the_vectors_probe_says_zero_when_redis_is_gone(settings):
    """A probe between slices of a bulk write: an unreachable Redis means carry on (0), never an error."""
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens
    assert keys.vectors_interactive_waiting() == 0
