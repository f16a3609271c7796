"""``embeddings/services/queues/vectors.py``: a chunk's points written slice by slice (images
decided meanwhile left out, a store that fails kept visible, a write that yields to interactive
work, a cancel between the write and the mark), searches by query image and by stored point, a
forgotten point, a collection's count.
"""
from __future__ import annotations

import time
import uuid

import pytest

from embeddings import runtime, tasks
from embeddings.models import BatchStat, EmbeddingSpace, Image, ImageStatus, Job, JobStatus, SpaceState
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.queues import bulk, interactive, store_writes, vectors
from project import lanes
from tests.embeddings.services.queues.conftest import interactive_rows, photos, queued_chunk, source, statuses
from tests.embeddings.conftest import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_chunk_write_leaves_out_images_decided_meanwhile(service, user, sent):
    job, chunk = queued_chunk(user, sent, photos(3, 40))
    bulk.chunk_embed(job_id=str(job.id), image_ids=chunk)
    ((job_id, stat_id, items), _, _), = sent.pop("embeddings.tasks.index_chunk")
    Image.objects.filter(id=chunk[0]).update(status=ImageStatus.CANCELLED, reason="cancelled")
    out = vectors.chunk_index(job_id=job_id, stat_id=stat_id, items=items, priority="background")
    assert (out["written"], out["yielded"]) == (3, 0)  # dealt with: two written, one left alone
    store = runtime.vector_store(job.model_id)
    assert store.count() == 2
    assert set(store.vectors([uuid.UUID(it["point_id"]) for it in items])) == {
        uuid.UUID(it["point_id"]) for it in items[1:]}
    assert statuses(chunk)[chunk[0]] == (ImageStatus.CANCELLED, "cancelled")


def test_a_query_image_embeds_as_its_upload_did_and_finds_it(service, user):
    space = runtime.model_id()
    data = jpeg_bytes(70, (64, 64))
    ids = interactive_rows(user, [source("a.jpg", data), *photos(2, 71)])
    vectors.interactive_index(embedded=interactive.interactive_embed(image_ids=ids, deadline_ts=time.time() + 30),
                               owner_id=user.id, k=0, skipped_ids=[])
    key, sha, _ = runtime.blob_store().put([data])
    query = interactive.query_embed(storage_key=key, sha256=sha, deadline_ts=time.time() + 30, model_id=space)
    found = vectors.vector_search(query=query, owner_id=user.id, k=3, job_id=None, model_id=space)["results"]
    assert found[0]["image_id"] == ids[0] and len(found) == 3
    assert found[0]["score"] == pytest.approx(1.0, abs=1e-4)
    refused = {"reason": "expired", "detail": "deadline passed"}
    assert vectors.vector_search(query=refused, owner_id=user.id, k=3, job_id=None, model_id=space) is refused
    by_point = vectors.point_search(point_id=str(Image.objects.get(id=ids[0]).point_id), owner_id=user.id, k=2,
                                     job_id=None, model_id=space)
    assert by_point[0]["image_id"] == ids[0] and len(by_point) == 2
    assert vectors.point_search(point_id=str(uuid.uuid4()), owner_id=user.id, k=2, job_id=None,
                                 model_id=space) is None


def test_a_forgotten_point_keeps_its_other_owners_then_goes_and_a_dropped_space_has_none(service, user, other_user):
    space = runtime.model_id()
    data = jpeg_bytes(80, (64, 64))
    mine = interactive_rows(user, [source("a.jpg", data)])
    theirs = interactive_rows(other_user, [source("b.jpg", data)])
    embedded = interactive.interactive_embed(image_ids=mine + theirs, deadline_ts=time.time() + 30)
    vectors.interactive_index(embedded=embedded, owner_id=None, k=0, skipped_ids=[])
    im = Image.objects.get(id=mine[0])
    store = runtime.vector_store(space)
    assert vectors.point_count(model_id=space) == {"collection": store.collection, "points": 1}

    Image.objects.filter(id=mine[0]).update(status=ImageStatus.FAILED)  # as if its row were gone
    assert vectors.point_forget(point_id=str(im.point_id), sha256=im.sha256, model_id=space) == "kept"
    assert store.payloads([im.point_id])[im.point_id]["owner_ids"] == [other_user.id]
    Image.objects.filter(id=theirs[0]).update(status=ImageStatus.FAILED)
    assert vectors.point_forget(point_id=str(im.point_id), sha256=im.sha256, model_id=space) == "deleted"
    assert vectors.point_count(model_id=space)["points"] == 0
    EmbeddingSpace.objects.filter(model_id=space).update(state=SpaceState.DROPPED)
    assert vectors.point_forget(point_id=str(im.point_id), sha256=im.sha256, model_id=space) == "dropped"


# --- chunk writes: a store that fails, a write that yields, a cancel meanwhile ------------------------

def embedded_chunk(user, sent_args, n=3):
    """A job whose one chunk is embedded; its ``index_chunk`` message captured, not run."""
    job = job_services.job_create(owner=user, sources=photos(n, 70))
    (job_id, chunk), = sent_args["embeddings.tasks.embed_chunk"]
    bulk.chunk_embed(job_id=job_id, image_ids=chunk)
    (args,) = sent_args["embeddings.tasks.index_chunk"]
    return job, args


def test_a_store_that_keeps_failing_leaves_images_queued_with_the_error(service, user, sent_args, monkeypatch):
    from qdrant_client.http.exceptions import (
        ResponseHandlingException,
        UnexpectedResponse,
    )

    job, args = embedded_chunk(user, sent_args)
    store = runtime.vector_store()
    for exc in (ResponseHandlingException(OSError("connect timeout")),
                UnexpectedResponse(503, "Service Unavailable", b"", {})):
        monkeypatch.setattr(store, "upsert", lambda points, exc=exc: (_ for _ in ()).throw(exc))
        with pytest.raises(store_writes.STORE_ERRORS):
            vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
        rows = set(Image.objects.filter(job=job).values_list("status", "reason"))
        assert rows == {("queued", "waiting_for_store")}
    assert "503" in Image.objects.filter(job=job).first().reason_detail
    monkeypatch.setattr(store, "upsert", lambda points: (_ for _ in ()).throw(
        UnexpectedResponse(400, "Bad Request", b"", {})))
    with pytest.raises(UnexpectedResponse):  # a client error is a bug, not an outage: not retried
        vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert store.count() == 0


def test_a_chunk_write_yields_to_waiting_interactive_work_and_its_rest_finishes_later(service, user, sent_args, monkeypatch):
    """Between slices the vectors worker looks at its queue; when interactive work waits, the rest of
    the chunk goes back to the queue at the job's bulk priority. Only written points are embedded."""
    from embeddings import lane_control

    service.VECTORS_WRITE_SLICE = 8
    job, args = embedded_chunk(user, sent_args, n=20)
    waiting = iter([1])  # one interactive message waits after the first slice, then none
    monkeypatch.setattr(lane_control, "vectors_interactive_waiting", lambda client=None: next(waiting, 0))
    rest: list = []
    monkeypatch.setattr(tasks.index_chunk, "apply_async", lambda args=(), kwargs=None, **kw: rest.append((args, kwargs, kw)))
    first = vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert (first["written"], first["yielded"]) == (8, 12)
    store = runtime.vector_store()
    assert store.count() == 8
    written = {it["id"] for it in args[2][:8]}
    rows = {str(i): (s, r) for i, s, r in Image.objects.filter(job=job).values_list("id", "status", "reason")}
    assert {rows[i] for i in written} == {("embedded", "")}
    assert {v for k, v in rows.items() if k not in written} == {("queued", "waiting_for_store")}
    (cargs, ckwargs, options), = rest
    assert cargs == (args[0], args[1], args[2][8:]) and ckwargs["priority"] == "background"
    assert options == {"queue": lanes.VECTORS, "priority": lanes.PRIORITY_BULK_BACKGROUND}
    assert Job.objects.get(id=job.id).status != JobStatus.DONE
    assert BatchStat.objects.get(id=args[1]).finished_at is None
    second = vectors.chunk_index(job_id=cargs[0], stat_id=cargs[1], items=cargs[2], **ckwargs)
    assert (second["written"], second["yielded"]) == (12, 0) and second["upsert_ms"] > ckwargs["upsert_ms"] > 0
    assert store.count() == 20
    assert Image.objects.filter(job=job, status=ImageStatus.EMBEDDED).count() == 20
    assert Job.objects.get(id=job.id).status == JobStatus.DONE
    stat = BatchStat.objects.get(id=args[1])
    assert stat.finished_at is not None and stat.upsert_ms == pytest.approx(second["upsert_ms"], abs=0.01)


def test_a_store_failure_mid_chunk_keeps_what_was_written_and_sends_the_rest_on(service, user, sent_args, monkeypatch):
    service.VECTORS_WRITE_SLICE = 4
    job, args = embedded_chunk(user, sent_args, n=10)
    store = runtime.vector_store()
    real_upsert, calls = store.upsert, []

    def fails_second_time(points):
        calls.append(len(points))
        if len(calls) == 2:
            raise ConnectionError("connection refused")
        return real_upsert(points)

    monkeypatch.setattr(store, "upsert", fails_second_time)
    rest: list = []
    monkeypatch.setattr(tasks.index_chunk, "apply_async", lambda args=(), kwargs=None, **kw: rest.append(args))
    out = vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert (out["written"], out["yielded"]) == (4, 6) and store.count() == 4
    assert rest == [(args[0], args[1], args[2][4:])]
    statuses = [Image.objects.get(id=it["id"]).status for it in args[2]]
    assert statuses == ["embedded"] * 4 + ["queued"] * 6
    assert {Image.objects.get(id=it["id"]).reason for it in args[2][4:]} == {"waiting_for_store"}


def test_a_job_cancelled_while_its_chunk_waits_to_be_written_stays_cancelled(service, user, sent_args):
    """Cancel while the chunk's vectors wait for the vectors worker: nothing is written, nothing is
    embedded afterwards, the job's counts keep saying cancelled."""
    job, args = embedded_chunk(user, sent_args, n=6)
    job_services.job_transition(job=Job.objects.get(id=job.id), to=JobStatus.CANCELLED)
    out = vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert (out["written"], out["yielded"]) == (6, 0)
    assert runtime.vector_store().count() == 0
    assert set(Image.objects.filter(job=job).values_list("status", flat=True)) == {ImageStatus.CANCELLED}
    job = Job.objects.get(id=job.id)
    assert job.status == JobStatus.CANCELLED
    assert job_services.job_progress(job)["counts"][ImageStatus.CANCELLED] == 6


def test_a_cancel_between_the_write_and_the_mark_takes_the_points_back(service, user, sent_args, monkeypatch):
    """The race: the points are written, then the job is cancelled before its images are marked
    (the part is marked once its slices are written: a cancel after the second of two slices). The
    images stay cancelled and their points are deleted again: Qdrant never holds a point that no
    embedded row accounts for."""
    service.VECTORS_WRITE_SLICE = 2
    job, args = embedded_chunk(user, sent_args, n=4)
    real_write, writes = store_writes._write_points, []

    def write_then_cancel(items, *payloads):
        ms = real_write(items, *payloads)
        writes.append(len(items))
        if len(writes) == 2:  # second slice: cancelled after its points were written
            job_services.job_transition(job=Job.objects.get(id=job.id), to=JobStatus.CANCELLED)
        return ms

    monkeypatch.setattr(store_writes, "_write_points", write_then_cancel)
    vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert writes == [2, 2]
    statuses = [Image.objects.get(id=it["id"]).status for it in args[2]]
    assert statuses == [ImageStatus.CANCELLED] * 4
    store = runtime.vector_store()
    assert store.count() == 0
    assert store.vectors([uuid.UUID(it["point_id"]) for it in args[2]]) == {}


def test_an_interactive_answer_leaves_before_its_payloads_are_settled(service, user, monkeypatch):
    """Inside a task, an upload's points are marked embedded and searched, and the payloads' settling
    (a read of the rows after the mark) waits until the task has answered (``deferred``), still
    before its message is acknowledged; outside a task it runs at once."""
    from embeddings import deferred

    settled: list[dict] = []
    settle = vectors.payloads_settle
    monkeypatch.setattr(vectors, "payloads_settle", lambda **kw: settled.append(kw["points"]) or settle(**kw))
    ids = interactive_rows(user, photos(2, 90))
    embedded = interactive.interactive_embed(image_ids=ids, deadline_ts=time.time() + 30)
    deferred.task_started()
    try:
        out = vectors.interactive_index(embedded=embedded, owner_id=user.id, k=1, skipped_ids=[])
        assert settled == [] and statuses(ids) == {i: (ImageStatus.EMBEDDED, "") for i in ids}
        assert [len(out[i]["neighbours"]) for i in ids] == [1, 1]  # each finds the other
    finally:
        deferred.task_ended()
    assert [set(points.values()) for points in settled] == [{it["point_id"] for it in embedded["items"]}]
