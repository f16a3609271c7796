"""Redis writes that no request waits for, off the path of the request that makes them.

Lane control's bookkeeping (an interactive task's in-flight entry, a running forward pass, a web
request's pending record) and the hop records are each one Redis command that only *other*
processes read, later. Sent inline, each is a round trip on the path of the very request it
describes: four to six per upload (docs/benchmarks-lanes.md). :func:`write` hands the command to
this process's writer thread instead, which sends everything waiting in one pipeline, in the order
it was handed over, so an entry's HSET always lands before its HDEL.

What that costs the readers: an entry lands a pipeline round trip later (well under a millisecond
on an idle Redis), which admission (a prediction) and a bulk worker deciding whether to yield
(between passes of tens of ms or more) do not notice. What a process's death costs: the commands
it had not sent yet; every entry written here is one the readers already expire when stale
(``lane_control.admission``).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

from embeddings.lane_control.keys import redis_client

log = logging.getLogger(__name__)

#: A write: given a non-transactional pipeline, queue one or more commands on it.
Write = Callable[[object], None]


class Writer:
    """One writer thread per process, started on the first :meth:`put`; a forked child starts its own
    (``os.register_at_fork``: the parent's thread does not exist there, its queue is the parent's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._handed = self._sent = 0

    def put(self, write: Write) -> None:
        """Queue ``write`` for the writer thread; never blocks on Redis, never raises."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
        with self._done:
            self._handed += 1
        self._queue.put(write)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every write handed over so far was sent (or failed and was logged), at most
        ``timeout_s``; True when they all were."""
        with self._done:
            target = self._handed
            return self._done.wait_for(lambda: self._sent >= target, timeout=timeout_s)

    def _run(self) -> None:
        pending = self._queue
        while True:
            writes = [pending.get()]
            while True:  # whatever else is waiting goes in the same round trip
                try:
                    writes.append(pending.get_nowait())
                except queue.Empty:
                    break
            self._send(writes)
            with self._done:
                self._sent += len(writes)
                self._done.notify_all()

    def _send(self, writes: list[Write]) -> None:
        try:
            with redis_client().pipeline(transaction=False) as pipe:
                for write in writes:
                    write(pipe)
                pipe.execute()
        except Exception as e:  # noqa: BLE001 - bookkeeping for other processes: never a request's failure
            log.warning("%s: %d Redis writes lost: %s", self.name, len(writes), e)


#: Lane control's bookkeeping (``reports``, ``admission``).
lane_writes = Writer("lane-writes")


def write(fn: Write) -> None:
    """Send ``fn(pipeline)``'s commands from the writer thread (:data:`lane_writes`)."""
    lane_writes.put(fn)


def flush(timeout_s: float = 5.0) -> bool:
    """Wait for :data:`lane_writes` (:meth:`Writer.flush`)."""
    return lane_writes.flush(timeout_s)
