"""``project/results.py``: a result whose message names a deadline is kept in Redis until then (plus
the margin), whatever it holds; any other keeps ``result_expires``. A real redis-server."""
from __future__ import annotations

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
