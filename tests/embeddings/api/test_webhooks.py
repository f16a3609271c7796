"""``/api/webhooks/`` and a job's ``callback_url`` (issue 42, docs/webhooks.md): secrets shown once,
URLs to refused addresses refused at creation, deliveries and their attempts visible, redeliver and
rotate. Messages are checked by the reference library (``standardwebhooks``) at a real receiver."""
from __future__ import annotations

import datetime as dt
import json

import pytest
import standardwebhooks

from embeddings.models import Job, WebhookDelivery, WebhookEndpoint
from embeddings.services.webhooks import delivery as webhook_delivery
from tests.embeddings.conftest import client_for, jpeg_bytes, upload
from tests.embeddings.services.webhooks.test_delivery import Receiver, drive

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def receiver(settings):
    """The checking receiver of ``tests/embeddings/services/webhooks/test_delivery.py`` on 127.0.0.1."""
    settings.FETCH_ALLOW_NETWORKS = ["127.0.0.1/32"]
    with Receiver() as r:
        yield r


def test_create_list_update_rotate_and_delete(service, api, other_user, receiver):
    r = api.post("/api/webhooks/", {"url": f"{receiver.url}/ok", "events": ["job.done", "job.failed"],
                                    "description": "ci"}, format="json")
    assert r.status_code == 201, r.content
    made = r.json()
    assert made["secret"].startswith("whsec_") and made["events"] == ["job.done", "job.failed"]
    assert made["job"] is None and made["deliveries_url"] == f"/api/webhooks/{made['id']}/deliveries/"
    url = f"/api/webhooks/{made['id']}/"
    shown = api.get(url).json()
    assert "secret" not in shown and shown["url"] == made["url"]
    listed = api.get("/api/webhooks/").json()
    assert [w["id"] for w in listed["results"]] == [made["id"]] and "secret" not in listed["results"][0]
    assert client_for(other_user).get(url).status_code == 404
    assert client_for(other_user).get("/api/webhooks/").json()["results"] == []

    r = api.patch(url, {"active": False, "events": []}, format="json")
    assert r.status_code == 200 and (r.json()["active"], r.json()["events"]) == (False, [])
    assert api.patch(url, {"events": ["job.nope"]}, format="json").status_code == 400

    old = made["secret"]
    r = api.post(f"{url}rotate/")
    assert r.status_code == 200 and r.json()["secret"] not in ("", old)
    assert api.delete(url).status_code == 204
    assert api.get(url).status_code == 404


@pytest.mark.parametrize("url, code", [
    ("http://169.254.169.254/latest/meta-data/", "fetch_refused_address"),
    ("http://127.0.0.1:8000/hook", "fetch_refused_address"),
    ("http://[::1]/hook", "fetch_refused_address"),
    ("http://10.0.0.5/hook", "fetch_refused_address"),
    ("ftp://example.com/hook", "invalid_callback_url"),
    ("http://user:pw@example.com/hook", "invalid_callback_url"),
    ("not a url", "invalid_callback_url"),
])
def test_a_callback_url_to_a_refused_address_is_refused_at_creation(service, api, url, code):
    r = api.post("/api/webhooks/", {"url": url}, format="json")
    assert r.status_code == 400 and r.json()["code"] == code, r.content
    r = api.post("/api/jobs/", {"files": [upload("a.jpg", jpeg_bytes(1))], "callback_url": url}, format="multipart")
    assert r.status_code == 400 and r.json()["code"] == code, r.content
    assert not Job.objects.exists() and not WebhookEndpoint.objects.exists()


def test_a_webhook_takes_only_what_its_schema_says(service, api):
    # found by the schema fuzz's negative data: a number as the description (DRF's CharField takes
    # its text), and a form PATCH with url= (DRF reads a blank form value as "not sent")
    r = api.post("/api/webhooks/", {"url": "https://example.com/hook", "description": 0}, format="json")
    assert r.status_code == 400 and r.json()["extra"]["fields"] == {"description": ["Not a valid string."]}, r.content
    hook = api.post("/api/webhooks/", {"url": "https://example.com/hook"}, format="json").json()
    r = api.patch(f"/api/webhooks/{hook['id']}/", "url=&active=false", content_type="application/x-www-form-urlencoded")
    assert r.status_code == 400 and r.json()["extra"]["fields"] == {"url": ["This field may not be blank."]}, r.content
    hook = api.get(f"/api/webhooks/{hook['id']}/").json()
    assert (hook["url"], hook["active"]) == ("https://example.com/hook", True)


def test_a_refused_address_names_the_setting_that_allows_it(service, api):
    r = api.post("/api/webhooks/", {"url": "http://0.0.0.0/hook"}, format="json")
    assert r.json()["message"] == ("callback URL refused: 0.0.0.0 is an unspecified address, refused unless "
                                   "FETCH_ALLOW_NETWORKS allows it")


def test_migration_events_only_for_a_staff_accounts_own_endpoints(service, api, user, receiver):
    """A non-staff account, or a job's callback, never hears migration.*: subscribing to one is refused."""
    r = api.post("/api/webhooks/", {"url": f"{receiver.url}/a", "events": ["migration.ready"]}, format="json")
    assert r.status_code == 400 and r.json()["code"] == "invalid_events", r.content
    assert r.json()["extra"]["unknown"] == ["migration.ready"] and "migration.ready" not in r.json()["extra"]["known"]
    user.is_staff = True
    user.save()
    r = api.post("/api/webhooks/", {"url": f"{receiver.url}/a", "events": ["migration.ready"]}, format="json")
    assert r.status_code == 201, r.content
    r = api.post("/api/jobs/", {"files": [upload("a.jpg", jpeg_bytes(1))], "callback_url": f"{receiver.url}/j",
                                "callback_events": "migration.promoted"}, format="multipart")
    assert r.status_code == 400 and r.json()["code"] == "invalid_events", r.content


def test_callback_url_as_one_form_part_holding_a_json_list(service, api, receiver):
    urls = [f"{receiver.url}/one", f"{receiver.url}/two"]
    r = api.post("/api/jobs/", {"files": [upload("a.jpg", jpeg_bytes(1))], "callback_url": json.dumps(urls)},
                 format="multipart")
    assert r.status_code == 202, r.content
    assert sorted(h["url"] for h in r.json()["webhooks"]) == urls


def test_a_jobs_callback_urls_get_its_events_signed(service, api, user, receiver):
    r = api.post("/api/jobs/", {"files": [upload("a.jpg", jpeg_bytes(1))],
                                "callback_url": [f"{receiver.url}/ok", f"{receiver.url}/flaky"]}, format="multipart")
    assert r.status_code == 202, r.content
    hooks = r.json()["webhooks"]
    assert len(hooks) == 2 and all(h["secret"].startswith("whsec_") and h["job"] == r.json()["id"] for h in hooks)
    receiver.secrets.update(ok=hooks[0]["secret"], flaky=hooks[1]["secret"])
    detail = api.get(r.json()["url"]).json()
    assert detail["status"] == "done" and {h["id"] for h in detail["webhooks"]} == {h["id"] for h in hooks}
    assert all("secret" not in h for h in detail["webhooks"])
    drive()
    assert sorted(n for n, _, p in receiver.accepted if p["type"] == "job.done") == ["flaky", "ok"]

    # the deliveries, their attempts and last error, newest first
    flaky = hooks[1]
    page = api.get(f"/api/webhooks/{flaky['id']}/deliveries/").json()
    (d,) = page["results"]
    assert (d["event"], d["status"], d["attempts"], d["last_status_code"]) == ("job.done", "delivered", 4, 200)
    assert [(a["number"], a["status_code"]) for a in d["attempt_log"]] == [(1, 500), (2, 500), (3, 500), (4, 200)]
    assert d["attempt_log"][0]["reason"] == "fetch_status" and "HTTP 500" in d["attempt_log"][0]["error"]
    assert d["message_id"].startswith("msg_") and d["payload"]["type"] == "job.done"
    assert api.get(f"/api/webhooks/{flaky['id']}/deliveries/?status=failed").json()["results"] == []
    assert api.get(f"/api/webhooks/{flaky['id']}/deliveries/?status=nope").status_code == 400

    # redeliver: the same webhook-id again, the receiver dedupes it
    r = api.post(f"/api/webhooks/{flaky['id']}/deliveries/{d['id']}/redeliver/")
    assert r.status_code == 202 and r.json()["message_id"] == d["message_id"], r.content
    assert [m for n, m, _ in receiver.accepted if n == "flaky"] == [d["message_id"]] * 2
    assert WebhookDelivery.objects.get(id=d["id"]).status == "delivered"


def test_an_account_endpoint_hears_every_job_and_a_rotated_secret_overlaps(service, api, user, receiver):
    made = api.post("/api/webhooks/", {"url": f"{receiver.url}/ok"}, format="json").json()
    old = made["secret"]
    new = api.post(f"/api/webhooks/{made['id']}/rotate/").json()["secret"]
    receiver.secrets["ok"] = old  # the receiver has not switched yet: the old secret's signature is still sent
    r = api.post("/api/jobs/", {"files": [upload("x.jpg", b"not an image")]}, format="multipart")
    assert r.status_code == 202 and "webhooks" not in r.json()
    (payload,) = [p for _, _, p in receiver.accepted]
    assert payload["type"] == "job.failed" and payload["data"]["job_id"] == r.json()["id"]
    assert payload["data"]["failure"]["code"] == "no_image_embedded"
    delivery = WebhookDelivery.objects.get()
    assert len(delivery.attempt_log.get().error) == 0
    # and the new one verifies the same messages
    body = webhook_delivery.body_of(delivery.payload)
    sig = webhook_delivery.signatures(WebhookEndpoint.objects.get(), delivery.message_id, 1_900_000_000, body)
    at = dt.datetime.fromtimestamp(1_900_000_000, dt.UTC)
    assert standardwebhooks.Webhook(new).sign(delivery.message_id, at, body) in sig.split(" ")
