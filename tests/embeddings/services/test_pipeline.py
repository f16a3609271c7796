"""``embeddings/services/pipeline.py``: what the workers' tasks call, on the session's random-weights
ViT-B-32, an embedded Qdrant and eager Celery. Where a service sends work on (a bulk chunk's points
to the vectors worker), the message is captured and read, and the next step is called by hand.
"""
from __future__ import annotations

import io
import time
import uuid

import numpy as np
import pytest

from embeddings import runtime, tasks
from embeddings.messages import decode_vector
from embeddings.models import (
    BatchStat,
    EmbeddingSpace,
    Image,
    ImageStatus,
    Job,
    JobStatus,
    Lane,
    SpaceState,
)
from embeddings.services import pipeline
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.sources import SourceFile
from project import lanes
from tests.embeddings.conftest import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)

#: Passes the upload's content check (JPEG magic bytes), fails the worker's decode.
BROKEN_JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 40
DIM = 512  # ViT-B-32's embedding width


def source(name: str, data: bytes) -> SourceFile:
    return SourceFile(name=name, size=len(data), open=lambda: io.BytesIO(data))


def photos(n: int, seed: int) -> list[SourceFile]:
    return [source(f"{seed + i}.jpg", jpeg_bytes(seed + i, (64, 64))) for i in range(n)]


@pytest.fixture
def sent(monkeypatch):
    """Bulk messages captured instead of run: ``{task name: [(args, kwargs, options), ...]}``."""
    out: dict[str, list] = {}
    for task in (tasks.embed_chunk, tasks.index_chunk):
        monkeypatch.setattr(task, "apply_async", lambda args=(), kwargs=None, task=task, **options:
                            out.setdefault(task.name, []).append((args, kwargs, options)))
    return out


def queued_chunk(user, sent, sources: list[SourceFile]) -> tuple[Job, list[str]]:
    """A bulk job of ``sources`` whose one chunk is queued (its message captured, not run)."""
    job = job_services.job_create(owner=user, sources=sources)
    ((job_id, chunk), _, _), = sent.pop("embeddings.tasks.embed_chunk")
    assert job_id == str(job.id)
    return job, chunk


def statuses(ids) -> dict[str, tuple[str, str]]:
    return {str(i): (s, r) for i, s, r in Image.objects.filter(id__in=ids).values_list("id", "status", "reason")}


# --- bulk lane -----------------------------------------------------------------------------------

def test_a_chunk_of_a_missing_or_cancelled_job_computes_nothing(service, user, sent):
    gone = pipeline.chunk_embed(job_id=str(uuid.uuid4()), image_ids=["a", "b"])
    assert gone == {"embedded": 0, "failed": 0, "skipped": 2, "stat_id": None}
    job, chunk = queued_chunk(user, sent, photos(3, 10))
    Job.objects.filter(id=job.id).update(status=JobStatus.CANCELLED)
    out = pipeline.chunk_embed(job_id=str(job.id), image_ids=chunk)
    assert out == {"embedded": 0, "failed": 0, "skipped": 3, "stat_id": None}
    assert set(statuses(chunk).values()) == {(ImageStatus.CANCELLED, "cancelled")}
    assert sent == {} and BatchStat.objects.count() == 0


def test_a_chunk_hands_its_vectors_to_the_vectors_worker_which_marks_them_embedded(service, user, sent):
    job, chunk = queued_chunk(user, sent, [*photos(3, 20), source("broken.jpg", BROKEN_JPEG)])
    out = pipeline.chunk_embed(job_id=str(job.id), image_ids=chunk)
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
    assert [got[i] for i in chunk[:3]] == [(ImageStatus.QUEUED, pipeline.WAITING_FOR_STORE)] * 3
    assert got[chunk[3]][0] == ImageStatus.FAILED and got[chunk[3]][1] in ("corrupt", "truncated")
    assert set(Image.objects.filter(id__in=chunk).values_list("attempts", flat=True)) == {1}

    written = pipeline.chunk_index(job_id=job_id, stat_id=stat_id, items=items, priority="background")
    assert (written["written"], written["yielded"]) == (3, 0) and written["upsert_ms"] > 0
    assert [statuses(chunk)[i] for i in chunk[:3]] == [(ImageStatus.EMBEDDED, "")] * 3
    assert runtime.vector_store(job.model_id).count() == 3
    stat.refresh_from_db()
    assert stat.finished_at is not None and stat.upsert_ms == pytest.approx(written["upsert_ms"], abs=0.01)
    assert Job.objects.get(id=job.id).status == JobStatus.DONE

    # delivered again (a worker died after the write): nothing left to compute or send
    again = pipeline.chunk_embed(job_id=str(job.id), image_ids=chunk)
    assert again == {"embedded": 0, "failed": 0, "skipped": 4, "stat_id": None} and sent == {}


def test_images_delivered_too_often_fail_and_the_rest_of_the_chunk_is_computed(service, user, sent):
    service.BULK_MAX_ATTEMPTS = 2
    job, chunk = queued_chunk(user, sent, photos(3, 30))
    Image.objects.filter(id=chunk[1]).update(attempts=2)
    out = pipeline.chunk_embed(job_id=str(job.id), image_ids=chunk)
    assert (out["embedded"], out["failed"], out["skipped"]) == (2, 0, 1)
    poisoned = Image.objects.get(id=chunk[1])
    assert (poisoned.status, poisoned.reason, poisoned.reason_detail) == (
        ImageStatus.FAILED, "attempts_exhausted", "delivered 2 times without finishing")
    ((_, _, items), _, _), = sent.pop("embeddings.tasks.index_chunk")
    assert [it["id"] for it in items] == [chunk[0], chunk[2]]


def test_a_chunk_write_leaves_out_images_decided_meanwhile(service, user, sent):
    job, chunk = queued_chunk(user, sent, photos(3, 40))
    pipeline.chunk_embed(job_id=str(job.id), image_ids=chunk)
    ((job_id, stat_id, items), _, _), = sent.pop("embeddings.tasks.index_chunk")
    Image.objects.filter(id=chunk[0]).update(status=ImageStatus.CANCELLED, reason="cancelled")
    out = pipeline.chunk_index(job_id=job_id, stat_id=stat_id, items=items, priority="background")
    assert (out["written"], out["yielded"]) == (3, 0)  # dealt with: two written, one left alone
    store = runtime.vector_store(job.model_id)
    assert store.count() == 2
    assert set(store.vectors([uuid.UUID(it["point_id"]) for it in items])) == {
        uuid.UUID(it["point_id"]) for it in items[1:]}
    assert statuses(chunk)[chunk[0]] == (ImageStatus.CANCELLED, "cancelled")


# --- interactive lane ----------------------------------------------------------------------------

def interactive_rows(user, sources: list[SourceFile]) -> list[str]:
    rows = image_services.images_create(owner=user, lane=Lane.INTERACTIVE, sources=sources)
    return [str(im.id) for im in rows]


def test_an_interactive_request_past_its_deadline_is_not_computed(service, user):
    ids = interactive_rows(user, photos(2, 50))
    out = pipeline.interactive_embed(image_ids=ids, deadline_ts=time.time() - 1)
    assert out == {"items": [], "failed": [[i, "expired", "deadline passed before the model ran"] for i in ids],
                   "timings": {}}


def test_an_interactive_request_is_embedded_written_and_answered_with_neighbours(service, user):
    ids = interactive_rows(user, [*photos(2, 60), source("broken.jpg", BROKEN_JPEG)])
    embedded = pipeline.interactive_embed(image_ids=ids, deadline_ts=time.time() + 30)
    assert [it["id"] for it in embedded["items"]] == ids[:2]
    assert {it["model_id"] for it in embedded["items"]} == {runtime.model_id()}
    assert [f[0] for f in embedded["failed"]] == [ids[2]] and embedded["failed"][0][1] in ("corrupt", "truncated")
    assert {"decode", "preprocess", "embed", "total"} <= set(embedded["timings"])

    out = pipeline.interactive_index(embedded=embedded, owner_id=user.id, k=5, skipped_ids=[])
    assert set(out) == set(ids)
    assert [n["image_id"] for n in out[ids[0]]["neighbours"]] == [ids[1]]  # never itself
    assert [n["image_id"] for n in out[ids[1]]["neighbours"]] == [ids[0]]
    assert out[ids[2]] == {"reason": embedded["failed"][0][1], "detail": embedded["failed"][0][2], "neighbours": []}
    assert [statuses(ids)[i][0] for i in ids] == [ImageStatus.EMBEDDED, ImageStatus.EMBEDDED, ImageStatus.FAILED]
    stat = BatchStat.objects.get(lane=Lane.INTERACTIVE)
    assert (stat.job_id, stat.images, stat.failed) == (None, 3, 1) and stat.finished_at is not None

    # a copy of stored bytes: no model run, its neighbours from the stored vector (not itself)
    copy, = interactive_rows(user, [photos(1, 60)[0]])
    assert Image.objects.get(id=copy).status == ImageStatus.SKIPPED
    answered = pipeline.interactive_index(embedded={}, owner_id=user.id, k=5, skipped_ids=[copy])
    assert [n["image_id"] for n in answered[copy]["neighbours"]] == [ids[1]]
    assert pipeline.interactive_index(embedded={}, owner_id=user.id, k=0, skipped_ids=[copy]) == {
        copy: {"neighbours": []}}


# --- queries -------------------------------------------------------------------------------------

def test_a_query_image_embeds_as_its_upload_did_and_finds_it(service, user):
    space = runtime.model_id()
    data = jpeg_bytes(70, (64, 64))
    ids = interactive_rows(user, [source("a.jpg", data), *photos(2, 71)])
    pipeline.interactive_index(embedded=pipeline.interactive_embed(image_ids=ids, deadline_ts=time.time() + 30),
                               owner_id=user.id, k=0, skipped_ids=[])
    key, sha, _ = runtime.blob_store().put([data])
    query = pipeline.query_embed(storage_key=key, sha256=sha, deadline_ts=time.time() + 30, model_id=space)
    found = pipeline.vector_search(query=query, owner_id=user.id, k=3, job_id=None, model_id=space)["results"]
    assert found[0]["image_id"] == ids[0] and len(found) == 3
    assert found[0]["score"] == pytest.approx(1.0, abs=1e-4)
    refused = {"reason": "expired", "detail": "deadline passed"}
    assert pipeline.vector_search(query=refused, owner_id=user.id, k=3, job_id=None, model_id=space) is refused
    by_point = pipeline.point_search(point_id=str(Image.objects.get(id=ids[0]).point_id), owner_id=user.id, k=2,
                                     job_id=None, model_id=space)
    assert by_point[0]["image_id"] == ids[0] and len(by_point) == 2
    assert pipeline.point_search(point_id=str(uuid.uuid4()), owner_id=user.id, k=2, job_id=None,
                                 model_id=space) is None


def test_queries_refuse_a_passed_deadline_an_unknown_space_and_bytes_that_are_no_image(service):
    space = runtime.model_id()
    text = pipeline.text_embed(text="a dog", deadline_ts=time.time() + 30, model_id=space)
    vector = decode_vector(text["vector"])
    assert vector.shape == (DIM,) and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    late = pipeline.text_embed(text="a dog", deadline_ts=time.time() - 2, model_id=space)
    assert late["reason"] == "expired" and late["detail"].startswith("deadline passed 2.")
    unknown = pipeline.text_embed(text="a dog", deadline_ts=time.time() + 30, model_id="ViT-L-14/openai/fp32")
    assert unknown["reason"] == "model_not_configured" and "vector" not in unknown
    key, sha, _ = runtime.blob_store().put([b"%PDF-1.7 not an image"])
    refused = pipeline.query_embed(storage_key=key, sha256=sha, deadline_ts=time.time() + 30, model_id=space)
    assert refused["reason"] == "not_an_image" and "vector" not in refused


# --- deletions and counts ------------------------------------------------------------------------

def test_a_forgotten_point_keeps_its_other_owners_then_goes_and_a_dropped_space_has_none(service, user, other_user):
    space = runtime.model_id()
    data = jpeg_bytes(80, (64, 64))
    mine = interactive_rows(user, [source("a.jpg", data)])
    theirs = interactive_rows(other_user, [source("b.jpg", data)])
    embedded = pipeline.interactive_embed(image_ids=mine + theirs, deadline_ts=time.time() + 30)
    pipeline.interactive_index(embedded=embedded, owner_id=None, k=0, skipped_ids=[])
    im = Image.objects.get(id=mine[0])
    store = runtime.vector_store(space)
    assert pipeline.point_count(model_id=space) == {"collection": store.collection, "points": 1}

    Image.objects.filter(id=mine[0]).update(status=ImageStatus.FAILED)  # as if its row were gone
    assert pipeline.point_forget(point_id=str(im.point_id), sha256=im.sha256, model_id=space) == "kept"
    assert store.payloads([im.point_id])[im.point_id]["owner_ids"] == [other_user.id]
    Image.objects.filter(id=theirs[0]).update(status=ImageStatus.FAILED)
    assert pipeline.point_forget(point_id=str(im.point_id), sha256=im.sha256, model_id=space) == "deleted"
    assert pipeline.point_count(model_id=space)["points"] == 0
    EmbeddingSpace.objects.filter(model_id=space).update(state=SpaceState.DROPPED)
    assert pipeline.point_forget(point_id=str(im.point_id), sha256=im.sha256, model_id=space) == "dropped"
