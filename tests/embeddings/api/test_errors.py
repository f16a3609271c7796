"""The API's one error shape (``embeddings.api.errors``): unknown URLs and ids under /api/ answer
JSON 404, elsewhere the site's page; an unhandled error answers JSON 500 without its detail."""
from __future__ import annotations

import pytest

from tests.embeddings.conftest import client_for

pytestmark = pytest.mark.django_db(transaction=True)


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
