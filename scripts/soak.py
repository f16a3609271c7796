"""Soak: many images through both lanes while faults are injected at random times, then check that
nothing was lost or duplicated.

    python -m scripts.soak --images 5000 --faults 6        (``make soak``)

Starts the whole service with a private Redis (never the shared one) and seeded random ViT-B-32
weights, then:

- bulk: most images as zip jobs (``POST /api/jobs/``), from two owners, some bytes shared between
  them (one Qdrant point, two rows) and some repeated (skipped), plus a few non-images that must
  fail with a reason;
- interactive: the rest uploaded 1-4 at a time by client threads (``POST /api/images/``) that
  behave like real clients: 429 → wait ``Retry-After``; 202 → poll the status URL; ``expired`` or
  a 5xx → send again;
- faults, at random times while work remains: SIGKILL of the bulk worker's pool child mid-chunk,
  SIGKILL of the whole bulk worker, SIGKILL of the interactive worker, a restart of the private
  Redis (everything queued is lost), the vectors worker (the only way to the embedded Qdrant)
  stopped for a while.

At the end: every job done, every image terminal, every failed/expired/cancelled image has a
reason, and ``embedded rows (distinct bytes) = Qdrant points = distinct good input images``.
Exit status 0 when all hold; the report (JSON) is printed and written to ``--report``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import cv2
import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.stack import Stack

FAULTS = ("kill-bulk-child", "kill-bulk-worker", "kill-interactive-worker", "restart-redis", "store-down")
TERMINAL = {"embedded", "skipped", "failed", "expired", "cancelled"}


def make_jpeg(seed: int, size: int = 96) -> bytes:
    """A distinct small JPEG for ``seed`` (smooth random colours; different seeds, different bytes)."""
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8), (size, size), interpolation=cv2.INTER_CUBIC)
    cv2.putText(img, str(seed), (4, size // 2), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (255, 255, 255), 1)
    return cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()


def zip_of(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in files:
            z.writestr(name, data)
    return buf.getvalue()


def soak_env(**extra: str) -> dict:
    """Environment of a soak or fault-test stack: short reconciler grace, small chunks, short deadline."""
    env = {
        "CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "DATABASE_URL": os.environ.get("SOAK_DATABASE_URL", ""),
        "INTERACTIVE_DEADLINE_S": "5", "BULK_BATCH_SIZE": "32",
        "RECONCILE_INTERVAL_S": "2", "RECONCILE_GRACE_S": "6",
    }
    env.update(extra)
    return env


class Client:
    """The API as one user (token), with the retries a real client makes."""

    def __init__(self, base: str, token: str) -> None:
        self.base = base
        self.s = requests.Session()
        self.s.headers["Authorization"] = f"Token {token}"
        self.on_429 = lambda: None  # counts documented refusals (admission control)

    def get(self, path: str, **kw) -> requests.Response:
        return self.s.get(self.base + path, timeout=120, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return self.s.post(self.base + path, timeout=120, **kw)

    def call(self, method: str, path: str, *, patience_s: float = 600, **kw) -> requests.Response:
        """``method path``, sent again after a connection error, a 429 (after ``Retry-After``) or a
        5xx, for at most ``patience_s`` seconds."""
        last = None
        end = time.monotonic() + patience_s
        while time.monotonic() < end:
            try:
                r = getattr(self, method)(path, **kw)
            except requests.RequestException as e:
                last = e
                time.sleep(1)
                continue
            if r.status_code == 429:
                last = r
                self.on_429()
                time.sleep(min(10.0, float(r.headers.get("Retry-After", "1"))))
                continue
            if r.status_code >= 500:
                last = r
                time.sleep(1)
                continue
            return r
        raise RuntimeError(f"{method} {path} kept failing: {last!r}")


class Soak:
    """One soak run; :meth:`run` returns the report dict (``report["ok"]``)."""

    def __init__(self, stack: Stack, *, images: int, interactive_share: float, faults: int, seed: int,
                 fault_kinds: tuple[str, ...] = FAULTS, min_gap_s: float = 4, max_gap_s: float = 30,
                 jobs: int = 4, log=print) -> None:
        self.stack = stack
        self.n = images
        self.interactive_n = int(images * interactive_share)
        self.faults_n = faults
        self.fault_kinds = fault_kinds
        self.gaps = (min_gap_s, max_gap_s)
        self.jobs_n = max(1, jobs)
        self.rng = random.Random(seed)
        self.seed = seed
        self.log = log
        self.events: list[dict] = []
        self.done = threading.Event()
        self.errors: list[str] = []
        self.interactive_stats = {"requests": 0, "200": 0, "202": 0, "429": 0, "5xx": 0, "resent": 0}
        self._lock = threading.Lock()

    # --- inputs ---------------------------------------------------------------------------------
    def inputs(self):
        """``(bulk by owner, interactive, bad, good shas)``: distinct images split between lanes."""
        import hashlib

        base = self.seed * 1_000_000
        images = [(f"img{i:05d}.jpg", make_jpeg(base + i)) for i in range(self.n)]
        good = {hashlib.sha256(d).hexdigest() for _, d in images}
        interactive = images[: self.interactive_n]
        bulk = images[self.interactive_n:]
        # Owner 2 gets every 10th bulk image too (shared points) and owner 1 some repeats (skipped).
        shared = bulk[::10]
        repeats = [(f"again-{name}", data) for name, data in bulk[5::25]]
        bad = [(f"bad{i}.jpg", b"definitely not an image %d" % i) for i in range(max(1, self.n // 500))]
        owner1 = bulk + repeats + bad
        self.rng.shuffle(owner1)
        return {"owner1": owner1, "owner2": list(shared)}, interactive, bad, good

    # --- lanes ----------------------------------------------------------------------------------
    def submit_jobs(self, clients: dict, bulk: dict) -> list[tuple[str, str]]:
        jobs = []
        for owner, files in bulk.items():
            parts = self.jobs_n if owner == "owner1" else 1
            size = -(-len(files) // parts)
            for k in range(0, len(files), size):
                z = zip_of(files[k:k + size])
                r = clients[owner].call("post", "/api/jobs/", files={"zip": (f"part{k}.zip", z)},
                                        data={"name": f"soak {owner} {k}"})
                if r.status_code != 202:
                    raise RuntimeError(f"job refused: {r.status_code} {r.text[:300]}")
                jobs.append((owner, r.json()["id"]))
                self.log(f"job {r.json()['id']} ({owner}): {r.json()['total']} files")
        return jobs

    def interactive_client(self, client: Client, files: list[tuple[str, bytes]]) -> None:
        """Upload ``files`` 1-4 at a time until each is embedded (or skipped as a duplicate)."""
        client.on_429 = lambda: self._count("429")
        pending = list(files)
        rng = random.Random(self.rng.random())
        while pending:
            batch = pending[: rng.randint(1, 4)]
            pending = pending[len(batch):]
            try:
                r = client.call("post", "/api/images/", files=[("files", f) for f in batch], data={"k": 3})
            except RuntimeError as e:
                self.errors.append(f"interactive upload gave up: {e}")
                continue
            with self._lock:
                self.interactive_stats["requests"] += 1
                key = str(r.status_code) if r.status_code in (200, 202, 429) else "5xx" if r.status_code >= 500 else str(r.status_code)
                self.interactive_stats[key] = self.interactive_stats.get(key, 0) + 1
            if r.status_code not in (200, 202):
                self.errors.append(f"interactive upload answered {r.status_code}: {r.text[:200]}")
                continue
            views = r.json()["images"]
            again = []
            for f, v in zip(batch, views):
                status = self.wait_terminal(client, v) if v["status"] not in TERMINAL else v["status"]
                if status not in ("embedded", "skipped"):
                    again.append(f)
            if again:
                with self._lock:
                    self.interactive_stats["resent"] += len(again)
                pending.extend(again)

    def wait_terminal(self, client: Client, view: dict, timeout: float = 600) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                r = client.get(view["url"])
                if r.status_code == 200 and r.json()["status"] in TERMINAL:
                    return r.json()["status"]
            except requests.RequestException:
                pass
            time.sleep(0.5)
        return "timeout"

    def _count(self, key: str) -> None:
        with self._lock:
            self.interactive_stats[key] = self.interactive_stats.get(key, 0) + 1

    # --- faults ---------------------------------------------------------------------------------
    def inject(self, kind: str) -> dict:
        st = self.stack
        t0 = time.monotonic()
        info: dict = {"fault": kind, "at_s": round(t0 - self.t_start, 1)}
        if kind == "kill-bulk-child":
            try:
                info["pid"] = st.kill("worker-bulk", child=True)
            except LookupError:
                info["skipped"] = "no child"
        elif kind == "kill-bulk-worker":
            st.stop_process("worker-bulk", sig=signal.SIGKILL)  # parent and child, no warm shutdown
            st.restart("worker-bulk")
        elif kind == "kill-interactive-worker":
            st.stop_process("worker-interactive", sig=signal.SIGKILL)
            st.restart("worker-interactive")
        elif kind == "restart-redis":
            st.restart_redis()
        elif kind == "store-down":
            st.stop_process("worker-vectors", sig=signal.SIGTERM)
            time.sleep(self.rng.uniform(3, 12))
            st.restart("worker-vectors")
        info["took_s"] = round(time.monotonic() - t0, 1)
        self.log(f"fault: {info}")
        return info

    def fault_loop(self) -> None:
        kinds = list(self.fault_kinds)
        self.rng.shuffle(kinds)
        for i in range(self.faults_n):
            if self.done.wait(self.rng.uniform(*self.gaps)):
                return
            try:
                self.events.append(self.inject(kinds[i % len(kinds)]))
            except Exception as e:
                self.errors.append(f"fault {kinds[i % len(kinds)]} failed: {e!r}")

    # --- checks ---------------------------------------------------------------------------------
    def db_summary(self) -> dict:
        code = (
            "import json; from django.db.models import Count; from embeddings.models import Image, Job\n"
            "q=Image.objects\n"
            "print(json.dumps({'status': {r['status']: r['n'] for r in q.values('status').annotate(n=Count('id'))},"
            "'no_reason': q.filter(status__in=['failed','expired','cancelled'], reason='').count(),"
            "'reasons': {r['status'] + ':' + r['reason']: r['n'] for r in q.filter(status__in=['failed','expired',"
            "'cancelled']).values('status', 'reason').annotate(n=Count('id'))},"
            "'embedded_shas': sorted(set(q.filter(status='embedded').values_list('sha256', flat=True))),"
            "'jobs': {r['status']: r['n'] for r in Job.objects.values('status').annotate(n=Count('id'))},"
            "'max_attempts': max(q.values_list('attempts', flat=True) or [0])}))"
        )
        return json.loads(self.stack.manage("shell", "-c", code).strip().splitlines()[-1])

    def run(self, *, timeout_s: float = 3600) -> dict:
        st = self.stack
        self.t_start = time.monotonic()
        clients = {
            "owner1": Client(st.web_url, st.manage("apiuser", "soak", "--staff").strip()),
            "owner2": Client(st.web_url, st.manage("apiuser", "soak2").strip()),
        }
        bulk, interactive, bad, good = self.inputs()
        faults = threading.Thread(target=self.fault_loop, name="faults", daemon=True)
        faults.start()
        jobs = self.submit_jobs(clients, bulk)
        n_threads = 2
        threads = [threading.Thread(target=self.interactive_client, args=(clients["owner1"], interactive[k::n_threads]),
                                    daemon=True) for k in range(n_threads)]
        for t in threads:
            t.start()
        end = self.t_start + timeout_s
        pending = set(j for _, j in jobs)
        last_log = 0.0
        while pending and time.monotonic() < end:
            for owner, job_id in jobs:
                if job_id in pending:
                    try:
                        r = clients[owner].get(f"/api/jobs/{job_id}/")
                        if r.status_code == 200 and r.json()["status"] in ("done", "cancelled"):
                            pending.discard(job_id)
                    except requests.RequestException:
                        pass
            if time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                self.log(f"{time.monotonic() - self.t_start:.0f} s: {len(pending)} jobs pending, "
                         f"interactive {self.interactive_stats}")
            time.sleep(1)
        for t in threads:
            t.join(timeout=max(1, end - time.monotonic()))
        self.done.set()
        faults.join(timeout=120)
        wall = time.monotonic() - self.t_start
        stats = clients["owner1"].call("get", "/api/stats/").json()
        db = self.db_summary()
        embedded = set(db.pop("embedded_shas"))
        report = {
            "images": self.n, "interactive": len(interactive), "bulk_files": sum(len(v) for v in bulk.values()),
            "bad_files": len(bad), "distinct_good_inputs": len(good), "wall_s": round(wall, 1),
            "faults": self.events, "interactive_requests": self.interactive_stats,
            "jobs_pending": sorted(pending), "db": db, "points": stats.get("points"),
            "distinct_embedded": stats.get("distinct_embedded"), "errors": self.errors,
        }
        checks = {
            "all jobs done": not pending,
            "no image left queued": db["status"].get("queued", 0) == 0,
            "every failure has a reason": db["no_reason"] == 0,
            "points = distinct embedded = distinct good inputs":
                stats.get("points") == stats.get("distinct_embedded") == len(good) == len(embedded & good),
            "only the bad files failed (others at most expired, then sent again)":
                {k: v for k, v in db["reasons"].items() if not k.startswith("expired:")} == {"failed:not_an_image": len(bad)},
            "no client errors": not self.errors,
        }
        report["checks"] = checks
        report["ok"] = all(checks.values())
        return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--interactive-share", type=float, default=0.1)
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--min-gap", type=float, default=10, help="seconds between faults, at least")
    ap.add_argument("--max-gap", type=float, default=60, help="seconds between faults, at most")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--var-dir", default=None, help="state folder (default: a fresh temporary one)")
    ap.add_argument("--report", default=str(ROOT / "var" / "soak-report.json"))
    ap.add_argument("--timeout", type=float, default=4 * 3600)
    args = ap.parse_args()
    var = Path(args.var_dir) if args.var_dir else Path(tempfile.mkdtemp(prefix="soak-"))
    print(f"soak: {args.images} images, {args.faults} faults, state in {var}")
    with Stack(var, soak_env(), private_redis=True, log=print) as stack:
        stack.supervise()
        report = Soak(stack, images=args.images, interactive_share=args.interactive_share, faults=args.faults,
                      seed=args.seed, min_gap_s=args.min_gap, max_gap_s=args.max_gap).run(timeout_s=args.timeout)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "errors"}, indent=2))
    for e in report["errors"][:20]:
        print("error:", e)
    print("SOAK", "OK" if report["ok"] else "FAILED", f"(report in {args.report})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
