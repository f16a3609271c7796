"""Web-side calls to the vectors worker that wait for an answer (stats, delete), with every way the
wait can fail mapped to the API's error shape: a 503 with a stable code and ``Retry-After``, never a
500 from an unhandled Celery, kombu or Redis exception.
"""
from __future__ import annotations

from django.conf import settings
from kombu.exceptions import OperationalError

from embeddings.services.errors import ApplicationError

#: Seconds a client should wait before trying again after a 503 from here: long enough for a
#: process manager to start a worker again, or for a restarted Redis to be reconnected to.
RETRY_AFTER_S = 5


def vectors_call(task, *args, timeout_s: float | None = None):
    """Run ``task(*args)`` on the ``vectors`` queue (the vector store's owner) at interactive
    priority and return its result.

    Args:
        task: the name of a task of ``embeddings.tasks`` (sent through ``embeddings.dispatch``),
            or a Celery task or signature.
        timeout_s: how long to wait (s); default ``VECTORS_CALL_TIMEOUT_S``.

    Raises:
        ApplicationError: ``broker_unavailable`` (503) when the message cannot be sent;
            ``vectors_unavailable`` (503) when the wait failed: no answer within ``timeout_s`` (the
            vectors worker is down or restarting) or the result connection broke (Redis restarted);
            ``worker_error`` (503) when the task itself raised. Each carries ``Retry-After``.
    """
    from embeddings import dispatch

    timeout_s = settings.VECTORS_CALL_TIMEOUT_S if timeout_s is None else timeout_s
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    options = dispatch.vectors_options(interactive=True)
    try:
        result = dispatch.send(task, args, **options) if isinstance(task, str) else task.apply_async(args=args, **options)
    except OperationalError as e:
        raise ApplicationError(f"the message broker cannot be reached: {e}", code="broker_unavailable",
                               status=503, headers=headers) from e
    try:
        value = result.get(timeout=timeout_s, propagate=False)  # a task's own failure is not raised here...
        failed = result.failed()
    except Exception as e:  # ...so whatever is raised is the wait: timeout, broken connection, retries spent
        raise ApplicationError(f"the vector store did not answer within {timeout_s:g} s ({type(e).__name__}: {e})",
                               code="vectors_unavailable", status=503, headers=headers) from e
    if failed:  # the task raised: systemic, not the caller's fault
        raise ApplicationError(f"the vector store failed: {type(value).__name__}: {value}", code="worker_error",
                               status=503, headers=headers)
    return value
