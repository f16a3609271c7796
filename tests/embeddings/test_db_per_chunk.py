"""Database work per chunk is independent of the job's size (issue 11, item 4).

A real chunk (real JPEGs, the real random-weights model, embedded Qdrant) runs through
``chunk_embed`` and ``chunk_index`` inside a job padded with synthetic rows; the number of SQL
statements must be the same for a 100-image job as for a 2,000-image one. ``images_mark_embedded``
(now one UPDATE per slice) is checked against a per-row recount after random mixes of statuses.
"""
from __future__ import annotations

import hashlib
import io
import random
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from embeddings import runtime, tasks
from embeddings.models import Image, ImageStatus, Job, JobStatus, Lane
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.queues import bulk, vectors
from embeddings.services.duplicates import scan as duplicate_scans
from embeddings.services.catalogue.sources import SourceFile
from tests.embeddings.conftest import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sent(monkeypatch):
    """Messages the code under test sends, captured instead of run: ``{task name: [args, ...]}``."""
    out: dict[str, list] = {}
    for task in (tasks.embed_chunk, tasks.index_chunk):
        monkeypatch.setattr(task, "apply_async", lambda args=(), task=task, **kw: out.setdefault(task.name, []).append(args))
    return out


def sources(n: int, seed: int) -> list[SourceFile]:
    out = []
    for i in range(n):
        data = jpeg_bytes(seed + i, (64, 64))
        out.append(SourceFile(name=f"{seed + i}.jpg", size=len(data), open=lambda d=data: io.BytesIO(d)))
    return out


def pad(job: Job, n: int, *, seed: int) -> None:
    """Add ``n`` synthetic rows to ``job``: half embedded, half queued (a job half-way through)."""
    rows = []
    for i in range(n):
        sha = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()
        rows.append(Image(owner_id=job.owner_id, job=job, lane=Lane.BULK, sha256=sha, size_bytes=1000,
                          storage_key=f"blob/{sha}", model_id=job.model_id, point_id=uuid.uuid4(),
                          status=ImageStatus.EMBEDDED if i % 2 else ImageStatus.QUEUED))
    Image.objects.bulk_create(rows, batch_size=500)
    Job.objects.filter(id=job.id).update(total=job.total + n)


def chunk_queries(user, sent, *, padding: int, seed: int) -> tuple[list[str], list[str]]:
    """SQL statements of one 4-image chunk's embed and index in a job padded to ``padding`` rows."""
    sent.clear()
    job = job_services.job_create(owner=user, sources=sources(4, seed))
    pad(job, padding, seed=seed)
    (job_id, chunk), = sent["embeddings.tasks.embed_chunk"]
    with CaptureQueriesContext(connection) as embed:
        out = bulk.chunk_embed(job_id=job_id, image_ids=chunk)
    assert out["embedded"] == 4
    (args,) = sent["embeddings.tasks.index_chunk"]
    # "any finished duplicate scan in this space?" is asked once per process every few seconds,
    # not per chunk: asked afresh here, so that both chunks measured ask it once
    duplicate_scans._scans_seen.clear()
    with CaptureQueriesContext(connection) as index:
        out = vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert out["written"] == 4
    assert sum('"EMBEDDINGS_DUPLICATESCAN"' in q["sql"].upper() for q in index.captured_queries) == 1
    assert Image.objects.filter(id__in=chunk, status=ImageStatus.EMBEDDED).count() == 4
    assert Job.objects.get(id=job.id).status == JobStatus.RUNNING  # the padding's queued half remains
    return [q["sql"] for q in embed.captured_queries], [q["sql"] for q in index.captured_queries]


def test_a_chunk_makes_the_same_queries_in_a_100_image_job_as_in_a_2000_image_job(service, user, sent):
    small_embed, small_index = chunk_queries(user, sent, padding=100, seed=1000)
    big_embed, big_index = chunk_queries(user, sent, padding=2000, seed=5000)
    assert len(small_embed) == len(big_embed)
    assert len(small_index) == len(big_index)
    # no statement counts the job's images (the old per-chunk job_refresh did)
    assert not [q for q in small_index + small_embed if "COUNT(" in q.upper()]
    # one UPDATE marks the slice's 4 images embedded (it was one per image, plus one per image's copies)
    marks = [q for q in big_index if q.upper().startswith("UPDATE") and "'embedded'" in q]
    assert len(marks) == 1


@pytest.mark.parametrize("slice_size", [1, 2, 4])
def test_a_chunk_reads_its_images_once_and_marks_them_with_two_updates_whatever_its_slices(
        service, user, sent, monkeypatch, slice_size):
    """Issues 10, 43 and 53: per chunk part one SELECT of the images (still queued? payloads), per
    slice one store call and one look at the vectors queue between slices, two UPDATEs for the whole
    part (its rows, RETURNING the ones marked; their skipped copies), then one SELECT of the marked
    images' payloads (settled against what was written: a PATCH racing the write); the same
    statements whatever the slice size; no ``SELECT ... FOR UPDATE``, no per-slice read or write."""
    from embeddings import lane_control

    service.VECTORS_WRITE_SLICE = slice_size
    looks: list[int] = []
    upserts: list[int] = []
    monkeypatch.setattr(lane_control, "vectors_interactive_waiting", lambda client=None: looks.append(1) or 0)
    job = job_services.job_create(owner=user, sources=sources(4, 7000 + slice_size))
    (job_id, chunk), = sent["embeddings.tasks.embed_chunk"]
    bulk.chunk_embed(job_id=job_id, image_ids=chunk)
    (args,) = sent["embeddings.tasks.index_chunk"]
    store = runtime.vector_store(args[2][0]["model_id"])
    upsert = store.upsert
    monkeypatch.setattr(store, "upsert", lambda points: upserts.append(len(points)) or upsert(points))
    with CaptureQueriesContext(connection) as q:
        out = vectors.chunk_index(job_id=args[0], stat_id=args[1], items=args[2], priority="background")
    assert (out["written"], out["yielded"], len(looks)) == (4, 0, 4 // slice_size - 1)
    assert upserts == [slice_size] * (4 // slice_size)
    sql = [x["sql"].upper() for x in q.captured_queries]
    image_reads = [x for x in sql if x.startswith("SELECT") and 'FROM "EMBEDDINGS_IMAGE"' in x and "SELECT 1 AS" not in x]
    assert len(image_reads) == 2 and "FOR UPDATE" not in " ".join(sql)
    marks = [x for x in sql if x.startswith('UPDATE "EMBEDDINGS_IMAGE"')]
    assert len(marks) == 2 and sum("RETURNING" in x for x in marks) == 1
    assert Image.objects.filter(job=job, status=ImageStatus.EMBEDDED).count() == 4


def test_job_refresh_finishes_a_job_with_an_indexed_exists_whatever_its_size(service, user, sent):
    job = job_services.job_create(owner=user, sources=sources(2, 9000))
    pad(job, 3000, seed=9000)
    with CaptureQueriesContext(connection) as q:
        assert job_services.job_refresh(job_id=job.id).status == JobStatus.RUNNING
    assert len(q.captured_queries) == 4  # read the job, EXISTS, mark running, read it back
    assert "COUNT(" not in " ".join(x["sql"].upper() for x in q.captured_queries)
    Image.objects.filter(job=job, status=ImageStatus.QUEUED).update(status=ImageStatus.EMBEDDED)
    with CaptureQueriesContext(connection) as q:
        assert job_services.job_refresh(job_id=job.id).status == JobStatus.DONE
    assert len(q.captured_queries) == 5  # read, EXISTS, its webhook endpoints (none), mark done, read it back
    progress = job_services.job_progress(Job.objects.get(id=job.id))
    assert (progress["total"], progress["embedded"], progress["finished"]) == (3002, 3002, 3002)
    with CaptureQueriesContext(connection) as q:  # a finished job is left alone: one read
        job_services.job_refresh(job_id=job.id)
    assert len(q.captured_queries) == 1


@pytest.mark.parametrize("returning", [True, False], ids=["update-returning", "select-for-update"])
def test_bulk_mark_embedded_equals_a_per_row_recount_after_random_mixes(service, user, returning, monkeypatch):
    """Both ways of marking (``UPDATE ... RETURNING``; a read ``FOR UPDATE`` first where the database
    has no ``RETURNING``) mark exactly the rows still queued, with their facts and their copies'."""
    monkeypatch.setattr(type(connection.features), "can_return_columns_from_insert", returning)
    rng = random.Random(11)
    job = Job.objects.create(owner=user, model_id="m", chunk_size=64)
    statuses = [ImageStatus.QUEUED, ImageStatus.QUEUED, ImageStatus.EMBEDDED, ImageStatus.FAILED,
                ImageStatus.CANCELLED, ImageStatus.EXPIRED]
    for round_ in range(5):
        rows = []
        for i in range(40):
            sha = hashlib.sha256(f"r{round_}-{i}".encode()).hexdigest()
            rows.append(Image(owner=user, job=job, lane=Lane.BULK, sha256=sha, size_bytes=1, storage_key="k",
                              model_id="m", point_id=uuid.uuid4(), status=rng.choice(statuses), width=1, height=1,
                              format="old"))
        Image.objects.bulk_create(rows)
        copies = []  # skipped copies of some queued originals
        for im in rng.sample([r for r in rows if r.status == ImageStatus.QUEUED], 3):
            copies.append(Image(owner=user, job=job, lane=Lane.BULK, sha256=im.sha256, size_bytes=1, storage_key="k",
                                model_id="m", point_id=im.point_id, status=ImageStatus.SKIPPED, duplicate_of=im))
        Image.objects.bulk_create(copies)
        chosen = rng.sample(rows, 25)
        items = [{"id": str(r.id), "width": 10 + k, "height": 20 + k, "format": f"f{k}"} for k, r in enumerate(chosen)]
        want = {str(r.id) for r in chosen if r.status == ImageStatus.QUEUED}
        assert image_services.images_mark_embedded(items) == want
        facts = {it["id"]: it for it in items}
        for r in Image.objects.filter(id__in=[x.id for x in rows]):
            before = next(x for x in rows if x.id == r.id)
            if str(r.id) in want:
                f = facts[str(r.id)]
                assert (r.status, r.width, r.height, r.format) == ("embedded", f["width"], f["height"], f["format"])
                assert r.embedded_at is not None
            else:
                assert (r.status, r.width, r.format) == (before.status, 1, "old")
        for c in Image.objects.filter(id__in=[x.id for x in copies]):
            if str(c.duplicate_of_id) in want:
                f = facts[str(c.duplicate_of_id)]
                assert (c.status, c.width, c.height, c.format) == ("skipped", f["width"], f["height"], f["format"])
            else:
                assert (c.width, c.format) == (None, "")
        assert image_services.images_mark_embedded(items) == set()  # a second write marks nothing
