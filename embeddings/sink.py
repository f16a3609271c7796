"""Where vector-store work runs: the write target, chosen from ``VECTOR_STORE``.

- ``WriteTarget.DIRECT`` (``VECTOR_STORE=server``, a Qdrant server at ``QDRANT_URL``): any number
  of processes may open the store, so each does its own work: an embedding worker upserts the
  points it computed (no vector crosses Redis), the web process searches, counts and deletes
  through its own qdrant-client connection. No ``vectors`` worker sits on any path.
- ``WriteTarget.VECTORS_WORKER`` (``edge``, the default, or ``local``): the embedded folder admits
  one process (qdrant/qdrant-client#1018, the edge WAL lock), the ``vectors`` worker; every other
  process sends it the work over the ``vectors`` queue (``embeddings.dispatch``) and, where
  someone waits, waits for the answer (:func:`vectors_call`).
- ``WriteTarget.INTERACTIVE_WORKER`` (an embedded store with ``STORE_OWNER=interactive``): the
  interactive worker owns the folder and consumes the ``vectors`` queue too. Everything goes as for
  ``VECTORS_WORKER``, except an interactive upload or query: it is embedded, written and searched in
  one task on the interactive queue (``embed_index_interactive``, ``embed_search``), since the
  process that computes its vector is the one that holds the store.

The same task body runs either way (``embeddings.tasks.<name>``, looked up by name): on the vectors
worker, or here, in the calling process.
"""
from __future__ import annotations

import enum
import time

import httpx
import redis
from django.conf import settings
from kombu.exceptions import OperationalError
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from embeddings import dispatch, lane_control
from embeddings.errors import ApplicationError

#: Seconds a client should wait before trying again after a 503 from here: long enough for a
#: process manager to start a worker again, or for a restarted Redis to be reconnected to.
RETRY_AFTER_S = 5


def broker_refusal(exc: BaseException | None) -> ApplicationError | None:
    """The API's 503 (``Retry-After``) for a message or write the broker's Redis refused, or None
    when ``exc`` is something else:

    - ``broker_full``: Redis is at its ``maxmemory`` under ``noeviction`` (the policy Celery asks
      for: it refuses writes rather than drop queued messages); redis-py's ``OutOfMemoryError``,
      raised as is or as the cause of kombu's ``OperationalError``. Workers free memory as they
      take messages off the queues.
    - ``broker_unavailable``: kombu's ``OperationalError`` for anything else (Redis cannot be reached).
    """

    seen, e = [], exc
    while e is not None and e not in seen:  # the exception and what it was raised from
        seen.append(e)
        e = e.__cause__ or e.__context__
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if any(isinstance(x, redis.exceptions.OutOfMemoryError) for x in seen):
        return ApplicationError("the message broker is full (Redis is at its maxmemory and refuses writes): "
                                "nothing was queued", code="broker_full", status=503, headers=headers)
    if isinstance(exc, OperationalError):
        return ApplicationError(f"the message broker cannot be reached: {exc}", code="broker_unavailable",
                                status=503, headers=headers)
    return None


def vectors_call(task, *args, timeout_s: float | None = None):
    """Run ``task(*args)`` on the ``vectors`` queue (the vector store's owner) at interactive
    priority and return its result, forgotten once read (kept until ``timeout_s`` from now at most
    if never read: ``dispatch.read_by``).

    Args:
        task: the name of a task of ``embeddings.tasks`` (sent through ``embeddings.dispatch``),
            or a Celery task or signature.
        timeout_s: how long to wait (s); default ``VECTORS_CALL_TIMEOUT_S``.

    Raises:
        ApplicationError: ``broker_full`` / ``broker_unavailable`` (503) when the message cannot be
            sent (:func:`broker_refusal`);
            ``vectors_unavailable`` (503) when the wait failed: no answer within ``timeout_s`` (the
            vectors worker is down or restarting) or the result connection broke (Redis restarted);
            ``worker_error`` (503) when the task itself raised. Each carries ``Retry-After``.
    """
    timeout_s = settings.VECTORS_CALL_TIMEOUT_S if timeout_s is None else timeout_s
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    options = {**dispatch.vectors_options(interactive=True), **dispatch.read_by(time.time() + timeout_s)}
    try:
        result = dispatch.send(task, args, **options) if isinstance(task, str) else task.apply_async(args=args, **options)
    except OperationalError as e:
        raise broker_refusal(e) from e
    try:
        value = result.get(timeout=timeout_s, propagate=False)  # a task's own failure is not raised here...
        failed = result.failed()
    except Exception as e:  # ...so whatever is raised is the wait: timeout, broken connection, retries spent
        raise ApplicationError(f"the vector store did not answer within {timeout_s:g} s ({type(e).__name__}: {e})",
                               code="vectors_unavailable", status=503, headers=headers) from e
    finally:
        dispatch.forget(result)
    if failed:  # the task raised: systemic, not the caller's fault
        raise ApplicationError(f"the vector store failed: {type(value).__name__}: {value}", code="worker_error",
                               status=503, headers=headers)
    return value


class WriteTarget(enum.Enum):
    """Who writes and queries the vector store (see the module docstring)."""

    DIRECT = "direct"
    VECTORS_WORKER = "vectors_worker"
    INTERACTIVE_WORKER = "interactive_worker"


def write_target() -> WriteTarget:
    """``DIRECT`` for a Qdrant server (``VECTOR_STORE=server``): only a server may be opened by
    several processes at once; else the embedded store's owner, ``STORE_OWNER``:
    ``INTERACTIVE_WORKER`` or ``VECTORS_WORKER``."""
    if settings.VECTOR_STORE == "server":
        return WriteTarget.DIRECT
    return WriteTarget.INTERACTIVE_WORKER if lane_control.owner_runs_threads() else WriteTarget.VECTORS_WORKER


def is_direct() -> bool:
    """True when this process does its own vector-store work (:data:`WriteTarget.DIRECT`)."""
    return write_target() is WriteTarget.DIRECT


def answers_in_one_task() -> bool:
    """True when an interactive upload or query is embedded, written and searched by one task of the
    interactive worker: it owns the embedded store (:data:`WriteTarget.INTERACTIVE_WORKER`)."""
    return write_target() is WriteTarget.INTERACTIVE_WORKER


def store_call(name: str, *args, timeout_s: float | None = None):
    """Run store task ``embeddings.tasks.<name>(*args)`` and return its result: here against the
    server (``DIRECT``), else on the vectors worker, waiting at most ``timeout_s``.

    Raises:
        ApplicationError: (vectors worker only) ``broker_unavailable`` / ``vectors_unavailable`` /
            ``worker_error`` (503, ``Retry-After``): see :func:`vectors_call`.
            (direct) ``vectors_unavailable`` (503, ``Retry-After``): the server cannot be reached
            or answered with a server error.
    """
    if is_direct():
        return _here(name, *args)
    return vectors_call(name, *args, timeout_s=timeout_s)


def store_send(name: str, *args, interactive: bool) -> None:
    """Have store task ``embeddings.tasks.<name>(*args)`` done without waiting for its result: here
    and now (``DIRECT``), else queued for the vectors worker at interactive or background priority,
    its result not stored (nobody reads it)."""
    if is_direct():
        _here(name, *args)
    else:
        dispatch.send(name, args, **dispatch.vectors_options(interactive=interactive), **dispatch.UNREAD)


def _here(name: str, *args):
    """Run store task ``name`` in this process; a server that cannot be reached (connection,
    timeout, 5xx) is the API's 503 ``vectors_unavailable``, as when the vectors worker is down."""

    try:
        return dispatch.run_here(name, *args)
    except (ConnectionError, TimeoutError, httpx.TransportError, ResponseHandlingException, UnexpectedResponse) as e:
        if isinstance(e, UnexpectedResponse) and (e.status_code or 0) < 500:
            raise
        raise ApplicationError(f"the vector store cannot be reached: {type(e).__name__}: {e}",
                               code="vectors_unavailable", status=503,
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from e
