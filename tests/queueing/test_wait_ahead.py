"""What a 429 says, learnt from earlier refusals' outcomes (queueing/wait_ahead.py). Pure: injected
clocks, refusal and answer records as lane control writes them to Redis; no Django, no Redis."""
from __future__ import annotations

import math

import pytest

from queueing import wait_ahead
from queueing import wait_model


def refusal(t: float, *, first: float = 0.5, inflight: float = 2, left: float = 0.1, running: float = 1,
            queued: float = 0) -> dict:
    return {"t": t, "wait_ahead_s": first, "inflight_images": inflight, "running_pass_left_s": left,
            "running_pass_images": running, "queued_messages": queued}


def answer(admitted: float, wait: float, status: int = 200) -> dict:
    return {"admitted": admitted, "answered": admitted + wait, "status": status, "images": 1,
            "work_s": None, "predicted_s": None, "ahead": None}


def test_a_refusal_is_labelled_with_the_median_wait_of_the_requests_admitted_around_it():
    r = refusal(10.0)
    # admitted within ±0.5 s: waits 0.4, 0.9, 0.6 (median 0.6); 10.6 and 9.4 are outside the window
    answers = [answer(9.4, 3.0), answer(9.6, 0.4), answer(9.9, 0.9), answer(10.3, 0.6), answer(10.6, 3.0)]
    (got, label, complete), = wait_ahead.labels([r], answers, pending_admitted=[], now=12.0)
    assert got is r and label == pytest.approx(0.6) and complete == pytest.approx(10.9)  # the last answered
    # not before its window has closed, nor while a request admitted in it is still waiting
    assert wait_ahead.labels([r], answers, pending_admitted=[], now=10.4) == []
    assert wait_ahead.labels([r], answers, pending_admitted=[10.45], now=12.0) == []
    assert len(wait_ahead.labels([r], answers, pending_admitted=[10.55, 9.45], now=12.0)) == 1
    # no request admitted around it: nothing to learn from; older than the fit's window: dropped
    assert wait_ahead.labels([refusal(20.0)], answers, pending_admitted=[], now=22.0) == []
    assert wait_ahead.labels([r], answers, pending_admitted=[], now=10.5 + wait_ahead.FIT_WINDOW_S + 0.1) == []


def lane(n: int, *, truth, start: float = 0.0, every: float = 1.0):
    """``n`` refusals every ``every`` s with in-flight images cycling 1..8 (the running pass and the
    first estimate, 0.45-0.55 s, vary on other cycles), each with one request admitted 0.1 s after
    it that waited ``truth(inflight)``."""
    refusals, answers = [], []
    for i in range(n):
        t, inflight = start + i * every, 1 + i % 8
        refusals.append(refusal(t, first=0.45 + 0.05 * (i % 3), inflight=inflight, left=0.05 * (i % 5),
                                running=1 + i % 7))
        answers.append(answer(t + 0.1, truth(inflight)))
    return refusals, answers


def test_the_fit_learns_what_the_first_estimate_misses(monkeypatch):
    """The first estimate says about 0.5 s whatever the lane holds; the requests admitted around
    each refusal waited 0.15 s + 0.1 s per image in flight. Without the ridge the fit finds that
    exactly; with it, the learnt estimate lies between the two, near the truth. (The clamp to a
    factor of the first estimate is tested apart: the truth here reaches 1.9× it.)"""
    monkeypatch.setattr(wait_ahead, "CLAMP", 10.0)

    def truth(inflight):
        return 0.15 + 0.1 * inflight

    refusals, answers = lane(48, truth=truth)
    now = refusals[-1]["t"] + 5
    fit = wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=now)
    assert fit is not None and fit.samples == 48
    for inflight in (2, 5, 8):
        x = refusal(now, inflight=inflight, left=0.1, running=2)
        first, got, want = x["wait_ahead_s"], fit.predict(x), truth(inflight)
        assert min(first, want) <= got <= max(first, want) and got == pytest.approx(want, rel=0.1)
    monkeypatch.setattr(wait_ahead, "RIDGE", 1e-12)
    fit = wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=now)
    assert fit.coef == pytest.approx((0.15, 0.0, 0.1, 0.0, 0.0, 0.0), abs=1e-6)
    assert fit.predict(refusal(now, inflight=7)) == pytest.approx(truth(7), rel=1e-6)


def test_with_few_labels_the_first_estimate_stands():
    refusals, answers = lane(wait_ahead.MIN_LABELLED - 1, truth=lambda n: 0.1 * n)
    assert wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=30.0) is None
    refusals, answers = lane(wait_ahead.MIN_LABELLED, truth=lambda n: 0.1 * n)
    fit = wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=30.0)
    assert fit.samples == wait_ahead.MIN_LABELLED
    # requests admitted around each refusal waited what it said: the fit says what it said
    refusals, answers = lane(48, truth=lambda n: 0.0)
    answers = [answer(a["admitted"], r["wait_ahead_s"]) for a, r in zip(answers, refusals)]
    fit = wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=50.0)
    assert fit.coef == pytest.approx((0.0, 1.0, 0.0, 0.0, 0.0, 0.0), abs=1e-9)


def test_the_learnt_estimate_stays_within_a_factor_of_the_first():
    fit = wait_ahead.WaitAheadFit(coef=(5.0, 0.0, 0.0, 0.0, 0.0, 0.0), samples=20)
    assert fit.predict(refusal(0.0, first=0.4)) == pytest.approx(0.4 * wait_ahead.CLAMP)
    fit = wait_ahead.WaitAheadFit(coef=(-5.0, 0.0, 0.0, 0.0, 0.0, 0.0), samples=20)
    assert fit.predict(refusal(0.0, first=0.4)) == pytest.approx(0.4 / wait_ahead.CLAMP)


def test_no_fit_moves_a_right_first_estimate_out_of_the_issue_s_30_percent():
    """At the shipped clamp (1.3: first / 1.3 is 23 % under it, first × 1.3 30 % over it) a fit
    learnt on another regime's refusals (an overload's first seconds said by the capacity scan's
    fit) can cost no 429 whose first estimate was right; at 1.5 it could (first / 1.5 is 33 % under)."""
    assert wait_ahead.CLAMP == 1.3
    for intercept in (-50.0, -0.3, 0.3, 50.0):
        fit = wait_ahead.WaitAheadFit(coef=(intercept, 0.0, 0.0, 0.0, 0.0, 0.0), samples=30)
        for first in (0.6, 1.4, 4.0):
            assert abs(fit.predict(refusal(0.0, first=first)) - first) <= 0.3 * first + 1e-9


def test_a_learnt_refusal_says_its_wait_and_a_retry_after_made_from_it():
    load = wait_model.LaneLoad(queued_messages=3, inflight_images=5, capacity_ips=4.0,
                               fit=wait_model.WaitFit(overhead_s=0.1, scale=1.0, margin_s=0.3, samples=20, age_s=0.0),
                               workers=1, passes=((2, 0.25),))
    first = wait_model.Decision(False, 1.9, retry_after_s=2, wait_ahead_s=1.2, retry_margin_s=0.3)
    fit = wait_ahead.WaitAheadFit(coef=(0.0, 0.5, 0.1, 1.0, 0.0, 0.05), samples=40)
    got = wait_ahead.learnt(first, load, fit, min_share=0.2, max_margin_s=0.8)
    ahead = 0.0 + 0.5 * 1.2 + 0.1 * 5 + 1.0 * 0.25 + 0.0 * 2 + 0.05 * 3  # = 1.5 s, within the clamp of 1.2 s
    assert got.wait_ahead_s == pytest.approx(ahead) and got.first_wait_ahead_s == 1.2 and got.wait_ahead_samples == 40
    assert got.retry_margin_s == pytest.approx(0.3)  # the learnt margin, over 0.2 × 1.5 s
    assert got.retry_after_s == math.ceil(ahead + 0.3) == 2
    assert not got.admitted and got.predicted_wait_s == 1.9  # what was decided is unchanged
    assert wait_ahead.learnt(first, load, None, min_share=0.2, max_margin_s=0.8) is first


def test_a_refusal_is_learnt_from_only_by_refusals_of_its_deadline_band():
    """A 2 s lane's refusals, whose admitted requests waited 0.1 s an image in flight, and a 5 s
    lane's just after, whose waited three times that: a 5 s refusal learns from the 5 s labels
    alone and a 2 s one from the 2 s labels (1.9 s shares 2 s's band; 1 s and 5 s have their own);
    with too few labels in its band, a refusal says its first estimate as is (no fit), whatever
    the other bands hold. A refusal recorded without a deadline belongs to no band."""
    assert wait_ahead.deadline_band(1.9) == wait_ahead.deadline_band(2.0) == wait_ahead.deadline_band(2.1)
    assert len({wait_ahead.deadline_band(d) for d in (0.5, 1.0, 2.0, 5.0)}) == 4
    with pytest.raises(ValueError):
        wait_ahead.deadline_band(0.0)
    # 0.7 s apart: each refusal's ±0.5 s window holds its own admitted request alone
    two, two_answers = lane(32, truth=lambda n: 0.1 * n, every=0.7)
    five, five_answers = lane(32, truth=lambda n: 0.3 * n, start=22.4, every=0.7)
    refusals = [{**r, "deadline_s": 2.0} for r in two] + [{**r, "deadline_s": 5.0} for r in five]
    answers = two_answers + five_answers
    now = 60.0
    fits = {d: wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=now, deadline_s=d)
            for d in (1.9, 5.0)}
    assert fits[1.9].samples == 32 and fits[5.0].samples == 32
    # each the fit of its own band's refusals alone, as if the other band had never been refused
    alone = {1.9: wait_ahead.fit_wait_ahead(two, two_answers, pending_admitted=[], now=now),
             5.0: wait_ahead.fit_wait_ahead(five, five_answers, pending_admitted=[], now=now)}
    for d in fits:
        assert fits[d].coef == pytest.approx(alone[d].coef, abs=1e-12)
    x = refusal(now, first=0.5, inflight=6, running=2)
    assert fits[1.9].predict(x) < 0.6 < fits[5.0].predict(x)  # truths 0.6 and 1.8 s, pulled to the first, 0.5 s
    assert wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=now, deadline_s=1.0) is None
    few, few_answers = lane(wait_ahead.MIN_LABELLED - 1, truth=lambda n: 0.05 * n,
                            start=now - 1.0 - 0.7 * (wait_ahead.MIN_LABELLED - 2), every=0.7)
    few = [{**r, "deadline_s": 1.0} for r in few]
    assert len(wait_ahead.labels(few, few_answers, pending_admitted=[], now=now, deadline_s=1.0)) == len(few)
    assert wait_ahead.fit_wait_ahead(refusals + few, answers + few_answers, pending_admitted=[], now=now,
                                     deadline_s=1.0) is None
    # no deadline asked: every band, as before deadlines were recorded; none recorded: no band
    assert wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=now).samples == 64
    assert wait_ahead.labels(two, two_answers, pending_admitted=[], now=now, deadline_s=2.0) == []


def test_deadlines_within_a_quarter_share_a_band():
    """``round(log(deadline) / log(1.25))``: 0.5 s, 1 s, 2 s and 5 s are bands −3, 0, 3 and 7."""
    assert wait_ahead.DEADLINE_RATIO == 1.25
    assert [wait_ahead.deadline_band(d) for d in (0.5, 1.0, 2.0, 5.0)] == [-3, 0, 3, 7]
    assert wait_ahead.deadline_band(1.11) == 0 and wait_ahead.deadline_band(1.12) == 1  # the edge: 1.25 ** 0.5


def test_a_refusals_features_are_its_first_estimate_and_the_lane_it_saw():
    """``features``: the first estimate, images in flight, the longest running pass's time left, the
    running passes' images, queued messages, as floats in :data:`FEATURES` order."""
    load = wait_model.LaneLoad(queued_messages=3, inflight_images=5, capacity_ips=4.0, passes=((2, 0.25), (1, 0.4)))
    refused = wait_model.Decision(False, 1.9, wait_ahead_s=1.2)
    got = wait_ahead.features(refused, load)
    assert list(got) == list(wait_ahead.FEATURES)
    assert got == {"wait_ahead_s": 1.2, "inflight_images": 5.0, "running_pass_left_s": 0.4,
                   "running_pass_images": 3.0, "queued_messages": 3.0}
    assert wait_ahead.features(refused, wait_model.LaneLoad(0, 0, None))["running_pass_left_s"] == 0.0


def test_a_label_counts_a_202_with_its_wait_and_is_complete_with_its_last_answer():
    """A 202 waited at least its deadline: its wait counts as it is (the benchmark judges it so).
    Two answers around a refusal at 10 s, 0.4 s (a 202) and 0.8 s: the median 0.6 s, complete when
    the later was answered, 11.0 s. A refusal of another deadline band is not labelled for this
    one; one recorded without a deadline is of no band."""
    answers = [answer(9.8, 0.4, status=202), answer(10.2, 0.8)]
    (r, label, complete), = wait_ahead.labels([refusal(10.0)], answers, pending_admitted=[], now=12.0)
    assert label == pytest.approx(0.6) and complete == pytest.approx(11.0)
    two = {**refusal(10.0), "deadline_s": 2.0}
    assert len(wait_ahead.labels([two], answers, pending_admitted=[], now=12.0, deadline_s=2.1)) == 1
    assert wait_ahead.labels([two], answers, pending_admitted=[], now=12.0, deadline_s=5.0) == []
    assert wait_ahead.labels([refusal(10.0)], answers, pending_admitted=[], now=12.0, deadline_s=2.0) == []


def test_an_admission_or_an_unestimated_refusal_is_said_as_decided():
    """``learnt`` changes only a refusal with a first estimate: an admission, or a refusal without
    ``wait_ahead_s``, is returned as is whatever the fit."""
    load = wait_model.LaneLoad(queued_messages=0, inflight_images=0, capacity_ips=4.0)
    fit = wait_ahead.WaitAheadFit(coef=(1.0, 0.0, 0.0, 0.0, 0.0, 0.0), samples=30)
    admitted = wait_model.Decision(True, 0.4, work_s=0.25)
    bare = wait_model.Decision(False, 3.0)
    assert wait_ahead.learnt(admitted, load, fit, min_share=0.2, max_margin_s=0.8) is admitted
    assert wait_ahead.learnt(bare, load, fit, min_share=0.2, max_margin_s=0.8) is bare


def test_the_web_refits_what_a_429_says_at_most_once_a_second():
    """``REFIT_S``: lane control and the load replay refit the learnt estimate this often (s)."""
    assert wait_ahead.REFIT_S == 1.0
