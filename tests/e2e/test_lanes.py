"""The two lanes on real processes: Redis priorities as documented, and deployment (b), one worker
consuming both lanes, where interactive work never waits behind more than one bulk batch.

Times come from the worker: Celery's task events (``task-started``/``task-succeeded``) captured from
the stack's private Redis, and for bulk chunks the moment each got its turn to compute (the task's
result ``started``/``ended``; the shared worker holds a second chunk on deck, whose task has begun
but waits).
"""
from __future__ import annotations

import ast
import concurrent.futures
import threading
import time

import cv2
import numpy as np
import pytest
from celery import Celery
from django.conf import settings
from kombu import Connection, Consumer, Queue

from project import lanes
from scripts.stack import Stack
from tests.e2e.conftest import Api

pytestmark = pytest.mark.e2e

# More chunks than the shared worker has threads (8 + 2): without the gate they would take every
# thread. The interactive requests are sent behind at least 10 of them still queued.
CHUNK, CHUNKS = 6, 13
INTERACTIVE = 4  # interactive uploads sent at once behind them
#: A bulk chunk counts as one an interactive task waited behind when it overlaps the task's wait
#: (queued → started) by more than this (s): a chunk here computes for ~1 s.
OVERLAP_S = 0.05


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (320, 256), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


class TaskEvents:
    """Task events from ``url``, captured on a thread from the moment :meth:`start` returns."""

    def __init__(self, url: str) -> None:
        self.app = Celery("lane-events", broker=url, set_as_current=False)
        # the stack's events travel under its deployment's prefix (kombu's global_keyprefix)
        self.app.conf.broker_transport_options = lanes.transport_options(settings.DEPLOYMENT_NAME)
        self.events: list[dict] = []
        self._ready = threading.Event()
        self._recv = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection() as conn:
            self._recv = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self._recv.on_consume_ready = lambda *a, **kw: self._ready.set()
            self._recv.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> "TaskEvents":
        self._thread.start()
        assert self._ready.wait(30), "event receiver did not start"
        return self

    def stop(self) -> None:
        if self._recv is not None:
            self._recv.should_stop = True
        self._thread.join(timeout=10)
        self.app.close()

    def tasks(self) -> dict[str, dict]:
        """``{uuid: {"name", "sent", "started", "ended", "result"}}`` (Unix s; publisher and worker
        clocks are this machine's; ``result``: the repr of the task's return value, from its
        task-succeeded event: the result backend keeps none of a bulk chunk's)."""
        out: dict[str, dict] = {}
        for e in list(self.events):
            t = out.setdefault(e.get("uuid", ""), {"uuid": e.get("uuid")})
            if e["type"] == "task-sent":  # published by the web process
                t["sent"] = e["timestamp"]
            elif e["type"] == "task-received":
                t["name"] = e["name"]
            elif e["type"] == "task-started":
                t["started"] = e["timestamp"]
            elif e["type"] in ("task-succeeded", "task-failed"):
                t["ended"] = e["timestamp"]
                if e["type"] == "task-succeeded":
                    t["result"] = e["result"]  # its repr, cut at resultrepr_maxsize
        return out


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory, database_url):
    # fp32: the chunks must still be queued when the interactive uploads arrive; in bf16 on a CPU
    # with AMX all 13 chunks of 6 were done within the test's first half second
    env = {"CLIP_PRETRAINED": "random", "CLIP_PRECISION": "fp32", "DATABASE_URL": database_url,
           "INTERACTIVE_DEADLINE_S": "30", "BULK_BATCH_SIZE": str(CHUNK), "CELERY_TASK_EVENTS": "1"}
    s = Stack(tmp_path_factory.mktemp("shared"), env, private_redis=True, deployment="shared", log=lambda *a: None)
    with s:
        yield s


def test_redis_priorities_behave_as_documented(shared_stack):
    """Priority 0 is the highest; a worker's BRPOP takes priority steps first, then queues in the
    listed order (interactive first). So interactive at 0 beats bulk at 6 and 9, and FIFO holds
    within a step; but a bulk message at step 0 would beat interactive at step 3 (../shared/NOTES.md),
    which is why bulk is only ever sent at 6 or 9."""
    url = shared_stack.env["REDIS_URL"].rsplit("/", 1)[0] + "/1"  # same server, a db no worker reads
    app = Celery("lane-priorities", broker=url, set_as_current=False)
    app.conf.broker_transport_options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    sent = [(lanes.BULK, 9, "b9-1"), (lanes.BULK, 6, "b6-1"), (lanes.BULK, 9, "b9-2"),
            (lanes.INTERACTIVE, 3, "i3-1"), (lanes.INTERACTIVE, 0, "i0-1"), (lanes.BULK, 6, "b6-2"),
            (lanes.BULK, 0, "b0-1"), (lanes.INTERACTIVE, 0, "i0-2")]
    for queue, priority, tag in sent:
        app.send_task("embeddings.tasks.embed_chunk", args=(tag, []), queue=queue, priority=priority)
    got: list[str] = []

    def on_message(body, message):
        got.append(body[0][0])
        message.ack()

    with Connection(url, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS) as conn:
        queues = [Queue(lanes.INTERACTIVE), Queue(lanes.BULK)]  # as in `-Q interactive,bulk`
        with Consumer(conn, queues=queues, callbacks=[on_message], accept=["json"], prefetch_count=1):
            deadline = time.monotonic() + 20
            while len(got) < len(sent) and time.monotonic() < deadline:
                conn.drain_events(timeout=2)
    app.close()
    assert got == ["i0-1", "i0-2", "b0-1", "i3-1", "b6-1", "b6-2", "b9-1", "b9-2"]


def test_shared_worker_runs_interactive_work_behind_at_most_one_bulk_batch(shared_stack):
    api = Api(shared_stack.web_url, shared_stack.manage("apiuser", "lanes", "--staff").strip())
    events = TaskEvents(shared_stack.env["REDIS_URL"]).start()
    try:
        r = api.post("/api/jobs/", files=[("files", (f"{i}.jpg", jpeg(i))) for i in range(CHUNK * CHUNKS)])
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        time.sleep(0.5)  # the chunks were queued before the 202; the worker takes what it may take
        t_submit = time.time()
        with concurrent.futures.ThreadPoolExecutor(INTERACTIVE) as pool:  # several people at once
            answers = list(pool.map(lambda i: api.post("/api/images/", files={"files": (f"now{i}.jpg", jpeg(10_000 + i))},
                                                        data={"k": 1}), range(INTERACTIVE)))
        for r in answers:
            assert r.status_code == 200 and r.json()["images"][0]["status"] == "embedded", r.text
        deadline = time.monotonic() + 180
        while api.get(f"/api/jobs/{job_id}/").json()["status"] != "done":
            assert time.monotonic() < deadline, "bulk job not done"
            time.sleep(0.3)
        time.sleep(0.5)  # the last events
    finally:
        events.stop()
    tasks = events.tasks()
    turns = [ast.literal_eval(t["result"]) for t in tasks.values() if t.get("name") == "embeddings.tasks.embed_chunk"]
    chunks = sorted((r["started"], r["ended"]) for r in turns)
    interactive = [t for t in tasks.values() if t.get("name") == "embeddings.tasks.embed_interactive"]
    assert len(chunks) == CHUNKS and all(end for _, end in chunks) and len(interactive) == INTERACTIVE
    # One bulk chunk computed at a time: each started after the previous one ended.
    assert all(nxt[0] >= prev[1] for prev, nxt in zip(chunks, chunks[1:])), chunks
    behind = [start for start, _ in chunks if start >= t_submit]
    assert len(behind) >= 10, "the job's chunks were not still queued: make them slower"
    for task in interactive:
        # Measured from the moment its message entered the queue (the web process's task-sent event;
        # the HTTP upload before it runs while the machine is busy with bulk work): each interactive
        # task started before a second bulk chunk could start after it was queued...
        after = [start for start, _ in chunks if start >= task["sent"]]
        assert len(after) < 2 or task["started"] < after[1], (task, after)
        # ...and at most one bulk batch computed between its queueing and its start: a chunk that
        # overlaps that wait by a few ms (one ending just after the message arrived, the next
        # beginning just before the task did; seen once: 3 ms and 7 ms of an 11 ms wait) is not
        # one the task waited behind.
        running = [c for c in chunks if min(c[1], task["started"]) - max(c[0], task["sent"]) > OVERLAP_S]
        assert len(running) <= 1, (task, running)
