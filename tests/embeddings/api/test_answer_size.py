"""Cost per request bounded by its size (issue 44): multipart parts counted against a limit, error
answers of bounded size, and nothing left behind by a refused upload (temporary files, blobs).

Requests go through ``project.wsgi.application`` (``tests/embeddings/api/test_parsers.py``'s client);
the shared case p07 (20,000 parts with empty header blocks) is sent as ``../shared/data/cases``'s
README says when present.
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

from embeddings.api.answer_size import BUDGET_CHARS, MAX_CHARS, MORE, bounded, bounded_error
from embeddings.models import Image, Job
from tests.embeddings.conftest import jpeg_bytes
from tests.embeddings.api.test_parsers import CASES, Wsgi, body, file_part, needs_cases, part

pytestmark = pytest.mark.django_db(transaction=True)

#: The most an error answer may weigh here (the module says "a few KB").
ANSWER_BYTES = 8 * 1024
TOO_MANY = "DATA_UPLOAD_MAX_NUMBER_FIELDS + DATA_UPLOAD_MAX_NUMBER_FILES"
UPLOADS = ("/api/images/", "/api/jobs/", "/api/search/")


@pytest.fixture
def wsgi(service, user):
    from rest_framework.authtoken.models import Token

    return Wsgi(Token.objects.get_or_create(user=user)[0].key)


def bare(n: int) -> list[bytes]:
    """``n`` parts with an empty header block, as in p07."""
    return [b"\r\nx"] * n


# --- every part counts against a limit ----------------------------------------------------------

@pytest.mark.parametrize("path", UPLOADS)
def test_parts_past_fields_plus_files_are_refused_and_the_body_read_no_further(wsgi, settings, path):
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS, settings.DATA_UPLOAD_MAX_NUMBER_FILES = 3, 2
    r = wsgi.request("POST", path, body("b", bare(5)), "multipart/form-data; boundary=b")
    err = r.error()
    assert (r.status, err["code"], err["extra"]["refused_count"]) == (400, "malformed_multipart", 5)
    # a sixth part: refused at once, whatever follows (here a body that never closes)
    data = body("b", bare(6) + [file_part("late.png")], close=False)
    r = wsgi.request("POST", path, data, "multipart/form-data; boundary=b")
    err = r.error()
    assert (r.status, err["code"]) == (400, "too_many_parts")
    assert err["extra"] == {"limit": TOO_MANY, "value": 5, "refused_count": 5,
                            "parts": [{"part": n, "reason": "no Content-Disposition header"} for n in range(1, 6)]}


def test_the_rest_of_a_refused_body_is_read_and_dropped(wsgi):
    """gunicorn closes a keep-alive connection with more than 64 KiB of body unread: the client's
    next request on it would fail. The body past the limit is read (not parsed) to its end."""
    data = body("b", bare(20_000))
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b")
    assert (r.status, r.error()["code"]) == (400, "too_many_parts")
    assert wsgi.last_environ["wsgi.input"].tell() == len(data) > 64 * 1024


def test_usable_parts_up_to_the_limit_are_read(wsgi, settings):
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS, settings.DATA_UPLOAD_MAX_NUMBER_FILES = 1, 2
    data = body("b", [file_part("a.png"), file_part("b.png"), part('form-data; name="k"', b"0", None)])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b")
    assert r.status == 200, r.body[:300]
    assert [im["original_name"] for im in r.json()["images"]] == ["a.png", "b.png"]


@needs_cases
@pytest.mark.parametrize("path", UPLOADS)
def test_shared_case_p07_twenty_thousand_parts_get_a_bounded_answer(wsgi, path):
    data = (CASES / "p07_many_parts_20000.multipart").read_bytes()
    r = wsgi.request("POST", path, data, "multipart/form-data; boundary=p07B")
    err = r.error()
    assert (r.status, err["code"]) == (400, "too_many_parts")
    assert err["extra"] == {"limit": TOO_MANY, "value": 2000, "refused_count": 2000,
                            "parts": [{"part": n, "reason": "no Content-Disposition header"} for n in range(1, 11)]}
    assert len(r.body) < 2048, len(r.body)  # was 1.98 MB: every part listed


@needs_cases
def test_shared_case_p07_on_a_site_form_is_the_sites_400_page(wsgi):
    data = (CASES / "p07_many_parts_20000.multipart").read_bytes()
    r = wsgi.request("POST", "/search/", data, "multipart/form-data; boundary=p07B")
    assert r.status == 400 and r.headers["Content-Type"].startswith("text/html")
    assert len(r.body) < ANSWER_BYTES and b"and 1990 more" in r.body


def test_refused_parts_are_counted_and_ten_listed(wsgi):
    r = wsgi.request("POST", "/api/images/", body("b", [file_part("a.png")] + bare(1500)),
                     "multipart/form-data; boundary=b")
    err = r.error()
    assert (r.status, err["code"], err["extra"]["refused_count"]) == (400, "malformed_multipart", 1500)
    assert [p["part"] for p in err["extra"]["parts"]] == list(range(2, 12))
    assert err["message"].endswith("; and 1490 more") and len(r.body) < 2048


def test_unexpected_parts_are_counted_and_ten_listed(wsgi):
    data = body("b", [file_part(f"{i}.png", field=f"photo{i}") for i in range(900)])
    r = wsgi.request("POST", "/api/images/", data, "multipart/form-data; boundary=b")
    err = r.error()
    assert (r.status, err["code"], err["extra"]["refused_count"]) == (400, "unexpected_parts", 900)
    assert [(p["part"], p["field"]) for p in err["extra"]["parts"]] == [(i + 1, f"photo{i}") for i in range(10)]
    assert len(r.body) < 4096, len(r.body)  # was 186 KB


# --- error answers that echo their input --------------------------------------------------------

@pytest.mark.parametrize("path, payload, field", [
    ("/api/jobs/", {"callback_events": ["bad"] * 100_000}, "callback_events"),
    ("/api/webhooks/", {"url": "https://example.com/hook", "events": ["bad"] * 100_000}, "events"),
])
def test_a_field_error_listing_100000_items_is_cut_to_ten_and_counted(wsgi, path, payload, field):
    r = wsgi.request("POST", path, json.dumps(payload).encode(), "application/json")
    err = r.error()
    assert (r.status, err["code"]) == (400, "invalid")
    items = err["extra"]["fields"][field]
    assert list(items) == [str(i) for i in range(10)] + [MORE] and items[MORE] == 99_990
    assert len(r.body) < 1024, len(r.body)  # was 4.3 MB


def test_bounded_keeps_small_values_and_cuts_long_ones():
    small = {"parts": [{"part": 1, "reason": "x"}], "limit": "L", "value": 5, "ok": True, "none": None}
    assert bounded(small) == small
    assert bounded(list(range(25))) == list(range(10)) + [f"{MORE} 15 more"]
    assert bounded({f"k{i}": i for i in range(12)}) == {**{f"k{i}": i for i in range(10)}, MORE: 2}
    assert bounded("é" * 3000) == "é" * MAX_CHARS + f"{MORE} (3000 characters)"
    # past the budget, items are counted instead of shown: four strings of 1000 characters spend it
    assert bounded([["y" * 1000] * 10, ["z"] * 5]) == [["y" * 1000] * 4 + [f"{MORE} 6 more"], f"{MORE} 1 more"]
    deep = {"a": [{str(i): ["w" * 5000] * 50 for i in range(50)}] * 50}
    assert len(json.dumps(bounded(deep))) < BUDGET_CHARS + 2 * MAX_CHARS
    assert bounded_error({"message": "m" * 5000, "code": "c", "extra": {}})["message"].endswith("(5000 characters)")


# --- nothing left behind by a refused upload ----------------------------------------------------

def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def _zip(entries: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries:
            z.writestr(name, data)
    return buf.getvalue()


def _refused_uploads(settings) -> list[tuple[str, str, bytes, int, str]]:
    """``(label, path, body, status, code)`` of refused uploads whose file parts are spooled to disk."""
    photo = jpeg_bytes(7)
    many = [file_part(f"{i}.jpg", photo) for i in range(settings.INTERACTIVE_MAX_FILES + 1)]
    overlap = bytearray(_zip([("a.jpg", photo), ("b.jpg", photo)]))
    second = overlap.rfind(b"PK\x01\x02")  # the second directory entry points at the first's header
    overlap[second + 42:second + 46] = (0).to_bytes(4, "little")
    cases = [
        ("truncated in a file part", "/api/images/", body("b", [file_part("a.jpg", photo)], close=False)[:-40],
         400, "malformed_multipart"),
        ("a part without a name", "/api/images/", body("b", [file_part("a.jpg", photo), part(None)]), 400,
         "malformed_multipart"),
        ("too many parts", "/api/jobs/", body("b", [file_part("a.jpg", photo)] + bare(2000)), 400, "too_many_parts"),
        ("a file in an unread field", "/api/images/", body("b", [file_part("a.jpg", photo, field="photo")]), 400,
         "unexpected_parts"),
        ("too many files", "/api/images/", body("b", many), 400, "too_many_files"),
        ("a bad k", "/api/images/", body("b", [file_part("a.jpg", photo), part('form-data; name="k"', b"x", None)]),
         400, "invalid"),
        ("bad metadata", "/api/images/", body("b", [file_part("a.jpg", photo),
                                                   part('form-data; name="metadata"', b'{"bad-key": 1}', None)]),
         400, "metadata_invalid"),
        ("an overlapping zip", "/api/jobs/", body("b", [file_part("a.jpg", photo),
                                                        file_part("o.zip", bytes(overlap), field="zip")]),
         400, "zip_unsafe"),
        ("a zip slip", "/api/jobs/", body("b", [file_part("a.jpg", photo),
                                                file_part("s.zip", _zip([("../a.jpg", photo)]), field="zip")]),
         400, "zip_unsafe_path"),
        ("files and a manifest", "/api/jobs/", body("b", [file_part("a.jpg", photo),
                                                          file_part("m.csv", b"url\nhttp://x/a.jpg\n", field="manifest")]),
         400, "mixed_sources"),
        ("a manifest for a bucket not allowed", "/api/jobs/",
         body("b", [file_part("m.csv", b"url\nhttp://x/a.jpg\n" * 100, field="manifest"),
                    part('form-data; name="bucket"', b"s3://elsewhere", None)]), 403, "source_not_allowed"),
    ]
    if (CASES / "p08_zip_overlap_24x60MiB.zip").exists():
        cases.append(("p08: 24 entries over one stream", "/api/jobs/",
                      body("b", [file_part("p08.zip", (CASES / "p08_zip_overlap_24x60MiB.zip").read_bytes(),
                                           field="zip")]), 400, "zip_unsafe"))
    return cases


def test_refused_uploads_leave_no_temporary_file_and_no_blob(wsgi, settings, tmp_path):
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path / "uploads")
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 0  # every file part goes to a temporary file on disk
    (tmp_path / "uploads").mkdir()
    blobs = Path(settings.BLOB_ROOT)
    for label, path, data, status, code in _refused_uploads(settings):
        before = _files_under(blobs)
        r = wsgi.request("POST", path, data, "multipart/form-data; boundary=b")
        assert (r.status, r.error()["code"]) == (status, code), (label, r.body[:300])
        assert _files_under(tmp_path / "uploads") == [], label
        assert _files_under(blobs) == before, label
    assert Image.objects.count() == 0 and Job.objects.count() == 0
    # and an accepted upload's temporary file goes too, once answered
    r = wsgi.request("POST", "/api/jobs/", body("b", [file_part("a.jpg", jpeg_bytes(8))]),
                     "multipart/form-data; boundary=b")
    assert r.status == 202 and _files_under(tmp_path / "uploads") == []
