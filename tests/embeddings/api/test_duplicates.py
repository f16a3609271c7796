"""Near-duplicate groups end to end in one process (eager Celery, the embedded edge store, the
random-weights model): the scan's groups equal numpy's over the stored vectors at the scan's
threshold, copies group with their originals and exact re-uploads apart, the calibration's
figures, incremental grouping of new images, review (keep one, not duplicates, remembered), and
bad input (issue 45 item 3)."""
from __future__ import annotations

import uuid

import cv2
import numpy as np
import pytest

from embeddings import runtime, spaces
from embeddings.models import DuplicateGroup, DuplicateScan, GroupStatus, Image, NotDuplicate
from tests.embeddings.conftest import client_for, jpeg_bytes, upload
from tests.duplicate_groups import expected_groups
from workers.image_copies import copy_of

pytestmark = pytest.mark.django_db(transaction=True)

#: The copies each original gets in these tests: a smaller save and a low-quality one.
COPIES = (("resize", 0.75), ("jpeg", 50))


def _rgb(data: bytes) -> np.ndarray:
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def _put(api, name: str, data: bytes) -> str:
    r = api.post("/api/images/", {"files": [upload(name, data)], "k": 0}, format="multipart")
    assert r.status_code == 200, r.json()
    return r.json()["images"][0]["id"]


@pytest.fixture
def catalogue(service, api):
    """12 originals; originals 0 and 1 with two copies each (:data:`COPIES`); original 2 uploaded
    twice (an exact copy) → ``{"originals", "copies": {i: [ids]}, "again"}``."""
    originals, copies = [], {}
    for i in range(12):
        data = jpeg_bytes(7000 + i, size=(240, 320))
        originals.append(_put(api, f"o{i}.jpg", data))
        if i < 2:
            copies[i] = [_put(api, f"o{i}-{k}.jpg", copy_of(_rgb(data), k, a)) for k, a in COPIES]
    again = _put(api, "o2-again.jpg", jpeg_bytes(7002, size=(240, 320)))
    return {"originals": originals, "copies": copies, "again": again}


def _vectors(ids) -> dict[str, np.ndarray]:
    rows = {str(i): p for i, p in Image.objects.filter(id__in=ids).values_list("id", "point_id")}
    got = runtime.vector_store(spaces.active().model_id).vectors(list(set(rows.values())))
    return {i: got[p] for i, p in rows.items() if p in got}


def _expected(ids, threshold) -> list[set[str]]:
    """The near groups numpy finds over the stored vectors of ``ids`` (one image per point)."""
    return expected_groups(_vectors(ids), threshold)


def _groups(api, **params) -> list[dict]:
    r = api.get("/api/duplicates/", params)
    assert r.status_code == 200, r.json()
    return r.json()["results"]


def _near_sets(api) -> list[set[str]]:
    return sorted(({m["image_id"] for m in g["members"]} for g in _groups(api, kind="near")), key=sorted)


def test_a_scan_groups_copies_with_their_originals_and_exact_copies_apart(catalogue, api):
    ids = catalogue["originals"] + [c for cs in catalogue["copies"].values() for c in cs]
    r = api.post("/api/duplicates/scan/", {"threshold": 0.99}, format="json")
    assert r.status_code == 202, r.json()
    scan = api.get("/api/duplicates/scan/").json()
    assert scan["state"] == "done" and scan["threshold"] == 0.99 and scan["calibration"] == {"source": "given"}
    assert scan["scanned"] == 16  # 12 originals + 4 copies; the exact copy shares its original's point
    near = _near_sets(api)
    assert near == _expected(ids, 0.99)
    for i, cs in catalogue["copies"].items():  # each original with both its copies
        assert {catalogue["originals"][i], *cs} in near
    exact = _groups(api, kind="exact")
    assert [{m["image_id"] for m in g["members"]} for g in exact] == [{catalogue["originals"][2], catalogue["again"]}]
    assert [m["score"] for m in exact[0]["members"]] == [1.0, 1.0]
    assert exact[0]["members"][0]["image_id"] == catalogue["originals"][2]  # the first upload represents it
    for g in _groups(api, kind="near"):
        rep = [m for m in g["members"] if m["representative"]]
        assert len(rep) == 1 and rep[0]["score"] == 1.0
        vec = _vectors([m["image_id"] for m in g["members"]])
        for m in g["members"]:
            assert m["score"] == pytest.approx(float(vec[rep[0]["image_id"]] @ vec[m["image_id"]]), abs=1e-5)
            assert m["score"] >= 0.99


def test_the_calibrated_threshold_comes_from_copies_of_the_owners_images(catalogue, api, settings):
    settings.DUPLICATES_CALIBRATION_SAMPLE = 10
    r = api.post("/api/duplicates/scan/", {}, format="json")
    assert r.status_code == 202, r.json()
    scan = api.get("/api/duplicates/scan/").json()
    cal = scan["calibration"]
    assert scan["state"] == "done" and cal["source"] == "calibrated"
    assert cal["sample"] == 10 and cal["copies"] == 40 and cal["positives"]["n"] == 40
    assert cal["pairs"]["n"] == 45 and cal["neighbours"]["n"] == 10  # each of the 10 with each other; nearest
    assert cal["threshold"] == scan["threshold"] and 0 < scan["threshold"] <= 1
    assert _near_sets(api) == _expected(catalogue["originals"] + [c for cs in catalogue["copies"].values() for c in cs],
                                        scan["threshold"])


def test_a_small_catalogue_takes_the_default_threshold(service, api, settings):
    settings.DUPLICATES_DEFAULT_THRESHOLD = 0.97
    for i in range(3):
        _put(api, f"s{i}.jpg", jpeg_bytes(7100 + i))
    api.post("/api/duplicates/scan/", {}, format="json")
    scan = api.get("/api/duplicates/scan/").json()
    assert scan["calibration"]["source"] == "default" and scan["threshold"] == 0.97


def test_images_embedded_after_a_scan_join_their_groups(catalogue, api):
    api.post("/api/duplicates/scan/", {"threshold": 0.99}, format="json")
    data = jpeg_bytes(7003, size=(240, 320))  # original 3 had no copy: now it gets one
    late = _put(api, "o3-late.jpg", copy_of(_rgb(data), "resize", 0.5))
    near = _near_sets(api)
    assert {catalogue["originals"][3], late} in near
    ids = catalogue["originals"] + [c for cs in catalogue["copies"].values() for c in cs] + [late]
    assert near == _expected(ids, 0.99)
    again = _put(api, "o0-again.jpg", jpeg_bytes(7000, size=(240, 320)))  # an exact copy of original 0
    DuplicateScan.objects.update(exact_checked_at=None)  # exact groups follow the rows when read, every 10 s
    assert {catalogue["originals"][0], again} in [{m["image_id"] for m in g["members"]}
                                                   for g in _groups(api, kind="exact")]


def test_keep_one_deletes_the_rest_and_their_points(catalogue, api):
    api.post("/api/duplicates/scan/", {"threshold": 0.99}, format="json")
    original = catalogue["originals"][0]
    group = next(g for g in _groups(api, kind="near") if original in {m["image_id"] for m in g["members"]})
    others = {m["image_id"] for m in group["members"]} - {original}
    store = runtime.vector_store(spaces.active().model_id)
    before = store.count()
    r = api.post(f"/api/duplicates/{group['id']}/keep/", {"image_id": original}, format="json")
    assert r.status_code == 200, r.json()
    assert r.json()["status"] == "resolved" and r.json()["kept"] == original
    assert not Image.objects.filter(id__in=others).exists() and Image.objects.filter(id=original).exists()
    assert store.count() == before - len(others)
    assert group["id"] not in {g["id"] for g in _groups(api)}
    assert group["id"] in {g["id"] for g in _groups(api, status="resolved")}
    again = api.post(f"/api/duplicates/{group['id']}/keep/", {"image_id": original}, format="json")
    assert again.status_code == 409 and again.json()["code"] == "already_reviewed"


def test_not_duplicates_is_remembered_across_scans(catalogue, api):
    api.post("/api/duplicates/scan/", {"threshold": 0.99}, format="json")
    original = catalogue["originals"][1]
    group = next(g for g in _groups(api, kind="near") if original in {m["image_id"] for m in g["members"]})
    n = len(group["members"])
    r = api.post(f"/api/duplicates/{group['id']}/not-duplicates/")
    assert r.status_code == 200 and r.json()["status"] == "dismissed"
    assert NotDuplicate.objects.count() == n * (n - 1) // 2
    api.post("/api/duplicates/scan/", {"threshold": 0.99}, format="json")
    members = {m["image_id"] for m in group["members"]}
    for g in _groups(api, kind="near"):  # no two of them in one group again
        assert len(members & {m["image_id"] for m in g["members"]}) <= 1
    exact = _groups(api, kind="exact")[0]
    r = api.post(f"/api/duplicates/{exact['id']}/not-duplicates/")
    assert r.status_code == 409 and r.json()["code"] == "exact_copies"


def test_bad_input_and_other_users(catalogue, api, other_user):
    assert api.get("/api/duplicates/scan/").status_code == 404  # no scan yet
    for body in ({"threshold": 1.5}, {"threshold": -0.1}, {"threshold": "high"}):
        r = api.post("/api/duplicates/scan/", body, format="json")
        assert r.status_code == 400, body
    assert api.get("/api/duplicates/", {"kind": "similar"}).json()["code"] == "invalid"
    assert api.get("/api/duplicates/", {"status": "closed"}).status_code == 400
    api.post("/api/duplicates/scan/", {"threshold": 0.99}, format="json")
    group = _groups(api, kind="near")[0]
    assert api.post(f"/api/duplicates/{group['id']}/keep/", {}, format="json").status_code == 400
    r = api.post(f"/api/duplicates/{group['id']}/keep/", {"image_id": str(uuid.uuid4())}, format="json")
    assert r.status_code == 409 and r.json()["code"] == "not_a_member"
    other = client_for(other_user)
    assert other.get("/api/duplicates/").json()["results"] == []
    assert other.get(f"/api/duplicates/{group['id']}/").status_code == 404
    assert other.post(f"/api/duplicates/{group['id']}/not-duplicates/").status_code == 404
    r = other.post(f"/api/duplicates/{group['id']}/keep/", {"image_id": group["members"][0]["image_id"]}, format="json")
    assert r.status_code == 404 and DuplicateGroup.objects.get(id=group["id"]).status == GroupStatus.OPEN
    # the other user's copy of the same picture is not in the first user's groups, nor they in theirs
    _put(other, "theirs.jpg", jpeg_bytes(7000, size=(240, 320)))
    other.post("/api/duplicates/scan/", {"threshold": 0.5}, format="json")
    assert DuplicateScan.objects.count() == 2
    assert other.get("/api/duplicates/").json()["results"] == []
    mine = {m["image_id"] for g in _groups(api) for m in g["members"]}
    assert mine <= set(str(i) for i in Image.objects.filter(owner__username="alice").values_list("id", flat=True))


def test_a_scan_takes_json_and_a_threshold_above_zero(service, api, client):
    assert api.post("/api/duplicates/scan/").status_code == 202  # no body: calibrate
    assert api.post("/api/duplicates/scan/", {"threshold": None}, format="json").status_code == 202
    r = api.post("/api/duplicates/scan/", {"threshold": 0}, format="json")
    assert r.status_code == 400 and r.json()["extra"]["fields"] == {"threshold": ["must be greater than 0"]}
    r = api.post("/api/duplicates/scan/", {"threshold": "0.9"}, format="multipart")
    assert r.status_code == 415
