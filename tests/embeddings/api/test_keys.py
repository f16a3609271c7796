"""API keys through the API (``embeddings.api.keys``, ``embeddings.api.authentication``,
``embeddings.api.access``): made with the secret shown once and only its hash kept, both keywords,
the refusal codes, scopes, DRF tokens migrated, and per-key request limits with their headers."""
from __future__ import annotations

import datetime as dt
import io
import logging

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from embeddings.errors import ApplicationError
from embeddings.lane_control.keys import key as redis_key
from embeddings.models import USER_SCOPES, ApiKey
from embeddings.services.access.keys import key_create, secret_hash
from tests.embeddings.conftest import client_for

pytestmark = pytest.mark.django_db(transaction=True)


def bearer(secret: str, keyword: str = "Bearer") -> APIClient:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"{keyword} {secret}")
    return c


@pytest.fixture
def limits_redis(private_redis, settings):
    """Per-key counters in a Redis of the test's own (``settings.REDIS_URL``)."""
    settings.REDIS_URL = private_redis[0]
    return private_redis[1]


def every_text_cell() -> list[str]:
    """Every value of every column of every table, as text."""
    out = []
    with connection.cursor() as cur:
        for table in connection.introspection.table_names(cur):
            cur.execute(f'SELECT * FROM "{table}"')
            out += [str(v) for row in cur.fetchall() for v in row if v is not None]
    return out


def test_a_key_is_made_shown_once_and_only_its_hash_is_stored(user, caplog, limits_redis):
    caplog.set_level(logging.DEBUG)
    r = client_for(user).post("/api/keys/", {"name": "search script", "scopes": ["search", "images:read"]},
                              format="json")
    assert r.status_code == 201, r.content
    made = r.json()
    secret = made["secret"]
    assert secret.startswith(made["prefix"] + "_") and len(made["prefix"]) == 11 and len(secret) == 55
    assert made["scopes"] == ["images:read", "search"] and made["state"] == "active"
    key = ApiKey.objects.get(pk=made["id"])
    assert key.secret_hash == secret_hash(secret) and len(key.secret_hash) == 64
    # used with both keywords, listed and read: never shown again
    for keyword in ("Bearer", "Token"):
        assert bearer(secret, keyword).get("/api/images/").status_code == 200
    listed = bearer(secret).get("/api/keys/")
    assert listed.status_code == 403 and listed.json()["code"] == "insufficient_scope"  # no keys scope
    listed = client_for(user).get("/api/keys/").json()["results"]
    assert [k["prefix"] for k in listed] == [made["prefix"]] and "secret" not in listed[0]
    tail = secret[12:]
    assert not [cell for cell in every_text_cell() if secret in cell or tail in cell]
    assert secret not in caplog.text and tail not in caplog.text
    assert made["prefix"] in caplog.text  # the prefix names it in the logs


def test_last_used_is_written_at_most_once_a_minute(user, limits_redis):
    made = key_create(owner=user, name="k", scopes=["images:read"])
    c = bearer(made.secret)
    assert c.get("/api/images/").status_code == 200
    first = ApiKey.objects.get(pk=made.key.pk).last_used_at
    assert first is not None
    assert c.get("/api/images/").status_code == 200
    assert ApiKey.objects.get(pk=made.key.pk).last_used_at == first
    ApiKey.objects.filter(pk=made.key.pk).update(last_used_at=first - dt.timedelta(seconds=61))
    assert c.get("/api/images/").status_code == 200
    assert ApiKey.objects.get(pk=made.key.pk).last_used_at > first


@pytest.mark.parametrize("header,code", [
    ("Bearer short", "key_malformed"), ("Bearer a b", "key_malformed"), ("Token ", "key_malformed"),
    ("Bearer " + "é" * 30, "key_malformed"), ("Bearer " + "x" * 201, "key_malformed"),
    ("Bearer ck_abcdefgh_" + "A" * 43, "key_unknown"), ("Token " + "0" * 40, "key_unknown"),
])
def test_a_credential_that_authenticates_nothing_says_why(client, header, code):
    r = client.get("/api/images/", HTTP_AUTHORIZATION=header.encode("utf-8").decode("latin-1"))
    assert (r.status_code, r.json()["code"]) == (401, code), r.content
    r = client.post("/v1/embeddings", {"model": "ViT-B-32", "input": "a"}, content_type="application/json",
                    HTTP_AUTHORIZATION=header.encode("utf-8").decode("latin-1"))
    assert r.status_code == 401 and r.json()["error"]["code"] == code
    assert r.json()["error"]["type"] == "authentication_error"


def test_revoked_and_expired_keys_are_refused_at_once(user, limits_redis):
    made = key_create(owner=user, name="k", scopes=["all"])
    c = bearer(made.secret)
    assert c.get("/api/images/").status_code == 200
    r = client_for(user).delete(f"/api/keys/{made.key.pk}/")
    assert r.status_code == 200 and r.json()["state"] == "revoked"
    for url in ("/api/images/", "/api/keys/"):
        r = c.get(url)
        assert (r.status_code, r.json()["code"]) == (401, "key_revoked")
    r = c.post("/v1/embeddings", {"model": "ViT-B-32", "input": "a"}, format="json")
    assert (r.status_code, r.json()["error"]["code"]) == (401, "key_revoked")
    other = key_create(owner=user, name="k2", scopes=["all"])
    ApiKey.objects.filter(pk=other.key.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    r = bearer(other.secret).get("/api/images/")
    assert (r.status_code, r.json()["code"]) == (401, "key_expired")


def test_refusals_when_making_a_key(user, staff):
    api = client_for(user)
    cases = [
        ({"name": "k", "scopes": ["images:read", "images:delete"]}, 400, "unknown_scope"),
        ({"name": "k", "scopes": ["everything"]}, 400, "unknown_scope"),
        ({"name": "k", "scopes": []}, 400, "invalid"),
        ({"name": "k", "scopes": ["admin"]}, 403, "scope_not_allowed"),
        ({"name": "k", "scopes": ["all"], "limits": {"requests_per_minute": 10}}, 403, "forbidden"),
        ({"name": "k", "scopes": ["all"], "expires_at": "2001-01-01T00:00:00Z"}, 400, "invalid_expiry"),
    ]
    for body, status, code in cases:
        r = api.post("/api/keys/", body, format="json")
        assert (r.status_code, r.json()["code"]) == (status, code), (body, r.content)
    root = client_for(staff)
    for bad in (0, -5):
        r = root.post("/api/keys/", {"name": "k", "scopes": ["all"], "limits": {"images_per_minute": bad}},
                      format="json")
        assert (r.status_code, r.json()["code"]) == (400, "invalid"), r.content
        assert "images_per_minute" in r.json()["extra"]["fields"]["limits"]
    r = api.post("/api/keys/", {"name": "k", "scopes": ["read-only"]}, format="json")
    assert r.json()["scopes"] == ["images:read", "search", "embeddings", "jobs:read", "usage"]
    key_id = r.json()["id"]
    r = api.patch(f"/api/keys/{key_id}/", {"limits": {"requests_per_minute": 5}}, format="json")
    assert (r.status_code, r.json()["code"]) == (403, "forbidden")
    r = root.patch(f"/api/keys/{key_id}/", {"limits": {"requests_per_minute": 0}}, format="json")
    assert (r.status_code, r.json()["code"]) == (400, "invalid")
    r = root.patch(f"/api/keys/{key_id}/", {"limits": {"requests_per_minute": 5}}, format="json")
    assert r.status_code == 200 and r.json()["limits"]["requests_per_minute"] == 5
    assert r.json()["custom_limits"] == {"requests_per_minute": 5, "images_per_minute": None,
                                         "bulk_images_per_day": None, "concurrent_bulk_jobs": None,
                                         "bulk_weight": None}
    assert ApiKey.objects.count() == 1  # no refused request made a key


def test_staff_set_a_keys_bulk_weight_and_0_negative_or_out_of_range_is_refused(staff, user, settings,
                                                                                   limits_redis):
    settings.BULK_OWNER_WEIGHTS = {"alice": 2.0}
    root = client_for(staff)
    key_id = client_for(user).post("/api/keys/", {"name": "k", "scopes": ["all"]}, format="json").json()["id"]
    r = root.get(f"/api/keys/{key_id}/")
    assert (r.json()["limits"]["bulk_weight"], r.json()["custom_limits"]["bulk_weight"]) == (2.0, None)  # alice's
    for bad in (0, -1, 0.001, 100.5, "nan", "inf"):
        r = root.patch(f"/api/keys/{key_id}/", {"limits": {"bulk_weight": bad}}, format="json")
        assert (r.status_code, r.json()["code"]) == (400, "invalid"), (bad, r.content)
        assert "bulk_weight" in r.json()["extra"]["fields"]["limits"]
    r = client_for(user).patch(f"/api/keys/{key_id}/", {"limits": {"bulk_weight": 3}}, format="json")
    assert (r.status_code, r.json()["code"]) == (403, "forbidden")
    r = root.patch(f"/api/keys/{key_id}/", {"limits": {"bulk_weight": 0.25}}, format="json")
    assert r.status_code == 200
    assert r.json()["limits"]["bulk_weight"] == r.json()["custom_limits"]["bulk_weight"] == 0.25
    assert ApiKey.objects.get(pk=key_id).bulk_weight == 0.25
    r = root.patch(f"/api/keys/{key_id}/", {"limits": {"bulk_weight": None}}, format="json")
    assert r.json()["limits"]["bulk_weight"] == 2.0 and ApiKey.objects.get(pk=key_id).bulk_weight is None
    # the service (manage.py apikeys) refuses the same in its error shape, and fractions of the counted limits
    for name, bad in (("bulk_weight", 0), ("bulk_weight", -2.0), ("bulk_weight", float("nan")),
                      ("bulk_weight", float("inf")), ("bulk_weight", True), ("requests_per_minute", 1.5)):
        with pytest.raises(ApplicationError) as e:
            key_create(owner=user, name="k", scopes=["all"], limits={name: bad}, by_staff=True)
        assert (e.value.status, e.value.code, e.value.extra["limit"]) == (400, "invalid_limit", name)
    call_command("apikeys", "create", "alice", "--limit", "bulk_weight=2.5", stdout=io.StringIO())
    assert ApiKey.objects.filter(owner=user, name="cli").get().bulk_weight == 2.5
    for bad in ("bulk_weight=0", "bulk_weight=-1", "bulk_weight=nan", "bulk_weight=x"):
        with pytest.raises(CommandError):
            call_command("apikeys", "create", "alice", "--limit", bad, stdout=io.StringIO())
    assert ApiKey.objects.count() == 2  # no refused one made a key
    # the admin: a form error on the field, nothing saved
    admin = Client()
    admin.force_login(staff)
    url = f"/admin/embeddings/apikey/{key_id}/change/"
    form = {"name": "k", "expires_at_0": "", "expires_at_1": "", "requests_per_minute": "",
            "images_per_minute": "", "bulk_images_per_day": "", "concurrent_bulk_jobs": ""}
    for bad in ("0", "-3", "inf"):
        r = admin.post(url, {**form, "bulk_weight": bad})
        assert r.status_code == 200 and "bulk_weight" in r.context["adminform"].form.errors, bad
    assert admin.post(url, {**form, "bulk_weight": "4"}).status_code == 302
    assert ApiKey.objects.get(pk=key_id).bulk_weight == 4.0


def test_a_staff_key_has_staff_powers_only_with_admin(staff, user, limits_redis):
    key_create(owner=user, name="users", scopes=["all"])
    plain = key_create(owner=staff, name="plain", scopes=["all"])
    admin = key_create(owner=staff, name="admin", scopes=["all", "admin"])
    r = bearer(plain.secret).get("/api/stats/")
    assert (r.status_code, r.json()["code"], r.json()["extra"]["required"]) == (403, "insufficient_scope", "admin")
    assert len(bearer(plain.secret).get("/api/keys/").json()["results"]) == 2  # its owner's own, not everyone's
    assert len(bearer(admin.secret).get("/api/keys/").json()["results"]) == 3
    r = client_for(user).get("/api/stats/")
    assert (r.status_code, r.json()["code"]) == (403, "forbidden")  # not staff: no scope makes it staff


def test_tokens_migrate_to_keys_of_the_same_secret(user, staff, limits_redis):
    tokens = {u.username: Token.objects.create(user=u).key for u in (user, staff)}
    call_command("apikeys", "migrate-tokens")
    assert Token.objects.count() == 0
    keys = {k.owner.username: k for k in ApiKey.objects.select_related("owner")}
    assert keys["alice"].scopes == list(USER_SCOPES) and keys["root"].scopes == [*USER_SCOPES, "admin"]
    for name, secret in tokens.items():
        assert keys[name].secret_hash == secret_hash(secret) and keys[name].name == "migrated token"
        for keyword in ("Token", "Bearer"):
            assert bearer(secret, keyword).get("/api/images/").status_code == 200
    assert bearer(tokens["root"]).get("/api/migrations/").status_code == 200  # staff keeps staff's routes
    assert not [cell for cell in every_text_cell() if tokens["alice"] in cell]
    call_command("apikeys", "migrate-tokens")  # again: nothing to do
    assert ApiKey.objects.count() == 2


def test_requests_per_minute_are_counted_with_headers_and_refused_with_retry_after(staff, limits_redis):
    made = key_create(owner=staff, name="k", scopes=["images:read"], limits={"requests_per_minute": 3},
                      by_staff=True)
    c = bearer(made.secret)
    seen = []
    for _ in range(3):
        r = c.get("/api/images/")
        assert r.status_code == 200
        seen.append((r["x-ratelimit-limit-requests"], r["x-ratelimit-remaining-requests"]))
        assert 1 <= int(r["x-ratelimit-reset-requests"].removesuffix("s")) <= 60
    assert seen == [("3", "2"), ("3", "1"), ("3", "0")]
    r = c.get("/api/images/")
    assert (r.status_code, r.json()["code"]) == (429, "rate_limited")
    assert 1 <= int(r["Retry-After"]) <= 60 and r["x-ratelimit-remaining-requests"] == "0"
    assert r.json()["extra"]["limit"] == "requests_per_minute"
    r = c.post("/v1/embeddings", {"model": "m", "input": "a"}, format="json")
    assert r.status_code == 403  # no embeddings scope: refused before it counts
    counter = redis_key(f"access:{made.key.pk}:requests")
    assert int(limits_redis.get(counter)) == 3 and 0 < limits_redis.pttl(counter) <= 60_000
    limits_redis.delete(counter)  # the minute is over
    assert c.get("/api/images/")["x-ratelimit-remaining-requests"] == "2"
    # other credentials carry no headers and are not counted
    assert "x-ratelimit-limit-requests" not in client_for(staff).get("/api/images/")


def test_bulk_limits_refuse_at_submission_and_make_nothing(staff, limits_redis):
    from embeddings.models import Job, JobStatus
    from embeddings.services.access import limits
    from tests.embeddings.conftest import jpeg_bytes, upload

    made = key_create(owner=staff, name="bulk", scopes=["jobs:write"], by_staff=True,
                      limits={"bulk_images_per_day": 1, "concurrent_bulk_jobs": 1})
    c = bearer(made.secret)
    r = c.post("/api/jobs/", {"files": [upload("a.jpg", jpeg_bytes(1)), upload("b.jpg", jpeg_bytes(2))]},
               format="multipart")
    assert (r.status_code, r.json()["code"], r.json()["extra"]["limit"]) == (413, "exceeds_key_limit",
                                                                              "bulk_images_per_day")
    running = Job.objects.create(owner=staff, status=JobStatus.RUNNING)
    limits.job_slot_reserve(key=made.key).fill(running.id)
    r = c.post("/api/jobs/", {"files": [upload("a.jpg", jpeg_bytes(1))]}, format="multipart")
    assert (r.status_code, r.json()["code"]) == (429, "rate_limited")
    assert r.json()["extra"] == {"limit": "concurrent_bulk_jobs", "value": 1, "running_jobs": [str(running.id)],
                                 "retry_after_s": 30}
    assert r["Retry-After"] == "30"
    assert Job.objects.count() == 1  # nothing was made


def test_interactive_images_are_counted_before_any_work(user, limits_redis):
    from embeddings.services.access import limits
    from tests.embeddings.conftest import jpeg_bytes, upload

    made = key_create(owner=user, name="k", scopes=["images:write", "embeddings"])
    ApiKey.objects.filter(pk=made.key.pk).update(images_per_minute=2)
    c = bearer(made.secret)
    files = [upload(f"{i}.jpg", jpeg_bytes(i)) for i in range(3)]
    r = c.post("/api/images/", {"files": files}, format="multipart")
    assert (r.status_code, r.json()["code"], r.json()["extra"]["limit"]) == (413, "exceeds_key_limit",
                                                                              "images_per_minute")
    made.key.refresh_from_db()
    limits.images_admit(key=made.key, images=2)  # the minute's images are used up
    r = c.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1))]}, format="multipart")
    assert (r.status_code, r.json()["code"], r["x-ratelimit-remaining-images"]) == (429, "rate_limited", "0")
    assert r["x-ratelimit-remaining-requests"] is not None and 1 <= int(r["Retry-After"]) <= 60
    pixel = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9" \
            "awAAAABJRU5ErkJggg=="
    r = c.post("/api/embeddings/", {"inputs": [{"image": pixel}]}, format="json")
    assert (r.status_code, r.json()["code"]) == (429, "rate_limited")
    r = c.post("/v1/embeddings", {"model": "ViT-B-32", "input": [pixel] * 3}, format="json")
    assert r.status_code == 413 and r.json()["error"]["code"] == "exceeds_key_limit"
    r = c.post("/v1/embeddings", {"model": "ViT-B-32", "input": pixel}, format="json")
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["type"]) == (429, "rate_limited",
                                                                                     "rate_limit_error")
    assert 1 <= int(r["Retry-After"]) <= 60
    only = bearer(key_create(owner=user, name="e", scopes=["embeddings"]).secret)
    r = only.post("/api/embeddings/", {"inputs": [{"image": pixel}], "store": True}, format="json")
    assert (r.status_code, r.json()["code"], r.json()["extra"]["required"]) == (403, "insufficient_scope",
                                                                                "images:write")  # store uploads
