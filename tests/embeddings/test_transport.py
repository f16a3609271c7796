"""What happens around the views (embeddings/transport.py, the search form's size in
embeddings/site/fields.py, the admin's list actions): a body without a length, a URL missing its
trailing slash, control characters in URLs and site forms, the site's own error pages, URLs the
search form can produce. Through Django's test client; tests/e2e/test_hostile_requests.py sends the
same through gunicorn. On PostgreSQL (the CI's second run) a NUL reaching a query raises, so the
admin sweep there is the proof that none does."""
from __future__ import annotations

import re
import uuid
from urllib.parse import urlencode

import pytest
from django.contrib import admin
from django.contrib.auth.views import redirect_to_login
from django.test import Client, RequestFactory
from django.urls import URLPattern, URLResolver, get_resolver

from embeddings import transport
from embeddings.site.fields import (
    LONGEST_DATE,
    LONGEST_DIVERSITY,
    NUMBER_CHARS,
    search_maxlengths,
)
from project import processes
from tests.embeddings.conftest import client_for

pytestmark = pytest.mark.django_db

BODY_METHODS = ("post", "put", "patch", "delete")
#: The request line's own bytes around the URL: "GET " and " HTTP/1.1".
LINE_OVERHEAD = len("GET  HTTP/1.1")


def signed_in(u, **kw) -> Client:
    c = Client(**kw)
    c.force_login(u)
    return c


def is_site_page(r, status: int, code: str) -> bool:
    """The site's own error page (site/error.html in site/base.html) with ``status`` and ``code``."""
    html = r.content.decode()
    return (r.status_code == status and r["Content-Type"].startswith("text/html")
            and "/static/site/site.css" in html and f"({status} {code}:" in html)


# --- a body without a length ------------------------------------------------------------------------

def test_a_body_sent_without_a_length_is_a_411_in_the_shape_of_its_area(user):
    api, site = client_for(user), signed_in(user)
    chunked = {"HTTP_TRANSFER_ENCODING": "chunked"}  # no data: the test client sets no CONTENT_LENGTH
    job = uuid.uuid4()
    for method in BODY_METHODS:
        for path in ("/api/images/", "/api/jobs/", f"/api/jobs/{job}/cancel/", "/api/search/", "/api/embeddings/"):
            r = api.generic(method.upper(), path, **chunked)
            assert (r.status_code, r.json()) == (411, {
                "message": "the body was sent with Transfer-Encoding and no Content-Length, which this service "
                           "cannot read: send it with a Content-Length header",
                "code": "length_required", "extra": {"header": "Content-Length"}}), (method, path)
        r = api.generic(method.upper(), "/v1/embeddings", **chunked)
        assert r.status_code == 411
        assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": None,
                                                        "code": "length_required"}
        assert is_site_page(site.generic(method.upper(), "/search/", **chunked), 411, "length_required")
    # a GET's body is never read: nothing is lost, nothing refused
    assert api.get("/api/jobs/", **chunked).status_code == 200
    # with a length the body is read as usual (a 400 for the missing field, not a 411)
    r = api.post("/api/search/", {"k": 3}, format="json", **chunked)
    assert (r.status_code, r.json()["code"]) == (400, "invalid_query")


# --- trailing slashes -------------------------------------------------------------------------------

def _routes(resolver=None, prefix: str = "") -> list[str]:
    """Every route of the URL configuration as a concrete path (uuid, int and str converters filled)."""
    out = []
    for p in (resolver or get_resolver()).url_patterns:
        route = prefix + str(p.pattern)
        if isinstance(p, URLResolver):
            out += _routes(p, route)
        elif isinstance(p, URLPattern):
            out.append("/" + re.sub(r"<(\w+):\w+>", lambda m: {"uuid": str(uuid.UUID(int=7)), "int": "7"}.get(
                m.group(1), "x"), route))
    return out


def test_every_api_route_without_its_trailing_slash_is_a_308_that_keeps_method_and_body(user, settings):
    settings.DEBUG = True  # Django raises (a 500) for a POST without the slash when DEBUG is on
    api = client_for(user)
    routes = [r for r in _routes() if r.startswith("/api/") and r.endswith("/")]
    assert len(routes) >= 20 and "/api/images/" in routes
    for route in routes:
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
            r = api.generic(method, route[:-1] + "?a=1", b'{"k": 1}', content_type="application/json")
            assert (r.status_code, r["Location"]) == (308, route + "?a=1"), (method, route)
            assert r.json() == {"message": f"this URL ends with a slash: repeat the request at {route}?a=1 (a 308 "
                                           f"keeps its method and body)",
                                "code": "trailing_slash", "extra": {"location": route + "?a=1"}}
    # the site: the same 308, a page's empty body
    r = signed_in(user).post("/search", {"q": "x"})
    assert (r.status_code, r["Location"], r.content) == (308, "/search/", b"")


def test_unknown_v1_paths_answer_openais_shape_and_name_the_slash(user):
    api = client_for(user)
    for path in ("/v1/models", "/v1", "/v1/embeddings/x"):
        r = api.post(path, {}, format="json")
        assert (r.status_code, r.json()) == (404, {"error": {"message": f"no such resource: {path}", "type":
                                                             "not_found_error", "param": None, "code": "not_found"}})
    r = api.post("/v1/embeddings/", {"input": "a"}, format="json")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == ("no such resource: /v1/embeddings/ (the resource is /v1/embeddings, "
                                            "without the trailing slash)")
    r = api.get("/api/nothing/")
    assert (r.status_code, r.json()) == (404, {"message": "no such resource: /api/nothing/", "code": "not_found",
                                               "extra": {}})


# --- control characters -----------------------------------------------------------------------------

def test_control_characters_in_the_url_are_refused_in_the_shape_of_its_area(user):
    api, site = client_for(user), signed_in(user)
    message = ("the request's {} holds a control character (U+0000 to U+001F other than tab, line feed and "
               "carriage return)")
    for path, where in (("/api/jobs/?status=%00", "query"), ("/api/images/?cursor=a%01b", "query"),
                        ("/api/images/%00/", "path"), ("/api/jobs/?x%1F=1", "query")):
        r = api.get(path)
        assert (r.status_code, r.json()) == (400, {"message": message.format(where), "code": "invalid_characters",
                                                   "extra": {"where": where}}), path
    r = api.post("/v1/embeddings?user=%00", {"input": "a"}, format="json")
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["type"]) == (
        400, "invalid_characters", "invalid_request_error")
    for path in ("/search/?q=%00", "/search/?q=a&job=%08", "/jobs/%00/"):
        assert is_site_page(site.get(path), 400, "invalid_characters"), path
    # tab, line feed and carriage return are text (pretty-printed JSON in a parameter)
    assert api.get("/api/jobs/?x=%09%0A%0D").status_code == 200


def test_control_characters_in_a_site_form_are_refused(user):
    r = Client().post("/login/", {"username": "alice\x00", "password": "pw"})
    assert is_site_page(r, 400, "invalid_characters") and "holds a control character" in r.content.decode()
    r = signed_in(user).post("/jobs/", {"source": "prefix", "prefix": "s3://bucket/\x1b"})
    assert is_site_page(r, 400, "invalid_characters")


def test_nul_in_api_bodies_is_refused_by_its_fields(user):
    """The API's bodies are not read by the middleware: DRF's fields and the metadata check refuse
    what PostgreSQL cannot store (NUL), JSON and multipart alike."""
    from embeddings.models import Image

    api = client_for(user)
    image = Image.objects.create(owner=user, lane="interactive", size_bytes=1, storage_key="k", model_id="m",
                                 sha256="0" * 64)
    cases = [
        ("patch", f"/api/images/{image.id}/", '{"external_id": "a\\u0000b"}', "invalid"),
        ("patch", f"/api/images/{image.id}/", '{"metadata": {"a": "x\\u0000y"}}', "metadata_invalid"),
        ("post", "/api/jobs/", '{"name": "a\\u0000", "prefix": "s3://b/p"}', "invalid"),
        ("post", "/api/webhooks/", '{"url": "https://example.com/", "description": "a\\u0000"}', "invalid"),
        ("post", "/api/search/", '{"text": "a\\u0000"}', "invalid"),
    ]
    for method, path, body, code in cases:
        r = getattr(api, method)(path, data=body, content_type="application/json")
        assert (r.status_code, r.json()["code"]) == (400, code), (path, body, r.content[:200])
    r = api.post("/api/jobs/", {"name": "a\x00", "prefix": "s3://b/p"}, format="multipart")
    assert (r.status_code, r.json()["extra"]) == (400, {"fields": {"name": ["Null characters are not allowed."]}})
    image.refresh_from_db()
    assert (image.external_id, image.metadata) == ("", {})


def _changelists() -> list[tuple[str, list[str]]]:
    """``(changelist URL, its list_filter field names)`` of every model in the admin."""
    return [(f"/admin/{m._meta.app_label}/{m._meta.model_name}/",
             [f for f in ma.list_filter if isinstance(f, str)]) for m, ma in admin.site._registry.items()]


def test_every_admin_changelist_refuses_hostile_lists_without_a_500(staff):
    c = signed_in(staff, raise_request_exception=False)
    lists = _changelists()
    # issue 45 added the duplicate scans, groups and "not duplicates" pairs (4 list filters); issue 56
    # the batch files and batches (1 each); issue 55 the API keys (its state filter is a class: not counted)
    # and the usage counter rows (kind, model_id, key_prefix)
    assert len(lists) == 16 and sum(len(f) for _, f in lists) == 26
    for url, fields in lists:
        for query in ["q=%00", "q=a%00b", "o=%00", "p=%00"] + [f"{f}__exact=%00" for f in fields] \
                + [f"{f}=%00" for f in fields] + [f"{f}__in=a,%00" for f in fields]:
            assert is_site_page(c.get(f"{url}?{query}"), 400, "invalid_characters"), (url, query)
        # the admin's own handling of what it cannot use: a junk order is ignored, a page that is not
        # one shows the nearest, ?e=1 (where the admin sends an invalid filter) its error page
        for query in ("o=junk", "o=99.-1", f"p={10**30}", "p=-1", "p=x", "e=1"):
            assert c.get(f"{url}?{query}").status_code == 200, (url, query)
        # list actions on ids that are not this model's keys
        for selected in ("junk", "-1", "1" * 40, str(uuid.uuid4())):
            r = c.post(url, {"action": "delete_selected", "index": "0", "_selected_action": selected})
            assert r.status_code in (200, 302), (url, selected, r.status_code)
        r = c.post(url, {"action": "delete_selected", "index": "0", "_selected_action": "\x00"})
        assert is_site_page(r, 400, "invalid_characters"), url


def test_a_list_action_on_ids_that_are_not_keys_says_so(staff):
    c = signed_in(staff)
    r = c.post("/admin/embeddings/image/", {"action": "delete_selected", "index": "0", "_selected_action": "junk"},
               follow=True)
    assert r.status_code == 200
    assert [str(m) for m in r.context["messages"]] == [
        "The selection holds ids that are not this list's: nothing was changed."]


# --- the site's own pages ---------------------------------------------------------------------------

def test_site_errors_are_the_sites_own_page(user, settings, monkeypatch):
    site = signed_in(user, raise_request_exception=False)
    r = site.get("/nowhere/")
    assert is_site_page(r, 404, "not_found") and "<h1>Not found</h1>" in r.content.decode()
    r = site.put("/search/")
    assert is_site_page(r, 405, "method_not_allowed") and r["Allow"] == "GET, POST"
    assert is_site_page(site.get("/logout/"), 405, "method_not_allowed")  # POST only
    r = Client(enforce_csrf_checks=True).post("/login/", {"username": "alice", "password": "pw"})
    assert is_site_page(r, 403, "csrf_failed")
    r = Client(HTTP_HOST="elsewhere.example").get("/login/")
    assert is_site_page(r, 400, "bad_request") and "ALLOWED_HOSTS" not in r.content.decode()  # that is the log's
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    r = Client().post("/login/", {"username": "a" * 2000, "password": "pw"})
    assert is_site_page(r, 413, "request_too_large") and "DATA_UPLOAD_MAX_MEMORY_SIZE (1000 bytes)" in r.content.decode()
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2_621_440
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 5
    r = Client().post("/login/", {f"f{i}": "x" for i in range(10)})
    assert is_site_page(r, 400, "too_many_fields")
    # an unhandled exception: the page again, rendered without the session or the database
    from embeddings.services.catalogue import reading

    monkeypatch.setattr(reading, "declared_types", lambda: 1 / 0)
    r = site.get("/search/")
    assert is_site_page(r, 500, "internal_error") and "Sign out" not in r.content.decode()


def test_handler500_answers_each_areas_shape():
    rf = RequestFactory()
    assert transport.handler500(rf.get("/api/images/")).content == (
        b'{"message": "internal error", "code": "internal_error", "extra": {}}')
    r = transport.handler500(rf.post("/v1/embeddings"))
    assert r.status_code == 500 and r.content == (b'{"error": {"message": "internal error", "type": "server_error", '
                                                  b'"param": null, "code": "internal_error"}}')
    assert is_site_page(transport.handler500(rf.get("/search/")), 500, "internal_error")


# --- how long a URL the site's search form produces -------------------------------------------------

DECLARED = [
    {},
    {"category": "keyword", "price": "float", "count": "integer", "taken": "datetime", "ok": "bool"},
    {f"field_{i}": "keyword" for i in range(20)} | {f"n_{i}": "float" for i in range(5)},
]


def longest_urls(declared: dict[str, str]) -> list[str]:
    """The longest search URL the page can produce with ``declared`` filter fields (every text input
    filled to its maxlength with a character of 9 URL bytes, dates the longest a browser sends, the
    page's own ``like``, ``all`` and ``diversity`` added), and the sign-in URL that carries it when signed out."""
    sizes, an_id = search_maxlengths(declared), str(uuid.uuid4())
    values = {"q": "\u4e2d" * sizes["q"], "like": an_id, "job": an_id, "all": "1", "diversity": LONGEST_DIVERSITY}
    for field, kind in declared.items():
        if kind == "keyword":
            values[f"m-{field}"] = "\u4e2d" * sizes[f"m-{field}"]
        elif kind in ("integer", "float"):
            values |= {f"m-{field}-{end}": "\u4e2d" * sizes[f"m-{field}-{end}"] for end in ("min", "max")}
        elif kind == "datetime":
            values |= {f"m-{field}-{end}": LONGEST_DATE for end in ("from", "to")}
        else:
            values[f"m-{field}"] = "yes"
    url = "/search/?" + urlencode(values)
    return [url, redirect_to_login(url)["Location"]]


@pytest.mark.parametrize("declared", DECLARED)
def test_the_longest_url_the_search_form_produces_fits_the_request_line(declared):
    sizes = search_maxlengths(declared)
    assert all(sizes[f"m-{f}-{end}"] == NUMBER_CHARS for f, k in declared.items() if k in ("integer", "float")
               for end in ("min", "max"))
    for url in longest_urls(declared):
        assert len(url) + LINE_OVERHEAD <= processes.REQUEST_LINE_BYTES
    if not declared:  # the bound is tight: one more character of q would not fit
        assert sizes == {"q": 534}
        url = "/search/?" + urlencode({"q": "\u4e2d" * 535, "like": str(uuid.uuid4()), "job": str(uuid.uuid4()),
                                       "all": "1", "diversity": LONGEST_DIVERSITY})
        assert len(redirect_to_login(url)["Location"]) + LINE_OVERHEAD > processes.REQUEST_LINE_BYTES


def test_the_search_page_carries_the_maxlengths_and_gunicorn_the_line_it_was_sized_for(user, monkeypatch):
    from embeddings.services.catalogue import reading

    monkeypatch.setattr(reading, "declared_types", lambda: dict(DECLARED[1]))
    sizes = search_maxlengths(DECLARED[1])
    html = signed_in(user).get("/search/").content.decode()
    assert f'name="q" type="search" value="" placeholder="a dog on a beach" maxlength="{sizes["q"]}"' in html
    for name in ("m-category", "m-price-min", "m-count-max"):
        assert re.search(rf'<input type="text" name="{name}"[^>]* maxlength="{sizes[name]}"', html), name
    assert 'name="m-count-min" form="text-search" inputmode="numeric"' in html
    assert f"--limit-request-line {processes.REQUEST_LINE_BYTES} " in processes.commands({})["web"]
