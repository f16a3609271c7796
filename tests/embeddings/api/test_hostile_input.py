"""Request input that once gave a 500 under /api/ and /v1/ (issue 44): tampered pagination cursors,
deeply nested JSON (bodies and JSON text in form fields), unpaired surrogates in JSON strings, odd
``Accept`` headers and a browser on the API, the schema view's query parameters. Each gets a 4xx in
the API's error shape, or the answer it would get anyway."""
from __future__ import annotations

import base64
import datetime
import json
from urllib.parse import urlencode

import pytest
from django.utils import timezone

from embeddings.api.json_input import JSON_MAX_DEPTH
from embeddings.models import Job
from tests.conftest import SHARED
from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db

NESTED_CASE = SHARED / "data" / "cases" / "p02_nested_arrays_50000.json"
#: ``{"text": [[[…]]], "k": 3}``, 50,000 arrays deep: the shape of ``p02_nested_arrays_50000.json``
NESTED = b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b', "k": 3}'
TOO_DEEP = {"message": f"the JSON body nested deeper than JSON_MAX_DEPTH ({JSON_MAX_DEPTH} levels)",
            "code": "json_too_deep", "extra": {"limit": "JSON_MAX_DEPTH", "value": 64, "field": None}}
INVALID_CURSOR = {"message": "Invalid cursor", "code": "not_found", "extra": {}}
#: What Firefox and Chrome send for a page they navigate to
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
def api(user):
    c = client_for(user)
    c.raise_request_exception = False  # a 500 is answered (and asserted against), not raised
    return c


def nested(depth: int) -> str:
    """JSON text of ``depth`` levels: ``[[…]]``."""
    return "[" * depth + "]" * depth


def cursor(position: str, reverse: str = "0") -> str:
    """A cursor as DRF writes one: base64 of the urlencoded ``r`` (reverse) and ``p`` (position)."""
    return base64.b64encode(urlencode({"r": reverse, "p": position}).encode()).decode()


def webhook(api, n: int = 0) -> str:
    r = api.post("/api/webhooks/", {"url": f"https://example.com/hook/{n}"}, format="json")
    assert r.status_code == 201, r.content
    return r.json()["id"]


# --- pagination cursors ---------------------------------------------------------------------------

BAD_POSITIONS = ["abc", "9999-99-99", "\x00", "2026-01-01 00:00:00", "2026-01-01", "0001-01-01 00:00:00+14:00",
                 "9999-12-31 23:59:59.999999-14:00", "2026-01-01 00:00:00+99:00", "1" * 5000]


@pytest.mark.parametrize("position", BAD_POSITIONS)
def test_a_cursor_with_a_position_no_row_can_have_is_an_unknown_cursor(api, position):
    endpoint = webhook(api)
    for path in ("/api/images/", "/api/jobs/", "/api/webhooks/", f"/api/webhooks/{endpoint}/deliveries/"):
        for reverse in ("0", "1"):
            r = api.get(path, {"cursor": cursor(position, reverse)})
            assert (r.status_code, r.json()) == (404, INVALID_CURSOR), (path, r.content[:200])


def test_the_cursors_the_service_writes_still_page(api, monkeypatch):
    from embeddings.api.pagination import NewestFirst

    monkeypatch.setattr(NewestFirst, "page_size", 2)
    ids = [webhook(api, n) for n in range(3)]
    first = api.get("/api/webhooks/").json()
    assert [w["id"] for w in first["results"]] == ids[:0:-1]
    second = api.get(first["next"]).json()
    assert [w["id"] for w in second["results"]] == ids[:1] and second["next"] is None
    assert [w["id"] for w in api.get(second["previous"]).json()["results"]] == ids[:0:-1]


def test_a_position_with_its_offset_is_read_as_the_service_writes_it(api, user):
    job = Job.objects.create(owner=user, name="old")
    Job.objects.filter(id=job.id).update(created_at=timezone.now() - datetime.timedelta(days=1))
    r = api.get("/api/jobs/", {"cursor": cursor(str(timezone.now()))})
    assert r.status_code == 200 and [j["id"] for j in r.json()["results"]] == [str(job.id)]


# --- deeply nested JSON ---------------------------------------------------------------------------

@pytest.mark.parametrize("method, path", [("post", "/api/search/"), ("post", "/api/jobs/"),
                                          ("post", "/api/embeddings/"), ("post", "/api/webhooks/"),
                                          ("post", "/api/auth/token/"), ("patch", "/api/webhooks/{id}/")])
def test_json_nested_past_the_limit_is_a_400_naming_it(api, method, path):
    path = path.replace("{id}", webhook(api))
    r = getattr(api, method)(path, NESTED, content_type="application/json")
    assert (r.status_code, r.json()) == (400, TOO_DEEP)


@pytest.mark.skipif(not NESTED_CASE.exists(), reason="../shared/data/cases is not present")
@pytest.mark.parametrize("path", ["/api/search/", "/api/jobs/"])
def test_the_nested_arrays_case_is_a_400(api, path):
    r = api.post(path, NESTED_CASE.read_bytes(), content_type="application/json")
    assert (r.status_code, r.json()) == (400, TOO_DEEP)


def test_the_openai_endpoint_answers_it_in_openais_shape(api):
    r = api.post("/v1/embeddings", NESTED, content_type="application/json")
    assert r.status_code == 400
    assert r.json() == {"error": {"message": TOO_DEEP["message"], "param": None, "code": "json_too_deep",
                                  "type": "invalid_request_error"}}


def test_the_limit_is_inclusive(api):
    """64 levels parse (the unknown field is then ignored, as any); 65 do not."""
    def body(depth):  # the object is level 1
        return f'{{"url": "https://example.com/h", "x": {nested(depth - 1)}}}'

    assert api.post("/api/webhooks/", body(JSON_MAX_DEPTH), content_type="application/json").status_code == 201
    r = api.post("/api/webhooks/", body(JSON_MAX_DEPTH + 1), content_type="application/json")
    assert (r.status_code, r.json()) == (400, TOO_DEEP)


@pytest.mark.parametrize("path, fields, field", [
    ("/api/search/", {"image": ("q.jpg", 40)}, "filter"),  # a multipart search carries its image
    ("/api/jobs/", {"name": "j"}, "callback_url"),
    ("/api/embeddings/", {}, "inputs"),
])
@pytest.mark.parametrize("depth", [JSON_MAX_DEPTH + 1, 50_000])
def test_json_text_in_a_form_field_has_the_same_limit(api, path, fields, field, depth):
    fields = {name: upload(value[0], jpeg_bytes(value[1])) if isinstance(value, tuple) else value
              for name, value in fields.items()}
    r = api.post(path, {**fields, field: nested(depth)}, format="multipart")
    assert r.status_code == 400
    assert r.json() == {"message": f"{field} is JSON nested deeper than JSON_MAX_DEPTH (64 levels)",
                        "code": "json_too_deep", "extra": {"limit": "JSON_MAX_DEPTH", "value": 64, "field": field}}


def test_metadata_text_nested_past_the_limit_is_metadata_too_deep(service, api):
    from tests.embeddings.conftest import jpeg_bytes, upload

    r = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(0))], "metadata": nested(50_000)},
                 format="multipart")
    assert r.status_code == 400
    body = r.json()
    assert (body["code"], body["extra"]) == ("metadata_too_deep", {"index": 0})


# --- strings that are not text ---------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/api/search/", '{"text": "a cat", "vector_format": "\\ud800"}'),  # a choice echoed in its error: was a 500
    ("/api/jobs/", '{"priority": "\\udfff"}'),
    ("/api/embeddings/", '{"inputs": [{"text": "a"}], "encoding_format": "\\ud800x"}'),
    ("/api/webhooks/", '{"url": "https://example.com/h", "\\ud800": 1}'),  # a key
])
def test_an_unpaired_surrogate_in_a_json_string_is_a_parse_error(api, path, body):
    r = api.post(path, body, content_type="application/json")
    assert r.status_code == 400
    assert r.json()["code"] == "parse_error" and r.json()["extra"] == {"field": None}


def test_a_surrogate_pair_is_one_character(api):
    r = api.post("/api/webhooks/", '{"url": "https://example.com/h", "description": "\\ud83d\\ude00"}',
                 content_type="application/json")
    assert r.status_code == 201 and r.json()["description"] == "\U0001F600"


def test_the_openai_endpoint_refuses_a_surrogate_in_its_shape(api):
    r = api.post("/v1/embeddings", '{"input": "a", "model": "ViT-B-32", "modality": "\\ud800"}',
                 content_type="application/json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "parse_error"
    assert r.json()["error"]["type"] == "invalid_request_error"


# --- Accept and the browser -----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/images/", "/api/jobs/", "/api/webhooks/"])
def test_a_signed_in_browser_gets_the_json(client, user, path):
    client.raise_request_exception = False
    client.force_login(user)
    r = client.get(path, HTTP_ACCEPT=BROWSER_ACCEPT)
    assert r.status_code == 200 and r["Content-Type"] == "application/json"
    assert r.json() == {"next": None, "previous": None, "results": []}


@pytest.mark.parametrize("accept, status", [
    ("text/html", 406), ("application/xml", 406), ("garbage", 406), ("text/html;q=abc", 406), (";q=", 406),
    ("text/html; q*=x-unknown''1", 406),
    # no media type DRF reads (empty, only commas, a token longer than its 8 KB cap): as if absent
    ("", 200), (" , ,", 200), ("a/b;" + "c=d;" * 2100, 200),
    ("*/*", 200), ("application/*", 200), ("application/json; indent=2", 200),
])
def test_odd_accept_headers_get_json_or_a_406_in_the_error_shape(client, user, accept, status):
    client.raise_request_exception = False
    client.force_login(user)
    for path in ("/api/images/", "/api/webhooks/", "/api/stats/", "/api/search/", "/api/nope/"):
        r = client.get(path, HTTP_ACCEPT=accept)
        assert r["Content-Type"] == "application/json", (path, r.status_code)
        if path == "/api/nope/":  # no view: Django's 404, whatever Accept says
            assert r.status_code == 404
        elif status == 406:
            assert (r.status_code, r.json()["code"]) == (406, "not_acceptable"), path
        else:
            assert r.status_code == {"/api/stats/": 403, "/api/search/": 405}.get(path, 200), path


def test_format_api_is_not_a_renderer(api):
    r = api.get("/api/images/", {"format": "api"})
    assert (r.status_code, r.json()) == (404, {"message": "Not found.", "code": "not_found", "extra": {}})
    assert api.get("/api/images/", {"format": "json"}).status_code == 200


def test_the_docs_page_answers_whatever_accept_says(client):
    for accept in ("application/json", "garbage", BROWSER_ACCEPT):
        r = client.get("/api/docs/", {"format": "json"}, HTTP_ACCEPT=accept)
        assert r.status_code == 200 and r["Content-Type"] == "text/html; charset=utf-8"


def test_a_thumbnail_answers_whatever_accept_says(service, api):
    from tests.embeddings.conftest import jpeg_bytes, upload

    r = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1))]}, format="multipart")
    image = r.json()["images"][0]
    assert image["status"] == "embedded"
    for accept in ("image/webp", "image/jpeg", "text/html"):
        r = api.get(image["thumbnail_url"], HTTP_ACCEPT=accept)
        assert r.status_code == 200 and r["Content-Type"] == "image/jpeg"


# --- the schema's query parameters ----------------------------------------------------------------

@pytest.mark.parametrize("query", [{"version": "1.0\r\nX-Injected: 1"}, {"version": 'a"; filename="evil.html'},
                                   {"version": "é☃"}, {"lang": "../../etc"}, {"lang": "xx" * 500},
                                   {"lang": "de"}, {"version": "2", "lang": "fr"}])
def test_the_schema_ignores_version_and_unknown_languages(client, query):
    import yaml

    r = client.get("/api/schema/", query)
    assert r.status_code == 200
    assert r["Content-Disposition"] == 'inline; filename="CLIP embeddings.yaml"'
    assert yaml.safe_load(r.content)["info"]["version"] == "1.0.0"


def test_the_schema_answers_errors_in_json(client):
    r = client.get("/api/schema/", {"format": "xml"})
    assert (r.status_code, r["Content-Type"]) == (404, "application/json")
    assert r.json() == {"message": "Not found.", "code": "not_found", "extra": {}}
    r = client.get("/api/schema/", HTTP_ACCEPT="text/html")
    assert (r.status_code, r.json()["code"]) == (406, "not_acceptable")
    r = client.get("/api/schema/", {"format": "json"})
    assert r.status_code == 200 and json.loads(r.content)["info"]["version"] == "1.0.0"


# --- numbers and ids out of range ------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/migrations/{big}/", "/api/migrations/{big}/gate/",
                                  "/api/webhooks/{hook}/deliveries/{big}/redeliver/"])
def test_ids_past_any_integer_column_are_unknown(django_user_model, path):
    staff = django_user_model.objects.create_user("root", password="pw", is_staff=True)
    api = client_for(staff)
    path = path.format(big=10**30, hook=webhook(api))
    r = api.post(path) if path.endswith(("gate/", "redeliver/")) else api.get(path)
    assert (r.status_code, r.json()["code"]) == (404, "not_found")
