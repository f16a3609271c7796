"""``project/results.py``: a result whose message names a deadline is kept in Redis until then (plus
the margin), whatever it holds; any other keeps ``result_expires``. A real redis-server."""
from __future__ import annotations

import json
import time

import pytest
from celery import Celery
from celery.app.task import Context

from project.results import RESULT_DEADLINE_HEADER, RESULT_MARGIN_S, result_deadline, result_ttl


@pytest.fixture
def backend(private_redis):
    url, client = private_redis
    app = Celery("results-test", backend="project.results:DeadlineRedisBackend+" + url, set_as_current=False)
    app.conf.result_expires = 3600
    yield app.backend, client
    app.close()


def test_a_result_is_kept_until_its_readers_deadline_and_no_longer(backend):
    b, client = backend
    now = time.time()
    # a worker's request: the message's custom headers, as attributes and as ``headers``
    b.store_result("read", {"vector": "AAAA"}, "SUCCESS",
                   request=Context({"id": "read", "task": "t", RESULT_DEADLINE_HEADER: now + 20}))
    # the context Celery builds for a failed chain's later steps (Backend._fail_chain): the signature's options
    chained = Context({"task": "t", "options": {"task_id": "chained", "headers": {RESULT_DEADLINE_HEADER: now + 20}}})
    chained.update(chained.options)
    b.store_result("chained", ValueError("boom"), "FAILURE", request=chained)
    b.store_result("late", {"vector": "AAAA"}, "SUCCESS",  # stored after its deadline: for nobody
                   request=Context({"id": "late", "task": "t", RESULT_DEADLINE_HEADER: now - 60}))
    b.store_result("other", 3, "SUCCESS", request=Context({"id": "other", "task": "t"}))
    ttl = {k: client.ttl(f"celery-task-meta-{k}") for k in ("read", "chained", "late", "other")}
    assert 20 + RESULT_MARGIN_S - 2 <= ttl["read"] <= 20 + RESULT_MARGIN_S + 1
    assert 20 + RESULT_MARGIN_S - 2 <= ttl["chained"] <= 20 + RESULT_MARGIN_S + 1
    assert ttl["late"] == 1 and ttl["other"] == 3600
    assert b.get_task_meta("read")["result"] == {"vector": "AAAA"}  # stored as Celery stores it


def test_the_expiry_arithmetic():
    assert result_ttl(100.0, now=100.0, ceiling_s=3600) == RESULT_MARGIN_S
    assert result_ttl(100.2, now=100.0, ceiling_s=3600) == RESULT_MARGIN_S + 1  # whole seconds, rounded up
    assert result_ttl(50.0, now=100.0, ceiling_s=3600) == 1  # Redis refuses 0
    assert result_ttl(1e9, now=100.0, ceiling_s=3600) == 3600 and result_ttl(1e3, now=100.0, ceiling_s=None) == 905
    assert result_deadline(Context({"id": "x"})) is None
    assert result_deadline(Context({"id": "x", RESULT_DEADLINE_HEADER: "12.5"})) == 12.5
    assert result_deadline(Context({"id": "x", RESULT_DEADLINE_HEADER: "soon"})) is None


def test_a_result_is_stored_and_published_in_one_round_trip_and_never_over_a_success(backend):
    """``STORE_SCRIPT``: one command per result (Celery's store is a GET, then SET + PUBLISH), the
    subscriber of the key's channel gets the meta, and a stored SUCCESS stays (a late duplicate's
    FAILURE or retry is dropped) while any other state is replaced."""
    b, client = backend
    key = "celery-task-meta-once"
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(key)
    b.store_result("warm", 0, "SUCCESS", request=Context({"id": "warm", "task": "t"}))  # Redis loads the script
    calls = []
    real = b.client.execute_command
    b.client.execute_command = lambda *a, **kw: calls.append(a[0]) or real(*a, **kw)
    try:
        b.store_result("once", {"n": 1}, "SUCCESS", request=Context({"id": "once", "task": "t",
                                                                    RESULT_DEADLINE_HEADER: time.time() + 20}))
    finally:
        b.client.execute_command = real
    assert calls == ["EVALSHA"]
    message = None
    for _ in range(50):
        message = message or listener.get_message(timeout=0.1)
    assert message is not None and json.loads(message["data"])["result"] == {"n": 1}
    assert 20 <= client.ttl(key) <= 20 + RESULT_MARGIN_S + 1

    b.store_result("once", ValueError("late duplicate"), "FAILURE", request=Context({"id": "once", "task": "t"}))
    assert b.get_task_meta("once")["status"] == "SUCCESS" and b.get_task_meta("once")["result"] == {"n": 1}

    b.store_result("retried", ValueError("first try"), "RETRY", request=Context({"id": "retried", "task": "t"}))
    b.store_result("retried", 7, "SUCCESS", request=Context({"id": "retried", "task": "t"}))
    assert b.get_task_meta("retried")["result"] == 7 and client.ttl("celery-task-meta-retried") == 3600
    # an unreadable stored value (not JSON) is replaced, as Celery's decode failure would be
    client.set("celery-task-meta-odd", b"\x80not json")
    b.store_result("odd", 8, "SUCCESS", request=Context({"id": "odd", "task": "t"}))
    assert b.get_task_meta("odd")["result"] == 8
    listener.close()
