"""The site and the thumbnails in one process (eager Celery, embedded Qdrant, random-weights model):
thumbnails drawn once by the embedding worker and served with owner checks and cache headers, the
pages' permissions (a user sees their own, staff all) and CSRF, static files and self-hosted API docs."""
from __future__ import annotations

import re
import uuid
from io import StringIO

import cv2
import numpy as np
import pytest
from django.core.management import call_command
from django.test import Client

from embeddings import runtime
from embeddings.models import Image, ImageStatus, Job
from embeddings.storage import thumbnail_exists, thumbnail_path
from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


def card_ids(html: str) -> list[str]:
    """The image ids of the result cards, in the page's order."""
    return re.findall(r'<li class="card">.*?<a class="thumb" href="/images/([0-9a-f-]+)/"', html, re.S)


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
    assert len(list((store.root / "thumb").rglob("*.jpg"))) == 1

    r = api.get(a["thumbnail_url"])
    assert r.status_code == 200 and r["Content-Type"] == "image/jpeg"
    assert r["Cache-Control"] == "private, max-age=31536000, immutable" and r["ETag"] == f'"{a["sha256"]}"'
    body = b"".join(r.streaming_content) if r.streaming else r.content
    assert body[:3] == b"\xff\xd8\xff" and body == path.read_bytes()
    again = api.get(a["thumbnail_url"], HTTP_IF_NONE_MATCH=f'"{a["sha256"]}"')
    assert again.status_code == 304 and again["ETag"] == f'"{a["sha256"]}"'


def test_a_thumbnail_still_being_drawn_is_waited_for_and_an_old_missing_one_is_404(service, api, monkeypatch):
    """The interactive worker draws a thumbnail once its answer is out: a request for it in the
    window after the image was embedded waits for it; past the window a missing one is 404 at once."""
    import datetime as dt
    import threading
    import time

    from django.utils import timezone

    from embeddings.site import thumbnails

    a = uploaded(api, "late.jpg", jpeg_bytes(11, size=(300, 400)))
    store = runtime.blob_store()
    path = thumbnail_path(store, a["sha256"])
    drawn = path.read_bytes()
    path.unlink()  # as if the worker had not drawn it yet
    Image.objects.filter(id=a["id"]).update(embedded_at=timezone.now())
    threading.Timer(0.3, lambda: path.write_bytes(drawn)).start()
    t0 = time.perf_counter()
    r = api.get(a["thumbnail_url"])
    assert r.status_code == 200 and r.content == drawn and 0.25 < time.perf_counter() - t0 < thumbnails.THUMBNAIL_LATE_S
    path.unlink()
    Image.objects.filter(id=a["id"]).update(embedded_at=timezone.now() - dt.timedelta(seconds=thumbnails.THUMBNAIL_LATE_S + 1))
    t0 = time.perf_counter()
    r = api.get(a["thumbnail_url"])
    assert r.status_code == 404 and r.json()["code"] == "not_found" and time.perf_counter() - t0 < 0.5


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
    assert like.status_code == 200 and len(card_ids(like.content.decode())) == 3
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
    assert r.status_code == 200 and r["Content-Type"] == "image/jpeg" and body[:3] == b"\xff\xd8\xff"
    assert admin.get(f"/admin/embeddings/image/{queued.id}/thumbnail/").status_code == 404


# --- catalogue jobs, the metadata filter, ids and metadata on the pages (issue 41) ------------------


@pytest.fixture
def catalogue(service, origin):
    """Fetching allowed from the test origin on 127.0.0.1 (refused by default), and the declared
    metadata fields the search page offers inputs for, one of each type."""
    service.FETCH_ALLOW_NETWORKS = ["127.0.0.1/32"]
    service.FETCH_RETRIES = 1
    service.METADATA_INDEXES = "category:keyword,price:float,count:integer,added:datetime,sale:bool"
    runtime.fetcher.cache_clear()
    yield service
    runtime.fetcher.cache_clear()


def csv_file(text: str | bytes, name: str = "catalogue.csv"):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile(name, text.encode() if isinstance(text, str) else text, content_type="text/csv")


def page_text(html: str) -> str:
    """The page's text: tags dropped, entities read, whitespace runs made one space."""
    import html as html_lib

    return re.sub(r"\s+", " ", html_lib.unescape(re.sub(r"<[^>]+>", " ", html))).strip()


def table_rows(html: str, table_id: str) -> list[list[str]]:
    """The text of each cell of each body row of table ``table_id``."""
    body = re.search(rf'<table id="{table_id}".*?<tbody>(.*?)</tbody>', html, re.S).group(1)
    return [[page_text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
            for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


def test_a_manifest_posted_on_the_jobs_page_becomes_a_job_with_failures_by_reason(catalogue, user, origin):
    base = origin.url
    text = ("url,external_id,category,price\n"
            f"{base}/img/1.jpg,SKU-1,shoes,49.5\n"
            f"{base}/img/2.jpg,SKU-2,hats,12\n"
            f"{base}/status/404,SKU-3,shoes,5\n"
            f"{base}/status/410,SKU-4,shoes,6\n"
            "file:///etc/passwd,SKU-5,bags,1\n")
    c = signed_in(user)
    form = c.get("/jobs/").content.decode()
    assert 'name="manifest"' in form and 'name="prefix"' in form
    assert '<details class="start" id="start" open>' in form  # no job yet: the forms are open
    r = c.post("/jobs/", {"source": "manifest", "manifest": csv_file(text), "name": "spring catalogue",
                          "priority": "urgent"})
    job = Job.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/jobs/{job.id}/"
    assert (job.name, job.priority, job.total, job.status, job.reading) == ("spring catalogue", "urgent", 5, "done",
                                                                            False)
    html = c.get(r["Location"]).content.decode()
    source = page_text(re.search(r'<section aria-labelledby="source-title".*?</section>', html, re.S).group(0))
    assert source == "Source Manifest catalogue.csv (uploaded) Format csv Rows read 5 Reading finished"
    assert re.search(r'id="job-reading" class="badge s-reading" hidden>', html)
    reasons = [page_text(li) for li in re.findall(r"<li>(.*?)</li>", re.search(
        r'<ul id="job-reasons".*?</ul>', html, re.S).group(0), re.S)]
    assert reasons == ["fetch_status 2 Its address answered with an error status.",
                       "url_invalid 1 The row's url is not a usable http or https address."]
    rows = table_rows(html, "job-failures")
    assert [r[:3] for r in rows] == [["3", f"{base}/status/404", "fetch_status"],
                                     ["4", f"{base}/status/410", "fetch_status"],
                                     ["5", "row 5", "url_invalid"]]
    assert "404" in rows[0][3] and "410" in rows[1][3]
    assert page_text(re.search(r'<h2 id="failures-title">.*?</h2>', html, re.S).group(0)) == "Failures 3"
    # the jobs list: the job, its progress
    listed = page_text(re.search(r"<tbody>(.*?)</tbody>", c.get("/jobs/").content.decode(), re.S).group(1))
    assert listed.startswith("spring catalogue done 2 / 5 3 ")


def test_the_jobs_page_shows_refusals_in_words_and_starts_nothing(catalogue, user):
    c = signed_in(user)
    bad_header = c.post("/jobs/", {"source": "manifest", "manifest": csv_file("image,sku\nhttp://e.com/a.jpg,1\n")})
    assert bad_header.status_code == 400
    html = bad_header.content.decode()
    assert "The manifest&#x27;s header cannot be used." in html and "(manifest_header: " in html
    assert '<details class="start" id="start" open>' in html and 'role="alert"' in html
    not_a_manifest = c.post("/jobs/", {"source": "manifest", "manifest": csv_file(jpeg_bytes(1), "photo.jpg")})
    assert not_a_manifest.status_code == 415 and "(manifest_format: " in not_a_manifest.content.decode()
    neither = c.post("/jobs/", {"source": "manifest", "name": "x"})
    assert neither.status_code == 400
    assert "Choose a manifest file or give its s3:// address (one of the two)." in neither.content.decode()
    both = c.post("/jobs/", {"source": "manifest", "manifest": csv_file("url\nhttp://e.com/a.jpg\n"),
                             "manifest_key": "s3://photos/c.csv"})
    assert both.status_code == 400 and "(mixed_sources: " in both.content.decode()
    catalogue.SOURCE_BUCKETS = ["photos/allowed/"]
    closed = c.post("/jobs/", {"source": "prefix", "prefix": "s3://photos/private/"})
    assert closed.status_code == 403
    html = closed.content.decode()
    assert "Jobs may not read that bucket or folder here." in html and "(source_not_allowed: " in html
    assert "Buckets open to jobs: <code>s3://photos/allowed/</code>." in html
    assert 'value="s3://photos/private/"' in html  # what was typed stays in the form
    not_s3 = c.post("/jobs/", {"source": "prefix", "prefix": "http://photos/"})
    assert not_s3.status_code == 400 and "(source_uri_invalid: " in not_s3.content.decode()
    late = c.post("/jobs/", {"source": "prefix", "prefix": "s3://photos/allowed/", "deadline": "tomorrow"})
    assert late.status_code == 400 and "Deadline (UTC, optional): Enter a valid date/time." in late.content.decode()
    assert c.post("/jobs/", {"source": "zip"}).status_code == 400
    assert not Job.objects.exists()
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    assert strict.post("/jobs/", {"source": "prefix", "prefix": "s3://photos/allowed/"}).status_code == 403
    assert not Job.objects.exists()


@pytest.fixture
def moto_bucket(catalogue, tmp_path):
    """A real S3 endpoint (moto's server) with bucket ``photos`` open to jobs."""
    from tests.embeddings.test_storage_s3 import MotoServer

    server = MotoServer(tmp_path / "moto.log")
    try:
        server.client().create_bucket(Bucket="photos")
        catalogue.SOURCE_BUCKETS = ["photos"]
        catalogue.SOURCE_S3 = {"endpoint_url": server.url, "region": "us-east-1", "access_key": "testing",
                               "secret_key": "testing", "addressing_style": "path"}
        runtime.source_client.cache_clear()
        yield server
    finally:
        runtime.source_client.cache_clear()
        server.stop()


def test_a_prefix_named_on_the_jobs_page_becomes_a_job(moto_bucket, user):
    s3 = moto_bucket.client()
    s3.put_object(Bucket="photos", Key="2024/a.jpg", Body=jpeg_bytes(70))
    s3.put_object(Bucket="photos", Key="2024/b.JPG", Body=jpeg_bytes(71))
    s3.put_object(Bucket="photos", Key="2024/notes.txt", Body=b"not a photo")
    s3.put_object(Bucket="photos", Key="2023/c.jpg", Body=jpeg_bytes(72))
    c = signed_in(user)
    r = c.post("/jobs/", {"source": "prefix", "prefix": "s3://photos/2024/", "extensions": "jpg"})
    job = Job.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/jobs/{job.id}/"
    assert (job.name, job.total, job.status) == ("s3://photos/2024/", 2, "done")
    html = c.get(r["Location"]).content.decode()
    source = page_text(re.search(r'<section aria-labelledby="source-title".*?</section>', html, re.S).group(0))
    assert source == ("Source Folder in a bucket s3://photos/2024/ Only these endings .jpg Objects listed 2 "
                      "Reading finished")
    assert 'id="job-failures-none" class="hint">None.' in html
    image = Image.objects.get(job=job, origin="s3://photos/2024/a.jpg")
    assert image.status == ImageStatus.EMBEDDED
    page = c.get(f"/images/{image.id}/").content.decode()
    # an s3:// origin is text, not a link
    assert '<dd class="mono" id="origin">s3://photos/2024/a.jpg</dd>' in page


def test_a_job_still_reading_and_a_source_that_could_not_be_read(catalogue, user):
    job = Job.objects.create(owner=user, name="big", model_id=runtime.model_id(), total=120, reading=True,
                             source={"kind": "manifest", "format": "parquet", "key": "s3://photos/big.parquet",
                                     "name": "big.parquet", "bucket": "photos", "rows_read": 120,
                                     "error": {"code": "source_missing",
                                               "message": "s3://photos/big.parquet does not exist"}})
    html = signed_in(user).get(f"/jobs/{job.id}/").content.decode()
    assert '<span id="job-reading" class="badge s-reading">reading its manifest…</span>' in html
    source = page_text(re.search(r'<section aria-labelledby="source-title".*?</section>', html, re.S).group(0))
    assert source == ("Source Manifest s3://photos/big.parquet Format parquet Bucket of bare keys s3://photos "
                      "Rows read 120 Reading reading… The manifest could not be read to the end. "
                      "The stored file is gone. (source_missing: s3://photos/big.parquet does not exist)")
    # a job from uploads has no source section
    plain = Job.objects.create(owner=user, model_id=runtime.model_id(), total=0)
    assert 'id="job-source"' not in signed_in(user).get(f"/jobs/{plain.id}/").content.decode()


def with_metadata(api, items: list[tuple[str, dict]]) -> dict[str, str]:
    """Upload one image per ``(external_id, metadata)``; returns ``{external_id: image id}``."""
    import json

    files = [upload(f"{ext}.jpg", jpeg_bytes(80 + i)) for i, (ext, _) in enumerate(items)]
    r = api.post("/api/images/", {"files": files, "external_id": [e for e, _ in items],
                                  "metadata": [json.dumps(m) for _, m in items], "k": 0}, format="multipart")
    assert r.status_code == 200, r.json()
    return {im["external_id"]: im["id"] for im in r.json()["images"]}


def external_ids(html: str) -> list[str]:
    """The external ids on the result cards, sorted."""
    return sorted(re.findall(r'<span class="ext" title="[^"]*">([^<]+)</span>', html))


CATALOGUE = [
    ("A-1", {"category": "shoes", "price": 49.5, "count": 3, "added": "2024-05-01", "sale": True}),
    ("A-2", {"category": "hats", "price": 12.0, "count": 10, "added": "2024-06-15", "sale": False}),
    ("A-3", {"category": "shoes", "price": 5.0, "count": 7, "added": "2024-05-31T23:00:00Z", "sale": False,
             "size": {"eu": 42, "us": 9}}),
    ("A-4", {"category": "bags"}),
]


def test_the_search_page_filters_by_the_declared_fields(catalogue, api, user):
    ids = with_metadata(api, CATALOGUE)
    c = signed_in(user)
    page = c.get("/search/", {"q": "a photo"})
    html = page.content.decode()
    assert page.status_code == 200 and external_ids(html) == ["A-1", "A-2", "A-3", "A-4"]
    assert re.findall(r'name="(m-[^"]+)"', html) == ["m-category", "m-price-min", "m-price-max", "m-count-min",
                                                     "m-count-max", "m-added-from", "m-added-to", "m-sale"]
    # numbers are text inputs with a numeric keyboard: maxlength does not apply to type="number"
    assert re.findall(r'type="(\w+)" name="m-', html) == ["text", "text", "text", "text", "text", "date", "date"]
    assert re.findall(r'inputmode="(\w+)"', html) == ["decimal", "decimal", "numeric", "numeric"]
    cases = [
        ({"m-category": "shoes"}, ["A-1", "A-3"]),
        ({"m-price-min": "10"}, ["A-1", "A-2"]),
        ({"m-price-min": "5", "m-price-max": "12"}, ["A-2", "A-3"]),  # both bounds included
        ({"m-category": "shoes", "m-count-max": "5"}, ["A-1"]),
        ({"m-count-min": "7"}, ["A-2", "A-3"]),
        ({"m-added-from": "2024-05-01", "m-added-to": "2024-05-31"}, ["A-1", "A-3"]),  # the last day included
        ({"m-added-to": "2024-05-30"}, ["A-1"]),
        ({"m-sale": "no"}, ["A-2", "A-3"]),
        ({"m-sale": "yes", "m-category": "hats"}, []),
        ({"m-sale": "", "m-category": ""}, ["A-1", "A-2", "A-3", "A-4"]),  # empty inputs filter nothing
    ]
    for params, expected in cases:
        r = c.get("/search/", {"q": "a photo", **params})
        assert r.status_code == 200, params
        assert external_ids(r.content.decode()) == expected, params
    # the filter goes with "more like this", into the image search form, and stays in its inputs
    html = c.get("/search/", {"q": "a photo", "m-category": "shoes"}).content.decode()
    assert html.count("&amp;m-category=shoes\" aria-label=\"More like") == 2
    assert '<input type="hidden" name="m-category" value="shoes">' in html
    assert 'name="m-category" value="shoes"' in html
    like = c.get("/search/", {"like": ids["A-2"], "m-category": "shoes"})
    assert external_ids(like.content.decode()) == ["A-1", "A-3"]
    from django.core.files.uploadedfile import SimpleUploadedFile

    by_image = c.post("/search/", {"image": SimpleUploadedFile("q.jpg", jpeg_bytes(81), "image/jpeg"),
                                   "m-price-max": "20"})
    assert by_image.status_code == 200 and external_ids(by_image.content.decode()) == ["A-2", "A-3"]
    # what is not a number or a date is refused in words, nothing searched
    bad = c.get("/search/", {"q": "a photo", "m-price-min": "cheap"})
    assert bad.status_code == 400 and "price (min): Enter a number." in bad.content.decode()
    assert "/thumbnail/" not in bad.content.decode()
    long = c.get("/search/", {"q": "a photo", "m-category": "x" * 300})
    assert long.status_code == 400 and "category: Ensure this value has at most 256 characters" in long.content.decode()


def test_result_cards_show_the_external_id_and_metadata_compactly(catalogue, api, user):
    with_metadata(api, CATALOGUE)
    html = signed_in(user).get("/search/", {"q": "a photo", "m-category": "shoes", "m-price-max": "6"}).content.decode()
    card = re.search(r'<li class="card">.*?</li>', html, re.S).group(0)
    assert '<span class="ext" title="your id: A-3">A-3</span>' in card
    pairs = re.findall(r"<div><dt>([^<]+)</dt><dd>([^<]+)</dd></div>", card)
    assert pairs == [("category", "shoes"), ("price", "5.0"), ("count", "7")]  # the first three
    assert "+4 more" in card  # added, sale, size.eu, size.us
    assert 'title="category: shoes; price: 5.0; count: 7; added: 2024-05-31T23:00:00Z; sale: false; size.eu: 42; ' \
           'size.us: 9"' in card


def test_no_declared_fields_no_filter_inputs(service, api, user):
    uploaded(api, "a.jpg", jpeg_bytes(90))
    html = signed_in(user).get("/search/", {"q": "a photo", "m-category": "shoes"}).content.decode()
    assert 'name="m-' not in html and 'id="filters"' not in html
    assert len(re.findall(r'/thumbnail/"', html)) == 1  # an input for an undeclared field filters nothing
    assert '<span class="ext"' not in html and '<dl class="kv"' not in html  # no id, no metadata


def test_the_image_page_shows_the_external_id_metadata_and_origin(catalogue, api, user, origin):
    ids = with_metadata(api, CATALOGUE)
    c = signed_in(user)
    html = c.get(f"/images/{ids['A-3']}/").content.decode()
    assert '<dd class="mono" id="external-id">A-3</dd>' in html and 'id="origin"' not in html
    meta = re.search(r'<dl class="pairs">(.*?)</dl>', html, re.S).group(1)
    assert re.findall(r"<div><dt>([^<]+)</dt><dd>([^<]+)</dd></div>", meta) == [
        ("category", "shoes"), ("price", "5.0"), ("count", "7"), ("added", "2024-05-31T23:00:00Z"), ("sale", "false"),
        ("size.eu", "42"), ("size.us", "9")]
    # a row of a manifest: its origin (a link for http), its row; a row waiting to take an id
    r = c.post("/jobs/", {"source": "manifest", "manifest": csv_file(f"url,external_id\n{origin.url}/img/5.jpg,A-9\n")})
    row = Image.objects.get(job_id=r["Location"].split("/")[2])
    Image.objects.filter(id=row.id).update(claimed_external_id="A-1")
    html = c.get(f"/images/{row.id}/").content.decode()
    assert (f'<dd class="mono" id="origin"><a href="{origin.url}/img/5.jpg" rel="noopener noreferrer nofollow">'
            f'{origin.url}/img/5.jpg</a></dd>') in html
    assert '<dd class="mono" id="external-id">A-9</dd>' in html
    assert '<span class="mono" id="pending-external-id">A-1</span>' in html
    assert "<div><dt>Manifest row</dt><dd>1</dd></div>" in html
    assert 'id="metadata-title">Metadata</h2>\n    <p class="hint">None.</p>' in html


def test_the_filter_form_builds_the_filter_json():
    from embeddings.site.fields import FilterForm

    declared = {"category": "keyword", "price": "float", "count": "integer", "added": "datetime", "sale": "bool",
                "size.eu": "integer"}
    assert FilterForm(declared).where() is None  # unbound: no filter
    assert FilterForm(declared, {"m-category": " "}).where() is None
    assert FilterForm(declared, {"m-category": "shoes"}).where() == {"field": "category", "eq": "shoes"}
    assert FilterForm(declared, {"m-price-min": "1.5", "m-count-max": "7", "m-sale": "no",
                                 "m-added-from": "2024-05-01", "m-added-to": "2024-05-31",
                                 "m-size.eu-min": "40"}).where() == {"and": [
        {"field": "price", "gte": 1.5}, {"field": "count", "lte": 7},
        {"field": "added", "gte": "2024-05-01", "lt": "2024-06-01"}, {"field": "sale", "eq": False},
        {"field": "size.eu", "gte": 40}]}
    assert FilterForm(declared, {"m-price-min": "nan"}).is_valid() is False


# --- search by examples and diverse results on the page (issue 45) ---------------------------------

@pytest.fixture
def gallery(service, api):
    """Six embedded images of ``user`` named g0..g5 → (ids, {id: stored unit vector as float64})."""
    from embeddings import spaces

    ids = [uploaded(api, f"g{i}.jpg", jpeg_bytes(4600 + i))["id"] for i in range(6)]
    points = {str(im.id): uuid.UUID(str(im.point_id)) for im in Image.objects.filter(id__in=ids)}
    got = runtime.vector_store(spaces.active().model_id).vectors(list(points.values()))
    vectors = {i: np.asarray(got[points[i]], np.float64) for i in ids}
    return ids, {i: v / np.linalg.norm(v) for i, v in vectors.items()}


def api_ids(api, body: dict) -> list[str]:
    """The image ids the API answers for a search ``body`` (k = the page's 50), best first."""
    r = api.post("/api/search/", {"k": 50, **body}, format="json")
    assert r.status_code == 200, r.json()
    return [h["image_id"] for h in r.json()["results"]]


def examples_form(html: str) -> str:
    """The search page's examples form ("search again with the selected"), as HTML."""
    return re.search(r'<form method="post" action="/search/" id="examples-search".*?</form>', html, re.S).group(0)


def hidden(form: str) -> list[tuple[str, str]]:
    """A form's hidden inputs ``(name, value)``, in order."""
    return re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form)


def error_of(html: str) -> str:
    """The page's refusal as shown: its words, then "(code: the API's message)"."""
    return re.sub(r"<[^>]+>", "", re.search(r'<p class="error" role="alert">(.*?)</p>', html, re.S).group(1))


def test_each_result_has_a_tick_and_a_cross_and_the_query_is_the_first_example(gallery, user):
    ids, _ = gallery
    c = signed_in(user)
    html = c.get("/search/", {"q": "a photo"}).content.decode()
    shown = card_ids(html)
    assert sorted(shown) == sorted(ids)
    # every card: a tick (positive) and a cross (negative) of its own id, both in the examples form
    for side in ("positive", "negative"):
        assert re.findall(rf'<input type="checkbox" name="{side}" value="([0-9a-f-]+)" form="examples-search">',
                          html) == shown
    form = examples_form(html)
    assert hidden(form) == [("csrfmiddlewaretoken", hidden(form)[0][1]), ("by", "examples"), ("job", ""),
                            ("positive_text", "a photo")]  # the text query, kept as a positive
    assert 'name="remove" value="positive_text:a photo"' in form
    assert re.findall(r'<option value="(\w+)"( selected)?>', form) == [
        ("best_score", ""), ("sum_scores", ""), ("average_vector", "")]  # best score: the first, the default
    # the diversity toggle: off, sends 0.5 when ticked
    assert '<input id="diverse" name="diversity" type="checkbox" value="0.5">' in html
    # "more like this": the image is the kept positive, shown by its name and thumbnail
    like = c.get("/search/", {"like": ids[2]}).content.decode()
    form = examples_form(like)
    assert hidden(form)[-1] == ("positive", ids[2])
    assert f'<img src="/api/images/{ids[2]}/thumbnail/" alt="" width="32" height="32">' in form
    assert ">g2.jpg</a>" in form
    # a search by an uploaded image keeps no example (its bytes are gone once it is answered)
    from django.core.files.uploadedfile import SimpleUploadedFile

    query = SimpleUploadedFile("q.jpg", jpeg_bytes(4601), "image/jpeg")
    by_image = c.post("/search/", {"image": query}).content.decode()
    assert [n for n, _ in hidden(examples_form(by_image))] == ["csrfmiddlewaretoken", "by", "job"]
    assert len(card_ids(by_image)) == 6
    # the image page's neighbours carry no tick or cross (no examples form there)
    assert 'form="examples-search"' not in c.get(f"/images/{ids[0]}/").content.decode()


def test_search_again_with_the_selected_runs_the_apis_search_by_examples(gallery, api, user):
    ids, vec = gallery
    c = signed_in(user)
    # after a text search: the query kept, two results ticked and one crossed
    r = c.post("/search/", {"by": "examples", "positive_text": "a photo", "positive": [ids[0], ids[1]],
                            "negative": [ids[2]]})
    assert r.status_code == 200
    html = r.content.decode()
    want = api_ids(api, {"positive": [{"text": "a photo"}, {"image_id": ids[0]}, {"image_id": ids[1]}],
                         "negative": [{"image_id": ids[2]}]})
    assert card_ids(html) == want and sorted(want) == sorted(ids[3:])  # the examples left out of the hits
    assert "Results for your examples" in html and 'title="score of the strategy, not a cosine"' in html
    # best_score (Qdrant's formula, docs/search.md): a hit nearer the crossed image than to both
    # ticked ones scores below 0, every other above
    sig = lambda x: (x / (1 + abs(x)) + 1) / 2
    best = lambda i: max(vec[i] @ vec[ids[0]], vec[i] @ vec[ids[1]])
    score = lambda i: sig(best(i)) if best(i) > vec[i] @ vec[ids[2]] else -sig(vec[i] @ vec[ids[2]])
    stored = c.post("/search/", {"by": "examples", "positive": [ids[0], ids[1]], "negative": [ids[2]]}).content.decode()
    assert card_ids(stored) == sorted(ids[3:], key=lambda i: -score(i))
    shown = [float(x) for x in re.findall(r'<span class="score"[^>]*>([-0-9.]+)</span>', stored)]
    assert shown == pytest.approx([score(i) for i in card_ids(stored)], abs=5e-4)
    # the examples stay above the results, in order (texts first), each with its remove button
    form = examples_form(html)
    assert [kv for kv in hidden(form) if kv[0] in ("positive", "negative", "positive_text")] == [
        ("positive_text", "a photo"), ("positive", ids[0]), ("positive", ids[1]), ("negative", ids[2])]
    assert re.findall(r'name="remove" value="([^"]+)"', form) == [
        "positive_text:a photo", f"positive:{ids[0]}", f"positive:{ids[1]}", f"negative:{ids[2]}"]
    assert form.count('<li class="chip positive">') == 3 and form.count('<li class="chip negative">') == 1
    # a result ticked again (a repeat) counts once; "remove" drops that one example and searches again
    again = c.post("/search/", {"by": "examples", "positive_text": "a photo", "positive": [ids[0], ids[1], ids[0]],
                                "negative": [ids[2]], "remove": f"negative:{ids[2]}"}).content.decode()
    assert card_ids(again) == api_ids(api, {"positive": [{"text": "a photo"}, {"image_id": ids[0]},
                                                         {"image_id": ids[1]}]})
    assert f"negative:{ids[2]}" not in examples_form(again) and len(card_ids(again)) == 4
    # the strategy select
    summed = c.post("/search/", {"by": "examples", "positive": [ids[3], ids[4]], "negative": [ids[5]],
                                 "strategy": "sum_scores"}).content.decode()
    assert card_ids(summed) == api_ids(api, {"positive": [{"image_id": ids[3]}, {"image_id": ids[4]}],
                                             "negative": [{"image_id": ids[5]}], "strategy": "sum_scores"})
    want = sorted(ids[:3], key=lambda i: -(vec[i] @ vec[ids[3]] + vec[i] @ vec[ids[4]] - vec[i] @ vec[ids[5]]))
    assert card_ids(summed) == want
    assert '<option value="sum_scores" selected>' in examples_form(summed)


def test_search_by_examples_in_a_job(gallery, api, user):
    r = api.post("/api/jobs/", {"files": [upload("j1.jpg", jpeg_bytes(4610)), upload("j2.jpg", jpeg_bytes(4611))],
                                "name": "two"}, format="multipart")
    job_id = r.json()["id"]
    in_job = set(Image.objects.filter(job_id=job_id).values_list("id", flat=True))
    ids, _ = gallery
    html = signed_in(user).post("/search/", {"by": "examples", "positive": [ids[0]], "job": job_id}).content.decode()
    assert {uuid.UUID(i) for i in card_ids(html)} == in_job
    assert ("job", job_id) in hidden(examples_form(html))


def test_diverse_results_on_every_kind_of_search(gallery, api, user):
    ids, vec = gallery
    c = signed_in(user)
    # "more like this" with diversity 1: the image itself, then each time the one least like those picked
    page = c.get("/search/", {"like": ids[0], "diversity": "1"})
    assert page.status_code == 200
    assert card_ids(page.content.decode()) == picked_from(ids[0], ids, vec) == api_ids(api, {"image_id": ids[0],
                                                                                             "diversity": 1})
    # the toggle (0.5): a text search, checked after it, carried by "more like this" and the other forms
    html = c.get("/search/", {"q": "a photo", "diversity": "0.5"}).content.decode()
    assert card_ids(html) == api_ids(api, {"text": "a photo", "diversity": 0.5})
    assert '<input id="diverse" name="diversity" type="checkbox" value="0.5" checked>' in html
    assert html.count('&amp;diversity=0.5" aria-label="More like') == 6
    image_form = re.search(r'id="image-search".*?</form>', html, re.S).group(0)
    assert '<input type="hidden" name="diversity" value="0.5">' in image_form
    assert ("diversity", "0.5") in hidden(examples_form(html)) and '<span class="badge">diverse</span>' in html
    # a search by examples and a search by an uploaded image
    ex = c.post("/search/", {"by": "examples", "positive": [ids[1], ids[2]], "negative": [ids[3]], "diversity": "0.5"})
    assert card_ids(ex.content.decode()) == api_ids(api, {"positive": [{"image_id": ids[1]}, {"image_id": ids[2]}],
                                                          "negative": [{"image_id": ids[3]}], "diversity": 0.5})
    from django.core.files.uploadedfile import SimpleUploadedFile

    query = SimpleUploadedFile("q.jpg", jpeg_bytes(4604), "image/jpeg")  # g4's bytes
    by_image = c.post("/search/", {"image": query, "diversity": "1"})
    assert card_ids(by_image.content.decode()) == picked_from(ids[4], ids, vec)
    # 0 or no diversity: the plain top-k, nothing carried
    plain = c.get("/search/", {"like": ids[0], "diversity": "0"}).content.decode()
    assert card_ids(plain) == api_ids(api, {"image_id": ids[0]}) and "diversity=" not in plain


def picked_from(first: str, ids: list[str], vec: dict) -> list[str]:
    """MMR with diversity 1 from the image ``first`` (a copy of it is the query): the query's nearest
    (itself), then each time the image least like those picked."""
    picked = [first]
    while len(picked) < len(ids):
        picked.append(min((i for i in ids if i not in picked), key=lambda i: max(vec[i] @ vec[p] for p in picked)))
    return picked


def test_refusals_of_a_search_by_examples_are_shown_with_the_apis_message(gallery, api, user, other_user):
    ids, _ = gallery
    theirs = uploaded(client_for(other_user), "theirs.jpg", jpeg_bytes(4620))
    c = signed_in(user)
    cases = [
        ({"negative": [ids[0]]}, 400,
         "positive_required: a multi-example search needs at least one positive example"),
        ({"positive_text": "a photo", "remove": "positive_text:a photo", "negative": [ids[0]]}, 400,
         "positive_required: a multi-example search needs at least one positive example"),
        ({"positive": [str(uuid.UUID(int=n)) for n in range(40)],
          "negative": [str(uuid.UUID(int=1000 + n)) for n in range(25)]}, 400,
         "too_many_examples: 65 examples; at most MAX_EXAMPLES = 64 in one search"),
        ({"positive": [str(uuid.UUID(int=n)) for n in range(65)]}, 400,
         "too_many_examples: 65 positive examples; at most MAX_EXAMPLES = 64"),
        ({"positive": [ids[0], theirs["id"]]}, 404, "not_found: no such image"),
        ({"positive": [ids[0], "nonsense"]}, 400, "invalid_example: positive[1]: image_id is not a UUID"),
        ({"positive": [ids[0]], "diversity": "2"}, 400,
         "invalid: Diversity: Ensure this value is less than or equal to 1."),
        ({"positive": [ids[0]], "diversity": "nan"}, 400, "invalid: Diversity: Enter a number."),
        ({"positive": [ids[0]], "strategy": "worst_score"}, 400,
         "invalid: Strategy: Select a valid choice. worst_score is not one of the available choices."),
        ({"positive": [ids[0]], "job": "nonsense"}, 400, "invalid: that is not an image or job id"),
    ]
    for body, status, shown in cases:
        r = c.post("/search/", {"by": "examples", **body})
        html = r.content.decode()
        assert r.status_code == status, body
        assert error_of(html).endswith(f"({shown})"), (body, error_of(html))
        assert card_ids(html) == [], body  # nothing searched
        assert "theirs.jpg" not in html and f'/api/images/{theirs["id"]}/thumbnail/' not in html
    # the examples stay on the page, so one can be removed
    r = c.post("/search/", {"by": "examples", "positive": [ids[0], theirs["id"]]}).content.decode()
    assert re.findall(r'name="remove" value="([^"]+)"', examples_form(r)) == [f"positive:{ids[0]}",
                                                                               f"positive:{theirs['id']}"]
    assert error_of(r).startswith("There is no such image or job (or it is not yours).")
    assert error_of(c.post("/search/", {"by": "examples", "negative": [ids[0]]}).content.decode()).startswith(
        "Tick at least one result you want more of")
    # the same refusals on a plain search's diversity, nothing searched
    for value, words in (("1.5", "Ensure this value is less than or equal to 1."),
                         ("-0.1", "Ensure this value is greater than or equal to 0."), ("inf", "Enter a number.")):
        r = c.get("/search/", {"q": "a photo", "diversity": value})
        assert r.status_code == 400 and words in error_of(r.content.decode()) and card_ids(r.content.decode()) == []


def test_a_search_by_examples_needs_the_csrf_token(gallery, user):
    ids, _ = gallery
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    assert strict.post("/search/", {"by": "examples", "positive": [ids[0]]}).status_code == 403
    page = strict.get("/search/", {"q": "a photo"}).content.decode()
    token = dict(hidden(examples_form(page)))["csrfmiddlewaretoken"]
    r = strict.post("/search/", {"by": "examples", "positive": [ids[0]], "csrfmiddlewaretoken": token})
    assert r.status_code == 200 and len(card_ids(r.content.decode())) == 5
