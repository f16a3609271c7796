"""``embeddings/services/interactive/upload.py``: an interactive upload from the web's side (the deadline, the
answer's status, each image's view), with eager Celery running the chain on the session's
random-weights model and an embedded Qdrant.
"""
from __future__ import annotations

import io

import pytest

from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus
from embeddings.services.catalogue.sources import SourceFile
from embeddings.services.interactive import upload, waiting
from tests.embeddings.conftest import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)

BROKEN_JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 40  # passes the content check, fails the decode


def source(name: str, data: bytes) -> SourceFile:
    return SourceFile(name=name, size=len(data), open=lambda: io.BytesIO(data))


def test_a_deadline_may_be_shortened_never_lengthened(settings):
    settings.INTERACTIVE_DEADLINE_S = 5.0
    assert (upload.deadline_for(None), upload.deadline_for(1.5), upload.deadline_for(60)) == (5.0, 1.5, 5.0)
    for bad in (0, -1.0):
        with pytest.raises(ApplicationError) as e:
            upload.deadline_for(bad)
        assert (e.value.code, e.value.status) == ("invalid_deadline", 400)


def test_an_upload_answers_every_image_in_order_with_its_neighbours(service, user):
    first = upload.images_upload(owner=user, sources=[source("a.jpg", jpeg_bytes(1))], deadline_s=30, k=5)
    assert first.status == 200 and [v["neighbours"] for v in first.images] == [[]]
    a = first.images[0]
    assert a == {"id": a["id"], "status": "embedded", "reason": None, "detail": None, "sha256": a["sha256"],
                 "width": 260, "height": 200, "original_name": "a.jpg", "job_id": None,
                 "url": f"/api/images/{a['id']}/", "thumbnail_url": f"/api/images/{a['id']}/thumbnail/",
                 "external_id": None, "metadata": {}, "neighbours": []}

    out = upload.images_upload(owner=user, deadline_s=30, k=5, sources=[
        source("b.jpg", jpeg_bytes(2)), source("broken.jpg", BROKEN_JPEG), source("a-again.jpg", jpeg_bytes(1))])
    assert out.status == 200
    b, broken, again = out.images
    assert [v["original_name"] for v in out.images] == ["b.jpg", "broken.jpg", "a-again.jpg"]
    assert (b["status"], again["status"], broken["status"]) == ("embedded", "skipped", "failed")
    assert broken["reason"] in ("corrupt", "truncated") and broken["thumbnail_url"] is None
    assert {n["image_id"] for n in b["neighbours"]} == {a["id"]}  # the copy maps to the user's first row
    assert [n["image_id"] for n in again["neighbours"]] == [b["id"]]  # not its own bytes' point
    assert broken["neighbours"] == []
    assert Image.objects.filter(owner=user, status=ImageStatus.EMBEDDED).count() == 2


def test_copies_of_stored_bytes_only_are_answered_without_the_model(service, user, monkeypatch):
    upload.images_upload(owner=user, sources=[source("a.jpg", jpeg_bytes(3)), source("b.jpg", jpeg_bytes(4))],
                         deadline_s=30, k=0)
    from embeddings import dispatch

    sent: list[str] = []
    real = dispatch.task
    monkeypatch.setattr(dispatch, "task", lambda name, *a, **kw: (sent.append(name), real(name, *a, **kw))[1])
    out = upload.images_upload(owner=user, sources=[source("a2.jpg", jpeg_bytes(3))], deadline_s=30, k=3)
    assert out.status == 200 and out.images[0]["status"] == "skipped"
    assert len(out.images[0]["neighbours"]) == 1 and sent == ["index_interactive"]  # no embed_interactive


@pytest.mark.parametrize("data,status,reason", [
    (b"", 400, "empty"),  # refused on arrival
    (b"%PDF-1.7", 415, "not_an_image"),  # refused on arrival
    (BROKEN_JPEG, 400, None),  # refused by the worker's decode: corrupt or truncated
])
def test_one_refused_image_answers_the_status_of_its_reason(service, user, data, status, reason):
    out = upload.images_upload(owner=user, sources=[source("f.jpg", data)], deadline_s=30, k=5)
    view, = out.images
    assert out.status == status == waiting.REASON_STATUS[view["reason"]]
    assert view["status"] == "failed" and view["reason"] == (reason or view["reason"])
    # two refused images are a request that was answered: each says why
    two = upload.images_upload(owner=user, sources=[source("f.jpg", data), source("g.jpg", b"")], deadline_s=30, k=5)
    assert two.status == 200 and [v["status"] for v in two.images] == ["failed", "failed"]


def test_an_image_waiting_for_its_deadline_has_no_thumbnail_yet(service, user):
    from embeddings.models import Lane
    from embeddings.services.catalogue.images import images_create

    im, = images_create(owner=user, lane=Lane.INTERACTIVE, sources=[source("q.jpg", jpeg_bytes(5))])
    view = upload.image_view(im)
    assert (view["status"], view["thumbnail_url"], "neighbours" in view) == ("queued", None, False)
    assert upload.image_view(im, [])["neighbours"] == []
