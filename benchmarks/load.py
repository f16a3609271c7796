"""Load: the interactive endpoint under a sustained request rate, and the workers' memory across it.

    python -m benchmarks.load [--rate 4] [--duration 60] [--files 1]      (``make bench-load``)

Starts the whole service (``scripts.stack.Stack``: private Redis, web, one worker per queue,
embedded Qdrant, the real ViT-B-32 architecture with seeded random weights), warms it up, then sends
``POST /api/images/`` at ``--rate`` requests per second for ``--duration`` seconds, open loop (a slow
answer does not delay the next request), each with ``--files`` distinct small JPEGs. Requests go
only to 127.0.0.1 and are bounded: ``rate × duration`` of them, at most ``--max-in-flight`` at once,
each with a 60 s client timeout.

Pass criteria (issue 6):
- no 5xx and no connection error;
- only documented 429s: code ``overloaded`` with a ``Retry-After`` header (admission control,
  ``embeddings/services/admission.py``); every other answer is 200 (embedded within the deadline)
  or 202 (deadline passed, status URL given);
- no growth of worker memory: the resident set (RSS, the process and its children) of every worker
  and of the web is sampled once a second; reported: start, end, max, the growth from the first to
  the last tenth of the run, and the growth over its second half (after allocator and cache
  warm-up), which must stay under ``--max-growth-mb``.

Prints a table and writes ``--out`` (JSON with every sample).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import machine, machine_line
from scripts.soak import make_jpeg
from scripts.stack import Stack

PROCESSES = ("web", "worker-interactive", "worker-bulk", "worker-vectors")


def tree_rss_mb(pid: int) -> float:
    """Resident set size (MiB) of a process and all its descendants (prefork children, gunicorn workers)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class Sampler(threading.Thread):
    """Samples :func:`tree_rss_mb` of each named process every ``every`` seconds."""

    def __init__(self, pids: dict[str, int], every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            self.samples.append({"t": round(time.monotonic() - t0, 2),
                                 **{n: round(tree_rss_mb(pid), 1) for n, pid in self.pids.items()}})
            self.stop.wait(self.every)

    def summary(self) -> dict[str, dict]:
        """Per process: MiB at start / end / max, and growth = mean(last tenth) − mean(first tenth)."""
        out = {}
        k = max(1, len(self.samples) // 10)
        for n in self.pids:
            series = [s[n] for s in self.samples]
            mid = len(series) // 2
            out[n] = {"start_mb": series[0], "end_mb": series[-1], "max_mb": max(series),
                      "growth_mb": round(statistics.fmean(series[-k:]) - statistics.fmean(series[:k]), 1),
                      "second_half_growth_mb": round(statistics.fmean(series[-k:])
                                                     - statistics.fmean(series[mid - k // 2: mid + k - k // 2]), 1)}
        return out


def run_load(stack: Stack, *, rate: float, duration: float, files: int, max_in_flight: int = 64,
             warmup: int = 10, seed: int = 0) -> dict:
    """Send the load to a running stack; returns the result dict (see module docstring)."""
    token = stack.manage("apiuser", "load").strip()
    s = requests.Session()
    s.headers["Authorization"] = f"Token {token}"
    s.headers["Connection"] = "close"  # never reuse a keep-alive connection the server is closing
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=max_in_flight)
    s.mount("http://", adapter)
    url = stack.web_url + "/api/images/"
    assert url.startswith("http://127.0.0.1:")
    counter = iter(range(seed * 10_000_000, 10**12))

    def one() -> dict:
        body = [("files", (f"{n}.jpg", make_jpeg(n, 128))) for n in (next(counter) for _ in range(files))]
        t0 = time.perf_counter()
        try:
            r = s.post(url, files=body, data={"k": 5}, timeout=60)
        except requests.RequestException as e:
            return {"status": "error", "error": repr(e), "ms": (time.perf_counter() - t0) * 1000}
        out = {"status": r.status_code, "ms": (time.perf_counter() - t0) * 1000}
        if r.status_code == 429:
            out["code"] = r.json().get("code")
            out["retry_after"] = r.headers.get("Retry-After")
        elif r.status_code >= 500:
            out["body"] = r.text[:300]
        return out

    for _ in range(warmup):  # load the model, fill caches: not measured
        one()
    pids = {n: stack.pid(n) for n in PROCESSES if n in stack.procs}
    sampler = Sampler(pids)
    sampler.start()
    n_total = int(rate * duration)
    results: list[dict] = []
    t_start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_in_flight) as pool:
        futures = []
        for i in range(n_total):
            delay = t_start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one))
        sent_s = time.monotonic() - t_start
        results = [f.result() for f in futures]
    wall = time.monotonic() - t_start
    sampler.stop.set()
    sampler.join()
    by_status: dict[str, int] = {}
    for r in results:
        by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
    ok = [r["ms"] for r in results if r["status"] in (200, 202)]
    pct = lambda xs, q: round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else None
    undocumented_429 = [r for r in results if r["status"] == 429 and (r.get("code") != "overloaded" or not r.get("retry_after"))]
    five_xx = [r for r in results if r["status"] == "error" or (isinstance(r["status"], int) and r["status"] >= 500)]
    memory = sampler.summary()
    return {
        "rate_per_s": rate, "duration_s": duration, "files_per_request": files, "requests": n_total,
        "sent_in_s": round(sent_s, 1), "wall_s": round(wall, 1), "by_status": by_status,
        "latency_ms_200_202": {"p50": pct(ok, 0.5), "p95": pct(ok, 0.95), "p99": pct(ok, 0.99),
                               "max": round(max(ok), 1) if ok else None},
        "memory_mb": memory, "five_xx_or_errors": five_xx[:20], "undocumented_429": undocumented_429[:20],
        "samples": sampler.samples,
    }


def verdict(result: dict, *, max_growth_mb: float) -> dict[str, bool]:
    """The pass criteria, by name."""
    statuses = set(result["by_status"])
    return {
        "no 5xx or connection errors": not result["five_xx_or_errors"],
        "only 200 / 202 / documented 429": statuses <= {"200", "202", "429"} and not result["undocumented_429"],
        f"no worker memory growth (second half < {max_growth_mb} MiB)":
            all(m["second_half_growth_mb"] < max_growth_mb for n, m in result["memory_mb"].items()),
    }


def table(result: dict, checks: dict[str, bool]) -> str:
    lat = result["latency_ms_200_202"]
    lines = [
        f"{result['requests']} requests at {result['rate_per_s']}/s for {result['duration_s']} s "
        f"({result['files_per_request']} image(s) each); answers: {result['by_status']}",
        f"latency of 200/202 (ms): p50 {lat['p50']}  p95 {lat['p95']}  p99 {lat['p99']}  max {lat['max']}",
        "",
        "| process | RSS start (MiB) | end | max | growth (last − first tenth) | second half |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, m in result["memory_mb"].items():
        lines.append(f"| {n} | {m['start_mb']:.0f} | {m['end_mb']:.0f} | {m['max_mb']:.0f} | {m['growth_mb']:+.1f} "
                     f"| {m['second_half_growth_mb']:+.1f} |")
    lines.append("")
    lines += [f"{'PASS' if v else 'FAIL'}  {k}" for k, v in checks.items()]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of sustained load")
    ap.add_argument("--files", type=int, default=1, help="images per request")
    ap.add_argument("--max-in-flight", type=int, default=64)
    ap.add_argument("--max-growth-mb", type=float, default=16.0,
                    help="largest RSS growth (MiB) allowed over the second half of the run, per process")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench-load.json"))
    ap.add_argument("--var-dir", default=None)
    args = ap.parse_args()
    if args.rate * args.duration > 10_000:
        raise SystemExit("refusing more than 10,000 requests in one run")
    var = Path(args.var_dir) if args.var_dir else Path(tempfile.mkdtemp(prefix="bench-load-"))
    env = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0"}
    hardware = machine()
    print(machine_line(hardware), flush=True)
    with Stack(var, env, private_redis=True, log=lambda *a: None) as stack:
        result = run_load(stack, rate=args.rate, duration=args.duration, files=args.files,
                          max_in_flight=args.max_in_flight)
    checks = verdict(result, max_growth_mb=args.max_growth_mb)
    result["checks"] = checks
    result["machine"] = hardware
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(machine_line(hardware) + "\n\n" + table(result, checks))
    print(f"(samples and details in {args.out})")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
