"""Turns at an embedded store inside the process that owns it, when that process runs its tasks on
several threads: the interactive worker with ``STORE_OWNER=interactive`` (``project.processes``).

The solo vectors worker runs one task at a time, so its tasks never meet at the store: an upsert,
the read of the points it merges with, a search, each task's sequence of store calls is never cut
by another task's. Where the interactive worker owns the store, its vectors-queue tasks (bulk
writes, point searches, deletes, scans) and its interactive tasks' writes and searches run on
different threads of one process; :class:`StoreTurn` gives them the same guarantee, one task's
store work at a time, and lets interactive work go first:

- an interactive holder (an upload's write and search, a query's search, an interactive-priority
  message on the vectors queue) is next as soon as the current holder lets go; background work
  (bulk writes, scans, deletes) waits while any interactive work does;
- a long background holder (a bulk chunk's write) calls :meth:`StoreTurn.let_interactive_through`
  between two slices: it hands the turn to the interactive work waiting and takes it back after,
  so an interactive request never waits longer than one slice (``VECTORS_WRITE_SLICE`` points)
  behind a bulk write: what the vectors worker's look at its queue between slices does for
  interactive messages (``services.queues.vectors.chunk_index``).

The turns are re-entrant per thread: a task that holds its turn may call code that takes it again.
Vectors-queue tasks take theirs around the whole task (:func:`task_turn_start`, ``task_prerun`` →
``task_postrun``), only in a process where :func:`owner_runs_threads` holds.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator

from celery.signals import task_postrun, task_prerun
from django.conf import settings

from project import lanes


class StoreTurn:
    """One holder of the store at a time, interactive holders first (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: int | None = None  # thread ident
        self._depth = 0
        self._interactive_waiting = 0

    @contextlib.contextmanager
    def hold(self, *, interactive: bool) -> Iterator[None]:
        """Hold the turn while the block runs; ``interactive``: go before every background holder
        waiting. Re-entrant for the thread that holds it."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                self._depth += 1
            else:
                self._wait_for_turn(interactive)
                self._holder, self._depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._holder = None
                    self._cond.notify_all()

    def _wait_for_turn(self, interactive: bool) -> None:
        """Wait (the condition held) until the turn is free, and, for background work, until no
        interactive work waits for it."""
        if interactive:
            self._interactive_waiting += 1
            try:
                while self._holder is not None:
                    self._cond.wait()
            finally:
                self._interactive_waiting -= 1
        else:
            while self._holder is not None or self._interactive_waiting:
                self._cond.wait()

    def interactive_waiting(self) -> int:
        """Interactive holders waiting for the turn now."""
        return self._interactive_waiting

    def let_interactive_through(self) -> float:
        """From the holder, between two pieces of its work: while interactive work waits for the
        turn, hand it over, then take it back once none waits (its depth as it was). Returns the
        seconds it was away (0.0 when nobody waited, or when the calling thread does not hold it)."""
        me = threading.get_ident()
        with self._cond:
            if self._holder != me or not self._interactive_waiting:
                return 0.0
            depth, t0 = self._depth, time.perf_counter()
            self._holder, self._depth = None, 0
            self._cond.notify_all()
            self._wait_for_turn(False)
            self._holder, self._depth = me, depth
        return time.perf_counter() - t0


@functools.cache
def store_turn() -> StoreTurn:
    """This process's :class:`StoreTurn`."""
    return StoreTurn()


def owner_runs_threads() -> bool:
    """True in a deployment whose interactive worker owns the embedded store
    (``STORE_OWNER=interactive``, not a server): its tasks take turns at the store. Elsewhere the
    owner is the solo vectors worker (nothing to take turns with), or every process opens a server.
    The one test of the setting in the app (``sink.write_target``, the boot refusal and ``/readyz``
    ask it); the command lines' own is ``project.processes.interactive_owns_store``."""
    return settings.STORE_OWNER == "interactive" and settings.VECTOR_STORE != "server"


@contextlib.contextmanager
def interactive_turn() -> Iterator[None]:
    """An interactive task's store work (an upload's write and search, a query's search) in the
    interactive worker that owns the store; nothing to wait for elsewhere."""
    if not owner_runs_threads():
        yield
        return
    with store_turn().hold(interactive=True):
        yield


_task_turns = threading.local()


@task_prerun.connect(dispatch_uid="embeddings.lane_control.store_turns.task_turn_start")
def task_turn_start(task=None, **_) -> None:
    """A vectors-queue task takes its turn before it runs (interactive priority: an interactive
    turn), where :func:`owner_runs_threads`; eager runs take none."""
    info = getattr(getattr(task, "request", None), "delivery_info", None) or {}
    if info.get("routing_key") != lanes.VECTORS or not owner_runs_threads():
        return
    turn = contextlib.ExitStack()
    turn.enter_context(store_turn().hold(interactive=info.get("priority") == lanes.PRIORITY_INTERACTIVE))
    _task_turns.stack = turn


@task_postrun.connect(dispatch_uid="embeddings.lane_control.store_turns.task_turn_end")
def task_turn_end(**_) -> None:
    """Give the turn back once the task has run (``task_postrun`` comes after success, failure or a
    retry alike)."""
    turn = getattr(_task_turns, "stack", None)
    if turn is not None:
        _task_turns.stack = None
        turn.close()
