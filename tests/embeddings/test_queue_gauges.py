"""Queue depth and oldest-message age per lane and priority step (issue 11, item 7), read from a
private redis-server holding real Celery messages, and served on the web's ``/metrics``."""
from __future__ import annotations

import socket
import time
import uuid

import pytest

from embeddings.metrics import PUBLISHED_AT, QueueGauges
from project import lanes




def send(url: str, settings, messages: list[tuple[str, int]]) -> tuple[float, float]:
    """Send ``(queue, priority)`` messages through a real Celery app, in order; returns the clock
    just before the first and just after the last."""
    from celery import Celery

    app = Celery(broker=url, set_as_current=False)
    app.conf.broker_transport_options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    t0 = time.time()
    for queue, priority in messages:
        app.send_task("embeddings.tasks.embed_chunk", args=("job", [str(uuid.uuid4())]), queue=queue, priority=priority)
        time.sleep(0.01)
    t1 = time.time()
    app.close()
    return t0, t1


def test_depth_and_oldest_age_per_lane_and_priority_step(settings, private_redis):
    url, client = private_redis
    t0, t1 = send(url, settings, [(lanes.BULK, 9), (lanes.BULK, 9), (lanes.BULK, 6), (lanes.INTERACTIVE, 0),
                                  (lanes.BULK, 9)])
    now = t1 + 100.0
    rows = {(lane, step): (n, age) for lane, step, n, age in QueueGauges(client, clock=lambda: now).read()}
    assert len(rows) == len(lanes.ALL_QUEUES) * 4 == 16  # every lane (fetch too) at every priority step, empty ones
    assert rows[(lanes.BULK, 9)][0] == 3 and rows[(lanes.BULK, 6)][0] == 1
    assert rows[(lanes.INTERACTIVE, 0)][0] == 1
    assert sum(n for n, _ in rows.values()) == 5
    # the oldest bulk/9 message is the first one sent: its age is 100 s plus the sending time
    assert 100.0 <= rows[(lanes.BULK, 9)][1] <= now - t0
    assert rows[(lanes.BULK, 9)][1] > rows[(lanes.BULK, 6)][1] > rows[(lanes.INTERACTIVE, 0)][1] >= 100.0
    assert rows[(lanes.VECTORS, 0)] == (0, 0.0)
    # a worker takes two bulk messages: the priority-6 one first (step 6 before step 9), then the
    # oldest at step 9 (kombu BRPOPs the tail): the next step-9 message is the oldest now
    from kombu import Connection

    conn = Connection(url, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    try:
        for _ in range(2):
            msg = conn.default_channel.basic_get(queue=lanes.BULK, no_ack=True)
            assert PUBLISHED_AT in msg.headers
    finally:
        conn.release()
    after = {(lane, step): (n, age) for lane, step, n, age in QueueGauges(client, clock=lambda: now).read()}
    assert after[(lanes.BULK, 6)] == (0, 0.0)
    assert after[(lanes.BULK, 9)][0] == 2
    assert rows[(lanes.BULK, 9)][1] > after[(lanes.BULK, 9)][1] > rows[(lanes.BULK, 6)][1]


@pytest.mark.django_db
def test_metrics_endpoint_serves_the_queue_gauges_and_says_when_redis_is_down(settings, private_redis, client):
    from tests.embeddings.test_metrics import sample

    def up(text: str) -> float:
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("clip_broker_up ")))

    url, _ = private_redis
    send(url, settings, [(lanes.BULK, 9), (lanes.BULK, 9), (lanes.INTERACTIVE, 0)])
    settings.REDIS_URL = url  # the web's Redis client is cached per URL
    text = client.get("/metrics").content.decode()
    assert up(text) == 1
    assert sample(text, "clip_queue_messages", lane="bulk", priority="9") == 2
    assert sample(text, "clip_queue_messages", lane="interactive", priority="0") == 1
    assert sample(text, "clip_queue_oldest_age_seconds", lane="bulk", priority="9") > 0
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        settings.REDIS_URL = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    text = client.get("/metrics").content.decode()
    assert up(text) == 0
    assert "clip_queue_messages{" not in text
