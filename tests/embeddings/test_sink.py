"""Waiting on the vectors worker from the web process: every failure is a 503 with a stable code and
``Retry-After`` (``embeddings/sink.py``), never an unhandled exception (a 500)."""
from __future__ import annotations

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

from embeddings.sink import RETRY_AFTER_S, vectors_call
from embeddings.errors import ApplicationError


class _Result:
    """``outcome``: the value, or an exception the wait raises; ``task_error``: what the task raised
    (returned, not raised, by ``get(propagate=False)``, as Celery does)."""

    def __init__(self, outcome, task_error=None):
        self.outcome, self.task_error = outcome, task_error
        self.timeout = None
        self.forgotten = 0

    def get(self, timeout, propagate=True):
        assert propagate is False
        self.timeout = timeout
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.task_error if self.task_error is not None else self.outcome

    def failed(self):
        return self.task_error is not None

    def forget(self):
        self.forgotten += 1


class _Task:
    """Stands in for a Celery task: records how it was sent, answers with ``outcome``."""

    def __init__(self, outcome=None, *, send_error: Exception | None = None, task_error=None):
        self.result = _Result(outcome, task_error)
        self.send_error = send_error
        self.sent: dict | None = None

    def apply_async(self, args, **options):
        if self.send_error is not None:
            raise self.send_error
        self.sent = {"args": args, **options}
        return self.result


def test_answer_comes_back_and_the_call_goes_to_the_vectors_queue_at_interactive_priority(settings):
    import time

    from project import lanes
    from project.results import RESULT_DEADLINE_HEADER

    task = _Task({"points": 3})
    before = time.time()
    assert vectors_call(task, "a", 1) == {"points": 3}
    read_by = task.sent.pop("headers")[RESULT_DEADLINE_HEADER]  # its result is kept no longer than the wait
    assert before + settings.VECTORS_CALL_TIMEOUT_S <= read_by <= time.time() + settings.VECTORS_CALL_TIMEOUT_S
    assert task.sent == {"args": ("a", 1), "queue": lanes.VECTORS, "priority": lanes.PRIORITY_INTERACTIVE}
    assert task.result.timeout == settings.VECTORS_CALL_TIMEOUT_S
    assert task.result.forgotten == 1  # nothing left in the result backend once read


@pytest.mark.parametrize("task", [
    _Task(CeleryTimeout("no answer")),                       # vectors worker down or restarting
    _Task(RedisConnectionError("connection reset")),         # result connection broke (Redis restarted)
    _Task(RuntimeError("Retry limit exceeded while trying to reconnect to the Celery redis result store backend.")),
    _Task(OperationalError("lost")),
], ids=["timeout", "connection", "reconnect-retries", "operational"])
def test_a_failed_wait_is_a_503_vectors_unavailable_with_retry_after(task):
    with pytest.raises(ApplicationError) as e:
        vectors_call(task, timeout_s=0.5)
    assert (e.value.status, e.value.code) == (503, "vectors_unavailable")
    assert e.value.headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert task.result.forgotten == 1


def test_a_task_that_raised_is_a_503_worker_error_naming_it():
    with pytest.raises(ApplicationError) as e:
        vectors_call(_Task(task_error=ValueError("bad collection")))
    assert (e.value.status, e.value.code) == (503, "worker_error")
    assert "ValueError: bad collection" in e.value.message


def test_a_broker_that_cannot_be_reached_is_a_503_broker_unavailable():
    with pytest.raises(ApplicationError) as e:
        vectors_call(_Task(send_error=OperationalError("Error 111 connecting")))
    assert (e.value.status, e.value.code, e.value.headers["Retry-After"]) == (503, "broker_unavailable", "5")


def test_a_broker_at_its_memory_limit_is_a_503_broker_full():
    from redis.exceptions import OutOfMemoryError

    refused = OperationalError("Command # 1 (LPUSH vectors) of pipeline caused error: command not allowed when "
                               "used memory > 'maxmemory'.")
    refused.__cause__ = OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    with pytest.raises(ApplicationError) as e:
        vectors_call(_Task(send_error=refused))
    assert (e.value.status, e.value.code, e.value.headers["Retry-After"]) == (503, "broker_full", "5")
