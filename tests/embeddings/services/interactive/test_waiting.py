"""``embeddings/services/interactive/waiting.py``: the web's wait for a chain's last result, bounded by the
request's deadline, forgotten however it ends; what a failed or expired task means to the caller.
"""
from __future__ import annotations

import time

import pytest
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeout

from embeddings.errors import ApplicationError
from embeddings.services.interactive import waiting

pytestmark = pytest.mark.django_db  # the wait closes the thread's connection when outside a transaction


class Result:
    """A chain's ``AsyncResult`` as the web sees it: ``get`` returns ``value`` or raises ``error``."""

    def __init__(self, value=None, error: BaseException | None = None) -> None:
        self.value, self.error, self.timeout = value, error, None
        self.forgotten = 0
        self.options: dict = {}

    def get(self, timeout: float, propagate: bool, **options):
        self.timeout, self.options = timeout, options
        if self.error is not None:
            raise self.error
        return self.value

    def forget(self) -> None:
        self.forgotten += 1


def test_the_wait_ends_at_the_deadline_and_a_failed_task_is_a_503_to_retry():
    ok = Result({"x": 1})
    assert waiting.wait_for(ok, time.time() + 2.0) == {"x": 1} and 1.9 < ok.timeout <= 2.0
    late = Result({"x": 1})
    waiting.wait_for(late, time.time() - 5)
    assert late.timeout == 0.01  # a passed deadline still asks once
    assert waiting.wait_for(Result(error=CeleryTimeout("no answer")), time.time() + 1) is None
    assert waiting.wait_for(Result(error=TaskRevokedError("expired")), time.time() + 1) is None  # in the broker
    for error in (TaskRevokedError("revoked"), ConnectionError("store down")):
        with pytest.raises(ApplicationError) as e:
            waiting.wait_for(Result(error=error), time.time() + 1)
        assert (e.value.code, e.value.status, e.value.headers) == ("worker_error", 503, {"Retry-After": "5"})


def test_the_result_is_forgotten_once_however_the_wait_ends_and_a_timeout_can_be_told_from_none():
    timed_out = object()
    answered, late, failed = Result(None), Result(error=CeleryTimeout("no answer")), Result(error=ValueError("x"))
    assert waiting.wait_for(answered, time.time() + 1, timed_out=timed_out) is None  # the task's own None
    assert waiting.wait_for(late, time.time() + 1, timed_out=timed_out) is timed_out
    with pytest.raises(ApplicationError):
        waiting.wait_for(failed, time.time() + 1)
    assert [r.forgotten for r in (answered, late, failed)] == [1, 1, 1]


def closes_on(monkeypatch, vendor: str) -> list[bool]:
    """The database connection's ``close`` calls (whether each came inside a transaction), with the
    connection taken for ``vendor``'s whatever the test database is."""
    from django.db import connection

    closed: list[bool] = []
    monkeypatch.setattr(connection, "close", lambda: closed.append(connection.in_atomic_block))
    monkeypatch.setattr(connection, "vendor", vendor)
    return closed


@pytest.mark.django_db(transaction=True)
def test_a_waiting_thread_holds_no_database_connection_outside_a_transaction(monkeypatch):
    """Closes are counted, on a server database (PostgreSQL here whatever the test database is)."""
    from django.db import transaction

    closed = closes_on(monkeypatch, "postgresql")
    assert waiting.wait_for(Result("done"), time.time() + 1) == "done"
    assert closed == [False]  # closed for the wait
    with transaction.atomic():  # a caller's transaction is never cut short
        assert waiting.wait_for(Result("done"), time.time() + 1) == "done"
    assert closed == [False]


@pytest.mark.django_db(transaction=True)
def test_a_waiting_thread_keeps_its_sqlite_connection(monkeypatch):
    """SQLite's connection is a file handle no server counts: kept, so the answer does not reopen it."""
    closed = closes_on(monkeypatch, "sqlite")
    assert waiting.wait_for(Result("done"), time.time() + 1) == "done"
    assert closed == []


def test_only_the_last_result_is_read_and_in_a_request_it_is_forgotten_once_the_response_is_sent():
    """A chain's failure is stored on its last task too (Celery's ``mark_as_failure``), so the wait
    reads no parent; the two deletes of ``forget`` wait for the response to be out."""
    from django.core.signals import request_finished, request_started

    outside = Result("done")
    assert waiting.wait_for(outside, time.time() + 1) == "done"
    assert outside.options == {"follow_parents": False} and outside.forgotten == 1  # no request: at once
    request_started.send(sender=None, environ={})
    answered, failed = Result("done"), Result(error=ValueError("x"))
    assert waiting.wait_for(answered, time.time() + 1) == "done"
    with pytest.raises(ApplicationError):
        waiting.wait_for(failed, time.time() + 1)
    assert (answered.forgotten, failed.forgotten) == (0, 0)  # the response is not out yet
    request_finished.send(sender=None)
    assert (answered.forgotten, failed.forgotten) == (1, 1)
