"""``GET /api/usage/``, the site's usage page and the admin's list, end to end in one process (eager
Celery, embedded Qdrant, random-weights model): exact counts per kind after a mix of uploads, a bulk
job, searches and embeddings calls made with an API key; the range's refusals; ``group_by``; each
owner sees their own usage only (docs/usage.md)."""
from __future__ import annotations

import base64
import datetime as dt
import types

import pytest
from rest_framework.test import APIClient

from embeddings.models import UsageRecord
from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "ck_ab12cd34"
ZERO = {"images_interactive": 0, "images_bulk": 0, "images_reembed": 0, "texts": 0, "searches": 0, "fetches": 0,
        "duplicates": 0, "images": 0, "bytes": 0}


def keyed(user, prefix: str = KEY) -> APIClient:
    """A client whose requests carry an API key with public prefix ``prefix``, as the keys'
    authentication leaves it in ``request.auth`` (anything with a ``prefix``)."""
    c = APIClient()
    c.force_authenticate(user=user, token=types.SimpleNamespace(prefix=prefix))
    return c


def counts(row: dict) -> dict:
    return {k: row[k] for k in ZERO}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def mixed_work(api) -> None:
    """2 interactive images and 1 duplicate (upload), 3 bulk images (a job), 3 searches, 3 texts and
    2 more interactive images (one stored) through the embeddings endpoints."""
    a, b = jpeg_bytes(1), jpeg_bytes(2)
    r = api.post("/api/images/", {"files": [upload("a.jpg", a), upload("b.jpg", b), upload("a2.jpg", a)], "k": 0},
                 format="multipart")
    assert r.status_code == 200, r.content
    assert [im["status"] for im in r.json()["images"]] == ["embedded", "embedded", "skipped"]
    stored = r.json()["images"][0]["id"]
    r = api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(10 + i)) for i in range(3)]},
                 format="multipart")
    assert r.status_code == 202, r.content
    assert api.get(f"/api/jobs/{r.json()['id']}/").json()["status"] == "done"
    for body in ({"text": "a cat"}, {"text": "a dog", "k": 3}, {"image_id": stored}):
        r = api.post("/api/search/", body, format="json")
        assert r.status_code == 200, r.content
    r = api.post("/v1/embeddings", {"model": "ViT-B-32", "input": ["a cat", "a dog"]}, format="json")
    assert r.status_code == 200, r.content
    r = api.post("/api/embeddings/", {"inputs": [{"text": "a bird"}, {"image": b64(jpeg_bytes(20))}]}, format="json")
    assert r.status_code == 200, r.content
    r = api.post("/api/embeddings/", {"inputs": [{"image": b64(jpeg_bytes(21))}], "store": True}, format="json")
    assert r.status_code == 200, r.content


def test_a_mix_of_work_is_counted_exactly_per_kind_and_key(service, user):
    mixed_work(keyed(user))
    client_for(user).post("/api/search/", {"text": "a legacy token's search"}, format="json")  # no key
    r = client_for(user).get("/api/usage/?group_by=kind")
    assert r.status_code == 200, r.content
    body = r.json()
    by_kind = {row["kind"]: row for row in body["data"]}
    assert sorted(by_kind) == ["duplicate", "image_bulk", "image_interactive", "search", "text"]
    assert counts(by_kind["image_interactive"]) == {**ZERO, "images_interactive": 4, "images": 4}
    assert counts(by_kind["image_bulk"]) == {**ZERO, "images_bulk": 3, "images": 3}
    assert counts(by_kind["text"]) == {**ZERO, "texts": 3}
    assert counts(by_kind["search"]) == {**ZERO, "searches": 4}
    assert counts(by_kind["duplicate"]) == {**ZERO, "duplicates": 1}
    assert by_kind["duplicate"]["compute_s"] == 0 and by_kind["duplicate"]["cost_per_image"] is None
    total = body["total"]
    assert counts(total) == {**ZERO, "images_interactive": 4, "images_bulk": 3, "texts": 3, "searches": 4,
                             "duplicates": 1, "images": 7}
    # cost: compute seconds at the price of a worker-hour; per image: the image kinds' over the images
    assert by_kind["image_bulk"]["compute_s"] > 0 and by_kind["image_interactive"]["compute_s"] > 0
    price = body["price_per_worker_hour"]
    assert total["cost"] == pytest.approx(total["compute_s"] / 3600 * price, rel=1e-6)
    images_s = by_kind["image_bulk"]["compute_s"] + by_kind["image_interactive"]["compute_s"]
    assert total["cost_per_image"] == pytest.approx(images_s / 3600 * price / 7, rel=1e-4)
    by_key = {row["key"]: counts(row) for row in client_for(user).get("/api/usage/?group_by=key").json()["data"]}
    assert by_key == {KEY: {**counts(total), "searches": 3}, None: {**ZERO, "searches": 1}}
    assert set(UsageRecord.objects.values_list("key_prefix", flat=True)) == {KEY, ""}


def test_group_by_day_model_and_key_in_that_order(service, user):
    keyed(user).post("/api/search/", {"text": "a cat"}, format="json")
    keyed(user, "ck_other999").post("/api/search/", {"text": "a cat"}, format="json")
    keyed(user, "ck_other999").post("/api/search/", {"text": "a dog"}, format="json")
    space_model = UsageRecord.objects.first().model_id
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    data = client_for(user).get("/api/usage/?group_by=day,model,key").json()["data"]
    assert [(r["day"], r["model"], r["key"], r["searches"]) for r in data] == [
        (today, space_model, KEY, 1), (today, space_model, "ck_other999", 2)]
    assert list(data[0])[:3] == ["day", "model", "key"]
    assert client_for(user).get("/api/usage/?group_by=key,key").json()["group_by"] == ["key"]  # a repeat: once
    one = client_for(user).get("/api/usage/").json()
    assert one["group_by"] == [] and len(one["data"]) == 1 and one["data"][0]["searches"] == 3


def test_a_range_inverted_too_long_or_not_a_date_is_refused_in_the_error_shape(user, settings):
    api = client_for(user)
    cases = [("start=2026-12-06&end=2026-12-01", "usage_range_inverted"),
             ("start=2026-01-01&end=2026-12-31", "usage_range_too_long"),
             ("start=2026-09-04&end=2026-12-06", "usage_range_too_long"),  # 94 days
             ("start=2026-02-30", "invalid_date"), ("end=2026-W49-1", "invalid_date"), ("start=20261201", "invalid_date"),
             ("group_by=key,colour", "invalid_group_by"), ("owner=abc", "forbidden"),
             # found by the schema fuzz: a parameter given empty is not the default, it is no date
             ("start=", "invalid_date"), ("end=", "invalid_date"), ("owner=", "invalid_owner")]
    for query, code in cases:
        r = api.get(f"/api/usage/?{query}")
        assert r.json()["code"] == code, (query, r.content)
        assert r.status_code == (403 if code == "forbidden" else 400) and set(r.json()) == {"message", "code", "extra"}
    r = api.get("/api/usage/?start=2026-09-04&end=2026-12-06")
    assert r.json()["extra"] == {"limit": "USAGE_MAX_RANGE_DAYS", "value": 93, "days": 94}
    r = api.get("/api/usage/?start=2026-09-05&end=2026-12-06")  # 93 days, both ends counted
    assert r.status_code == 200 and (r.json()["start"], r.json()["end"]) == ("2026-09-05", "2026-12-06")
    settings.USAGE_MAX_RANGE_DAYS = 7
    assert api.get("/api/usage/?start=2026-12-01&end=2026-12-08").json()["code"] == "usage_range_too_long"
    r = api.get("/api/usage/")  # default: the 30 days ending today, or the bound where it is fewer
    start, end = dt.date.fromisoformat(r.json()["start"]), dt.date.fromisoformat(r.json()["end"])
    assert (end - start).days + 1 == 7 and end == dt.datetime.now(dt.timezone.utc).date()


def test_each_owner_sees_their_own_usage_and_staff_may_name_one_or_all(service, user, other_user, staff):
    keyed(user).post("/api/search/", {"text": "a cat"}, format="json")
    keyed(other_user, "ck_bob00001").post("/api/search/", {"text": "a cat"}, format="json")
    keyed(other_user, "ck_bob00001").post("/api/search/", {"text": "a dog"}, format="json")
    mine = client_for(user).get("/api/usage/?group_by=key").json()
    assert mine["owner"] == user.id and [(r["key"], r["searches"]) for r in mine["data"]] == [(KEY, 1)]
    assert client_for(other_user).get("/api/usage/").json()["total"]["searches"] == 2
    r = client_for(user).get(f"/api/usage/?owner={other_user.id}")
    assert (r.status_code, r.json()["code"]) == (403, "forbidden")
    assert client_for(user).get(f"/api/usage/?owner={user.id}").status_code == 200  # one's own id
    boss = client_for(staff)
    assert boss.get("/api/usage/").json()["total"]["searches"] == 0  # staff's own by default
    assert boss.get(f"/api/usage/?owner={other_user.id}").json()["total"]["searches"] == 2
    everyone = boss.get("/api/usage/?owner=all&group_by=owner").json()
    assert everyone["owner"] is None
    assert {r["owner"]: r["searches"] for r in everyone["data"]} == {user.id: 1, other_user.id: 2}
    assert boss.get("/api/usage/?owner=999999").status_code == 404
    assert boss.get("/api/usage/?owner=-1").json()["code"] == "invalid_owner"


def test_the_usage_page_draws_a_bar_per_day_and_a_table(service, user, client):
    keyed(user).post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1))], "k": 0}, format="multipart")
    client.force_login(user)
    today = dt.datetime.now(dt.timezone.utc).date()
    start = (today - dt.timedelta(days=6)).isoformat()
    r = client.get(f"/usage/?start={start}&end={today.isoformat()}")
    assert r.status_code == 200
    page = r.content.decode()
    assert page.count("<rect ") == 7  # a bar per day, days without usage too
    assert f"{today.isoformat()}: 1 image</title>" in page
    assert "<svg" in page and "http://" not in page.split("<svg", 1)[1].split("</svg>", 1)[0].replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    assert 'aria-current="page">Usage</a>' in page
    r = client.get(f"/usage/?start={today.isoformat()}&end={start}")
    assert r.status_code == 400 and "The end is before the start" in r.content.decode()


def test_the_admin_lists_usage_read_only(service, user, staff, client):
    keyed(user).post("/api/search/", {"text": "a cat"}, format="json")
    client.force_login(staff)
    r = client.get("/admin/embeddings/usagerecord/?kind__exact=search")
    assert r.status_code == 200 and KEY in r.content.decode()
    row = UsageRecord.objects.get()
    page = client.get(f"/admin/embeddings/usagerecord/{row.pk}/change/").content.decode()
    assert 'name="units"' not in page  # read-only: shown, not a field
    assert client.get("/admin/embeddings/usagerecord/add/").status_code == 403


def test_a_batchs_output_lines_are_metered_for_its_key_and_its_error_lines_not(service, user):
    """An OpenAI batch (run to its end by eager Celery): the inputs of its output lines count (texts,
    bulk images) for the key that created it, once, with the part that recorded them; an error
    line's inputs do not."""
    import json

    from django.core.files.uploadedfile import SimpleUploadedFile

    api = keyed(user, "ck_batch001")
    image = "data:image/jpeg;base64," + b64(jpeg_bytes(30))
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "ViT-B-32", "input": ["a cat", "a dog"]}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"model": "ViT-B-32", "input": image}},
             {"custom_id": "c", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "ViT-B-32", "input": ["a bird", "data:image/jpeg;base64,bm90IGFuIGltYWdl"]}}]
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    r = api.post("/v1/files", {"file": SimpleUploadedFile("in.jsonl", body), "purpose": "batch"})
    assert r.status_code == 200, r.content
    r = api.post("/v1/batches", {"input_file_id": r.json()["id"], "endpoint": "/v1/embeddings",
                                 "completion_window": "24h"}, format="json")
    assert r.status_code == 200, r.content
    batch = api.get(f"/v1/batches/{r.json()['id']}").json()
    assert (batch["status"], batch["request_counts"]["completed"], batch["request_counts"]["failed"]) == (
        "completed", 2, 1)
    data = client_for(user).get("/api/usage/?group_by=key,kind").json()["data"]
    assert {(row["key"], row["kind"]): counts(row) for row in data} == {
        ("ck_batch001", "image_bulk"): {**ZERO, "images_bulk": 1, "images": 1},
        ("ck_batch001", "text"): {**ZERO, "texts": 2}}
    assert all(row["compute_s"] > 0 for row in data)
