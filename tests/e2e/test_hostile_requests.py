"""Hostile requests through the real web process (gunicorn, ``project.wsgi``) and workers.

The files of ``../shared/data/cases/`` (n05, n06) are sent as their README says: a Content-Type
Django cannot parse is a JSON 400 on the API and no 500 anywhere; every file part, whatever its
name, is one entry (interactive) or one image of the job (bulk).

Around the views (``embeddings.transport``), as gunicorn passes them on: a chunked upload is a 411
(gunicorn de-chunks it but sets no length, and Django would read an empty body), a POST without its
trailing slash a 308 that a client follows with its body, the longest search the site's form allows
the site's own page (signed in or sent to sign in), a NUL in an admin filter a 400 page.
"""
from __future__ import annotations

import http.client
import json
import re
import time
from urllib.parse import quote, urlsplit

import cv2
import numpy as np
import pytest
import requests

from project.processes import REQUEST_LINE_BYTES
from tests.conftest import SHARED

pytestmark = pytest.mark.e2e

CASES = SHARED / "data" / "cases"
needs_cases = pytest.mark.skipif(not (CASES / "README.md").exists(), reason=f"{CASES} is not present")
BOGUS_CT = "multipart/form-data; boundary=n05boundaryQ7w3; charset*=x-no-such-charset''%41"
FALLBACKS = ["visible.png", "upload-2", "upload-3", "upload-4", "upload-5"]


def _body() -> bytes:
    return (b"--n05boundaryQ7w3\r\nContent-Disposition: form-data; name=\"files\"; filename=\"ok.png\"\r\n"
            b"Content-Type: image/png\r\n\r\nnot an image\r\n--n05boundaryQ7w3--\r\n")


def test_unparseable_content_type_is_a_json_400_and_no_url_answers_500(stack, api):
    data = (CASES / "n05_plain_body_for_bogus_content_type.multipart").read_bytes() if CASES.exists() else _body()
    for path in ("/api/images/", "/api/jobs/"):
        r = api.post(path, data=data, headers={"Content-Type": BOGUS_CT})
        assert r.status_code == 400, (path, r.text[:300])
        assert r.headers["Content-Type"].startswith("application/json")
        assert r.json() == {"message": r.json()["message"], "code": "malformed_request",
                            "extra": {"header": "Content-Type"}}
    r = api.get("/healthz", data=data, headers={"Content-Type": BOGUS_CT})
    assert (r.status_code, r.json()) == (200, {"ok": True})
    assert api.get("/api/images/", headers={"Content-Type": BOGUS_CT}).status_code == 200
    # a truncated body (no closing boundary) is a 400 too, in the error shape
    r = api.post("/api/images/", data=_body()[:-25], headers={"Content-Type": "multipart/form-data; boundary=n05boundaryQ7w3"})
    assert (r.status_code, r.json()["code"]) == (400, "malformed_multipart")


@needs_cases
def test_a_file_named_only_by_filename_star_in_an_unknown_charset_is_embedded(api):
    data = (CASES / "n05_filename_star_bogus_charset.multipart").read_bytes()
    r = api.post("/api/images/", data=data, headers={"Content-Type": "multipart/form-data; boundary=n05boundaryQ7w3"})
    assert r.status_code == 200, r.text[:300]
    assert [(im["original_name"], im["status"]) for im in r.json()["images"]] == [("cat photo.png", "embedded")]


@needs_cases
def test_five_nameless_parts_are_five_entries_and_five_job_images(api):
    data = (CASES / "n06_nameless_parts.multipart").read_bytes()
    ct = {"Content-Type": "multipart/form-data; boundary=n06boundaryK2p9"}
    r = api.post("/api/images/", data=data, headers=ct)
    assert r.status_code == 200, r.text[:300]
    images = r.json()["images"]
    assert [(im["original_name"], im["status"]) for im in images] == [(n, "embedded") for n in FALLBACKS]
    assert [im.get("raw_name") for im in images] == [None, "", "holiday.png/", "..", "\t"]

    r = api.post("/api/jobs/", data=data, headers=ct)
    assert r.status_code == 202, r.text[:300]
    assert r.json()["total"] == 5 and [x["name"] for x in r.json()["renamed"]] == FALLBACKS[1:]
    deadline = time.monotonic() + 120
    while (j := api.get(r.json()["url"]).json())["status"] not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, j
        time.sleep(0.5)
    # the same bytes were embedded by the interactive request just before: all five are skipped
    assert (j["status"], j["total"], j["embedded"], j["skipped"], j["failed"]) == ("done", 5, 0, 5, 0)


# --- around the views (embeddings/transport.py) -----------------------------------------------------

PASSWORD = "correct horse battery"


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return cv2.imencode(".png", pixels)[1].tobytes()


def _multipart(data: bytes) -> tuple[bytes, str]:
    body = (b"--b44\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n" + data + b"\r\n--b44--\r\n")
    return body, "multipart/form-data; boundary=b44"


def _chunked(stack, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    """``POST path`` with ``body`` sent ``Transfer-Encoding: chunked`` (1 KiB chunks, no
    Content-Length) through http.client → ``(status, headers, body)``."""
    u = urlsplit(stack.web_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", path, body=(body[i:i + 1024] for i in range(0, len(body), 1024)), headers=headers,
                     encode_chunked=True)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_a_chunked_upload_is_a_411_naming_the_length_not_an_empty_request(stack, api):
    body, ctype = _multipart(_png(4401))
    auth = {"Authorization": api.s.headers["Authorization"]}
    for path in ("/api/images/", "/api/jobs/"):
        status, headers, answer = _chunked(stack, path, body, {**auth, "Content-Type": ctype})
        assert (status, headers["Content-Type"]) == (411, "application/json"), answer[:300]
        assert json.loads(answer) == {
            "message": "the body was sent with Transfer-Encoding and no Content-Length, which this service cannot "
                       "read: send it with a Content-Length header",
            "code": "length_required", "extra": {"header": "Content-Length"}}
    status, _, answer = _chunked(stack, "/v1/embeddings", b'{"input": "a cat"}',
                                 {**auth, "Content-Type": "application/json"})
    error = json.loads(answer)["error"]
    assert (status, error["code"], error["type"], error["param"]) == (411, "length_required", "invalid_request_error",
                                                                      None)
    # the same body with its length is read
    r = api.post("/api/images/", data=body, headers={"Content-Type": ctype})
    assert r.status_code == 200 and [im["status"] for im in r.json()["images"]] == ["embedded"]


def test_a_post_without_its_trailing_slash_is_followed_with_its_body(api):
    r = api.post("/api/images", files={"files": ("b.png", _png(4402), "image/png")})
    assert [h.status_code for h in r.history] == [308]
    assert r.history[0].headers["Location"] == "/api/images/"
    assert r.history[0].json()["code"] == "trailing_slash"
    assert (r.status_code, [im["status"] for im in r.json()["images"]]) == (200, ["embedded"])


def _signed_in(stack, username: str, *, staff: bool = False) -> requests.Session:
    """A browser-like session signed in to the site through its sign-in form."""
    stack.site_user(username, PASSWORD, staff=staff)
    s = requests.Session()
    s.get(stack.web_url + "/login/", timeout=60)
    r = s.post(stack.web_url + "/login/", timeout=60, data={
        "csrfmiddlewaretoken": s.cookies["csrftoken"], "username": username, "password": PASSWORD})
    assert r.status_code == 200 and "sessionid" in s.cookies, r.text[:300]
    return s


def test_the_longest_search_the_form_allows_gets_the_sites_page_signed_in_or_out(stack):
    s = _signed_in(stack, "e2e-hostile-site")
    page = s.get(stack.web_url + "/search/", timeout=60).text
    maxlength = int(re.search(r'name="q" [^>]*maxlength="(\d+)"', page).group(1))
    assert maxlength >= 460  # the search of 460 CJK characters fits
    url = stack.web_url + "/search/?" + "q=" + quote("\u4e2d" * maxlength) + "&job="
    r = s.get(url, timeout=120)
    assert r.status_code == 200 and '<h2 class="results-title">' in r.text, r.text[:300]
    # signed out: sent to sign in with the search in ?next=, and that URL is read too
    r = requests.get(url, timeout=60)
    assert [h.status_code for h in r.history] == [302] and r.history[0].headers["Location"].startswith("/login/?next=")
    assert r.status_code == 200 and 'name="next"' in r.text
    # past any form's URL: gunicorn's own 414, never a 500
    r = requests.get(stack.web_url + "/search/?q=" + "a" * REQUEST_LINE_BYTES, timeout=60)
    assert r.status_code == 414


def test_a_nul_in_an_admin_filter_is_a_400_page(stack):
    s = _signed_in(stack, "e2e-hostile-staff", staff=True)
    for query in ("status__exact=%00", "q=%00", "lane=a%00"):
        r = s.get(stack.web_url + "/admin/embeddings/image/?" + query, timeout=60)
        assert (r.status_code, r.headers["Content-Type"]) == (400, "text/html; charset=utf-8"), query
        assert "(400 invalid_characters:" in r.text and "</html>" in r.text
    assert s.get(stack.web_url + "/admin/embeddings/image/?status__exact=failed", timeout=60).status_code == 200


# --- cost bounded by the request's size (p07, p08) ---------------------------------------------------

@needs_cases
def test_many_parts_and_zip_bombs_are_refused_at_once_through_gunicorn(api):
    data = (CASES / "p07_many_parts_20000.multipart").read_bytes()
    r = api.post("/api/images/", data=data, headers={"Content-Type": "multipart/form-data; boundary=p07B"})
    assert (r.status_code, r.json()["code"], r.json()["extra"]["refused_count"]) == (400, "too_many_parts", 2000)
    assert len(r.content) < 2048  # was 1.98 MB, every part listed
    r = api.post("/api/jobs/", files={"zip": ("p08.zip", (CASES / "p08_zip_overlap_24x60MiB.zip").read_bytes())})
    assert (r.status_code, r.json()["code"]) == (400, "zip_unsafe")
    r = api.post("/api/jobs/", files={"zip": ("one.zip", (CASES / "p08_zip_single_60MiB.zip").read_bytes())})
    assert (r.status_code, r.json()["total"]) == (202, 1)
    deadline = time.monotonic() + 60
    while (j := api.get(r.json()["url"]).json())["status"] != "done":
        assert time.monotonic() < deadline, j
        time.sleep(0.5)
    assert [(f["original_name"], f["reason"]) for f in j["failures"]] == [("same.jpg", "too_large")]
