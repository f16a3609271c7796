"""Faults the service must survive, each with real processes: a private Redis, the web process, one
Celery worker per queue, embedded Qdrant, seeded random ViT-B-32 weights.

Each fault ends with every image embedded exactly once (or failed/expired with a reason) and with
``Qdrant points = distinct embedded images`` (``GET /api/stats/``). Tests share one stack and run in
file order; each leaves it healthy. Chunks are 32 images; the reconciler runs every 2 s with a 6 s
grace, so lost work is found within seconds instead of minutes.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
import redis

from embeddings.services.reconcile import queue_keys
from project import lanes
from scripts.soak import make_jpeg, soak_env, zip_of
from scripts.stack import Stack
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

CHUNK = 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    env = soak_env(DATABASE_URL=database_url, BULK_BATCH_SIZE=str(CHUNK), BULK_PROCESSES="1", ADMISSION_CONTROL="0")
    s = Stack(tmp_path_factory.mktemp("faults"), env, private_redis=True, log=lambda *a: None)
    with s:
        s.supervise()  # as the process manager does in production: a worker may exit when Redis goes
        yield s


@pytest.fixture(scope="module")
def api(stack):
    from tests.e2e.conftest import Api

    return Api(stack.web_url, stack.manage("apiuser", "faults", "--staff").strip())


_seed = iter(range(10_000, 1_000_000, 1000))


def images(n: int) -> list[tuple[str, bytes]]:
    """``n`` distinct JPEGs never used before in this module."""
    base = next(_seed)
    return [(f"f{base + i}.jpg", make_jpeg(base + i)) for i in range(n)]


def submit_job(api, files) -> str:
    r = api.post("/api/jobs/", files={"zip": ("job.zip", zip_of(files))})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def wait_job(api, job_id: str, *, status=("done",), timeout: float = 240) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        j = api.get(f"/api/jobs/{job_id}/").json()
        if j["status"] in status:
            return j
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not {status} after {timeout} s: {j['status']} {j['counts']}")


def wait_until(predicate, *, timeout: float, what: str, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stats_of(api, stack, *, timeout: float = 60) -> dict:
    """``GET /api/stats/``. Right after a fault the vectors worker or the web process's result
    connection may still be coming back: the API then answers 503 with a stable code and
    ``Retry-After``, which a client honours; anything else fails the test with the web log's tail."""
    end = time.monotonic() + timeout
    while True:
        r = api.get("/api/stats/")
        if r.status_code == 200:
            return r.json()
        web_log = log_text(stack, "web")[-4000:]
        assert r.status_code == 503 and r.headers.get("Retry-After"), (r.status_code, r.text[:500], web_log)
        assert r.json()["code"] in ("vectors_unavailable", "broker_unavailable"), (r.text, web_log)
        assert time.monotonic() < end, (f"stats still 503 after {timeout} s", r.text, web_log)
        time.sleep(1)


def assert_counts_match(api, stack) -> dict:
    """Qdrant holds exactly one point per distinct embedded image, and nothing is left queued."""
    stats = stats_of(api, stack)
    assert stats["points"] == stats["distinct_embedded"] == stats["images"].get("embedded", 0), stats
    assert stats["images"].get("queued", 0) == 0, stats
    return stats


def log_text(stack, name: str) -> str:
    return (stack.var_dir / "log" / f"{name}.log").read_text(errors="replace")


def job_images(api, job_id: str) -> list[dict]:
    out, page = [], api.get("/api/images/").json()  # every page (cursor pagination, newest first)
    while True:
        out += [im for im in page["results"] if im["job"] == job_id]
        if not page["next"]:
            return out
        page = api.s.get(page["next"], timeout=60).json()


def bulk_images_metered(api) -> int:
    """The module's user's ``image_bulk`` usage so far (``GET /api/usage/``, docs/usage.md)."""
    r = api.get("/api/usage/?group_by=kind")
    assert r.status_code == 200, r.text
    return r.json()["total"]["images_bulk"]


def test_bulk_pool_child_killed_mid_chunk_runs_the_chunk_again(stack, api):
    files = images(2 * CHUNK)
    metered = bulk_images_metered(api)
    job_id = submit_job(api, files)
    wait_job(api, job_id, status=("running",), timeout=60)  # the first chunk has started
    stack.kill("worker-bulk", child=True)
    j = wait_job(api, job_id)
    assert (j["embedded"], j["skipped"], j["failed"]) == (len(files), 0, 0), j["counts"]
    assert "WorkerLostError" in log_text(stack, "worker-bulk")  # the kill did land mid-task
    assert_counts_match(api, stack)
    # the killed chunk ran again; each image is metered once, by the write that marked it embedded
    assert bulk_images_metered(api) - metered == len(files)


def test_whole_bulk_worker_killed_mid_chunk_is_recovered_by_the_reconciler(stack, api):
    files = images(2 * CHUNK)
    job_id = submit_job(api, files)
    wait_job(api, job_id, status=("running",), timeout=60)
    time.sleep(0.3)
    stack.stop_process("worker-bulk", sig=signal.SIGKILL)  # parent and child: the delivery stays unacknowledged
    stack.restart("worker-bulk")
    j = wait_job(api, job_id)
    assert (j["embedded"], j["failed"]) == (len(files), 0), j["counts"]
    assert "reconcile:" in log_text(stack, "worker-vectors")  # the orphaned chunk was found and sent again
    assert_counts_match(api, stack)


def test_interactive_worker_killed_mid_request_gives_a_clear_outcome(stack, api):
    files = images(16)  # two batches of the dynamic batcher: the kill lands while they run
    before = log_text(stack, "worker-interactive").count("embed_interactive")
    out: dict = {}

    def upload():
        t0 = time.monotonic()
        out["r"] = api.post("/api/images/", files=[("files", f) for f in files], data={"k": 3})
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=upload)
    t.start()
    wait_until(lambda: log_text(stack, "worker-interactive").count("embed_interactive") > before, timeout=30,
               what="the interactive worker to receive the request")
    stack.stop_process("worker-interactive", sig=signal.SIGKILL)
    t.join(timeout=60)
    assert not t.is_alive(), "the request hung"
    r, deadline = out["r"], 5.0
    assert out["s"] < deadline + 5, out["s"]  # answered by its deadline, not hung
    assert r.status_code == 202, r.text  # the deadline passed: the work is not lost silently
    views = r.json()["images"]

    def statuses():
        got = [api.get(v["url"]).json() for v in views]
        return got if all(g["status"] != "queued" for g in got) else None

    final = wait_until(statuses, timeout=60, what="the images to leave 'queued'", every=0.5)
    assert {(g["status"], g["reason"]) for g in final} == {("expired", "expired")}, final
    # The client sends them again once a worker is back: embedded, as if nothing happened.
    stack.restart("worker-interactive")
    again = api.post("/api/images/", files=[("files", f) for f in files], data={"k": 3})
    assert again.status_code == 200, again.text
    assert {im["status"] for im in again.json()["images"]} == {"embedded"}
    assert_counts_match(api, stack)


def test_redis_restart_loses_queued_chunks_and_the_reconciler_queues_them_again(stack, api):
    files = images(3 * CHUNK)
    job_id = submit_job(api, files)
    wait_job(api, job_id, status=("running",), timeout=60)
    broker = redis.Redis.from_url(stack.env["REDIS_URL"])
    waiting = sum(broker.llen(k) for k in queue_keys((lanes.BULK,)))
    assert waiting >= 1  # chunks still in Redis: the restart loses them
    stack.restart_redis()
    assert sum(broker.llen(k) for k in queue_keys((lanes.BULK,))) == 0
    j = wait_job(api, job_id)
    assert (j["embedded"], j["failed"]) == (len(files), 0), j["counts"]
    assert_counts_match(api, stack)


def test_store_down_images_wait_visibly_and_a_chunk_delivered_twice_writes_each_point_once(stack, api):
    """The vectors worker (the only way to embedded Qdrant) is stopped: chunks still embed, their
    images wait visibly, nothing is marked embedded. Meanwhile the same chunk is delivered a second
    time, as Redis does when a chunk outlives the visibility timeout: both deliveries embed, both
    write the same point ids once the store is back: one point per image."""
    stack.stop_process("worker-vectors", sig=signal.SIGTERM)
    files = images(CHUNK)
    job_id = submit_job(api, files)
    ids = [im["id"] for im in job_images(api, job_id)]
    assert len(ids) == len(files)
    app = stack.celery_app()  # the stack's deployment: its workers' keys
    app.send_task("embeddings.tasks.embed_chunk", args=(job_id, ids), queue=lanes.BULK,
                  priority=lanes.PRIORITY_BULK_BACKGROUND)
    app.close()

    def all_waiting():
        ims = job_images(api, job_id)
        done = api.get(f"/api/jobs/{job_id}/").json()["batches"] == 2
        return ims if done and all(im["reason"] == "waiting_for_store" for im in ims) else None

    waiting = wait_until(all_waiting, timeout=120, what="both deliveries to embed and wait for the store", every=0.5)
    assert {im["status"] for im in waiting} == {"queued"}  # nothing is embedded before its point is written
    assert api.get(f"/api/jobs/{job_id}/").json()["embedded"] == 0
    stack.restart("worker-vectors")
    j = wait_job(api, job_id)
    assert (j["embedded"], j["failed"], j["batches"]) == (len(files), 0, 2), j
    assert all(im["status"] == "embedded" and im["reason"] == "" for im in job_images(api, job_id))
    assert_counts_match(api, stack)


def test_worker_refuses_to_start_when_a_chunk_could_outlive_the_visibility_timeout(stack):
    env = {**stack.env, "CELERY_VISIBILITY_TIMEOUT_S": "600", "CELERY_BULK_TIME_LIMIT_S": "600"}
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "celery") if (ROOT / ".venv").exists() else "celery",
                          "-A", "project", "worker", "-Q", "unused-queue", "-P", "solo", "-n", "refused@%h",
                          "--without-gossip", "--without-mingle"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 78, out.stderr[-2000:]
    assert "CELERY_BULK_TIME_LIMIT_S (600 s) must be shorter than CELERY_VISIBILITY_TIMEOUT_S (600 s)" in out.stderr


def test_interactive_worker_that_cannot_load_its_model_stops_instead_of_looking_ready(stack, tmp_path):
    """Weights missing: the worker must not sit "ready" while every request expires; it exits 78
    (EX_CONFIG) naming the problem and the options. It listens on a Redis database no one uses."""
    url = stack.env["REDIS_URL"].rsplit("/", 1)[0] + "/5"
    env = {**stack.env, "REDIS_URL": url, "VAR_DIR": str(tmp_path), "CLIP_PRETRAINED": str(tmp_path / "missing.pt")}
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "celery") if (ROOT / ".venv").exists() else "celery",
                          "-A", "project", "worker", "-Q", lanes.INTERACTIVE, "-P", "threads", "-c", "2",
                          "-n", "noweights@%h", "--without-gossip", "--without-mingle"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 78, out.stderr[-2000:]
    assert "refusing to serve the interactive lane" in out.stderr and "missing.pt' does not exist" in out.stderr


def test_nothing_was_lost_or_duplicated_across_all_faults(stack, api):
    stats = assert_counts_match(api, stack)
    assert stats["images"].get("failed", 0) == 0
