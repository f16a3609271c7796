"""The load benchmark's judgement of a 429 (``benchmarks.load.summarise``): each one's
``wait_ahead_s`` (and its first estimate, before it was learnt) against the median wait of the
requests admitted within ±0.5 s of it, and the lane's own drift (that wait 1 s earlier)."""
from __future__ import annotations

import pytest

from benchmarks.load import actual_wait_near, summarise


def admitted(sent: float) -> dict:
    return {"sent": sent, "status": 200, "ms": 500.0 if sent < 2 else 1000.0}


def refused(sent: float, *, wait_ahead: float, first: float) -> dict:
    return {"sent": sent, "status": 429, "ms": 5.0, "code": "overloaded", "retry_after": "2",
            "wait_ahead_s": wait_ahead, "predicted_wait_s": 3.0, "model": {"first_wait_ahead_s": first}}


def test_each_429_is_judged_against_the_requests_admitted_around_it():
    # admitted every 0.25 s: 0.5 s waits before t = 2 s, 1 s waits from then on
    answers = [admitted(i / 4) for i in range(17)]
    answers += [refused(1.0, wait_ahead=0.5, first=0.8),   # around: 0.5 s; 1 s before: 0.5 s
                refused(2.6, wait_ahead=1.0, first=0.5),   # around: 1.0 s; 1 s before: 0.5 s (0.5, 0.5, 0.5, 1.0)
                refused(3.5, wait_ahead=0.6, first=1.0)]   # around: 1.0 s; 1 s before: 1.0 s
    assert [actual_wait_near(answers, t) for t in (1.0, 1.6, 2.6, 3.5)] == [0.5, 0.5, 1.0, 1.0]
    p = summarise(answers, rate=5.0, duration=4.0, deadline_s=2.0, capacity=4.0, web_records=[])
    assert p["retry_after_checked"] == 3 and p["by_status"] == {"200": 17, "429": 3}
    assert p["unrounded_within_30pct_share"] == pytest.approx(2 / 3, abs=1e-4)  # 0.6 is not within ±30 % of 1.0
    assert p["first_within_30pct_share"] == pytest.approx(1 / 3, abs=1e-4)      # only the last
    assert p["drift_within_30pct_share"] == pytest.approx(2 / 3, abs=1e-4)      # not at 2.6 s, where the wait doubled
    assert p["retry_after_not_early_share"] == 1.0 and p["retry_after_within_30pct_share"] == 0.0
    assert p["goodput_per_s"] == pytest.approx(17 / 4)
