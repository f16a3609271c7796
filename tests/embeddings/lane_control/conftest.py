"""Fixtures for lane control's tests: a private Redis, the real model's batch records, a fresh
worker tracker; and the helpers that publish real Celery messages and make real JPEGs.

Real values throughout: the service time comes from the real ViT-B-32 (random weights) run through
the real dynamic batcher; the backlog is real Celery messages published to a private redis-server
at the lane's priorities and counted back from kombu's per-priority lists.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import time

import cv2
import numpy as np
import pytest

from embeddings.lane_control import admission, keys, reports
from scripts.stack import free_port, redis_answers


def jpeg_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (260, 200), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


def torch_pixels(encoder):
    import torch

    h, w = encoder.preprocess_config.size
    return torch.randint(0, 255, (4, 3, h, w), dtype=torch.uint8)


def publish(app, queue: str, priority: int, n: int = 1) -> None:
    for _ in range(n):
        app.send_task("embeddings.tasks.embed_interactive", args=([], 0.0), queue=queue, priority=priority)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A private, empty redis-server for this module (never the machine's shared one)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    p = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(tmp_path_factory.mktemp("redis"))], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if redis_answers(url):
            break
        time.sleep(0.05)
    yield url
    p.terminate()
    p.wait(timeout=10)


@pytest.fixture
def lane_redis(redis_url, settings):
    """``settings.REDIS_URL`` → the private Redis, emptied; a Celery app that publishes to it with the
    project's transport options (priority steps, queue order)."""
    from celery import Celery

    settings.REDIS_URL = redis_url
    client = keys.redis_client()
    client.flushdb()
    admission._wait_ahead_cache = {}  # a web process's learnt 429s belong to its Redis
    admission._wait_ahead_records = (-math.inf, ([], [], []))
    app = Celery("admission-test", broker=redis_url, set_as_current=False)
    app.conf.broker_transport_options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    yield client, app
    app.close()
    client.flushdb()
    admission._wait_ahead_cache = {}
    admission._wait_ahead_records = (-math.inf, ([], [], []))


@pytest.fixture(scope="session")
def measured(encoder):
    """Batch records of the real model behind the real dynamic batcher: 3 lone requests, then 4
    concurrent ones (merged into one pass). Read only: every test copies them."""
    from workers.batcher import DynamicBatcher
    from workers.preprocess import normalize

    b = DynamicBatcher(lambda px: encoder.encode_images(normalize(px, encoder.preprocess_config)),
                       max_batch_size=8, max_queue_delay_ms=50)
    px = torch_pixels(encoder)
    for _ in range(3):
        b.embed(px[:1])
    futs = [b.submit(px[i : i + 1]) for i in range(4)]
    for f in futs:
        f.result(timeout=60)
    b.close()
    return list(b.records)


@pytest.fixture
def tracker():
    """A fresh per-process tracker (finished tasks, last entry) for this test."""
    reports._tracker.cache_clear()
    yield reports._tracker()
    reports._tracker().heartbeat_stop.set()
    reports._tracker.cache_clear()
