"""Hostile multipart requests through the real web process (gunicorn, ``project.wsgi``) and workers.

The files of ``../shared/data/cases/`` (n05, n06) are sent as their README says: a Content-Type
Django cannot parse is a JSON 400 on the API and no 500 anywhere; every file part, whatever its
name, is one entry (interactive) or one image of the job (bulk).
"""
from __future__ import annotations

import time

import pytest

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
