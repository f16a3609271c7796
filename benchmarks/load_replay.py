"""Replay a ``bench-load`` run's admitted requests against the wait model with other half-lives.

    python -m benchmarks.load_replay var/bench-load.json [--half-lives 6:5 16:10 24:15]

For every admitted request of every phase (the web's own records, ``admission.ANSWERS_KEY``, saved
by ``benchmarks.load``), the model is fitted (:func:`embeddings.services.wait_model.fit_wait`) on the
answers that had arrived before it was admitted, with the fit's half-lives set to ``ANSWERS:SECONDS``
(its ``half_life_answers`` and ``half_life_s``; ``FIT_HALF_LIFE_ANSWERS``, ``FIT_HALF_LIFE_S`` by
default), and its predicted wait for the request's ``work_s`` is compared with the wait it really had. Printed per phase and half-lives: the error
(actual − predicted, s) at the 5th / 50th / 95th percentile, the share of requests predicted
within ±30 %, and the share whose wait was longer than predicted + the fit's margin (*short*:
what ends 202 at the admission threshold).

A replay, not a rerun: the requests, their admission times and their ``work_s`` are the run's
own, so the lane's trajectory (which admissions a different model would have refused) is not
replayed, and admitted-but-unanswered requests (``fit_wait``'s ``pending``) are left out. It says
which half-lives would have predicted that trajectory better; ``make bench-load`` with the change
says whether the lane then behaves better.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: A wait counts as *short* of predicted + margin only past this (s): not floating-point noise.
SHORT_SLACK_S = 0.001


def replay(records: list[dict], *, half_life_answers: float, half_life_s: float, quantile: float = 0.99) -> dict:
    """Predict each record of ``records`` (the web's answer records of one phase) from the answers
    before its admission, with these fit half-lives. Returns the figures described in the module
    docstring (``None`` where fewer than 5 records could be predicted)."""
    from embeddings.services import wait_model

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a benchmarks.load --out JSON")
    ap.add_argument("--half-lives", nargs="+", default=["6:5", "16:10"], metavar="ANSWERS:SECONDS",
                    help="fit half-lives to compare (default: 6:5, the earlier ones, and 16:10)")
    args = ap.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    result = json.loads(Path(args.result).read_text())
    print(f"{result.get('machine', {}).get('cpu', '?')}; {args.result}")
    print("| phase | half-lives (answers : s) | requests | error p5 / p50 / p95 (s) | within ±30 % | short of predicted + margin |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for phase in result["phases"]:
        name = f"{phase['deadline_s']:g} s{' + bulk' if phase.get('bulk') else ''}"
        for spec in args.half_lives:
            answers, seconds = (float(x) for x in spec.split(":"))
            r = replay(phase["web_records"], half_life_answers=answers, half_life_s=seconds)
            err = " / ".join(f"{e:+.2f}" for e in r["error_s"]) if r["error_s"] else "-"
            print(f"| {name} | {spec} | {r['requests']} | {err} | {r['within_30pct']} | {r['short']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
