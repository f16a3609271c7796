"""End to end with real processes: every real photo as a bulk job plus interactive uploads.

Asserts: each image's nearest neighbour is itself (score >= 0.99); DB embedded count = Qdrant
points = distinct images; re-ingesting adds nothing and reports every image skipped; a non-image
file fails alone with its reason. On the shared stack (tests/e2e/conftest.py) the counts are what
this module adds, as its own user.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys

import cv2
import pytest

from tests.conftest import ROOT, needs_shared, photo_paths
from tests.e2e.conftest import settled_stats, stats_added, stats_now

pytestmark = [pytest.mark.e2e, needs_shared]


def ingest(stack, api, folder) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "ingest", str(folder), "--user", api.user,
                          "--timeout", "600"], env=stack.env, cwd=ROOT, check=True, text=True, capture_output=True)
    return out.stdout.split()[1].rstrip(":")  # "job <id>: N files queued ..."


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    for p in photo_paths():
        shutil.copy(p, folder / p.name)
    (folder / "notes.jpg").write_text("meeting notes, definitely not a JPEG\n")
    return folder


@pytest.fixture(scope="module")
def before(api):
    """The service's counts before this module added anything."""
    return settled_stats(api)


@pytest.fixture(scope="module")
def first_job(stack, api, photo_folder, before):
    job_id = ingest(stack, api, photo_folder)
    return api.get(f"/api/jobs/{job_id}/").json()


def test_bulk_job_embeds_every_photo_and_the_non_image_fails_alone(first_job):
    photos = photo_paths()
    distinct = len({hashlib.sha256(p.read_bytes()).hexdigest() for p in photos})
    j = first_job
    assert j["status"] == "done" and j["total"] == len(photos) + 1
    assert j["embedded"] == distinct and j["skipped"] == len(photos) - distinct
    assert [(f["original_name"], f["reason"]) for f in j["failures"]] == [("notes.jpg", "not_an_image")]
    assert j["batches"] == -(-distinct // 64)
    for stage in ("load", "decode", "decode_wait", "preprocess", "embed", "upsert", "total"):
        assert j["timings_ms"][stage]["max"] > 0


def test_interactive_uploads_and_counts_match(stack, api, first_job, before):
    photos = photo_paths()
    # Two re-encoded photos (new bytes) and one identical to an ingested photo (skipped).
    files = []
    for p in photos[:2]:
        ok, jpg = cv2.imencode(".jpg", cv2.imread(str(p)), [cv2.IMWRITE_JPEG_QUALITY, 80])
        files.append(("files", (f"re-{p.stem}.jpg", jpg.tobytes())))
    files.append(("files", (photos[5].name, photos[5].read_bytes())))
    r = api.post("/api/images/", files=files, data={"k": 3})
    assert r.status_code == 200, r.text
    a, b, same = r.json()["images"]
    assert (a["status"], b["status"], same["status"]) == ("embedded", "embedded", "skipped")
    assert a["neighbours"] and a["neighbours"][0]["score"] > 0.9
    added = stats_added(before, stats_now(api))
    distinct = len({hashlib.sha256(p.read_bytes()).hexdigest() for p in photos}) + 2
    assert added["embedded"] == added["points"] == added["distinct_embedded"] == distinct, added


def test_each_image_is_its_own_nearest_neighbour(api, first_job):
    ids = [im["id"] for im in api.get("/api/images/").json()["results"] if im["status"] == "embedded"]
    assert len(ids) >= 80
    for image_id in ids:
        res = api.post("/api/search/", json={"image_id": image_id, "k": 3}).json()["results"]
        top = res[0]["score"]
        mine = [r for r in res if r["image_id"] == image_id]
        assert top >= 0.99 and mine and mine[0]["score"] >= top - 1e-5, (image_id, res)


def test_search_by_uploaded_photo_finds_it(api, first_job):
    for p in photo_paths()[::20]:
        res = api.post("/api/search/", files={"image": (p.name, p.read_bytes())}, data={"k": 1}).json()["results"]
        assert res[0]["original_name"] == p.name and res[0]["score"] >= 0.99


def test_reingest_adds_nothing_and_reports_every_image_skipped(stack, api, photo_folder, first_job):
    before = api.get("/api/stats/").json()
    job_id = ingest(stack, api, photo_folder)
    j = api.get(f"/api/jobs/{job_id}/").json()
    assert j["status"] == "done"
    assert (j["embedded"], j["skipped"], j["failed"]) == (0, len(photo_paths()), 1)
    after = api.get("/api/stats/").json()
    assert after["points"] == before["points"] and after["images"]["embedded"] == before["images"]["embedded"]
