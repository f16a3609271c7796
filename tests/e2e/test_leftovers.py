"""What a request leaves in Redis's result backend, through the real web process and workers: nothing
once it is answered; after a request whose deadline passed, only keys that expire with that
deadline (``project.results``, ``embeddings.dispatch.read_by``, ``services.interactive.waiting``). Every result
the workers write is watched with Redis's ``MONITOR``. Images are distinct pixels
(``pixels_jpeg``) this module alone sends: the stack is shared with other modules."""
from __future__ import annotations

import base64
import signal
import threading
import time

import pytest
import redis
from django.conf import settings

from project.results import RESULT_MARGIN_S
from tests.e2e.conftest import SHARED_ENV
from tests.origin_server import pixels_jpeg

pytestmark = pytest.mark.e2e

#: Seeds of this module's images (other modules use other ones).
SEEDS = (4401, 4402, 4403, 4404)
#: Result keys, under the stack's deployment prefix (the result backend's global_keyprefix).
RESULT_PREFIX = settings.REDIS_KEY_PREFIX + "celery-task-meta-"
RESULTS = RESULT_PREFIX + "*"


class ResultWrites:
    """Every ``SETEX`` of a result key the server runs while the block is open: ``(key, ttl s)``."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.writes: list[tuple[str, int]] = []
        self._stop = f"leftovers-stop-{time.time()}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.client.monitor() as m:
            self._ready.set()
            while True:
                words = m.next_command()["command"].split()
                if words[:2] == ["ECHO", self._stop]:
                    return
                if words and words[0].upper() == "SETEX" and words[1].startswith(RESULT_PREFIX):
                    self.writes.append((words[1], int(words[2])))

    def __enter__(self) -> "ResultWrites":
        self._thread.start()
        assert self._ready.wait(10)
        self.client.ping()  # MONITOR is on once a command after it is seen
        return self

    def __exit__(self, *exc) -> None:
        self.client.echo(self._stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def broker(stack):
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    yield client
    client.close()


def results_left(broker) -> list[bytes]:
    return sorted(broker.keys(RESULTS))


def results_left_after_answer(broker, within_s: float = 2.0) -> list[bytes]:
    """The result keys still there ``within_s`` after an answer: the web forgets a request's results
    once its response is sent (``deferred.after_response``), a moment after the client has it."""
    end = time.monotonic() + within_s
    while (left := results_left(broker)) and time.monotonic() < end:
        time.sleep(0.02)
    return left


def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def test_an_answered_request_leaves_no_result_in_redis(stack, api, broker):
    # earlier modules' requests may have left keys before results were forgotten: not this module's
    for key in broker.keys(RESULTS):
        broker.delete(key)
    deadline_s = float(SHARED_ENV["INTERACTIVE_DEADLINE_S"])
    with ResultWrites(stack.env["REDIS_URL"]) as watched:
        r = api.post("/api/images/", files={"files": ("a.jpg", pixels_jpeg(SEEDS[0]))}, data={"k": 1})
        assert r.status_code == 200 and r.json()["images"][0]["status"] == "embedded", r.text
        image_id = r.json()["images"][0]["id"]
        assert results_left_after_answer(broker) == []
        steps = [
            ("text search", lambda: api.post("/api/search/", json={"text": "a cat", "k": 2})),
            ("search by id", lambda: api.post("/api/search/", json={"image_id": image_id, "k": 2})),
            ("search by image", lambda: api.post("/api/search/", files={"image": ("q.jpg", pixels_jpeg(SEEDS[1]))},
                                                 data={"k": 2})),
            ("embeddings", lambda: api.post("/api/embeddings/", json={"inputs": [
                {"text": "a dog"}, {"image": data_url(pixels_jpeg(SEEDS[2]))}]})),
            ("openai embeddings", lambda: api.post("/v1/embeddings", json={"model": "ViT-B-32", "input": "a bird"})),
            ("stats", lambda: api.get("/api/stats/")),
        ]
        for name, step in steps:
            r = step()
            assert r.status_code == 200, (name, r.text[:300])
            assert results_left_after_answer(broker) == [], name  # forgotten once the answer is sent
        other = api.post("/api/images/", files={"files": ("b.jpg", pixels_jpeg(SEEDS[3]))}, data={"k": 0})
        assert other.status_code == 200, other.text
        r = api.s.delete(f"{stack.web_url}/api/images/{other.json()['images'][0]['id']}/", timeout=60)
        assert r.status_code == 204, r.text  # its point forgotten through the vectors worker, waited for
        assert results_left_after_answer(broker) == []
    # every result written, read or not, was to expire with the wait it answered, never in an hour
    # one result per answer read, the last task's of each chain (two uploads' index, three searches,
    # two embeddings requests, the stats' count, the deletion's forget): no chain's inner step
    assert len(watched.writes) == 9, watched.writes
    assert max(ttl for _, ttl in watched.writes) <= deadline_s + RESULT_MARGIN_S, watched.writes


def test_a_timed_out_requests_result_expires_with_its_deadline(stack, api, broker):
    """The vectors worker is paused (SIGSTOP) while an upload waits for its points: the web answers
    202 at the deadline; resumed, the worker stores the neighbours nobody will read, for seconds."""
    deadline_s = 2.0
    with ResultWrites(stack.env["REDIS_URL"]) as watched:
        stack.kill("worker-vectors", sig=signal.SIGSTOP)
        try:
            r = api.post("/api/images/", files={"files": ("late.jpg", pixels_jpeg(SEEDS[0] + 100))},
                         data={"k": 1, "deadline": deadline_s})
        finally:
            stack.kill("worker-vectors", sig=signal.SIGCONT)
        assert r.status_code == 202, r.text
        end = time.monotonic() + 60
        while not watched.writes:  # the index task runs once resumed and stores its neighbours
            assert time.monotonic() < end, "no result was stored"
            time.sleep(0.05)
        (key, ttl), = watched.writes
        assert 1 <= ttl <= deadline_s + RESULT_MARGIN_S, watched.writes
        assert broker.ttl(key) <= ttl  # gone by itself within seconds, not CELERY_RESULT_EXPIRES
    end = time.monotonic() + RESULT_MARGIN_S + deadline_s + 5
    while results_left(broker):
        assert time.monotonic() < end, [(k, broker.ttl(k)) for k in results_left(broker)]
        time.sleep(0.2)
    image = api.get(f"/api/images/{r.json()['images'][0]['id']}/").json()
    assert image["status"] == "embedded"  # the work went on after the deadline, as the 202 says
