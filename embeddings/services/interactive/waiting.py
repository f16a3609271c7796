"""What the request-level services share while someone waits for an answer: the wait for a chain's
last result until the request's deadline, with no database connection held meanwhile, the result
forgotten once the response is sent, and the HTTP status of a refused image (an upload of one image, a
query image).
"""
from __future__ import annotations

import time

from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeout
from django.db import connection

from embeddings import deferred
from embeddings.dispatch import forget
from embeddings.errors import ApplicationError
from embeddings.lane_control import hops
from embeddings.sink import RETRY_AFTER_S
from workers.errors import Reason

#: HTTP status for a refused image, by reason code: 400 bad bytes, 413 too large, 415 not an image we
#: read, 422 an input the model gave no usable vector for (NaN, infinity or zeros: ``workers.screen``;
#: the request is well formed, and sending it again gives the same vector).
REASON_STATUS = {
    Reason.EMPTY.value: 400,
    Reason.TRUNCATED.value: 400,
    Reason.CORRUPT.value: 400,
    Reason.TOO_LARGE.value: 413,
    Reason.TOO_MANY_PIXELS.value: 413,
    Reason.NOT_AN_IMAGE.value: 415,
    Reason.UNSUPPORTED_FORMAT.value: 415,
    Reason.DECODE_TIMEOUT.value: 400,
    Reason.INVALID_BASE64.value: 400,
    Reason.NON_FINITE_EMBEDDING.value: 422,
    Reason.ZERO_EMBEDDING.value: 422,
    Reason.TEXT_TOWER_MISSING.value: 422,
}


def release_database() -> None:
    """Close this thread's database connection before a long wait (outside a transaction): the
    web's threads outnumber what PostgreSQL should hold open (``WEB_THREADS``,
    ``project/processes.py``), and a waiting request needs no connection; the next query after the
    wait opens one again (a few ms). SQLite's connection is kept: it is a file handle in this
    process, which no server counts, and opening it again (its pragmas included) would cost the
    answer about 1.5 ms."""

    if connection.vendor != "sqlite" and not connection.in_atomic_block:
        connection.close()


def wait_for(result, deadline_ts: float, *, timed_out=None):
    """The chain's result, or ``timed_out`` when the deadline passes first. The thread's database
    connection is released for the wait (:func:`release_database`); the result is forgotten once
    the response is sent, however the wait ends (``dispatch.forget`` through
    ``deferred.after_response``: two deletes nobody waits for).

    Only the last task's result is read: a chain's earlier task that fails stores its failure on
    every later task of the chain too (Celery's ``Backend.mark_as_failure``; the tasks opening a
    chain store their errors even with ``ignore_result``), so reading its parents first
    (``follow_parents``) would add a Redis read per parent to every answer and find nothing new.
    An expired message of the chain is the deadline passing, which this wait sees itself.

    Raises:
        ApplicationError: ``worker_error`` (503, ``Retry-After``) if a task failed.
    """
    release_database()
    sent = time.time()
    try:
        answer = result.get(timeout=max(0.01, deadline_ts - time.time()), propagate=True, follow_parents=False)
        hops.waited(result, sent=sent, got=time.time())
        return answer
    except CeleryTimeout:
        return timed_out
    except Exception as e:  # a task raised or was revoked: systemic, not the caller's fault...
        if isinstance(e, TaskRevokedError) and "expired" in str(e):  # ...unless its message outlived the deadline
            return timed_out
        raise ApplicationError(f"the embedding service failed: {type(e).__name__}: {e}", code="worker_error",
                               status=503, headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    finally:
        deferred.after_response(lambda: forget(result))
