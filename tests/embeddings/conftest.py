"""Fixtures for the Django app: isolated state folders, eager Celery, the session's model, API clients,
and the small JPEG images the tests upload.

Eager Celery runs every task in the test process, through the same chains and services the real
workers run (the end-to-end tests in tests/e2e use real worker processes instead).
"""
from __future__ import annotations

import contextlib
import time

import cv2
import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from embeddings import runtime


def clear_runtime():
    if runtime.vector_store.cache_info().currsize:
        runtime.vector_store().client.close()
    for f in (runtime.blob_store, runtime.encoder_holder, runtime.batch_runner, runtime.dynamic_batcher,
              runtime.vector_store, runtime.model_id):
        f.cache_clear()


@pytest.fixture
def service(settings, tmp_path, random_config, encoder):
    """The app wired to temp folders, random weights, and eager Celery."""
    import embeddings.tasks  # noqa: F401 - eager calls need the tasks registered; importing them
    # (qdrant-client, httpx: ~2 s cold) inside the first request would spend its 2 s deadline
    from project.celery import app

    settings.VAR_DIR = tmp_path
    settings.BLOB_ROOT = tmp_path / "blobs"
    settings.QDRANT_PATH = str(tmp_path / "qdrant")
    settings.QDRANT_URL = ""
    settings.PIPELINE = random_config.replace(interactive_max_queue_delay_ms=1.0)
    clear_runtime()
    runtime.encoder_holder()._encoder = encoder
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    yield settings
    app.conf.task_always_eager = False
    if runtime.dynamic_batcher.cache_info().currsize:
        runtime.dynamic_batcher().close()
    clear_runtime()


@pytest.fixture(scope="session")
def origin():
    """A real local HTTP server of image URLs that misbehave on purpose (``tests/origin_server.py``):
    catalogue manifests point at it; fetching it needs ``FETCH_ALLOW_NETWORKS`` = 127.0.0.1/32."""
    from tests.origin_server import OriginServer

    with OriginServer() as server:
        yield server


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice", password="pw")


@pytest.fixture
def other_user(django_user_model):
    return django_user_model.objects.create_user("bob", password="pw")


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("root", password="pw", is_staff=True, is_superuser=True)


def client_for(u) -> APIClient:
    from rest_framework.authtoken.models import Token

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=u)[0].key}")
    return c


@pytest.fixture
def api(user):
    return client_for(user)


def jpeg_bytes(seed: int, size=(200, 260)) -> bytes:
    """A smooth random JPEG of ``size`` (height, width) pixels, the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), size[::-1], interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


def upload(name: str, data: bytes) -> SimpleUploadedFile:
    """``data`` as an uploaded ``image/jpeg`` file named ``name``."""
    return SimpleUploadedFile(name, data, content_type="image/jpeg")


@contextlib.contextmanager
def celery_publishing_to(url: str):
    """The project's Celery app not eager and publishing to the broker at ``url`` while the block
    runs (nothing consumes it: the test reads what was sent), then eager on the broker it had.

    Both the connection pool (``app.close()``) and the producer pool (``app.amqp._producer_pool``,
    as Celery itself resets it after a fork) are dropped each way: a producer pool made for an
    earlier test's broker kept publishing there (a Redis already stopped)."""
    from project.celery import app

    def drop_pools():
        app.close()
        app.amqp._producer_pool = None

    original = app.conf.broker_url
    drop_pools()
    app.conf.broker_url, app.conf.task_always_eager = url, False
    try:
        yield app
    finally:
        app.conf.task_always_eager = True
        drop_pools()
        app.conf.broker_url = original
