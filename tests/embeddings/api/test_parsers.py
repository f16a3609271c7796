"""Hostile multipart requests (issue 9): no request ends in a 500, and no file part disappears.

Requests go through ``project.wsgi.application``, the WSGI callable gunicorn and runserver serve:
Django's test client builds a plain ``WSGIRequest`` in its own handler and could not even send a
Content-Type that Django fails to parse. The app runs with eager Celery (tests/embeddings/conftest.py);
file parts are tiny non-images (refused ``not_an_image`` before the model) unless a test says
otherwise. The files of ``../shared/data/cases/`` are sent as their README says when present.
"""
from __future__ import annotations

import io
import json
import sys
import zipfile

import cv2
import numpy as np
import pytest
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from embeddings.services.catalogue.sources import from_zip, safe_name
from tests.conftest import SHARED

pytestmark = pytest.mark.django_db(transaction=True)

CASES = SHARED / "data" / "cases"
needs_cases = pytest.mark.skipif(not (CASES / "README.md").exists(), reason=f"{CASES} is not present")
BOGUS_CT = "multipart/form-data; boundary=n05boundaryQ7w3; charset*=x-no-such-charset''%41"
ERROR_KEYS = {"message", "code", "extra"}


# --- a WSGI client for project.wsgi.application ----------------------------------------------

def wsgi_environ(method: str, path: str, body: bytes, content_type: str | None) -> dict:
    """A WSGI environ as gunicorn gives it (PEP 3333)."""
    environ = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "", "QUERY_STRING": "",
        "SERVER_NAME": "testserver", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "testserver", "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
        "wsgi.version": (1, 0), "wsgi.url_scheme": "http", "wsgi.errors": sys.stderr,
        "wsgi.multithread": False, "wsgi.multiprocess": False, "wsgi.run_once": False,
    }
    if content_type is not None:
        environ["CONTENT_TYPE"] = content_type
    return environ


class Wsgi:
    """Calls ``project.wsgi.application`` as a WSGI server would; ``token`` authenticates."""

    def __init__(self, token: str | None = None) -> None:
        from project.wsgi import application

        self.app, self.token = application, token

    def request(self, method: str, path: str, body: bytes = b"", content_type: str | None = None, **headers: str):
        environ = wsgi_environ(method, path, body, content_type)
        if self.token:
            environ["HTTP_AUTHORIZATION"] = f"Token {self.token}"
        environ.update({f"HTTP_{k.upper()}": v for k, v in headers.items()})
        self.last_environ = environ
        started = []
        # As Django's test client does: the test's database connection must survive the request.
        request_started.disconnect(close_old_connections)
        request_finished.disconnect(close_old_connections)
        try:
            result = self.app(environ, lambda status, headers, exc_info=None: started.append((status, headers)))
            try:
                body_out = b"".join(result)
            finally:
                result.close()
        finally:
            request_started.connect(close_old_connections)
            request_finished.connect(close_old_connections)
        status, headers = started[0]
        return Answer(int(status.split()[0]), dict(headers), body_out)


class Answer:
    def __init__(self, status: int, headers: dict, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)

    def error(self) -> dict:
        """The body, checked to be the API's one error shape."""
        assert self.headers.get("Content-Type", "").startswith("application/json"), (self.status, self.body[:200])
        body = self.json()
        assert set(body) == ERROR_KEYS, body
        return body


@pytest.fixture
def wsgi(service, user):
    from rest_framework.authtoken.models import Token

    return Wsgi(Token.objects.get_or_create(user=user)[0].key)


# --- building bodies ---------------------------------------------------------------------------

def part(disposition: str | bytes | None, data: bytes = b"not an image", content_type: str | None = "image/png") -> bytes:
    """One part: headers (``disposition`` is the Content-Disposition value, None: no such header)
    then the data."""
    lines = []
    if disposition is not None:
        d = disposition if isinstance(disposition, bytes) else disposition.encode()
        lines.append(b"Content-Disposition: " + d)
    if content_type:
        lines.append(b"Content-Type: " + content_type.encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + data


def body(boundary: str, parts: list[bytes], *, close: bool = True) -> bytes:
    b = boundary.encode()
    out = b"".join(b"--" + b + b"\r\n" + p + b"\r\n" for p in parts)
    return out + (b"--" + b + b"--\r\n" if close else b"")


def file_part(filename: str, data: bytes = b"not an image", field: str = "files") -> bytes:
    return part(f'form-data; name="{field}"; filename="{filename}"', data)


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return cv2.imencode(".png", rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))[1].tobytes()


NAMELESS = ["visible.png", "", "holiday.png/", "..", "\t"]  # the five names of n06_nameless_parts
FALLBACKS = ["visible.png", "upload-2", "upload-3", "upload-4", "upload-5"]


# --- the Content-Type header ---------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    "charset*=x-no-such-charset''%41",
    "boundary*=x-unknown''n05boundaryQ7w3",
    "name*=no-such''a; charset=utf-8",
])
def test_unparseable_content_type_is_a_400_in_the_error_shape_never_a_500(wsgi, params):
    ct = f"multipart/form-data; boundary=n05boundaryQ7w3; {params}"
    data = body("n05boundaryQ7w3", [file_part("ok.png")])
    for path in ("/api/images/", "/api/jobs/", "/api/search/"):
        r = wsgi.request("POST", path, data, ct)
        assert r.status == 400, (path, r.body[:300])
        err = r.error()
        assert err["code"] == "malformed_request" and err["extra"] == {"header": "Content-Type"}
    r = wsgi.request("GET", "/healthz", b"", ct)  # a URL that never reads the body answers as usual
    assert (r.status, r.json()) == (200, {"ok": True})
    # Django's own form parsing: the CSRF middleware reads the posted token from the body
    r = wsgi.request("POST", "/admin/login/", data, ct, cookie="csrftoken=" + "a" * 32)
    assert r.status == 400


@needs_cases
def test_shared_case_bogus_content_type(wsgi):
    data = (CASES / "n05_plain_body_for_bogus_content_type.multipart").read_bytes()
    r = wsgi.request("POST", "/api/images/", data, BOGUS_CT)
    assert r.status == 400 and r.error()["code"] == "malformed_request"
    assert wsgi.request("GET", "/healthz", data, BOGUS_CT).status == 200


@pytest.mark.parametrize("path", ["/api/search/", "/api/jobs/"])
def test_json_nested_past_the_recursion_limit_is_a_400_in_the_error_shape(wsgi, path):
    """``json`` raises RecursionError, not ValueError, on deep ``[[[…]]]``: a 400 ``json_too_deep``
    naming the limit (``JSON_MAX_DEPTH``), never a 500 (the shared case p02, and one made here);
    malformed JSON stays a ``parse_error``."""
    made = b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b', "k": 3}'
    shared = CASES / "p02_nested_arrays_50000.json"
    for data in [made, *([shared.read_bytes()] if shared.exists() else [])]:
        r = wsgi.request("POST", path, data, "application/json")
        assert r.status == 400 and r.error()["code"] == "json_too_deep", r.status
        assert r.error()["extra"] == {"limit": "JSON_MAX_DEPTH", "value": 64, "field": None}
    assert wsgi.request("POST", path, b'{"text": [1,', "application/json").error()["code"] == "parse_error"


# --- file parts with unusable names ----------------------------------------------------------

def test_every_file_part_is_an_entry_with_a_fallback_name_where_its_name_is_unusable(wsgi):
    data = body("n06boundaryK2p9", [file_part(n) for n in NAMELESS] + [part('form-data; name="k"', b"0", None)])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=n06boundaryK2p9")
    assert r.status == 200, r.body[:300]
    images = r.json()["images"]
    assert [im["original_name"] for im in images] == FALLBACKS
    assert [im.get("raw_name") for im in images] == [None, "", "holiday.png/", "..", "\t"]
    assert [(im["status"], im["reason"]) for im in images] == [("failed", "not_an_image")] * 5


def test_a_file_named_only_by_filename_star_in_an_unknown_charset_is_accepted(wsgi):
    data = body("b1", [part("form-data; name=\"files\"; filename*=x-no-such-charset''cat%20photo%E2%9C%93.png")])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b1")
    assert r.status == 415, r.body[:300]  # the one file is refused for what it is, not for its name
    (im,) = r.json()["images"]
    assert (im["original_name"], im["reason"]) == ("cat photo\u2713.png", "not_an_image")


@pytest.mark.parametrize("memory_bytes", [5 * 1024 * 1024, 0], ids=["in memory", "temporary files"])
def test_names_are_made_safe_for_display(wsgi, settings, memory_bytes):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = memory_bytes  # 0: every file through TemporaryFileUploadHandler
    sent = ["a\tb.png", "C:\\Users\\me\\c.png", "../../etc/d.png", "e\u202egnp.exe", " f.png ", "x" * 300 + ".png",
            "a." + "é" * 200, *NAMELESS]
    data = body("b2", [file_part(n) for n in sent])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b2")
    assert r.status == 200, r.body[:300]
    names = [im["original_name"] for im in r.json()["images"]]
    assert names == ["ab.png", "c.png", "d.png", "egnp.exe", "f.png", "x" * 251 + ".png", "a." + "é" * 200,
                     "visible.png", "upload-9", "upload-10", "upload-11", "upload-12"]


def test_jobs_count_every_file_part_and_list_the_renamed(wsgi):
    data = body("b3", [file_part(n) for n in NAMELESS])
    r = wsgi.request("POST", "/api/jobs/", data, "multipart/form-data; boundary=b3")
    assert r.status == 202, r.body[:300]
    j = r.json()
    assert j["total"] == 5
    assert j["renamed"] == [{"name": f, "raw_name": n} for f, n in zip(FALLBACKS[1:], NAMELESS[1:])]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in ("dir/", "ok.png", "holiday.png/", "sub/\t"):
            z.writestr(name, b"" if name == "dir/" else b"not an image")
    data = body("b3", [file_part("a.zip", buf.getvalue(), field="zip")])
    r = wsgi.request("POST", "/api/jobs/", data, "multipart/form-data; boundary=b3")
    assert r.status == 202, r.body[:300]
    assert (r.json()["total"], r.json()["renamed"]) == (
        3, [{"name": "entry-3", "raw_name": "holiday.png/"}, {"name": "entry-4", "raw_name": "sub/\t"}])


def test_zip_entries_with_unusable_names_are_entries_too():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("dir/", b"")  # a real directory: no entry
        z.writestr("ok.png", b"1")
        z.writestr("holiday.png/", b"2")  # a name like a directory's, but it holds bytes
        z.writestr("sub/\t", b"3")
        z.writestr("sub/a\x01b.png", b"4")
        z.writestr("\x01", b"5")
    got = from_zip(io.BytesIO(buf.getvalue()), max_entries=10, max_uncompressed=100)
    assert [(s.name, s.raw_name) for s in got] == [
        ("ok.png", None), ("entry-3", "holiday.png/"), ("entry-4", "sub/\t"), ("sub/ab.png", "sub/a\x01b.png"),
        ("entry-6", "\x01"),
    ]
    assert [s.open().read() for s in got] == [b"1", b"2", b"3", b"4", b"5"]


def test_safe_name():
    assert [safe_name(n, fallback="F") for n in (None, "", ".", "..", "a/", "\x00\x7f", "é.png", "a\\b")] == [
        "F", "F", "F", "F", "F", "F", "é.png", "b"]
    assert safe_name("a/./b//c.png", fallback="F", keep_dirs=True) == "a/b/c.png"


# --- parts that cannot be used -------------------------------------------------------------------

def test_parts_the_endpoint_does_not_read_are_a_400_that_lists_them(wsgi):
    data = body("b4", [file_part("a.png"), file_part("b.png", field="photos"), part('form-data; name="files"', b"x", None)])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b4")
    assert r.status == 400
    err = r.error()
    assert err["code"] == "unexpected_parts"
    assert [(p["part"], p["field"], p["filename"]) for p in err["extra"]["parts"]] == [
        (2, "photos", "b.png"), (None, "files", None)]


def test_parts_without_a_usable_disposition_are_a_400_that_lists_them(wsgi):
    data = body("b5", [file_part("a.png"), part(None), part('form-data; filename="x.png"'), b"no headers at all"])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b5")
    assert r.status == 400
    err = r.error()
    assert err["code"] == "malformed_multipart"
    assert [p["part"] for p in err["extra"]["parts"]] == [2, 3, 4]


def test_a_part_of_headers_and_no_body_is_an_empty_part(wsgi):
    # RFC 2046: body-part := headers [CRLF *OCTET], so an empty part may end at its header lines'
    # CRLF (werkzeug writes an empty file so): the part is read as empty, not refused as headerless
    empty = b'Content-Disposition: form-data; name="external_id"\r\nContent-Type: text/plain'
    data = body("b8", [file_part("a.png", png(3)), empty])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b8")
    assert r.status == 200, r.body[:300]
    assert r.json()["images"][0]["external_id"] is None


@pytest.mark.parametrize("data", [
    body("b6", [file_part("a.png")], close=False),  # truncated: no closing boundary
    b"no boundary anywhere",
    b"--b6\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.png\"\r\n" + b"x" * 2000,  # no header end
    body("b6", [part('form-data; name="files"; filename="a.png"', b"!!!", "image/png\r\nContent-Transfer-Encoding: base64")]),
])
def test_a_body_that_cannot_be_split_into_parts_is_a_400(wsgi, data):
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b6")
    assert r.status == 400 and r.error()["code"] == "malformed_multipart", r.body[:300]


def test_django_forms_get_every_part_too(service):
    """``request.FILES`` outside the API (the site's forms) goes through the same parser."""
    from django.core.exceptions import BadRequest

    from project.wsgi import Request

    data = body("b7", [file_part(n, field="image") for n in NAMELESS])
    req = Request(wsgi_environ("POST", "/", data, "multipart/form-data; boundary=b7"))
    assert [f.name for f in req.FILES.getlist("image")] == FALLBACKS
    req = Request(wsgi_environ("POST", "/", data, BOGUS_CT))
    assert req.content_type == "multipart/form-data" and req.content_type_error
    with pytest.raises(BadRequest):
        req.POST


# --- the shared cases ------------------------------------------------------------------------

@needs_cases
def test_shared_cases_filename_star_and_nameless_parts(wsgi):
    data = (CASES / "n05_filename_star_bogus_charset.multipart").read_bytes()
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=n05boundaryQ7w3")
    assert r.status == 200, r.body[:300]
    assert [(im["original_name"], im["status"]) for im in r.json()["images"]] == [("cat photo.png", "embedded")]
    data = (CASES / "n06_nameless_parts.multipart").read_bytes()
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=n06boundaryK2p9")
    assert r.status == 200, r.body[:300]
    assert [(im["original_name"], im["status"]) for im in r.json()["images"]] == [(n, "embedded") for n in FALLBACKS]
    r = wsgi.request("POST", "/api/jobs/", data, "multipart/form-data; boundary=n06boundaryK2p9")
    assert r.status == 202 and r.json()["total"] == 5


# --- fuzz --------------------------------------------------------------------------------------

ODD_NAMES = ["a.png", "", ".", "..", "/", "holiday.png/", "\t", "a\x00b", "é.png", "a\\b.png", "x" * 400,
             "a\"b.png", "a;b.png", "%41.png", "\u202e.png", "\r", "\n"]
BOGUS_PARAMS = ["", "; charset*=x-no-such-charset''%41", "; charset=x-unknown", "; boundary*=x-bad''b",
                "; ;;=", "; a*0*=x''y; a*1=z", "; charset*=utf-8''%FF"]
FIELDS = ["files"] * 6 + ["file", "image", "k", "photos", ""]


@st.composite
def file_parts(draw):
    name = draw(st.sampled_from(ODD_NAMES) | st.text(max_size=12))
    how = draw(st.sampled_from(["quoted", "quoted", "rfc2231", "bogus_charset", "latin1", "none", "unquoted"]))
    field = draw(st.sampled_from(FIELDS))
    if how == "quoted":
        disp = f'form-data; name="{field}"; filename="{name}"'.encode("utf-8", "surrogatepass")
    elif how in ("rfc2231", "bogus_charset"):
        from urllib.parse import quote

        cs = "utf-8" if how == "rfc2231" else "x-no-such-charset"
        disp = f"form-data; name=\"{field}\"; filename*={cs}''{quote(name.encode('utf-8', 'surrogatepass'))}".encode()
    elif how == "latin1":
        disp = f'form-data; name="{field}"; filename="'.encode() + name.encode("latin-1", "replace") + b'"'
    elif how == "unquoted":
        disp = f"form-data; name={field}; filename={name}".encode("utf-8", "surrogatepass")
    else:
        disp = f'form-data; name="{field}"'.encode()
    data = draw(st.sampled_from([b"not an image", b"", b"\x89PNG\r\n\x1a\n", b"--", b"\r\n--b"]))
    return part(disp, data, draw(st.sampled_from(["image/png", None, "text/plain; charset*=x-bad''q"])))


@st.composite
def requests_(draw):
    boundary = draw(st.sampled_from(["b", "fuzzB0undary", "a b", "x" * 71]))
    parts = draw(st.lists(file_parts(), max_size=5))
    raw = body(boundary, parts, close=draw(st.sampled_from([True] * 6 + [False])))
    mutation = draw(st.sampled_from(["none"] * 6 + ["truncate", "drop_crlf", "bad_boundary", "garbage"]))
    at = draw(st.integers(min_value=0, max_value=max(0, len(raw) - 1)))
    if mutation == "truncate":
        raw = raw[:at]
    elif mutation == "drop_crlf":
        i = raw.find(b"\r\n", at)
        raw = raw if i < 0 else raw[:i] + raw[i + 2:]
    elif mutation == "bad_boundary":
        raw = raw.replace(b"--" + boundary.encode(), b"--" + boundary.encode()[:-1] + b"#", 1)
    elif mutation == "garbage":
        raw = raw[:at] + draw(st.binary(max_size=16)) + raw[at:]
    ct = f"multipart/form-data; boundary={draw(st.sampled_from([boundary] * 10 + [f'{boundary!r}', '', 'other']))}"
    ct += draw(st.sampled_from([""] * 8 + BOGUS_PARAMS))
    return draw(st.sampled_from(["/api/images/", "/api/jobs/"])), ct, raw, parts


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests_())
def test_fuzz_upload_endpoints_never_5xx_and_always_answer_in_shape(wsgi, req):
    path, ct, raw, _ = req
    r = wsgi.request("POST", path, raw, ct)
    assert r.status < 500, (r.status, r.body[:300])
    if r.status < 400:
        event(f"{r.status}")
    elif "images" in r.json():  # the upload's own answer when its only file is refused (README)
        (im,) = r.json()["images"]
        assert im["status"] == "failed" and im["reason"]
        event(f"{r.status} one file refused: {im['reason']}")
    else:
        event(f"{r.status} {r.error()['code']}")  # shown by --hypothesis-show-statistics


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.sampled_from(ODD_NAMES) | st.text(max_size=12), min_size=1, max_size=5),
       st.sampled_from(["/api/images/", "/api/jobs/"]))
def test_fuzz_well_formed_bodies_give_one_entry_per_file_part(wsgi, names, path):
    from urllib.parse import quote

    # filename* (RFC 2231) carries any name, quotes and line breaks included, in a well-formed header
    parts = [part(f"form-data; name=\"files\"; filename*=utf-8''{quote(n.encode('utf-8', 'surrogatepass'))}")
             for n in names]
    r = wsgi.request("POST", path, body("wellFormed", parts), "multipart/form-data; boundary=wellFormed")
    assert r.status < 500, r.body[:300]
    if path == "/api/jobs/":
        assert (r.status, r.json()["total"]) == (202, len(names))
    else:
        images = r.json()["images"]
        assert len(images) == len(names)
        assert all(im["original_name"] and im["original_name"].isprintable() for im in images)
