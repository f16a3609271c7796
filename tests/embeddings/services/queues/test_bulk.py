"""``embeddings/services/queues/bulk.py``: a bulk chunk embedded and handed to the vectors worker,
left alone when its job is gone or cancelled, its poison images failed, redelivered without a
second point (``tests/embeddings/services/queues/conftest.py`` says how the messages are caught).
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from embeddings import runtime
from embeddings.messages import decode_vector
from embeddings.models import BatchStat, Image, ImageStatus, Job, JobStatus, Lane
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.queues import bulk, store_writes, vectors
from embeddings.services.reconcile import ATTEMPTS_EXHAUSTED
from project import lanes
from tests.embeddings.services.queues.conftest import BROKEN_JPEG, DIM, photos, queued_chunk, source, statuses

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_chunk_of_a_missing_or_cancelled_job_computes_nothing(service, user, sent):
    gone = bulk.chunk_embed(job_id=str(uuid.uuid4()), image_ids=["a", "b"])
    assert gone == {"embedded": 0, "failed": 0, "skipped": 2, "stat_id": None}
    job, chunk = queued_chunk(user, sent, photos(3, 10))
    Job.objects.filter(id=job.id).update(status=JobStatus.CANCELLED)
    out = bulk.chunk_embed(job_id=str(job.id), image_ids=chunk)
    assert out == {"embedded": 0, "failed": 0, "skipped": 3, "stat_id": None}
    assert set(statuses(chunk).values()) == {(ImageStatus.CANCELLED, "cancelled")}
    assert sent == {} and BatchStat.objects.count() == 0


def test_a_chunk_hands_its_vectors_to_the_vectors_worker_which_marks_them_embedded(service, user, sent):
    job, chunk = queued_chunk(user, sent, [*photos(3, 20), source("broken.jpg", BROKEN_JPEG)])
    out = bulk.chunk_embed(job_id=str(job.id), image_ids=chunk)
    assert (out["embedded"], out["failed"], out["skipped"]) == (3, 1, 0)
    stat = BatchStat.objects.get(id=out["stat_id"])
    assert (stat.lane, stat.images, stat.failed, stat.finished_at) == (Lane.BULK, 4, 1, None)

    ((job_id, stat_id, items), kwargs, options), = sent.pop("embeddings.tasks.index_chunk")
    assert (job_id, stat_id, kwargs) == (str(job.id), stat.id, {"priority": "background"})
    assert options == {"queue": lanes.VECTORS, "priority": lanes.PRIORITY_BULK_BACKGROUND}
    assert [it["id"] for it in items] == chunk[:3]  # in the chunk's order, the broken one left out
    rows = {str(im.id): im for im in Image.objects.filter(id__in=chunk)}
    for it in items:
        assert it["point_id"] == str(rows[it["id"]].point_id) and it["sha256"] == rows[it["id"]].sha256
        assert (it["width"], it["height"], it["model_id"]) == (64, 64, job.model_id)
        vector = decode_vector(it["vector"])
        assert vector.shape == (DIM,) and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    # computed, not written yet: still queued, and saying why
    got = statuses(chunk)
    assert [got[i] for i in chunk[:3]] == [(ImageStatus.QUEUED, store_writes.WAITING_FOR_STORE)] * 3
    assert got[chunk[3]][0] == ImageStatus.FAILED and got[chunk[3]][1] in ("corrupt", "truncated")
    assert set(Image.objects.filter(id__in=chunk).values_list("attempts", flat=True)) == {1}

    written = vectors.chunk_index(job_id=job_id, stat_id=stat_id, items=items, priority="background")
    assert (written["written"], written["yielded"]) == (3, 0) and written["upsert_ms"] > 0
    assert [statuses(chunk)[i] for i in chunk[:3]] == [(ImageStatus.EMBEDDED, "")] * 3
    assert runtime.vector_store(job.model_id).count() == 3
    stat.refresh_from_db()
    assert stat.finished_at is not None and stat.upsert_ms == pytest.approx(written["upsert_ms"], abs=0.01)
    assert Job.objects.get(id=job.id).status == JobStatus.DONE

    # delivered again (a worker died after the write): nothing left to compute or send
    again = bulk.chunk_embed(job_id=str(job.id), image_ids=chunk)
    assert again == {"embedded": 0, "failed": 0, "skipped": 4, "stat_id": None} and sent == {}


def test_images_delivered_too_often_fail_and_the_rest_of_the_chunk_is_computed(service, user, sent):
    service.BULK_MAX_ATTEMPTS = 2
    job, chunk = queued_chunk(user, sent, photos(3, 30))
    Image.objects.filter(id=chunk[1]).update(attempts=2)
    out = bulk.chunk_embed(job_id=str(job.id), image_ids=chunk)
    assert (out["embedded"], out["failed"], out["skipped"]) == (2, 0, 1)
    poisoned = Image.objects.get(id=chunk[1])
    assert (poisoned.status, poisoned.reason, poisoned.reason_detail) == (
        ImageStatus.FAILED, "attempts_exhausted", "delivered 2 times without finishing")
    ((_, _, items), _, _), = sent.pop("embeddings.tasks.index_chunk")
    assert [it["id"] for it in items] == [chunk[0], chunk[2]]


# --- redelivery: idempotent -----------------------------------------------------------------------

def test_a_chunk_delivered_twice_before_its_points_are_written_writes_each_point_once(service, user, sent_args):
    """What Redis does when a chunk outlives the visibility timeout: a second delivery runs while the
    first one's vectors still wait to be written. Both embed, both write; one point per image."""
    job = job_services.job_create(owner=user, sources=photos(4, 90))
    (job_id, chunk), = sent_args["embeddings.tasks.embed_chunk"]
    bulk.chunk_embed(job_id=job_id, image_ids=chunk)
    bulk.chunk_embed(job_id=job_id, image_ids=chunk)  # redelivered while the first is unwritten
    writes = sent_args["embeddings.tasks.index_chunk"]
    assert len(writes) == 2
    for args in writes:
        vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert runtime.vector_store().count() == 4
    assert Image.objects.filter(job=job, status=ImageStatus.EMBEDDED).count() == 4
    assert BatchStat.objects.filter(job=job).count() == 2
    assert Job.objects.get(id=job.id).status == JobStatus.DONE
    # A third delivery after the writes finds nothing queued and does nothing.
    assert bulk.chunk_embed(job_id=job_id, image_ids=chunk)["skipped"] == 4
    assert len(sent_args["embeddings.tasks.index_chunk"]) == 2


def test_a_poison_chunk_stops_after_max_attempts(service, user, sent_args, settings):
    job_services.job_create(owner=user, sources=photos(3, 110))
    (job_id, chunk), = sent_args["embeddings.tasks.embed_chunk"]
    Image.objects.filter(id=chunk[0]).update(attempts=settings.BULK_MAX_ATTEMPTS)
    out = bulk.chunk_embed(job_id=job_id, image_ids=chunk)
    assert out["embedded"] == 2
    im = Image.objects.get(id=chunk[0])
    assert (im.status, im.reason) == ("failed", ATTEMPTS_EXHAUSTED)
    Image.objects.filter(id__in=chunk).update(status=ImageStatus.QUEUED, attempts=settings.BULK_MAX_ATTEMPTS)
    assert bulk.chunk_embed(job_id=job_id, image_ids=chunk)["failed"] == 3  # all exhausted: nothing to run
    assert Image.objects.filter(id__in=chunk, reason=ATTEMPTS_EXHAUSTED).count() == 3
