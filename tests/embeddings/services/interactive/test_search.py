"""``embeddings/services/interactive/search.py``: a search from the web's side (what may be searched, by whom,
and what each refusal says), with eager Celery running the embedding and the look-up on the
session's random-weights model and an embedded Qdrant.
"""
from __future__ import annotations

import io

import pytest

from embeddings import runtime
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus, Lane
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.images import images_create
from embeddings.services.catalogue.sources import SourceFile
from embeddings.services.interactive.search import search
from embeddings.services.interactive.upload import images_upload
from tests.embeddings.conftest import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)


def source(name: str, data: bytes) -> SourceFile:
    return SourceFile(name=name, size=len(data), open=lambda: io.BytesIO(data))


def uploaded(owner, *seeds: int) -> list[str]:
    """Ids of ``owner``'s images of ``seeds``, embedded on the interactive lane."""
    out = images_upload(owner=owner, sources=[source(f"{s}.jpg", jpeg_bytes(s)) for s in seeds], deadline_s=30, k=0)
    assert {v["status"] for v in out.images} == {"embedded"}
    return [v["id"] for v in out.images]


def refusal(**query) -> tuple[str, int]:
    with pytest.raises(ApplicationError) as e:
        search(**query)
    return e.value.code, e.value.status


def test_a_search_by_text_image_or_id_sees_only_the_callers_images(service, user, other_user, staff):
    mine = uploaded(user, 10, 11, 12)
    theirs = uploaded(other_user, 13)
    by_text = search(user=user, k=10, text="a red bicycle")
    assert sorted(r["image_id"] for r in by_text) == sorted(mine)
    by_image = search(user=user, k=2, image=source("q.jpg", jpeg_bytes(11)))
    assert by_image[0]["image_id"] == mine[1] and len(by_image) == 2
    assert by_image[0]["score"] == pytest.approx(1.0, abs=1e-4)
    by_id = search(user=user, k=3, image_id=mine[2])
    assert by_id[0]["image_id"] == mine[2] and len(by_id) == 3  # itself first
    assert [r["image_id"] for r in search(user=other_user, k=10, text="a dog")] == theirs
    assert sorted(r["image_id"] for r in search(user=staff, k=10, text="a dog")) == sorted(mine + theirs)
    assert refusal(user=other_user, k=3, image_id=mine[0]) == ("not_found", 404)


def test_a_search_within_a_job_needs_a_job_the_caller_may_see(service, user, other_user):
    job = job_services.job_create(owner=user, sources=[source(f"{s}.jpg", jpeg_bytes(s)) for s in (20, 21)])
    uploaded(user, 22)
    in_job = search(user=user, k=10, text="a cat", job_id=str(job.id))
    assert sorted(r["image_id"] for r in in_job) == sorted(str(i) for i in Image.objects.filter(job=job)
                                                           .values_list("id", flat=True))
    assert {r["job_id"] for r in in_job} == {str(job.id)}
    assert refusal(user=other_user, k=3, text="a cat", job_id=str(job.id)) == ("not_found", 404)


def test_a_search_says_why_it_cannot_be_answered(service, user):
    embedded, = uploaded(user, 30)
    assert refusal(user=user, k=3) == ("invalid_query", 400)
    assert refusal(user=user, k=3, text="x", image_id=embedded) == ("invalid_query", 400)
    assert refusal(user=user, k=3, text="   ") == ("invalid_query", 400)
    assert refusal(user=user, k=3, image=source("e.jpg", b"")) == ("empty", 400)
    assert refusal(user=user, k=3, image=source("d.pdf", b"%PDF-1.7")) == ("not_an_image", 415)
    queued, = images_create(owner=user, lane=Lane.INTERACTIVE, sources=[source("q.jpg", jpeg_bytes(31))])
    assert refusal(user=user, k=3, image_id=str(queued.id)) == ("not_embedded", 409)
    im = Image.objects.get(id=embedded)
    runtime.vector_store(im.model_id).delete([im.point_id])
    assert refusal(user=user, k=3, image_id=embedded) == ("vector_missing", 409)


def test_a_skipped_copy_is_searched_by_the_point_it_shares(service, user):
    first, other = uploaded(user, 40, 41)
    copy = images_upload(owner=user, sources=[source("again.jpg", jpeg_bytes(40))], deadline_s=30, k=0).images[0]
    assert Image.objects.get(id=copy["id"]).status == ImageStatus.SKIPPED
    found = search(user=user, k=2, image_id=copy["id"])
    assert [r["image_id"] for r in found] == [first, other]  # its original's point, mapped to the original row


def test_a_query_image_leaves_no_bytes_behind(service, user):
    uploaded(user, 50)
    root = runtime.blob_store().root  # a folder here (BLOB_ROOT)
    before = sorted(p for p in root.rglob("*") if p.is_file())
    assert search(user=user, k=1, image=source("q.jpg", jpeg_bytes(51)))
    assert sorted(p for p in root.rglob("*") if p.is_file()) == before
