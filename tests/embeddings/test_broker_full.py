"""A broker's Redis at its memory limit under ``noeviction`` (the policy Celery's docs ask for)
refuses every publish: the API answers 503 ``broker_full`` with ``Retry-After`` and leaves nothing
half-written (``sink.broker_refusal``, ``services.interactive.upload``, ``services.catalogue.jobs``); a broker
that may evict keys is reported at start-up (``embeddings.checks``). A real redis-server of the
test's own, filled until it refuses writes."""
from __future__ import annotations

import base64
import logging

import pytest
import redis

from embeddings.models import Image
from tests.conftest import redis_server
from tests.embeddings.conftest import celery_publishing_to, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)

OOM = "command not allowed when used memory > 'maxmemory'"


def fill(client) -> int:
    """Write 10 kB values until Redis refuses one; the number written."""
    n = 0
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        while n < 10_000:
            client.set(f"fill:{n}", b"x" * 10_000)
            n += 1
    return n


@pytest.fixture
def full_broker(service, tmp_path):
    """``(url, client)`` of a 2 MB ``noeviction`` Redis already full, which the project's Celery app
    publishes to (not eager) and lane control reads; admission control off (not the subject here)."""
    with redis_server(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as (url, client):
        assert fill(client) > 0
        service.REDIS_URL, service.ADMISSION_CONTROL = url, False
        with celery_publishing_to(url):
            yield url, client


def queued_messages(client) -> int:
    return sum(client.llen(k) for k in client.keys("*") if client.type(k) == b"list")


def test_an_upload_the_broker_refuses_is_a_503_broker_full_and_its_images_end_expired(full_broker, api, user):
    _, client = full_broker
    r = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1)), upload("b.jpg", jpeg_bytes(2)),
                                            upload("a-again.jpg", jpeg_bytes(1))]}, format="multipart")
    assert r.status_code == 503, r.content
    assert r.json() == {"message": "the message broker is full (Redis is at its maxmemory and refuses writes): "
                                   "nothing was queued", "code": "broker_full", "extra": {}}
    assert r["Retry-After"] == "5"
    rows = sorted(Image.objects.filter(owner=user).values_list("original_name", "status", "reason"))
    # nothing stays queued: the two originals expired now, the copy (same request) with its original
    assert rows == [("a-again.jpg", "expired", "expired"), ("a.jpg", "expired", "expired"),
                    ("b.jpg", "expired", "expired")]
    assert Image.objects.get(owner=user, original_name="a.jpg").reason_detail.startswith("not queued: the message "
                                                                                         "broker is full")
    assert queued_messages(client) == 0


def test_a_search_and_an_embeddings_request_the_broker_refuses_are_503_broker_full(full_broker, api, service):
    r = api.post("/api/search/", {"text": "a cat", "k": 3}, format="json")
    assert (r.status_code, r.json()["code"], r["Retry-After"]) == (503, "broker_full", "5")
    r = api.post("/api/search/", {"image": upload("q.jpg", jpeg_bytes(3)), "k": 2}, format="multipart")
    assert (r.status_code, r.json()["code"], r["Retry-After"]) == (503, "broker_full", "5")
    r = api.post("/api/embeddings/", {"inputs": [{"text": "a cat"}, {"image": "data:image/jpeg;base64,"
                                                  + base64.b64encode(jpeg_bytes(4)).decode()}]}, format="json")
    assert (r.status_code, r.json()["code"], r["Retry-After"]) == (503, "broker_full", "5"), r.content
    r = api.post("/v1/embeddings", {"model": "ViT-B-32", "input": "a cat"}, format="json")  # OpenAI's shape
    assert (r.status_code, r.json()["error"]["code"], r["Retry-After"]) == (503, "broker_full", "5")
    # the query image's temporary blob went with the request
    assert [p for p in (service.BLOB_ROOT).rglob("*") if p.is_file()] == []


def test_a_job_the_broker_refuses_is_accepted_and_left_queued_for_the_reconciler(full_broker, api, user, caplog):
    _, client = full_broker
    with caplog.at_level(logging.WARNING, logger="embeddings.services.catalogue.jobs"):
            r = api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(10 + i)) for i in range(3)]},
                     format="multipart")
    assert r.status_code == 202, r.content
    assert r.json()["total"] == 3
    (refused,) = [r.getMessage() for r in caplog.records if r.name == "embeddings.services.catalogue.jobs"]
    assert "3 images not queued now" in refused and OOM in refused
    # committed and queued: what the reconciler sends again once older than RECONCILE_GRACE_S
    assert list(Image.objects.filter(owner=user).values_list("status", flat=True)) == ["queued"] * 3
    assert queued_messages(client) == 0


def test_a_broker_that_may_evict_keys_is_a_warning_at_start_up(service, tmp_path, caplog):
    from django.core import checks as django_checks

    from embeddings import checks

    with redis_server(tmp_path) as (url, client):
        service.CELERY_BROKER_URL = url
        assert checks.broker_eviction_warning() is None  # no maxmemory: nothing is ever evicted
        client.config_set("maxmemory", "2mb")
        assert checks.broker_eviction_warning() is None  # noeviction (the default): writes refused instead
        client.config_set("maxmemory-policy", "allkeys-lru")
        warning = checks.broker_eviction_warning()
        assert warning == ("the broker's Redis evicts keys at its memory limit (maxmemory 2097152 bytes, "
                           "maxmemory-policy allkeys-lru): when it fills, queued messages, results and lane "
                           "state are dropped without a word")
        found = [m for m in django_checks.run_checks() if m.id == "embeddings.W003"]
        assert [(m.level, m.msg) for m in found] == [(django_checks.WARNING, warning)]
        with caplog.at_level(logging.WARNING, logger="embeddings.checks"):
            checks.warn_evicting_broker()
        assert [r.getMessage() for r in caplog.records] == [
            f"{warning}; set maxmemory-policy noeviction (docs/operations.md)"]
    assert checks.broker_eviction_warning() is None  # Redis gone: silent (its outage is reported where used)
