"""The wait model of interactive admission: numbers in, numbers out (no Django, Redis or Celery).

The app's lane control reads what the interactive lane holds and builds a :class:`LaneLoad`
(:func:`lane_load`); :func:`decide` then admits a request or refuses it. Everything here takes
injected clocks and records. A request is refused when the predicted wait for its answer, plus a
margin, is longer than its deadline. The prediction is the whole admitted→answered time::

    images = queued messages × images per request + images in flight + its own images
             − the images of the forward passes running now
    work_s = what the running passes have left (the longest)
             + the forward passes that drain the images, full batches first, at each live
             worker's measured per-batch-size service times (images shared by the workers'
             rates), the last, partial pass with the images admitted behind it before it
             starts (``arrivals_ips`` × its start, up to a full batch: :func:`drain_s`);
             images / Σ capacity of the live workers (images/s) until every one reported them
    wait_s = overhead_s + scale × work_s        (admit when wait_s + margin_s ≤ deadline,
                                                 margin_s ≥ min_margin_share × wait_s)

- *running passes* count as the time they have left, not as a whole pass: a request arriving
  0.9 s into a 1 s pass waits 0.1 s for it. Counted whole, the pass's phase was the prediction's
  largest error, and the margin had to cover it.
- *capacity*: each worker's own drain rate (:func:`drain_rate`: decode, batching window, forward
  passes at whatever batch sizes the load formed, whatever else steals its cores), summed over the
  workers whose entry is younger than :data:`WORKER_TTL_S`: two workers admit twice the backlog of
  one at the same predicted wait, and a killed one stops counting within seconds.
- *per-batch-size service times* (:func:`update_batch_curve`): a backlog of eight is one batch of
  eight, not eight lone passes (:func:`drain_s`). With the drain rate alone, an admission that kept
  the queue short measured batches of one, predicted long waits and kept the queue short.
- *overhead, scale, margin* (:func:`fit_wait`): a recency-weighted fit of ``wait = overhead +
  scale × work`` on the answers of the last :data:`FIT_WINDOW_S` s. ``scale`` absorbs what the
  workers' figure misses (the vectors hop, the web, a machine slower than a moment ago),
  ``overhead`` what every request pays, ``margin`` the late side of admission's own errors
  (:func:`_upper_bound`). Admitted requests that have already waited longer than predicted count
  before their answer.
- *regime*: a bulk chunk computing on the same cores makes every request wait longer than its
  work, and an overload makes the bulk job park, so the lane switches between two regimes that
  admission's own refusals cause. Each answer records the seconds of its wait beside bulk work
  (:func:`bulk_overlap_s`); the fit and the lone overheads are learnt per regime
  (:func:`fit_regime`) and used by the regime of the moment (:func:`lane_load`).

With no worker measurement yet every request is admitted: there is nothing to predict with. A lane
with at most :data:`SHALLOW_REQUESTS` requests' images ahead is spared the margin (the predicted wait
alone must fit), an empty lane admits a probe once the newest answer is stale (:func:`decide`), and
an empty lane's prediction is at most ``work_s`` plus what lone requests measured
(:meth:`LaneLoad.predicted_wait_s`). The measurements behind the constants: docs/benchmarks-load.md
and its history appendix, by the section titles cited below.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from typing import Sequence


#: Admission's margin policy, the defaults of ``ADMISSION_MARGIN_QUANTILE``,
#: ``ADMISSION_MIN_MARGIN_SHARE`` and ``ADMISSION_MAX_MARGIN_SHARE`` (project/settings.py says why
#: each): the quantile of late errors the margin covers, its floor as a share of the predicted wait,
#: its cap as a share of the deadline.
MARGIN_QUANTILE = 0.99
MIN_MARGIN_SHARE = 0.2
MAX_MARGIN_SHARE = 0.4

#: A worker whose entry is older than this (s) is gone: its capacity no longer counts. Three missed
#: heartbeats of 5 s (``lane_control.reports.HEARTBEAT_S``).
WORKER_TTL_S = 15.0
#: A worker's capacity is the images it finished over the last this-many seconds divided by the
#: time it was busy in them (s): short enough to follow a machine that slows within seconds.
DRAIN_WINDOW_S = 10.0
#: Weight of a new forward pass in a worker's per-batch-size service time (EWMA per batch size,
#: :func:`update_batch_curve`): a size seen five times since a change is ~83 % of the way there.
BATCH_EWMA_ALPHA = 0.3
#: The wait model is fitted on answers of the last this-many seconds, each weighted by recency twice
#: over: ``0.5 ** (age / FIT_HALF_LIFE_S)`` (time) × ``0.5 ** (newer / FIT_HALF_LIFE_ANSWERS)``
#: (observations: ``newer`` answers arrived after it). The weighted fit is an exponentially weighted
#: moving average of the lane's whole admitted→answered service times: under load a change of the
#: machine's speed is followed within 16 answers, whatever the answer rate; with few answers, within
#: ~10 s. Shorter half-lives forget the last peak of a 2× overload by the next one (an answer arrives
#: one wait after its admission) and run a limit cycle. Chosen by replay (benchmarks/load_replay.py;
#: docs/benchmarks-load.md, "Half-lives and the margin").
FIT_WINDOW_S = 30.0
FIT_HALF_LIFE_S = 10.0
FIT_HALF_LIFE_ANSWERS = 16.0
#: The margin's errors are weighted the same way with their own half-lives: 16 answers (a spread
#: needs more than the last handful of answers to mean anything) and 5 s, so that a margin learnt in
#: a bad moment fades within seconds when no answer comes to correct it.
MARGIN_HALF_LIFE_ANSWERS = 16.0
MARGIN_HALF_LIFE_S = 5.0
#: A request answered 202 waited *at least* its deadline; it enters the fit as this × its wait.
CENSORED_FACTOR = 1.25
#: Ridge pull of the fitted scale towards 1 (s²): with few or tightly bunched answers the workers'
#: own capacity figure is trusted; ~ one fresh answer with 0.3 s of work ahead (the answers of the
#: fit weigh ~9 fresh ones in all under load).
PRIOR_WEIGHT = 0.1
#: The margin is scaled by ``W / (W + MARGIN_PRIOR_WEIGHT)``, ``W`` the answers' summed time weights
#: (a fresh answer weighs 1): old evidence fades, so a margin learnt in a bad moment cannot keep
#: refusing everything once no new answer arrives to correct it (seen in the load benchmark).
MARGIN_PRIOR_WEIGHT = 2.0
#: An empty lane admits one request (a probe) when the newest answer is older than this (s), even
#: if the model predicts a miss: without answers the model cannot learn that the machine got faster.
PROBE_AFTER_S = 5.0
#: A lane with at most this many requests' images ahead of a request (queued and in flight) admits
#: it whatever the margin, when its predicted wait alone fits (:func:`decide`): it joins the next
#: forward pass, and its answer is what tells a model learnt in a bad moment that the lane has
#: drained. With 0 (an empty lane only), the fit and margin learnt from a burst of late answers kept
#: a 1 s lane one or two requests deep for seconds while those answered well within the deadline
#: (docs/benchmarks-load.md, "Shallow lanes").
SHALLOW_REQUESTS = 1
#: Weight of the pull of the fit's intercept towards the lone requests' mean overhead
#: (``lane_control.keys.LONE_KEY``, :func:`_solve`), in fresh answers: under a steady overload the
#: answers' works are bunched and say little about the intercept apart from the slope, and the fit
#: wandered (docs/benchmarks-load.md, "Starved lanes").
OVERHEAD_PRIOR_WEIGHT = 2.0
#: What admitted requests were promised over the last this-many seconds (answered or not):
#: ``LaneLoad.recent_admitted_s``, and the arrivals that join the last, partial pass
#: (``arrivals_ips``).
RECENT_ADMISSIONS_S = 2.0
#: An answer waited *beside bulk work* when bulk chunks computed on the machine for at least this
#: share of its admitted→answered time (:func:`beside_bulk`). The wait model keeps one fit per
#: regime (:func:`lane_load`): a bulk job that computes between an under-loaded lane's requests
#: makes them wait longer than their work, and an overload makes that job park, so one intercept
#: learnt across the switch over-predicted the first seconds of every overload beside a bulk job
#: (docs/benchmarks-load.md, "Two regimes"). A quarter: a request that only met the tail of a
#: micro-batch is not beside it.
BESIDE_BULK_SHARE = 0.25


def bulk_overlap_s(runs: Sequence[tuple[float, float]], computing: Sequence[float], *, start: float,
                   end: float) -> float:
    """Seconds of ``[start, end]`` (Unix s) during which at least one bulk chunk computed. Pure.

    Args:
        runs: ``(start, end)`` (Unix s) of finished computing intervals (``lane_control.keys.BULK_RUNS_KEY``).
        computing: when each chunk computing now started (Unix s, ``keys.BULK_ACTIVITY_KEY``);
            counted as computing until ``end``.

    Returns:
        The length (s, ≥ 0) of the union of the intervals clipped to ``[start, end]``.
    """
    spans = sorted((max(a, start), min(b, end)) for a, b in [*runs, *((c, end) for c in computing)])
    total, cur_s, cur_e = 0.0, None, None
    for a, b in spans:
        if b <= a:
            continue
        if cur_e is None or a > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def fit_regime(record: dict) -> bool | None:
    """The regime whose fit an answer record (``lane_control.interactive_answered``) teaches: ``True``
    beside bulk work (:func:`beside_bulk`), ``False`` the quiet lane, ``None`` neither: admitted
    while bulk chunks computed (``bulk_at_admission``; absent: not recorded) but waited mostly after
    they parked. Pure.

    Its wait mixes both regimes, and what it got wrong is the switch, which neither fit predicts.
    Under a 2× overload that starts beside a bulk job the chunks park within a micro-batch of the
    first refusal; the requests admitted before, predicted by the bulk fit and answered in the quiet
    lane, would be the quiet fit's newest evidence and make it over-predict the quiet lane
    (docs/benchmarks-load.md, "The switch out of the bulk regime")."""
    if beside_bulk(record):
        return True
    return None if record.get("bulk_at_admission") else False


def beside_bulk(record: dict) -> bool:
    """Whether an answer record (``lane_control.interactive_answered``) waited beside bulk work:
    its ``bulk_s`` (s of its wait during which a bulk chunk computed; absent: none recorded) at
    least :data:`BESIDE_BULK_SHARE` of its wait, and > 0. Pure."""
    bulk = record.get("bulk_s") or 0.0
    return bulk > 0 and bulk >= BESIDE_BULK_SHARE * (record["answered"] - record["admitted"])


def parse_bulk_activity(raw: dict[str, str], *, now: float,
                        stale_s: float) -> tuple[list[float], list[str], bool]:
    """Parse ``lane_control.keys.BULK_ACTIVITY_KEY`` (``{process: "since"}`` or ``"since y"``). Pure.

    Returns:
        ``(since, stale, yielding)``: when each chunk computing now started (Unix s), for the
        entries younger than ``stale_s`` s; the fields older than that or unreadable (a process
        killed while computing), to delete; and whether every chunk computing now yields to the
        interactive lane while it refuses (its mark ends in ``y``: ``lane_control.bulk_yield.BulkActivity``'s
        ``yields``, a background ingest or migration chunk), ``False`` with none computing.
    """
    since, stale, yielding = [], [], True
    for field, value in raw.items():
        try:
            t, *flags = value.split()
            t = float(t)
        except ValueError:
            stale.append(field)
            continue
        if now - t > stale_s:
            stale.append(field)
        else:
            since.append(t)
            yielding = yielding and flags == ["y"]
    return since, stale, bool(since) and yielding


@dataclasses.dataclass(frozen=True)
class WaitFit:
    """``wait_s = overhead_s + scale × work_s``, fitted on recent answered requests (:func:`fit_wait`).

    Attributes:
        overhead_s: seconds every request waits whatever the backlog (decode, batching window, the
            vectors hop, the web's own round trips).
        scale: actual drain time / the workers' own capacity figure (1.0: the workers are right).
        margin_s: s (≥ 0) added to a prediction before it is compared with the deadline: the
            ``ADMISSION_MARGIN_QUANTILE`` quantile of recent errors (actual − predicted at
            admission) were they zero-mean normal, their spread taken from the late ones
            (:func:`_upper_bound`).
        samples: answers the fit used (0: the prior ``overhead 0, scale 1, margin 0``).
        age_s: seconds since the newest answer it used (``inf``: none).
    """

    overhead_s: float = 0.0
    scale: float = 1.0
    margin_s: float = 0.0
    samples: int = 0
    age_s: float = math.inf

    def predict(self, work_s: float) -> float:
        """Predicted admitted→answered seconds for a request with ``work_s`` seconds of work ahead
        (its own images included) at the workers' measured capacity."""
        return self.overhead_s + self.scale * work_s


def _solve(rows: list[tuple[float, float, float]], *, overhead_prior_s: float | None = None) -> tuple[float, float]:
    """Weighted least squares of ``y ≈ a + c·x`` over ``(x, y, w)`` with a ridge pull of ``c`` to 1
    (:data:`PRIOR_WEIGHT`), of ``a`` to ``overhead_prior_s`` when known (:data:`OVERHEAD_PRIOR_WEIGHT`),
    and ``a ≥ 0``; returns ``(a, c)``, ``c`` clamped to [0.25, 20]."""
    lam = PRIOR_WEIGHT
    mu, a0 = (0.0, 0.0) if overhead_prior_s is None else (OVERHEAD_PRIOR_WEIGHT, overhead_prior_s)
    sw = sum(w for _, _, w in rows) + mu
    sx = sum(w * x for x, _, w in rows)
    sy = sum(w * y for _, y, w in rows) + mu * a0
    sxx = sum(w * x * x for x, _, w in rows)
    sxy = sum(w * x * y for x, y, w in rows)
    det = sw * (sxx + lam) - sx * sx  # > 0: Cauchy–Schwarz gives sw·sxx ≥ sx², and lam > 0
    a = (sy * (sxx + lam) - sx * (sxy + lam)) / det
    c = (sw * (sxy + lam) - sx * sy) / det
    if a < 0:  # no negative overhead: refit the slope through the origin
        a, c = 0.0, (sxy + lam) / (sxx + lam)
    return a, min(20.0, max(0.25, c))


def _upper_bound(errors: list[float], weights: list[float], q: float) -> float:
    """``z_q × √(2 · Σ w·max(0, e)² / Σ w)``: the ``q`` quantile of zero-mean normal errors whose
    standard deviation is estimated from the late side alone (the weighted root mean square of the
    positive errors, × √2), ``z_q`` the standard normal's ``q`` quantile (2.33 for 0.99). Pure.

    One-sided on purpose: an early answer (the machine got faster, a bulk job ended) never widens
    the margin, and a run of late ones raises it at once (squared). Not the errors' empirical
    quantile: with the ~20 answers that carry the weight, a 99th percentile is their largest error,
    so one bad prediction set the margin alone until it aged out (docs/benchmarks-load.md,
    "Half-lives and the margin")."""
    late_square = sum(w * max(0.0, e) ** 2 for e, w in zip(errors, weights)) / sum(weights)
    return _normal_quantile(q) * math.sqrt(2 * late_square)


@functools.cache
def _normal_quantile(q: float) -> float:
    """The standard normal's ``q`` quantile (2.33 for 0.99), once per ``q``: not on every admission."""
    return statistics.NormalDist().inv_cdf(q)


def fit_wait(answers: Sequence[dict], *, now: float, pending: Sequence[dict] = (),
             margin_quantile: float = MARGIN_QUANTILE, overhead_prior_s: float | None = None,
             half_life_answers: float = FIT_HALF_LIFE_ANSWERS, half_life_s: float = FIT_HALF_LIFE_S) -> WaitFit:
    """Fit :class:`WaitFit` on answered requests (records of ``lane_control.interactive_answered``). Pure.

    Uses the answers of the last :data:`FIT_WINDOW_S` with a ``work_s``; ``y`` is the
    admitted→answered time (s), × :data:`CENSORED_FACTOR` for a 202 (it waited at least that long).
    Each answer weighs ``0.5 ** (age / half_life_s) × 0.5 ** (newer / half_life_answers)``
    (``newer``: answers that came after it): an exponentially weighted least squares, i.e. EWMAs of
    the sums it needs, so a machine that gets slower (or faster) moves the prediction within a few
    answers under load and within a few seconds when answers are rare. No answer is dropped as an
    outlier: after a change of regime the first slow answers *are* the new truth; they move the
    margin at once and the fit within a few answers
    (``test_the_prediction_follows_a_service_time_that_doubles``). The margin is an upper bound of
    admission's own errors (:func:`_upper_bound`): each answer's wait minus the ``predicted_s`` it was admitted with
    (minus this fit's prediction for a record without one), so it measures what the model as used
    got wrong, including its lag after a change, and a machine that gets faster does not widen it.

    Args:
        answers: dicts with ``admitted``, ``answered`` (Unix s), ``work_s`` (s), ``status`` and
            optionally ``predicted_s`` (s).
        now: Unix s.
        pending: admitted requests not answered yet (``admitted``, ``work_s``, ``predicted_s``,
            ``deadline_s``). One that has already waited longer than predicted, and not yet past its
            deadline (after which it is answered 202 soon, or failed and will never be), enters as
            an answer now with its wait so far: a lower bound, seen before the answer.
        margin_quantile: the quantile :func:`_upper_bound` aims at (:data:`MARGIN_QUANTILE`).

    Returns:
        The fit; ``WaitFit()`` (the prior) when no answer qualifies. The margin is
        :func:`_upper_bound` of the errors (weights with :data:`MARGIN_HALF_LIFE_ANSWERS` and
        :data:`MARGIN_HALF_LIFE_S`), shrunk while the evidence is thin or old
        (:data:`MARGIN_PRIOR_WEIGHT`).
    """
    recent = sorted((r for r in answers
                     if r.get("work_s") is not None and now - FIT_WINDOW_S <= r["answered"] <= now + 1),
                    key=lambda r: r["answered"])
    for p in pending:
        waited = now - p["admitted"]
        if (p.get("work_s") is not None and p.get("predicted_s") is not None
                and p["predicted_s"] < waited <= p.get("deadline_s", 0.0) + 1.0):
            recent.append({**p, "answered": now, "status": 200})
    if not recent:
        return WaitFit()
    rows, waits, margin_weights, time_weights = [], [], [], []
    n = len(recent)
    for i, r in enumerate(recent):
        wait = r["answered"] - r["admitted"]
        waits.append(wait)
        newer = n - 1 - i
        age = max(0.0, now - r["answered"])
        rows.append((float(r["work_s"]), wait * (CENSORED_FACTOR if r.get("status") != 200 else 1.0),
                     0.5 ** (age / half_life_s) * 0.5 ** (newer / half_life_answers)))
        w_time = 0.5 ** (age / MARGIN_HALF_LIFE_S)
        margin_weights.append(w_time * 0.5 ** (newer / MARGIN_HALF_LIFE_ANSWERS))
        time_weights.append(w_time)
    a, c = _solve(rows, overhead_prior_s=overhead_prior_s)
    # The margin is how wrong admission was: each answer's wait against what was predicted when it
    # was admitted (by the fit of that moment), or against this fit where no prediction was made.
    # A 202's error is its wait (a lower bound: its deadline) against the prediction, not the fit's
    # CENSORED_FACTOR × that: squared, one such error set the margin alone.
    res = [wait - (r["predicted_s"] if r.get("predicted_s") is not None else a + c * x)
           for (x, _, _), wait, r in zip(rows, waits, recent)]
    margin = 0.0
    if n >= 3:
        total = sum(time_weights)
        margin = _upper_bound(res, margin_weights, margin_quantile) * total / (total + MARGIN_PRIOR_WEIGHT)
    return WaitFit(overhead_s=a, scale=c, margin_s=margin, samples=n,
                   age_s=max(0.0, now - recent[-1]["answered"]))


def drain_rate(tasks: Sequence[tuple[float, float, int]], *, now: float,
               window_s: float = DRAIN_WINDOW_S) -> float | None:
    """Images per second a worker drains while busy. Pure.

    Args:
        tasks: ``(started, ended, images)`` of finished interactive tasks (Unix s).
        now: Unix s; only tasks that ended in ``(now − window_s, now]`` count.

    Returns:
        Their images divided by the union of their run intervals (clipped to the window): the rate
        at whatever batch sizes the load formed, decode and batching window included; ``None``
        when no task ended in the window or they were busy for under 50 ms.
    """
    start = now - window_s
    spans = sorted((max(s, start), e, n) for s, e, n in tasks if start < e <= now)
    if not spans:
        return None
    busy, images, cur_s, cur_e = 0.0, 0, None, None
    for s, e, n in spans:
        images += n
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return images / busy if busy >= 0.05 else None


def update_batch_curve(curve: dict[int, float], records: Sequence, *,
                       alpha: float = BATCH_EWMA_ALPHA) -> dict[int, float]:
    """Fold new batch records (``workers.batcher.BatchRecord``, oldest first) into a worker's
    per-batch-size service time: ``{size: EWMA of service_ms}``, one EWMA per size. Pure (returns
    a new dict)."""
    out = dict(curve)
    for r in records:
        if r.size:
            prev = out.get(r.size)
            out[r.size] = r.service_ms if prev is None else (1 - alpha) * prev + alpha * r.service_ms
    return out


def batch_ms(curve: dict[int, float], size: float) -> float:
    """Service time (ms) of one forward pass of ``size`` images (may be fractional) on a worker with
    per-batch-size times ``curve`` (``{size: ms}``, non-empty). Pure.

    Between measured sizes: linear interpolation. Below the smallest measured size: that size's
    time (never cheaper: a pass has a fixed cost). Above the largest: proportional to the size
    (never more images per second than measured). Both err on the long side.
    """
    if size <= 0:
        return 0.0
    sizes = sorted(curve)
    if size <= sizes[0]:
        return curve[sizes[0]]
    if size >= sizes[-1]:
        return curve[sizes[-1]] * size / sizes[-1]
    for lo, hi in zip(sizes, sizes[1:]):
        if lo <= size <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (size - lo) / (hi - lo)
    raise AssertionError("unreachable")


def drain_s(curve: dict[int, float], images: float, max_batch: int, *, arrivals_ips: float = 0.0,
            start_s: float = 0.0) -> float:
    """Seconds of forward passes to drain ``images`` through one worker that forms batches of at most
    ``max_batch``: full batches first, then the rest (:func:`batch_ms`), which also carries the
    images that arrive before it starts. Pure.

    This is what makes the prediction depend on the batch size: a worker that runs one image in
    300 ms and eight in 550 ms drains a backlog of eight in 0.55 s, not 2.4 s.

    The last, partial pass is not formed yet: the batcher fills it with whatever reached it by the
    time the pass before ends (``workers.batcher.DynamicBatcher``), so it holds the rest plus
    ``arrivals_ips`` (images/s arriving behind the last of ``images``) × the seconds until it starts
    (``start_s``, what the running passes have left, plus the full passes), at most ``max_batch``.
    Where a pass costs about the same per image whatever its size, the images that join it are what
    a request waits for behind itself (docs/benchmarks-load.md, "Who joins the pass").
    """
    full, rest = divmod(max(0.0, images), max_batch)
    passes_ms = full * batch_ms(curve, max_batch)
    if rest > 0:
        rest = min(max_batch, rest + max(0.0, arrivals_ips) * (start_s + passes_ms / 1000))
    return (passes_ms + batch_ms(curve, rest)) / 1000


@dataclasses.dataclass(frozen=True)
class LaneLoad:
    """What the interactive lane holds now and how fast it drains.

    Attributes:
        queued_messages: messages waiting in Redis (every priority step).
        inflight_images: images of tasks a worker has started and not finished.
        capacity_ips: images/s the live interactive workers drain, summed over workers (each one's
            own measurement, :func:`drain_rate`); ``None`` before any measurement.
        images_per_request: measured mean images per request (1.0 before any measurement).
        fit: the wait model fitted on recent answers (:func:`fit_wait`).
        workers: live interactive workers counted in ``capacity_ips``.
        curves: per live worker that reported one, its per-batch-size service times
            (``{size: ms}``, :func:`update_batch_curve`) and its largest batch; when every live
            worker has one, the work ahead is counted in forward passes at those sizes
            (:func:`drain_s`), else in images at ``capacity_ips``.
        passes: the forward passes running now, ``(images, seconds left)`` each (left ≥ 0: a pass
            that overran its expected time counts as ending now); their images are in
            ``inflight_images`` too.
        recent_admitted_s: the predicted waits (s) of the requests admitted in the last
            :data:`RECENT_ADMISSIONS_S` s (the answered ones first, then the pending).
        lone_overhead_s: the mean ``wait − work_s`` (s, ≥ 0) of the last lone requests answered 200
            (``lane_control.keys.LONE_KEY``); ``None``: none yet. Bounds the prediction for an empty
            lane (:meth:`predicted_wait_s`).
        arrivals_ips: images/s admitted over the last :data:`RECENT_ADMISSIONS_S` s (the requests
            of ``recent_admitted_s`` × ``images_per_request``): what joins the last, partial pass
            of a request before it starts (:func:`drain_s`).
        beside_bulk: a bulk chunk is computing on the machine now; ``fit`` (and
            ``lone_overhead_s``) were learnt from the answers that waited beside bulk work
            (:func:`beside_bulk`), else from those that did not.
        quiet: where ``beside_bulk`` and every chunk computing yields to this lane while it
            refuses (:func:`parse_bulk_activity`), the same lane as the quiet regime's fit
            predicts it (its fit and lone overhead, ``beside_bulk`` false): a refusal parks those
            chunks within a micro-batch, and the requests admitted next wait in that regime
            (:func:`decide`); ``None`` otherwise.
    """

    queued_messages: int
    inflight_images: int
    capacity_ips: float | None
    images_per_request: float = 1.0
    fit: WaitFit = WaitFit()
    workers: int = 0
    curves: tuple[tuple[dict[int, float], int], ...] = ()
    passes: tuple[tuple[int, float], ...] = ()
    recent_admitted_s: tuple[float, ...] = ()
    lone_overhead_s: float | None = None
    arrivals_ips: float = 0.0
    beside_bulk: bool = False
    quiet: LaneLoad | None = None

    @property
    def backlog_images(self) -> float:
        """Images ahead of a request arriving now."""
        return self.queued_messages * self.images_per_request + self.inflight_images

    def work_s(self, images: int = 1) -> float | None:
        """Seconds of work ahead of (and including) a request of ``images`` arriving now; ``None``
        when unknown.

        The images of the running :attr:`passes` count as the longest time one of them has left
        (each worker starts its next pass when its own ends; with several workers this errs long).
        The rest, with every live worker's per-batch-size times (:attr:`curves`): shared between
        the workers in proportion to their full-batch rates, the longest worker's forward passes
        (:func:`drain_s`), the last of which also carries the :attr:`arrivals_ips` that reach it
        before it starts. Otherwise: images / the summed ``capacity_ips``.
        """
        if not self.capacity_ips:
            return None
        running = sum(n for n, _ in self.passes)
        left = max((s for _, s in self.passes), default=0.0)
        total = max(0.0, self.backlog_images - running) + images
        if self.curves and len(self.curves) == self.workers:
            rates = [mb / max(1e-6, batch_ms(c, mb)) for c, mb in self.curves]
            shares = [r / sum(rates) for r in rates]  # each worker's part of the images and arrivals
            return left + max(drain_s(c, total * share, mb, start_s=left, arrivals_ips=self.arrivals_ips * share)
                              for (c, mb), share in zip(self.curves, shares))
        return left + total / self.capacity_ips

    def empty_lane_wait_s(self, images: int = 1) -> float | None:
        """:meth:`predicted_wait_s` of a request of ``images`` were nothing queued, in flight or
        running: the floor of what a refusal says (:func:`decide`)."""
        return dataclasses.replace(self, queued_messages=0, inflight_images=0, passes=()).predicted_wait_s(images)

    def predicted_wait_s(self, images: int = 1) -> float | None:
        """Admitted→answered seconds predicted for a request of ``images`` arriving now; ``None`` when unknown.

        In an empty lane (nothing queued, in flight or running) at most ``work_s`` plus
        :attr:`lone_overhead_s`, what the last lone requests measured: the fit is learnt mostly where
        there is a backlog, and after a phase of long waits whose length did not follow their work
        it can keep a large intercept and a flat slope that refuse an empty lane's requests
        (docs/benchmarks-load.md, "A slower machine"). ``work_s`` follows a slower machine at once (the
        workers' batch times).
        """
        work = self.work_s(images)
        if work is None:
            return None
        wait = self.fit.predict(work)
        if self.lone_overhead_s is not None and self.backlog_images == 0 and not self.passes:
            wait = min(wait, work + self.lone_overhead_s)
        return wait


@dataclasses.dataclass(frozen=True)
class Decision:
    """``admitted``; the ``predicted_wait_s`` it was based on (``None``: unknown).

    When refused: ``wait_ahead_s`` (s), about what a request admitted at this moment waits: the
    admission edge (:func:`admission_edge_s`, the longest predicted wait admitted now), or how long
    the backlog needs to drain to it where that is longer, at least the wait of a request of its
    size in an empty lane (:func:`decide`; ``wait_ahead_from``: ``"edge"``, ``"drain"`` or
    ``"alone"``; beside bulk chunks that yield, the same in the quiet regime they park for, or
    ``"parks"``: the wait the backlog of the moment has there, :func:`parked_wait_ahead`); and
    ``retry_after_s``, the same plus ``retry_margin_s`` (its margin, :func:`margin_s`) rounded **up**
    to whole seconds (≥ 1), the ``Retry-After`` header (RFC 9110 delay-seconds): a client that
    waits it does not come back before a request admitted at this moment is answered. ``work_s``,
    ``ahead_images``, ``admitted_at`` (Unix s) and ``token`` (its ``lane_control.keys.PENDING_KEY``
    entry) are kept for ``lane_control.interactive_answered``;
    ``margin_s`` (s) is the margin the refusal applied (:func:`margin_s`), for the 429's body;
    ``work_ahead_wait_s`` (s) the predicted wait of the work ahead (at least a lone request's), for
    the 429's body (what the work queued now needs; the next request admitted waits for more, the
    pass it joins). ``first_wait_ahead_s`` (s) and
    ``wait_ahead_samples``: set when ``wait_ahead_s`` was learnt from labelled refusals
    (:func:`wait_ahead.learnt`): the estimate above, and how many refusals the fit used.
    ``admitted_beside_bulk``: whether bulk chunks computed when it was admitted (set by
    ``lane_control.interactive_admit``; the answer's ``bulk_at_admission``, :func:`fit_regime`)."""

    admitted: bool
    predicted_wait_s: float | None
    retry_after_s: int | None = None
    work_s: float | None = None
    admitted_at: float | None = None
    wait_ahead_s: float | None = None
    ahead_images: float | None = None
    token: str | None = None
    margin_s: float | None = None
    retry_margin_s: float | None = None
    work_ahead_wait_s: float | None = None
    wait_ahead_from: str | None = None
    first_wait_ahead_s: float | None = None
    wait_ahead_samples: int = 0
    admitted_beside_bulk: bool | None = None


def retry_after(wait_ahead_s: float) -> int:
    """``Retry-After`` (whole seconds, ≥ 1) for a predicted wait of the work ahead (s): rounded up,
    so that a client never retries before that work has drained. Pure."""
    return max(1, math.ceil(round(wait_ahead_s, 3)))


def margin_s(fit: WaitFit, wait_s: float, *, min_share: float, max_s: float = math.inf) -> float:
    """Seconds added to a predicted wait of ``wait_s`` before it is compared with the deadline: the
    fit's learnt margin, at least ``min_share`` × the predicted wait (``ADMISSION_MIN_MARGIN_SHARE``)
    and at most ``max_s`` (``ADMISSION_MAX_MARGIN_SHARE`` × the deadline). Pure.

    The floor is for long deadlines, where an answer arrives one long wait after its admission: by
    the time the queue reached the deadline the learnt margin had decayed, and the errors that said
    so came a whole wait later, after the 202s (docs/benchmarks-load.md, "Half-lives and the
    margin"). The cap is for the first seconds of an overload: the answers admitted before the
    model knew it came late all at once, the learnt margin neared the deadline, only requests to an
    empty lane were admitted and the lane starved ("Starved lanes" there)."""
    return min(max(fit.margin_s, min_share * wait_s), max_s)


def admission_edge_s(fit: WaitFit, deadline_s: float, *, min_share: float, max_s: float = math.inf) -> float:
    """The admission edge (s): the longest predicted wait :func:`decide` admits at ``deadline_s``
    (s) in a lane deeper than shallow, the largest ``w`` with ``w + margin_s(fit, w) ≤ deadline_s``
    (:func:`margin_s`, the same ``min_share`` and ``max_s``); 0 when none fits. Pure.

    ``w + margin_s(w)`` rises with slope ≥ 1 and is linear in pieces: the learnt margin binding
    (``w = deadline − learnt``), the floor (``w = deadline / (1 + min_share)``) or the cap
    (``w = deadline − max_s``); the edge is the largest of those that fits.

    Under overload it is what a request admitted at the moment of a refusal is promised: the next
    request admitted is the first whose predicted wait falls back to it: the first ``wait_ahead_s``
    of a refusal (:func:`decide`). The mean predicted wait of the requests admitted in the last
    :data:`RECENT_ADMISSIONS_S` s is the same number in a steady overload, but lags when admission
    stops. Chosen by replay (``benchmarks/load_replay.py --wait-ahead --first-edge``;
    docs/benchmarks-load.md, "The admission edge").
    """
    candidates = (deadline_s - min(fit.margin_s, max_s), deadline_s / (1 + min_share), deadline_s - max_s)
    return max((w for w in candidates
                if w >= 0 and w + margin_s(fit, w, min_share=min_share, max_s=max_s) <= deadline_s + 1e-9), default=0.0)


def first_wait_ahead(fit: WaitFit, *, deadline_s: float, wait_s: float, alone_s: float, min_share: float,
                     max_s: float = math.inf) -> tuple[float, str]:
    """A refusal's first ``wait_ahead_s`` (s) and where it came from (:func:`decide`'s docstring):
    the admission edge (:func:`admission_edge_s`), ``"edge"``; the drain to it, ``wait_s`` (the
    refused request's predicted wait, s) − edge, where longer, ``"drain"``; at least ``alone_s``
    (a request of its size in an empty lane, s), ``"alone"``. Pure."""
    edge = admission_edge_s(fit, deadline_s, min_share=min_share, max_s=max_s)
    return max((edge, "edge"), (wait_s - edge, "drain"), (alone_s, "alone"), key=lambda x: x[0])


def parked_wait_ahead(fit: WaitFit, *, deadline_s: float, wait_s: float, alone_s: float, min_share: float,
                      max_s: float = math.inf) -> tuple[float, str]:
    """A refusal's first ``wait_ahead_s`` (s) beside bulk chunks that yield to the lane, and where it
    came from: ``fit`` is the quiet regime's, ``wait_s`` and ``alone_s`` (s) a request's predicted
    wait now and in an empty lane under it (:func:`decide`). The refusal parks the chunks within a
    micro-batch, and admission reopens then with the backlog of that moment: a request admitted
    then waits about ``wait_s`` (``"parks"``), or the quiet admission edge (``"edge"``) where the
    backlog is deeper than that, which it needs ``wait_s`` − edge to drain to where longer
    (``"drain"``); at least ``alone_s`` (``"alone"``). Pure.

    Why: the bulk regime's edge (the deadline less a margin at its cap) is far longer than what the
    requests admitted next wait, in the quiet lane a few hundred ms later, and the quiet fit
    predicts the backlog of that moment well (docs/benchmarks-load.md, "The switch out of the bulk
    regime")."""
    edge = admission_edge_s(fit, deadline_s, min_share=min_share, max_s=max_s)
    return max((min(wait_s, edge), "edge" if edge < wait_s else "parks"), (wait_s - edge, "drain"),
               (alone_s, "alone"), key=lambda x: x[0])


def decide(load: LaneLoad, *, deadline_s: float, images: int = 1, min_margin_share: float = MIN_MARGIN_SHARE,
           max_margin_share: float = MAX_MARGIN_SHARE) -> Decision:
    """Admit unless the predicted wait plus its margin (:func:`margin_s`: at least
    ``min_margin_share`` × the wait, at most ``max_margin_share`` × ``deadline_s``) is longer than
    ``deadline_s`` (s); a lane
    with at most :data:`SHALLOW_REQUESTS` requests' images ahead admits a request whose predicted
    wait alone fits, and an empty lane any request once the newest answer is older than
    :data:`PROBE_AFTER_S` (a probe).

    A refusal carries ``wait_ahead_s``, about what a request admitted at this moment waits: the
    admission edge (:func:`admission_edge_s`), since under overload the next request admitted is
    the first whose predicted wait, plus its margin, fits the deadline again. Where the backlog
    needs longer than that to drain to the edge (predicted wait − edge: a lane filled by requests
    of longer deadlines, or one that lost a worker), that time instead: no request of this deadline
    is admitted before, and Retry-After is when to come back. At least the
    predicted wait of a request of its size in an empty lane (a lone pass nearly done leaves little
    work ahead, but the next request admitted still waits its own pass). Beside bulk chunks that
    all yield to the lane
    (``load.quiet``), what the quiet regime predicts for the moment they park instead
    (:func:`parked_wait_ahead`). And
    ``retry_after_s`` = :func:`retry_after` of it plus its margin (``retry_margin_s``): the header
    promises "not before", and ``wait_ahead_s`` alone rounded up is early where the wait sits just
    above a whole second. Not
    "until it fits the deadline", which under sustained overload is a fraction of a second, always
    rounded up to 1 s.
    """
    wait = load.predicted_wait_s(images)
    work = load.work_s(images)
    share = min_margin_share
    cap = max_margin_share * deadline_s
    # A shallow lane admits whatever the margin, an empty one whatever the prediction once the
    # evidence is stale (a probe): the request goes straight to the next pass of a worker, and its
    # answer is what a model learnt in a bad moment needs to be corrected.
    empty = load.backlog_images == 0
    shallow = load.backlog_images <= SHALLOW_REQUESTS * load.images_per_request
    margin = None if wait is None else margin_s(load.fit, wait, min_share=share, max_s=cap)
    if (wait is None or wait + margin <= deadline_s
            or (shallow and wait <= deadline_s) or (empty and load.fit.age_s > PROBE_AFTER_S)):
        return Decision(True, wait, work_s=work, ahead_images=load.backlog_images)
    # the next request admitted is admitted at the edge; a backlog that needs longer than that to
    # drain to the edge keeps admission shut that long; never less than a request of its size waits
    # in an empty lane. The work ahead of it now (its own images left out) goes in the body.
    alone = load.empty_lane_wait_s(images)
    if load.quiet is not None and load.quiet.fit.samples:
        # beside bulk chunks that yield: this refusal parks them within a micro-batch, and admission
        # reopens in the quiet regime with the backlog of that moment, not at this regime's edge
        quiet = load.quiet
        ahead, source = parked_wait_ahead(quiet.fit, deadline_s=deadline_s, wait_s=quiet.predicted_wait_s(images),
                                          alone_s=quiet.empty_lane_wait_s(images), min_share=share, max_s=cap)
    else:
        ahead, source = first_wait_ahead(load.fit, deadline_s=deadline_s, wait_s=wait, alone_s=alone,
                                         min_share=share, max_s=cap)
    # the header promises "not before": that wait's upper bound, as admission bounds a wait
    late = margin_s(load.fit, ahead, min_share=share, max_s=cap)
    return Decision(False, wait, retry_after(ahead + late), work_s=work, wait_ahead_s=ahead,
                    ahead_images=load.backlog_images, margin_s=margin, retry_margin_s=late,
                    work_ahead_wait_s=max(load.predicted_wait_s(0), alone), wait_ahead_from=source)


def running_passes(raw: dict[str, str], *, now: float,
                   stale_s: float) -> tuple[tuple[tuple[int, float], ...], list[str]]:
    """Parse ``lane_control.keys.PASSES_KEY`` (``{batcher: "images started expected_ms"}``). Pure.

    Returns:
        ``(passes, stale)``: ``(images, seconds left)`` of each pass younger than ``stale_s`` whose
        expected time is known (left = expected − elapsed, ≥ 0), and the fields older than that
        (a worker that died mid-pass), to delete.
    """
    passes, stale = [], []
    for field, value in raw.items():
        try:
            images, started, expected_ms = value.split()
            images, started, expected_ms = int(images), float(started), float(expected_ms)
        except ValueError:
            stale.append(field)
            continue
        if now - started > stale_s:
            stale.append(field)
        elif images > 0 and expected_ms > 0:
            passes.append((images, max(0.0, expected_ms / 1000 - max(0.0, now - started))))
    return tuple(passes), stale


def lane_load(*, queued_messages: int, inflight_images: int, workers: dict[str, str],
              answers: Sequence[str], now: float, pending: Sequence[str] = (),
              passes: tuple[tuple[int, float], ...] = (), lone: Sequence[str] = (),
              beside_bulk_now: bool = False, bulk_yields: bool = False, lone_quiet: Sequence[str] = (),
              margin_quantile: float = MARGIN_QUANTILE) -> LaneLoad:
    """Build the :class:`LaneLoad` from what Redis holds (the raw hash and list values) and the
    running ``passes`` (:func:`running_passes`). Pure.

    The wait is fitted on the answers of the regime the machine is in now: with a bulk chunk
    computing (``beside_bulk_now``, :func:`parse_bulk_activity`), on those that waited beside bulk work
    (:func:`beside_bulk`); otherwise on the others admitted in the quiet lane (:func:`fit_regime`).
    ``lone`` must be the same regime's list (``lane_control.keys.LONE_BULK_KEY`` or
    ``LONE_KEY``). A regime with no answer in the fit's window starts from the prior
    (the workers' own figures, scale 1). ``pending`` requests count in the regime they were
    admitted in (``bulk_at_admission``); their arrivals count in either. Beside bulk chunks that
    all yield to this lane (``bulk_yields``, :func:`parse_bulk_activity`), the load also carries
    the quiet regime's (``LaneLoad.quiet``, its lone overheads ``lone_quiet``:
    ``LONE_KEY``), for what a refusal says (:func:`decide`).

    ``lone`` is that list (s): their mean, ≥ 0, is the overhead the fit's
    intercept is pulled to (``fit_wait``'s ``overhead_prior_s``); none yet: no pull. The answers'
    and ``pending``'s predicted waits of requests admitted in the last :data:`RECENT_ADMISSIONS_S`
    s are ``recent_admitted_s``, and their count × images per request / that window is
    ``arrivals_ips`` (images/s); the lone mean is also ``lone_overhead_s``.

    Capacity is summed over workers whose entry is younger than :data:`WORKER_TTL_S`; images per
    request is their capacity-weighted mean; their per-batch-size times go to ``curves``.
    """
    live = []
    for raw in workers.values():
        w = json.loads(raw)
        if now - w["updated"] <= WORKER_TTL_S and w.get("capacity_ips"):
            live.append(w)
    capacity = sum(w["capacity_ips"] for w in live) or None
    per_request = (sum(w["capacity_ips"] * w.get("images_per_request", 1.0) for w in live) / capacity
                   if capacity else 1.0)
    answered, waiting = [json.loads(a) for a in answers], [json.loads(p) for p in pending]

    def regime(bulk: bool, lone_s: Sequence[str]) -> tuple[WaitFit, float | None]:
        prior = max(0.0, statistics.fmean(float(x) for x in lone_s)) if lone_s else None
        return fit_wait([a for a in answered if fit_regime(a) is bulk], now=now, overhead_prior_s=prior,
                        pending=[p for p in waiting if bool(p.get("bulk_at_admission")) is bulk],
                        margin_quantile=margin_quantile), prior

    fit, prior = regime(beside_bulk_now, lone)
    recent = tuple(r["predicted_s"] for r in answered + waiting
                   if r.get("predicted_s") is not None and now - RECENT_ADMISSIONS_S <= r["admitted"] <= now)
    arrivals = len(recent) * per_request / RECENT_ADMISSIONS_S
    curves = tuple(({int(k): float(v) for k, v in w["batch_ms"].items()}, int(w["max_batch"]))
                   for w in live if w.get("batch_ms") and w.get("max_batch"))
    load = LaneLoad(queued_messages=queued_messages, inflight_images=inflight_images, capacity_ips=capacity,
                    images_per_request=per_request, fit=fit, workers=len(live), curves=curves,
                    passes=passes, recent_admitted_s=recent, lone_overhead_s=prior, arrivals_ips=arrivals,
                    beside_bulk=beside_bulk_now)
    if beside_bulk_now and bulk_yields:
        quiet_fit, quiet_prior = regime(False, lone_quiet)
        load = dataclasses.replace(load, quiet=dataclasses.replace(load, fit=quiet_fit, lone_overhead_s=quiet_prior,
                                                                   beside_bulk=False))
    return load

