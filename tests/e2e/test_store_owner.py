"""``STORE_OWNER=interactive`` with real processes: no vectors worker; the interactive worker owns
the embedded store, consumes the vectors queue after its own, and answers uploads and text
searches with one task each while a bulk job's writes go through the same process.

Real Redis (private), PostgreSQL (a fresh database), the web process, the interactive and bulk
workers, embedded Qdrant (edge), seeded random ViT-B-32 weights, the real photos.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import shutil
import subprocess
import sys
import time

import cv2
import pytest
import requests

from scripts.stack import Stack
from tests.conftest import ROOT, needs_shared, photo_paths
from tests.e2e.conftest import Api, settled_stats

pytestmark = [pytest.mark.e2e, needs_shared]

JOB_PHOTOS = 24


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    env = {"CLIP_PRETRAINED": "random", "DATABASE_URL": database_url, "DJANGO_DEBUG": "0",
           "STORE_OWNER": "interactive", "VECTOR_STORE": "edge", "QDRANT_URL": ""}
    with Stack(tmp_path_factory.mktemp("owner"), env, private_redis=True, log=lambda *a: None) as s:
        yield s


@pytest.fixture(scope="module")
def api(stack):
    return Api(stack.web_url, stack.manage("apiuser", "owner", "--staff").strip(), "owner")


def _log(stack, name: str) -> str:
    return (stack.var_dir / "log" / f"{name}.log").read_text(errors="replace")


def _reencoded(path, quality: int) -> bytes:
    ok, jpg = cv2.imencode(".jpg", cv2.imread(str(path)), [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return jpg.tobytes()


def test_the_interactive_worker_owns_the_store_and_answers_beside_a_bulk_job(stack, api, tmp_path):
    assert "worker-vectors" not in stack.procs
    assert stack.ping_workers(expect=3) == {"interactive", "bulk", "fetch"}
    photos = photo_paths()
    folder = tmp_path / "job"
    folder.mkdir()
    for p in photos[:JOB_PHOTOS]:
        shutil.copy(p, folder / p.name)
    distinct_job = len({hashlib.sha256(p.read_bytes()).hexdigest() for p in photos[:JOB_PHOTOS]})

    # the store holds a few points before the job, so every upload below has its 3 neighbours
    seed = [_reencoded(p, 60) for p in photos[-4:]]
    r = api.post("/api/images/", files=[("files", (f"s{i}.jpg", d)) for i, d in enumerate(seed)], data={"k": 0})
    assert r.status_code == 200 and [im["status"] for im in r.json()["images"]] == ["embedded"] * 4, r.text

    ingest = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "ingest", str(folder), "--user", api.user,
                               "--timeout", "600"], env=stack.env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    # uploads of new bytes and text searches while the job's chunks are computed and written
    uploads = [_reencoded(p, 70 + i) for i, p in enumerate(photos[JOB_PHOTOS:JOB_PHOTOS + 4])]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ups = list(pool.map(lambda d: api.post("/api/images/", files={"files": ("u.jpg", d)}, data={"k": 3}), uploads))
        texts = list(pool.map(lambda t: api.post("/api/search/", json={"text": t, "k": 5}),
                              ["a red bicycle", "a dog on a beach", "a city at night", "a bowl of fruit"]))
    out, err = ingest.communicate(timeout=600)
    assert ingest.returncode == 0, err
    job_id = out.split()[1].rstrip(":")

    for r in ups:
        assert r.status_code == 200, r.text
        image = r.json()["images"][0]
        assert image["status"] == "embedded" and len(image["neighbours"]) == 3
    for r in texts:
        assert r.status_code == 200, r.text
        assert len(r.json()["results"]) == 5
    job = api.get(f"/api/jobs/{job_id}/").json()
    assert job["status"] == "done" and job["embedded"] == distinct_job, job
    stats = settled_stats(api)
    assert stats["points"] == stats["distinct_embedded"] == distinct_job + len(uploads) + len(seed)

    # a bulk image is found by its own vector, which the interactive worker wrote
    listed = api.get("/api/images/").json()["results"]
    first = next(im["id"] for im in listed if str(im["job"]) == job_id and im["status"] == "embedded")
    hit = api.post("/api/search/", json={"image_id": first, "k": 1}).json()["results"][0]
    assert hit["image_id"] == first and hit["score"] > 0.99

    log = _log(stack, "worker-interactive")
    for task in ("embed_index_interactive", "embed_search", "index_chunk", "search_point"):
        assert f"embeddings.tasks.{task}[" in log, task
    assert "embeddings.tasks.index_interactive[" not in log and "embeddings.tasks.search_vector[" not in log


def test_ready_with_the_vectors_lane_answered_by_the_interactive_worker(stack):
    """``/readyz``: every required lane answers its canary; the vectors lane's (a store call) is
    answered by the interactive worker, the one worker that consumes it."""
    end = time.monotonic() + 60
    while (r := requests.get(stack.web_url + "/readyz", timeout=30)).status_code != 200 and time.monotonic() < end:
        time.sleep(0.5)  # the first probes send the canaries; a later one finds them answered
    assert r.status_code == 200, r.text
    assert r.json()["checks"]["store"]["detail"].startswith("the interactive worker called the edge store")
    lanes = r.json()["checks"]["lanes"]
    for lane in ("interactive", "bulk", "vectors"):
        assert lanes[lane]["ok"] and lanes[lane]["workers"] == 1 and lanes[lane]["last_ok_s"] is not None, lanes
