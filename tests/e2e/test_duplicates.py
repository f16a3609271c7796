"""Near-duplicate groups on the running service (web, Celery workers, Redis, the embedded store):
a catalogue of real photos, copies of three of them and an exact re-upload; the scan is calibrated
on the bulk worker and sliced on the vectors worker, and its groups equal numpy's over the stored
vectors at its threshold; a copy uploaded afterwards joins its group; keeping one deletes the rest
and their points (issue 45 item 3). On the shared stack, as this module's own user."""
from __future__ import annotations

import base64
import time

import cv2
import numpy as np
import pytest

from tests.conftest import needs_shared, photo_paths
from tests.duplicate_groups import expected_groups
from tests.e2e.conftest import settled_stats, stats_now
from workers.image_copies import copy_of

pytestmark = [pytest.mark.e2e, needs_shared]

#: The copies of each of the first three photos: copies a person calls "the same photo".
COPIES = (("resize", 0.5), ("jpeg", 40))


def _rgb(data: bytes) -> np.ndarray:
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def _upload(api, name: str, data: bytes) -> str:
    r = api.post("/api/images/", files=[("files", (name, data, "image/jpeg"))], data={"k": "0"})
    assert r.status_code == 200, r.text
    image = r.json()["images"][0]
    assert image["status"] in ("embedded", "skipped"), image
    return image["id"]


def _wait_scan(api, timeout: float = 240) -> dict:
    end = time.monotonic() + timeout
    while True:
        r = api.get("/api/duplicates/scan/")
        assert r.status_code == 200, r.text
        scan = r.json()
        if scan["state"] in ("done", "failed"):
            return scan
        assert time.monotonic() < end, f"the scan did not finish in {timeout} s: {scan}"
        time.sleep(0.5)


def _vectors(api) -> dict[str, np.ndarray]:
    out, url = {}, "/api/images/?include=vector&vector_format=base64"
    while url:
        body = api.get(url.removeprefix(api.base)).json()
        for im in body["results"]:
            if im.get("vector") and im["status"] == "embedded":
                out[im["id"]] = np.frombuffer(base64.b64decode(im["vector"]), "<f4")
        url = body["next"]
    return out


def _near(api) -> list[set[str]]:
    r = api.get("/api/duplicates/", params={"kind": "near"})
    assert r.status_code == 200, r.text
    return sorted(({m["image_id"] for m in g["members"]} for g in r.json()["results"]), key=sorted)


@pytest.fixture(scope="module")
def catalogue(stack, api):
    settled_stats(api)
    # this module's own bytes (a JPEG 93 save of each photo): points are shared per sha256 across
    # users, and other modules on the shared stack count the points of the photos as they are
    photos = [copy_of(_rgb(p.read_bytes()), "jpeg", 93) for p in photo_paths()[:12]]
    originals = [_upload(api, f"p{i}.jpg", data) for i, data in enumerate(photos)]
    copies = {i: [_upload(api, f"p{i}-{k}.jpg", copy_of(_rgb(photos[i]), k, a)) for k, a in COPIES] for i in range(3)}
    again = _upload(api, "p4-again.jpg", photos[4])
    return {"photos": photos, "originals": originals, "copies": copies, "again": again}


def test_a_calibrated_scan_groups_the_copies(api, catalogue):
    r = api.post("/api/duplicates/scan/", json={})
    assert r.status_code == 202, r.text
    scan = _wait_scan(api)
    assert scan["state"] == "done", scan
    cal = scan["calibration"]
    assert cal["source"] == "calibrated" and cal["sample"] == 18 and cal["copies"] == 72  # 12 + 6 distinct points
    assert scan["scanned"] == 18
    near = _near(api)
    assert near == expected_groups(_vectors(api), scan["threshold"])
    for i, (_, resaved) in catalogue["copies"].items():  # a JPEG re-save, the gentlest copy, always groups
        assert any({catalogue["originals"][i], resaved} <= g for g in near), (i, scan["threshold"])
    assert cal["recall_copies"] >= 0.95 and cal["separable"] is True
    exact = api.get("/api/duplicates/", params={"kind": "exact"}).json()["results"]
    assert [{m["image_id"] for m in g["members"]} for g in exact] == [{catalogue["originals"][4], catalogue["again"]}]


def test_a_later_copy_joins_its_group_and_keeping_one_deletes_the_rest(api, catalogue):
    late = _upload(api, "p3-late.jpg", copy_of(_rgb(catalogue["photos"][3]), "resize", 0.6))
    end = time.monotonic() + 120
    while {catalogue["originals"][3], late} not in _near(api):  # duplicates_update on the vectors queue
        assert time.monotonic() < end, _near(api)
        time.sleep(0.5)
    group = next(g for g in api.get("/api/duplicates/", params={"kind": "near"}).json()["results"]
                 if late in {m["image_id"] for m in g["members"]})
    points = stats_now(api)["points"]
    r = api.post(f"/api/duplicates/{group['id']}/keep/", json={"image_id": late})
    assert r.status_code == 200 and r.json()["status"] == "resolved", r.text
    assert api.get(f"/api/images/{catalogue['originals'][3]}/").status_code == 404
    end = time.monotonic() + 60
    while stats_now(api)["points"] != points - (len(group["members"]) - 1):  # points forgotten at bulk priority
        assert time.monotonic() < end
        time.sleep(0.2)
