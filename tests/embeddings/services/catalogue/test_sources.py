"""Hostile upload sources: zip archives (zip slip, zip bombs, lying headers, damaged, encrypted) and
server-side folders (confined to INGEST_ROOTS, no traversal, no symlinks out)."""
from __future__ import annotations

import io
import os
import struct
import zipfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings.models import Image, Job
from embeddings.errors import ApplicationError
from embeddings.services.catalogue.sources import from_folder, from_zip
from tests.conftest import SHARED
from tests.embeddings.conftest import client_for, jpeg_bytes
from workers.errors import ImageRejected

LIMITS = {"max_entries": 100, "max_uncompressed": 10_000_000}


def make_zip(entries, method=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in entries:
            z.writestr(name, data)
    return buf.getvalue()


def patch_headers(data: bytes, *, offset_local: int, offset_central: int, fmt: str, value: int) -> bytes:
    """Rewrite one field of the first entry's local and central headers (as a hostile tool would)."""
    b = bytearray(data)
    struct.pack_into(fmt, b, b.find(b"PK\x03\x04") + offset_local, value)
    struct.pack_into(fmt, b, b.rfind(b"PK\x01\x02") + offset_central, value)
    return bytes(b)


def read_all(source) -> bytes:
    f = source.open()
    return b"".join(iter(lambda: f.read(1 << 16), b""))


# --- zip: what is accepted -----------------------------------------------------------------------

def test_zip_entries_become_sources_and_directories_are_skipped():
    data = make_zip([("a/1.jpg", b"one"), ("a/./2.jpg", b"two"), ("a//3.jpg", b"three"), ("a/sub/", b"")])
    got = from_zip(io.BytesIO(data), **LIMITS)
    assert [(s.name, s.size, read_all(s)) for s in got] == [("a/1.jpg", 3, b"one"), ("a/2.jpg", 3, b"two"),
                                                            ("a/3.jpg", 5, b"three")]


# --- zip slip ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "/etc/passwd", "../evil.jpg", "a/../../evil.jpg", "a/b/..", "..\\..\\evil.jpg", "a\\..\\..\\evil.jpg",
    "C:\\Windows\\evil.jpg", "C:evil.jpg", "//server/share/evil.jpg",
])
def test_zip_slip_entries_refuse_the_whole_archive(name):
    data = make_zip([("ok.jpg", b"fine"), (name, b"evil")])
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(data), **LIMITS)
    assert (e.value.code, e.value.status, e.value.extra["entry"]) == ("zip_unsafe_path", 400, name)


# --- zip bombs ---------------------------------------------------------------------------------------

def test_entry_count_is_bounded():
    data = make_zip([(f"{i}.jpg", b"x") for i in range(11)])
    assert len(from_zip(io.BytesIO(data), max_entries=11, max_uncompressed=100)) == 11
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(data), max_entries=10, max_uncompressed=100)
    assert (e.value.code, e.value.status, e.value.extra) == ("zip_too_many_entries", 413, {"limit": 10, "entries": 11})


def test_total_uncompressed_size_is_bounded_before_anything_is_read():
    bomb = make_zip([("a.jpg", b"\0" * 5_000_000), ("b.jpg", b"\0" * 5_000_000)])
    assert len(bomb) < 30_000  # 10 MB of zeros in a few kB
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(bomb), max_entries=10, max_uncompressed=9_999_999)
    assert (e.value.code, e.value.status, e.value.extra["uncompressed_bytes"]) == ("zip_too_large", 413, 10_000_000)


def test_a_header_that_understates_the_size_cannot_inflate_past_it():
    data = make_zip([("big.jpg", b"A" * 1_000_000)])
    lying = patch_headers(data, offset_local=22, offset_central=24, fmt="<I", value=100)  # "100 bytes"
    (src,) = from_zip(io.BytesIO(lying), max_entries=10, max_uncompressed=1000)
    assert src.size == 100
    f = src.open()
    got = b""
    with pytest.raises(ImageRejected) as e:  # the CRC of the first 100 bytes does not match: damaged
        while chunk := f.read(1 << 16):
            got += chunk
    assert len(got) <= 100 and e.value.reason == "corrupt"


def test_a_damaged_entry_fails_alone_when_read():
    data = make_zip([("a.jpg", b"\xff\xd8" + os.urandom(2000) + b"\0" * 20000)])
    b = bytearray(data)
    start = b.find(b"PK\x03\x04") + 30 + len("a.jpg")
    b[start + 5:start + 200] = b"\xff" * 195  # garble the deflate stream, not the directory
    (src,) = from_zip(io.BytesIO(bytes(b)), **LIMITS)
    with pytest.raises(ImageRejected) as e:
        read_all(src)
    assert e.value.reason == "corrupt" and "a.jpg" in e.value.detail


@pytest.mark.parametrize("how", ["encrypted", "unknown method"])
def test_encrypted_or_unknown_compression_refuses_the_archive(how):
    data = make_zip([("a.jpg", b"data")], zipfile.ZIP_STORED)
    if how == "encrypted":
        b = bytearray(data)
        b[b.find(b"PK\x03\x04") + 6] |= 1
        b[b.rfind(b"PK\x01\x02") + 8] |= 1
        data = bytes(b)
    else:
        data = patch_headers(data, offset_local=8, offset_central=10, fmt="<H", value=99)
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(data), **LIMITS)
    assert (e.value.code, e.value.status) == ("zip_unsupported", 400)


@pytest.mark.parametrize("data", [b"", b"not a zip at all", make_zip([("a.jpg", b"x" * 100)])[:-30]],
                         ids=["empty", "not a zip", "cut short"])
def test_unreadable_archives_are_400(data):
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(data), **LIMITS)
    assert (e.value.code, e.value.status) == ("zip_invalid", 400)


@pytest.mark.django_db(transaction=True)
def test_api_zip_with_a_damaged_entry_embeds_the_rest(service, api):
    good = [(f"{i}.jpg", jpeg_bytes(600 + i)) for i in range(2)]
    damaged = make_zip([("bad.jpg", b"\xff\xd8" + b"\0" * 30000)])
    b = bytearray(damaged)
    start = b.find(b"PK\x03\x04") + 30 + len("bad.jpg")
    b[start + 2:start + 40] = b"\xff" * 38
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in good:
            z.writestr(name, data)
    archive = buf.getvalue()
    # Append the damaged entry by merging archives: simplest is one zip per upload field.
    r = api.post("/api/jobs/", {"zip": [SimpleUploadedFile("good.zip", archive), SimpleUploadedFile("bad.zip", bytes(b))]},
                 format="multipart")
    assert r.status_code == 202, r.json()
    p = api.get(f"/api/jobs/{r.json()['id']}/").json()
    assert (p["embedded"], p["failed"]) == (2, 1)
    assert [(f["original_name"], f["reason"]) for f in p["failures"]] == [("bad.jpg", "corrupt")]


@pytest.mark.django_db(transaction=True)
def test_an_oversized_file_is_refused_without_being_stored(service, api):
    service.PIPELINE = service.PIPELINE.replace(max_image_bytes=1000)
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("big.jpg", jpeg_bytes(1, (300, 300)))]}, format="multipart")
    assert r.status_code == 413 and r.json()["images"][0]["reason"] == "too_large"
    im = Image.objects.get()
    blobs = [p for p in Path(service.BLOB_ROOT).rglob("*") if p.is_file()] if Path(service.BLOB_ROOT).exists() else []
    assert im.storage_key == "" and blobs == []


# --- zip bombs that the directory hides: overlap, declared sizes, inflation ratio (issue 44) ------

CASES = SHARED / "data" / "cases"
needs_cases = pytest.mark.skipif(not (CASES / "README.md").exists(), reason=f"{CASES} is not present")


def overlapping(n: int, size: int = 2_000_000) -> bytes:
    """A zip whose ``n`` directory entries all point at one deflated stream of ``size`` zeros (the
    shape of CVE-2024-0450's bomb, as ``p08_zip_overlap_24x60MiB.zip``)."""
    data = make_zip([("same.jpg", b"\0" * size)])
    cd = data.rfind(b"PK\x01\x02")
    eocd = data.rfind(b"PK\x05\x06")
    record = data[cd:eocd]
    out = bytearray(data[:cd] + record * n + data[eocd:])
    end = len(out) - (len(data) - eocd)
    struct.pack_into("<HHI", out, end + 8, n, n, len(record) * n)
    return bytes(out)


def test_overlapping_entries_refuse_the_archive_before_any_is_inflated(monkeypatch):
    bomb = overlapping(24)
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: pytest.fail("an entry was inflated"))
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(bomb), **LIMITS)
    assert (e.value.code, e.value.status) == ("zip_unsafe", 400)
    assert e.value.extra == {"entries": [{"entry": 1, "name": "same.jpg"}, {"entry": 2, "name": "same.jpg"}]}


def test_an_entry_pointing_into_another_ones_data_is_unsafe():
    data = bytearray(make_zip([("a.jpg", b"\xff\xd8" + os.urandom(5000)), ("b.jpg", b"b" * 100)]))
    second = data.rfind(b"PK\x01\x02")
    struct.pack_into("<I", data, second + 42, 1000)  # b's local header: inside a's data
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(bytes(data)), **LIMITS)
    assert e.value.code == "zip_unsafe" and "no local header" in e.value.message


def test_an_entry_whose_data_runs_into_the_directory_is_unsafe():
    data = make_zip([("a.jpg", os.urandom(5000))], zipfile.ZIP_STORED)
    longer = patch_headers(data, offset_local=18, offset_central=20, fmt="<I", value=6000)  # compressed size
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(longer), **LIMITS)
    assert (e.value.code, e.value.extra) == ("zip_unsafe", {"entries": [{"entry": 1, "name": "a.jpg"}]})


@needs_cases
def test_shared_case_p08_overlap_is_unsafe():
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO((CASES / "p08_zip_overlap_24x60MiB.zip").read_bytes()), max_entries=100_000,
                 max_uncompressed=4 << 30, max_ratio=20, max_entry_bytes=50 << 20)
    assert e.value.code == "zip_unsafe" and [x["entry"] for x in e.value.extra["entries"]] == [1, 2]


def test_an_entry_declared_over_the_image_limit_is_refused_without_inflating(monkeypatch):
    data = make_zip([("big.jpg", b"\0" * 3_000_000), ("small.jpg", b"\xff\xd8small")])
    big, small = from_zip(io.BytesIO(data), **LIMITS, max_ratio=20, max_entry_bytes=1_000_000)
    assert (big.name, big.size, small.size) == ("big.jpg", 3_000_000, 7)
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: pytest.fail("the oversized entry was inflated"))
    with pytest.raises(ImageRejected) as e:
        big.open()
    assert e.value.reason == "too_large" and "declares 3000000 bytes > limit 1000000 bytes" in e.value.detail


def test_an_entry_declared_under_the_limit_cannot_inflate_past_it():
    data = make_zip([("big.jpg", b"\0" * 3_000_000)])
    lying = patch_headers(data, offset_local=22, offset_central=24, fmt="<I", value=999_999)
    (src,) = from_zip(io.BytesIO(lying), **LIMITS, max_ratio=None, max_entry_bytes=1_000_000)
    f, got = src.open(), 0
    with pytest.raises(ImageRejected) as e:  # its CRC is that of 3 MB: damaged, after at most 999,999 bytes
        while chunk := f.read(1 << 16):
            got += len(chunk)
    assert got <= 999_999 and e.value.reason == "corrupt"


def test_inflation_is_bounded_by_a_ratio_of_the_archive_but_always_allows_one_image():
    entries = [(f"{i}.jpg", b"\0" * 400_000) for i in range(3)]
    data = make_zip(entries)
    limits = {**LIMITS, "max_entry_bytes": 1_000_000}
    assert len(from_zip(io.BytesIO(make_zip(entries[:2])), **limits, max_ratio=20)) == 2  # 800 kB: one image's worth
    with pytest.raises(ApplicationError) as e:
        from_zip(io.BytesIO(data), **limits, max_ratio=20)
    assert (e.value.code, e.value.status) == ("zip_too_large", 413)
    assert e.value.extra == {"limit": "ZIP_MAX_RATIO", "value": 1_000_000, "uncompressed_bytes": 1_200_000,
                             "archive_bytes": len(data)}
    assert len(from_zip(io.BytesIO(data), **limits, max_ratio=1_200_000 / len(data) + 1)) == 3
    # entries refused without inflating do not count: only what would be inflated does
    assert len(from_zip(io.BytesIO(data), **LIMITS, max_ratio=20, max_entry_bytes=300_000)) == 3


@needs_cases
@pytest.mark.django_db(transaction=True)
def test_api_shared_cases_p08(service, api, monkeypatch):
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: pytest.fail("an entry was inflated"))
    overlap = (CASES / "p08_zip_overlap_24x60MiB.zip").read_bytes()
    r = api.post("/api/jobs/", {"zip": [SimpleUploadedFile("p08.zip", overlap)]}, format="multipart")
    assert (r.status_code, r.json()["code"]) == (400, "zip_unsafe")
    assert Job.objects.count() == 0 and Image.objects.count() == 0
    single = (CASES / "p08_zip_single_60MiB.zip").read_bytes()
    r = api.post("/api/jobs/", {"zip": [SimpleUploadedFile("single.zip", single)]}, format="multipart")
    assert (r.status_code, r.json()["total"]) == (202, 1)
    p = api.get(f"/api/jobs/{r.json()['id']}/").json()
    assert (p["status"], p["failed"]) == ("done", 1)
    assert [(f["original_name"], f["reason"]) for f in p["failures"]] == [("same.jpg", "too_large")]
    assert Image.objects.get().size_bytes == 60 * 2**20


# --- server-side folders -----------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    """``root/`` (allowed) with photos, a hidden file, symlinks in and out; ``outside/`` and ``root2/``."""
    root, outside, sibling = tmp_path / "root", tmp_path / "outside", tmp_path / "root2"
    for d in (root / "sub", outside, sibling):
        d.mkdir(parents=True)
    (root / "a.jpg").write_bytes(b"a")
    (root / "sub" / "b.jpg").write_bytes(b"b")
    (root / ".hidden.jpg").write_bytes(b"h")
    (outside / "secret.jpg").write_bytes(b"secret")
    (sibling / "c.jpg").write_bytes(b"c")
    (root / "link-out.jpg").symlink_to(outside / "secret.jpg")
    (root / "dir-out").symlink_to(outside, target_is_directory=True)
    (root / "link-in.jpg").symlink_to(root / "a.jpg")
    os.mkfifo(root / "fifo.jpg")
    (tmp_path / "root-link").symlink_to(outside, target_is_directory=True)
    return tmp_path


def test_folder_lists_regular_files_and_never_leaves_the_folder(tree):
    got = from_folder(tree / "root", roots=[tree / "root"])
    assert sorted(s.name for s in got) == ["a.jpg", "link-in.jpg", "sub/b.jpg"]
    assert all(s.in_place.is_relative_to(tree / "root") for s in got)
    assert b"secret" not in b"".join(read_all(s) for s in got)


@pytest.mark.parametrize("folder", ["outside", "root2", "root/../outside", "root/sub/../../outside", "root-link",
                                    "root/dir-out", "/"])
def test_folders_outside_the_roots_are_refused(tree, folder):
    with pytest.raises(ApplicationError) as e:
        from_folder(tree / folder, roots=[(tree / "root").resolve()])
    assert (e.value.code, e.value.status) == ("folder_not_allowed", 403)


def test_no_roots_configured_means_no_folder(tree):
    with pytest.raises(ApplicationError) as e:
        from_folder(tree / "root", roots=[])
    assert e.value.code == "folder_not_allowed"


@pytest.mark.parametrize("folder", ["missing", "root/a.jpg"])
def test_missing_folders_are_400(tree, folder):
    with pytest.raises(ApplicationError) as e:
        from_folder(tree / folder, roots=[tree / "root"])
    assert (e.value.code, e.value.status) == ("folder_missing", 400)


def test_the_servers_own_command_line_may_ingest_any_folder(tree):
    assert [s.name for s in from_folder(tree / "outside", roots=None)] == ["secret.jpg"]


@pytest.mark.django_db(transaction=True)
def test_api_folder_ingestion_is_staff_only_and_confined(service, api, staff, tree, settings):
    settings.INGEST_ROOTS = [(tree / "root").resolve()]
    r = api.post("/api/jobs/", {"folder": str(tree / "root")}, format="json")
    assert (r.status_code, r.json()["code"]) == (403, "forbidden")
    root_api = client_for(staff)
    r = root_api.post("/api/jobs/", {"folder": str(tree / "root" / ".." / "outside")}, format="json")
    assert (r.status_code, r.json()["code"]) == (403, "folder_not_allowed")
    assert Job.objects.count() == 0
    r = root_api.post("/api/jobs/", {"folder": str(tree / "root")}, format="json")
    assert r.status_code == 202 and r.json()["total"] == 3
    names = set(Image.objects.values_list("original_name", flat=True))
    assert names == {"a.jpg", "link-in.jpg", "sub/b.jpg"}
    assert not Image.objects.filter(storage_key__contains="outside").exists()
