"""Issue 41: catalogue jobs from a manifest of URLs, keyed by the caller's ids and metadata, through the
API in one process (eager Celery: job_read → fetch_chunk → embed_chunk → index_chunk run inline), with
URLs served by a real local HTTP server and the real edge store."""
from __future__ import annotations

import io
import re
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from embeddings import runtime
from embeddings.models import Image, ImageStatus, Job, JobStatus
from embeddings.services.catalogue import manifests
from tests.conftest import SHARED
from tests.embeddings.conftest import client_for
from tests.origin_server import pixels_jpeg

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def catalogue(service, origin):
    """The service allowed to fetch from the test server on 127.0.0.1 (refused by default)."""
    service.FETCH_ALLOW_NETWORKS = ["127.0.0.1/32"]
    service.FETCH_RETRIES = 1
    service.METADATA_INDEXES = "category:keyword,price:float"
    runtime.fetcher.cache_clear()
    yield service
    runtime.fetcher.cache_clear()


def manifest(text: str, name: str = "catalogue.csv") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, text.encode(), content_type="text/csv")


def post_manifest(api, text: str, **fields):
    r = api.post("/api/jobs/", {"manifest": manifest(text), **fields}, format="multipart")
    assert r.status_code == 202, r.json()
    assert r.json()["reading"] is True
    return Job.objects.get(id=r.json()["id"])


def rows_by(job) -> dict[int, Image]:
    return {im.row: im for im in Image.objects.filter(job=job)}


def test_a_manifest_of_urls_becomes_a_job_with_ids_metadata_and_per_row_errors(catalogue, api, origin):
    base = origin.url
    text = (
        "url,external_id,category,price\n"
        f"{base}/pixels/{0}.jpg,SKU-1,shoes,49.5\n"
        f"{base}/pixels/{1}.jpg,SKU-2,hats,12\n"
        f"{base}/status/404,SKU-3,shoes,5\n"
        "file:///etc/passwd,SKU-4,shoes,1\n"
        f"{base}/pixels/{2}.jpg,SKU-1,shoes,3\n"  # SKU-1 again: an error of this row, the first keeps it
        f"{base}/pixels/{0}.jpg?again=1,SKU-6,bags,7\n"  # the same bytes as row 1 behind another URL
    )
    job = post_manifest(api, text)
    job.refresh_from_db()
    assert job.status == JobStatus.DONE and not job.reading and job.total == 6
    rows = rows_by(job)
    assert {n: (im.status, im.reason) for n, im in rows.items()} == {
        1: (ImageStatus.EMBEDDED, ""), 2: (ImageStatus.EMBEDDED, ""), 3: (ImageStatus.FAILED, "fetch_status"),
        4: (ImageStatus.FAILED, "url_invalid"), 5: (ImageStatus.FAILED, "external_id_repeated"),
        6: (ImageStatus.SKIPPED, ""),
    }
    assert rows[6].duplicate_of_id == rows[1].id  # content-addressed: one original, one vector
    assert (rows[1].external_id, rows[1].metadata) == ("SKU-1", {"category": "shoes", "price": 49.5})
    assert rows[2].metadata == {"category": "hats", "price": 12.0}  # a declared float column
    assert rows[1].origin == f"{base}/pixels/0.jpg" and rows[1].original_name == "0.jpg"
    progress = api.get(f"/api/jobs/{job.id}/").json()
    assert progress["failure_reasons"] == {"external_id_repeated": 1, "fetch_status": 1, "url_invalid": 1}
    assert [f["row"] for f in progress["failures"]] == [3, 4, 5]
    # the point's payload carries the caller's id and metadata, item by item
    payload = runtime.vector_store().payloads([rows[1].point_id])[rows[1].point_id]
    assert payload["items"] == [{"image": str(rows[1].id), "owner": job.owner_id, "job": str(job.id),
                                 "external_id": "SKU-1", "m": {"category": "shoes", "price": 49.5}}]
    found = api.get("/api/images/", {"external_id": "SKU-2"}).json()["results"]
    assert [(im["id"], im["metadata"]) for im in found] == [(str(rows[2].id), {"category": "hats", "price": 12.0})]


def test_a_search_filters_on_metadata_inside_the_query(catalogue, api, origin):
    text = "url,external_id,category,price\n" + "".join(
        f"{origin.url}/pixels/{i}.jpg,SKU-{i},{'shoes' if i % 2 else 'hats'},{10 * i}\n" for i in range(6))
    post_manifest(api, text)
    r = api.post("/api/search/", {"text": "a photo", "k": 10, "min_score": -1,
                                  "filter": {"and": [{"field": "category", "eq": "shoes"},
                                                     {"field": "price", "lt": 45}]}}, format="json")
    assert r.status_code == 200, r.json()
    got = r.json()["results"]
    assert sorted(h["external_id"] for h in got) == ["SKU-1", "SKU-3"]
    assert all(h["metadata"]["category"] == "shoes" for h in got)
    bad = api.post("/api/search/", {"text": "a photo", "filter": {"and": [{"field": "price", "between": 3}]}},
                   format="json")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_filter"
    assert bad.json()["extra"]["path"].startswith("and[0]")


def test_the_same_id_with_the_same_bytes_is_skipped_and_with_new_bytes_replaces(catalogue, api, origin):
    first = post_manifest(api, f"url,external_id,category\n{origin.url}/pixels/{0}.jpg,SKU-1,shoes\n"
                               f"{origin.url}/pixels/{1}.jpg,SKU-2,hats\n")
    one, two = rows_by(first)[1], rows_by(first)[2]
    # same bytes for SKU-1 (new metadata), new bytes for SKU-2
    second = post_manifest(api, f"url,external_id,category\n{origin.url}/pixels/{0}.jpg?v=2,SKU-1,boots\n"
                                f"{origin.url}/pixels/{3}.jpg,SKU-2,caps\n")
    again, new = rows_by(second)[1], rows_by(second)[2]
    one.refresh_from_db()
    assert (again.status, again.duplicate_of_id, again.external_id) == (ImageStatus.SKIPPED, one.id, "")
    assert (one.external_id, one.metadata) == ("SKU-1", {"category": "boots"})
    assert not Image.objects.filter(id=two.id).exists()  # replaced: its row and its vector went
    assert (new.status, new.external_id) == (ImageStatus.EMBEDDED, "SKU-2")
    store = runtime.vector_store()
    assert store.payloads([one.point_id])[one.point_id]["items"][0]["m"] == {"category": "boots"}
    assert store.payloads([two.point_id]) == {}


def test_a_url_that_fails_leaves_the_holder_of_its_id_alone(catalogue, api, origin):
    first = post_manifest(api, f"url,external_id\n{origin.url}/pixels/{0}.jpg,SKU-1\n")
    holder = rows_by(first)[1]
    second = post_manifest(api, f"url,external_id\n{origin.url}/status/500,SKU-1\n")
    failed = rows_by(second)[1]
    assert (failed.status, failed.reason, failed.claimed_external_id) == (ImageStatus.FAILED, "fetch_status", "SKU-1")
    holder.refresh_from_db()
    assert (holder.status, holder.external_id) == (ImageStatus.EMBEDDED, "SKU-1")


def test_uploads_carry_ids_and_metadata_and_patch_moves_the_payload(catalogue, api, user, other_user):
    data = [pixels_jpeg(0), pixels_jpeg(1)]
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("a.jpg", data[0]), SimpleUploadedFile("b.jpg", data[1])],
                                  "external_id": ["A-1", "A-2"], "metadata": ['{"category": "shoes"}']},
                 format="multipart")
    assert r.status_code == 200, r.json()
    a, b = r.json()["images"]
    assert (a["external_id"], a["metadata"], b["external_id"]) == ("A-1", {"category": "shoes"}, "A-2")
    patched = api.patch(f"/api/images/{a['id']}/", {"metadata": {"category": "boots", "size": 42}}, format="json")
    assert patched.status_code == 200 and patched.json()["metadata"] == {"category": "boots", "size": 42}
    im = Image.objects.get(id=a["id"])
    assert runtime.vector_store().payloads([im.point_id])[im.point_id]["items"][0]["m"] == {"category": "boots",
                                                                                           "size": 42}
    taken = api.patch(f"/api/images/{a['id']}/", {"external_id": "A-2"}, format="json")
    assert taken.status_code == 409 and taken.json()["code"] == "external_id_taken"
    assert taken.json()["extra"]["image_id"] == b["id"]
    deep = api.patch(f"/api/images/{a['id']}/", {"metadata": {"a": {"b": {"c": {"d": 1}}}}}, format="json")
    assert deep.status_code == 400 and deep.json()["code"] == "metadata_too_deep"
    unknown = api.patch(f"/api/images/{a['id']}/", {"sha256": "0" * 64}, format="json")
    assert unknown.status_code == 400
    # another owner's images are not found by id, external id, or PATCH
    bob = client_for(other_user)
    assert bob.get("/api/images/", {"external_id": "A-1"}).json()["results"] == []
    assert bob.patch(f"/api/images/{a['id']}/", {"metadata": {}}, format="json").status_code == 404
    repeated = api.post("/api/images/", {"files": [SimpleUploadedFile("c.jpg", data[0]),
                                                   SimpleUploadedFile("d.jpg", data[1])],
                                         "external_id": ["X", "X"]}, format="multipart")
    assert repeated.status_code == 400 and repeated.json()["code"] == "external_id_repeated"


#: The issue 53 case: five rows whose ids are ``Café-1`` in NFC then NFD, ``Å-2`` as U+00C5 then
#: U+212B, and ``plain-3``; ``ORIGIN`` stands for the origin serving five different images.
LOOKALIKE_CASE = SHARED / "data" / "cases" / "w03_lookalike_ids.csv"
LOOKALIKE_TEXT = ("url,external_id,category\r\n"
                  "http://ORIGIN/a.jpg,Caf\u00e9-1,shoes\r\nhttp://ORIGIN/b.jpg,Cafe\u0301-1,shoes\r\n"
                  "http://ORIGIN/c.jpg,\u00c5-2,bags\r\nhttp://ORIGIN/d.jpg,\u212b-2,bags\r\n"
                  "http://ORIGIN/e.jpg,plain-3,hats\r\n")


@pytest.mark.parametrize("case", ["generated", "shared"])
def test_ids_that_look_the_same_are_one_id_at_every_door(case, catalogue, api, origin, staff):
    if case == "shared":
        if not LOOKALIKE_CASE.exists():
            pytest.skip("../shared/data/cases is not present")
        text = LOOKALIKE_CASE.read_bytes().decode("utf-8")
        assert text == LOOKALIKE_TEXT  # the case is the one generated here
    else:
        text = LOOKALIKE_TEXT
    text = re.sub(r"http://ORIGIN/([a-e])\.jpg", lambda m: f"{origin.url}/pixels/{'abcde'.index(m[1])}.jpg", text)
    job = post_manifest(api, text)
    job.refresh_from_db()
    assert job.status == JobStatus.DONE and job.total == 5
    rows = rows_by(job)
    # the second row of each pair is a repeated id within the manifest, as an exact repeat is
    assert {n: (im.status, im.reason, im.external_id) for n, im in rows.items()} == {
        1: (ImageStatus.EMBEDDED, "", "Caf\u00e9-1"), 2: (ImageStatus.FAILED, "external_id_repeated", ""),
        3: (ImageStatus.EMBEDDED, "", "\u00c5-2"), 4: (ImageStatus.FAILED, "external_id_repeated", ""),
        5: (ImageStatus.EMBEDDED, "", "plain-3")}
    assert rows[2].reason_detail == "external_id 'Café-1' is given by an earlier row of this manifest"
    # a lookup by either spelling finds it: the API, a search filter, the admin's search
    for spellings, row in ((("Caf\u00e9-1", "Cafe\u0301-1"), rows[1]), (("\u00c5-2", "\u212b-2"), rows[3])):
        for spelling in spellings:
            found = api.get("/api/images/", {"external_id": spelling}).json()["results"]
            assert [im["id"] for im in found] == [str(row.id)]
            hits = api.post("/api/search/", {"text": "a photo", "k": 10, "min_score": -1,
                                             "filter": {"field": "external_id", "eq": spelling}}, format="json")
            assert [h["image_id"] for h in hits.json()["results"]] == [str(row.id)]
            listed = admin_client(staff).get("/admin/embeddings/image/", {"q": spelling}).content.decode()
            assert f"/admin/embeddings/image/{row.id}/change/" in listed
            assert f"/admin/embeddings/image/{rows[5].id}/change/" not in listed
    # PATCH: the other spelling of a held id is that id; a new one is stored in NFC
    taken = api.patch(f"/api/images/{rows[5].id}/", {"external_id": "Cafe\u0301-1"}, format="json")
    assert taken.status_code == 409 and taken.json()["code"] == "external_id_taken"
    renamed = api.patch(f"/api/images/{rows[5].id}/", {"external_id": "\u212b-9"}, format="json")
    assert renamed.status_code == 200 and renamed.json()["external_id"] == "\u00c5-9"
    same = api.patch(f"/api/images/{rows[5].id}/", {"external_id": "\u00c5-9"}, format="json")
    assert same.status_code == 200
    im = Image.objects.get(id=rows[5].id)
    assert runtime.vector_store().payloads([im.point_id])[im.point_id]["items"][0]["external_id"] == "\u00c5-9"
    # an upload: two spellings of one id in one request are a repeat; the other spelling of a held
    # id with other bytes replaces its holder, as the same spelling does
    files = [SimpleUploadedFile("x.jpg", pixels_jpeg(7)), SimpleUploadedFile("y.jpg", pixels_jpeg(8))]
    repeated = api.post("/api/images/", {"files": files, "external_id": ["new-\u00e9", "new-e\u0301"]},
                        format="multipart")
    assert repeated.status_code == 400 and repeated.json()["code"] == "external_id_repeated"
    again = api.post("/api/images/", {"files": [SimpleUploadedFile("z.jpg", pixels_jpeg(9))],
                                      "external_id": ["Cafe\u0301-1"]}, format="multipart")
    assert again.status_code == 200, again.json()
    assert again.json()["images"][0]["external_id"] == "Caf\u00e9-1"
    assert not Image.objects.filter(id=rows[1].id).exists()
    assert [str(i) for i in Image.objects.filter(owner=job.owner, external_id__in=["Caf\u00e9-1", "Cafe\u0301-1"])
            .values_list("id", flat=True)] == [again.json()["images"][0]["id"]]


def admin_client(staff) -> Client:
    client = Client()
    client.force_login(staff)
    return client


def test_a_manifest_with_a_wrong_header_is_refused_before_any_job(catalogue, api):
    r = api.post("/api/jobs/", {"manifest": manifest("image,sku\nhttp://example.com/a.jpg,1\n")}, format="multipart")
    assert r.status_code == 400 and r.json()["code"] == "manifest_header"
    assert not Job.objects.exists()


def test_a_parquet_row_group_over_the_bound_is_refused_before_any_job(catalogue, api, monkeypatch):
    monkeypatch.setattr(manifests, "MAX_ROW_GROUP_ROWS", 10)
    table = pa.table({"url": [f"http://example.com/{i}.jpg" for i in range(30)]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=12)
    upload = SimpleUploadedFile("catalogue.parquet", buffer.getvalue(), content_type="application/octet-stream")
    r = api.post("/api/jobs/", {"manifest": upload}, format="multipart")
    assert r.status_code == 413 and r.json()["code"] == "manifest_row_group_too_large"
    assert r.json()["extra"] == {"row_group": 0, "row": 1}
    assert not Job.objects.exists()


def test_one_job_reads_one_source(catalogue, api):
    r = api.post("/api/jobs/", {"manifest": manifest("url\nhttp://example.com/a.jpg\n"), "prefix": "s3://b/p"},
                 format="multipart")
    assert r.status_code == 400 and r.json()["code"] == "mixed_sources"


def test_a_prefix_outside_the_allowed_buckets_is_forbidden(catalogue, api):
    catalogue.SOURCE_BUCKETS = ["photos/allowed/"]
    r = api.post("/api/jobs/", {"prefix": "s3://photos/private/"}, format="json")
    assert r.status_code == 403 and r.json()["code"] == "source_not_allowed"
    assert api.post("/api/jobs/", {"prefix": "s3://other/"}, format="json").json()["code"] == "source_not_allowed"


def test_a_read_that_dies_part_way_continues_after_the_rows_it_made(catalogue, api, origin, monkeypatch):
    """A redelivered read (its worker died after some slices) makes each row once."""
    from embeddings import dispatch
    from embeddings.services.catalogue import reading

    monkeypatch.setattr(dispatch, "send_job_read", lambda **kw: None)  # made, not read yet
    job = post_manifest(api, "url\n" + "".join(f"{origin.url}/pixels/{i}.jpg\n" for i in range(3)))
    Job.objects.filter(id=job.id).update(chunk_size=1)
    real, calls = reading._store_slice, []

    def dies_on_the_second_slice(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("the fetch worker lost its database")
        return real(*args, **kwargs)

    monkeypatch.setattr(reading, "_store_slice", dies_on_the_second_slice)
    with pytest.raises(ConnectionError):
        reading.job_read(job_id=str(job.id))
    assert Job.objects.get(id=job.id).source["rows_read"] == 1
    assert reading.job_read(job_id=str(job.id)) == {"rows": 2, "rows_read": 3}
    assert sorted(Image.objects.filter(job=job).values_list("row", flat=True)) == [1, 2, 3]
    job.refresh_from_db()
    assert (job.total, job.reading, job.status) == (3, False, JobStatus.DONE)


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    from tests.embeddings.test_storage_s3 import MotoServer

    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


def test_a_prefix_is_listed_page_by_page_and_read_where_it_lives(catalogue, api, moto, monkeypatch):
    from embeddings.services.catalogue import reading
    from tests.origin_server import small_jpeg
    from workers.errors import ImageRejected

    s3 = moto.client()
    s3.create_bucket(Bucket="shop")
    jpeg = small_jpeg()
    for n in range(60):  # 60 distinct images, 5 notes, and images under another prefix
        s3.put_object(Bucket="shop", Key=f"catalogue/p{n:03d}.JPG", Body=jpeg + str(n).encode())
    for n in range(5):
        s3.put_object(Bucket="shop", Key=f"catalogue/note{n}.txt", Body=b"not an image")
    s3.put_object(Bucket="shop", Key="elsewhere/p.jpg", Body=jpeg)
    catalogue.SOURCE_BUCKETS = ["shop/catalogue/"]
    catalogue.SOURCE_S3 = {"endpoint_url": moto.url, "region": "us-east-1", "access_key": "testing",
                           "secret_key": "testing", "addressing_style": "path"}
    runtime.source_client.cache_clear()
    monkeypatch.setattr(reading, "LIST_PAGE_SIZE", 25)  # 65 objects: 3 pages
    r = api.post("/api/jobs/", {"prefix": "s3://shop/catalogue/", "extensions": "jpg"}, format="json")
    assert r.status_code == 202, r.json()
    job = Job.objects.get(id=r.json()["id"])
    assert (job.status, job.total, job.reading) == (JobStatus.DONE, 60, False)
    assert job.source["rows_read"] == 60
    rows = list(Image.objects.filter(job=job).order_by("row"))
    assert [im.status for im in rows] == [ImageStatus.EMBEDDED] * 60
    assert [im.storage_key for im in rows[:2]] == ["s3://shop/catalogue/p000.JPG", "s3://shop/catalogue/p001.JPG"]
    # read where it lives (SOURCE_COPY off), its sha256 checked on every read
    store = runtime.blob_store()
    assert store.read(rows[0].storage_key, rows[0].sha256) == jpeg + b"0"
    s3.put_object(Bucket="shop", Key="catalogue/p000.JPG", Body=jpeg + b"changed")
    with pytest.raises(ImageRejected) as e:
        store.read(rows[0].storage_key, rows[0].sha256)
    assert e.value.reason.value == "source_changed"
    s3.delete_object(Bucket="shop", Key="catalogue/p001.JPG")
    with pytest.raises(ImageRejected) as e:
        store.read(rows[1].storage_key, rows[1].sha256)
    assert e.value.reason.value == "source_missing"
    runtime.source_client.cache_clear()


def test_a_manifest_in_a_bucket_names_objects_by_key(catalogue, api, moto):
    from tests.origin_server import small_jpeg

    s3 = moto.client()
    s3.create_bucket(Bucket="feeds")
    jpeg = small_jpeg()
    s3.put_object(Bucket="feeds", Key="img/a.jpg", Body=jpeg + b"a")
    s3.put_object(Bucket="feeds", Key="img/b.jpg", Body=jpeg + b"b")
    s3.put_object(Bucket="feeds", Key="manifest.jsonl", Body=(
        b'{"key": "img/a.jpg", "external_id": "A", "metadata": {"brand": "acme"}}\n'
        b'{"key": "s3://feeds/img/b.jpg", "external_id": "B", "price": 3}\n'
        b'{"key": "img/missing.jpg", "external_id": "C"}\n'
        b'{"key": "s3://secret/x.jpg"}\n'))
    catalogue.SOURCE_BUCKETS = ["feeds"]
    catalogue.SOURCE_S3 = {"endpoint_url": moto.url, "region": "us-east-1", "access_key": "testing",
                           "secret_key": "testing", "addressing_style": "path"}
    runtime.source_client.cache_clear()
    r = api.post("/api/jobs/", {"manifest_key": "s3://feeds/manifest.jsonl"}, format="json")
    assert r.status_code == 202, r.json()
    job = Job.objects.get(id=r.json()["id"])
    rows = rows_by(job)
    assert {n: (im.status, im.reason, im.external_id) for n, im in rows.items()} == {
        1: (ImageStatus.EMBEDDED, "", "A"), 2: (ImageStatus.EMBEDDED, "", "B"),
        3: (ImageStatus.FAILED, "source_missing", "C"), 4: (ImageStatus.FAILED, "source_not_allowed", "")}
    # a free id is taken when the row is made: the failed row still answers for it (and why)
    assert (rows[1].metadata, rows[2].metadata) == ({"brand": "acme"}, {"price": 3})
    missing = api.post("/api/jobs/", {"manifest_key": "s3://feeds/nope.csv"}, format="json")
    assert missing.status_code == 400 and missing.json()["code"] == "source_missing"
    runtime.source_client.cache_clear()


def test_source_copy_puts_objects_in_the_blob_store(catalogue, api, moto):
    from tests.origin_server import small_jpeg

    s3 = moto.client()
    s3.create_bucket(Bucket="copied")
    for n in range(2):
        s3.put_object(Bucket="copied", Key=f"p{n}.jpg", Body=small_jpeg() + bytes([n]))
    catalogue.SOURCE_BUCKETS, catalogue.SOURCE_COPY = ["copied"], True
    catalogue.SOURCE_S3 = {"endpoint_url": moto.url, "region": "us-east-1", "access_key": "testing",
                           "secret_key": "testing", "addressing_style": "path"}
    runtime.source_client.cache_clear()
    r = api.post("/api/jobs/", {"prefix": "s3://copied/"}, format="json")
    assert r.status_code == 202, r.json()
    rows = list(Image.objects.filter(job_id=r.json()["id"]).order_by("row"))
    assert [(im.status, im.storage_key[:5], im.origin) for im in rows] == [
        (ImageStatus.EMBEDDED, "blob/", "s3://copied/p0.jpg"), (ImageStatus.EMBEDDED, "blob/", "s3://copied/p1.jpg")]
    s3.delete_object(Bucket="copied", Key="p0.jpg")  # the copy does not need the object any more
    assert runtime.blob_store().read(rows[0].storage_key, rows[0].sha256) == small_jpeg() + b"\x00"
    runtime.source_client.cache_clear()


def test_a_bucket_manifest_on_storage_that_cannot_be_reached_is_a_503_not_a_500(catalogue, api):
    from scripts.stack import free_port

    catalogue.SOURCE_BUCKETS = ["feeds"]
    catalogue.SOURCE_S3 = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "region": "us-east-1",
                           "access_key": "testing", "secret_key": "testing", "addressing_style": "path"}
    runtime.source_client.cache_clear()
    r = api.post("/api/jobs/", {"manifest_key": "s3://feeds/manifest.csv"}, format="json")
    assert r.status_code == 503 and r.json()["code"] == "source_unavailable" and r["Retry-After"] == "30"
    # the storage endpoint is this deployment's own (an internal name): not in the answer
    endpoint = catalogue.SOURCE_S3["endpoint_url"]
    assert endpoint.split("//")[1] not in r.content.decode() and "127.0.0.1" not in r.content.decode()
    assert r.json()["message"] == ("object storage cannot be reached for s3://feeds/manifest.csv "
                                   "(EndpointConnectionError; the server's log has the details)")
    assert not Job.objects.exists()
    runtime.source_client.cache_clear()


def test_a_read_stays_at_most_fetch_read_ahead_rows_ahead_of_the_model(catalogue, api, origin, monkeypatch):
    """While a job has FETCH_READ_AHEAD images queued its read stops and asks to be read again
    later; it then goes on from where it stopped, never reading a row twice."""
    from embeddings import dispatch
    from embeddings.services.catalogue import reading

    reads, fetches = [], []
    monkeypatch.setattr(dispatch, "send_job_read", lambda **kw: reads.append(kw))
    monkeypatch.setattr(dispatch, "send_fetch_chunk", lambda **kw: fetches.append(kw))  # nothing fetched
    catalogue.FETCH_READ_AHEAD = 2
    job = post_manifest(api, "url\n" + "".join(f"{origin.url}/img/{i}.jpg\n" for i in range(5)))
    Job.objects.filter(id=job.id).update(chunk_size=1)
    assert reading.job_read(job_id=str(job.id)) == {"rows": 2, "rows_read": 2, "waiting": True}
    assert reads[-1]["countdown"] == reading.READ_AHEAD_WAIT_S and len(fetches) == 2
    assert reading.job_read(job_id=str(job.id)) == {"rows": 0, "rows_read": 2, "waiting": True}  # still 2 queued
    Image.objects.filter(job=job).update(status=ImageStatus.EMBEDDED)  # the model caught up
    assert reading.job_read(job_id=str(job.id)) == {"rows": 2, "rows_read": 4, "waiting": True}
    Image.objects.filter(job=job).update(status=ImageStatus.EMBEDDED)
    assert reading.job_read(job_id=str(job.id)) == {"rows": 1, "rows_read": 5}
    assert sorted(Image.objects.filter(job=job).values_list("row", flat=True)) == [1, 2, 3, 4, 5]
    job.refresh_from_db()
    assert (job.total, job.reading, job.status) == (5, False, JobStatus.RUNNING)  # row 5 waits for its fetch


def test_a_jobs_first_slice_is_small_so_its_first_images_reach_the_model_at_once(catalogue, api, origin, monkeypatch):
    from embeddings import dispatch
    from embeddings.services.catalogue import reading

    fetches = []
    monkeypatch.setattr(dispatch, "send_job_read", lambda **kw: None)
    monkeypatch.setattr(dispatch, "send_fetch_chunk", lambda **kw: fetches.append(kw["image_ids"]))
    job = post_manifest(api, "url\n" + "".join(f"{origin.url}/img/{i}.jpg\n" for i in range(80)))
    assert job.chunk_size == 64
    reading.job_read(job_id=str(job.id))
    assert [len(ids) for ids in fetches] == [reading.FIRST_SLICE_ROWS, 64, 80 - 64 - reading.FIRST_SLICE_ROWS]


def test_a_trickling_url_holds_only_its_own_row_of_the_slice(catalogue, api, origin, monkeypatch):
    """A slice of fast URLs and one that answers a byte every half second: the fast rows are stored,
    resolved, sent to the model and embedded while the slow row is still being fetched (asserted on
    the rows' and the origin's state at the moment they are sent on); the slow row then fails alone,
    ``fetch_timeout``, at the whole-URL limit (``FETCH_TOTAL_TIMEOUT_S``) that a per-read timeout
    would never reach."""
    from embeddings import dispatch
    from embeddings.services.catalogue import fetching, reading

    catalogue.FETCH_TOTAL_TIMEOUT_S = 15.0  # the fast rows finish well within it on a loaded machine
    runtime.fetcher.cache_clear()
    fetches, sends = [], []
    real_send = dispatch.send_chunk
    monkeypatch.setattr(dispatch, "send_job_read", lambda **kw: None)
    monkeypatch.setattr(dispatch, "send_fetch_chunk", lambda **kw: fetches.append(kw["image_ids"]))
    fast = [f"{origin.url}/pixels/{700 + i}.jpg" for i in range(7)]
    slow_url = f"{origin.url}/slow?interval=0.5&bytes=40"  # 20 s of body, each read well under the read timeout
    job = post_manifest(api, "url\n" + "\n".join(fast[:3] + [slow_url] + fast[3:]) + "\n")
    reading.job_read(job_id=str(job.id))
    (ids,) = fetches
    rows = rows_by(job)
    slow = rows[4]
    fast_ids = {str(im.id) for n, im in rows.items() if n != 4}

    def send_chunk(**kw):
        slow_now = Image.objects.get(id=slow.id)  # the state at the moment the rows are sent on
        in_flight = [s.finished is None for s in origin.requests("/slow")]
        result = real_send(**kw)  # eager: the chunk is embedded here
        sends.append({"ids": set(kw["image_ids"]), "slow": (slow_now.status, slow_now.sha256), "in_flight": in_flight,
                      "embedded": set(map(str, Image.objects.filter(id__in=kw["image_ids"], status=ImageStatus.EMBEDDED)
                                          .values_list("id", flat=True)))})
        return result

    monkeypatch.setattr(dispatch, "send_chunk", send_chunk)
    origin.reset()
    result = fetching.chunk_fetch(job_id=str(job.id), image_ids=ids)
    # every fast row was sent on, and embedded, while the slow row was queued without its bytes and
    # its body not finished (a first fast row may be sent before the slow request even reaches the
    # origin: the fetcher's threads start the URLs in turn), and by the last send it was being served
    while_slow = [s for s in sends if s["slow"] == (ImageStatus.QUEUED, "") and s["in_flight"] in ([], [True])]
    assert set().union(*(s["ids"] for s in while_slow)) == fast_ids
    assert sends[-1]["in_flight"] == [True]
    assert set().union(*(s["embedded"] for s in while_slow)) == fast_ids
    assert all(s["ids"] <= fast_ids for s in sends)
    slow.refresh_from_db()
    assert (slow.status, slow.reason) == (ImageStatus.FAILED, "fetch_timeout")
    assert "the total time limit of 15 s passed" in slow.reason_detail
    assert {k: result[k] for k in ("fetched", "failed", "skipped", "queued")} == {
        "fetched": 7, "failed": 1, "skipped": 0, "queued": 7}
    job.refresh_from_db()
    assert job.status == JobStatus.DONE


def test_an_object_that_cannot_be_read_fails_its_row_without_naming_the_storage_endpoint(catalogue, api, monkeypatch):
    """A storage client's error names its endpoint (an internal host name): the row's failure names
    the object and the error's kind; the endpoint stays in the fetch worker's log."""
    from botocore.exceptions import EndpointConnectionError

    def unreachable(bucket, key):
        raise EndpointConnectionError(endpoint_url=f"http://minio.internal:9000/{bucket}/{key}")

    monkeypatch.setattr(runtime, "source_object", unreachable)
    catalogue.SOURCE_BUCKETS = ["shop"]
    job = post_manifest(api, "key,external_id\ns3://shop/a.jpg,A\n")
    (row,) = rows_by(job).values()
    assert (row.status, row.reason, row.reason_detail) == (
        ImageStatus.FAILED, "source_missing",
        "s3://shop/a.jpg: EndpointConnectionError while reading it (the fetch worker's log has the details)")
    body = api.get(f"/api/jobs/{job.id}/").content.decode()
    assert "minio.internal" not in body and "s3://shop/a.jpg" in body


def test_a_slice_killed_after_its_first_rows_settled_is_finished_by_its_redelivery(catalogue, api, origin, monkeypatch):
    """The fetch task is acknowledged late: a worker killed after some rows of its slice settled
    gets the slice again. The settled rows (queued with their bytes) are sent on without being
    fetched again, the rest are fetched; no row is lost or left queued."""
    from embeddings import dispatch
    from embeddings.services.catalogue import fetching, reading

    catalogue.FETCH_TOTAL_TIMEOUT_S = 2.0
    runtime.fetcher.cache_clear()
    fetches, sends = [], []
    real_send = dispatch.send_chunk
    monkeypatch.setattr(dispatch, "send_job_read", lambda **kw: None)
    monkeypatch.setattr(dispatch, "send_fetch_chunk", lambda **kw: fetches.append(kw["image_ids"]))
    urls = [f"{origin.url}/pixels/{800 + i}.jpg" for i in range(4)] + [f"{origin.url}/slow?interval=0.5&bytes=40"]
    job = post_manifest(api, "url\n" + "\n".join(urls) + "\n")
    reading.job_read(job_id=str(job.id))
    (ids,) = fetches
    rows = rows_by(job)
    fast_ids = {str(rows[n].id) for n in range(1, 5)}

    def killed(**kw):
        raise SystemExit("the worker was killed")  # after the first group was stored and resolved

    monkeypatch.setattr(dispatch, "send_chunk", killed)
    with pytest.raises(SystemExit):
        fetching.chunk_fetch(job_id=str(job.id), image_ids=ids)
    settled = {str(im.id): (im.status, bool(im.sha256)) for im in Image.objects.filter(job=job)}
    assert {i: settled[i] for i in fast_ids} == {i: (ImageStatus.QUEUED, True) for i in fast_ids}
    assert settled[str(rows[5].id)] == (ImageStatus.QUEUED, False)
    origin.reset()
    monkeypatch.setattr(dispatch, "send_chunk", lambda **kw: sends.append(set(kw["image_ids"])) or real_send(**kw))
    result = fetching.chunk_fetch(job_id=str(job.id), image_ids=ids)  # the redelivery
    assert sends == [fast_ids]  # sent on as they were, not fetched again
    assert [s.path for s in origin.requests()] == ["/slow"]
    assert {k: result[k] for k in ("fetched", "failed", "queued")} == {"fetched": 0, "failed": 1, "queued": 4}
    final = {n: (im.status, im.reason) for n, im in rows_by(job).items()}
    assert final == {1: (ImageStatus.EMBEDDED, ""), 2: (ImageStatus.EMBEDDED, ""), 3: (ImageStatus.EMBEDDED, ""),
                     4: (ImageStatus.EMBEDDED, ""), 5: (ImageStatus.FAILED, "fetch_timeout")}
    job.refresh_from_db()
    assert job.status == JobStatus.DONE


def test_a_reimported_catalogue_is_never_at_risk_its_skipped_rows_count_in_its_rate(catalogue, api, user, origin,
                                                                                     monkeypatch):
    """Issue 53: a catalogue imported again, its bytes all stored already, with a deadline 15 minutes
    away. Every row settles as a skipped duplicate; the job's rate counts them (settled rows per
    second since it started), so at no point, from before its first row to its end, is it at risk,
    and the reconciler's ``job.at_risk`` check sends nothing. The clock is a fake one that moves
    1 s before and 1 s after each row's fetch (one row a chunk)."""
    import datetime as dt
    import types

    from django.utils import timezone

    from embeddings import dispatch
    from embeddings.models import WebhookDelivery, WebhookEndpoint
    from embeddings.services.catalogue import fetching, reading
    from embeddings.services.catalogue import jobs as job_services

    text = "url\n" + "".join(f"{origin.url}/pixels/{i}.jpg\n" for i in range(6))
    first = post_manifest(api, text)
    assert {im.status for im in Image.objects.filter(job=first)} == {ImageStatus.EMBEDDED}
    WebhookEndpoint.objects.create(owner=user, url=f"{origin.url}/hooks", secret="whsec_test")

    clock = [timezone.now()]
    monkeypatch.setattr(job_services, "timezone", types.SimpleNamespace(now=lambda: clock[0]))
    chunks = []
    monkeypatch.setattr(dispatch, "send_job_read", lambda **kw: None)
    monkeypatch.setattr(dispatch, "send_fetch_chunk", lambda **kw: chunks.append(kw["image_ids"]))
    again = post_manifest(api, text.replace(".jpg\n", ".jpg?again=1\n"),
                          deadline=(clock[0] + dt.timedelta(minutes=15)).isoformat())
    Job.objects.filter(id=again.id).update(chunk_size=1)
    while Job.objects.get(id=again.id).reading:
        reading.job_read(job_id=str(again.id))
    assert [len(ids) for ids in chunks] == [1] * 6

    def at_risk() -> bool:
        job = Job.objects.get(id=again.id)
        notified = job_services.jobs_at_risk_notify()
        return job_services.job_progress(job)["at_risk"] or notified > 0

    seen = [at_risk()]  # nothing settled yet, 15 minutes to go: not at risk for having no rate
    for ids in chunks:
        clock[0] += dt.timedelta(seconds=1)
        fetching.chunk_fetch(job_id=str(again.id), image_ids=ids)
        clock[0] += dt.timedelta(seconds=1)
        seen.append(at_risk())
        if len(seen) == 4:  # 3 rows settled, all skipped, in the 6 s since the job started (its read)
            progress = job_services.job_progress(Job.objects.get(id=again.id))
            assert (progress["skipped"], progress["elapsed_s"], progress["throughput_images_per_s"]) == (3, 6.0, 0.5)
            assert progress["eta"] == clock[0] + dt.timedelta(seconds=3 / 0.5)
    assert seen == [False] * 7
    job = Job.objects.get(id=again.id)
    assert job.status == JobStatus.DONE
    assert {im.status for im in Image.objects.filter(job=again)} == {ImageStatus.SKIPPED}
    progress = job_services.job_progress(job)
    assert (progress["skipped"], progress["elapsed_s"], progress["throughput_images_per_s"]) == (6, 11.0, 0.545)  # finished at 11 s
    assert not WebhookDelivery.objects.filter(event="job.at_risk").exists()
