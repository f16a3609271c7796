"""What a 429 says: the wait of a request admitted at the moment of a refusal, learnt from the lane's
own outcomes. Pure (no Redis): the app's lane control records each refusal's :data:`FEATURES`
(``lane_control.keys.REFUSALS_KEY``) and reads them back with the answers.

:func:`wait_model.decide` gives a first estimate of ``wait_ahead_s``: the admission edge
(``wait_model.admission_edge_s``; at least a lone request's). It is right on average and wrong in
the moment where the lane's state says more: the images in flight (a request admitted just before
the refusal is still waiting; its wait is in the label), the running forward pass (what it has
left, how many images it carries), and after a change of pace (the fit's answers lag one wait
behind).

So each refusal is **labelled**, once every request admitted within ±:data:`LABEL_WINDOW_S` of it
has been answered (none of them pending), with the median admitted→answered time of those
requests: the quantity the load benchmark checks a 429 against. A ridge regression
(:func:`fit_wait_ahead`) of the labels of the last :data:`FIT_WINDOW_S` s on the refusals' features,
each weighted by a :data:`HALF_LIFE_S` s half-life and by (mean label / label)² (relative errors: a
429 promises ±30 %), pulled towards "the first estimate as is" (:data:`RIDGE`), maps a new
refusal's features to its ``wait_ahead_s`` (:meth:`WaitAheadFit.predict`), within ×:data:`CLAMP` of
the first estimate. It changes only what a refusal says (``wait_ahead_s`` and ``Retry-After``),
never what is admitted: no feedback into the lane.

Labels are learnt from **per deadline band** (:func:`deadline_band`: deadlines within a factor of
:data:`DEADLINE_RATIO` share one): the deadline sets how deep admission lets the lane grow, so a fit
made on a 2 s lane's refusals extrapolates badly to a 5 s lane's. Until a band has
:data:`MIN_LABELLED` labels of its own, its refusals say the first estimate as is. The constants
were chosen by replay (``benchmarks.load_replay --wait-ahead``; docs/benchmarks-load.md, "What a 429
says, learnt" and "Deadline bands").
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from typing import Mapping, Sequence

import numpy as np

from queueing.wait_model import Decision, LaneLoad, margin_s, retry_after

#: A refusal's features, in the regression's order after the intercept (all from the
#: :class:`wait_model.LaneLoad` of the refusal and its first estimate): the first estimate (s),
#: images in flight, the longest running pass's seconds left, the running passes' images, queued
#: messages.
FEATURES = ("wait_ahead_s", "inflight_images", "running_pass_left_s", "running_pass_images", "queued_messages")
#: A refusal's label is the median wait of the requests admitted within ± this (s) of it: the load
#: benchmark's window (``benchmarks.load_judge.actual_wait_near``).
LABEL_WINDOW_S = 0.5
#: Refusals labelled in the last this-many seconds are fitted, each weighted
#: ``0.5 ** (age / HALF_LIFE_S)`` (age: since its label was complete).
FIT_WINDOW_S = 60.0
HALF_LIFE_S = 20.0
#: Ridge weight (in features scaled to their largest magnitude) of the pull towards the first
#: estimate as is (coefficient 1 on ``wait_ahead_s``, 0 elsewhere): with few or alike labels the
#: fit says what ``decide`` said.
RIDGE = 0.5
#: Labelled refusals needed before the fit is used (fewer: the first estimate as is). An overload's
#: first labels come from its first seconds, which a fit on too few of them carries into the seconds
#: after; more than 24 lowered other phases. Chosen by replay (``benchmarks.load_replay
#: --wait-ahead``; docs/benchmarks-load.md).
MIN_LABELLED = 24
#: Refusals are learnt from only by refusals whose deadlines are in the same band: ``round(log(deadline)
#: / log(DEADLINE_RATIO))`` (:func:`deadline_band`), so deadlines within about ×1.25 of each other share
#: labels (1 s, 2 s and 5 s each have their own; 2 s shares its band, 1.75-2.18 s, with 1.9 s).
DEADLINE_RATIO = 1.25
#: The learnt estimate stays within [first / CLAMP, first × CLAMP]: a guard against extrapolating
#: to a state the labels never saw, such as an overload's first refusals said by a fit learnt on
#: whatever came before it (the load benchmark's closed-loop capacity scan, whose clients back off
#: and keep the lane shallow). At 1.3 no fit can move a first estimate that was right out of the
#: ±30 % a 429 promises (first / 1.3 is 23 % under it); the fit can only mend wrong ones. Chosen by
#: replay (``benchmarks.load_replay --wait-ahead``; docs/benchmarks-load.md, "The wait model").
CLAMP = 1.3
#: A web process refits what a 429 says at most this often (s): a fit parses up to a thousand
#: refusals and as many answers, and refusals come several a second. The load replay refits as often.
REFIT_S = 1.0


def deadline_band(deadline_s: float) -> int:
    """The band of a request's deadline (s, > 0) whose refusals' labels it learns from: deadlines
    within a factor of about :data:`DEADLINE_RATIO` share a band. Pure.

    Raises:
        ValueError: ``deadline_s`` is not positive (the API refuses those before admission).
    """
    if not deadline_s > 0:
        raise ValueError(f"a deadline must be positive, not {deadline_s!r}")
    return round(math.log(deadline_s) / math.log(DEADLINE_RATIO))


def features(decision: Decision, load: LaneLoad) -> dict[str, float]:
    """A refusal's :data:`FEATURES` (``decision.wait_ahead_s`` is the first estimate, s). Pure."""
    return {"wait_ahead_s": float(decision.wait_ahead_s),
            "inflight_images": float(load.inflight_images),
            "running_pass_left_s": max((left for _, left in load.passes), default=0.0),
            "running_pass_images": float(sum(n for n, _ in load.passes)),
            "queued_messages": float(load.queued_messages)}


@dataclasses.dataclass(frozen=True)
class WaitAheadFit:
    """``wait_ahead_s ≈ coef · (1, *FEATURES)``, fitted on labelled refusals (:func:`fit_wait_ahead`).

    Attributes:
        coef: the intercept (s) then one coefficient per :data:`FEATURES` entry (s per unit).
        samples: labelled refusals the fit used (≥ :data:`MIN_LABELLED`).
    """

    coef: tuple[float, ...]
    samples: int

    def predict(self, x: Mapping[str, float]) -> float:
        """The learnt wait (s) of a request admitted at a refusal with features ``x``, within
        [first / :data:`CLAMP`, first × :data:`CLAMP`] of its first estimate ``x["wait_ahead_s"]``."""
        first = float(x["wait_ahead_s"])
        y = self.coef[0] + sum(c * float(x[k]) for c, k in zip(self.coef[1:], FEATURES))
        return min(max(y, first / CLAMP), first * CLAMP)


def labels(refusals: Sequence[Mapping], answers: Sequence[Mapping], *, pending_admitted: Sequence[float],
           now: float, deadline_s: float | None = None) -> list[tuple[Mapping, float, float]]:
    """The refusals whose label is known at ``now``: ``(refusal, label_s, complete_at)`` each. Pure.

    With ``deadline_s``, only the refusals of its :func:`deadline_band` (``refusal["deadline_s"]``;
    one without it, recorded before deadlines were, is of no band).

    A refusal at ``t`` (``refusal["t"]``, Unix s) is labelled when ``now ≥ t + LABEL_WINDOW_S``, no
    admitted request in ``[t − w, t + w]`` is still pending (``pending_admitted``: their admission
    times) and at least one was answered (``answers``: ``admitted`` and ``answered``, Unix s; a 202
    counts with its wait, a lower bound, as in the benchmark). ``label_s`` is the median
    admitted→answered time of those answers, ``complete_at`` when the last of them was answered
    (at least ``t + w``). Refusals older than :data:`FIT_WINDOW_S` are left out.
    """
    w = LABEL_WINDOW_S
    rows = sorted((float(a["admitted"]), float(a["answered"])) for a in answers)
    admitted = [r[0] for r in rows]
    waiting = sorted(pending_admitted)
    band = None if deadline_s is None else deadline_band(deadline_s)
    out = []
    for r in refusals:
        if band is not None and (not r.get("deadline_s") or deadline_band(float(r["deadline_s"])) != band):
            continue
        t = float(r["t"])
        if t + w > now or now - (t + w) > FIT_WINDOW_S:
            continue
        lo = bisect.bisect_left(waiting, t - w)
        if lo < len(waiting) and waiting[lo] <= t + w:
            continue  # an admitted request of its window is not answered yet
        near = rows[bisect.bisect_left(admitted, t - w):bisect.bisect_right(admitted, t + w)]
        if not near:
            continue
        label = statistics.median(answered - adm for adm, answered in near)
        if label > 0:
            out.append((r, label, max(t + w, max(answered for _, answered in near))))
    return out


def fit_wait_ahead(refusals: Sequence[Mapping], answers: Sequence[Mapping], *, pending_admitted: Sequence[float],
                   now: float, deadline_s: float | None = None) -> WaitAheadFit | None:
    """Fit :class:`WaitAheadFit` on the refusals labelled by ``now`` (:func:`labels`; with
    ``deadline_s``, those of its deadline band alone). Pure.

    Weighted ridge least squares in features scaled to their largest magnitude (so :data:`RIDGE`
    means the same whatever the units), weights ``0.5 ** (age / HALF_LIFE_S) × (mean label / label)²``
    (relative errors; a fresh label weighs about 1 at any deadline), pulled to coefficient 1 on the
    first estimate and 0 elsewhere.

    Returns:
        The fit, or ``None`` with fewer than :data:`MIN_LABELLED` labelled refusals (of the band).
    """
    rows = labels(refusals, answers, pending_admitted=pending_admitted, now=now, deadline_s=deadline_s)
    if len(rows) < MIN_LABELLED:
        return None
    x = np.array([[1.0, *(float(r[k]) for k in FEATURES)] for r, _, _ in rows])
    y = np.array([label for _, label, _ in rows])
    # relative errors, in units of the labels' mean: each fresh label weighs about 1 whatever the
    # deadline, so RIDGE means the same at 1 s and at 5 s
    w = np.array([0.5 ** (max(0.0, now - done) / HALF_LIFE_S) for _, _, done in rows]) * (y.mean() / y) ** 2
    scale = np.maximum(np.abs(x).max(axis=0), 1e-6)
    xs = x / scale
    prior = np.zeros(x.shape[1])
    prior[1 + FEATURES.index("wait_ahead_s")] = 1.0
    prior *= scale  # the prior's coefficients in scaled units
    a = xs.T @ (xs * w[:, None]) + RIDGE * np.eye(x.shape[1])
    b = xs.T @ (w * y) + RIDGE * prior
    coef = np.linalg.solve(a, b) / scale
    return WaitAheadFit(coef=tuple(float(c) for c in coef), samples=len(rows))


def learnt(decision: Decision, load: LaneLoad, fit: WaitAheadFit | None, *, min_share: float,
           max_margin_s: float) -> Decision:
    """A refusal with its ``wait_ahead_s`` learnt (:meth:`WaitAheadFit.predict`) and its
    ``retry_after_s`` and ``retry_margin_s`` made again from it as :func:`wait_model.decide` makes
    them (that wait plus its margin, rounded up); ``decision`` as is when ``fit`` is ``None``. Pure."""
    if fit is None or decision.admitted or decision.wait_ahead_s is None:
        return decision
    ahead = fit.predict(features(decision, load))
    late = margin_s(load.fit, ahead, min_share=min_share, max_s=max_margin_s)
    return dataclasses.replace(decision, wait_ahead_s=ahead, retry_margin_s=late,
                               retry_after_s=retry_after(ahead + late), first_wait_ahead_s=decision.wait_ahead_s,
                               wait_ahead_samples=fit.samples)
