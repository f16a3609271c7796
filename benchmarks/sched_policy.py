"""How much a bulk forward pass slows an interactive one on the same cores, by the bulk worker's
CPU scheduling policy: none (the interactive pass alone), nice 19, and Linux's ``SCHED_IDLE``.

``make bench-sched`` (= ``python -m benchmarks.sched_policy``). The deployment's shape without its
services: one "interactive" process with the interactive worker's torch threads
(``--interactive-threads``, default what ``PipelineConfig.threads`` gives it here: 1 on 2 cores) runs
ViT-B-32 passes of ``--batch`` (8, a full interactive batch) with ``--gap-ms`` pauses between them
(decode and batching, when the interactive worker leaves the cores to others), while
``--bulk-processes`` (2, ``BULK_PROCESSES``) "bulk" processes of one torch thread each run passes of
``--bulk-batch`` images back to back under the policy. Conditions take turns ``--rounds`` times
so that a machine's drift falls on all of them. Seeded random weights, fp32, random pixels.

Prints the machine, a table (interactive pass ms: median, p90, max, CV; its slowdown against
alone in the same round; the bulk processes' images/s over the same time), saves
``var/bench-sched/sched.json`` and a plot of each condition's pass times. The figures it printed
are in docs/benchmarks-load.md ("The bulk worker under SCHED_IDLE").
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks._common import ROOT, machine, machine_line, markdown_table, pyplot, write_json

#: The conditions: ``alone`` (no bulk process), ``nice`` (what a bulk-only worker does by default:
#: ``BULK_WORKER_NICE``, 19), ``idle`` (what it does with ``BULK_WORKER_SCHED_IDLE=1``: nice and
#: ``SCHED_IDLE``).
CONDITIONS = ("alone", "nice", "idle")


def _encoder(threads: int):
    from workers.config import PipelineConfig
    from workers.model import ClipEncoder

    return ClipEncoder(PipelineConfig(pretrained="random", precision="fp32", device="cpu", torch_threads=threads,
                                      bulk_processes=1))


def _bulk(policy: str, batch: int, images, ready, stop) -> None:
    """One bulk process: lower its priority with the bulk-only worker's own ``celeryd_init`` handler
    (``embeddings.worker_boot.lower_cpu_priority``; ``BULK_WORKER_SCHED_IDLE`` set by ``policy``), then run
    passes of ``batch`` random images until ``stop``, adding each pass's images to ``images``."""
    os.environ["BULK_WORKER_SCHED_IDLE"] = "1" if policy == "idle" else "0"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    import torch

    from embeddings.worker_boot import lower_cpu_priority
    from project import lanes

    lower_cpu_priority(options={"queues": [lanes.BULK]})  # its warnings still show
    logging.disable(logging.INFO)  # Django's logging config would print the model load in every process
    enc = _encoder(1)
    x = torch.randn(batch, 3, 224, 224)
    enc.encode_images(x)
    ready.release()
    while not stop.is_set():
        enc.encode_images(x)
        with images.get_lock():
            images.value += batch


def measure(enc, condition: str, *, passes: int, batch: int, gap_ms: float, bulk_processes: int,
            bulk_batch: int) -> dict:
    """Interactive pass times (ms, one per pass) of ``condition`` and the bulk images/s meanwhile."""
    import torch

    ctx = mp.get_context("spawn")  # a fresh interpreter: no torch thread pool copied across a fork
    stop, images, ready = ctx.Event(), ctx.Value("q", 0), ctx.Semaphore(0)
    procs = [] if condition == "alone" else [
        ctx.Process(target=_bulk, args=(condition, bulk_batch, images, ready, stop), daemon=True)
        for _ in range(bulk_processes)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=300):
            raise RuntimeError("a bulk process did not start within 300 s")
    x = torch.randn(batch, 3, 224, 224)
    times = []
    n0, t0 = images.value, time.perf_counter()
    for _ in range(passes):
        s = time.perf_counter()
        enc.encode_images(x)
        times.append((time.perf_counter() - s) * 1000)
        time.sleep(gap_ms / 1000)
    bulk_ips = (images.value - n0) / (time.perf_counter() - t0)
    stop.set()
    for p in procs:
        p.join(timeout=60)
    return {"condition": condition, "pass_ms": times, "bulk_images_per_s": bulk_ips}


def summary(results: list[dict]) -> list[dict]:
    """One row per (round, condition): pass ms median / p90 / max, CV, slowdown against the same
    round's ``alone`` median, bulk images/s."""
    rows, alone = [], {}
    for r in results:
        t = sorted(r["pass_ms"])
        med = statistics.median(t)
        if r["condition"] == "alone":
            alone[r["round"]] = med
        rows.append({"round": r["round"], "condition": r["condition"], "median_ms": med,
                     "p90_ms": t[min(len(t) - 1, int(0.9 * len(t)))], "max_ms": t[-1],
                     "cv": statistics.pstdev(t) / statistics.fmean(t), "bulk_images_per_s": r["bulk_images_per_s"]})
    for row in rows:
        row["slowdown"] = row["median_ms"] / alone[row["round"]] if row["round"] in alone else None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=20, help="interactive passes per condition and round")
    ap.add_argument("--batch", type=int, default=8, help="images per interactive pass")
    ap.add_argument("--gap-ms", type=float, default=100.0, help="pause after each interactive pass (ms)")
    ap.add_argument("--bulk-processes", type=int, default=2)
    ap.add_argument("--bulk-batch", type=int, default=16, help="images per bulk pass")
    ap.add_argument("--interactive-threads", type=int, default=None,
                    help="torch threads of the interactive pass (default: the interactive worker's)")
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench-sched")
    args = ap.parse_args(argv)
    if not hasattr(os, "SCHED_IDLE"):
        print("SCHED_IDLE is Linux's: nothing to compare here", file=sys.stderr)
        return 2
    from workers.config import PipelineConfig

    info = machine()
    threads = args.interactive_threads or PipelineConfig(device="cpu").threads().torch
    print(machine_line(info), f"(load average {info.get('load_average_1m')}); interactive pass on {threads} torch "
          f"thread(s), {args.bulk_processes} bulk processes of 1", flush=True)
    enc = _encoder(threads)
    enc.encode_images(__import__("torch").randn(args.batch, 3, 224, 224))  # warm-up
    results = []
    for rnd in range(1, args.rounds + 1):
        for cond in CONDITIONS:
            r = measure(enc, cond, passes=args.passes, batch=args.batch, gap_ms=args.gap_ms,
                        bulk_processes=args.bulk_processes, bulk_batch=args.bulk_batch)
            r["round"] = rnd
            results.append(r)
            print(f"round {rnd} {cond:5s}: median {statistics.median(r['pass_ms']):.0f} ms, "
                  f"bulk {r['bulk_images_per_s']:.1f} images/s", flush=True)
    rows = summary(results)
    print()
    print(markdown_table(
        ["round", "bulk policy", "pass ms median", "p90", "max", "CV", "× alone", "bulk images/s"],
        [[r["round"], r["condition"], r["median_ms"], r["p90_ms"], r["max_ms"], round(r["cv"], 3),
          None if r["slowdown"] is None else round(r["slowdown"], 2), r["bulk_images_per_s"]] for r in rows]))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "sched.json", {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results, "summary": rows})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for cond, colour in zip(CONDITIONS, ("tab:green", "tab:red", "tab:blue")):
        ts = [t for r in results if r["condition"] == cond for t in r["pass_ms"]]
        ax.plot(range(len(ts)), ts, ".-", color=colour, label=cond, alpha=0.8)
    ax.set_xlabel("interactive pass (rounds one after another)")
    ax.set_ylabel(f"pass of {args.batch} (ms)")
    ax.set_title(f"interactive pass ({threads} thread(s)) beside {args.bulk_processes} bulk processes, by their policy\n"
                 f"{info['cpu']}, {info['cores']} cores", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "sched.png", dpi=110)
    print(f"\nsaved {args.out / 'sched.json'} and {args.out / 'sched.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
