"""The pure parts of ``benchmarks/keys_cost.py``: the arms' order, the web's own time, the summary,
the bootstrap interval and the verdict. No stack, no timing."""
from __future__ import annotations

import pytest

from benchmarks import keys_cost


def test_each_arm_goes_first_in_every_other_pair():
    order = [keys_cost.arm_order(p) for p in range(4)]
    assert order == [("on", "off"), ("off", "on"), ("on", "off"), ("off", "on")]
    firsts = [o[0] for o in order]
    assert firsts.count("on") == firsts.count("off")


def test_web_own_time_is_djangos_time_less_the_wait():
    record = {"start": 10.000, "sent": 10.015, "got": 10.215, "end": 10.220}
    assert keys_cost.web_own_ms(record) == pytest.approx(20.0)


def sample(arm: str, client: float, web: float | None, http: int = 200, status: str = "embedded") -> dict:
    return {"arm": arm, "client_ms": client, "web_ms": web, "http": http, "status": status,
            "ratelimit_headers": 6 if arm == "on" else 0}


def test_summary_takes_answered_requests_and_subtracts_off_from_on():
    samples = [sample("off", 200.0 + i, 20.0 + i / 10) for i in range(21)]
    samples += [sample("on", 201.0 + i, 20.5 + i / 10) for i in range(21)]
    samples += [sample("on", 5000.0, 900.0, http=202, status="queued"), sample("off", 1.0, None, 429, "overloaded")]
    side = keys_cost.summarise(samples)
    assert side["client_ms"]["on"]["n"] == side["client_ms"]["off"]["n"] == 21  # the 202 and the 429 are not timed
    assert side["client_ms"]["added"]["p50"] == pytest.approx(1.0)
    assert side["web_ms"]["added"]["p95"] == pytest.approx(0.5)
    assert side["outcomes"] == {"off 200 embedded": 21, "on 200 embedded": 21, "on 202 queued": 1,
                                "off 429 overloaded": 1}
    assert side["ratelimit_headers"] == {"off": [0], "on": [6]}


def test_bootstrap_interval_holds_a_shift_and_is_reproducible():
    off = [float(v) for v in range(100)]
    on = [v + 3.0 for v in off]
    lo, hi = keys_cost.delta_interval(on, off, 95, resamples=500)
    assert lo <= 3.0 <= hi
    assert keys_cost.delta_interval(on, off, 95, resamples=500) == (lo, hi)
    assert keys_cost.delta_interval([], off, 95) is None


def components(**p95: float) -> dict[str, list[float]]:
    """Timings whose every value is the given figure (so p50 = p95 = it)."""
    return {name: [p95.get(name, 0.1)] * 20 for name in keys_cost.COMPONENTS}


def test_direct_figure_is_the_per_request_sum_of_the_added_components():
    timings = components(key_lookup=0.5, scope=0.01, limit_requests=0.3, limit_images=0.3, metering=0.2,
                         token_before=5.0, token_now=5.2)
    stats = keys_cost.component_stats(timings)
    assert stats["added"]["p95"] == pytest.approx(1.31)  # the token lookups are for comparison only
    assert stats["added"]["n"] == 20


def test_verdict_adds_metering_and_the_token_miss_to_the_side_by_side_difference():
    side = keys_cost.summarise([sample("off", 200.0, 20.0 + i / 10) for i in range(21)]
                               + [sample("on", 200.0, 21.0 + i / 10) for i in range(21)])
    stats = keys_cost.component_stats(components(metering=0.3, token_before=0.4, token_now=0.6))
    direct, side_check = keys_cost.verdicts(side, stats)
    assert direct["value"] == pytest.approx(0.1 * 4 + 0.3) and direct["pass"]
    assert side_check["value"] == pytest.approx(1.0 + 0.3 + 0.2) and side_check["pass"]
    strict = keys_cost.verdicts(side, stats, target_ms=1.0)
    assert [c["pass"] for c in strict] == [True, False]
    assert "metering" in keys_cost.tables(side, stats)


def test_a_side_by_side_interval_across_the_target_is_flagged():
    stats = keys_cost.component_stats(components(metering=0.3, token_before=0.4, token_now=0.6))
    tight = keys_cost.summarise([sample("off", 200.0, 20.0 + i / 100) for i in range(200)]
                                + [sample("on", 200.0, 20.5 + i / 100) for i in range(200)])
    check = keys_cost.verdicts(tight, stats)[1]
    assert check["pass"] and check["resolved"] and "WARNING" not in check["detail"]
    # 20 requests an arm spread over 20 ms: p95's difference is known to a few ms at best
    wide = keys_cost.summarise([sample("off", 200.0, 20.0 + i) for i in range(20)]
                               + [sample("on", 200.0, 21.0 + i) for i in range(20)])
    check = keys_cost.verdicts(wide, stats)[1]
    assert not check["resolved"] and "WARNING" in check["detail"]
