"""The wait model of interactive admission (queueing/wait_model.py): numbers in, numbers out.

Pure: injected clocks and records, as lane control reads them from Redis; no Django, no Redis.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queueing import wait_model


# --- capacity, batch times, the work ahead --------------------------------------------------------

def test_drain_rate_is_images_over_the_union_of_busy_time():
    now = 1000.0
    tasks = [
        (now - 30, now - 29, 50),  # ended before the window: ignored
        (now - 9, now - 8, 4),  # busy 1 s
        (now - 8.5, now - 7, 4),  # overlaps the first: busy until now − 7 (2 s in all)
        (now - 5, now - 4.5, 2),  # busy 0.5 s more; idle gaps do not count
        (now - 12, now - 9.5, 3),  # started before the window: only its 0.5 s inside counts
    ]
    assert wait_model.drain_rate(tasks, now=now) == pytest.approx((4 + 4 + 2 + 3) / (2 + 0.5 + 0.5))
    assert wait_model.drain_rate(tasks[:1], now=now) is None  # nothing finished in the window
    assert wait_model.drain_rate([(now - 1, now - 0.99, 1)], now=now) is None  # under 50 ms busy: no figure
    # A machine that slows: the same worker drains 10 images/s, then 5 images/s for the last 10 s.
    history = ([(now - 40 + i, now - 39 + i, 10) for i in range(30)]
               + [(now - 10 + i, now - 9 + i, 5) for i in range(10)])
    assert wait_model.drain_rate(history, now=now) == pytest.approx(5.0)


def answers_from(model, *, start: float, end: float, every: float = 0.1, seed: int = 0) -> list[dict]:
    """Answer records as the web writes them, one every ``every`` s, ``wait = model(t, work)`` ± 20 ms."""
    import random

    rng, out, t = random.Random(seed), [], start
    while t < end:
        work = rng.uniform(0.2, 1.8)
        wait = model(t, work) + rng.gauss(0, 0.02)
        out.append({"admitted": t - wait, "answered": t, "work_s": work, "status": 200, "images": 1})
        t += every
    return out


def test_fit_recovers_overhead_and_scale_and_ignores_old_answers():
    answers = answers_from(lambda t, w: 0.3 + 1.5 * w, start=0, end=30)
    fit = wait_model.fit_wait(answers, now=30)
    # the newest answers weigh most (~9 fresh answers in all) and the scale is pulled towards 1 a little
    assert fit.overhead_s == pytest.approx(0.3, abs=0.04) and fit.scale == pytest.approx(1.5, abs=0.04)
    assert 0 < fit.margin_s < 0.06  # the 95th percentile of ±20 ms noise
    assert fit.samples == 300
    assert wait_model.fit_wait(answers, now=100) == wait_model.WaitFit()  # all older than the window: the prior
    assert fit.age_s == pytest.approx(0.1, abs=1e-6)  # the newest answer, at 29.9 s
    # One answer: its wait is all overhead at scale 1 (the ridge pull to the workers' own figure).
    one = wait_model.fit_wait([{"admitted": 9.0, "answered": 10.0, "work_s": 0.5, "status": 200}], now=10)
    assert (one.overhead_s, one.scale, one.margin_s, one.samples, one.age_s) == (
        pytest.approx(0.5), pytest.approx(1.0), 0.0, 1, 0.0)


def test_fit_follows_a_machine_that_slows_within_seconds():
    """At t = 30 s something steals the cores: the same work takes twice as long. The prediction plus
    margin (what admission compares with the deadline) reaches the new truth within 3 s."""
    answers = answers_from(lambda t, w: 0.3 + (1.0 if t < 30 else 2.0) * w, start=0, end=40)
    truth = 0.3 + 2.0 * 1.5
    bound = lambda now: ((f := wait_model.fit_wait([a for a in answers if a["answered"] <= now], now=now)).predict(1.5)
                         + f.margin_s)
    assert bound(29.95) == pytest.approx(0.3 + 1.5, abs=0.1)  # before: right, small margin
    assert bound(31) > 0.3 + 1.5 + 0.8  # one second later the margin has already grown by ~1 s
    assert bound(33) >= truth * 0.97
    late = wait_model.fit_wait(answers, now=40)
    # ten seconds (100 answers) later the fit itself has followed: the old answers weigh nothing
    assert late.scale == pytest.approx(2.0, abs=0.1) and late.predict(1.5) + late.margin_s >= truth * 0.97


def observations(model, n: int, *, start: float, every: float = 0.01, seed: int = 0) -> list[dict]:
    """``n`` answers ``every`` s apart (no time passes to speak of: only their count matters), work
    uniform in 0.2–1.8 s, ``wait = model(work)`` × (1 ± 2 %)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        t, work = start + i * every, rng.uniform(0.2, 1.8)
        wait = model(work) * (1 + rng.uniform(-0.02, 0.02))
        out.append({"admitted": t - wait, "answered": t, "work_s": work, "status": 200, "images": 1})
    return out


def as_admitted(answers: list[dict]) -> list[dict]:
    """The same answers with the ``predicted_s`` the web would have recorded: each one predicted by
    the fit of the answers before it (as if admitted just after the previous answer)."""
    out = []
    for a in answers:
        out.append({**a, "predicted_s": wait_model.fit_wait(out, now=a["answered"]).predict(a["work_s"])})
    return out


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_the_prediction_follows_a_service_time_that_doubles(factor):
    """The whole service time doubles (a second process takes the cores; or halves: it stops): the
    answers say so one by one, with no time passing. Within 4 answers the prediction plus margin
    (what admission compares with the deadline) covers a doubled wait; within 64 the prediction is
    the new wait ± 10 % and the scale the new one ± 15 %, and within 160 the errors made during the
    change have left the margin; a speed-up never widens the margin (it is one-sided). Observation
    counts, not seconds: under load that is a few seconds, whatever the answer rate.

    The price of the 16-answer half-lives (``FIT_HALF_LIFE_ANSWERS``, ``MARGIN_HALF_LIFE_ANSWERS``): a
    step change is followed more slowly, in exchange for a fit that under a cycling overload still
    knows the last peak and a margin that one bad prediction does not set alone
    (docs/benchmarks-load.md, "Half-lives and the margin")."""
    before = lambda w: 0.2 + 1.0 * w
    after = lambda w: factor * before(w)
    answers = as_admitted(observations(before, 60, start=0.0) + observations(after, 160, start=0.6, seed=1))
    fit = lambda k: wait_model.fit_wait(answers[:60 + k], now=0.6 + 0.01 * k)
    work = 1.0
    assert fit(0).predict(work) == pytest.approx(before(work), rel=0.03) and fit(0).margin_s < 0.05
    if factor > 1:  # slower: admission must stop over-admitting at once
        assert fit(4).predict(work) + fit(4).margin_s >= 0.95 * after(work)
    assert fit(64).predict(work) == pytest.approx(after(work), rel=0.10)
    assert fit(64).scale == pytest.approx(factor, rel=0.15)
    assert fit(160).margin_s < 0.1 * after(work)  # the errors made during the change fade from the margin
    if factor < 1:  # faster: every answer is early, and early answers never widen the margin
        assert max(fit(k).margin_s for k in (4, 16, 64)) <= fit(0).margin_s


def test_a_request_still_waiting_past_its_prediction_counts_before_its_answer():
    """The machine slows at t = 60.6: the requests admitted then are not answered yet, but each one
    that has waited longer than predicted is a lower bound of its wait. Admission sees them at once
    (prediction + margin up), not a whole (longer) wait later. One within its prediction says
    nothing; one past its deadline is left out (answered 202 soon, or it failed and never will be)."""
    answers = as_admitted(observations(lambda w: 0.2 + w, 60, start=0.0))
    now = 61.5
    base = wait_model.fit_wait(answers, now=now)
    late = [{"admitted": now - 1.5, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0},
            {"admitted": now - 1.4, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0}]
    seen = wait_model.fit_wait(answers, now=now, pending=late)
    assert seen.samples == base.samples + 2
    assert seen.predict(0.5) + seen.margin_s >= 1.4 > base.predict(0.5) + base.margin_s
    on_time = [{"admitted": now - 0.3, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0}]
    expired = [{"admitted": now - 3.5, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0}]
    assert wait_model.fit_wait(answers, now=now, pending=on_time + expired) == base


def test_work_is_counted_in_forward_passes_at_the_measured_batch_times():
    """A worker measured 300 ms for one image and 550 ms for eight: a backlog of eight drains in one
    pass of eight, not eight of one; sizes between are interpolated, sizes below the smallest cost
    that size's pass, above the largest proportionally more (both err long)."""
    curve = {1: 300.0, 8: 550.0}
    assert wait_model.batch_ms(curve, 4) == pytest.approx(300 + 250 * 3 / 7)
    assert wait_model.batch_ms({4: 400.0}, 1) == 400.0 and wait_model.batch_ms({4: 400.0}, 6) == 600.0
    assert wait_model.drain_s(curve, 8, 8) == pytest.approx(0.55)
    assert wait_model.drain_s(curve, 17, 8) == pytest.approx(2 * 0.55 + 0.3)
    assert wait_model.drain_s(curve, 0, 8) == 0.0
    load = wait_model.LaneLoad(queued_messages=7, inflight_images=0, capacity_ips=1000 / 300, workers=1,
                               curves=((curve, 8),))
    assert load.work_s(1) == pytest.approx(0.55)  # the drain rate alone would say 8 × 0.3 s
    assert dataclasses.replace(load, curves=()).work_s(1) == pytest.approx(8 * 0.3)
    # two workers, one twice as fast at full batches: the images are shared by rate, the waits agree
    two = dataclasses.replace(load, queued_messages=23, workers=2, curves=((curve, 8), ({1: 150.0, 8: 275.0}, 8)))
    assert two.work_s(1) == pytest.approx(wait_model.drain_s(curve, 8, 8), rel=1e-6)


def test_a_running_pass_counts_as_the_time_it_has_left():
    """Eight images in flight, all in one pass of eight (550 ms expected) started 450 ms ago: a
    request arriving now waits the 0.1 s that pass has left and then its own pass of one (0.3 s),
    not a whole second pass of eight first. Two images in flight but outside the running pass
    (decoding, waiting for the model) join the next pass with it."""
    curve = {1: 300.0, 8: 550.0}
    now = 1000.0
    passes, stale = wait_model.running_passes({"w:1:m": f"8 {now - 0.45:.3f} 550.0"}, now=now, stale_s=60)
    assert passes == (pytest.approx((8, 0.1)),) and stale == []
    load = wait_model.LaneLoad(queued_messages=0, inflight_images=8, capacity_ips=1000 / 300, workers=1,
                               curves=((curve, 8),), passes=passes)
    assert load.work_s(1) == pytest.approx(0.1 + 0.3)
    assert load.work_s(0) == pytest.approx(0.1)  # the work ahead of it: the rest of that pass
    assert dataclasses.replace(load, passes=()).work_s(1) == pytest.approx(0.55 + 0.3)  # counted whole
    outside = dataclasses.replace(load, inflight_images=10)
    assert outside.work_s(1) == pytest.approx(0.1 + wait_model.batch_ms(curve, 3) / 1000)
    # without per-batch-size times: the rest at the drain rate, after the running pass
    assert dataclasses.replace(outside, curves=()).work_s(1) == pytest.approx(0.1 + 3 * 0.3)
    # a pass that overran its expected time is about to end: 0 s left, its images still not ahead
    late, _ = wait_model.running_passes({"w:1:m": f"8 {now - 0.9:.3f} 550.0"}, now=now, stale_s=60)
    assert late == ((8, 0.0),) and dataclasses.replace(load, passes=late).work_s(1) == pytest.approx(0.3)
    # an expected time not measured yet (0) says nothing: the images count whole, as before
    unknown, _ = wait_model.running_passes({"w:1:m": f"8 {now - 0.1:.3f} 0.0"}, now=now, stale_s=60)
    assert unknown == ()
    # a dead worker's pass, or a garbled entry, is stale: ignored and returned for deletion
    gone, stale = wait_model.running_passes({"dead": f"8 {now - 120:.3f} 550.0", "bad": "x"}, now=now, stale_s=60)
    assert gone == () and sorted(stale) == ["bad", "dead"]


def test_the_images_that_arrive_before_a_requests_pass_starts_join_it():
    """A pass costs 100 ms + 200 ms an image (a CPU where batching barely helps). A pass
    of one runs with 0.5 s left and two requests wait for the next: a request arriving now joins
    them, and so do the 4 images/s admitted behind it until that pass starts (0.5 s: two more), a
    pass of five (1.1 s), not three (0.7 s). The joiners fill the last pass only up to the largest
    batch; full passes ahead delay the last one's start, so more join it; an empty lane (nothing
    running) starts its pass at once: nobody joins."""
    curve = {1: 300.0, 8: 1700.0}
    load = wait_model.LaneLoad(queued_messages=0, inflight_images=3, capacity_ips=1000 / 300, workers=1,
                               curves=((curve, 8),), passes=((1, 0.5),), arrivals_ips=4.0)
    assert load.work_s(1) == pytest.approx(0.5 + wait_model.batch_ms(curve, 5) / 1000)
    alone = dataclasses.replace(load, arrivals_ips=0.0)
    assert alone.work_s(1) == pytest.approx(0.5 + wait_model.batch_ms(curve, 3) / 1000)
    assert dataclasses.replace(load, arrivals_ips=40.0).work_s(1) == pytest.approx(0.5 + 1.7)  # at most a full pass
    assert wait_model.drain_s(curve, 9, 8, arrivals_ips=2.0, start_s=0.5) == pytest.approx(
        1.7 + wait_model.batch_ms(curve, 1 + 2.0 * (0.5 + 1.7)) / 1000)
    assert wait_model.drain_s(curve, 8, 8, arrivals_ips=2.0, start_s=0.5) == pytest.approx(1.7)  # no partial pass
    empty = dataclasses.replace(load, inflight_images=0, passes=())
    assert empty.work_s(1) == pytest.approx(0.3)
    # lane_load: the requests admitted in the last 2 s (answered or pending) × images per request, per second
    now = 1000.0
    entry = json.dumps({"capacity_ips": 2.0, "images_per_request": 2.0, "updated": now - 1})
    answered = [json.dumps({"admitted": now - a, "answered": now - a + 0.8, "work_s": 0.7, "predicted_s": 0.8,
                            "status": 200, "images": 2, "ahead": 1}) for a in (3.0, 1.5, 1.0)]
    pending = [json.dumps({"admitted": now - 0.2, "work_s": 0.7, "predicted_s": 0.7, "deadline_s": 1.0})]
    assert wait_model.lane_load(queued_messages=0, inflight_images=0, workers={"w": entry}, answers=answered,
                                pending=pending, now=now).arrivals_ips == pytest.approx(3 * 2.0 / 2.0)


def test_a_workers_batch_times_follow_a_forward_pass_that_doubles():
    """Per batch size, an EWMA of the forward pass (weight 0.3): the machine slows to twice the time;
    within 7 passes of a size its figure is over 90 % of the way there, and other sizes keep theirs."""
    from workers.batcher import BatchRecord

    rec = lambda size, ms: BatchRecord(size=size, requests=size, queue_delay_ms=1.0, service_ms=ms, expired=0)
    curve = wait_model.update_batch_curve({}, [rec(1, 300.0), rec(8, 550.0), rec(0, 0.0)])
    assert curve == {1: 300.0, 8: 550.0}  # an empty batch (all expired) measures nothing
    for k in range(1, 8):
        curve = wait_model.update_batch_curve(curve, [rec(8, 1100.0)])
        if k == 3:
            assert curve[8] > 550 + 0.6 * 550
    assert curve[8] > 550 + 0.9 * 550 and curve[1] == 300.0


def test_retry_after_is_the_wait_ahead_rounded_up_to_whole_seconds():
    """RFC 9110 delay-seconds: an integer ≥ 1 s, never below the predicted wait of the work ahead
    (to the millisecond: 1.0004 s is 1 s), so a client that waits it never retries too early."""
    assert [wait_model.retry_after(w) for w in (0.0, 0.3, 1.0, 1.0004, 1.001, 1.5, 4.2, 12.0)] == \
        [1, 1, 1, 1, 2, 2, 5, 12]


def test_a_margin_learnt_in_a_bad_moment_fades_when_no_new_answer_comes():
    """Answers with a wide spread (some waited 1 s longer than predicted), then nothing: the margin
    shrinks with the evidence's weight, so admission cannot refuse everything forever."""
    answers = answers_from(lambda t, w: 0.3 + w + (1.0 if round(t * 2) % 5 == 0 else 0.0), start=0, end=5, every=0.5)
    fresh, old = wait_model.fit_wait(answers, now=5), wait_model.fit_wait(answers, now=20)
    assert fresh.margin_s > 0.6  # every fifth answer 1 s late: the 95th percentile sees them
    assert old.margin_s < 0.5 * fresh.margin_s  # fifteen seconds of silence later
    assert wait_model.fit_wait(answers, now=5 + wait_model.FIT_WINDOW_S + 0.1) == wait_model.WaitFit()


def test_a_202_counts_as_a_longer_wait():
    base = {"admitted": 8.0, "answered": 10.0, "work_s": 1.0}
    ok = wait_model.fit_wait([{**base, "status": 200}], now=10)
    late = wait_model.fit_wait([{**base, "status": 202}], now=10)
    assert ok.predict(1.0) == pytest.approx(2.0)
    assert late.predict(1.0) == pytest.approx(2.0 * wait_model.CENSORED_FACTOR)


def test_decide_refuses_exactly_when_the_predicted_wait_plus_margin_exceeds_the_deadline():
    decide = functools.partial(wait_model.decide, min_margin_share=0.0)  # the learnt margin alone
    fit = wait_model.WaitFit(overhead_s=0.2, scale=1.25, margin_s=0.1, samples=50)
    capacity, deadline = 8.0, 2.0
    # largest backlog B with 0.2 + 1.25 (B + 1) / 8 + 0.1 <= 2  →  B + 1 <= 10.88
    fits = wait_model.LaneLoad(queued_messages=9, inflight_images=0, capacity_ips=capacity, fit=fit)
    ok = decide(fits, deadline_s=deadline)
    assert ok.admitted and ok.predicted_wait_s == pytest.approx(0.2 + 1.25 * 10 / 8)
    assert ok.work_s == pytest.approx(10 / 8)
    over = wait_model.LaneLoad(queued_messages=9, inflight_images=1, capacity_ips=capacity, fit=fit)
    refused = decide(over, deadline_s=deadline)
    assert not refused.admitted and refused.predicted_wait_s == pytest.approx(0.2 + 1.25 * 11 / 8)
    # the admission edge, the longest predicted wait admitted: 2 − 0.1 = 1.9 s (the work ahead,
    # 0.2 + 1.25 × 10 / 8 = 1.76 s, goes in the body), plus its margin (0.1 s), rounded up
    assert refused.wait_ahead_s == pytest.approx(1.9) and refused.wait_ahead_from == "edge"
    assert refused.work_ahead_wait_s == pytest.approx(1.7625) and refused.retry_margin_s == pytest.approx(0.1)
    assert refused.retry_after_s == 2
    # Requests of several images weigh more, queued and arriving; unknown capacity admits.
    assert not decide(dataclasses.replace(fits, images_per_request=2.0), deadline_s=deadline).admitted
    assert not decide(fits, deadline_s=deadline, images=2).admitted
    assert decide(wait_model.LaneLoad(10_000, 0, None), deadline_s=deadline).admitted
    # Retry-After is never 0, and follows a long backlog.
    assert decide(dataclasses.replace(fits, queued_messages=1, fit=wait_model.WaitFit(margin_s=5)),
                  deadline_s=0.2).retry_after_s == 1  # 0.125 s + a margin capped at 0.4 × 0.2 s
    # An empty lane admits whatever the margin, unless the request alone is predicted to miss.
    empty = dataclasses.replace(fits, queued_messages=0, fit=wait_model.WaitFit(margin_s=5))
    assert decide(empty, deadline_s=deadline).admitted
    fresh = wait_model.WaitFit(margin_s=5, age_s=1.0)
    assert not decide(dataclasses.replace(empty, capacity_ips=0.4, fit=fresh), deadline_s=deadline).admitted
    # ... and once the newest answer is stale, it admits a probe whatever the prediction: only an
    # answer can tell the model that the machine got faster again (the prior has no answer: a probe).
    stale = dataclasses.replace(fresh, age_s=wait_model.PROBE_AFTER_S + 0.1)
    assert decide(dataclasses.replace(empty, capacity_ips=0.4, fit=stale), deadline_s=deadline).admitted
    assert not decide(dataclasses.replace(fits, capacity_ips=0.4, fit=stale), deadline_s=deadline).admitted
    # A backlog far beyond the edge (a lane filled by longer deadlines): no request of this deadline
    # is admitted until it has drained to the edge, predicted wait − edge; Retry-After follows it.
    deep = decide(dataclasses.replace(fits, queued_messages=79), deadline_s=deadline)  # 0.2 + 1.25 × 80 / 8 = 12.7 s
    assert deep.wait_ahead_from == "drain" and deep.wait_ahead_s == pytest.approx(12.7 - 1.9)
    assert deep.retry_after_s == 11  # ⌈10.8 + 0.1⌉
    assert decide(dataclasses.replace(fits, queued_messages=70),
                  deadline_s=deadline).retry_after_s == 10  # 9.39 + 0.1 s
    # A pass of two images nearly done (0.02 s left) with a 0.3 s margin: little work is ahead, but
    # the next request admitted waits its own pass; wait_ahead_s is never less than that. At a 0.6 s
    # deadline the edge is 0.6 − 0.24 (the margin's cap, 0.4 × the deadline) = 0.36 s, above it; at
    # 0.5 s it is 0.3 s, below: the floor.
    lone = wait_model.LaneLoad(queued_messages=0, inflight_images=2, capacity_ips=1 / 0.3, workers=1,
                               curves=(({1: 300.0, 8: 550.0}, 8),), passes=((2, 0.02),),
                               fit=wait_model.WaitFit(overhead_s=0.05, scale=1.0, margin_s=0.3, samples=50))
    d = decide(lone, deadline_s=0.6)
    assert not d.admitted and d.predicted_wait_s == pytest.approx(0.05 + 0.02 + 0.3)
    assert d.wait_ahead_s == pytest.approx(0.36) and d.wait_ahead_from == "edge"
    d = decide(lone, deadline_s=0.5)
    assert d.wait_ahead_s == pytest.approx(0.05 + 0.3) and d.wait_ahead_from == "alone"  # not the work ahead, 0.07 s
    assert decide(dataclasses.replace(lone, passes=((2, 0.25),)), deadline_s=0.5).wait_ahead_s \
        == pytest.approx(0.05 + 0.3)  # more left, still under a lone pass: the floor
    backlog = decide(dataclasses.replace(lone, queued_messages=8, inflight_images=8, passes=((8, 0.5),)),
                     deadline_s=0.6)  # predicted 0.05 + 0.5 left + a pass of eight 0.55 + its own 0.3 = 1.4 s
    assert backlog.wait_ahead_from == "drain" and backlog.wait_ahead_s == pytest.approx(1.4 - 0.36)
    assert backlog.work_ahead_wait_s == pytest.approx(0.05 + 0.5 + 0.55)


def test_a_shallow_lane_admits_whatever_the_margin_when_the_wait_alone_fits():
    """``SHALLOW_REQUESTS`` (1): with at most one request's images ahead, the margin (learnt in a
    bad moment: 0.3 s) is not applied; the predicted wait alone still is. Two requests ahead: the
    margin is. A lane of two-image requests counts requests, not images."""
    assert wait_model.SHALLOW_REQUESTS == 1
    fit = wait_model.WaitFit(overhead_s=0.05, scale=1.0, margin_s=0.3, samples=50)
    lane = lambda inflight, per_request=1.0: wait_model.LaneLoad(
        queued_messages=0, inflight_images=inflight, capacity_ips=1 / 0.3, workers=1, images_per_request=per_request,
        curves=(({1: 300.0, 2: 350.0, 8: 550.0}, 8),), passes=((inflight, 0.1),) if inflight else (), fit=fit)
    one = wait_model.decide(lane(1), deadline_s=0.6)  # 0.05 + 0.1 left + 0.3 own pass = 0.45 s; + 0.3 > 0.6
    assert one.admitted and one.predicted_wait_s == pytest.approx(0.45) and one.ahead_images == 1
    assert not wait_model.decide(lane(1), deadline_s=0.4).admitted  # the wait alone misses: refused
    two = wait_model.decide(lane(2), deadline_s=0.6)  # the same wait, two requests ahead: the margin applies
    assert not two.admitted and two.predicted_wait_s == pytest.approx(0.45) and two.margin_s == pytest.approx(0.24)
    assert wait_model.decide(lane(2, per_request=2.0), deadline_s=0.6).admitted  # one request of two images ahead


def test_the_margin_is_never_less_than_a_share_of_the_predicted_wait():
    """``MIN_MARGIN_SHARE`` (``ADMISSION_MIN_MARGIN_SHARE``'s default): a learnt margin of 0.1 s is
    raised to 0.2 × the predicted wait.
    At a 5 s deadline the largest admitted wait is then 5 / 1.2 = 4.17 s, not 4.9 s; at 0.4 s the
    floor (0.08 s) is below the learnt margin and changes nothing."""
    fit = wait_model.WaitFit(overhead_s=0.0, scale=1.0, margin_s=0.1, samples=50)
    assert wait_model.margin_s(fit, 4.0, min_share=0.2) == pytest.approx(0.8)
    assert wait_model.margin_s(fit, 0.4, min_share=0.2) == pytest.approx(0.1)
    lane = lambda backlog: wait_model.LaneLoad(queued_messages=backlog, inflight_images=0, capacity_ips=2.0, fit=fit)
    # predicted wait = (backlog + 1) / 2 s: 3.5 s admits either way (3.5 + 0.7 <= 5); 4.5 s only
    # with the learnt margin alone (4.5 + 0.1 <= 5 < 4.5 + 0.9)
    assert wait_model.decide(lane(6), deadline_s=5.0, min_margin_share=0.2).admitted
    assert not wait_model.decide(lane(8), deadline_s=5.0, min_margin_share=0.2).admitted
    assert wait_model.decide(lane(8), deadline_s=5.0, min_margin_share=0.0).admitted
    assert wait_model.MIN_MARGIN_SHARE == 0.2 and not wait_model.decide(lane(8), deadline_s=5.0).admitted


def test_the_margin_is_never_more_than_a_share_of_the_deadline():
    """``MAX_MARGIN_SHARE`` (0.4, ``ADMISSION_MAX_MARGIN_SHARE``'s default): a burst of late
    answers at the start of an overload taught a margin of 0.9 s at a 1 s deadline; capped at 0.4 s,
    a request predicted 0.55 s is admitted (it would have been refused for anything but an empty
    lane), one predicted 0.65 s is not."""
    fit = wait_model.WaitFit(overhead_s=0.0, scale=1.0, margin_s=0.9, samples=50)
    assert wait_model.margin_s(fit, 0.5, min_share=0.2, max_s=0.4) == pytest.approx(0.4)
    assert wait_model.margin_s(fit, 0.5, min_share=0.2) == pytest.approx(0.9)
    lane = lambda backlog: wait_model.LaneLoad(queued_messages=backlog, inflight_images=0, capacity_ips=20.0, fit=fit)
    assert wait_model.MAX_MARGIN_SHARE == 0.4
    assert wait_model.decide(lane(10), deadline_s=1.0).admitted  # 11 / 20 = 0.55 s
    refused = wait_model.decide(lane(12), deadline_s=1.0)  # 0.65 s
    assert not refused.admitted and refused.margin_s == pytest.approx(0.4)


def test_an_overhead_prior_keeps_bunched_answers_from_moving_the_intercept():
    """Under a steady overload every answer has about the same work ahead (0.48-0.52 s): the data
    fix ``overhead + scale × 0.5`` and little else. Here the machine is 1.4 × slower than the
    workers' figure, with 0.05 s of overhead. Without a prior the ridge keeps the scale near 1 and
    the overhead absorbs the rest (0.25 s); a lone request (0.15 s of work) is then predicted
    0.40 s where it waits 0.26 s. Pulled to the overhead lone requests measured (0.05 s), the
    scale takes it and the lone request is predicted within 10 %; the loaded one stays right."""
    truth = lambda w: 0.05 + 1.4 * w
    rows = [(0.48 + 0.04 * (i % 5) / 4, truth(0.48 + 0.04 * (i % 5) / 4), 1.0) for i in range(20)]
    a, c = wait_model._solve(rows)
    assert a + c * 0.15 > 1.4 * truth(0.15)
    a, c = wait_model._solve(rows, overhead_prior_s=0.05)
    assert a + c * 0.15 == pytest.approx(truth(0.15), rel=0.10)
    assert a + c * 0.5 == pytest.approx(truth(0.5), rel=0.02)


def test_a_202_enters_the_margin_with_its_wait_not_the_censored_factor():
    """A 202 waited at least its deadline: the fit takes CENSORED_FACTOR × that (it waited longer),
    but the margin takes the wait itself, since a squared 1.25 × error set the margin alone."""
    now = 100.0
    answers = [{"admitted": now - 5 + 0.2 * i, "answered": now - 5 + 0.2 * i + 0.6, "work_s": 0.5,
                "predicted_s": 0.6, "status": 200} for i in range(20)]
    answers.append({"admitted": now - 1.0, "answered": now, "work_s": 0.5, "predicted_s": 0.75, "status": 202})
    fit = wait_model.fit_wait(answers, now=now)
    recent = sorted(answers, key=lambda r: r["answered"])
    n = len(recent)
    weights = [0.5 ** ((now - r["answered"]) / wait_model.MARGIN_HALF_LIFE_S)
               * 0.5 ** ((n - 1 - i) / wait_model.MARGIN_HALF_LIFE_ANSWERS) for i, r in enumerate(recent)]
    errors = [(r["answered"] - r["admitted"]) - r["predicted_s"] for r in recent]  # the 202's: 1.0 - 0.75
    total = sum(0.5 ** ((now - r["answered"]) / wait_model.MARGIN_HALF_LIFE_S) for r in recent)
    expected = wait_model._upper_bound(errors, weights, 0.99) * total / (total + wait_model.MARGIN_PRIOR_WEIGHT)
    assert fit.margin_s == pytest.approx(expected, rel=1e-6)
    assert fit.predict(0.5) > 0.6  # and the fit still heard that it waited longer


def test_capacity_is_summed_over_live_workers():
    now = 500.0
    entry = lambda cap, age: json.dumps({"capacity_ips": cap, "images_per_request": 1.0, "updated": now - age})
    load = wait_model.lane_load(queued_messages=0, inflight_images=0, answers=[], now=now,
                                workers={"a": entry(6.0, 1), "b": entry(4.0, 14), "dead": entry(9.0, 16)})
    assert (load.capacity_ips, load.workers) == (10.0, 2)
    assert wait_model.lane_load(queued_messages=0, inflight_images=0, answers=[], now=now,
                                workers={"dead": entry(9.0, 16)}).capacity_ips is None


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), max_size=6),
       st.lists(st.integers(0, 40), max_size=2), st.integers(0, 40), st.integers(0, 40))
def test_the_bulk_overlap_of_a_wait_is_the_union_of_the_computing_intervals_within_it(runs, computing, a, b):
    """``bulk_overlap_s`` against counting, on a 0.1 s grid, the instants of ``[start, end]``
    covered by a finished interval or by a chunk computing since ``since`` (until ``end``)."""
    start, end = min(a, b) / 10, max(a, b) / 10
    intervals = [(s / 10, (s + d) / 10) for s, d in runs]
    covered = sum(any(lo <= (t + 0.5) / 10 < hi for lo, hi in [*intervals, *((c / 10, end) for c in computing)])
                  for t in range(min(a, b), max(a, b)))
    assert wait_model.bulk_overlap_s(intervals, [c / 10 for c in computing], start=start, end=end) == pytest.approx(
        covered / 10, abs=1e-9)


def test_the_wait_is_fitted_apart_beside_bulk_work():
    """Answers that waited beside a computing bulk chunk (``bulk_s`` ≥ a quarter of their wait) and
    the others each have their own fit: here the lane pays 0.1 s over its work alone and 0.9 s
    beside bulk work, and ``lane_load`` fits the regime it is told the machine is in now. A record
    without ``bulk_s`` (written before it existed) is not beside bulk; a chunk's 1 s-old marks in
    the activity hash are live, a 200 s-old one is a dead process's."""
    now = 1000.0
    entry = json.dumps({"capacity_ips": 4.0, "images_per_request": 1.0, "updated": now - 1})
    answers = []
    for i in range(24):
        work = 0.3 + 0.05 * (i % 6)
        bulk = i % 2 == 1
        wait = work + (0.9 if bulk else 0.1)
        record = {"admitted": now - 20 + i * 0.5, "answered": now - 20 + i * 0.5 + wait, "work_s": work,
                  "predicted_s": wait, "status": 200, "images": 1, "ahead": 2}
        if bulk:
            record["bulk_s"] = round(0.3 * wait, 4)
        elif i % 4 == 0:
            record["bulk_s"] = round(0.2 * wait, 4)  # met a micro-batch's tail: not beside it
        answers.append(record)
    assert [wait_model.beside_bulk(r) for r in answers[:4]] == [False, True, False, True]
    raw = [json.dumps(r) for r in answers]
    quiet = wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry}, answers=raw, now=now)
    beside = wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry}, answers=raw, now=now,
                                  beside_bulk_now=True)
    assert (quiet.beside_bulk, beside.beside_bulk) == (False, True)
    assert quiet.fit.samples == beside.fit.samples == 12
    assert quiet.fit.predict(0.5) == pytest.approx(0.6, abs=0.02)
    assert beside.fit.predict(0.5) == pytest.approx(1.4, abs=0.02)
    mixed = wait_model.fit_wait(answers, now=now)  # one fit across both: wrong for either
    assert 0.8 < mixed.predict(0.5) < 1.2
    # no answer of the regime yet: the prior, the workers' own figure
    assert wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry}, answers=raw[::2],
                                now=now, beside_bulk_now=True).fit == wait_model.WaitFit()
    assert wait_model.parse_bulk_activity({"a": f"{now - 1}", "b": f"{now - 200}", "c": "?"}, now=now, stale_s=120) == (
        [now - 1], ["b", "c"], False)
    # every live chunk yields to the lane (" y"): a refusal parks them (bulk_yield.BulkActivity)
    assert wait_model.parse_bulk_activity({"a": f"{now - 1} y", "b": f"{now - 200}", "c": f"{now - 2} y"}, now=now,
                                          stale_s=120) == ([now - 1, now - 2], ["b"], True)
    assert wait_model.parse_bulk_activity({"a": f"{now - 1} y", "c": f"{now - 2}"}, now=now, stale_s=120)[2] is False
    assert wait_model.parse_bulk_activity({}, now=now, stale_s=120) == ([], [], False)


def test_a_request_admitted_beside_bulk_passes_that_parked_teaches_neither_fit():
    """The switch out of the bulk regime: requests admitted while bulk chunks computed
    (``bulk_at_admission``) that waited mostly after the chunks parked (``bulk_s`` under a quarter of
    their wait) are left out of both fits, and one still waiting is a lower bound of its admission
    regime's waits only. Here the quiet lane pays 0.1 s over its work; the switch's requests waited
    1.5 s over theirs (predicted by the bulk fit, answered in the quiet lane), and the quiet fit is
    the fit of the quiet answers alone, as if they had never been. A record admitted in the quiet
    lane that met a micro-batch's tail still teaches the quiet fit, and one that waited mostly
    beside bulk passes teaches the bulk fit, whatever the regime it was admitted in."""
    now = 1000.0
    entry = json.dumps({"capacity_ips": 4.0, "images_per_request": 1.0, "updated": now - 1})
    quiet, switch, bulk = [], [], []
    for i in range(12):
        work = 0.3 + 0.05 * (i % 6)
        admitted = now - 20 + i * 0.5
        quiet.append({"admitted": admitted, "answered": admitted + work + 0.1, "work_s": work,
                      "predicted_s": work + 0.1, "status": 200, "images": 1, "ahead": 2, "bulk_at_admission": False,
                      **({"bulk_s": round(0.2 * (work + 0.1), 4)} if i % 4 == 0 else {})})
        bulk.append({"admitted": admitted, "answered": admitted + work + 0.9, "work_s": work, "predicted_s": work + 0.9,
                     "status": 200, "images": 1, "ahead": 2, "bulk_at_admission": i % 3 != 0,
                     "bulk_s": round(0.5 * (work + 0.9), 4)})
    for i in range(6):
        work, admitted = 0.5, now - 6 + i * 0.4
        switch.append({"admitted": admitted, "answered": admitted + work + 1.5, "work_s": work,
                       "predicted_s": work + 0.9, "status": 200, "images": 1, "ahead": 8, "bulk_at_admission": True,
                       "bulk_s": round(0.1 * (work + 1.5), 4)})
    assert [wait_model.fit_regime(r) for r in (quiet[0], quiet[1], switch[0], bulk[0], bulk[1])] == [
        False, False, None, True, True]
    assert wait_model.fit_regime({"admitted": 0.0, "answered": 1.0, "bulk_s": 0.1}) is False  # written before the field
    # waited past its prediction
    waiting = {"admitted": now - 2.0, "work_s": 0.5, "predicted_s": 1.4, "deadline_s": 5.0}
    pending = [json.dumps({**waiting, "bulk_at_admission": True})]

    def load(records, *, beside_bulk_now=False, pending=()):
        return wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry},
                                    answers=[json.dumps(r) for r in records], now=now, pending=pending,
                                    beside_bulk_now=beside_bulk_now)

    alone = load(quiet).fit
    assert alone.predict(0.5) == pytest.approx(0.6, abs=0.02)
    assert load(quiet + bulk + switch, pending=pending).fit == alone
    # the same records, were the switch's taught as the quiet lane's (without fit_regime's None)
    assert load(quiet + bulk + [{**r, "bulk_at_admission": False} for r in switch],
                pending=[json.dumps(waiting)]).fit.predict(0.5) > alone.predict(0.5) + 0.5
    beside = load(quiet + bulk + switch, beside_bulk_now=True, pending=pending).fit
    assert beside.samples == len(bulk) + 1  # and the one still waiting, admitted beside bulk passes
    assert load(bulk, beside_bulk_now=True).fit.predict(0.5) == pytest.approx(1.4, abs=0.02)


def test_the_admission_edge_is_the_longest_predicted_wait_admitted():
    """``admission_edge_s``: the largest ``w`` with ``w + margin_s(w) ≤ deadline``, whichever of the
    learnt margin, the floor (a share of ``w``) or the cap (a share of the deadline) binds there."""
    edge = functools.partial(wait_model.admission_edge_s, min_share=0.2, max_s=0.8)  # a 2 s deadline's cap
    learnt = lambda m: wait_model.WaitFit(margin_s=m)  # noqa: E731
    assert edge(learnt(0.5), 2.0) == pytest.approx(1.5)  # the learnt margin: 1.5 + 0.5 = 2
    assert edge(learnt(0.1), 2.0) == pytest.approx(2.0 / 1.2)  # the floor: 1.667 + 0.2 × 1.667 = 2
    assert edge(learnt(1.5), 2.0) == pytest.approx(1.2)  # the cap: 1.2 + 0.8 = 2
    assert edge(learnt(0.1), 2.0, min_share=0.0) == pytest.approx(1.9)
    assert wait_model.admission_edge_s(learnt(5.0), 2.0, min_share=0.0) == 0.0  # no cap, nothing fits


@given(margin=st.floats(0, 10), deadline=st.floats(0.05, 60), share=st.floats(0, 1), cap=st.floats(0, 1))
def test_the_admission_edge_is_where_decide_stops_admitting(margin, deadline, share, cap):
    """Property: at the edge the predicted wait plus its margin is the deadline (or under it where
    it is 0), and a wait a millisecond longer does not fit; ``decide``'s own rule."""
    fit = wait_model.WaitFit(margin_s=margin)
    mg = functools.partial(wait_model.margin_s, fit, min_share=share, max_s=cap * deadline)
    e = wait_model.admission_edge_s(fit, deadline, min_share=share, max_s=cap * deadline)
    assert 0 <= e <= deadline and e + mg(e) <= deadline + 1e-9
    assert e + 1e-3 + mg(e + 1e-3) > deadline


def test_a_refusal_says_the_wait_at_the_admission_edge():
    """Under overload the next request admitted is the first whose predicted wait plus its margin
    fits again: a lane at the edge of a 1 s deadline (a pass of one running, 0.3 s left, one request
    queued) refuses a request predicted 0.95 s (+ a 0.2 s margin). The work ahead waits 0.05 + 0.3
    + 0.45 = 0.8 s; ``wait_ahead_s`` is the edge, 1 − 0.2 = 0.8 s, whatever the requests admitted in
    the last seconds were promised (their mean lags when admission stops). With a margin of 0.4 s
    (the cap) the edge is 0.6 s. At a 0.6 s deadline the edge is 0.4 s, and the lane needs
    0.95 − 0.4 = 0.55 s to drain to it: that, longer (and longer than a lone request's 0.5 s, the
    floor: ``test_decide_refuses_exactly_…``)."""
    fit = wait_model.WaitFit(overhead_s=0.05, scale=1.0, margin_s=0.2, samples=50)
    lane = wait_model.LaneLoad(queued_messages=1, inflight_images=1, capacity_ips=1 / 0.45, workers=1,
                               curves=(({1: 450.0, 2: 600.0}, 8),), passes=((1, 0.3),), fit=fit)
    d = wait_model.decide(lane, deadline_s=1.0)  # 0.05 + 0.3 + a pass of two (0.6) = 0.95 s, + 0.2 > 1
    assert not d.admitted and d.predicted_wait_s == pytest.approx(0.95)
    assert d.wait_ahead_s == pytest.approx(0.8) and d.wait_ahead_from == "edge"
    assert d.work_ahead_wait_s == pytest.approx(0.8) and d.retry_after_s == 1  # ⌈0.8 + its margin 0.2⌉
    assert wait_model.decide(dataclasses.replace(lane, recent_admitted_s=(0.2,)), deadline_s=1.0) == d
    wider = wait_model.decide(dataclasses.replace(lane, fit=dataclasses.replace(fit, margin_s=0.6)), deadline_s=1.0)
    assert wider.wait_ahead_s == pytest.approx(0.6) and wider.wait_ahead_from == "edge"
    short = wait_model.decide(lane, deadline_s=0.6)
    assert short.wait_ahead_s == pytest.approx(0.55) and short.wait_ahead_from == "drain"
    # lane_load still keeps what the requests admitted in the last 2 s were promised (their count is
    # the arrivals that join the last, partial pass): from the answers and the pending, oldest first
    now = 1000.0
    entry = json.dumps({"capacity_ips": 2.0, "images_per_request": 1.0, "updated": now - 1})
    answered = [json.dumps({"admitted": now - a, "answered": now - a + 0.8, "work_s": 0.7, "predicted_s": p,
                            "status": 200, "images": 1, "ahead": 1}) for a, p in ((3.0, 9.9), (1.9, 0.8), (1.2, 0.9))]
    pending = [json.dumps({"admitted": now - 0.4, "work_s": 0.7, "predicted_s": 0.7, "deadline_s": 1.0}),
               json.dumps({"admitted": now - 0.1, "work_s": 0.7, "predicted_s": None, "deadline_s": 1.0})]
    load = wait_model.lane_load(queued_messages=0, inflight_images=0, workers={"w": entry}, answers=answered,
                                pending=pending, now=now)
    assert load.recent_admitted_s == (0.8, 0.9, 0.7)  # 3 s ago is out; an unpredicted admission is left out


def test_a_refusal_beside_bulk_work_that_yields_says_what_the_quiet_lane_will_wait():
    """Beside bulk chunks that yield to the lane (``LaneLoad.quiet``), a refusal parks them within
    a micro-batch and admission reopens in the quiet regime with the backlog of that moment: the
    429 says what the quiet fit predicts for it (``parks``), not the bulk regime's edge. A 5 s lane,
    16 images in flight: beside bulk work (overhead 0.3 s, scale 1.9, margin at its 2 s cap) the
    request is predicted 0.3 + 1.9 × 2.0 = 4.1 s and refused, and the edge is 3.0 s; the quiet fit
    (0.3 s, 0.85, margin 0.3 s) predicts 0.3 + 0.85 × 2.0 = 2.0 s, under its edge (5 / 1.2). Behind
    a deeper backlog the quiet edge, and the drain to it where longer; with chunks that do not yield
    (an urgent job's), or no quiet answer yet, the bulk regime's edge as before."""
    bulk = wait_model.WaitFit(overhead_s=0.3, scale=1.9, margin_s=2.5, samples=30)
    quiet_fit = wait_model.WaitFit(overhead_s=0.3, scale=0.85, margin_s=0.3, samples=200)
    lane = wait_model.LaneLoad(queued_messages=0, inflight_images=15, capacity_ips=8.0, workers=1, fit=bulk,
                               beside_bulk=True)
    assert lane.work_s() == pytest.approx(2.0)
    plain = wait_model.decide(lane, deadline_s=5.0)
    assert not plain.admitted and plain.predicted_wait_s == pytest.approx(4.1)
    assert (plain.wait_ahead_s, plain.wait_ahead_from) == (pytest.approx(3.0), "edge")
    parked = dataclasses.replace(lane, quiet=dataclasses.replace(lane, fit=quiet_fit, beside_bulk=False))
    d = wait_model.decide(parked, deadline_s=5.0)
    assert not d.admitted and d.predicted_wait_s == plain.predicted_wait_s and d.margin_s == plain.margin_s
    assert (d.wait_ahead_s, d.wait_ahead_from) == (pytest.approx(2.0), "parks")
    assert d.retry_after_s == 4  # ⌈2.0 + the bulk regime's margin on it (its 0.4 × 5 s cap)⌉: never early
    deep = dataclasses.replace(parked, inflight_images=39, quiet=dataclasses.replace(parked.quiet, inflight_images=39))
    d = wait_model.decide(deep, deadline_s=5.0)  # quiet: 0.3 + 0.85 × 5 = 4.55 s, past its edge 4.17 s
    assert (d.wait_ahead_s, d.wait_ahead_from) == (pytest.approx(5 / 1.2), "edge")
    deeper = dataclasses.replace(deep, inflight_images=95, quiet=dataclasses.replace(deep.quiet, inflight_images=95))
    d = wait_model.decide(deeper, deadline_s=5.0)  # quiet: 0.3 + 0.85 × 12 = 10.5 s: 6.33 s to drain to the edge
    assert (d.wait_ahead_s, d.wait_ahead_from) == (pytest.approx(10.5 - 5 / 1.2), "drain")
    unknown = dataclasses.replace(parked, quiet=dataclasses.replace(parked.quiet, fit=wait_model.WaitFit()))
    assert wait_model.decide(unknown, deadline_s=5.0) == plain
    # lane_load builds the quiet regime's load only beside chunks that all yield
    now = 1000.0
    entry = json.dumps({"capacity_ips": 8.0, "images_per_request": 1.0, "updated": now - 1})
    answers = [json.dumps({"admitted": now - 10 + i * 0.2, "answered": now - 9 + i * 0.2, "work_s": 0.8,
                           "predicted_s": 1.0, "status": 200, "images": 1, "ahead": 4, "bulk_at_admission": False})
               for i in range(20)]
    args = dict(queued_messages=0, inflight_images=15, workers={"w": entry}, answers=answers, now=now,
                lone=["0.6"], lone_quiet=["0.1"])
    assert wait_model.lane_load(**args, beside_bulk_now=True).quiet is None
    assert wait_model.lane_load(**args, bulk_yields=True).quiet is None  # nothing computes: one regime
    load = wait_model.lane_load(**args, beside_bulk_now=True, bulk_yields=True)
    assert load.fit == wait_model.WaitFit() and load.lone_overhead_s == pytest.approx(0.6)  # no bulk answer yet
    assert load.quiet.beside_bulk is False and load.quiet.quiet is None
    assert load.quiet.fit == wait_model.lane_load(**{**args, "lone": ["0.1"]}).fit and load.quiet.fit.samples == 20
    assert load.quiet.lone_overhead_s == pytest.approx(0.1)
    assert (load.quiet.inflight_images, load.quiet.capacity_ips) == (15, 8.0)


def test_an_empty_lane_is_predicted_from_what_lone_requests_waited():
    """After a 5 s phase whose waits did not follow their work, the fit said overhead 1.33 s and
    scale 0.25 (its floor): 1.47 s for a lone 0.55 s pass, refused at a 1 s deadline while lone
    requests waited 0.5-0.64 s. An empty lane is bounded by ``work_s`` + the lone requests' mean
    overhead (0.1 s): 0.65 s, admitted. A lane with a pass running keeps the fit; with no lone
    evidence, the fit alone (refused: the newest answer is fresh, so no probe)."""
    fit = wait_model.WaitFit(overhead_s=1.33, scale=0.25, margin_s=0.0, samples=40, age_s=1.0)
    empty = wait_model.LaneLoad(queued_messages=0, inflight_images=0, capacity_ips=1 / 0.55, workers=1,
                                curves=(({1: 550.0, 2: 700.0}, 8),), fit=fit, lone_overhead_s=0.1)
    d = wait_model.decide(empty, deadline_s=1.0)
    assert d.admitted and d.predicted_wait_s == pytest.approx(0.65)
    busy = dataclasses.replace(empty, inflight_images=1, passes=((1, 0.2),))
    assert busy.predicted_wait_s() == pytest.approx(1.33 + 0.25 * (0.2 + 0.55))
    unknown = dataclasses.replace(empty, lone_overhead_s=None)
    assert unknown.predicted_wait_s() == pytest.approx(1.33 + 0.25 * 0.55)
    assert not wait_model.decide(unknown, deadline_s=1.0).admitted
    # a fit below the lone figure is kept: the bound only ever lowers an empty lane's prediction
    low = dataclasses.replace(empty, fit=wait_model.WaitFit(overhead_s=0.02, samples=40, age_s=1.0))
    assert low.predicted_wait_s() == pytest.approx(0.57)
    # lane_load: the lone list's mean (≥ 0)
    entry = json.dumps({"capacity_ips": 2.0, "images_per_request": 1.0, "updated": 99.0})
    load = wait_model.lane_load(queued_messages=0, inflight_images=0, workers={"w": entry}, answers=[], now=100.0,
                                lone=["0.05", "0.15"])
    assert load.lone_overhead_s == pytest.approx(0.1)



# --- the pieces alone -----------------------------------------------------------------------------

def test_the_drain_rate_counts_only_the_tasks_that_ended_in_its_window():
    now = 100.0
    tasks = [(now - 15, now - 12, 6)]  # 6 images in 3 s busy, ended 12 s ago
    assert wait_model.drain_rate(tasks, now=now) is None  # outside the default 10 s
    assert wait_model.drain_rate(tasks, now=now, window_s=20) == 2.0
    assert wait_model.drain_rate([(now - 1, now - 0.5, 3), (now + 1, now + 2, 9)], now=now) == 6.0  # not yet ended


def test_the_backlog_counts_queued_requests_at_their_mean_size_and_an_empty_lane_its_lone_bound():
    """Three queued requests of 1.5 images and 2 in flight, both in a pass with 0.3 s left, at 4
    images/s: 6.5 images ahead; a request of one waits 0.3 + (6.5 − 2 + 1) / 4 = 1.675 s of work,
    0.1 + 2 × that = 3.45 s by the fit. In an empty lane the fit would say 0.1 + 2 × 0.25 = 0.6 s;
    the lone requests' 0.05 s over their work bound it to 0.3 s (0.55 s for two images)."""
    load = wait_model.LaneLoad(queued_messages=3, inflight_images=2, capacity_ips=4.0, images_per_request=1.5,
                               fit=wait_model.WaitFit(overhead_s=0.1, scale=2.0), workers=1, passes=((2, 0.3),),
                               lone_overhead_s=0.05)
    assert load.backlog_images == 6.5
    assert load.work_s(1) == pytest.approx(1.675) and load.predicted_wait_s(1) == pytest.approx(3.45)
    assert load.empty_lane_wait_s(1) == pytest.approx(0.3) and load.empty_lane_wait_s(2) == pytest.approx(0.55)
    unknown = dataclasses.replace(load, capacity_ips=None)
    assert (unknown.work_s(1), unknown.predicted_wait_s(1), unknown.empty_lane_wait_s(1)) == (None, None, None)


def test_the_lane_load_weighs_request_sizes_by_capacity_and_keeps_only_full_curves():
    """Two live workers, 6 images/s of two-image requests and 2 images/s of one-image ones: 8
    images/s of requests of 1.75 images on average. Only the worker that reported both its batch
    times and its largest batch has a curve; a lone overhead below zero counts as none (0 s)."""
    now = 100.0

    def entry(cap: float, per_request: float, **more) -> str:
        return json.dumps({"capacity_ips": cap, "images_per_request": per_request, "updated": now - 1, **more})

    load = wait_model.lane_load(queued_messages=0, inflight_images=0, answers=[], now=now, lone=["0.1", "-0.3"],
                                workers={"a": entry(6.0, 2.0, batch_ms={"1": 300.0, "8": 550.0}, max_batch=8),
                                         "b": entry(2.0, 1.0, batch_ms={"1": 200.0})})
    assert (load.capacity_ips, load.workers, load.images_per_request) == (8.0, 2, 1.75)
    assert load.curves == (({1: 300.0, 8: 550.0}, 8),) and load.lone_overhead_s == 0.0


def test_the_bulk_overlap_is_the_union_of_the_intervals_clipped_to_the_wait():
    """Runs 0-2 s and 1-3 s overlap (one interval, 1.5-3 s within a wait from 1.5 s), 5-6 s, and a
    chunk computing since 7.5 s counts until the answer at 8 s: 1.5 + 1 + 0.5 = 3 s."""
    assert wait_model.bulk_overlap_s([(0, 2), (1, 3), (5, 6)], [7.5], start=1.5, end=8) == 3.0
    assert wait_model.bulk_overlap_s([(0, 1)], [], start=2, end=3) == 0.0
    assert wait_model.bulk_overlap_s([], [9.0], start=2, end=3) == 0.0  # started after the answer


def test_an_answer_is_beside_bulk_work_from_a_quarter_of_its_wait():
    """``beside_bulk`` at ``BESIDE_BULK_SHARE`` (0.25) of a 2 s wait: 0.5 s of bulk computing is
    beside it, 0.49 s is not; then ``fit_regime`` goes by the regime it was admitted in."""
    assert wait_model.BESIDE_BULK_SHARE == 0.25
    record = {"admitted": 10.0, "answered": 12.0}
    assert wait_model.fit_regime({**record, "bulk_s": 0.5}) is True
    assert wait_model.fit_regime({**record, "bulk_s": 0.49}) is False
    assert wait_model.fit_regime({**record, "bulk_s": 0.49, "bulk_at_admission": True}) is None
    assert wait_model.fit_regime({**record, "bulk_s": 0.0, "bulk_at_admission": False}) is False
    assert wait_model.beside_bulk({**record, "bulk_s": None}) is False


def test_the_margin_is_the_late_errors_upper_bound():
    """``_upper_bound``: z(0.99) = 2.3263 × √(2 × the weighted mean of the squared late errors):
    errors +0.3 (weight 1), −0.5 (1, early: 0), +0.1 (2) → √(2 × 0.11 / 4) × 2.3263 = 0.5456 s.
    Early errors alone give no margin."""
    assert wait_model._normal_quantile(0.99) == pytest.approx(2.3263479, abs=1e-7)
    assert wait_model._normal_quantile(0.5) == 0.0
    assert wait_model._upper_bound([0.3, -0.5, 0.1], [1.0, 1.0, 2.0], 0.99) == pytest.approx(
        2.3263479 * math.sqrt(0.055), rel=1e-7)
    assert wait_model._upper_bound([-0.3, -0.1], [1.0, 1.0], 0.99) == 0.0


def test_a_refusals_first_wait_is_the_edge_the_drain_to_it_or_a_lone_requests_wait():
    """``first_wait_ahead`` at a 1 s deadline with a learnt margin of 0.2 s (floor 0.2 × the wait,
    cap 0.4 s): the edge is 0.8 s. A refused request predicted 0.95 s: the edge; 2 s: the 1.2 s the
    lane needs to drain to it; a lone request's 0.9 s when that is longer than both."""
    first = functools.partial(wait_model.first_wait_ahead, wait_model.WaitFit(margin_s=0.2), deadline_s=1.0,
                              min_share=0.2, max_s=0.4)
    assert wait_model.admission_edge_s(wait_model.WaitFit(margin_s=0.2), 1.0, min_share=0.2, max_s=0.4) == 0.8
    ahead, source = first(wait_s=0.95, alone_s=0.5)
    assert (ahead, source) == (pytest.approx(0.8), "edge")
    ahead, source = first(wait_s=2.0, alone_s=0.5)
    assert (ahead, source) == (pytest.approx(1.2), "drain")
    assert first(wait_s=0.95, alone_s=0.9) == (0.9, "alone")


def test_a_refusal_beside_yielding_bulk_work_says_the_quiet_lanes_wait_up_to_its_edge():
    """``parked_wait_ahead`` with the quiet regime's fit (edge 0.8 s as above): a backlog the quiet
    lane predicts at 0.6 s is what the request admitted once the chunks park waits (``parks``);
    past the edge, the edge (1.0 s predicted) or the drain to it (2.0 s: 1.2 s); a lone request's
    wait at least."""
    parked = functools.partial(wait_model.parked_wait_ahead, wait_model.WaitFit(margin_s=0.2), deadline_s=1.0,
                               min_share=0.2, max_s=0.4, alone_s=0.3)
    assert parked(wait_s=0.6) == (0.6, "parks")
    assert parked(wait_s=1.0) == (pytest.approx(0.8), "edge")
    assert parked(wait_s=2.0) == (pytest.approx(1.2), "drain")
    assert parked(wait_s=0.2) == (0.3, "alone")


def test_an_answer_record_is_parsed_once_and_shared_read_only():
    """``lane_load`` reads the same newest answers on every admission: each JSON text is parsed once
    per process, and the parsed record cannot be changed by one reader under another."""
    raw = json.dumps({"admitted": 100.0, "answered": 100.2, "images": 1, "status": 200, "work_s": 0.1})
    first = wait_model._record(raw)
    assert wait_model._record(raw) is first and dict(first) == json.loads(raw)
    with pytest.raises(TypeError):
        first["status"] = 504  # type: ignore[index]
    load = wait_model.lane_load(queued_messages=0, inflight_images=0, workers={}, answers=[raw, raw], now=100.5)
    assert load.fit.samples == 2
