"""The site and the thumbnails in one process (eager Celery, embedded Qdrant, random-weights model):
thumbnails drawn once by the embedding worker and served with owner checks and cache headers, the
pages' permissions (a user sees their own, staff all) and CSRF, static files and self-hosted API docs."""
from __future__ import annotations

import re
from io import StringIO

import cv2
import numpy as np
import pytest
from django.core.management import call_command
from django.test import Client

from embeddings import runtime
from embeddings.models import Image, ImageStatus, Job
from embeddings.storage import thumbnail_exists, thumbnail_path
from tests.embeddings.conftest import client_for
from tests.embeddings.test_api import jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


def uploaded(api, name: str, data: bytes) -> dict:
    r = api.post("/api/images/", {"files": [upload(name, data)], "k": 0}, format="multipart")
    assert r.status_code == 200, r.json()
    return r.json()["images"][0]


def signed_in(u, **kw) -> Client:
    c = Client(**kw)
    c.force_login(u)
    return c


def test_an_embedded_image_has_a_thumbnail_drawn_once(service, api, user, other_user):
    a = uploaded(api, "a.jpg", jpeg_bytes(1, size=(600, 900)))
    assert a["status"] == "embedded" and a["thumbnail_url"] == f"/api/images/{a['id']}/thumbnail/"
    store = runtime.blob_store()
    path = thumbnail_path(store, a["sha256"])
    assert thumbnail_exists(store, a["sha256"]) and path.parent.parent.name == "thumb"
    before = path.stat().st_mtime_ns
    # the same bytes from another user: a new row, no second decode, the same thumbnail
    b = uploaded(client_for(other_user), "b.jpg", jpeg_bytes(1, size=(600, 900)))
    assert b["thumbnail_url"] == f"/api/images/{b['id']}/thumbnail/"
    assert path.stat().st_mtime_ns == before
    assert len(list((store.root / "thumb").rglob("*.webp"))) == 1

    r = api.get(a["thumbnail_url"])
    assert r.status_code == 200 and r["Content-Type"] == "image/webp"
    assert r["Cache-Control"] == "private, max-age=31536000, immutable" and r["ETag"] == f'"{a["sha256"]}"'
    body = b"".join(r.streaming_content) if r.streaming else r.content
    assert body[:4] == b"RIFF" and body == path.read_bytes()
    again = api.get(a["thumbnail_url"], HTTP_IF_NONE_MATCH=f'"{a["sha256"]}"')
    assert again.status_code == 304 and again["ETag"] == f'"{a["sha256"]}"'


def test_thumbnails_are_checked_like_their_image(service, api, user, other_user, staff):
    a = uploaded(api, "a.jpg", jpeg_bytes(2))
    url = a["thumbnail_url"]
    assert Client().get(url).status_code == 401  # no credentials
    other = client_for(other_user).get(url)
    assert other.status_code == 404 and other.json()["code"] == "not_found"  # as for an unknown id
    assert client_for(staff).get(url).status_code == 200
    assert signed_in(user).get(url).status_code == 200  # the site's session works too


def test_a_refused_image_has_no_thumbnail(service, api):
    r = api.post("/api/images/", {"files": [upload("t.jpg", b"plain text, not an image")]}, format="multipart")
    im = r.json()["images"][0]
    assert im["status"] == "failed" and im["thumbnail_url"] is None
    assert api.get(f"/api/images/{im['id']}/thumbnail/").json()["code"] == "not_found"


def test_api_image_and_search_results_carry_thumbnail_urls(service, api, user):
    a = uploaded(api, "a.jpg", jpeg_bytes(3))
    uploaded(api, "b.jpg", jpeg_bytes(4))
    assert api.get(f"/api/images/{a['id']}/").json()["thumbnail_url"] == a["thumbnail_url"]
    hits = api.post("/api/search/", {"text": "a photo", "k": 5}, format="json").json()["results"]
    assert len(hits) == 2
    assert {h["thumbnail_url"] for h in hits} == {f"/api/images/{h['image_id']}/thumbnail/" for h in hits}


def test_pages_need_a_signed_in_user(service, client):
    for url in ("/", "/search/", "/upload/", "/jobs/"):
        r = client.get(url)
        assert r.status_code == 302 and r["Location"].startswith("/login/"), url
    assert client.get("/login/").status_code == 200


def test_sign_in_with_a_password_and_csrf(service, user):
    c = Client(enforce_csrf_checks=True)
    assert c.post("/login/", {"username": "alice", "password": "pw"}).status_code == 403  # no CSRF token
    page = c.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)
    r = c.post("/login/", {"username": "alice", "password": "pw", "csrfmiddlewaretoken": token})
    assert r.status_code == 302 and r["Location"] == "/search/"
    assert c.get("/search/").status_code == 200


def test_search_page_shows_own_images_only(service, api, user, other_user, staff):
    mine = [uploaded(api, f"mine{i}.jpg", jpeg_bytes(10 + i)) for i in range(3)]
    theirs = uploaded(client_for(other_user), "theirs.jpg", jpeg_bytes(20))
    page = signed_in(user).get("/search/", {"q": "a photo"})
    assert page.status_code == 200
    html = page.content.decode()
    assert sorted(re.findall(r'src="/api/images/([0-9a-f-]+)/thumbnail/"', html)) == sorted(m["id"] for m in mine)
    assert theirs["id"] not in html
    assert html.count("More like this") == 3
    everyone = signed_in(staff).get("/search/", {"q": "a photo"}).content.decode()
    assert len(re.findall(r'src="/api/images/[0-9a-f-]+/thumbnail/"', everyone)) == 4
    like = signed_in(user).get("/search/", {"like": mine[0]["id"]})
    assert like.status_code == 200 and len(re.findall(r'/thumbnail/"', like.content.decode())) == 3
    # another user's image as "more like this": not found, nothing leaked
    refused = signed_in(user).get("/search/", {"like": theirs["id"]})
    assert refused.status_code == 404 and "thumbnail" not in refused.content.decode()
    assert signed_in(user).get("/search/", {"like": "nonsense"}).status_code == 400


def test_search_by_image_and_job_filter(service, api, user):
    from django.core.files.uploadedfile import SimpleUploadedFile

    uploaded(api, "a.jpg", jpeg_bytes(30))
    r = api.post("/api/jobs/", {"files": [upload("j1.jpg", jpeg_bytes(31)), upload("j2.jpg", jpeg_bytes(32))],
                                "name": "two"}, format="multipart")
    job_id = r.json()["id"]
    c = signed_in(user)
    in_job = c.get("/search/", {"q": "x", "job": job_id}).content.decode()
    assert len(re.findall(r'/thumbnail/"', in_job)) == 2
    by_image = c.post("/search/", {"image": SimpleUploadedFile("q.jpg", jpeg_bytes(30), "image/jpeg")})
    assert by_image.status_code == 200 and len(re.findall(r'/thumbnail/"', by_image.content.decode())) == 3
    refused = c.post("/search/", {"image": SimpleUploadedFile("q.txt", b"hello there", "text/plain")})
    assert refused.status_code == 415 and "This file is not an image." in refused.content.decode()


def test_job_and_image_pages_follow_the_api_permissions(service, api, user, other_user, staff):
    a = uploaded(api, "a.jpg", jpeg_bytes(40))
    uploaded(api, "b.jpg", jpeg_bytes(41))
    r = api.post("/api/jobs/", {"files": [upload("j.jpg", jpeg_bytes(42)), upload("bad.jpg", b"nope")]},
                 format="multipart")
    job = Job.objects.get(id=r.json()["id"])
    own, other, boss = signed_in(user), signed_in(other_user), signed_in(staff)
    page = own.get(f"/images/{a['id']}/").content.decode()
    assert "a.jpg" in page and a["thumbnail_url"] in page and "Nearest neighbours" in page
    assert len(re.findall(r'/thumbnail/"', page)) == 1 + 2  # itself + b + the job's image
    assert other.get(f"/images/{a['id']}/").status_code == 404
    assert boss.get(f"/images/{a['id']}/").status_code == 200
    detail = own.get(f"/jobs/{job.id}/").content.decode()
    assert 'id="job-data"' in detail and '"failed": 1' in detail and "not_an_image" in detail
    assert other.get(f"/jobs/{job.id}/").status_code == 404 and boss.get(f"/jobs/{job.id}/").status_code == 200
    assert str(job.id) in own.get("/jobs/").content.decode()
    assert str(job.id) not in other.get("/jobs/").content.decode()


def test_delete_needs_the_owner_and_a_csrf_token(service, api, user, other_user):
    a = uploaded(api, "a.jpg", jpeg_bytes(50))
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    assert strict.post(f"/images/{a['id']}/delete/").status_code == 403  # no token
    nosy = signed_in(other_user)
    assert nosy.post(f"/images/{a['id']}/delete/").status_code == 404
    page = strict.get(f"/images/{a['id']}/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    r = strict.post(f"/images/{a['id']}/delete/", {"csrfmiddlewaretoken": token})
    assert r.status_code == 302 and r["Location"] == "/search/"
    assert not Image.objects.filter(id=a["id"]).exists()
    assert strict.get("/api/images/", HTTP_ACCEPT="application/json").json()["results"] == []


def test_upload_page_carries_the_limit_and_reasons_in_words(service, user):
    html = signed_in(user).get("/upload/").content.decode()
    assert 'data-interactive-max="16"' in html and '"not_an_image": "This file is not an image."' in html


def test_static_files_and_api_docs_are_served_without_a_cdn(service, user):
    c = signed_in(user)
    assert c.get("/static/admin/css/base.css").status_code == 200
    assert c.get("/static/site/site.css").status_code == 200
    icon = c.get("/favicon.ico")  # asked for by every page that names no icon (admin, API docs)
    assert icon.status_code == 301 and c.get(icon["Location"]).status_code == 200
    docs = c.get("/api/docs/").content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in docs
    assert not re.search(r'(src|href)="https?://', docs)
    assert c.get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js").status_code == 200
    # Redoc is not offered: its page template loads Google Fonts and its bundle a logo from a CDN
    assert c.get("/api/redoc/").status_code == 404


def test_the_thumbnails_command_draws_only_what_is_missing(service, api):
    a = uploaded(api, "a.jpg", jpeg_bytes(60, size=(300, 500)))
    uploaded(api, "b.jpg", jpeg_bytes(61))
    store = runtime.blob_store()
    thumbnail_path(store, a["sha256"]).unlink()  # as for an image embedded before thumbnails existed
    out = StringIO()
    call_command("thumbnails", stdout=out)
    assert out.getvalue().strip() == "1 thumbnails drawn, 1 already there, 0 without a readable original"
    drawn = cv2.imdecode(np.frombuffer(thumbnail_path(store, a["sha256"]).read_bytes(), np.uint8), cv2.IMREAD_COLOR)
    assert drawn.shape[:2] == (154, 256)  # 500 × 300 → 256 on the long side
    out = StringIO()
    call_command("thumbnails", stdout=out)
    assert out.getvalue().strip() == "0 thumbnails drawn, 2 already there, 0 without a readable original"


def test_admin_thumbnails_are_the_workers_never_a_decode_in_the_web(service, api, staff, monkeypatch):
    """The admin's image list shows the thumbnail the worker drew, for any shape (a 60000×1 line
    once made the admin decode the original and fail in ``cv2.resize`` with a 500)."""
    ok, png = cv2.imencode(".png", np.full((1, 60000, 3), 200, np.uint8))
    line = uploaded(api, "line.png", png.tobytes())
    queued = Image.objects.create(owner=staff, lane="bulk", sha256="0" * 64, size_bytes=1, storage_key="",
                                  model_id="m", point_id="00000000-0000-0000-0000-000000000000")
    import workers.decode

    def no_decode(*a, **k):
        raise AssertionError("the web process decoded an original")

    monkeypatch.setattr(workers.decode, "decode_image", no_decode)
    admin = signed_in(staff)
    page = admin.get("/admin/embeddings/image/")
    assert page.status_code == 200
    html = page.content.decode()
    assert f"/admin/embeddings/image/{line['id']}/thumbnail/" in html
    assert f"/admin/embeddings/image/{queued.id}/thumbnail/" not in html  # never decoded: no thumbnail
    r = admin.get(f"/admin/embeddings/image/{line['id']}/thumbnail/")
    body = b"".join(r.streaming_content) if r.streaming else r.content
    assert r.status_code == 200 and r["Content-Type"] == "image/webp" and body[:4] == b"RIFF"
    assert admin.get(f"/admin/embeddings/image/{queued.id}/thumbnail/").status_code == 404
