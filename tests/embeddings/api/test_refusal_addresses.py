"""Issue 53: a refused fetch never tells the sender what a host name resolves to on the server.

A name of the test's own (``intranet.test``, answered by a fake resolver with a private address, as
the server's hosts file or internal DNS would) is sent through every door that fetches or posts to a
URL: ``POST /api/embeddings/``, ``POST /v1/embeddings``, a manifest row (the row's failure in
``GET /api/jobs/{id}/``), a webhook endpoint (at creation, where a name is not resolved yet, and in
its deliveries). Each answer names the rule (``fetch_refused_address``) and the URL; its whole body
holds the resolved address nowhere. The server's log keeps the address (``workers.fetch``, INFO).
"""
from __future__ import annotations

import json
import socket

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings import runtime
from embeddings.models import Image, WebhookDelivery, WebhookEndpoint
from embeddings.services.webhooks import events as webhook_events

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "intranet.test"
#: What the fake resolver answers for NAME: a private address, and its IPv4-mapped IPv6 form.
RESOLVED = "10.20.30.40"
ALLOW_TEXT = "refused unless FETCH_ALLOW_NETWORKS allows it"


@pytest.fixture
def intranet(service, monkeypatch):
    """NAME resolves to RESOLVED on this server; every other name to the real resolver."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        return real(RESOLVED if host == NAME else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    service.FETCH_ALLOW_NETWORKS = []
    service.FETCH_RETRIES = 0
    runtime.fetcher.cache_clear()
    yield service
    runtime.fetcher.cache_clear()


def hides_the_address(body: bytes) -> bool:
    text = body.decode()
    return RESOLVED not in text and "10.20.30" not in text and "0a14:1e28" not in text.lower()


def test_the_embeddings_api_names_the_rule_and_the_url(intranet, api):
    url = f"http://{NAME}/cat.jpg"
    r = api.post("/api/embeddings/", {"inputs": [{"image_url": url}]}, format="json")
    assert r.status_code == 400, r.content
    assert hides_the_address(r.content)
    (item,) = r.json()["data"]
    assert (item["reason"], item["detail"]) == ("fetch_refused_address",
                                                f"{url}: {NAME} resolves to a private address, {ALLOW_TEXT}")


def test_the_openai_endpoint_names_the_rule_and_the_url(intranet, api):
    url = f"http://{NAME}/cat.jpg"
    r = api.post("/v1/embeddings", {"model": "ViT-B-32", "input": [url]}, format="json")
    assert r.status_code == 400, r.content
    assert hides_the_address(r.content)
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("fetch_refused_address", "input[0]")
    assert error["message"] == (f"input[0] (image): fetch_refused_address: {url}: {NAME} resolves to a private "
                                f"address, {ALLOW_TEXT}")


def test_a_manifest_rows_failure_names_the_rule_and_the_url(intranet, api):
    url = f"http://{NAME}/shoes/1.jpg"
    manifest = SimpleUploadedFile("catalogue.csv", f"url,external_id\n{url},SKU-1\n".encode(), content_type="text/csv")
    r = api.post("/api/jobs/", {"manifest": manifest}, format="multipart")
    assert r.status_code == 202, r.content
    job = api.get(f"/api/jobs/{r.json()['id']}/")
    assert job.status_code == 200 and job.json()["status"] == "done"
    assert hides_the_address(job.content)
    (failure,) = job.json()["failures"]
    assert (failure["reason"], failure["origin"]) == ("fetch_refused_address", url)
    assert failure["reason_detail"] == f"{url}: {NAME} resolves to a private address, {ALLOW_TEXT}"
    images = api.get("/api/images/")
    assert images.status_code == 200 and hides_the_address(images.content)
    assert [im["reason_detail"] for im in images.json()["results"]] == [failure["reason_detail"]]
    assert Image.objects.get(job_id=r.json()["id"]).reason_detail == failure["reason_detail"]


def test_a_webhook_endpoint_names_the_rule_and_the_url_at_creation_and_in_its_deliveries(intranet, api, user):
    url = f"http://{NAME}/hook"
    made = api.post("/api/webhooks/", {"url": url, "events": ["job.done"]}, format="json")
    assert made.status_code == 201, made.content  # a name is resolved at each attempt, not at creation
    assert hides_the_address(made.content)
    endpoint = made.json()
    webhook_events.event_emit(event="job.done", key="k", data={},
                              endpoints=[WebhookEndpoint.objects.get(id=endpoint["id"])])
    delivery = WebhookDelivery.objects.get(endpoint_id=endpoint["id"])
    assert (delivery.last_reason, delivery.attempts) == ("fetch_refused_address", 1)
    listed = api.get(f"/api/webhooks/{endpoint['id']}/deliveries/")
    assert listed.status_code == 200 and hides_the_address(listed.content)
    text = json.dumps(listed.json())
    assert "fetch_refused_address" in text and f"{url}: {NAME} resolves to a private address, {ALLOW_TEXT}" in text


def test_the_server_log_keeps_the_address(intranet, api, caplog):
    url = f"http://{NAME}/cat.jpg"
    with caplog.at_level("INFO", logger="workers.fetch"):
        api.post("/api/embeddings/", {"inputs": [{"image_url": url}]}, format="json")
    assert [r.getMessage() for r in caplog.records if r.name == "workers.fetch"] == [
        f"refused {url}: {NAME} resolves to {RESOLVED} (private)"]
