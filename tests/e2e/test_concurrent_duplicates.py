"""Issue 9, kind 3, with real processes: the same ~3 MB file uploaded by two simultaneous requests
(gunicorn, two worker processes, eight threads each) is embedded once. The database decides
(constraint ``image_one_original``), on SQLite here and on PostgreSQL when DATABASE_URL names it.
On the shared stack (tests/e2e/conftest.py) the counts are what this test adds.
"""
from __future__ import annotations

import threading

import cv2
import numpy as np
import pytest
import requests

from tests.e2e.conftest import settled_stats, stats_added, stats_now

pytestmark = pytest.mark.e2e

PAIRS = 10


def noise_png(seed: int) -> bytes:
    """A ~3 MB PNG of noise (incompressible): hashing and storing it takes long enough for two
    requests to overlap."""
    img = np.random.default_rng(seed).integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
    return cv2.imencode(".png", img)[1].tobytes()


def upload_together(api, data: bytes) -> list[dict]:
    """POST the same bytes from two threads (two connections) released at the same moment."""
    barrier, out = threading.Barrier(2), [None, None]

    def send(i: int) -> None:
        s = requests.Session()
        s.headers.update(api.s.headers)
        barrier.wait()
        r = s.post(api.base + "/api/images/", files={"files": (f"copy{i}.png", data, "image/png")},
                   data={"k": "1"}, timeout=120)
        out[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_simultaneous_uploads_of_the_same_bytes_embed_once(stack, api):
    before = settled_stats(api)
    pairs = []
    for n in range(PAIRS):
        data = noise_png(n)
        assert len(data) > 2_900_000
        answers = upload_together(api, data)
        assert [code for code, _ in answers] == [200, 200], answers
        pairs.append([body["images"][0]["id"] for _, body in answers])
    rows = [sorted((api.get(f"/api/images/{i}/").json() for i in ids), key=lambda r: r["status"]) for ids in pairs]
    assert [[r["status"] for r in pair] for pair in rows] == [["embedded", "skipped"]] * PAIRS
    for original, copy in rows:
        assert (copy["width"], copy["height"]) == (original["width"], original["height"]) == (1000, 1000)
        assert copy["sha256"] == original["sha256"]
        found = api.post("/api/search/", json={"image_id": copy["id"], "k": 1})
        assert found.status_code == 200 and found.json()["results"][0]["sha256"] == copy["sha256"]
    added = stats_added(before, stats_now(api))
    assert added["embedded"] == PAIRS and added["skipped"] == PAIRS, added
    assert added["distinct_embedded"] == added["points"] == PAIRS, added
