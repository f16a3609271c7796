"""Replay a ``bench-load`` run against the wait model with other half-lives, and what its 429s say.

    python -m benchmarks.load_replay var/bench-load.json [--half-lives 6:5 16:10 24:15]
    python -m benchmarks.load_replay var/bench-load.json --wait-ahead [--first-edge]

Runs on :mod:`queueing` alone: no Django, no Redis. The margin policy is queueing's defaults
(``--margin-quantile``, ``--min-margin-share``, ``--max-margin-share`` to try others, as the
``ADMISSION_*`` settings do live).

For every admitted request of every phase (the web's own records, ``lane_control.keys.ANSWERS_KEY``,
saved by ``benchmarks.load``), the model is fitted (:func:`queueing.wait_model.fit_wait`) on the
answers that had arrived before it was admitted, with the fit's half-lives set to
``ANSWERS:SECONDS`` (its ``half_life_answers`` and ``half_life_s``; ``FIT_HALF_LIFE_ANSWERS``,
``FIT_HALF_LIFE_S`` by default), and its predicted wait for the request's ``work_s`` is compared
with the wait it really had. Printed per phase and half-lives: the error (actual − predicted, s) at
the 5th / 50th / 95th percentile, the share of requests predicted within ±30 %, and the share whose
wait was longer than predicted + the fit's margin (*short*: what ends 202 at the admission
threshold).

A replay, not a rerun: the requests, their admission times and their ``work_s`` are the run's
own, so the lane's trajectory (which admissions a different model would have refused) is not
replayed, and admitted-but-unanswered requests (``fit_wait``'s ``pending``) are left out. It says
which half-lives would have predicted that trajectory better; ``make bench-load`` with the change
says whether the lane then behaves better.

``--wait-ahead`` replays instead what each 429 of the run would have said
(:mod:`queueing.wait_ahead`), on one timeline through all phases as the web saw them:
each 429 is a refusal at its send time with the lane state its body reported (the first estimate,
images in flight, the running pass, queued messages) and its phase's deadline, labelled from the
web's answer records known by then, refitted at most once a second as the web does
(``wait_ahead.REFIT_S``). Printed per phase, the share of 429s within ±30 % of the
actual wait as the benchmark judges it (:func:`benchmarks.load_judge.actual_wait_near`): the first
estimate as is, the fit on every refusal (before deadline bands), the fit on the refusal's own
deadline band alone, and what the run's 429s said. Each phase starts from the web's own refusal
and answer records of the minute before it (mostly its capacity scan's; the result's ``before``),
as the web's fit did; a result without it starts its phases from the phases before alone. With
``--first-edge`` the first estimate of each 429 is replaced by the admission edge
(:func:`queueing.wait_model.admission_edge_s`, from the 429's ``learnt_margin_s`` and its phase's
deadline), or the drain to it (``predicted_wait_s`` − edge) where longer: what a run recorded
before 429s said the edge would have said with it (a lone request's wait, the floor, is not in a
429's body and is left out).
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from queueing import wait_ahead, wait_model  # noqa: E402 - after the path that finds it

#: A wait counts as *short* of predicted + margin only past this (s): not floating-point noise.
SHORT_SLACK_S = 0.001


def replay(records: list[dict], *, half_life_answers: float, half_life_s: float,
           quantile: float = wait_model.MARGIN_QUANTILE) -> dict:
    """Predict each record of ``records`` (the web's answer records of one phase) from the answers
    before its admission, with these fit half-lives and margin ``quantile``. Returns the figures
    described in the module docstring (``None`` where fewer than 5 records could be predicted)."""
    recs = sorted((r for r in records if r.get("work_s") is not None), key=lambda r: r["admitted"])
    answered = sorted(recs, key=lambda r: r["answered"])
    errors, within, short = [], 0, 0
    for r in recs:
        before = [a for a in answered if a["answered"] < r["admitted"]]
        if len(before) < 5:
            continue
        fit = wait_model.fit_wait(before, now=r["admitted"], margin_quantile=quantile,
                                  half_life_answers=half_life_answers, half_life_s=half_life_s)
        predicted, actual = fit.predict(r["work_s"]), r["answered"] - r["admitted"]
        errors.append(actual - predicted)
        within += abs(actual - predicted) <= 0.3 * actual
        short += actual > predicted + fit.margin_s + SHORT_SLACK_S
    if len(errors) < 5:
        return {"requests": len(errors), "error_s": None, "within_30pct": None, "short": None}
    errors.sort()
    q = lambda x: round(errors[int(x * (len(errors) - 1))], 3)
    return {"requests": len(errors), "error_s": (q(0.05), q(0.5), q(0.95)),
            "within_30pct": round(within / len(errors), 3), "short": round(short / len(errors), 3)}


def edge_first(model: dict, *, deadline_s: float, predicted_wait_s: float | None,
               min_share: float = wait_model.MIN_MARGIN_SHARE, max_share: float = wait_model.MAX_MARGIN_SHARE) -> float:
    """The first estimate a 429 says (s), from what its body reported (:func:`wait_model.first_wait_ahead`
    at its learnt margin, the margin's floor ``min_share`` × the wait and cap ``max_share`` × the
    deadline; a lone request's wait, not reported, left out): the admission edge, or the drain to it
    (``predicted_wait_s`` − edge) where longer."""
    ahead, _ = wait_model.first_wait_ahead(wait_model.WaitFit(margin_s=float(model.get("learnt_margin_s") or 0.0)),
                                           deadline_s=deadline_s, wait_s=predicted_wait_s or 0.0, alone_s=0.0,
                                           min_share=min_share, max_s=max_share * deadline_s)
    return ahead


def replay_wait_ahead(phases: list[dict], *, by_deadline: bool, first_edge: bool = False,
                      min_share: float = wait_model.MIN_MARGIN_SHARE,
                      max_share: float = wait_model.MAX_MARGIN_SHARE) -> list[dict]:
    """What each 429 of ``phases`` (a ``benchmarks.load`` result's, in run order) would have said,
    learnt online (see the module docstring), refitted every ``wait_ahead.REFIT_S`` s as the web
    does; ``by_deadline``: from the refusals of its own deadline band alone
    (:func:`wait_ahead.deadline_band`), else from all. Returns per phase ``{"name", "checked",
    "first", "replayed", "said"}``: 429s judged, and the share of them within ±30 % of the actual
    wait for the first estimate, the replayed estimate and what the run's 429s said. ``first_edge``:
    the first estimate is :func:`edge_first` (with ``min_share``, ``max_share``) instead of the one
    the 429 reported."""
    from benchmarks.load_judge import RETRY_AFTER_TOLERANCE, actual_wait_near, phase_name

    refusals, answers, judged = [], [], []
    seen_t = seen_admitted = -math.inf  # the newest refusal and admission the phases before gave
    for i, phase in enumerate(phases):
        # what the web's fit had learnt from before the phase (the capacity scan's refusals and
        # answers): not judged, and none the phase before already gave
        before = phase.get("before") or {}
        refusals += [r for r in before.get("refusals", ()) if r["t"] > seen_t and r.get("wait_ahead_s") is not None]
        answers += [a for a in before.get("web_records", ()) if a["admitted"] > seen_admitted]
        answers += phase["web_records"]
        for a in phase["answers"]:
            m = a.get("model") or {}
            if a["status"] != 429 or m.get("first_wait_ahead_s") is None:
                continue
            actual = actual_wait_near(phase["answers"], a["sent"])
            first = (edge_first(m, deadline_s=phase["deadline_s"], predicted_wait_s=a.get("predicted_wait_s"),
                                min_share=min_share, max_share=max_share)
                     if first_edge else m["first_wait_ahead_s"])
            refusals.append({"t": a["sent"], "deadline_s": phase["deadline_s"], "wait_ahead_s": first,
                             **{k: float(m.get(k) or 0.0) for k in wait_ahead.FEATURES[1:]}})
            if actual is not None:
                judged.append((i, refusals[-1], actual, a.get("wait_ahead_s")))
        # the web's time of a 429 is a little after the client's: nothing before the phase's end is new
        seen_t = max([seen_t, *(r["t"] for r in refusals), *phase.get("window", [])[1:]])
        seen_admitted = max([seen_admitted, *(a["admitted"] for a in answers)])
    refusals.sort(key=lambda r: r["t"])
    times = [r["t"] for r in refusals]
    fits: dict = {}
    tally = [{"name": phase_name(p), "checked": 0, "first": 0, "replayed": 0, "said": 0} for p in phases]
    for i, r, actual, said in sorted(judged, key=lambda j: j[1]["t"]):
        now = r["t"]
        key = wait_ahead.deadline_band(r["deadline_s"]) if by_deadline else None
        fitted_at, fit = fits.get(key, (-float("inf"), None))
        if now - fitted_at >= wait_ahead.REFIT_S:
            known = [a for a in answers if a["answered"] <= now]
            pending = [a["admitted"] for a in answers if a["admitted"] <= now < a["answered"]]
            fit = wait_ahead.fit_wait_ahead(refusals[:bisect.bisect_left(times, now)], known, pending_admitted=pending,
                                            now=now, deadline_s=r["deadline_s"] if by_deadline else None)
            fits[key] = (now, fit)
        first = r["wait_ahead_s"]
        replayed = fit.predict(r) if fit else first
        tol = RETRY_AFTER_TOLERANCE * actual
        row = tally[i]
        row["checked"] += 1
        row["first"] += abs(first - actual) <= tol
        row["replayed"] += abs(replayed - actual) <= tol
        row["said"] += said is not None and abs(said - actual) <= tol
    return [{**row, **{k: round(row[k] / row["checked"], 4) if row["checked"] else None
                       for k in ("first", "replayed", "said")}} for row in tally]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a benchmarks.load --out JSON")
    ap.add_argument("--half-lives", nargs="+", default=["6:5", "16:10"], metavar="ANSWERS:SECONDS",
                    help="fit half-lives to compare (default: 6:5, the earlier ones, and 16:10)")
    ap.add_argument("--wait-ahead", action="store_true",
                    help="replay what the 429s say (learnt from all refusals, and per deadline band) instead")
    ap.add_argument("--first-edge", action="store_true",
                    help="with --wait-ahead: the first estimate from the admission edge (what 429s say now) "
                         "instead of the one each 429 reported")
    ap.add_argument("--margin-quantile", type=float, default=wait_model.MARGIN_QUANTILE,
                    help="the quantile of late errors the margin covers (ADMISSION_MARGIN_QUANTILE; "
                         f"default {wait_model.MARGIN_QUANTILE})")
    ap.add_argument("--min-margin-share", type=float, default=wait_model.MIN_MARGIN_SHARE,
                    help="with --first-edge: the margin's floor, a share of the predicted wait "
                         f"(ADMISSION_MIN_MARGIN_SHARE; default {wait_model.MIN_MARGIN_SHARE})")
    ap.add_argument("--max-margin-share", type=float, default=wait_model.MAX_MARGIN_SHARE,
                    help="with --first-edge: the margin's cap, a share of the deadline "
                         f"(ADMISSION_MAX_MARGIN_SHARE; default {wait_model.MAX_MARGIN_SHARE})")
    args = ap.parse_args()
    shares = {"min_share": args.min_margin_share, "max_share": args.max_margin_share}
    result = json.loads(Path(args.result).read_text())
    print(f"{result.get('machine', {}).get('cpu', '?')}; {args.result}")
    if args.wait_ahead:
        every = replay_wait_ahead(result["phases"], by_deadline=False, first_edge=args.first_edge, **shares)
        banded = replay_wait_ahead(result["phases"], by_deadline=True, first_edge=args.first_edge, **shares)
        print("| phase | 429s judged | first estimate ±30 % | learnt from every refusal | learnt per deadline band "
              "| what the run's 429s said |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        pc = lambda x: "-" if x is None else f"{100 * x:.1f} %"  # noqa: E731
        for a, b in zip(every, banded):
            print(f"| {a['name']} | {a['checked']} | {pc(a['first'])} | {pc(a['replayed'])} | {pc(b['replayed'])} "
                  f"| {pc(a['said'])} |")
        return 0
    print("| phase | half-lives (answers : s) | requests | error p5 / p50 / p95 (s) | within ±30 % "
          "| short of predicted + margin |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for phase in result["phases"]:
        name = f"{phase['deadline_s']:g} s{' + bulk' if phase.get('bulk') else ''}"
        for spec in args.half_lives:
            answers, seconds = (float(x) for x in spec.split(":"))
            r = replay(phase["web_records"], half_life_answers=answers, half_life_s=seconds,
                       quantile=args.margin_quantile)
            err = " / ".join(f"{e:+.2f}" for e in r["error_s"]) if r["error_s"] else "-"
            print(f"| {name} | {spec} | {r['requests']} | {err} | {r['within_30pct']} | {r['short']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
