"""Dynamic batcher for the interactive lane, in the style of Triton's dynamic batcher.

Task threads ``submit`` their prepared images and block on a future; one model thread forms
batches: it takes the first waiting request, then keeps adding requests that arrive within
``max_queue_delay_ms`` of that first one, up to ``max_batch_size`` images, and runs one forward pass.
A lone request therefore never waits longer than the window, and a burst of requests shares one
pass. A request whose deadline has passed when its batch is formed is not computed: its future
raises :class:`Expired`.

With ``wait_for="announced"`` (the interactive worker's) a batch waits only for company that is on
its way: a task thread announces its request when it starts decoding (:meth:`DynamicBatcher.coming`),
and the forming batch stops waiting as soon as no announced request is left to arrive, so a lone
request on an idle lane goes to the model at once instead of sitting out the window for company
nobody is preparing, while a burst still shares its pass. The window stays the bound.

Why not celery-batches: its ``flush_interval`` is a repeating timer, not a per-request bound, and it
needs prefetch × concurrency > ``flush_every`` (../shared/NOTES.md).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)


class Expired(Exception):
    """The request's deadline passed before it reached the model."""


@dataclasses.dataclass
class _Request:
    pixels: torch.Tensor  # (n, 3, S, S)
    deadline: float | None  # time.time() seconds
    arrived: float  # time.perf_counter()
    future: concurrent.futures.Future


class Announcement:
    """A request a task thread has announced (:meth:`DynamicBatcher.coming`): open until it is
    submitted or withdrawn."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = True


#: Queued to wake the forming batch when an announced request is withdrawn unsubmitted.
_WAKE = object()

#: How a batch waits for company: the whole window, or only while announced requests are on their way.
WAIT_POLICIES = ("window", "announced")


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """One formed batch: ``size`` images from ``requests`` requests; ``queue_delay_ms`` is how long
    its first request waited; ``service_ms`` the forward pass; ``expired`` requests dropped."""

    size: int
    requests: int
    queue_delay_ms: float
    service_ms: float
    expired: int


class DynamicBatcher:
    """Merges concurrent requests into forward passes with a bounded queue delay.

    Args:
        run_batch: embeds ``(N, 3, S, S)`` pixels → ``(N, D) float32``; called on the model thread only.
        max_batch_size: most images per forward pass (a larger single request runs alone, split).
        max_queue_delay_ms: longest time the first request of a batch waits for company (ms).
        history: how many :class:`BatchRecord` to keep for metrics.
        on_pass: called on the model thread as ``on_pass(size, started)`` right before each forward
            pass (``size`` images, ``started`` Unix s) and ``on_pass(0, ended)`` right after it, so
            that admission control can count the time a running pass has left; must not raise
            (what it raises is logged and ignored).
        wait_for: ``"window"``: a batch waits for company until the window ends (or it is full);
            ``"announced"``: only while requests announced with :meth:`coming` are still to be
            submitted, and never past the window.

    Raises:
        ValueError: ``max_batch_size`` < 1, ``max_queue_delay_ms`` < 0, or ``wait_for`` not one of
            :data:`WAIT_POLICIES`.
    """

    def __init__(
        self,
        run_batch: Callable[[torch.Tensor], np.ndarray],
        *,
        max_batch_size: int,
        max_queue_delay_ms: float,
        history: int = 10_000,
        on_pass: Callable[[int, float], None] | None = None,
        wait_for: str = "window",
    ) -> None:
        if max_batch_size < 1 or max_queue_delay_ms < 0:
            raise ValueError("max_batch_size must be >= 1 and max_queue_delay_ms >= 0")
        if wait_for not in WAIT_POLICIES:
            raise ValueError(f"wait_for must be one of {WAIT_POLICIES}, not {wait_for!r}")
        self.wait_for = wait_for
        # announced requests not yet submitted; changed with a submit's queueing under one lock, so
        # the forming batch never sees a request neither announced nor queued
        self._announced = 0
        self._lock = threading.Lock()
        self._run_batch = run_batch
        self._on_pass = on_pass
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_ms / 1000
        self._queue: queue.Queue = queue.Queue()  # _Request, _WAKE, or None: close
        self._carry: _Request | None = None
        self.records: collections.deque[BatchRecord] = collections.deque(maxlen=history)
        self._thread = threading.Thread(target=self._loop, name="model-batcher", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def coming(self):
        """Announce a request this thread is preparing (decoding) and will submit: yields its
        :class:`Announcement`, to pass to :meth:`submit`. Leaving the block without submitting
        withdraws it, and a batch waiting for it stops waiting."""
        announcement = Announcement()
        with self._lock:
            self._announced += 1
        try:
            yield announcement
        finally:
            with self._lock:
                withdrawn = announcement.open
                if withdrawn:
                    announcement.open = False
                    self._announced -= 1
            if withdrawn:
                self._queue.put(_WAKE)

    def submit(self, pixels: torch.Tensor, *, deadline: float | None = None,
               announced: Announcement | None = None) -> concurrent.futures.Future:
        """Queue ``(n, 3, S, S)`` pixels (``announced``: the request's :meth:`coming`); the future
        gives ``(n, D) float32`` or raises :class:`Expired`."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if announced is not None and announced.open:
                announced.open = False
                self._announced -= 1
            self._queue.put(_Request(pixels, deadline, time.perf_counter(), fut))
        return fut

    def embed(self, pixels: torch.Tensor, *, deadline: float | None = None,
              announced: Announcement | None = None) -> np.ndarray:
        """``submit`` and wait. Raises :class:`Expired`, or what the model raised."""
        return self.submit(pixels, deadline=deadline, announced=announced).result()

    def close(self) -> None:
        """Stop the model thread after the requests already queued."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    @property
    def backlog(self) -> int:
        """Requests waiting for the model thread (approximate)."""
        return self._queue.qsize()

    def _next(self, timeout: float | None) -> _Request | None:
        if self._carry is not None:
            req, self._carry = self._carry, None
            return req
        return self._queue.get(timeout=timeout) if timeout is None or timeout > 0 else self._queue.get_nowait()

    def _nobody_coming(self) -> bool:
        """Under ``wait_for="announced"``: no announced request left to submit and none queued."""
        with self._lock:
            return self._announced == 0 and self._queue.empty()

    def _loop(self) -> None:
        while True:
            first = self._next(None)
            if first is _WAKE:
                continue
            if first is None:
                return
            batch, size = [first], len(first.pixels)
            window_end = first.arrived + self.max_queue_delay_s
            while size < self.max_batch_size:
                if self.wait_for == "announced" and self._nobody_coming():
                    break
                try:
                    req = self._next(window_end - time.perf_counter())
                except queue.Empty:
                    break
                if req is _WAKE:
                    continue
                if req is None:
                    self._queue.put(None)
                    break
                if size + len(req.pixels) > self.max_batch_size:
                    self._carry = req  # starts the next batch; keeps arrival order
                    break
                batch.append(req)
                size += len(req.pixels)
            self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        now_wall, now = time.time(), time.perf_counter()
        live = []
        for req in batch:
            if req.deadline is not None and now_wall > req.deadline:
                req.future.set_exception(Expired(f"deadline passed {now_wall - req.deadline:.3f} s before the model"))
            else:
                live.append(req)
        service_ms = 0.0
        if live:
            self._notify(sum(len(r.pixels) for r in live), time.time())
            t0 = time.perf_counter()
            try:
                pixels = torch.cat([r.pixels for r in live])
                out = np.concatenate(
                    [self._run_batch(pixels[i : i + self.max_batch_size]) for i in range(0, len(pixels), self.max_batch_size)]
                )
            except Exception as e:  # the model failed: every caller of this batch sees it
                for r in live:
                    r.future.set_exception(e)
            else:
                start = 0
                for r in live:
                    r.future.set_result(out[start : start + len(r.pixels)])
                    start += len(r.pixels)
            service_ms = (time.perf_counter() - t0) * 1000
            self._notify(0, time.time())
        self.records.append(
            BatchRecord(
                size=sum(len(r.pixels) for r in live),
                requests=len(live),
                queue_delay_ms=(now - batch[0].arrived) * 1000,
                service_ms=service_ms,
                expired=len(batch) - len(live),
            )
        )

    def _notify(self, size: int, at: float) -> None:
        if self._on_pass is None:
            return
        try:
            self._on_pass(size, at)
        except Exception:  # a metrics hook never stops the model thread
            log.exception("on_pass hook failed")
