"""The wait model of interactive admission: pure (no Redis, no Celery).

:mod:`embeddings.lane_control.admission` reads what the interactive lane holds from Redis and builds a
:class:`LaneLoad` (:func:`lane_load`); :func:`decide` then admits a request or refuses it. Everything
here takes injected clocks and records. A request is refused when the predicted wait for its answer
(plus a margin) is longer than its deadline. The prediction is the whole admitted→answered time::

    images = queued messages × images per request + images in flight + its own images
             − the images of the forward passes running now
    work_s = what the running passes have left (the longest)
             + the forward passes that drain the images, full batches first, at each live
             worker's measured per-batch-size service times (images shared by the workers'
             rates), the last, partial pass with the images admitted behind it before it
             starts (``arrivals_ips`` × its start, up to a full batch: :func:`drain_s`);
             images / Σ capacity of the live workers (images/s) until every one reported them
    wait_s = overhead_s + scale × work_s        (admit when wait_s + margin_s ≤ deadline,
                                                 margin_s ≥ ADMISSION_MIN_MARGIN_SHARE × wait_s)

- *queued messages*: ``LLEN`` of the interactive queue's lists in Redis. kombu keeps one list per
  priority step: ``interactive`` for step 0 and ``interactive\\x06\\x16{3,6,9}`` for the others
  (``Channel._q_for_pri``, separator ``Channel.sep``).
- *images in flight*: images of interactive tasks that a worker has started and not finished, a
  hash the workers keep (:func:`admission.interactive_in_flight`). Entries older than a stale bound
  are ignored, so a killed worker cannot block admission forever.
- *running passes*: each dynamic batcher records the forward pass it is running (images, start,
  expected ms at its worker's per-batch-size time) in :data:`admission.PASSES_KEY` and clears it
  when the pass ends (:func:`admission.interactive_pass`). Those images count as the time their pass
  has left, not as a whole pass: a request arriving 0.9 s into a 1 s pass waits 0.1 s for it, not
  1 s. Counted whole, the pass's phase was the largest error of the prediction (the wait of requests
  with the same backlog ranged over a whole pass), and the margin — the errors' upper spread — had
  to cover it.
- *capacity*: each interactive worker measures what it really drains: images of the tasks it
  finished over the last :data:`DRAIN_WINDOW_S` s divided by the time it was busy with them
  (:func:`drain_rate`: decode, batching window, forward passes at whatever batch sizes the load
  formed, and whatever else steals its cores). Each writes its own entry, keyed by its hostname,
  in :data:`admission.WORKERS_KEY` and refreshes it every :data:`admission.HEARTBEAT_S` s; the web
  sums the entries younger than :data:`WORKER_TTL_S`. Two workers therefore admit twice the backlog
  of one at the same predicted wait, and a killed worker stops counting within seconds (issue 11).
- *per-batch-size service times*: each worker also folds its dynamic batcher's forward passes
  into one EWMA per batch size (:func:`update_batch_curve`) and reports them in the same entry
  (``batch_ms``, ``max_batch``). A backlog of eight is then one batch of eight, not eight lone
  passes (:func:`drain_s`): with the drain rate alone, an admission that kept the queue short
  measured batches of one, predicted long waits and kept the queue short (issue 15).
- *overhead, scale, margin*: the web records every admitted request's answer (admitted and
  answered times, its ``work_s`` at admission, 200 or not) in a capped list
  (:func:`admission.interactive_answered`, :data:`admission.ANSWERS_KEY`), and fits ``wait =
  overhead + scale × work`` on the last :data:`FIT_WINDOW_S` s of them, each weighted by a
  :data:`FIT_HALF_LIFE_S` s half-life and a :data:`FIT_HALF_LIFE_ANSWERS` answers half-life
  (:func:`fit_wait`: an exponentially weighted moving fit of the whole service times). ``scale``
  absorbs what the workers' figure misses (the vectors hop, the web, a machine slower than 10 s
  ago), ``overhead`` what every request pays, ``margin`` the late side of the spread (``z`` of
  ``ADMISSION_MARGIN_QUANTILE`` × the root mean square of admission's late errors × √2, an error
  being wait − the wait predicted at admission: :func:`_upper_bound`). A slower machine shows in
  the answers within a few of them, in the workers' batch times at once, and in admitted requests
  that have waited longer than predicted before they are even answered
  (:data:`admission.PENDING_KEY`).
- *regime*: a bulk chunk computing on the same cores makes every request wait longer than its
  work, and an overload makes the bulk job park (``bulk_yield.ingest_yielder``), so the lane
  switches between two regimes that admission's own refusals cause. Bulk chunks mark when they
  compute (:data:`admission.BULK_ACTIVITY_KEY`, :data:`admission.BULK_RUNS_KEY`); each answer
  records the seconds of its wait beside them (``bulk_s``, :func:`bulk_overlap_s`), and the fit
  (and the lone overheads) are learnt per regime and used by the regime of the moment
  (:func:`beside_bulk`, :func:`lane_load`). With no bulk job there is one regime, as before. A
  record teaches the regime it was admitted in (``bulk_at_admission``) unless it waited mostly
  beside bulk work (:func:`fit_regime`): one admitted beside bulk passes that parked during its wait
  teaches neither, and a request admitted beside them still waiting is no lower bound of the quiet
  regime's waits (:func:`lane_load`).

With no worker measurement yet every request is admitted: there is nothing to predict with. A lane
with at most :data:`SHALLOW_REQUESTS` requests' images ahead is spared the margin (the predicted wait
alone must fit), and an empty lane admits a probe once the newest answer is stale (:func:`decide`).
An empty lane's prediction is at most ``work_s`` plus what lone requests measured
(:meth:`LaneLoad.predicted_wait_s`).
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
#: heartbeats (:data:`admission.HEARTBEAT_S`), so a killed worker stops counting within 15 s.
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
#: machine's speed is followed within a few seconds (half the weight after 16 answers, 2–3 s at the
#: 6–8 answers/s of this 2-core machine), whatever the answer rate; with few answers, within ~10 s.
#: Until 2026-12-01 the half-lives were 6 answers and 5 s: under a 2× overload the lane then ran a
#: limit cycle (docs/benchmarks-load.md, "Half-lives and the margin"): an answer arrives one wait
#: after its admission, so at a queue's peak the fit had forgotten the last peak and knew only the
#: trough's short waits; it under-predicted (scale ~1.0 where the phase's own slope was 1.7),
#: admitted requests ended 202, the margin jumped to 0.6 × the deadline and the lane emptied.
#: Replayed on that run's six phases (benchmarks/load_replay.py), predicted + margin was short for
#: 5–13 % of admitted requests with the old half-lives and 0–5 % with these.
FIT_WINDOW_S = 30.0
FIT_HALF_LIFE_S = 10.0
FIT_HALF_LIFE_ANSWERS = 16.0
#: The margin's errors are weighted the same way with their own half-lives: 16 answers (a spread
#: needs more than the last handful of answers to mean anything, ~23 fresh answers in all; 8 while
#: the margin was the errors' empirical quantile, :func:`_upper_bound`) and 5 s, so that a margin
#: learnt in a bad moment fades within seconds when no answer comes to correct it (with the fit's
#: 10 s, 15 s of silence left two thirds of it).
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
#: drained. Until 2026-12-02 only an empty lane did (0): after a burst of late answers the fitted
#: scale (1.2-1.5) and the margin (at its cap) kept a 1 s lane one or two requests deep for 2-5 s
#: while those answered in 0.25-0.4 s and the 429s of the trough said 0.6 s. With 1, in three
#: runs of the load benchmark's 1 s phases (docs/benchmarks-load.md, "Shallow lanes"): 429s within
#: ±30 % 90.1-92.0 % (84.0-89.1 % in six earlier runs), with bulk 82.2-93.9 % (77.5-89.6 %); 202s
#: 0.8-2.5 %; 2 s and 5 s unchanged (98.1-98.8 %).
SHALLOW_REQUESTS = 1
#: Weight of the pull of the fit's intercept towards the lone requests' mean overhead
#: (:data:`admission.LONE_KEY`, :func:`_solve`), in fresh answers: under a steady overload the
#: answers' works are bunched and say little about the intercept apart from the slope, and the fit
#: wandered (overhead 1.2 s and scale 0.25 at a 2 s deadline; scale 1.9 for lone requests in a lane
#: that had just drained).
OVERHEAD_PRIOR_WEIGHT = 2.0
#: What admitted requests were promised over the last this-many seconds (answered or not):
#: ``LaneLoad.recent_admitted_s``, and the arrivals that join the last, partial pass
#: (``arrivals_ips``). Until 2026-12-03 a refusal's first ``wait_ahead_s`` was their mean (2 s:
#: 1 s and 2 s windows differed by under a point); now it is the admission edge
#: (:func:`admission_edge_s`), which that mean lagged behind when admission stopped.
RECENT_ADMISSIONS_S = 2.0
#: An answer waited *beside bulk work* when bulk chunks computed on the machine for at least this
#: share of its admitted→answered time (:func:`beside_bulk`). The wait model keeps one fit per
#: regime (:func:`lane_load`): a bulk job that computes between an under-loaded lane's requests
#: makes them wait 0.4-1.1 s longer than their work, and an overload makes that job park
#: (:func:`bulk_yield.ingest_yielder`), so one intercept learnt across the switch over-predicted the
#: first seconds of every overload beside a bulk job (docs/benchmarks-load.md, "The AVX-512 EPYC
#: again"). A quarter: a request that only met the tail of a micro-batch is not beside it.
BESIDE_BULK_SHARE = 0.25


def bulk_overlap_s(runs: Sequence[tuple[float, float]], computing: Sequence[float], *, start: float,
                   end: float) -> float:
    """Seconds of ``[start, end]`` (Unix s) during which at least one bulk chunk computed. Pure.

    Args:
        runs: ``(start, end)`` (Unix s) of finished computing intervals (:data:`admission.BULK_RUNS_KEY`).
        computing: when each chunk computing now started (Unix s, :data:`admission.BULK_ACTIVITY_KEY`);
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
    """The regime whose fit an answer record (:func:`admission.interactive_answered`) teaches: ``True``
    beside bulk work (:func:`beside_bulk`), ``False`` the quiet lane, ``None`` neither: admitted
    while bulk chunks computed (``bulk_at_admission``; absent: not recorded, as before 2026-12-04)
    but waited mostly after they parked. Pure.

    Its wait mixes both regimes, and what it got wrong is the switch, which neither fit predicts.
    Under a 2× overload that starts beside a bulk job the chunks park within a micro-batch of the
    first refusal; the requests admitted before, predicted by the bulk fit and answered in the quiet
    lane, were the quiet fit's newest evidence. On the Intel Xeon of 2026-12-04 (load benchmark,
    5 s + bulk, PostgreSQL) the quiet fit then read overhead 0.0 s, scale 1.47 and a margin of
    1.4 s a second after the switch, where the paused capacity scan's answers alone gave 0.48 s,
    0.71 and 0.35 s: admitted requests were predicted 3.4-3.9 s and waited 2.2-2.8 s, and the 429s
    said 3.6-4.2 s (docs/benchmarks-load.md, "The switch out of the bulk regime")."""
    if beside_bulk(record):
        return True
    return None if record.get("bulk_at_admission") else False


def beside_bulk(record: dict) -> bool:
    """Whether an answer record (:func:`admission.interactive_answered`) waited beside bulk work:
    its ``bulk_s`` (s of its wait during which a bulk chunk computed; absent: none recorded) at
    least :data:`BESIDE_BULK_SHARE` of its wait, and > 0. Pure."""
    bulk = record.get("bulk_s") or 0.0
    return bulk > 0 and bulk >= BESIDE_BULK_SHARE * (record["answered"] - record["admitted"])


def parse_bulk_activity(raw: dict[str, str], *, now: float,
                        stale_s: float) -> tuple[list[float], list[str], bool]:
    """Parse :data:`admission.BULK_ACTIVITY_KEY` (``{process: "since"}`` or ``"since y"``). Pure.

    Returns:
        ``(since, stale, yielding)``: when each chunk computing now started (Unix s), for the
        entries younger than ``stale_s`` s; the fields older than that or unreadable (a process
        killed while computing), to delete; and whether every chunk computing now yields to the
        interactive lane while it refuses (its mark ends in ``y``: ``bulk_yield.BulkActivity``'s
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
    the margin, and a run of late ones raises it at once (squared). Why not the errors' empirical
    quantile, as until 2026-12-01: with the ~20 answers that carry the weight, a 99th percentile is
    their largest error, so one bad prediction set the margin alone until it aged out. Replayed on
    four load-benchmark runs' records (``docs/benchmarks-load.md``, "Half-lives and the margin"),
    3-17 % of admitted requests waited longer than predicted + this margin, against 7-27 % with
    the quantile (half-life 8 answers), for a margin 0-58 % wider on average (most at 5 s)."""
    late_square = sum(w * max(0.0, e) ** 2 for e, w in zip(errors, weights)) / sum(weights)
    return _normal_quantile(q) * math.sqrt(2 * late_square)


@functools.cache
def _normal_quantile(q: float) -> float:
    """The standard normal's ``q`` quantile (2.33 for 0.99), once per ``q``: not on every admission."""
    return statistics.NormalDist().inv_cdf(q)


def fit_wait(answers: Sequence[dict], *, now: float, pending: Sequence[dict] = (),
             margin_quantile: float = MARGIN_QUANTILE, overhead_prior_s: float | None = None,
             half_life_answers: float = FIT_HALF_LIFE_ANSWERS, half_life_s: float = FIT_HALF_LIFE_S) -> WaitFit:
    """Fit :class:`WaitFit` on answered requests (records of :func:`admission.interactive_answered`). Pure.

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


def update_batch_curve(curve: dict[int, float], records: Sequence, *, alpha: float = BATCH_EWMA_ALPHA) -> dict[int, float]:
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
    a request waits for behind itself: 2026-12-02, AVX2-only EPYC, passes of 1 / 2 / 3 / 4 / 6
    images ran 297 / 528 / 677 / 927 / 1,220 ms (load benchmark at 2 s, 2 × capacity), so two
    requests that joined a request's pass cost it ~0.4 s that the images ahead of it did not show.
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
            (:data:`admission.LONE_KEY`); ``None``: none yet. Bounds the prediction for an empty
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
        (a 5 s deadline's limit cycle) it kept an intercept of 1.33 s and its slope at the 0.25
        floor, predicted 1.50 s for a request to an empty lane whose lone requests waited 0.7-0.9 s,
        and refused all but the probes at a 1 s deadline for 40 s (docs/benchmarks-load.md, "A
        slower machine"). ``work_s`` follows a slower machine at once (the workers' batch times).
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
    ``ahead_images``, ``admitted_at`` (Unix s) and ``token`` (its :data:`admission.PENDING_KEY`
    entry) are kept for :func:`admission.interactive_answered`;
    ``margin_s`` (s) is the margin the refusal applied (:func:`margin_s`), for the 429's body;
    ``work_ahead_wait_s`` (s) the predicted wait of the work ahead (at least a lone request's), for
    the 429's body (what the work queued now needs; the next request admitted waits for more, the
    pass it joins). ``first_wait_ahead_s`` (s) and
    ``wait_ahead_samples``: set when ``wait_ahead_s`` was learnt from labelled refusals
    (:func:`wait_ahead.learnt`): the estimate above, and how many refusals the fit used.
    ``admitted_beside_bulk``: whether bulk chunks computed when it was admitted (set by
    :func:`admission.interactive_admit`; the answer's ``bulk_at_admission``, :func:`fit_regime`)."""

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

    The floor is for long deadlines, where an answer arrives one long wait after its admission:
    at a 5 s deadline the learnt margin had decayed to ~0.1 × the wait by the time the queue
    reached the deadline, and the errors that said so came ~5 s later, after the 202s. Replayed on
    four 5 s load-benchmark phases, a floor of 0.2 cut the admitted requests that waited longer
    than predicted + margin from 12-15 % to 5-9 %, for a margin 0.01-0.03 × the deadline wider on
    average; at 1 s and 2 s it moved that share by at most 1.3 points (docs/benchmarks-load.md,
    "Half-lives and the margin"); in the load benchmark the 5 s phase then had 0.4 % 202s.

    The cap is for the first seconds of an overload: the answers admitted before the model knew
    it came late all at once, the learnt margin reached 0.8-1.0 × a 1 s deadline, only requests to
    an empty lane were admitted, and the lane starved for 5-8 s ("Starved lanes" there)."""
    return min(max(fit.margin_s, min_share * wait_s), max_s)


def admission_edge_s(fit: WaitFit, deadline_s: float, *, min_share: float, max_s: float = math.inf) -> float:
    """The admission edge (s): the longest predicted wait :func:`decide` admits at ``deadline_s``
    (s) in a lane deeper than shallow, the largest ``w`` with ``w + margin_s(fit, w) ≤ deadline_s``
    (:func:`margin_s`, the same ``min_share`` and ``max_s``); 0 when none fits. Pure.

    ``w + margin_s(w)`` rises with slope ≥ 1 and is linear in pieces: the learnt margin binding
    (``w = deadline − learnt``), the floor (``w = deadline / (1 + min_share)``) or the cap
    (``w = deadline − max_s``); the edge is the largest of those that fits.

    Under overload it is what a request admitted at the moment of a refusal is promised: the next
    request admitted is the first whose predicted wait falls back to it. It is the first
    ``wait_ahead_s`` of a refusal (:func:`decide`) since 2026-12-03; before, the mean predicted wait
    of the requests admitted in the last :data:`RECENT_ADMISSIONS_S` s, the same number in a steady
    overload, but it lagged when admission stopped: on the Intel Xeon of that day (load benchmark,
    ``--deadline 1 2 5 --with-bulk 0 3000``), a 5 s phase admitted nothing for 2.0 s after its
    passes slowed by a third, the margin grew from 0.9 to 2.0 s, its 429s kept saying 4.0 s from the
    last admissions and the requests admitted next waited 2.2-2.8 s: 69 misses of ±30 %, 91.2 %
    within. Replayed on that run and the next (``benchmarks/load_replay.py``; first estimate alone,
    then learnt, :mod:`queueing.wait_ahead`), within ±30 % of the actual wait with the
    edge against the mean: 2 s 98.7 / 98.9 % against 92.9 / 96.7 % (learnt 100.0 / 98.6 against
    97.8 / 97.5), 5 s 95.2 / 99.1 against 91.1 / 96.3 (learnt 99.8 / 99.1 against 91.2 / 97.9), 1 s
    98.5 / 97.8 against 98.8 / 99.3 (learnt 98.7 / 99.4 against 98.7 / 100.0); with a bulk job
    (the first run) 1 s 70.2 against 79.5 (learnt 90.7 both), 2 s 95.9 against 97.9 (learnt 97.6
    both), 5 s 100 both.
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

    Why: on the Intel Xeon of 2026-12-04 (load benchmark, 5 s + bulk) 19, 21 and 14 refusals beside
    bulk passes in the first 3 s of three runs' phases missed ±30 % (all of the third's misses,
    with :func:`fit_regime`): they said the bulk regime's edge (5 − the margin's 2 s cap = 3.0 s)
    and the requests admitted next, in the quiet lane a few hundred ms later, waited 1.8-2.1 s; the
    quiet fit predicted the backlog of those moments at 1.9-2.2 s. With this, two runs: 9 of 34
    and 3 of 8 ``parks`` refusals missed, the first of their phase, judged against requests
    admitted just before them beside bulk passes (docs/benchmarks-load.md, "The switch out of
    the bulk regime")."""
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
    work ahead, but the next request admitted still waits its own pass: replayed on a
    load-benchmark run at deadline 1 s, the floor put 78 % of the 429s within ±30 % of the wait
    admitted requests had, against 56 %). Beside bulk chunks that all yield to the lane
    (``load.quiet``), what the quiet regime predicts for the moment they park instead
    (:func:`parked_wait_ahead`). And
    ``retry_after_s`` = :func:`retry_after` of it plus its margin (``retry_margin_s``): the header
    promises "not before", and ``wait_ahead_s`` alone rounded up was early where the wait sat just
    above a whole second (79-94 % not early at a 5 s deadline). Not
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



def running_passes(raw: dict[str, str], *, now: float, stale_s: float) -> tuple[tuple[tuple[int, float], ...], list[str]]:
    """Parse :data:`admission.PASSES_KEY` (``{batcher: "images started expected_ms"}``). Pure.

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
    ``lone`` must be the same regime's list (:data:`admission.LONE_BULK_KEY` or
    :data:`admission.LONE_KEY`). A regime with no answer in the fit's window starts from the prior
    (the workers' own figures, scale 1). ``pending`` requests count in the regime they were
    admitted in (``bulk_at_admission``); their arrivals count in either. Beside bulk chunks that
    all yield to this lane (``bulk_yields``, :func:`parse_bulk_activity`), the load also carries
    the quiet regime's (``LaneLoad.quiet``, its lone overheads ``lone_quiet``:
    :data:`admission.LONE_KEY`), for what a refusal says (:func:`decide`).

    ``lone`` is :data:`admission.LONE_KEY`'s list (s): their mean, ≥ 0, is the overhead the fit's
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

