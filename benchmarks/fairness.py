"""Issue 54's fairness benchmark: the bulk lane under ``BULK_SCHEDULER=fifo`` and ``fair``, on a real
stack each, in one run.

    python -m benchmarks.fairness [--chunk 16] [--window 2] [--busy-s 60]
    make bench-fairness [BENCH_ARGS="..."]

Each policy gets a fresh stack (``scripts.stack.Stack``: web, one Celery worker per queue with the
default 2 bulk processes, a private Redis, SQLite, embedded store; seeded random ViT-B-32 weights,
fp32, 96 px JPEGs), warmed by a first job, then runs the scenarios in order, each on an empty lane:

1. **small behind big**: a 64-image job alone (its standalone time: the mean of a run before and one
   after, the machine's other load drifts), then a ``--big``-image job of another owner and the
   same-sized small job 2 s later: the small job's time (created → finished) against standalone;
   target under ``fair`` ≤ 2.5 ×.
2. **three owners, equal weights**: each keeps three 64-image jobs outstanding (a new one when one
   finishes) for ``--busy-s`` seconds; Jain's fairness index of their images/s over the busy
   window (from each image's ``embedded_at``); target ≥ 0.95. The lane's images/s over the same
   window is the throughput figure: target ``fair`` ≥ 0.95 × ``fifo``.
3. **weights 2:1:1** (``BULK_OWNER_WEIGHTS``), the same: shares within ±10 % of 50/25/25 %.
4. **deadlines**: a ``--big``-image job without one, then three jobs of other owners (32, 48, 64
   images) with deadlines that earliest-deadline-first meets with 50 % to spare at the rate
   scenario 1 measured (first come, first served finishes them after the big job): how many are
   missed; target under ``fair`` none.

Outstanding jobs are cancelled at the end of each scenario (the tail is not measured). Prints the
machine (CPU model, flags, load average), a table and PASS/FAIL lines; saves ``results.json``,
``table.md`` and ``fairness.png`` (each owner's images over time: the slope is its images/s; one panel per
scenario and policy)
under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ROOT, begin, markdown_table, pyplot  # noqa: E402
from benchmarks.lanes import Client  # noqa: E402
from scripts.soak import make_jpeg, zip_of  # noqa: E402
from scripts.stack import Stack  # noqa: E402

POLICIES = ("fifo", "fair")
#: The issue's targets.
SMALL_RATIO_MAX = 2.5
JAIN_MIN = 0.95
SHARE_TOLERANCE = 0.10
THROUGHPUT_MIN = 0.95
#: Users of each scenario; ``w2a`` has weight 2 (``BULK_OWNER_WEIGHTS``), everyone else 1.
EQUAL = ("eqa", "eqb", "eqc")
WEIGHTED = ("w2a", "w2b", "w2c")
WEIGHTS = {"w2a": 2.0, "w2b": 1.0, "w2c": 1.0}
USERS = ("warm", "big", "small", *EQUAL, *WEIGHTED, "dx", "da", "db", "dc")
JOB = 64
#: Deadlines of scenario 4: earliest-deadline-first's finish times at the measured rate, times this.
MARGIN = 1.5


class Lane:
    """The stack's API as several owners, and its database read afterwards."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.clients = {u: Client(stack.web_url, stack.manage("apiuser", u).strip()) for u in USERS}
        self.seed = 1000

    def submit(self, user: str, n: int, **fields) -> str:
        files = []
        for _ in range(n):
            self.seed += 1
            files.append((f"i{self.seed}.jpg", make_jpeg(self.seed)))
        c = self.clients[user]
        r = c.s.post(c.base + "/api/jobs/", files={"zip": ("job.zip", zip_of(files))},
                     data={k: str(v) for k, v in fields.items()}, timeout=120)
        if r.status_code != 202:
            raise SystemExit(f"job refused: {r.status_code} {r.text[:300]}")
        return r.json()["id"]

    def job(self, user: str, job_id: str) -> dict:
        return self.clients[user].job(job_id)

    def wait(self, jobs: dict[str, str], timeout: float = 600) -> dict[str, dict]:
        """Wait until every ``{job id: user}`` is done or cancelled; returns their answers."""
        end = time.monotonic() + timeout
        out: dict[str, dict] = {}
        while len(out) < len(jobs):
            for job_id, user in jobs.items():
                if job_id not in out:
                    j = self.job(user, job_id)
                    if j["status"] in ("done", "cancelled"):
                        out[job_id] = j
            if time.monotonic() > end:
                raise TimeoutError(f"jobs not done after {timeout} s")
            time.sleep(0.5)
        return out

    def cancel(self, jobs: dict[str, str]) -> None:
        for job_id, user in jobs.items():
            c = self.clients[user]
            c.s.post(f"{c.base}/api/jobs/{job_id}/cancel/", timeout=60)

    def embedded(self, since: float, until: float | None = None) -> list[tuple[str, float]]:
        """``[(owner, embedded_at Unix s)]`` of images embedded in the window, read from SQLite."""
        con = sqlite3.connect(self.stack.var_dir / "db.sqlite3", timeout=30)
        try:
            rows = con.execute("SELECT u.username, i.embedded_at FROM embeddings_image i JOIN auth_user u "
                               "ON u.id = i.owner_id WHERE i.embedded_at IS NOT NULL").fetchall()
        finally:
            con.close()
        out = []
        for user, at in rows:
            t = dt.datetime.fromisoformat(at).replace(tzinfo=dt.timezone.utc).timestamp()
            if t >= since and (until is None or t <= until):
                out.append((user, t))
        return out


def _span(j: dict) -> float:
    def ts(s):
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()

    return ts(j["finished_at"]) - ts(j["created_at"])


def small_behind_big(lane: Lane, big: int) -> dict:
    alone_id = lane.submit("small", JOB)
    alone = lane.wait({alone_id: "small"})[alone_id]
    big_id = lane.submit("big", big)
    time.sleep(2.0)
    small_id = lane.submit("small", JOB)
    small = lane.wait({small_id: "small"})[small_id]
    big_now = lane.job("big", big_id)
    big_done = lane.wait({big_id: "big"})[big_id]
    again_id = lane.submit("small", JOB)  # standalone again: the machine's other load drifts
    again = lane.wait({again_id: "small"})[again_id]
    alone_s = (_span(alone) + _span(again)) / 2
    return {"alone_s": round(alone_s, 2), "alone_each_s": [round(_span(alone), 2), round(_span(again), 2)],
            "behind_s": round(_span(small), 2), "ratio": round(_span(small) / alone_s, 2),
            "big_embedded_when_small_done": big_now["embedded"],
            "lane_images_per_s": round((big + JOB) / _span(big_done), 2)}


def continuous(lane: Lane, users: tuple[str, ...], busy_s: float, warm_s: float = 6.0) -> dict:
    """Each of ``users`` keeps three jobs outstanding for ``busy_s``; images/s per owner over the
    window after ``warm_s`` (every owner's first chunks in)."""
    outstanding: dict[str, list[str]] = {u: [] for u in users}
    lock = threading.Lock()
    t0 = time.time()
    stop = t0 + busy_s

    def keep(user: str) -> None:
        while time.time() < stop:
            with lock:
                mine = list(outstanding[user])
            live = [j for j in mine if lane.job(user, j)["status"] not in ("done", "cancelled")]
            for _ in range(3 - len(live)):
                live.append(lane.submit(user, JOB))
            with lock:
                outstanding[user] = live
            time.sleep(0.5)

    threads = [threading.Thread(target=keep, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    since, until = t0 + warm_s, stop
    lane.cancel({j: u for u, js in outstanding.items() for j in js})
    rows = lane.embedded(t0 - 1)
    window = [(u, t) for u, t in rows if since <= t <= until and u in users]
    rates = {u: sum(1 for o, _ in window if o == u) / (until - since) for u in users}
    total = sum(rates.values())
    jain = total ** 2 / (len(users) * sum(r * r for r in rates.values())) if total else 0.0
    time.sleep(2.0)  # cancelled chunks in flight settle before the next scenario
    return {"rates": {u: round(r, 2) for u, r in rates.items()}, "shares": {u: round(r / total, 3) if total else 0.0
                                                                             for u, r in rates.items()},
            "jain": round(jain, 4), "images_per_s": round(total, 2), "t0": t0,
            "series": [(u, round(t - t0, 3)) for u, t in rows if u in users]}


def deadlines(lane: Lane, big: int, rate: float) -> dict:
    big_id = lane.submit("dx", big)
    time.sleep(2.0)
    ahead = 64.0  # images already in the window when they arrive
    jobs, cum = {}, 0
    for user, n in (("da", 32), ("db", 48), ("dc", 64)):
        cum += n
        due = time.time() + MARGIN * (ahead + cum) / rate + 2.0
        deadline = dt.datetime.fromtimestamp(due, tz=dt.timezone.utc).isoformat()
        jobs[lane.submit(user, n, deadline=deadline)] = user
    done = lane.wait(jobs)
    lane.cancel({big_id: "dx"})
    missed = sum(1 for j in done.values() if j["finished_at"] > j["deadline"])
    time.sleep(2.0)
    return {"jobs": len(jobs), "missed": missed,
            "late_s": {jobs[i]: round((dt.datetime.fromisoformat(j["finished_at"].replace("Z", "+00:00"))
                                       - dt.datetime.fromisoformat(j["deadline"].replace("Z", "+00:00")))
                                      .total_seconds(), 1) for i, j in done.items()}}


def run_policy(policy: str, args, out: Path) -> dict:
    env = {"CLIP_PRETRAINED": "random", "CLIP_PRECISION": "fp32", "DJANGO_DEBUG": "0", "ADMISSION_CONTROL": "0",
           "BULK_SCHEDULER": policy, "BULK_BATCH_SIZE": str(args.chunk), "BULK_SCHEDULER_WINDOW": str(args.window),
           "BULK_OWNER_WEIGHTS": ",".join(f"{u}={w:g}" for u, w in WEIGHTS.items() if w != 1.0),
           "BULK_YIELD_MAX_S": "0", "RECONCILE_INTERVAL_S": "5", "DATABASE_URL": ""}
    res: dict = {}
    with Stack(out / f"stack-{policy}", env, private_redis=True, log=lambda *a: None) as stack:
        lane = Lane(stack)
        warm = lane.submit("warm", 2 * args.chunk)
        lane.wait({warm: "warm"})
        res["small"] = small_behind_big(lane, args.big)
        print(f"[{policy}] small behind big: {res['small']}", flush=True)
        if args.only:
            return res
        res["equal"] = continuous(lane, EQUAL, args.busy_s)
        print(f"[{policy}] equal weights: jain {res['equal']['jain']}, {res['equal']['images_per_s']} images/s",
              flush=True)
        res["weighted"] = continuous(lane, WEIGHTED, args.busy_s)
        print(f"[{policy}] weights 2:1:1: shares {res['weighted']['shares']}", flush=True)
        # the rate of scenario 1 (the big job alone most of the time), not scenario 2's (its uploads share the cores)
        res["deadlines"] = deadlines(lane, args.big, res["small"]["lane_images_per_s"])
        print(f"[{policy}] deadlines: {res['deadlines']}", flush=True)
    return res


def verdicts(res: dict) -> list[tuple[bool, str]]:
    fifo, fair = res["fifo"], res["fair"]
    w = fair["weighted"]["shares"]
    want = {u: WEIGHTS[u] / sum(WEIGHTS.values()) for u in WEIGHTED}
    ratio = fair["equal"]["images_per_s"] / fifo["equal"]["images_per_s"] if fifo["equal"]["images_per_s"] else 0.0
    fair_w = ", ".join(f"{100 * w[u]:.1f} %" for u in WEIGHTED)
    fifo_w = ", ".join(f"{100 * fifo['weighted']['shares'][u]:.1f} %" for u in WEIGHTED)
    return [
        (fair["small"]["ratio"] <= SMALL_RATIO_MAX,
         f"small job behind a big one: {fair['small']['ratio']}x its standalone time under fair (target <= "
         f"{SMALL_RATIO_MAX}x; fifo {fifo['small']['ratio']}x)"),
        (fair["equal"]["jain"] >= JAIN_MIN,
         f"three owners, equal weights: Jain's index {fair['equal']['jain']} under fair (target >= {JAIN_MIN}; "
         f"fifo {fifo['equal']['jain']})"),
        (all(abs(w[u] - want[u]) <= SHARE_TOLERANCE * want[u] for u in WEIGHTED),
         f"weights 2:1:1: shares {fair_w} under fair (target 50/25/25 ± 10 %; fifo {fifo_w})"),
        (fair["deadlines"]["missed"] == 0,
         f"deadlines feasible together: {fair['deadlines']['missed']} of {fair['deadlines']['jobs']} missed under "
         f"fair (fifo misses {fifo['deadlines']['missed']})"),
        (ratio >= THROUGHPUT_MIN,
         f"throughput: {fair['equal']['images_per_s']} images/s under fair, {fifo['equal']['images_per_s']} under "
         f"fifo: {ratio:.3f}x (target >= {THROUGHPUT_MIN})"),
    ]


def table(res: dict) -> str:
    rows = []
    for p in POLICIES:
        r = res[p]
        rows.append([p, r["small"]["alone_s"], r["small"]["behind_s"], f"{r['small']['ratio']}x",
                     r["small"]["big_embedded_when_small_done"], r["equal"]["jain"], r["equal"]["images_per_s"],
                     " / ".join(f"{100 * r['weighted']['shares'][u]:.1f}" for u in WEIGHTED),
                     f"{r['deadlines']['missed']} of {r['deadlines']['jobs']}"])
    return markdown_table(["policy", "small alone s", "small behind big s", "ratio", "big's images done then",
                           "Jain (equal)", "images/s (equal)", "shares 2:1:1 %", "deadlines missed"], rows)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharey=True, sharex=True)
    for col, p in enumerate(POLICIES):
        for row, key in enumerate(("equal", "weighted")):
            ax = axes[row][col]
            series = res[p][key]["series"]
            for user in sorted({u for u, _ in series}):
                ts = sorted(t for u, t in series if u == user)
                # images over time: the slope is the owner's images/s (a chunk lands all at once)
                ax.step(ts, range(1, len(ts) + 1), where="post", label=f"{user} (weight {WEIGHTS.get(user, 1.0):g})")
            ax.set_title(f"{p}: {'equal weights' if key == 'equal' else 'weights 2:1:1'}")
            ax.set_xlabel("s since the owners started (busy window from 6 s)")
            ax.set_ylabel("images embedded (slope: images/s)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=16, help="BULK_BATCH_SIZE: images per chunk")
    ap.add_argument("--window", type=int, default=2, help="BULK_SCHEDULER_WINDOW (fair): chunks in flight")
    ap.add_argument("--big", type=int, default=256, help="images of the big jobs (scenarios 1 and 4)")
    ap.add_argument("--busy-s", type=float, default=60.0, help="seconds of continuous submission (scenarios 2, 3)")
    ap.add_argument("--only", choices=("small",), help="scenario 1 alone (a quick look)")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench-fairness"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out, hardware = begin(args.out)
    t0 = time.monotonic()
    res: dict = {"machine": hardware, "config": vars(args)}
    for policy in POLICIES:
        res[policy] = run_policy(policy, args, out)
    if args.only:
        return 0
    res["load_average_end"] = round(os.getloadavg()[0], 2)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    checks = verdicts(res)
    res["verdicts"] = [{"pass": ok, "line": line} for ok, line in checks]
    text = table(res)
    lines = [f"{'PASS' if ok else 'FAIL'}: {line}" for ok, line in checks]
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    (out / "table.md").write_text(text + "\n\n" + "\n".join(lines) + "\n")
    print(text)
    print("\n".join(lines))
    print(f"wall {res['wall_s']} s; load average at the end {res['load_average_end']}")
    plot(res, out / "fairness.png")
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
