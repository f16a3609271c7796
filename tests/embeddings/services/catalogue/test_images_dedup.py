"""Issue 9, kind 3: the same bytes are embedded once per owner and model, held by the database
(constraint ``image_one_original``), and a skipped copy carries its original's facts.

Concurrent HTTP requests from two processes: ``tests/e2e/test_concurrent_duplicates.py``.
"""
from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from embeddings.models import Image, ImageStatus, Job, Lane
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import jobs as job_services
from tests.embeddings.conftest import jpeg_bytes, upload
from tests.embeddings.services.catalogue.test_images import src

pytestmark = pytest.mark.django_db(transaction=True)


def _row(owner, sha: str, **kw) -> Image:
    fields = dict(owner=owner, lane=Lane.BULK, sha256=sha, size_bytes=1, storage_key="", model_id="m",
                  point_id="00000000-0000-0000-0000-000000000001", status=ImageStatus.QUEUED)
    return Image(**{**fields, **kw})


def test_the_database_refuses_a_second_original_of_the_same_bytes(service, user, other_user):
    _row(user, "a" * 64).save()
    with pytest.raises(IntegrityError), transaction.atomic():
        _row(user, "a" * 64, status=ImageStatus.EMBEDDED).save()
    # what the constraint leaves free: another owner, another model, a duplicate, a finished row
    _row(other_user, "a" * 64).save()
    _row(user, "a" * 64, model_id="other").save()
    first = Image.objects.get(owner=user, model_id="m")
    _row(user, "a" * 64, status=ImageStatus.SKIPPED, duplicate_of=first).save()
    _row(user, "a" * 64, status=ImageStatus.FAILED).save()
    _row(user, "a" * 64, status=ImageStatus.CANCELLED).save()
    assert Image.objects.filter(sha256="a" * 64).count() == 6


def test_an_insert_that_loses_the_race_becomes_a_duplicate_of_the_winner(service, user):
    """What a second request does when another one committed the same bytes after its look-up:
    the database refuses its insert and the row becomes the winner's skipped duplicate."""
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
    winner = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("a.png", png)])[0]
    late = Image(owner=user, lane=Lane.INTERACTIVE, sha256=winner.sha256, size_bytes=winner.size_bytes,
                 storage_key=winner.storage_key, model_id=winner.model_id, point_id=winner.point_id)
    other = Image(owner=user, lane=Lane.INTERACTIVE, sha256="b" * 64, size_bytes=1, storage_key="",
                  model_id=winner.model_id, point_id=winner.point_id)
    with transaction.atomic():
        image_services._insert_originals([late, other])
        Image.objects.bulk_create([late])  # images_create saves the skipped rows after the originals
    late.refresh_from_db()
    assert (late.status, late.duplicate_of_id) == (ImageStatus.SKIPPED, winner.id)
    assert Image.objects.get(id=other.id).status == ImageStatus.QUEUED  # the batch's other row is in
    assert Image.objects.filter(sha256=winner.sha256, status=ImageStatus.QUEUED).count() == 1


def test_a_duplicate_in_the_same_request_carries_the_originals_facts(service, api):
    data = jpeg_bytes(40, size=(120, 90))
    r = api.post("/api/images/", {"files": [upload("a.jpg", data), upload("a-again.jpg", data)]}, format="multipart")
    assert r.status_code == 200, r.json()
    a, again = r.json()["images"]
    assert (a["status"], again["status"]) == ("embedded", "skipped")
    assert (a["width"], a["height"]) == (again["width"], again["height"]) == (90, 120)
    assert Image.objects.get(id=again["id"]).format == Image.objects.get(id=a["id"]).format == "jpeg"


def test_a_copy_of_a_queued_original_gets_its_facts_when_it_is_embedded(service, api, user):
    data = jpeg_bytes(41, size=(64, 80))
    job = Job.objects.create(owner=user, model_id="m")
    queued = image_services.images_create(owner=user, lane=Lane.BULK, job=job, sources=[src("q.jpg", data)])[0]
    copy = api.post("/api/images/", {"files": [upload("c.jpg", data)]}, format="multipart").json()["images"][0]
    assert copy["status"] == "skipped" and copy["width"] is None  # the original is not decoded yet
    image_services.images_mark_embedded([{"id": str(queued.id), "width": 80, "height": 64, "format": "jpeg"}])
    got = api.get(f"/api/images/{copy['id']}/").json()
    assert (got["status"], got["width"], got["height"]) == ("skipped", 80, 64)


def test_retrying_a_failed_image_whose_bytes_were_uploaded_again_skips_it(service, user):
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
    failed = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("a.png", png)])[0]
    image_services.images_mark_failed([(str(failed.id), "corrupt", "bad")])
    again = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("b.png", png)])[0]
    assert again.status == ImageStatus.QUEUED  # a failed row is not an original
    assert job_services.images_retry(images=Image.objects.filter(id=failed.id)) == 0
    failed.refresh_from_db()
    assert (failed.status, failed.duplicate_of_id) == (ImageStatus.SKIPPED, again.id)
    assert Image.objects.filter(sha256=again.sha256, status=ImageStatus.QUEUED).count() == 1


def test_a_failed_original_takes_its_copies_with_it(service, user):
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
    a, b = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("a.png", png), src("b.png", png)])
    image_services.images_mark_failed([(str(a.id), "corrupt", "broken IDAT")])
    b.refresh_from_db()
    assert (b.status, b.reason) == (ImageStatus.FAILED, "corrupt")
    assert b.reason_detail == f"same bytes as image {a.id}: broken IDAT"


def test_the_migration_resolves_duplicates_made_before_the_constraint(user):
    """Databases filled before 0004 may hold several originals of the same bytes (the race this
    constraint closes): the migration keeps one (embedded first) and skips the others."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    executor.migrate([("embeddings", "0002_job_utilisation_pipeline")])
    old = executor.loader.project_state([("embeddings", "0002_job_utilisation_pipeline")]).apps.get_model(
        "embeddings", "Image")
    common = dict(owner_id=user.id, lane="interactive", sha256="c" * 64, size_bytes=1, storage_key="", model_id="m",
                  point_id="00000000-0000-0000-0000-000000000002")
    queued = old.objects.create(status="queued", **common)
    embedded = old.objects.create(status="embedded", width=7, height=5, format="png", **common)
    lagging = old.objects.create(status="skipped", duplicate_of_id=queued.id, **common)
    executor = MigrationExecutor(connection)
    executor.migrate([("embeddings", "0004_image_one_original")])
    # only the columns 0004 has (later migrations add others, e.g. 0005's ``source``)
    rows = {r.id: r for r in Image.objects.filter(sha256="c" * 64).only("id", "status", "duplicate_of", "width",
                                                                          "height")}
    executor = MigrationExecutor(connection)  # forward to the latest again: the next tests need every table
    executor.migrate(executor.loader.graph.leaf_nodes())
    assert (rows[embedded.id].status, rows[embedded.id].duplicate_of_id) == ("embedded", None)
    assert (rows[queued.id].status, rows[queued.id].duplicate_of_id) == ("skipped", embedded.id)
    assert rows[lagging.id].duplicate_of_id == embedded.id  # copies of the demoted row follow it
    assert (rows[queued.id].width, rows[queued.id].height) == (7, 5)


def test_a_blob_deleted_between_storing_and_inserting_is_stored_again(service, user, monkeypatch):
    """A deletion of the last row naming some bytes removes their blob; an upload of the same bytes
    that found the blob already there (so wrote nothing) before that must not end up naming a
    missing file: under the bytes' lock it stores them again."""
    from embeddings import runtime

    png = b"\x89PNG\r\n\x1a\n" + b"\x01" * 40
    store = runtime.blob_store()
    put, lost = store.put, []

    def put_then_lose(chunks):
        key, sha, size = put(chunks)
        if not lost:  # once: what a concurrent delete of the last row with these bytes does
            store.delete(key)
            lost.append(key)
        return key, sha, size

    monkeypatch.setattr(store, "put", put_then_lose)
    im = image_services.images_create(owner=user, lane=Lane.BULK, sources=[src("a.png", png)])[0]
    assert lost == [im.storage_key] and store.read(im.storage_key, im.sha256) == png
