"""How the load benchmark judges a phase's answers, shared by the benchmark (``benchmarks.load``) and
its offline replay (``benchmarks.load_replay``), which must judge a recorded run the same way without
Django, Redis or the stack: the standard library only.
"""
from __future__ import annotations

import statistics

#: A 429's ``Retry-After`` (and ``wait_ahead_s``) counts as right within this share of the actual
#: wait (±30 %: the load benchmark's target, docs/benchmarks-load.md).
RETRY_AFTER_TOLERANCE = 0.30


def actual_wait_near(answers: list[dict], t: float, *, window_s: float = 0.5) -> float | None:
    """Median latency (s) of admitted requests (200/202) sent within ±``window_s`` of ``t`` (±2×
    that when none were); ``None`` when none at all. A 202's latency is a lower bound of its wait."""
    for w in (window_s, 2 * window_s):
        near = [a["ms"] / 1000 for a in answers if a["status"] in (200, 202) and abs(a["sent"] - t) <= w]
        if near:
            return statistics.median(near)
    return None


def phase_name(phase: dict) -> str:
    """A phase's name in tables and checks: its deadline, "+ bulk" beside a bulk job ("2 s + bulk")."""
    return f"{phase['deadline_s']:g} s{' + bulk' if phase.get('bulk') else ''}"
