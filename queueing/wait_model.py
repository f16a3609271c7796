"""The wait model of interactive admission: numbers in, numbers out (no Django, Redis or Celery).

``lane_control`` reads what the interactive lane holds and builds a :class:`LaneLoad` (:func:`lane_load`);
:func:`decide` admits a request or refuses it. Everything takes injected clocks and records. The rule::

    work_s = the longest running pass's time left + the forward passes that drain the images ahead
             and its own at the workers' per-batch-size times (:meth:`LaneLoad.work_s`)
    wait_s = overhead_s + scale × work_s   (:func:`fit_wait`, per regime, on recent answers)
    admit  ⇔ wait_s + margin_s ≤ deadline_s (:func:`margin_s`; shallow lanes and probes: :func:`decide`)

No worker measurement yet: admit. Why each term and constant: docs/lanes.md, "The wait model:
derivations"; section titles quoted here are in docs/benchmarks-load-history.md.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import types
from typing import Mapping, Sequence


#: Admission's margin policy, the defaults of ``ADMISSION_MARGIN_QUANTILE``, ``ADMISSION_MIN_MARGIN_SHARE``
#: (× the predicted wait) and ``ADMISSION_MAX_MARGIN_SHARE`` (× the deadline); project/settings.py says why.
MARGIN_QUANTILE = 0.99
MIN_MARGIN_SHARE = 0.2
MAX_MARGIN_SHARE = 0.4

#: A worker entry older than this (s) is gone: three missed heartbeats (``lane_control.reports.HEARTBEAT_S``).
WORKER_TTL_S = 15.0
#: Window (s) of a worker's drain rate (:func:`drain_rate`): follows a machine that slows within seconds.
DRAIN_WINDOW_S = 10.0
#: EWMA weight of a new pass per batch size (:func:`update_batch_curve`): 5 passes take ~83 % of a change.
BATCH_EWMA_ALPHA = 0.3
#: The fit's window (s) and recency half-lives (s; answers), chosen by replay: "Half-lives and the margin".
FIT_WINDOW_S = 30.0
FIT_HALF_LIFE_S = 10.0
FIT_HALF_LIFE_ANSWERS = 16.0
#: The margin's half-lives (answers; s): a spread needs 16 answers, a bad moment's margin fades in seconds.
MARGIN_HALF_LIFE_ANSWERS = 16.0
MARGIN_HALF_LIFE_S = 5.0
#: A 202 waited at least its deadline: it enters the fit as this × its wait.
CENSORED_FACTOR = 1.25
#: Ridge pull (s²) of the fitted scale towards 1: about one fresh answer with 0.3 s of work ahead.
PRIOR_WEIGHT = 0.1
#: The margin is scaled by ``W / (W + this)``, ``W`` the answers' summed time weights: old evidence fades.
MARGIN_PRIOR_WEIGHT = 2.0
#: An empty lane admits a probe once the newest answer is older than this (s): only answers correct the fit.
PROBE_AFTER_S = 5.0
#: With at most this many requests' images ahead the margin is spared (:func:`decide`): "Shallow lanes".
SHALLOW_REQUESTS = 1
#: Weight (fresh answers) of the intercept's pull to the lone requests' mean overhead: "Starved lanes".
OVERHEAD_PRIOR_WEIGHT = 2.0
#: Window (s) of ``LaneLoad.recent_admitted_s`` and ``LaneLoad.arrivals_ips``.
RECENT_ADMISSIONS_S = 2.0
#: An answer waited beside bulk work when a chunk computed for this share of its wait: "Two regimes".
BESIDE_BULK_SHARE = 0.25


def bulk_overlap_s(runs: Sequence[tuple[float, float]], computing: Sequence[float], *, start: float,
                   end: float) -> float:
    """Seconds (≥ 0) of ``[start, end]`` (Unix s) during which at least one bulk chunk computed: the
    union of ``runs`` (finished ``(start, end)``, Unix s, ``lane_control.keys.BULK_RUNS_KEY``) and of
    ``computing`` (starts of the chunks computing now, Unix s, ``keys.BULK_ACTIVITY_KEY``; until
    ``end``), clipped to it. Pure."""
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
    """The regime an answer record (``lane_control.interactive_answered``) teaches: ``True`` beside
    bulk work (:func:`beside_bulk`), ``False`` the quiet lane, ``None`` neither (admitted while bulk
    computed, ``bulk_at_admission``, but waited mostly after it parked: its error is the switch).
    Pure."""
    if beside_bulk(record):
        return True
    return None if record.get("bulk_at_admission") else False


def beside_bulk(record: dict) -> bool:
    """Whether an answer record waited beside bulk work: its ``bulk_s`` (s; absent: 0) > 0 and at
    least :data:`BESIDE_BULK_SHARE` of its admitted→answered wait. Pure."""
    bulk = record.get("bulk_s") or 0.0
    return bulk > 0 and bulk >= BESIDE_BULK_SHARE * (record["answered"] - record["admitted"])


def parse_bulk_activity(raw: dict[str, str], *, now: float,
                        stale_s: float) -> tuple[list[float], list[str], bool]:
    """Parse ``lane_control.keys.BULK_ACTIVITY_KEY`` (``{process: "since"}`` or ``"since y"``). Pure.

    Returns ``(since, stale, yielding)``: the start (Unix s) of each chunk computing now, younger than
    ``stale_s`` (s); the fields older or unreadable, to delete; whether every chunk computing yields
    (its mark ends in ``y``: ``lane_control.bulk_yield.BulkActivity(yields=True)``), ``False`` with none.
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

    Attributes: ``overhead_s`` (s every request waits whatever the backlog); ``scale`` (actual drain
    time / the workers' capacity figure); ``margin_s`` (s ≥ 0 added before the deadline comparison,
    :func:`_upper_bound`); ``samples`` (answers used; 0: the prior ``0, 1, 0``); ``age_s`` (s since
    the newest answer used; ``inf``: none).
    """

    overhead_s: float = 0.0
    scale: float = 1.0
    margin_s: float = 0.0
    samples: int = 0
    age_s: float = math.inf

    def predict(self, work_s: float) -> float:
        """Predicted admitted→answered s for ``work_s`` s of work ahead (its own images included)."""
        return self.overhead_s + self.scale * work_s


def _solve(rows: list[tuple[float, float, float]], *, overhead_prior_s: float | None = None) -> tuple[float, float]:
    """Weighted least squares of ``y ≈ a + c·x`` over ``(x, y, w)``, ``c`` pulled to 1
    (:data:`PRIOR_WEIGHT`), ``a`` to ``overhead_prior_s`` when known (:data:`OVERHEAD_PRIOR_WEIGHT`),
    ``a ≥ 0``; returns ``(a, c)``, ``c`` clamped to [0.25, 20]."""
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
    """``z_q × √(2 · Σ w·max(0, e)² / Σ w)`` (s): the ``q`` quantile of zero-mean normal errors
    whose spread is read off the late ones alone, so an early answer never widens it. Pure."""
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

    Answers of the last :data:`FIT_WINDOW_S` s with a ``work_s``, weighted ``0.5 ** (age /
    half_life_s) × 0.5 ** (newer / half_life_answers)``; ``y`` the admitted→answered s, × :data:`CENSORED_FACTOR`
    for a 202; none dropped as an outlier. The margin (3 answers or more): :func:`_upper_bound` of
    each wait minus its ``predicted_s`` (else this fit's), weighted by the ``MARGIN_HALF_LIFE_*``,
    × ``W / (W + MARGIN_PRIOR_WEIGHT)``.

    Args:
        answers: dicts with ``admitted``, ``answered`` (Unix s), ``work_s`` (s), ``status`` and optionally
            ``predicted_s`` (s).
        now: Unix s.
        pending: admitted requests not answered yet (``admitted``, ``work_s``, ``predicted_s``, ``deadline_s``); one
            past its prediction but not its deadline enters as answered now (a lower bound).
        margin_quantile: the ``q`` of :func:`_upper_bound` (:data:`MARGIN_QUANTILE`).
        overhead_prior_s: where the intercept is pulled (s, :func:`_solve`); ``None``: no pull.

    Returns:
        The fit; ``WaitFit()`` (the prior) when no answer qualifies.
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
    # the margin is admission's own error: each wait against its prediction at admission (this fit's where
    # none was); a 202 with its wait, not CENSORED_FACTOR × it: squared, one such error set the margin alone
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
    """Images/s a worker drains while busy: the images of ``tasks`` (``(started, ended, images)``,
    Unix s) that ended in ``(now − window_s, now]`` over the union of their run intervals (s, clipped
    to the window); ``None`` when none ended there or they were busy for under 50 ms. Pure."""
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
    """Fold batch records (``workers.batcher.BatchRecord``, oldest first) into a worker's
    ``{size: EWMA of service_ms}`` (ms), weight ``alpha``. Pure (returns a new dict)."""
    out = dict(curve)
    for r in records:
        if r.size:
            prev = out.get(r.size)
            out[r.size] = r.service_ms if prev is None else (1 - alpha) * prev + alpha * r.service_ms
    return out


def batch_ms(curve: dict[int, float], size: float) -> float:
    """Service time (ms) of one forward pass of ``size`` images (may be fractional) on a worker with
    per-batch-size times ``curve`` (``{size: ms}``, non-empty): interpolated between measured sizes,
    the smallest size's time below it, proportional above the largest (both err long). Pure."""
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
    """Seconds of forward passes that drain ``images`` through one worker with batches of at most
    ``max_batch``: full batches first, then the partial pass (:func:`batch_ms`), which also carries
    ``arrivals_ips`` (images/s) × the seconds until it starts (``start_s`` + the full passes), up to
    a full batch. Pure."""
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
        inflight_images: images of tasks a worker has started and not finished (``passes``' included).
        capacity_ips: images/s of the live workers, summed (:func:`drain_rate`); ``None`` before any measurement.
        images_per_request: measured mean images per request (1.0 before any measurement).
        fit: the wait model of the regime of the moment (:func:`fit_wait`).
        workers: live interactive workers counted in ``capacity_ips``.
        curves: ``({size: ms}, max_batch)`` per live worker that reported one (:func:`update_batch_curve`).
        passes: ``(images, seconds left ≥ 0)`` of each forward pass running now.
        recent_admitted_s: predicted waits (s) of the requests admitted in the last :data:`RECENT_ADMISSIONS_S` s.
        lone_overhead_s: mean ``wait − work_s`` (s, ≥ 0) of the last lone 200s (``keys.LONE_KEY``); ``None``: none.
        arrivals_ips: images/s admitted over the last :data:`RECENT_ADMISSIONS_S` s (join the last pass).
        beside_bulk: a bulk chunk computes now; ``fit`` and ``lone_overhead_s`` are that regime's.
        quiet: where every chunk computing yields, this lane under the quiet regime's fit; else ``None``.
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
        when unknown: the longest running pass's time left, then the rest in forward passes
        (:func:`drain_s`, shared by the workers' full-batch rates) when every live worker has a
        curve, else images / ``capacity_ips``."""
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
        """Admitted→answered s predicted for a request of ``images`` arriving now (``None``: unknown);
        in an empty lane at most ``work_s`` + :attr:`lone_overhead_s` ("A slower machine")."""
        work = self.work_s(images)
        if work is None:
            return None
        wait = self.fit.predict(work)
        if self.lone_overhead_s is not None and self.backlog_images == 0 and not self.passes:
            wait = min(wait, work + self.lone_overhead_s)
        return wait


@dataclasses.dataclass(frozen=True)
class Decision:
    """An admission decision (times in s).

    ``admitted``; ``predicted_wait_s`` (``None``: unknown); ``work_s``, ``ahead_images``, ``admitted_at``
    (Unix s), ``token`` (its ``lane_control.keys.PENDING_KEY`` entry) and ``admitted_beside_bulk`` are
    kept for ``lane_control.interactive_answered``. A refusal's ``wait_ahead_s`` (about what a request
    admitted now waits) and ``wait_ahead_from`` (``"edge"``, ``"drain"``, ``"alone"``, ``"parks"``):
    :func:`decide`; ``retry_after_s`` (whole s ≥ 1, the ``Retry-After`` header) of it plus
    ``retry_margin_s``; ``margin_s`` the margin applied and ``work_ahead_wait_s`` the predicted wait of
    the work ahead, for the 429's body; ``first_wait_ahead_s`` and ``wait_ahead_samples`` when
    ``wait_ahead_s`` was learnt (:func:`wait_ahead.learnt`)."""

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
    """Seconds added to a predicted wait of ``wait_s`` (s) before it is compared with the deadline:
    the fit's learnt margin, at least ``min_share`` × ``wait_s``, at most ``max_s`` (s). Pure."""
    return min(max(fit.margin_s, min_share * wait_s), max_s)


def admission_edge_s(fit: WaitFit, deadline_s: float, *, min_share: float, max_s: float = math.inf) -> float:
    """The admission edge (s): the largest ``w`` with ``w + margin_s(fit, w) ≤ deadline_s`` (s), the
    longest predicted wait :func:`decide` admits in a lane deeper than shallow; 0 when none fits.
    ``w + margin_s(w)`` is linear in pieces with slope ≥ 1: the edge is the largest fitting
    breakpoint (learnt margin, floor or cap). Pure."""
    candidates = (deadline_s - min(fit.margin_s, max_s), deadline_s / (1 + min_share), deadline_s - max_s)
    return max((w for w in candidates
                if w >= 0 and w + margin_s(fit, w, min_share=min_share, max_s=max_s) <= deadline_s + 1e-9), default=0.0)


def first_wait_ahead(fit: WaitFit, *, deadline_s: float, wait_s: float, alone_s: float, min_share: float,
                     max_s: float = math.inf) -> tuple[float, str]:
    """A refusal's first ``wait_ahead_s`` (s) and its source: the admission edge (``"edge"``), the
    drain to it, ``wait_s`` − edge, where longer (``"drain"``), at least ``alone_s`` (s, ``"alone"``). Pure."""
    edge = admission_edge_s(fit, deadline_s, min_share=min_share, max_s=max_s)
    return max((edge, "edge"), (wait_s - edge, "drain"), (alone_s, "alone"), key=lambda x: x[0])


def parked_wait_ahead(fit: WaitFit, *, deadline_s: float, wait_s: float, alone_s: float, min_share: float,
                      max_s: float = math.inf) -> tuple[float, str]:
    """:func:`first_wait_ahead` beside bulk chunks that yield, in the quiet regime they park for
    (``fit``, ``wait_s``, ``alone_s`` its): ``wait_s`` (``"parks"``) or the edge where the backlog is
    deeper (``"edge"``), the drain to it where longer, at least ``alone_s``. Pure."""
    edge = admission_edge_s(fit, deadline_s, min_share=min_share, max_s=max_s)
    return max((min(wait_s, edge), "edge" if edge < wait_s else "parks"), (wait_s - edge, "drain"),
               (alone_s, "alone"), key=lambda x: x[0])


def decide(load: LaneLoad, *, deadline_s: float, images: int = 1, min_margin_share: float = MIN_MARGIN_SHARE,
           max_margin_share: float = MAX_MARGIN_SHARE) -> Decision:
    """Admit unless the predicted wait plus :func:`margin_s` (≥ ``min_margin_share`` × the wait,
    ≤ ``max_margin_share`` × ``deadline_s``) exceeds ``deadline_s`` (s); a lane with at most
    :data:`SHALLOW_REQUESTS` requests' images ahead admits when the wait alone fits, an empty one any
    request once the newest answer is older than :data:`PROBE_AFTER_S` (a probe). A refusal says
    ``wait_ahead_s`` (:func:`first_wait_ahead`, or :func:`parked_wait_ahead` beside chunks that all
    yield) and ``retry_after_s``, :func:`retry_after` of it plus its margin ("not before").
    """
    wait = load.predicted_wait_s(images)
    work = load.work_s(images)
    share = min_margin_share
    cap = max_margin_share * deadline_s
    # a shallow lane spares the margin, a stale empty one the prediction: only answers correct the fit
    empty = load.backlog_images == 0
    shallow = load.backlog_images <= SHALLOW_REQUESTS * load.images_per_request
    margin = None if wait is None else margin_s(load.fit, wait, min_share=share, max_s=cap)
    if (wait is None or wait + margin <= deadline_s
            or (shallow and wait <= deadline_s) or (empty and load.fit.age_s > PROBE_AFTER_S)):
        return Decision(True, wait, work_s=work, ahead_images=load.backlog_images)
    alone = load.empty_lane_wait_s(images)
    if load.quiet is not None and load.quiet.fit.samples:
        # yielding chunks park within a micro-batch of this refusal: admission reopens in the quiet regime
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

    Returns ``(passes, stale)``: ``(images, seconds left ≥ 0)`` of each pass younger than ``stale_s``
    (s) with a known expected time; the fields older or unreadable (a worker died mid-pass), to delete.
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


@functools.lru_cache(maxsize=4096)
def _record(raw: str) -> Mapping:
    """One answer record (JSON text, as Redis holds it) parsed once per process: every admission
    reads the newest ``ANSWERS_READ`` (128) of them and most are the same as the last admission's
    (measured: their parse was a quarter of an admission's CPU). Read-only, since it is shared.
    4,096: 32 windows of 128, so the window read always fits while older records age out."""
    return types.MappingProxyType(json.loads(raw))


def lane_load(*, queued_messages: int, inflight_images: int, workers: dict[str, str],
              answers: Sequence[str], now: float, pending: Sequence[str] = (),
              passes: tuple[tuple[int, float], ...] = (), lone: Sequence[str] = (),
              beside_bulk_now: bool = False, bulk_yields: bool = False, lone_quiet: Sequence[str] = (),
              margin_quantile: float = MARGIN_QUANTILE) -> LaneLoad:
    """Build the :class:`LaneLoad` from what Redis holds (raw hash and list values) and the running
    ``passes`` (:func:`running_passes`) at ``now`` (Unix s). Pure.

    The fit uses the answers of the regime of the moment (``beside_bulk_now``, :func:`fit_regime`) and
    the ``pending`` admitted in it; ``lone`` (s, that regime's ``keys.LONE_BULK_KEY`` or ``LONE_KEY``)
    has the mean the intercept is pulled to. With ``bulk_yields`` the load also carries the quiet
    regime (``quiet``, its lone overheads ``lone_quiet``). Capacity sums the workers younger than
    :data:`WORKER_TTL_S`; images per request is their capacity-weighted mean.
    """
    live = []
    for raw in workers.values():
        w = json.loads(raw)
        if now - w["updated"] <= WORKER_TTL_S and w.get("capacity_ips"):
            live.append(w)
    capacity = sum(w["capacity_ips"] for w in live) or None
    per_request = (sum(w["capacity_ips"] * w.get("images_per_request", 1.0) for w in live) / capacity
                   if capacity else 1.0)
    answered, waiting = [_record(a) for a in answers], [json.loads(p) for p in pending]

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

