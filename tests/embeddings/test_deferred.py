"""``embeddings.deferred``: work after the answer runs once the task has answered (its postrun),
in order, at once outside a task, and never fails the task (issue 58)."""
from __future__ import annotations

import pytest
from celery import shared_task

from embeddings.deferred import after_answer
from project.celery import app

calls: list[str] = []


@shared_task(name="tests.deferred.outer")
def outer(tag: str) -> str:
    after_answer(lambda: calls.append(f"after {tag}"))
    after_answer(lambda: 1 / 0)  # logged, not raised
    after_answer(lambda: calls.append(f"after {tag} again"))
    calls.append(f"ran {tag}")
    return tag


def test_outside_a_task_it_runs_at_once():
    seen = []
    after_answer(lambda: seen.append(1))
    assert seen == [1]


def test_in_a_task_it_runs_after_the_task_in_order_and_a_failure_is_only_logged(caplog):
    calls.clear()
    eager = app.conf.task_always_eager
    app.conf.task_always_eager = True
    try:
        assert outer.delay("a").get() == "a"
        # an eager chain runs its second task inside the first: each keeps its own calls
        assert (outer.si("b") | outer.si("c")).delay().get() == "c"
    finally:
        app.conf.task_always_eager = eager
    assert calls[:3] == ["ran a", "after a", "after a again"]
    assert sorted(calls[3:]) == sorted(["ran b", "after b", "after b again", "ran c", "after c", "after c again"])
    assert calls.index("ran b") < calls.index("after b") and calls.index("ran c") < calls.index("after c")
    assert len([r for r in caplog.records if "work after the answer failed" in r.getMessage()]) == 3


@pytest.mark.django_db  # Django's own receivers of these signals close old connections
def test_in_a_web_request_it_runs_once_the_response_is_sent(caplog):
    """Django's ``request_finished`` (the WSGI server closing the response, after its last byte) runs
    what the request queued, in order; outside a request it runs at once; a failure is only logged."""
    from django.core.signals import request_finished, request_started

    from embeddings.deferred import after_response

    seen: list[str] = []
    after_response(lambda: seen.append("outside"))
    assert seen == ["outside"]
    request_started.send(sender=None, environ={})
    after_response(lambda: seen.append("first"))
    after_response(lambda: 1 / 0)
    after_response(lambda: seen.append("second"))
    assert seen == ["outside"]  # nothing before the response is out
    request_finished.send(sender=None)
    assert seen == ["outside", "first", "second"]
    assert len([r for r in caplog.records if "work after the answer failed" in r.getMessage()]) == 1
    after_response(lambda: seen.append("after the request"))  # the request is over: at once
    assert seen[-1] == "after the request"

