"""A worker process's failed forward passes in a row, and leaving the pool when they pile up.

A model that produces nothing (a wedged GPU, a poisoned checkpoint giving NaN) would otherwise keep
its worker taking messages and failing every one of them, while its pod looks alive. So every pass
of the model reports here (:func:`pass_succeeded`, :func:`pass_failed`): the dynamic batcher's
passes (``embeddings.runtime``), the bulk chunks (``services.queues.bulk``) and the canaries
(``services.readiness``). After ``WORKER_MAX_BATCH_FAILURES`` failures in a row (0: never) the
worker stops: SIGTERM to the Celery main process (the parent, from a prefork child), whose soft
shutdown hands back what it holds, and its supervisor (Kubernetes, docker-compose's ``restart``)
starts a fresh one. A process that is not a Celery worker (the web, tests calling services) only logs.

A pass counts as failed when the model raised, or when it gave vectors and every one was refused
(``workers.screen``: NaN, infinity, zeros). One bad image among good ones is that image's failure,
not the model's.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import threading

from billiard.process import current_process
from django.conf import settings

from workers import screen

log = logging.getLogger(__name__)


class FailureStreak:
    """Failed passes in a row of one process; calls ``leave(reason)`` once when ``limit`` is reached.

    Args:
        limit: failures in a row that make the process leave (0: never).
        leave: called with the last failure's reason, at most once.
    """

    def __init__(self, limit: int, leave) -> None:
        self.limit, self._leave = limit, leave
        self._lock = threading.Lock()
        self.failures = 0
        self.left = False

    def passed(self) -> None:
        with self._lock:
            self.failures = 0

    def failed(self, reason: str) -> bool:
        """Count one failure; returns whether this one made the process leave."""
        with self._lock:
            self.failures += 1
            leave = bool(self.limit) and self.failures >= self.limit and not self.left
            self.left = self.left or leave
            n = self.failures
        log.warning("a forward pass failed (%d in a row, limit %s): %s", n, self.limit or "none", reason)
        if leave:
            self._leave(f"{n} forward passes failed in a row; the last: {reason}")
        return leave


@functools.cache
def _state() -> dict:
    """This process's role: ``{"worker": bool}``, set by :func:`enable` in Celery worker processes."""
    return {"worker": False}


def enable() -> None:
    """Mark this process as a Celery worker process (its main process, or a prefork child): from now
    on, a streak of failures stops the worker (``embeddings.worker_boot`` calls it)."""
    _state()["worker"] = True


def leave_pool(reason: str) -> None:
    """Stop this Celery worker for a restart: SIGTERM to its main process (this process, or the
    parent of a prefork child). Outside a worker, only logs."""
    if not _state()["worker"]:
        log.critical("not leaving (not a Celery worker): %s", reason)
        return
    main = os.getpid() if current_process().name == "MainProcess" else os.getppid()
    log.critical("leaving the pool, the worker stops for a restart: %s", reason)
    os.kill(main, signal.SIGTERM)


@functools.cache
def streak() -> FailureStreak:
    """This process's :class:`FailureStreak` (``WORKER_MAX_BATCH_FAILURES``, leaving by :func:`leave_pool`)."""
    return FailureStreak(settings.WORKER_MAX_BATCH_FAILURES, leave_pool)


def pass_succeeded() -> None:
    """A forward pass gave at least one usable vector."""
    streak().passed()


def pass_failed(reason: str) -> None:
    """A forward pass raised, or every vector it gave was refused (``reason``: what happened)."""
    streak().failed(reason)


def judge_vectors(vectors) -> None:
    """Report a pass by its output ``(N, D)``: failed when N > 0 and every row is refused by
    ``workers.screen``, else succeeded (N = 0: nothing reported)."""
    faults = screen.faults(vectors)
    if not faults:
        return
    if all(f is not None for f in faults):
        pass_failed(f"every vector of the pass refused ({faults[0].value})")
    else:
        pass_succeeded()
