"""Services: image creation (dedupe, refusals by content), payloads from the database, job state."""
from __future__ import annotations

import io
import uuid

import numpy as np
import pytest

from embeddings.messages import decode_vector, encode_vector
from embeddings.models import Image, ImageStatus, Job, JobStatus, Lane
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import payloads as payload_reads
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.sources import SourceFile

pytestmark = pytest.mark.django_db


def src(name: str, data: bytes) -> SourceFile:
    return SourceFile(name=name, size=len(data), open=lambda: io.BytesIO(data))


PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
JPG = b"\xff\xd8\xff\xe0" + b"\x00" * 40


def test_images_create_dedupes_per_owner_and_refuses_by_content(service, user, other_user):
    rows = image_services.images_create(owner=user, lane=Lane.BULK, sources=[
        src("a.png", PNG), src("again.png", PNG), src("empty.jpg", b""), src("doc.jpg", b"%PDF-1.7"), src("b.jpg", JPG)])
    assert [r.status for r in rows] == ["queued", "skipped", "failed", "failed", "queued"]
    assert [r.reason for r in rows] == ["", "", "empty", "not_an_image", ""]
    assert rows[1].duplicate_of_id == rows[0].id and rows[1].point_id == rows[0].point_id
    later = image_services.images_create(owner=user, lane=Lane.INTERACTIVE, sources=[src("c.png", PNG)])
    assert later[0].status == "skipped" and later[0].duplicate_of_id == rows[0].id
    theirs = image_services.images_create(owner=other_user, lane=Lane.INTERACTIVE, sources=[src("c.png", PNG)])
    assert theirs[0].status == "queued" and theirs[0].point_id == rows[0].point_id  # same point, own row


def test_too_large_is_refused_without_queuing(service, user):
    service.PIPELINE = service.PIPELINE.replace(max_image_bytes=10)
    rows = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("big.png", PNG)])
    assert (rows[0].status, rows[0].reason) == ("failed", "too_large")


def test_point_payloads_list_every_owner_and_job(service, user, other_user):
    job = Job.objects.create(owner=user, model_id="m")
    a = image_services.images_create(owner=user, lane=Lane.BULK, job=job, sources=[src("a.png", PNG)])[0]
    b = image_services.images_create(owner=other_user, lane=Lane.INTERACTIVE, sources=[src("a.png", PNG)])[0]
    Image.objects.filter(id=a.id).update(status=ImageStatus.EMBEDDED)
    p = payload_reads.point_payloads(model_id=a.model_id, shas=[a.sha256])[a.sha256]
    assert p == {"sha256": a.sha256, "owner_ids": [user.id], "job_ids": [str(job.id)],
                 "items": [{"image": str(a.id), "owner": user.id, "job": str(job.id), "m": {}}]}
    p = payload_reads.point_payloads(model_id=a.model_id, shas=[a.sha256], including=[str(b.id)])[a.sha256]
    assert p["owner_ids"] == sorted([user.id, other_user.id])
    # one item per image the point stands for, each with its owner's id and metadata (issue 41)
    Image.objects.filter(id=b.id).update(external_id="B-1", metadata={"category": "shoes"})
    p = payload_reads.point_payloads(model_id=a.model_id, shas=[a.sha256], including=[str(b.id)])[a.sha256]
    assert sorted(p["items"], key=lambda it: it["owner"]) == [
        {"image": str(a.id), "owner": user.id, "job": str(job.id), "m": {}},
        {"image": str(b.id), "owner": other_user.id, "external_id": "B-1", "m": {"category": "shoes"}}]


def test_one_read_tells_which_images_to_write_and_their_payloads(service, user, other_user):
    """``point_payloads(queued=...)``, the vectors worker's one read per chunk: rows of ``including``
    count while queued (their ids returned) or embedded; one cancelled meanwhile counts for nothing."""
    third = type(user).objects.create(username="third")
    job = Job.objects.create(owner=user, model_id="m")
    shared = image_services.images_create(owner=user, lane=Lane.BULK, job=job, sources=[src("a.png", PNG)])[0]
    theirs = image_services.images_create(owner=other_user, lane=Lane.BULK, sources=[src("a.png", PNG)])[0]
    cancelled = image_services.images_create(owner=third, lane=Lane.BULK, sources=[src("a.png", PNG)])[0]
    alone = image_services.images_create(owner=user, lane=Lane.BULK, job=job, sources=[src("b.jpg", JPG)])[0]
    Image.objects.filter(id=theirs.id).update(status=ImageStatus.EMBEDDED)  # another delivery wrote it
    Image.objects.filter(id=cancelled.id).update(status=ImageStatus.CANCELLED)
    rows = [shared, theirs, cancelled, alone]
    queued: set[str] = set()
    p = payload_reads.point_payloads(model_id=shared.model_id, shas={r.sha256 for r in rows},
                                      including=[str(r.id) for r in rows], point_ids={str(r.point_id) for r in rows},
                                      queued=queued)
    assert queued == {str(shared.id), str(alone.id)}
    assert {k: v for k, v in p[shared.sha256].items() if k != "items"} == {
        "sha256": shared.sha256, "owner_ids": sorted([user.id, other_user.id]), "job_ids": [str(job.id)]}
    assert sorted(it["image"] for it in p[shared.sha256]["items"]) == sorted([str(shared.id), str(theirs.id)])
    assert p[alone.sha256] == {"sha256": alone.sha256, "owner_ids": [user.id], "job_ids": [str(job.id)],
                               "items": [{"image": str(alone.id), "owner": user.id, "job": str(job.id), "m": {}}]}


def test_the_postgresql_payload_read_is_the_python_loop_s(service, user, other_user):
    """On PostgreSQL ``point_payloads`` builds the payloads as JSON in the server
    (``payloads._point_payloads_json``): the same payloads and queued ids as the row-by-row loop, for
    shared bytes, copies in another space (their user row's job, id and metadata), empty and falsy
    metadata, rows of ``including`` queued, embedded or decided, with and without point ids."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the JSON read is PostgreSQL's (DATABASE_URL=postgres://...)")
    third = type(user).objects.create(username="third")
    job, copies_job = Job.objects.create(owner=user, model_id="m"), Job.objects.create(owner=user, model_id="copies")

    def row(owner, sha, status, *, model_id="m", job=None, source=None, ext="", metadata=None):
        return Image.objects.create(owner=owner, lane=Lane.BULK, status=status, sha256=sha, size_bytes=1,
                                    storage_key=sha, model_id=model_id, point_id=uuid.uuid5(uuid.NAMESPACE_URL, sha + model_id),
                                    job=job, source=source, external_id=ext,
                                    metadata={} if metadata is None else metadata)

    shared, alone, odd = "a" * 64, "b" * 64, "c" * 64
    a = row(user, shared, ImageStatus.EMBEDDED, job=job, ext="A-1",
            metadata={"cat": "shoes", "price": 10.5, "n": {"x": [1, 2, "\u00fc"], "none": None}, "big": 10**18})
    b = row(other_user, shared, ImageStatus.EMBEDDED, metadata={"cat": 'quo"te\\'})
    c = row(third, shared, ImageStatus.QUEUED, job=job, metadata=False)
    d = row(user, alone, ImageStatus.QUEUED, job=job, metadata=[])
    e = row(third, odd, ImageStatus.CANCELLED, metadata={"k": 1})
    f = row(user, odd, ImageStatus.QUEUED, metadata=0)
    row(user, alone, ImageStatus.EMBEDDED, model_id="elsewhere")
    copies = [row(user, shared, ImageStatus.EMBEDDED, model_id="copies", job=copies_job, source=a),
              row(other_user, shared, ImageStatus.QUEUED, model_id="copies", job=copies_job, source=b),
              row(user, alone, ImageStatus.EMBEDDED, model_id="copies", source=d)]
    rows, ids = [a, b, c, d, e, f], [str(r.id) for r in (a, b, c, d, e, f, *copies)]
    calls = [dict(model_id=m, shas=[shared, alone, odd, "d" * 64], including=inc, point_ids=pids)
             for m in ("m", "copies") for inc in ([], ids[2:]) for pids in (None, [str(r.point_id) for r in rows])]
    calls.append(dict(model_id="m", shas=[shared], including=ids, point_ids=[]))
    for call in calls:
        for queued in (None, set()):
            want_queued = None if queued is None else set()
            want = payload_reads._point_payloads_rows(**{**call, "shas": set(call["shas"])}, queued=want_queued)
            got = payload_reads._point_payloads_json(**{**call, "shas": set(call["shas"])}, queued=queued)
            assert got == want, call
            assert queued == want_queued, call
    assert payload_reads.point_payloads(model_id="copies", shas=[shared])[shared]["items"][0]["m"] == a.metadata


def test_mark_failed_never_undoes_an_embedded_image(service, user):
    im = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("a.png", PNG)])[0]
    image_services.images_mark_embedded([{"id": str(im.id), "width": 4, "height": 3, "format": "png"}])
    image_services.images_mark_failed([(str(im.id), "corrupt", "late duplicate delivery")])
    im.refresh_from_db()
    assert (im.status, im.width, im.height, im.reason) == ("embedded", 4, 3, "")


def test_job_state_follows_its_images(service, user):
    job = Job.objects.create(owner=user, model_id="m", total=2)
    ims = image_services.images_create(owner=user, lane=Lane.BULK, job=job, sources=[src("a.png", PNG), src("b.jpg", JPG)])
    job_services.job_mark_started(job_id=job.id)
    assert job_services.job_refresh(job_id=job.id).status == JobStatus.RUNNING
    image_services.images_mark_embedded([{"id": str(ims[0].id), "width": 1, "height": 1, "format": "png"}])
    image_services.images_mark_failed([(str(ims[1].id), "corrupt", "bad")])
    job = job_services.job_refresh(job_id=job.id)
    assert job.status == JobStatus.DONE and job.finished_at is not None
    p = job_services.job_progress(job)
    assert (p["embedded"], p["failed"], p["finished"]) == (1, 1, 2)
    assert p["failures"][0]["reason"] == "corrupt"


def test_vector_messages_round_trip():
    v = np.random.default_rng(0).normal(size=512).astype(np.float32)
    s = encode_vector(v)
    assert isinstance(s, str) and len(s) == 2732
    np.testing.assert_array_equal(decode_vector(s), v)
    with pytest.raises(ValueError):
        decode_vector("abc")


def test_a_copy_in_another_space_carries_its_user_rows_id_and_metadata(service, user):
    """Issue 41: a migration's copy of an image (``source`` = the user's row) puts the user row's
    external_id and metadata in the new space's payload, so filters work after a model switch."""
    a = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("a.png", PNG)])[0]
    Image.objects.filter(id=a.id).update(status=ImageStatus.EMBEDDED, external_id="SKU-9", metadata={"cat": "shoes"})
    copy = Image.objects.create(owner=user, lane=Lane.BULK, status=ImageStatus.EMBEDDED, sha256=a.sha256,
                                size_bytes=a.size_bytes, storage_key=a.storage_key, model_id="other-space",
                                point_id=uuid.uuid4(), source=a)
    p = payload_reads.point_payloads(model_id="other-space", shas=[a.sha256])[a.sha256]
    assert p["items"] == [{"image": str(a.id), "owner": user.id, "external_id": "SKU-9", "m": {"cat": "shoes"}}]
    assert copy.external_id == "" and copy.metadata == {}  # the copy holds none of its own


def test_a_migration_copies_no_catalogue_row_before_its_bytes_are_fetched(service, user):
    """An unfetched row (a manifest's URL, no sha256 yet) gets its copy in a candidate space when its
    bytes arrive, never a copy of nothing."""
    from embeddings.models import EmbeddingSpace
    from embeddings.services.catalogue import copies

    fetched = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("a.png", PNG)])[0]
    unfetched = Image.objects.create(owner=user, lane=Lane.BULK, sha256="", size_bytes=0, storage_key="",
                                     origin="https://example.com/a.jpg", model_id=fetched.model_id, point_id=None)
    ids = set(copies.catalogue(EmbeddingSpace(model_id="other-space")).values_list("id", flat=True))
    assert fetched.id in ids and unfetched.id not in ids
