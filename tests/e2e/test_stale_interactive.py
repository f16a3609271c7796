"""Issue 9 (4), with real processes: searches queued while the interactive worker was down are
stale when it comes back; none of them reaches the model, and a fresh search answers in time.

Real Redis (private), the web process, the interactive and vectors workers (no bulk worker: it plays
no part), embedded Qdrant, seeded random ViT-B-32 weights. What is counted is what the workers
themselves log for every message: Celery's ``Discarding revoked task`` (expired in the broker, not
run), the task's own ``not computed`` (refused before the model), and ``succeeded`` with a vector
(the model ran).
"""
from __future__ import annotations

import concurrent.futures
import re
import signal
import time

import pytest
import redis

from embeddings.services.reconcile import queue_keys
from project import lanes
from scripts.stack import Stack

pytestmark = pytest.mark.e2e

#: A search's deadline (s): ``VECTORS_CALL_TIMEOUT_S`` (the search API takes no deadline of its own).
DEADLINE_S = 2.0
STALE = 50


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    env = {"CLIP_PRETRAINED": "random", "DATABASE_URL": database_url, "DJANGO_DEBUG": "0",
           "VECTORS_CALL_TIMEOUT_S": str(DEADLINE_S), "RECONCILE_INTERVAL_S": "0"}
    s = Stack(tmp_path_factory.mktemp("stale"), env, private_redis=True, log=lambda *a: None,
              only=("web", "worker-interactive", "worker-vectors"))
    with s:
        yield s


@pytest.fixture(scope="module")
def api(stack):
    from tests.e2e.conftest import Api

    return Api(stack.web_url, stack.manage("apiuser", "stale", "--staff").strip())


def log_since(stack, name: str, offset: int) -> str:
    return (stack.var_dir / "log" / f"{name}.log").read_bytes()[offset:].decode(errors="replace")


def log_size(stack, name: str) -> int:
    return (stack.var_dir / "log" / f"{name}.log").stat().st_size


def computed(log: str, task: str) -> int:
    """``task`` runs that returned a vector (text) or results (search): the model / store did work."""
    return len(re.findall(rf"{re.escape(task)}\[[0-9a-f-]+\] succeeded in [0-9.e-]+s: \{{'(?:vector|results)'", log))


def test_searches_queued_while_the_worker_was_down_never_reach_the_model(stack, api):
    broker = redis.Redis.from_url(stack.env["REDIS_URL"])
    interactive_keys = queue_keys((lanes.INTERACTIVE,))
    warm = api.post("/api/search/", json={"text": "warm-up", "k": 3})
    assert warm.status_code == 200, warm.text

    stack.stop_process("worker-interactive", sig=signal.SIGTERM)
    offsets = {name: log_size(stack, name) for name in ("worker-interactive", "worker-vectors")}

    def stale_search(i: int):
        r = api.post("/api/search/", json={"text": f"stale query {i}", "k": 3})
        return r.status_code, r.json().get("code")

    # All at once (the web holds 2 × WEB_THREADS = 64 waiting requests): they wait out one deadline
    # together instead of STALE / 16 deadlines one after another.
    with concurrent.futures.ThreadPoolExecutor(STALE) as pool:
        answers = list(pool.map(stale_search, range(STALE)))
    # Each caller was answered at its deadline (or refused at once): nobody waits for these any more.
    assert {a for a in answers} <= {(504, "deadline_exceeded"), (429, "overloaded")}, answers
    queued = sum(1 for a in answers if a[0] == 504)
    assert queued == STALE, answers  # no measurement yet (text queries skip the batcher): all admitted
    assert sum(broker.llen(k) for k in interactive_keys) == queued  # waiting in Redis for the worker

    stack.restart("worker-interactive")
    t0 = time.monotonic()
    fresh = api.post("/api/search/", json={"text": "a fresh query", "k": 3})
    took = time.monotonic() - t0
    assert fresh.status_code == 200, fresh.text
    assert took < DEADLINE_S, took

    deadline = time.monotonic() + 30
    while sum(broker.llen(k) for k in interactive_keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(broker.llen(k) for k in interactive_keys) == 0
    # The last lines reach the logs: until every stale message is accounted for and the fresh search
    # is in both logs (a stale query that reached the model keeps the sum below STALE: 10 s, then
    # the assertions below say which).
    end = time.monotonic() + 10
    while True:
        worker = log_since(stack, "worker-interactive", offsets["worker-interactive"])
        vectors = log_since(stack, "worker-vectors", offsets["worker-vectors"])
        discarded = len(re.findall(r"Discarding revoked task: embeddings\.tasks\.encode_text\[", worker))
        refused = len(re.findall(r"embeddings\.tasks\.encode_text\[[0-9a-f-]+\] not computed: deadline passed",
                                 worker))
        if time.monotonic() > end or (discarded + refused >= STALE and computed(worker, "embeddings.tasks.encode_text")
                                      and computed(vectors, "embeddings.tasks.search_vector")):
            break
        time.sleep(0.1)
    assert computed(worker, "embeddings.tasks.encode_text") == 1, worker[-3000:]  # the fresh query only
    assert discarded + refused == STALE, (discarded, refused, worker[-3000:])
    # ... and nothing stale went on to the vector store: one search ran there, the fresh one.
    assert computed(vectors, "embeddings.tasks.search_vector") == 1, vectors[-3000:]
