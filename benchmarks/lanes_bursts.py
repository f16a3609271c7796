"""Bursts of simultaneous single-image uploads on an idle stack, under each batching rule: the batch
sizes the interactive worker formed and the uploads' latency (docs/benchmarks-lanes.md, "a lone
request no longer sits out the batching window").

    python -m benchmarks.lanes_bursts                         # 6 bursts of 8, both rules
    python -m benchmarks.lanes_bursts --bursts 10 --size 4 --rules announced

Each rule (``INTERACTIVE_BATCH_WAIT``) gets a fresh stack (``scripts.stack.Stack``: private Redis,
embedded store, ViT-B-32 with seeded random weights); after a warm-up, ``--bursts`` bursts of
``--size`` uploads of distinct photos, one client thread each, ``--gap`` s apart. Batch sizes are the
worker's records (``lanes:interactive:batches`` in Redis); latency is each upload's client wall time.
Prints a table and writes ``bursts.json`` to ``--out``. Exit status 1 when an upload is not answered 200.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import time
from pathlib import Path

import numpy as np
import redis

from benchmarks._common import machine, machine_line
from benchmarks.lanes import INTERACTIVE_BATCHES_KEY, Client, base_images, distinct_jpeg
from scripts.stack import Stack

RULES = ("announced", "window")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=int, default=6, help="bursts per rule")
    p.add_argument("--size", type=int, default=8, help="simultaneous uploads per burst")
    p.add_argument("--gap", type=float, default=1.0, help="seconds between bursts (the lane idles between them)")
    p.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES), help="INTERACTIVE_BATCH_WAIT values")
    p.add_argument("--out", default="var/bench-lanes-bursts", help="output folder")
    return p.parse_args(argv)


def run_rule(rule: str, args, bases, out: Path) -> dict:
    """One fresh stack under ``rule``: ``{"rule", "batch_sizes", "latency_ms", "statuses"}``."""
    folder = out / f"stack-{rule}"
    shutil.rmtree(folder, ignore_errors=True)
    env = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "INTERACTIVE_BATCH_WAIT": rule}
    with Stack(folder, env, private_redis=True, log=lambda *a: None) as stack:
        stack.manage("apiuser", "bench", "--staff")
        client = Client(stack.web_url, stack.manage("apikeys", "create", "bench").strip())
        for i in range(4):  # warm-up: models loaded, connections open; not measured
            client.upload(distinct_jpeg(bases, 10**6 + i), f"w{i}.jpg")
        r = redis.Redis.from_url(stack.env["REDIS_URL"])
        r.delete(INTERACTIVE_BATCHES_KEY)
        photos = [distinct_jpeg(bases, 3 * 10**6 + i) for i in range(args.bursts * args.size)]  # before the clock
        samples = []
        with concurrent.futures.ThreadPoolExecutor(args.size) as pool:
            for b in range(args.bursts):
                burst = range(b * args.size, (b + 1) * args.size)
                samples += pool.map(lambda i: client.upload(photos[i], f"b{i}.jpg"), burst)
                time.sleep(args.gap)
        rows = [json.loads(x) for x in r.lrange(INTERACTIVE_BATCHES_KEY, 0, -1)]
    return {"rule": rule, "batch_sizes": sorted((row["size"] for row in rows), reverse=True),
            "latency_ms": [s.latency_ms for s in samples], "statuses": [s.http for s in samples]}


def table(results: list[dict]) -> str:
    lines = ["| rule | batches | images per batch | upload p50 / p95 ms | answered 200 |",
             "| --- | --- | --- | --- | --- |"]
    for res in results:
        lat = np.array(res["latency_ms"])
        ok = sum(1 for s in res["statuses"] if s == 200)
        lines.append(f"| {res['rule']} | {len(res['batch_sizes'])} | {', '.join(map(str, res['batch_sizes']))} "
                     f"| {np.percentile(lat, 50):.1f} / {np.percentile(lat, 95):.1f} | {ok}/{len(lat)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(machine_line(info), flush=True)
    bases = base_images(16)
    results = [run_rule(rule, args, bases, out) for rule in args.rules]
    print(f"{args.bursts} bursts of {args.size} simultaneous uploads, {args.gap} s apart\n\n{table(results)}")
    (out / "bursts.json").write_text(json.dumps({"machine": info, "args": vars(args), "results": results}, indent=1))
    print(f"\nwrote {out}/bursts.json")
    return 0 if all(s == 200 for res in results for s in res["statuses"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
