"""Waiting on the vectors worker from the web process: every failure is a 503 with a stable code and
``Retry-After`` (``embeddings/services/calls.py``), never an unhandled exception (a 500)."""
from __future__ import annotations

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

from embeddings.services.calls import RETRY_AFTER_S, vectors_call
from embeddings.services.errors import ApplicationError


class _Result:
    def __init__(self, outcome):
        self.outcome = outcome
        self.timeout = None

    def get(self, timeout):
        self.timeout = timeout
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _Task:
    """Stands in for a Celery task: records how it was sent, answers with ``outcome``."""

    def __init__(self, outcome=None, *, send_error: Exception | None = None):
        self.result = _Result(outcome)
        self.send_error = send_error
        self.sent: dict | None = None

    def apply_async(self, args, **options):
        if self.send_error is not None:
            raise self.send_error
        self.sent = {"args": args, **options}
        return self.result


def test_answer_comes_back_and_the_call_goes_to_the_vectors_queue_at_interactive_priority(settings):
    from project import lanes

    task = _Task({"points": 3})
    assert vectors_call(task, "a", 1) == {"points": 3}
    assert task.sent == {"args": ("a", 1), "queue": lanes.VECTORS, "priority": lanes.PRIORITY_INTERACTIVE}
    assert task.result.timeout == settings.VECTORS_CALL_TIMEOUT_S


@pytest.mark.parametrize("outcome,code", [
    (CeleryTimeout("no answer"), "vectors_unavailable"),            # vectors worker down or restarting
    (RedisConnectionError("connection reset"), "vectors_unavailable"),  # result connection broke
    (OperationalError("lost"), "vectors_unavailable"),
    (ValueError("bad collection"), "worker_error"),                 # the task itself raised
])
def test_a_failed_wait_is_a_503_with_a_code_and_retry_after(outcome, code):
    with pytest.raises(ApplicationError) as e:
        vectors_call(_Task(outcome), timeout_s=0.5)
    assert (e.value.status, e.value.code) == (503, code)
    assert e.value.headers == {"Retry-After": str(RETRY_AFTER_S)}


def test_a_broker_that_cannot_be_reached_is_a_503_broker_unavailable():
    with pytest.raises(ApplicationError) as e:
        vectors_call(_Task(send_error=OperationalError("Error 111 connecting")))
    assert (e.value.status, e.value.code, e.value.headers["Retry-After"]) == (503, "broker_unavailable", "5")
