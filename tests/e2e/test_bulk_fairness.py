"""The fair scheduler on real workers (``BULK_SCHEDULER=fair``): a private Redis, the web process, one
Celery worker per queue (one bulk process: a window of 2 chunks), embedded Qdrant, seeded random
ViT-B-32 weights. A small job of another owner submitted behind a big one waits for the window,
not for the big job: it finishes while most of the big job is still to do (first come, first
served would finish it after every one of the big job's chunks)."""
from __future__ import annotations

import time

import pytest

from scripts.soak import make_jpeg, soak_env, zip_of
from scripts.stack import Stack

pytestmark = pytest.mark.e2e

CHUNK = 16
BIG_CHUNKS = 10


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    env = soak_env(DATABASE_URL=database_url, BULK_BATCH_SIZE=str(CHUNK), BULK_PROCESSES="1", ADMISSION_CONTROL="0",
                   BULK_SCHEDULER="fair")
    with Stack(tmp_path_factory.mktemp("fairness"), env, private_redis=True, log=lambda *a: None) as s:
        yield s


def submit(api, seed: int, n: int) -> str:
    files = [(f"f{seed + i}.jpg", make_jpeg(seed + i)) for i in range(n)]
    r = api.post("/api/jobs/", files={"zip": ("job.zip", zip_of(files))})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def test_a_small_job_of_another_owner_finishes_before_the_big_one_it_arrived_behind(stack):
    from tests.e2e.conftest import Api

    alice = Api(stack.web_url, stack.manage("apiuser", "alice").strip())
    bob = Api(stack.web_url, stack.manage("apiuser", "bob").strip())
    root = Api(stack.web_url, stack.manage("apiuser", "root", "--staff").strip())
    big = submit(alice, 50_000, BIG_CHUNKS * CHUNK)
    end = time.monotonic() + 120
    while alice.get(f"/api/jobs/{big}/").json()["embedded"] == 0:  # the big job's first chunk is written
        assert time.monotonic() < end, "the big job never started"
        time.sleep(0.2)
    small = submit(bob, 60_000, CHUNK)
    big_done_then = None
    end = time.monotonic() + 300
    while True:
        s, b = bob.get(f"/api/jobs/{small}/").json(), alice.get(f"/api/jobs/{big}/").json()
        if s["status"] == "done" and big_done_then is None:
            big_done_then = b["embedded"]
        if b["status"] == "done" and s["status"] == "done":
            break
        assert time.monotonic() < end, (s["status"], s["counts"], b["status"], b["counts"])
        time.sleep(0.2)
    assert (s["embedded"], b["embedded"]) == (CHUNK, BIG_CHUNKS * CHUNK)
    assert s["finished_at"] < b["finished_at"]
    # it waited for the window (2 chunks) and the chunk computing when it came, not for the big job
    assert big_done_then <= 4 * CHUNK, big_done_then
    stats = root.get("/api/stats/").json()
    assert stats["points"] == stats["distinct_embedded"] == stats["images"]["embedded"] == (BIG_CHUNKS + 1) * CHUNK
    assert stats["images"].get("queued", 0) == 0
