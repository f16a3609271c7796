"""The REST API end to end in one process (eager Celery, embedded Qdrant, random-weights model)."""
from __future__ import annotations

import io
import zipfile

import cv2
import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings.models import Image, ImageStatus, Job, JobStatus
from tests.embeddings.conftest import client_for

pytestmark = pytest.mark.django_db(transaction=True)


def jpeg_bytes(seed: int, size=(200, 260)) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), size[::-1], interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


def upload(name: str, data: bytes) -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="image/jpeg")


def test_authentication_is_required(client, service):
    for method, url in (("get", "/api/images/"), ("post", "/api/images/"), ("get", "/api/jobs/"),
                        ("post", "/api/search/")):
        r = getattr(client, method)(url)
        assert r.status_code == 401, url
        assert set(r.json()) == {"message", "code", "extra"}


def test_interactive_upload_embeds_and_returns_neighbours(service, api):
    r1 = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1))]}, format="multipart")
    assert r1.status_code == 200, r1.json()
    a = r1.json()["images"][0]
    assert a["status"] == "embedded" and (a["width"], a["height"]) == (260, 200) and a["neighbours"] == []
    r2 = api.post("/api/images/", {"files": [upload("b.jpg", jpeg_bytes(2)), upload("c.jpg", jpeg_bytes(3))], "k": 5},
                  format="multipart")
    assert r2.status_code == 200
    b, c = r2.json()["images"]
    assert {b["status"], c["status"]} == {"embedded"}
    # b's neighbours: a (indexed before) and c (indexed in the same request), never b itself
    assert {n["image_id"] for n in b["neighbours"]} == {a["id"], c["id"]}
    assert Image.objects.filter(status=ImageStatus.EMBEDDED).count() == 3


def test_upload_with_k_0_embeds_without_neighbours(service, api):
    first = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(10))]}, format="multipart")
    assert first.status_code == 200
    r = api.post("/api/images/", {"files": [upload("b.jpg", jpeg_bytes(11)), upload("a2.jpg", jpeg_bytes(10))],
                                  "k": 0}, format="multipart")
    assert r.status_code == 200, r.json()
    b, again = r.json()["images"]
    assert (b["status"], again["status"]) == ("embedded", "skipped")  # embedded (or shared), nothing searched
    assert b["neighbours"] == [] and again["neighbours"] == []
    assert Image.objects.get(id=b["id"]).status == ImageStatus.EMBEDDED


def test_same_bytes_again_are_skipped_and_share_the_point(service, api):
    data = jpeg_bytes(4)
    first = api.post("/api/images/", {"files": [upload("x.jpg", data)]}, format="multipart").json()["images"][0]
    again = api.post("/api/images/", {"files": [upload("y.jpg", data)]}, format="multipart").json()["images"][0]
    assert again["status"] == "skipped"
    im = Image.objects.get(id=again["id"])
    assert str(im.duplicate_of_id) == first["id"] and im.point_id == Image.objects.get(id=first["id"]).point_id


def test_bad_file_in_a_request_fails_alone(service, api):
    r = api.post("/api/images/", {"files": [upload("ok.jpg", jpeg_bytes(5)), upload("bad.jpg", b"not an image")]},
                 format="multipart")
    assert r.status_code == 200
    ok, bad = r.json()["images"]
    assert ok["status"] == "embedded"
    assert (bad["status"], bad["reason"]) == ("failed", "not_an_image")


@pytest.mark.parametrize("data,status,reason", [
    (b"", 400, "empty"),
    (b"%PDF-1.4 not an image", 415, "not_an_image"),
])
def test_single_refused_file_answers_4xx_with_reason(service, api, data, status, reason):
    r = api.post("/api/images/", {"files": [upload("f.jpg", data)]}, format="multipart")
    assert r.status_code == status
    assert r.json()["images"][0]["reason"] == reason


def test_deadline_may_shorten_but_not_lengthen(service, api):
    r = api.post("/api/images/", {"files": [upload("d.jpg", jpeg_bytes(6))], "deadline": 60}, format="multipart")
    assert r.json()["deadline_s"] == service.INTERACTIVE_DEADLINE_S
    r = api.post("/api/images/", {"files": [upload("e.jpg", jpeg_bytes(7))], "deadline": 0}, format="multipart")
    assert r.status_code == 400 and r.json()["code"] == "invalid_deadline"


def test_too_many_files_names_the_limit(service, api):
    files = [upload(f"{i}.jpg", jpeg_bytes(i)) for i in range(service.INTERACTIVE_MAX_FILES + 1)]
    r = api.post("/api/images/", {"files": files}, format="multipart")
    assert r.status_code == 400 and r.json()["extra"]["limit"] == "INTERACTIVE_MAX_FILES"
    assert r.json()["extra"]["value"] == service.INTERACTIVE_MAX_FILES  # the limit, and what was sent
    assert r.json()["extra"]["files"] == service.INTERACTIVE_MAX_FILES + 1


def test_django_upload_limits_become_4xx_naming_the_limit(service, api, settings):
    settings.DATA_UPLOAD_MAX_NUMBER_FILES = 2
    r = api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(i)) for i in range(3)]}, format="multipart")
    assert r.status_code == 400 and r.json()["extra"]["limit"] == "DATA_UPLOAD_MAX_NUMBER_FILES"
    settings.UPLOAD_MAX_REQUEST_BYTES = 1000
    r = api.post("/api/jobs/", {"files": [upload("big.jpg", jpeg_bytes(1, (400, 400)))]}, format="multipart")
    assert r.status_code == 413 and r.json()["extra"]["limit"] == "UPLOAD_MAX_REQUEST_BYTES"


def test_bulk_job_from_files_and_zip_with_progress_and_timings(service, api):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i in range(3):
            z.writestr(f"folder/{i}.jpg", jpeg_bytes(100 + i))
        z.writestr("notes.txt", "hello")
    buf.seek(0)
    r = api.post("/api/jobs/", {"files": [upload("f1.jpg", jpeg_bytes(200)), upload("dup.jpg", jpeg_bytes(200))],
                                "zip": [SimpleUploadedFile("a.zip", buf.read(), content_type="application/zip")],
                                "name": "catalogue"}, format="multipart")
    assert r.status_code == 202, r.json()
    job_id = r.json()["id"]
    assert r.json()["total"] == 6
    p = api.get(f"/api/jobs/{job_id}/").json()
    assert p["status"] == "done"
    assert (p["embedded"], p["skipped"], p["failed"]) == (4, 1, 1)
    assert [f["reason"] for f in p["failures"]] == ["not_an_image"]
    assert set(p["timings_ms"]) == {"load", "decode", "decode_wait", "preprocess", "embed", "upsert", "total"}
    for v in p["timings_ms"].values():
        assert v["min"] <= v["avg"] <= v["max"]
    assert p["throughput_images_per_s"] > 0 and p["started_at"] and p["finished_at"]


def test_zip_slip_is_refused(service, api):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../../etc/evil.jpg", jpeg_bytes(1))
    r = api.post("/api/jobs/", {"zip": [SimpleUploadedFile("e.zip", buf.getvalue())]}, format="multipart")
    assert r.status_code == 400 and r.json()["code"] == "zip_unsafe_path"
    assert Job.objects.count() == 0


def test_search_by_text_image_and_id(service, api):
    ids = [api.post("/api/images/", {"files": [upload(f"{i}.jpg", jpeg_bytes(300 + i))]}, format="multipart")
           .json()["images"][0]["id"] for i in range(4)]
    by_id = api.post("/api/search/", {"image_id": ids[2], "k": 4}, format="json").json()["results"]
    assert by_id[0]["image_id"] == ids[2] and by_id[0]["score"] >= 0.99 and len(by_id) == 4
    by_image = api.post("/api/search/", {"image": upload("q.jpg", jpeg_bytes(301)), "k": 2}, format="multipart")
    assert by_image.status_code == 200 and by_image.json()["results"][0]["image_id"] == ids[1]
    by_text = api.post("/api/search/", {"text": "a red bicycle", "k": 3}, format="json").json()["results"]
    assert len(by_text) == 3 and {r["image_id"] for r in by_text} <= set(ids)
    bad = api.post("/api/search/", {"text": "x", "image_id": ids[0]}, format="json")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_query"


def test_owners_only_see_their_own_images(service, api, other_user, staff):
    mine = api.post("/api/images/", {"files": [upload("m.jpg", jpeg_bytes(400))]}, format="multipart").json()["images"][0]
    bob = client_for(other_user)
    theirs = bob.post("/api/images/", {"files": [upload("t.jpg", jpeg_bytes(401))]}, format="multipart").json()["images"][0]
    assert theirs["neighbours"] == []  # alice's image is not bob's neighbour
    assert bob.get(f"/api/images/{mine['id']}/").status_code == 404
    assert bob.delete(f"/api/images/{mine['id']}/").status_code == 404
    assert bob.post("/api/search/", {"image_id": mine["id"]}, format="json").status_code == 404
    found = bob.post("/api/search/", {"text": "anything", "k": 10}, format="json").json()["results"]
    assert [r["image_id"] for r in found] == [theirs["id"]]
    everything = client_for(staff).post("/api/search/", {"text": "anything", "k": 10}, format="json").json()["results"]
    assert {r["image_id"] for r in everything} == {mine["id"], theirs["id"]}


def test_delete_removes_the_vector(service, api):
    from embeddings import runtime

    im = api.post("/api/images/", {"files": [upload("d.jpg", jpeg_bytes(500))]}, format="multipart").json()["images"][0]
    assert runtime.vector_store().count() == 1
    assert api.delete(f"/api/images/{im['id']}/").status_code == 204
    assert runtime.vector_store().count() == 0
    assert api.get(f"/api/images/{im['id']}/").status_code == 404


def test_cancel_marks_queued_images_and_is_final(service, api, user):
    job = Job.objects.create(owner=user, model_id="m", total=1)
    r = api.post(f"/api/jobs/{job.id}/cancel/")
    assert r.status_code == 200 and r.json()["status"] == JobStatus.CANCELLED
    again = api.post(f"/api/jobs/{job.id}/resume/")
    assert again.status_code == 409 and again.json()["code"] == "invalid_transition"


@pytest.mark.parametrize("url", ["/api/nope/", "/api/images/nope/", "/api/jobs/nope/", "/api/jobs/nope/cancel/",
                                 "/api/images/00000000-0000-0000-0000-000000000000/"])
def test_unknown_urls_and_ids_under_api_answer_json_404(service, api, url):
    r = api.get(url)
    assert r.status_code == 404 and r["Content-Type"] == "application/json", r.content[:200]
    body = r.json()
    assert set(body) == {"message", "code", "extra"} and body["code"] == "not_found" and body["extra"] == {}
    assert body["message"]


def test_unknown_urls_outside_api_get_the_sites_page(client):
    r = client.get("/nope/")
    assert r.status_code == 404 and r["Content-Type"].startswith("text/html")
    assert "/static/site/site.css" in r.content.decode() and "(404 not_found: no such resource: /nope/)" in r.content.decode()


def test_an_unhandled_error_answers_json_500(service, user, monkeypatch):
    from embeddings.api import images

    def boom(u):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(images, "images_visible_to", boom)
    c = client_for(user)
    c.raise_request_exception = False
    r = c.get("/api/images/")
    assert r.status_code == 500 and r["Content-Type"] == "application/json"
    assert r.json() == {"message": "internal error", "code": "internal_error", "extra": {}}


def test_openapi_schema_renders(service, api):
    r = api.get("/api/schema/")
    assert r.status_code == 200 and b"/api/images/" in r.content
