"""Admission control on the interactive lane (embeddings/services/admission.py), and deadlines.

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
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings import runtime
from embeddings.models import Image, ImageStatus, Job
from embeddings.services import admission
from project import lanes
from scripts.stack import free_port, redis_answers

pytestmark = pytest.mark.django_db(transaction=True)


def jpeg_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (260, 200), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


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
    client = admission.redis_client()
    client.flushdb()
    app = Celery("admission-test", broker=redis_url, set_as_current=False)
    app.conf.broker_transport_options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    yield client, app
    app.close()
    client.flushdb()


@pytest.fixture(scope="module")
def measured(encoder):
    """Batch records of the real model behind the real dynamic batcher: 3 lone requests, then 4
    concurrent ones (merged into one pass)."""
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


def torch_pixels(encoder):
    import torch

    h, w = encoder.preprocess_config.size
    return torch.randint(0, 255, (4, 3, h, w), dtype=torch.uint8)


def publish(app, queue: str, priority: int, n: int = 1) -> None:
    for _ in range(n):
        app.send_task("embeddings.tasks.embed_interactive", args=([], 0.0), queue=queue, priority=priority)


# --- the prediction -------------------------------------------------------------------------------

def test_window_stats_from_the_real_model(measured):
    stats = admission.window_stats(measured)
    assert stats["batches"] == len([r for r in measured if r.size]) >= 2
    assert stats["ms_per_image"] == pytest.approx(sum(r.service_ms for r in measured) / sum(r.size for r in measured))
    assert stats["images_per_request"] == pytest.approx(1.0)  # every request here had one image
    assert max(r.size for r in measured) > 1  # the concurrent requests shared a pass
    assert stats["ms_per_image"] > 0


def test_decide_refuses_exactly_when_the_predicted_wait_exceeds_the_deadline(measured):
    ms = admission.window_stats(measured)["ms_per_image"]
    deadline = 2.0
    fits = math.floor(deadline * 1000 / ms)  # images that drain within the deadline
    ok = admission.decide(admission.LaneLoad(queued_messages=fits, inflight_images=0, ms_per_image=ms),
                          deadline_s=deadline)
    assert ok.admitted and ok.predicted_wait_s <= deadline
    over = admission.LaneLoad(queued_messages=fits, inflight_images=3, ms_per_image=ms)
    refused = admission.decide(over, deadline_s=deadline)
    assert not refused.admitted
    assert refused.predicted_wait_s == pytest.approx((fits + 3) * ms / 1000)
    assert refused.retry_after_s == max(1, math.ceil(refused.predicted_wait_s - deadline))
    # Requests of several images weigh more; unknown service time admits (nothing to predict with).
    heavy = admission.LaneLoad(queued_messages=fits, inflight_images=0, ms_per_image=ms, images_per_request=2.0)
    assert not admission.decide(heavy, deadline_s=deadline).admitted
    assert admission.decide(admission.LaneLoad(10_000, 0, None), deadline_s=deadline).admitted


# --- what Redis holds -----------------------------------------------------------------------------

def test_backlog_is_counted_across_kombus_priority_lists(lane_redis):
    client, app = lane_redis
    for priority in (0, 3, 6, 9):
        publish(app, lanes.INTERACTIVE, priority, n=2)
    publish(app, lanes.BULK, 9, n=5)  # another lane: not interactive backlog
    keys = admission.queue_keys(lanes.INTERACTIVE)
    assert keys[0] == lanes.INTERACTIVE and all(k.startswith(lanes.INTERACTIVE + "\x06\x16") for k in keys[1:])
    assert {k for k in client.keys(lanes.INTERACTIVE + "*")} == set(keys)  # what kombu really wrote
    load = admission.interactive_load()
    assert (load.queued_messages, load.inflight_images, load.ms_per_image) == (8, 0, None)


def test_vectors_worker_sees_only_interactive_messages_waiting_on_its_queue(lane_redis):
    """What a bulk chunk's write looks at between slices: step-0 messages of the ``vectors`` queue
    (searches, interactive writes), never bulk writes at 6/9 nor other lanes."""
    client, app = lane_redis
    assert admission.vectors_interactive_waiting() == 0
    for queue, priority, n in ((lanes.VECTORS, 9, 4), (lanes.VECTORS, 6, 2), (lanes.INTERACTIVE, 0, 3),
                               (lanes.VECTORS, 0, 2)):
        for _ in range(n):
            app.send_task("embeddings.tasks.index_chunk", args=("job", None, []), queue=queue, priority=priority)
    assert admission.vectors_interactive_waiting() == 2
    assert admission.vectors_interactive_waiting(client) == client.llen(lanes.VECTORS) == 2


def test_worker_reports_service_time_and_in_flight_work(lane_redis, measured):
    client, _ = lane_redis
    assert admission.interactive_report(measured) == len(measured)
    assert admission.interactive_report(measured) == 0  # nothing new: nothing sent twice
    stats = admission.window_stats(measured)
    load = admission.interactive_load()
    assert load.ms_per_image == pytest.approx(stats["ms_per_image"])
    assert load.images_per_request == pytest.approx(stats["images_per_request"])
    records = admission.batch_records()
    assert [r["size"] for r in records] == [r.size for r in measured]
    assert {"t", "size", "requests", "queue_delay_ms", "service_ms", "expired"} <= set(records[0])
    with admission.interactive_in_flight("task-a", 5), admission.interactive_in_flight("task-b", 2):
        assert admission.interactive_load().inflight_images == 7
    assert admission.interactive_load().inflight_images == 0
    # A task whose worker died long ago no longer counts, and is cleaned away.
    client.hset(admission.INFLIGHT_KEY, "dead-task", f"16 {time.time() - 3600:.3f}")
    assert admission.interactive_load().inflight_images == 0
    assert not client.hexists(admission.INFLIGHT_KEY, "dead-task")


# --- the API --------------------------------------------------------------------------------------

@pytest.fixture
def overloaded(service, lane_redis, measured):
    """A real, non-eager setting: measured service time in Redis and more queued interactive work
    than drains within the deadline. No worker consumes the private Redis."""
    from project.celery import app

    _, publisher = lane_redis
    admission.interactive_report(measured)
    ms = admission.window_stats(measured)["ms_per_image"]
    longest = max(service.INTERACTIVE_DEADLINE_S, service.VECTORS_CALL_TIMEOUT_S)  # uploads, searches
    backlog = math.ceil(2 * longest * 1000 / ms)  # ≈ 2 of the longest deadlines of work
    publish(publisher, lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE, n=backlog)
    original = app.conf.broker_url
    app.close()  # drops the connection pools, so the next publish uses the private Redis
    app.conf.broker_url = service.REDIS_URL
    app.conf.task_always_eager = False
    yield backlog * ms / 1000
    app.conf.task_always_eager = True
    app.close()
    app.conf.broker_url = original


def test_upload_answers_429_with_retry_after_and_stores_nothing(overloaded, api, service):
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("a.jpg", jpeg_bytes(1), content_type="image/jpeg")]},
                 format="multipart")
    assert r.status_code == 429, r.content
    body = r.json()
    assert set(body) == {"message", "code", "extra"} and body["code"] == "overloaded"
    wait = body["extra"]["predicted_wait_s"]
    assert wait == pytest.approx(overloaded, rel=0.01) and wait > service.INTERACTIVE_DEADLINE_S
    assert int(r["Retry-After"]) == body["extra"]["retry_after_s"] == math.ceil(wait - service.INTERACTIVE_DEADLINE_S)
    assert Image.objects.count() == 0  # refused before anything was stored or queued
    # A text query on the same lane is refused too; a longer deadline is never granted.
    r = api.post("/api/search/", {"text": "a cat", "k": 3}, format="json")
    assert r.status_code == 429 and r.json()["code"] == "overloaded" and "Retry-After" in r


def test_bulk_is_never_refused(overloaded, api):
    r = api.post("/api/jobs/", {"files": [SimpleUploadedFile("b.jpg", jpeg_bytes(2), content_type="image/jpeg")]},
                 format="multipart")
    assert r.status_code == 202
    assert Job.objects.get(id=r.json()["id"]).total == 1


def test_admission_can_be_switched_off(overloaded, service):
    service.ADMISSION_CONTROL = False
    assert admission.interactive_admit(deadline_s=0.5).admitted


# --- deadlines ------------------------------------------------------------------------------------

def test_an_expired_request_is_never_computed_through_the_task_path(service, api, monkeypatch):
    """The whole chain (upload → embed_interactive → index_interactive) with a deadline that has
    passed before the embed task runs: the model is never called and the image ends ``expired``."""
    encoder = runtime.encoder_holder().get()
    calls = []
    real = encoder.encode_images
    monkeypatch.setattr(encoder, "encode_images", lambda px: calls.append(len(px)) or real(px))
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("late.jpg", jpeg_bytes(3), content_type="image/jpeg")],
                                  "deadline": 0.000001}, format="multipart")
    assert r.status_code == 200, r.content
    im = r.json()["images"][0]
    assert (im["status"], im["reason"]) == (ImageStatus.EXPIRED, "expired")
    assert calls == []
    assert Image.objects.get(id=im["id"]).status == ImageStatus.EXPIRED
    assert runtime.vector_store().count() == 0
    # The same path with a live deadline does compute (the spy is on the real call path).
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("ok.jpg", jpeg_bytes(4), content_type="image/jpeg")]},
                 format="multipart")
    assert r.json()["images"][0]["status"] == ImageStatus.EMBEDDED and calls == [1]
