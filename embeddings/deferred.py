"""Work done after the answer is out: bookkeeping nobody waits for (statistics rows, the
interactive lane's reports, a search's usage row) runs once the answer has left, not before, so it
never lengthens the wait of the person who asked (issue 58).

:func:`after_answer` inside a running task queues a call until the task ends (Celery's
``task_postrun``, sent after the result and the chain's next message); :func:`after_response` inside
a web request queues one until its response is sent (Django's ``request_finished``, which the WSGI
server sends when it closes the response, after its last byte). Outside a task or a request (a
service called directly: tests, scripts) each runs the call at once.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from celery.signals import task_postrun, task_prerun
from django.core.signals import request_finished, request_started
from django.dispatch import receiver

log = logging.getLogger(__name__)

_pending = threading.local()


def after_answer(fn: Callable[[], object]) -> None:
    """Run ``fn()`` once this thread's task has answered, or now outside a task. What it raises is
    logged, never raised: the answer is already out."""
    stack = getattr(_pending, "stack", None)
    if not stack:
        _run(fn)
    else:
        stack[-1].append(fn)


def _run(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - bookkeeping after the answer: logged, never the caller's failure
        log.exception("work after the answer failed")


@task_prerun.connect(dispatch_uid="embeddings.deferred.task_started")
def task_started(**_) -> None:
    """Open this task's list of calls for after the answer: one list per task on a stack, since an
    eager chain runs its next task inside the one before (tests, scripts)."""
    if getattr(_pending, "stack", None) is None:
        _pending.stack = []
    _pending.stack.append([])


@task_postrun.connect(dispatch_uid="embeddings.deferred.task_ended")
def task_ended(**_) -> None:
    """Run the calls queued while the task ran (its result is stored, its next message sent)."""
    stack = getattr(_pending, "stack", None)
    calls = stack.pop() if stack else []
    for fn in calls:
        _run(fn)


_request = threading.local()


def after_response(fn: Callable[[], object]) -> None:
    """Run ``fn()`` once this thread's web request has sent its response, or now outside a request.
    What it raises is logged, never raised: the response is already out."""
    calls = getattr(_request, "calls", None)
    if calls is None:
        _run(fn)
    else:
        calls.append(fn)


@receiver(request_started, dispatch_uid="embeddings.deferred.request_started")
def request_opened(**_) -> None:
    """Open this request's list of calls for after the response."""
    _request.calls = []


@receiver(request_finished, dispatch_uid="embeddings.deferred.request_finished")
def request_closed(**_) -> None:
    """Run the calls queued while the request ran (its response has been sent)."""
    calls, _request.calls = getattr(_request, "calls", None) or [], None
    for fn in calls:
        _run(fn)


def forget_request() -> None:
    """End this thread's open request, dropping what it queued unrun: for a request whose response
    was never closed, so Django never sent ``request_finished`` (a test client that re-raised a
    view's exception). Each test starts outside any request this way (``tests/conftest.py``)."""
    _request.calls = None
