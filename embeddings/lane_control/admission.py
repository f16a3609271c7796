"""Admission, the web side of the interactive lane: admit a request, or refuse it with 429.

A request is refused at once, with ``Retry-After``, when the predicted wait for its answer plus a
margin is longer than its deadline: such work would only expire in the queue (the batcher drops it
unseen) after costing a database row, a blob and a queue slot, and after pushing every later request
further back. The prediction (``queueing.wait_model.decide``) is made from what Redis holds, read in
one round trip per request (:func:`interactive_load`): the interactive queue's lists, the images in
flight, the running forward passes, the live workers' entries, the recent answers, the admitted
requests not answered yet and the lone requests' overheads (:mod:`.keys`). The workers write their
side (:mod:`.reports`); bulk work is never refused, it yields (:mod:`.bulk_yield`).

With no worker measurement yet every request is admitted: there is nothing to predict with. A Redis
error admits too (the enqueue that follows reports the outage). Eager Celery (tests) queues nothing,
so admission is skipped there.

What a refusal says (``extra.wait_ahead_s``, s) is about the wait of a request admitted at that
moment: first ``wait_model.decide``'s estimate (``extra.first_wait_ahead_s``; where it came from in
``extra.wait_ahead_from``: ``edge``, ``drain``, ``alone`` or ``parks``), then what earlier refusals
of the same deadline band teach (``queueing.wait_ahead``; ``extra.wait_ahead_samples`` of them, 0:
the first estimate as is). Every refusal is recorded (``keys.REFUSALS_KEY``) and labelled with the
waits of the requests admitted around it once they are answered. ``Retry-After`` is that wait plus
its margin rounded **up** to whole seconds (RFC 9110 delay-seconds, ≥ 1): a client never retries
too early.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid

from django.conf import settings

from embeddings import deferred
from embeddings.errors import ApplicationError
from embeddings.lane_control import background
from embeddings.lane_control.keys import (
    ANSWERS_KEPT,
    ANSWERS_KEY,
    ANSWERS_READ,
    BULK_ACTIVITY_KEY,
    BULK_RUNS_KEY,
    BULK_RUNS_READ,
    INFLIGHT_KEY,
    LABEL_ANSWERS_READ,
    LONE_BULK_KEY,
    LONE_KEPT,
    LONE_KEY,
    PASSES_KEY,
    PENDING_KEY,
    REFUSALS_KEPT,
    REFUSALS_KEY,
    WORKERS_KEY,
    bulk_stale_after_s,
    queue_keys,
    redis_client,
    stale_after_s,
)
from project import lanes
from project.celery import app
from queueing import wait_ahead
from queueing.wait_model import (
    Decision,
    LaneLoad,
    bulk_overlap_s,
    decide,
    fit_regime,
    lane_load,
    parse_bulk_activity,
    running_passes,
)

log = logging.getLogger(__name__)


def interactive_load(client=None) -> LaneLoad:
    """Read the interactive lane's :class:`LaneLoad` from Redis (one round trip).

    Raises:
        redis.RedisError: Redis cannot be reached.
    """
    client = client or redis_client()
    keys = queue_keys(lanes.INTERACTIVE)
    with client.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.llen(k)
        pipe.hgetall(INFLIGHT_KEY)
        pipe.hgetall(WORKERS_KEY)
        pipe.lrange(ANSWERS_KEY, -ANSWERS_READ, -1)
        pipe.hgetall(PENDING_KEY)
        pipe.hgetall(PASSES_KEY)
        pipe.lrange(LONE_KEY, 0, -1)
        pipe.lrange(LONE_BULK_KEY, 0, -1)
        pipe.hgetall(BULK_ACTIVITY_KEY)
        *lengths, inflight, workers, answers, pending, passes, lone, lone_bulk, bulk = pipe.execute()
    now, stale = time.time(), stale_after_s()
    inflight_images, dead = 0, []
    for task_id, value in inflight.items():
        images, started = value.split()
        if now - float(started) > stale:
            dead.append(task_id)
        else:
            inflight_images += int(images)
    if dead:
        client.hdel(INFLIGHT_KEY, *dead)
    gone = [token for token, raw in pending.items() if now - json.loads(raw)["admitted"] > stale]
    if gone:  # admitted by a web process that died before answering
        client.hdel(PENDING_KEY, *gone)
    running, dead_passes = running_passes(passes, now=now, stale_s=stale)
    if dead_passes:  # a worker that died mid-pass
        client.hdel(PASSES_KEY, *dead_passes)
    computing, dead_chunks, yielding = parse_bulk_activity(bulk, now=now, stale_s=bulk_stale_after_s())
    if dead_chunks:  # a bulk process killed while computing
        client.hdel(BULK_ACTIVITY_KEY, *dead_chunks)
    return lane_load(queued_messages=sum(lengths), inflight_images=inflight_images, workers=workers,
                     answers=answers, now=now, pending=[v for k, v in pending.items() if k not in gone],
                     passes=running, lone=lone_bulk if computing else lone, beside_bulk_now=bool(computing),
                     bulk_yields=yielding, lone_quiet=lone, margin_quantile=settings.ADMISSION_MARGIN_QUANTILE)


def interactive_admit(*, deadline_s: float, images: int = 1) -> Decision:
    """Admit a request of ``images`` with ``deadline_s`` to the interactive lane, or refuse it.

    Returns:
        The :class:`Decision` (admitted; ``admitted_at`` set unless admission is off or eager, and
        then also recorded as pending in :data:`PENDING_KEY` until :func:`interactive_answered`).

    Raises:
        ApplicationError: ``overloaded`` (429) with a ``Retry-After`` header (s) when the predicted
            wait plus margin exceeds the deadline; ``extra`` carries the numbers the decision used.
            ``request_exceeds_deadline`` (413, no ``Retry-After``) when the request alone, in an
            empty lane, is predicted to take longer than its deadline.
    """

    if app.conf.task_always_eager or not settings.ADMISSION_CONTROL:
        return Decision(True, None)
    try:
        load = interactive_load()
    except Exception as e:  # Redis down: admit; the enqueue that follows reports the outage
        log.warning("admission skipped, Redis unreadable: %s", e)
        return Decision(True, None)
    decision = decide(load, deadline_s=deadline_s, images=images, min_margin_share=settings.ADMISSION_MIN_MARGIN_SHARE,
                      max_margin_share=settings.ADMISSION_MAX_MARGIN_SHARE)
    if not decision.admitted:
        decision = _refused(decision, load, deadline_s=deadline_s)
        if decision.wait_ahead_from == "alone" and decision.wait_ahead_s > deadline_s:
            # Even in an empty lane a request of this size misses its deadline: a retry never helps
            # (clients retry a 429 by themselves), so it is refused as too large, without Retry-After.
            raise ApplicationError(
                f"a request of {images} images takes about {decision.wait_ahead_s:.2f} s even in an empty "
                f"interactive lane, longer than its deadline {deadline_s:.2f} s: send fewer per request, or "
                f"use POST /api/jobs/", code="request_exceeds_deadline", status=413,
                extra={"images": images, "alone_s": round(decision.wait_ahead_s, 3),
                       "deadline_s": round(deadline_s, 3)})
        about = {"edge": "a request admitted next waits about",
                 "drain": "the work ahead drains to what this deadline admits in about",
                 "alone": "a request of its size waits about, even in an empty lane,",
                 "parks": "bulk work yields to this lane within a pass; a request admitted then waits about",
                 }[decision.wait_ahead_from]
        if decision.wait_ahead_samples:
            about = f"learnt from {decision.wait_ahead_samples} earlier refusals, a request admitted now waits about"
        first = decision.wait_ahead_s if decision.first_wait_ahead_s is None else decision.first_wait_ahead_s
        raise ApplicationError(
            f"the interactive lane is overloaded: predicted wait {decision.predicted_wait_s:.2f} s plus a margin of "
            f"{decision.margin_s:.2f} s is longer than the deadline {deadline_s:.2f} s; {about} "
            f"{decision.wait_ahead_s:.2f} s: retry after {decision.retry_after_s} s or use POST /api/jobs/",
            code="overloaded", status=429, headers={"Retry-After": str(decision.retry_after_s)},
            extra={"predicted_wait_s": round(decision.predicted_wait_s, 3), "deadline_s": round(deadline_s, 3),
                   # Retry-After (whole seconds: wait_ahead_s + retry_margin_s, rounded up) and about
                   # what a request admitted now waits: learnt from earlier refusals' outcomes
                   # (wait_ahead_samples of them; 0: not yet) from decide's first estimate
                   # (first_wait_ahead_s: which one, wait_ahead_from; what the work queued now
                   # needs, work_ahead_wait_s)
                   "retry_after_s": decision.retry_after_s, "wait_ahead_s": round(decision.wait_ahead_s, 3),
                   "first_wait_ahead_s": round(first, 3), "wait_ahead_samples": decision.wait_ahead_samples,
                   "wait_ahead_from": decision.wait_ahead_from,
                   "work_ahead_wait_s": round(decision.work_ahead_wait_s, 3),
                   "queued_messages": load.queued_messages, "inflight_images": load.inflight_images,
                   "running_pass_images": sum(n for n, _ in load.passes),
                   "running_pass_left_s": round(max((x for _, x in load.passes), default=0.0), 3),
                   "capacity_ips": round(load.capacity_ips, 2), "workers": load.workers,
                   "overhead_s": round(load.fit.overhead_s, 3), "scale": round(load.fit.scale, 3),
                   "margin_s": round(decision.margin_s, 3), "retry_margin_s": round(decision.retry_margin_s, 3),
                   "learnt_margin_s": round(load.fit.margin_s, 3), "beside_bulk": load.beside_bulk},
        )
    decision = dataclasses.replace(decision, admitted_at=time.time(), token=uuid.uuid4().hex,
                                   admitted_beside_bulk=load.beside_bulk)
    if decision.work_s is not None:  # a lower bound of its wait for its regime's fit until it is answered
        # (fit_wait's pending), written by the writer thread: the request does not wait for it
        record = json.dumps({"admitted": round(decision.admitted_at, 4), "work_s": round(decision.work_s, 4),
                             "predicted_s": round(decision.predicted_wait_s, 4), "deadline_s": round(deadline_s, 3),
                             "bulk_at_admission": load.beside_bulk})
        token = decision.token
        background.write(lambda pipe: pipe.hset(PENDING_KEY, token, record))
    return decision


#: This process's learnt :class:`wait_ahead.WaitAheadFit` per deadline band
#: (:func:`wait_ahead.deadline_band`) and when it was fitted (Unix s); each refit every
#: :data:`wait_ahead.REFIT_S` s at most. Replaced whole, never mutated (web threads share it); at
#: most one entry per band, and deadlines are bounded (0.001 s to the default), so it stays small.
_wait_ahead_cache: dict[int, tuple[float, wait_ahead.WaitAheadFit | None]] = {}
#: The records the fits are made from, parsed (refusals, answers, pending requests' admission
#: times), and when they were read (Unix s): read at most every :data:`wait_ahead.REFIT_S` s per
#: process, whatever the number of bands refitted from them. Replaced whole, never mutated.
_wait_ahead_records: tuple[float, tuple[list, list, list]] = (-math.inf, ([], [], []))


def _refused(decision: Decision, load: LaneLoad, *, deadline_s: float) -> Decision:
    """A refusal with what its 429 says learnt (:func:`wait_ahead.learnt`) from the refusals of the
    last minute at deadlines of its band (:func:`wait_ahead.deadline_band`) and the answers around
    them, recorded in :data:`REFUSALS_KEY` (with ``deadline_s``) to label later; the refusal as
    :func:`wait_model.decide` made it when Redis fails (never raises)."""
    global _wait_ahead_cache, _wait_ahead_records
    now = time.time()
    state = wait_ahead.features(decision, load)
    band = wait_ahead.deadline_band(deadline_s)
    try:
        client = redis_client()
        fitted_at, fit = _wait_ahead_cache.get(band, (-math.inf, None))
        read_at, records = _wait_ahead_records
        refit = now - fitted_at >= wait_ahead.REFIT_S
        read = refit and now - read_at >= wait_ahead.REFIT_S  # another band's refit may have read them
        with client.pipeline(transaction=False) as pipe:
            pipe.rpush(REFUSALS_KEY, json.dumps({"t": round(now, 4), "deadline_s": round(deadline_s, 3),
                                                 **{k: round(v, 4) for k, v in state.items()}}))
            pipe.ltrim(REFUSALS_KEY, -REFUSALS_KEPT, -1)
            if read:
                pipe.lrange(REFUSALS_KEY, 0, -1)
                pipe.lrange(ANSWERS_KEY, -LABEL_ANSWERS_READ, -1)
                pipe.hvals(PENDING_KEY)
            replies = pipe.execute()
        if read:
            refusals, answers, pending = replies[2:]
            records = ([json.loads(r) for r in refusals], [json.loads(a) for a in answers],
                       [json.loads(p)["admitted"] for p in pending])
            _wait_ahead_records = (now, records)
        if refit:
            refusals, answers, pending = records
            fit = wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=pending, now=now, deadline_s=deadline_s)
            _wait_ahead_cache = {**_wait_ahead_cache, band: (now, fit)}
    except Exception as e:  # noqa: BLE001 - what a 429 says is never what fails it
        log.warning("what the 429 says is not learnt, Redis failed: %s", e)
        return decision
    return wait_ahead.learnt(decision, load, fit, min_share=settings.ADMISSION_MIN_MARGIN_SHARE,
                             max_margin_s=settings.ADMISSION_MAX_MARGIN_SHARE * deadline_s)


def _bulk_overlap(client, *, start: float, end: float) -> float:
    """Seconds of ``[start, end]`` (Unix s) during which a bulk chunk computed
    (:func:`wait_model.bulk_overlap_s` of :data:`BULK_RUNS_KEY`'s newest :data:`BULK_RUNS_READ`
    intervals and the live marks of :data:`BULK_ACTIVITY_KEY`, parsed by
    :func:`wait_model.parse_bulk_activity`); an unreadable interval is skipped. One round trip; a Redis
    error propagates (the caller logs it)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.lrange(BULK_RUNS_KEY, -BULK_RUNS_READ, -1)
        pipe.hgetall(BULK_ACTIVITY_KEY)
        raw_runs, marks = pipe.execute()
    runs = []
    for raw in raw_runs:
        with contextlib.suppress(ValueError):
            lo, hi = map(float, raw.split())
            runs.append((lo, hi))
    computing, _, _ = parse_bulk_activity(marks, now=time.time(), stale_s=bulk_stale_after_s())
    return bulk_overlap_s(runs, computing, start=start, end=end)


def interactive_answered(decision: Decision, *, images: int, status: int, answered_at: float | None = None) -> None:
    """Record an admitted request's answer for the wait model (web side; never raises).

    Appends ``{"admitted", "answered", "images", "work_s", "predicted_s", "status", "ahead",
    "bulk_s", "bulk_at_admission"}`` to :data:`ANSWERS_KEY` (capped at :data:`ANSWERS_KEPT`) and
    removes it from :data:`PENDING_KEY`; ``bulk_s`` (s) is how long bulk chunks computed during its
    wait (:func:`wait_model.bulk_overlap_s` of :data:`BULK_RUNS_KEY` and :data:`BULK_ACTIVITY_KEY`),
    which with ``bulk_at_admission`` (``decision.admitted_beside_bulk``; absent when unknown) decides
    the regime whose fit and lone overheads it feeds, if any (:func:`wait_model.fit_regime`).
    ``status`` 200: answered within the
    deadline; anything else (202, 504): the deadline passed first. Nothing is recorded for a request
    that admission did not see (``admitted_at`` is ``None``) or that put no work on the lane.

    In a web request the record is written once the response is sent (``deferred.after_response``:
    two Redis round trips nobody waits for), with ``answered_at`` taken now.
    """
    if decision.admitted_at is None:
        return
    answered_at = answered_at or time.time()
    deferred.after_response(lambda: _record_answer(decision, images=images, status=status, answered_at=answered_at))


def _record_answer(decision: Decision, *, images: int, status: int, answered_at: float) -> None:
    """:func:`interactive_answered`'s writes to Redis (never raises). The request's pending record
    left from the writer thread (:func:`interactive_admit`): that is waited for first (it left long
    ago, unless Redis is unreachable), so the HDEL below never lands before its HSET."""
    background.flush(timeout_s=1.0)
    if images <= 0:
        if decision.token:
            with contextlib.suppress(Exception):
                redis_client().hdel(PENDING_KEY, decision.token)
        return
    record = {"admitted": round(decision.admitted_at, 4), "answered": round(answered_at, 4),
              "images": images, "status": status,
              "work_s": None if decision.work_s is None else round(decision.work_s, 4),
              "predicted_s": None if decision.predicted_wait_s is None else round(decision.predicted_wait_s, 4),
              "ahead": None if decision.ahead_images is None else round(decision.ahead_images, 2)}
    if decision.admitted_beside_bulk is not None:
        record["bulk_at_admission"] = decision.admitted_beside_bulk
    try:
        client = redis_client()
        record["bulk_s"] = round(_bulk_overlap(client, start=record["admitted"], end=record["answered"]), 4)
        regime = fit_regime(record)
        lone = LONE_BULK_KEY if regime else LONE_KEY
        with client.pipeline(transaction=False) as pipe:
            pipe.rpush(ANSWERS_KEY, json.dumps(record))
            pipe.ltrim(ANSWERS_KEY, -ANSWERS_KEPT, -1)
            if status == 200 and record["ahead"] == 0 and record["work_s"] is not None and regime is not None:
                pipe.rpush(lone, round(record["answered"] - record["admitted"] - record["work_s"], 4))
                pipe.ltrim(lone, -LONE_KEPT, -1)
            if decision.token:
                pipe.hdel(PENDING_KEY, decision.token)
            pipe.execute()
    except Exception as e:
        log.warning("could not record an interactive answer: %s", e)


def answer_records(client=None, *, since: float = 0.0) -> list[dict]:
    """Answers (:func:`interactive_answered`) recorded at or after ``since`` (Unix s), oldest first."""
    client = client or redis_client()
    rows = [json.loads(x) for x in client.lrange(ANSWERS_KEY, 0, -1)]
    return [r for r in rows if r["answered"] >= since]
