"""``embeddings.deferred``: work after the answer runs once the task has answered (its postrun),
in order, at once outside a task, and never fails the task (issue 58)."""
from __future__ import annotations

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
