"""Webhook events (issue 42, docs/webhooks.md): every event emitted once per subscribed endpoint,
whatever emits it twice, and delivered through failed attempts; unsubscribed and inactive
endpoints get nothing. The receiver of ``test_delivery.py`` verifies each message; real jobs and a
real model migration (two open_clip architectures with seeded random weights), eager Celery.
"""
from __future__ import annotations

import datetime as dt
import io

import pytest
from django.utils import timezone

from embeddings import dispatch, runtime, spaces
from embeddings.models import (
    Batch,
    DeliveryStatus,
    EmbeddingSpace,
    Job,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEvent,
)
from embeddings.services.batches import batches as batch_services
from embeddings.services.batches import files as batch_files
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.sources import SourceFile
from embeddings.services.lifecycle import cutoff, gate, model_migrations
from embeddings.services.webhooks import endpoints as webhook_endpoints
from tests.embeddings.conftest import client_for
from tests.embeddings.services.webhooks.test_delivery import drive, endpoint, receiver  # noqa: F401
from tests.embeddings.conftest import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)

S = "ViT-S-32/random-seed0/fp32"


def sources(*blobs: bytes) -> list[SourceFile]:
    return [SourceFile(name=f"{i}.jpg", size=len(b), open=lambda b=b: io.BytesIO(b)) for i, b in enumerate(blobs)]


@pytest.fixture
def migrating(service, settings, monkeypatch):
    """ViT-S-32 configured for migrations; the real quality gate on a 2-image sample (no cutoff
    calibration: it has its own tests)."""
    settings.CLIP_MODELS = ["ViT-S-32:random"]
    settings.SPACE_CACHE_S = 0.0
    settings.MIGRATION_GATE_SAMPLE = 2
    settings.MIGRATION_GATE_THRESHOLD = 0.0
    spaces.forget_cache()
    monkeypatch.setattr(cutoff, "calibrate_start", lambda space: None)
    # eager Celery would run the gate inside the migration's last chunk (a bulk turn inside a bulk
    # turn): the test starts it once the migration request has returned, as a worker would
    finished = []
    monkeypatch.setattr(model_migrations, "migration_job_done", lambda job: finished.append(job.id))
    yield finished
    spaces.forget_cache()


def test_each_event_is_delivered_once_after_failed_attempts(migrating, receiver,  # noqa: F811
                                                            staff, monkeypatch, random_config):
    from workers.model import ClipEncoder

    runtime.encoder_holder(S)._encoder = ClipEncoder(random_config.replace(model_name="ViT-S-32"))
    hook = endpoint(staff, receiver, "flaky")
    admin = client_for(staff)

    # job.done and job.failed: real jobs, run eagerly
    done = job_services.job_create(owner=staff, sources=sources(jpeg_bytes(1), jpeg_bytes(2)), name="good")
    failed = job_services.job_create(owner=staff, sources=sources(b"not an image"), name="bad")
    assert Job.objects.get(id=done.id).status == Job.objects.get(id=failed.id).status == "done"
    # job.at_risk, then job.cancelled: a job whose chunks are not sent (no worker takes them)
    with pytest.MonkeyPatch.context() as no_workers:
        no_workers.setattr(dispatch, "send_job_chunks", lambda **kw: 0)
        late = job_services.job_create(owner=staff, sources=sources(jpeg_bytes(3)), name="late",
                                       deadline=timezone.now() + dt.timedelta(seconds=1))
    # made 10 s ago and no row settled: under one row per 10 s, its row is due after the deadline
    Job.objects.filter(id=late.id).update(created_at=timezone.now() - dt.timedelta(seconds=10))
    assert job_services.jobs_at_risk_notify() == 1
    assert job_services.jobs_at_risk_notify() == 0  # once per job
    job_services.job_transition(job=late, to="cancelled")
    # a redelivered emitter makes no second message
    job_services.job_event_emit(job=Job.objects.get(id=done.id), event=None)

    # batch.completed, batch.failed (a file failing validation), batch.cancelled, batch.expired:
    # OpenAI batches of the same owner, run eagerly; the last two with parts no worker takes
    def batch_of(content: bytes):
        f = batch_files.file_upload(owner=staff, filename="in.jsonl", size=len(content), stream=io.BytesIO(content),
                                    purpose="batch")
        return batch_services.batch_create(owner=staff, input_file_id=f.id, endpoint="/v1/embeddings",
                                           completion_window="24h")

    request = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "ViT-B-32", ' \
              b'"input": "a cat"}}\n'
    batches = {"batch.completed": batch_of(request).id, "batch.failed": batch_of(b"not json\n").id}
    with pytest.MonkeyPatch.context() as no_workers:
        no_workers.setattr(dispatch, "send_batch_part", lambda **kw: None)
        batches["batch.cancelled"] = batch_of(request).id
        batches["batch.expired"] = batch_of(request).id
    batch_services.batch_cancel(batch=Batch.objects.get(id=batches["batch.cancelled"]))
    Batch.objects.filter(id=batches["batch.expired"]).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert batch_services.batches_expire() == 1
    assert {Batch.objects.get(id=b).status for b in batches.values()} == {"completed", "failed", "cancelled",
                                                                         "expired"}

    # the model lifecycle: migrate (its gate makes migration.ready), promote, roll back
    r = admin.post("/api/migrations/", {"model": "ViT-S-32", "pretrained": "random"}, format="json")
    assert r.status_code == 202, r.content
    url = r.json()["url"]
    assert migrating == [Job.objects.get(id=r.json()["job"]["id"]).id]
    space = EmbeddingSpace.objects.get(model_id=S)
    gate.gate_start(space.id)
    gate.gate_start(space.id)  # run again by hand: no second migration.ready
    r = admin.post(f"{url}promote/", {"force": True}, format="json")
    assert r.status_code == 200, r.content
    r = admin.post(f"{url}rollback/", {}, format="json")
    assert r.status_code == 200, r.content

    assert receiver.requests >= 3
    drive()
    events = sorted(p["type"] for _, _, p in receiver.accepted)
    assert events == sorted(WebhookEvent.values), events
    assert not receiver.duplicates and not receiver.rejected
    assert set(WebhookDelivery.objects.values_list("status", flat=True)) == {DeliveryStatus.DELIVERED}
    assert WebhookDelivery.objects.count() == len(WebhookEvent.values)
    assert WebhookAttempt.objects.filter(status_code=500).count() == 3
    assert WebhookAttempt.objects.filter(status_code=200).count() == len(WebhookEvent.values)

    by_type = {p["type"]: p for _, _, p in receiver.accepted}
    ok = by_type["job.done"]["data"]
    assert (ok["job_id"], ok["status"], ok["counts"]["total"], ok["counts"]["embedded"]) == (str(done.id), "done", 2, 2)
    bad = by_type["job.failed"]["data"]
    assert bad["failure"]["code"] == "no_image_embedded" and bad["counts"]["failed"] == 1
    assert sum(bad["failure_reasons"].values()) == 1
    assert by_type["job.at_risk"]["data"]["deadline"] is not None
    assert by_type["job.cancelled"]["data"]["status"] == "cancelled"
    assert by_type["migration.ready"]["data"]["model_id"] == S
    assert by_type["migration.promoted"]["data"]["state"] == "active"
    assert by_type["migration.rolled_back"]["data"]["previous_model_id"] == S
    for event, batch_id in batches.items():  # OpenAI's event object, as its client's webhooks.unwrap reads it
        p = by_type[event]
        assert set(p) == {"id", "object", "created_at", "type", "data"} and p["object"] == "event"
        assert p["id"].startswith("evt_") and isinstance(p["created_at"], int) and p["data"] == {"id": batch_id}
    for p in by_type.values():
        if not p["type"].startswith("batch."):
            assert dt.datetime.fromisoformat(p["timestamp"]).tzinfo is not None
    assert hook.deliveries.count() == len(WebhookEvent.values)


def test_unsubscribed_and_inactive_endpoints_get_nothing(service, receiver, user):  # noqa: F811
    only_failed = endpoint(user, receiver, "ok", events=["job.failed"])
    off = endpoint(user, receiver, "down")
    webhook_endpoints.endpoint_update(endpoint=off, active=False)
    job = job_services.job_create(owner=user, sources=sources(jpeg_bytes(4)))
    assert Job.objects.get(id=job.id).status == "done"
    assert not WebhookDelivery.objects.filter(endpoint__in=[only_failed, off]).exists()
