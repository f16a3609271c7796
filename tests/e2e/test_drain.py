"""Stopping workers loses nothing, and ``/readyz`` knows whether the model works: real processes.

A private Redis, gunicorn, the interactive, bulk and vectors workers (embedded store, SQLite), the
workers started through ``tests.worker_encoders``: a model that costs nothing but sleeps
``DELAY_S`` per pass of pictures and writes a file as each pass starts, so a test stops a worker
while a chunk or a request is in the model, and counts the passes afterwards. Each worker gets
SIGTERM alone, as Kubernetes sends it to a container's first process, with ``REMAP_SIGTERM=SIGQUIT``
as the manifests set it (Celery's soft shutdown, bounded by ``WORKER_DRAIN_S``).

What each test shows (issue 57, items 3 and 4):

- SIGTERM mid-chunk: the worker exits within the bound; the job finishes on the restarted worker
  with every image embedded once and at most the chunk in flight computed again.
- ``manage.py worker_drain`` (the preStop) mid-chunk: the worker takes no more chunks, the chunk in
  flight finishes, the hook returns; SIGTERM then stops an idle worker at once; nothing repeats.
- SIGTERM mid-request: the interactive request in flight is answered before the worker exits.
- ``/readyz``: ready once each lane's worker answered a canary; a worker whose model gives NaN fails
  its lane's canary (the body names the lane), and after ``WORKER_MAX_BATCH_FAILURES`` failed passes
  it leaves the pool (exits) by itself.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import Api
from tests.embeddings.conftest import jpeg_bytes
from tests.worker_encoders import EncoderStack

#: Seconds each pass of pictures takes in the model: long enough to stop a worker in the middle.
DELAY_S = 2.0
#: WORKER_DRAIN_S of these workers: the soft shutdown's bound (Celery sleeps it whole while a task runs).
DRAIN_S = 6.0
#: Images per bulk chunk (BULK_BATCH_SIZE): a canary's pass has 1, so a chunk's passes are told apart.
CHUNK = 4
#: Seconds a stopped worker may take beyond its bound (the interpreter's exit, a loaded 2-core machine).
EXIT_MARGIN_S = 15
FAILURES = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    root = tmp_path_factory.mktemp("drain")
    passes = {name: root / f"passes-{name}" for name in ("worker-bulk", "worker-interactive")}
    for folder in passes.values():
        folder.mkdir()
    env = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "DATABASE_URL": database_url,
           "BULK_BATCH_SIZE": str(CHUNK), "BULK_PROCESSES": "1", "BULK_YIELD_MAX_S": "0",
           "ADMISSION_CONTROL": "0", "INTERACTIVE_DEADLINE_S": "30", "RECONCILE_INTERVAL_S": "0",
           "WORKER_DRAIN_S": str(DRAIN_S), "REMAP_SIGTERM": "SIGQUIT", "TEST_ENCODER_DELAY_S": str(DELAY_S),
           "WORKER_MAX_BATCH_FAILURES": str(FAILURES), "CANARY_INTERVAL_S": "1", "CANARY_TIMEOUT_S": "10",
           "READY_LANES": "interactive,bulk,vectors"}
    s = EncoderStack(root / "var", env, private_redis=True, only=("web", "worker-interactive", "worker-bulk",
                                                                  "worker-vectors"),
                     process_env={name: {"TEST_ENCODER_PASSES": str(folder)} for name, folder in passes.items()})
    s.passes = passes
    with s:
        yield s


@pytest.fixture(scope="module")
def api(stack):
    return Api(stack.web_url, stack.manage("apiuser", "e2e-drain", "--staff").strip(), "e2e-drain")


def chunk_passes(stack, name: str) -> list[float]:
    """Start times of the passes of whole chunks (``CHUNK`` images) worker ``name`` ran, sorted."""
    out = []
    for f in stack.passes[name].iterdir():
        started, images = f.read_text().split()
        if int(images) == CHUNK:
            out.append(float(started))
    return sorted(out)


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"not within {timeout} s: {what}")


def post_job(api, n: int, seed: int) -> str:
    files = [("files", (f"{seed}-{i}.jpg", jpeg_bytes(seed + i), "image/jpeg")) for i in range(n)]
    r = api.post("/api/jobs/", files=files)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def job_done(api, job_id: str, timeout: float = 120) -> dict:
    def done():
        j = api.get(f"/api/jobs/{job_id}/").json()
        return j if j["status"] == "done" else None

    return wait_for(done, timeout, f"job {job_id} done", every=0.3)


def sigterm_and_wait(stack, name: str) -> float:
    """SIGTERM to worker ``name``'s main process alone (what the kubelet sends); seconds until it exited."""
    p = stack.procs[name]
    started = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=DRAIN_S + EXIT_MARGIN_S + 30)
    except Exception:
        pytest.fail(f"{name} still runs {DRAIN_S + EXIT_MARGIN_S + 30} s after SIGTERM")
    return time.monotonic() - started


def settle_passes(stack, name: str, quiet_s: float = 1.5) -> None:
    """Wait until worker ``name`` starts no pass for ``quiet_s`` (canaries from /readyz included)."""
    def quiet():
        files = list(stack.passes[name].iterdir())
        newest = max((f.stat().st_mtime for f in files), default=0)
        return time.time() - newest > quiet_s + DELAY_S

    wait_for(quiet, 60, f"{name} idle")


def test_ready_once_every_required_lane_answers_a_canary(stack):
    # the first probe finds no answer yet and sends the canaries; a later one finds them answered
    first = requests.get(stack.web_url + "/readyz", timeout=30)
    if first.status_code == 503:
        assert {f["check"] for f in first.json()["failed"]} <= {"store", "lane:interactive", "lane:bulk",
                                                                "lane:vectors"}

    def ready():
        r = requests.get(stack.web_url + "/readyz", timeout=30)
        return r if r.status_code == 200 else None

    r = wait_for(ready, 60, "/readyz answering 200", every=0.5)
    lanes = r.json()["checks"]["lanes"]
    for lane in ("interactive", "bulk", "vectors"):
        assert lanes[lane]["ok"] and lanes[lane]["workers"] == 1 and lanes[lane]["last_ok_s"] is not None, lanes
    assert lanes["fetch"]["ok"] and not lanes["fetch"]["required"] and lanes["fetch"]["workers"] == 0


def test_sigterm_mid_chunk_loses_nothing_and_repeats_at_most_the_chunk_in_flight(stack, api):
    settle_passes(stack, "worker-bulk")
    before = len(chunk_passes(stack, "worker-bulk"))
    job_id = post_job(api, 2 * CHUNK, seed=100)
    wait_for(lambda: len(chunk_passes(stack, "worker-bulk")) > before, 60, "a chunk in the model")

    took = sigterm_and_wait(stack, "worker-bulk")
    assert took <= DRAIN_S + EXIT_MARGIN_S, f"the bulk worker took {took:.1f} s to stop"
    stack.restart("worker-bulk")
    job = job_done(api, job_id)
    assert job["counts"]["embedded"] == 2 * CHUNK and not job["counts"].get("failed"), job
    ran = len(chunk_passes(stack, "worker-bulk")) - before
    assert 2 <= ran <= 3, f"{ran} chunk passes for 2 chunks: more than the chunk in flight was repeated"


def test_prestop_drain_waits_for_the_chunk_in_flight_and_takes_no_other(stack, api):
    settle_passes(stack, "worker-bulk")
    before = len(chunk_passes(stack, "worker-bulk"))
    first = post_job(api, 2 * CHUNK, seed=200)
    wait_for(lambda: len(chunk_passes(stack, "worker-bulk")) > before, 60, "a chunk in the model")

    # the hook is a process of its own: the worker may finish more of the job while it boots
    out = stack.manage("worker_drain", "--name", "bulk", "--wait", str(DRAIN_S + 10))
    report = json.loads(out.strip().splitlines()[-1])
    assert report["queues"] == ["bulk"] and report["idle"], report
    drained = len(chunk_passes(stack, "worker-bulk")) - before
    # work sent after the drain stays queued: the worker consumes nothing any more
    second = post_job(api, 2 * CHUNK, seed=300)
    time.sleep(DELAY_S + 1)  # a worker still consuming would have started a chunk by now
    assert len(chunk_passes(stack, "worker-bulk")) - before == drained
    assert api.get(f"/api/jobs/{first}/").json()["counts"].get("embedded") == drained * CHUNK
    assert not api.get(f"/api/jobs/{second}/").json()["counts"].get("embedded")

    took = sigterm_and_wait(stack, "worker-bulk")  # idle: no soft shutdown wait
    assert took < DRAIN_S, f"an idle worker took {took:.1f} s to stop"
    stack.restart("worker-bulk")
    for job_id in (first, second):
        job = job_done(api, job_id)
        assert job["counts"]["embedded"] == 2 * CHUNK and not job["counts"].get("failed"), job
    assert len(chunk_passes(stack, "worker-bulk")) - before == 4  # nothing repeated


def test_sigterm_mid_request_answers_the_request_in_flight_before_exit(stack, api):
    settle_passes(stack, "worker-interactive")
    before = len(list(stack.passes["worker-interactive"].iterdir()))
    answer: dict = {}

    def upload():
        # bytes no other test sends: an upload of bytes already embedded is skipped, not computed
        r = api.post("/api/images/", files=[("files", ("one.jpg", jpeg_bytes(900), "image/jpeg"))])
        answer.update(status=r.status_code, body=r.json(), at=time.monotonic())

    thread = threading.Thread(target=upload)
    thread.start()
    wait_for(lambda: len(list(stack.passes["worker-interactive"].iterdir())) > before, 60, "the request in the model")
    p = stack.procs["worker-interactive"]
    os.kill(p.pid, signal.SIGTERM)
    p.wait(timeout=DRAIN_S + EXIT_MARGIN_S + 30)
    exited = time.monotonic()
    thread.join(60)
    assert answer, "no answer"
    assert answer["status"] in (200, 202), answer
    if answer["status"] == 200:
        assert answer["body"]["images"][0]["status"] == "embedded", answer
    assert answer["at"] <= exited, "answered only after the worker exited"
    # left stopped: the next test starts it again, poisoned (a restart costs seconds of a loaded machine)


def test_a_poisoned_model_fails_its_lane_and_its_worker_leaves_the_pool(stack):
    stack.process_env["worker-interactive"]["TEST_ENCODER_FAULT"] = "nan"
    stack.restart("worker-interactive")
    p = stack.procs["worker-interactive"]

    def lane_failed():
        r = requests.get(stack.web_url + "/readyz", timeout=30)
        failed = {f["check"]: f for f in r.json()["failed"]} if r.status_code == 503 else {}
        # first "stale" (the fresh worker has not answered yet), then its failed answer
        failure = failed.get("lane:interactive") or {}
        return failure if failure.get("code") == "lane_canary_failed" else None

    failure = wait_for(lane_failed, 60, "/readyz naming the interactive lane's failed canary", every=0.5)
    assert "non_finite_embedding" in failure["detail"], failure
    # each canary is one failed pass (the picture's; the text's too with this model): the worker leaves
    def left() -> bool:
        if p.poll() is not None:
            return True
        requests.get(stack.web_url + "/readyz", timeout=30)  # keeps the canaries coming
        return False

    wait_for(left, 60, "the poisoned worker leaving the pool", every=0.5)
    log = (Path(stack.var_dir) / "log" / "worker-interactive.log").read_text()
    assert "leaving the pool, the worker stops for a restart" in log
