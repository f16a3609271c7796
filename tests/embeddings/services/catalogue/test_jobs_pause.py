"""Pause, resume and cancel of bulk jobs through the real chunk task (eager Celery: every chunk runs
in this process through ``embeddings.tasks.embed_chunk`` → ``queues.bulk.chunk_embed``).

A paused job's chunks must not run while it is paused (they are parked) and must run after resume;
a cancelled job's queued chunks do nothing. Parking is how a chunk already in the broker waits:
under ``BULK_SCHEDULER=fifo`` every chunk is there, so the parking tests run with it (the fixture
``fifo``); under ``fair`` a paused job's chunks stay in the database
(``tests/embeddings/test_bulk_schedule.py``).
"""
from __future__ import annotations

import cv2
import numpy as np
import pytest
from django.db import transaction

from embeddings import runtime, tasks
from embeddings.models import BatchStat, Image, ImageStatus, Job, JobStatus
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.sources import SourceFile
from tests.embeddings.conftest import client_for

pytestmark = pytest.mark.django_db(transaction=True)

N_IMAGES, CHUNK = 5, 2  # three chunks


def jpeg_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (240, 240), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


def sources(seed0: int) -> list[SourceFile]:
    import io

    out = []
    for i in range(N_IMAGES):
        data = jpeg_bytes(seed0 + i)
        out.append(SourceFile(name=f"{seed0 + i}.jpg", size=len(data), open=lambda d=data: io.BytesIO(d)))
    return out


@pytest.fixture
def model_calls(service, monkeypatch):
    """Small chunks, and a record of every forward pass the real model makes."""
    service.PIPELINE = service.PIPELINE.replace(batch_size=CHUNK)
    encoder = runtime.encoder_holder().get()
    calls: list[int] = []
    real = encoder.encode_images
    monkeypatch.setattr(encoder, "encode_images", lambda px: calls.append(len(px)) or real(px))
    return calls


@pytest.fixture
def fifo(settings):
    """Every chunk sent when made (``BULK_SCHEDULER=fifo``): a paused job's chunks reach the worker
    and park."""
    settings.BULK_SCHEDULER = "fifo"


def create_then(user, to: str, seed0: int) -> Job:
    """Create a job and move it to ``to`` before its chunks are sent (they are sent on commit, and
    run at once: eager Celery), as when a job is paused while its chunks wait in the queue."""
    with transaction.atomic():
        job = job_services.job_create(owner=user, sources=sources(seed0), name="catalogue")
        job_services.job_transition(job=job, to=to)
    job.refresh_from_db()
    return job


def statuses(job: Job) -> dict[str, int]:
    return {k: v for k, v in job_services.job_counts(job).items() if v}


def test_paused_jobs_chunks_do_not_run_and_run_after_resume(fifo, model_calls, user):
    job = create_then(user, JobStatus.PAUSED, 10)
    # Every chunk reached the (eager) worker while paused: parked, nothing computed or written.
    assert job.status == JobStatus.PAUSED
    assert statuses(job) == {ImageStatus.QUEUED: N_IMAGES}
    assert set(Image.objects.filter(job=job).values_list("reason", flat=True)) == {job_services.PARKED}
    assert model_calls == [] and not BatchStat.objects.exists() and runtime.vector_store().count() == 0

    r = client_for(user).post(f"/api/jobs/{job.id}/resume/")
    assert r.status_code == 200
    job.refresh_from_db()
    assert job.status == JobStatus.DONE
    assert statuses(job) == {ImageStatus.EMBEDDED: N_IMAGES}
    assert set(Image.objects.filter(job=job).values_list("reason", flat=True)) == {""}
    assert model_calls == [CHUNK, CHUNK, N_IMAGES - 2 * CHUNK]  # each image computed once
    assert BatchStat.objects.filter(job=job).count() == 3 and runtime.vector_store().count() == N_IMAGES


def test_a_chunk_that_arrives_after_resume_simply_runs(fifo, model_calls, user):
    """Parking happens only while the job is paused: once resumed, a chunk still in the queue runs
    (and resume does not send it a second time)."""
    job = create_then(user, JobStatus.PAUSED, 20)
    ids = [str(i) for i in Image.objects.filter(job=job).values_list("id", flat=True)]
    assert job_services.job_chunk_park(job_id=job.id, image_ids=[])  # paused: it parks
    Image.objects.filter(job=job).update(reason="")  # as if these were still queued, never parked
    job_services.job_transition(job=job, to=JobStatus.QUEUED)
    assert model_calls == []  # nothing parked: resume sent nothing
    assert job_services.job_chunk_park(job_id=job.id, image_ids=ids) is False
    tasks.embed_chunk.apply(args=(str(job.id), ids))
    job.refresh_from_db()
    assert job.status == JobStatus.DONE and statuses(job) == {ImageStatus.EMBEDDED: N_IMAGES}
    assert model_calls == [N_IMAGES]


def test_cancelled_jobs_queued_chunks_do_nothing(model_calls, user):
    job = create_then(user, JobStatus.CANCELLED, 30)
    assert job.status == JobStatus.CANCELLED
    assert statuses(job) == {ImageStatus.CANCELLED: N_IMAGES}
    assert model_calls == [] and not BatchStat.objects.exists() and runtime.vector_store().count() == 0
    # A chunk delivered again later (redelivery) still does nothing; cancel is final.
    ids = [str(i) for i in Image.objects.filter(job=job).values_list("id", flat=True)]
    out = tasks.embed_chunk.apply(args=(str(job.id), ids)).get()
    assert out["embedded"] == 0 and model_calls == []
    r = client_for(user).post(f"/api/jobs/{job.id}/resume/")
    assert r.status_code == 409 and r.json()["code"] == "invalid_transition"


def test_cancel_a_paused_job_cancels_its_parked_images(model_calls, user):
    job = create_then(user, JobStatus.PAUSED, 40)
    r = client_for(user).post(f"/api/jobs/{job.id}/cancel/")
    assert r.status_code == 200 and r.json()["status"] == JobStatus.CANCELLED
    job.refresh_from_db()
    assert statuses(job) == {ImageStatus.CANCELLED: N_IMAGES} and model_calls == []
