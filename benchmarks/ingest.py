"""Ingest (issue 41): a URL manifest and an object-storage prefix read into the running service, the
fetch stage alone, and the metadata-filtered search beside them.

    python -m benchmarks.ingest                   # 100,000 rows and objects (make bench-ingest)
    python -m benchmarks.ingest --quick           # 5,000 of each, 30 s windows: a check in minutes
    python -m benchmarks.ingest --rows 20000 --seconds 30 --database sqlite --only fetch manifest

Five parts (``--only`` picks some):

1. **fetch alone** (``fetch``): ``workers.fetch.Fetcher.fetch_many`` (the service's defaults:
   ``FetchPolicy()`` with 8 requests in flight per host, 16 threads, and only ``allow_networks``
   opened for 127.0.0.1) over ``--rows`` URLs ``/img/<n>.jpg`` of the tests' origin server, run as a
   program in its own process (``python -m tests.origin_server``; nothing of ``tests`` is
   imported): a distinct ~630-byte JPEG per URL over keep-alive connections on 127.0.0.1. Images
   per second with no model and no database.
2. **manifest** (``manifest``): the whole service (``scripts.stack.Stack``: web, the interactive,
   bulk, vectors and fetch workers, a private Redis, embedded Qdrant, ViT-B-32 with seeded random
   weights, fp32) on PostgreSQL when a server answers at 127.0.0.1:5432 (a scratch database, dropped
   afterwards, as ``bench-db`` and ``--postgres`` of the others do), else SQLite (``--database``),
   with ``FETCH_ALLOW_NETWORKS=127.0.0.1/32`` (the origin is on loopback, which the fetcher refuses
   by default) and ``METADATA_INDEXES=category:keyword,price:float``. Warm-up
   (:func:`warm_up`): a few job lists, then :data:`WARM_UP_JOBS` small manifest jobs embedded whole,
   so both web processes have served a manifest upload and the bulk worker's children have loaded
   the model; the first of them gives the cold figure (model loading included). Then a CSV
   manifest of ``--rows`` rows ``url,external_id,category,price`` (:func:`manifest_lines`: distinct
   URLs, a random category of 100, a random price) is written to a temporary file and sent as the
   ``manifest`` part of ``POST /api/jobs/``, streamed from the file by httpx with its
   ``Content-Length`` (:func:`upload_manifest`). Measured:

   - seconds from the upload's last byte to the 202;
   - the web's resident set (gunicorn's master and workers together, every 0.2 s,
     ``benchmarks.load.Sampler``): growth = the highest from the upload's start to the window's
     end − the mean of the 2 s before the upload (:func:`memory_growth`); the fetch worker's too;
   - for ``--seconds`` after the upload's end, once a second from the database
     (:class:`Progress`): rows made (the job's rows), fetched (bytes arrived, ``sha256`` set),
     embedded, skipped, failed; their rates (:func:`rate_summary`), and the seconds to the first
     embedded image (the earliest ``embedded_at`` of the job's rows);
   - the job's ``GET /api/jobs/{id}/`` every 5 s (its latency, ``total``, ``reading``), and its
     stage timings at the end;
   - the cores each of the web, the fetch worker and the bulk worker used;
   - the fewest rows fetched and waiting for the model after the first image
     (:func:`fewest_waiting`): whether fetching ever made the model wait.

   Then the job is cancelled (``POST /api/jobs/{id}/cancel/``). Each job starts on an idle stack
   (:func:`wait_idle`: the warm-up's and the cancelled job's chunks done or dropped). The service
   reads a source at most ``FETCH_READ_AHEAD`` rows (1,024) ahead of the model, so here rows are
   made and fetched at the model's pace once that many wait: part 4 measures how fast they can be.
3. **prefix** (``prefix``): before the stack starts, ``--rows`` distinct small objects are put into
   a bucket of moto's S3 server (``moto_server``, its own process; :func:`seed_bucket`, 32 threads
   through boto3; its time is reported); the stack reads it (``SOURCE_BUCKETS``, ``S3_ENDPOINT_URL``,
   path-style addressing) and ``POST /api/jobs/`` ``{"prefix": "s3://bench-ingest/objects/"}``
   starts the job. The same figures, from the request's end; the listing is the rows made.
4. **capacity** (``capacity``): the fetch worker restarted with ``FETCH_READ_AHEAD=0`` (reading no
   longer waits for the model), and parts 2 and 3 again for another user (so none of the first
   jobs' images is a duplicate): rows made (read, listed) and fetched per second by the fetch stage
   of the service, on the cores it shares with the model. Reported, not judged.
5. **filtered search** (``store``): ``python -m benchmarks.store --filtered`` at ``--rows`` points,
   in its own process, its figures read back: the ``group AND owner`` row (:data:`JUDGED_FILTER`,
   a metadata filter that with the owner's matches 1 % of the points; top-10 p95) is judged,
   ``cat AND owner`` (0.25-0.3 %) reported.

Targets (issue 41), judged for parts 2 and 3: the 202 within :data:`ANSWER_S` of the upload's
(request's) end, web memory growth at most :data:`WEB_GROWTH_MB`, the first image embedded within
:data:`FIRST_EMBEDDED_S` of the upload's (request's) end, and fetching never capping the model (at
least :data:`WAITING_MIN` rows waiting for it); fetch alone at least :data:`FETCH_PER_S` images/s;
filtered search p95 at most :data:`FILTERED_P95_MS`. Everything else is reported. Memory is in MB
(10^6 bytes), as the issue states it.

Prints the machine (CPU model and flags), the table and the verdict; writes ``--out`` (JSON: the
figures and every sample) and a plot beside it (rows made, fetched and embedded over time, one panel
per job). docs/benchmarks-ingest.md has a run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import functools
import io
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import REDIS_PREFIX, machine, machine_line, markdown_table, pyplot, write_json

#: Issue 41's targets.
ANSWER_S = 10.0  # the 202 after the upload's end (s)
WEB_GROWTH_MB = 100.0  # web resident-set growth over the upload and the reading (MB)
FIRST_EMBEDDED_S = 10.0  # first image embedded after the upload's end (s)
FETCH_PER_S = 500.0  # fetch alone (images/s)
FILTERED_P95_MS = 20.0  # top-10 with a metadata filter matching 1 % of 100,000 points, p95 (ms)

#: The bucket and prefix of the prefix job (moto accepts names of 3-63 characters).
BUCKET, PREFIX = "bench-ingest", "objects/"
#: Manifest ``category`` values (a filter on one keeps 1 % of the rows, as the store benchmark's).
CATEGORIES = 100
#: The default PostgreSQL server, as ``benchmarks.db`` and ``--postgres`` of the others.
POSTGRES = "postgres://postgres@127.0.0.1:5432/postgres"
#: Warm-up manifest jobs and their rows. Each upload opens its own connection, and which of the two
#: gunicorn workers (``--workers 2``) accepts it is chance: 8 miss one of them with odds 1 in 128.
#: Each job is one chunk for the bulk worker: 8 chunks keep both of its children (``BULK_PROCESSES``
#: 2) busy, so both load the model.
WARM_UP_JOBS, WARM_UP_ROWS = 8, 16
#: First ``/img/<n>.jpg`` number of the warm-up jobs: far from the measured manifest's 0..rows-1,
#: so no measured row is a duplicate of a warm-up image.
WARM_UP_BASE = 900_000_000
#: Seconds of resident-set samples before the upload that make the baseline.
BASELINE_S = 2.0
#: Rows fetched and waiting for the model that show fetching does not cap the lane: a chunk of 64
#: (``PIPELINE.batch_size``) being embedded by each of the 2 bulk children (``BULK_PROCESSES``) and
#: one more ready for whichever finishes first.
WAITING_MIN = 3 * 64
#: ``benchmarks.store --filtered``'s row judged: ``group`` (1 of 25) AND owner (1 of 4), 1 % of the points.
JUDGED_FILTER = "group_and_owner"
#: Span (s) of the sliding window of :func:`rate_summary`'s peak rate.
PEAK_SPAN_S = 5.0
#: The measured jobs, in order, and their names in the table and the plot.
PHASES = {"manifest": "URL manifest", "prefix": "S3 prefix (moto)",
          "manifest_unbounded": "URL manifest, FETCH_READ_AHEAD=0", "prefix_unbounded": "S3 prefix, FETCH_READ_AHEAD=0"}
#: Seconds a job is followed past its window while no image is embedded yet, so the first image's
#: time is measured even where it misses the target.
FIRST_WAIT_S = 180.0
#: Processes whose resident set and CPU time are sampled during a job (their children included).
SAMPLED = ("web", "worker-fetch", "worker-bulk")
#: kombu's Redis hash of the messages workers hold: every task is ``acks_late``
#: (``CELERY_TASK_ACKS_LATE``), so a running task's message stays there until it ends.
UNACKED_KEY = f"{REDIS_PREFIX}unacked"  # kombu's, under the deployment's global_keyprefix


# --- pure helpers (tests/test_bench_ingest.py) ----------------------------------------------------

def manifest_lines(rows: int, base_url: str, *, seed: int = 0, categories: int = CATEGORIES,
                   first: int = 0) -> Iterator[str]:
    """The CSV manifest, one line at a time (``\\n`` ended): the header ``url,external_id,category,price``,
    then ``rows`` rows ``{base_url}/img/{n}.jpg,ext-{n},c{k},{price}`` for ``n`` from ``first``:
    distinct URLs and ids, ``k`` uniform in ``0..categories-1`` and the price uniform in 0..1000
    with two decimals, both from ``random.Random(seed)``."""
    rng = random.Random(seed)
    yield "url,external_id,category,price\n"
    for n in range(first, first + rows):
        yield f"{base_url}/img/{n}.jpg,ext-{n},c{rng.randrange(categories)},{rng.uniform(0, 1000):.2f}\n"


def write_manifest(path: Path, rows: int, base_url: str, **kwargs) -> int:
    """Write :func:`manifest_lines` to ``path``; returns its size in bytes."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.writelines(manifest_lines(rows, base_url, **kwargs))
    return path.stat().st_size


def to_unix(value) -> float | None:
    """A database timestamp as Unix seconds: an aware ``datetime`` (PostgreSQL), or SQLite's text
    ``YYYY-MM-DD HH:MM:SS[.ffffff]`` (Django stores UTC there without an offset); ``None`` stays."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()


def rate_summary(samples: Sequence[dict], key: str, t0: float) -> dict:
    """How ``key`` (a count) grew in ``samples`` (``{"t": Unix s, key: int}``, in time order) since
    ``t0`` (Unix s).

    Returns:
        ``{"count"``: the last value, ``"first_s"``: seconds from ``t0`` to the first sample above
        0 (``None`` if none), ``"per_s"``: count over the seconds from ``t0`` to the last sample,
        ``"active_per_s"``: the growth while it grew, from the sample before the first one above 0
        to the first one at the last value, over the seconds between them (``None`` if it never
        grew), ``"peak_per_s"``: the largest growth over :data:`PEAK_SPAN_S` s or more between two
        samples (``None`` when the samples span less)``}``; the count 0 and the rest ``None``
        without samples.
    """
    out = {"count": 0, "first_s": None, "per_s": None, "active_per_s": None, "peak_per_s": None}
    if not samples:
        return out
    last = samples[-1]
    out["count"] = last[key]
    if last["t"] > t0:
        out["per_s"] = last[key] / (last["t"] - t0)
    first = next((i for i, s in enumerate(samples) if s[key] > 0), None)
    if first is not None:
        out["first_s"] = samples[first]["t"] - t0
        start = samples[first - 1] if first else {"t": t0, key: 0}
        stop = next(s for s in samples if s[key] == last[key])
        if stop["t"] > start["t"]:
            out["active_per_s"] = (stop[key] - start[key]) / (stop["t"] - start["t"])
    peak, j = None, 0
    for i, s in enumerate(samples):
        while j < i and s["t"] - samples[j + 1]["t"] >= PEAK_SPAN_S:
            j += 1
        if s["t"] - samples[j]["t"] >= PEAK_SPAN_S:
            r = (s[key] - samples[j][key]) / (s["t"] - samples[j]["t"])
            peak = r if peak is None else max(peak, r)
    out["peak_per_s"] = peak
    return out


def fewest_waiting(samples: Sequence[dict], since: float, rows: int) -> int | None:
    """The fewest rows fetched and not yet settled by the model (``fetched − embedded − skipped``)
    in the ``samples`` (:class:`Progress`'s) taken from ``since`` (Unix s) on while the fetcher still
    had rows to fetch (``fetched < rows``): how far the fetch stage stayed ahead of the model.
    ``None`` without such samples (every row fetched before ``since``: it never made the model wait)."""
    ahead = [s["fetched"] - s["embedded"] - s["skipped"] for s in samples if s["t"] >= since and s["fetched"] < rows]
    return min(ahead) if ahead else None


def memory_growth(samples: Sequence[dict], name: str, start: float, end: float,
                  baseline_s: float = BASELINE_S) -> dict:
    """Resident-set growth of process ``name`` over ``[start, end]`` (Unix s), from
    ``benchmarks.load.Sampler`` samples (``{"unix", name: MiB, name + ":anon": MiB}``).

    Returns:
        MB (10^6 bytes): ``{"before_mb"``: mean of the samples in the ``baseline_s`` before ``start``
        (else the last one before it), ``"max_mb"``: highest in the window, ``"growth_mb"``: their
        difference, ``"anon_growth_mb"``: the same of the anonymous part (heap, stacks)``}``.

    Raises:
        ValueError: no sample before ``start`` or none in the window.
    """
    to_mb = 2**20 / 1e6
    before = [s for s in samples if start - baseline_s <= s["unix"] < start] or \
        [s for s in samples if s["unix"] < start][-1:]
    window = [s for s in samples if start <= s["unix"] <= end]
    if not before or not window:
        raise ValueError(f"memory_growth: {len(before)} samples before {start}, {len(window)} in the window")
    out = {}
    for suffix, label in (("", ""), (":anon", "anon_")):
        base = statistics.fmean(s[name + suffix] for s in before) * to_mb
        top = max(s[name + suffix] for s in window) * to_mb
        if not label:
            out["before_mb"], out["max_mb"] = round(base, 1), round(top, 1)
        out[f"{label}growth_mb"] = round(top - base, 1)
    return out


def verdict(result: dict) -> dict[str, bool]:
    """The issue's targets against ``result`` (:func:`main`'s): ``{check: passed}``, one per figure
    measured (a part not run has no check)."""
    checks = {}
    if f := result.get("fetch_alone"):
        checks[f"fetch alone >= {FETCH_PER_S:g} images/s"] = f["per_s"] >= FETCH_PER_S
    for kind in ("manifest", "prefix"):  # as configured; the unbounded rounds are reported
        if not (p := result.get(kind)):
            continue
        checks[f"{kind}: answered within {ANSWER_S:g} s"] = p["status"] == 202 and p["answer_s"] <= ANSWER_S
        checks[f"{kind}: web memory growth <= {WEB_GROWTH_MB:g} MB"] = p["memory"]["web"]["growth_mb"] <= WEB_GROWTH_MB
        first = p["first_embedded_s"]
        checks[f"{kind}: first image embedded within {FIRST_EMBEDDED_S:g} s"] = (
            first is not None and first <= FIRST_EMBEDDED_S)
        waiting = p.get("fewest_waiting")  # None: every row fetched before the first image
        checks[f"{kind}: fetching never caps the model (>= {WAITING_MIN} rows waiting for it after the first image)"] = (
            first is not None and (waiting is None or waiting >= WAITING_MIN))
    if s := result.get("store"):
        checks[f"filtered search ({s['matching_pct']:.1f} % of points) p95 <= {FILTERED_P95_MS:g} ms"] = (
            s["p95_ms"] <= FILTERED_P95_MS)
    return checks


# --- servers --------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    """True when something accepts TCP at ``host:port`` within a second."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


@contextlib.contextmanager
def origin_server() -> Iterator[str]:
    """``python -m tests.origin_server`` in its own process (its own interpreter lock); yields its
    base URL (``http://127.0.0.1:<port>``). Stopped on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.origin_server"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        url = proc.stdout.readline().strip()
        if not url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the origin server printed {url!r}")
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a helper process: SIGTERM, then SIGKILL if it is still there after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[str]:
    """moto's S3 server (``moto_server -H 127.0.0.1 -p PORT``, installed with moto) in its own
    process; yields its endpoint URL once it answers. Raises ``RuntimeError`` if it exits or does
    not answer within 30 s."""
    import httpx

    exe = Path(sys.executable).parent / "moto_server"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(exe if exe.exists() else "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url + "/moto-api/", timeout=1)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer within 30 s; see {log}")
            time.sleep(0.1)
        yield url
    finally:
        _stop(proc)


#: moto's credentials and region (any values: moto checks no signature).
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_S3_REGION_NAME": "us-east-1",
          "AWS_S3_ADDRESSING_STYLE": "path"}


def s3_client(endpoint: str, connections: int = 32):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name=S3_ENV["AWS_S3_REGION_NAME"],
                        config=Config(max_pool_connections=connections, s3={"addressing_style": "path"}))


def small_jpeg() -> bytes:
    """A 16×16 grey baseline JPEG (Pillow), the base of every object."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 130, 140)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def seed_bucket(endpoint: str, objects: int, *, threads: int = 32) -> dict:
    """Create :data:`BUCKET` and put ``objects`` objects ``{PREFIX}{n:07d}.jpg``: a small JPEG with
    ``s3-{n}`` after its end-of-image marker (distinct bytes, still decodes), ``threads`` at a time.

    Returns:
        ``{"objects", "seconds", "per_s"}``.
    """
    client = s3_client(endpoint, threads)
    client.create_bucket(Bucket=BUCKET)
    base = small_jpeg()

    def put(n: int) -> None:
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}{n:07d}.jpg", Body=base + b"s3-%d" % n,
                          ContentType="image/jpeg")

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for f in concurrent.futures.as_completed([pool.submit(put, n) for n in range(objects)]):
            f.result()
    seconds = time.perf_counter() - t0
    return {"objects": objects, "seconds": round(seconds, 1), "per_s": round(objects / seconds, 1)}


# --- part 1: the fetcher alone --------------------------------------------------------------------

def fetch_alone(base_url: str, urls: int, *, threads: int = 16) -> dict:
    """``Fetcher.fetch_many`` over ``urls`` URLs ``{base_url}/img/<n>.jpg`` (service defaults, 127.0.0.1
    allowed).

    Returns:
        ``{"urls", "seconds", "per_s"`` (images fetched whole per second), ``"failed"``,
        ``"reasons"`` (``{reason code: count}`` of the failures), ``"bytes", "threads", "per_host"}``.
    """
    from workers.fetch import Fetched, Fetcher, FetchPolicy

    policy = FetchPolicy(allow_networks=("127.0.0.1/32",))
    with Fetcher(policy) as fetcher:
        fetcher.fetch_many([f"{base_url}/img/{WARM_UP_BASE - 1}.jpg"] * 8, threads=threads)  # connections open
        t0 = time.perf_counter()
        results = fetcher.fetch_many([f"{base_url}/img/{n}.jpg" for n in range(urls)], threads=threads)
        seconds = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, Fetched)]
    reasons: dict[str, int] = {}
    for r in results:
        if not isinstance(r, Fetched):
            code = getattr(getattr(r, "reason", None), "value", type(r).__name__)
            reasons[code] = reasons.get(code, 0) + 1
    return {"urls": urls, "seconds": round(seconds, 2), "per_s": round(len(ok) / seconds, 1),
            "failed": len(results) - len(ok), "reasons": reasons, "bytes": sum(len(r.data) for r in ok),
            "threads": threads, "per_host": policy.per_host}


# --- parts 2 and 3: the service -------------------------------------------------------------------

COUNTS_SQL = ("SELECT count(*), "
              "coalesce(sum(CASE WHEN sha256 <> '' THEN 1 ELSE 0 END), 0), "
              "coalesce(sum(CASE WHEN status = 'embedded' THEN 1 ELSE 0 END), 0), "
              "coalesce(sum(CASE WHEN status = 'skipped' THEN 1 ELSE 0 END), 0), "
              "coalesce(sum(CASE WHEN status = 'failed' THEN 1 ELSE 0 END), 0), "
              "coalesce(sum(CASE WHEN status = 'cancelled' THEN 1 ELSE 0 END), 0) "
              "FROM embeddings_image WHERE job_id = {p}")
COUNT_KEYS = ("made", "fetched", "embedded", "skipped", "failed", "cancelled")
TIMES_SQL = ("SELECT min(embedded_at), min(created_at), max(created_at) FROM embeddings_image "
             "WHERE job_id = {p}")


class Database:
    """Read-only counts of a job's rows, straight from the service's database (the driver imports no
    Django). One connection per thread that asks.

    Args:
        url: ``DATABASE_URL`` (PostgreSQL); empty: the stack's SQLite file ``var_dir/db.sqlite3``.
    """

    def __init__(self, url: str, var_dir: Path) -> None:
        self.url, self.path = url, var_dir / "db.sqlite3"
        self._local = threading.local()

    def _connection(self):
        if getattr(self._local, "conn", None) is None:
            if self.url:
                import psycopg

                self._local.conn = psycopg.connect(self.url, autocommit=True)
            else:
                import sqlite3

                self._local.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        return self._local.conn

    def _one(self, sql: str, job_id: str) -> tuple:
        key = job_id if self.url else uuid.UUID(job_id).hex  # Django stores a UUID as 32 hex digits in SQLite
        return self._connection().execute(sql.format(p="%s" if self.url else "?"), (key,)).fetchone()

    def counts(self, job_id: str) -> dict[str, int]:
        """``{made, fetched (sha256 set), embedded, skipped, failed, cancelled}`` of the job's rows."""
        return dict(zip(COUNT_KEYS, (int(v) for v in self._one(COUNTS_SQL, job_id))))

    def times(self, job_id: str) -> dict[str, float | None]:
        """``{first_embedded, first_made, last_made}`` (Unix s) of the job's rows."""
        return dict(zip(("first_embedded", "first_made", "last_made"), map(to_unix, self._one(TIMES_SQL, job_id))))

    def close(self) -> None:
        if (conn := getattr(self._local, "conn", None)) is not None:
            conn.close()
            self._local.conn = None


class Progress(threading.Thread):
    """:meth:`Database.counts` of one job every ``every`` s; ``samples``: ``{"t": Unix s, **counts}``."""

    def __init__(self, db: Database, job_id: str, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.db, self.job_id, self.every = db, job_id, every
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                t = time.time()
                counts = self.db.counts(self.job_id)
                self.samples.append({"t": round(t, 3), **counts})
                self.stop.wait(max(0.0, self.every - (time.time() - t)))
        finally:
            self.db.close()


class _TimedFile(io.FileIO):
    """The manifest file as httpx's multipart encoder reads it (64 KiB a read, its length from
    ``fstat``): ``eof_at`` is when a read first found the end (Unix s), i.e. when every byte of it
    had been handed to the socket, and ``first_at`` when the first read came."""

    eof_at: float | None = None
    first_at: float | None = None

    def read(self, size: int = -1) -> bytes:
        if self.first_at is None:
            self.first_at = time.time()
        data = super().read(size)
        if not data and self.eof_at is None:
            self.eof_at = time.time()
        return data


class Api:
    """The service's API for one user (token), through one httpx client that keeps no connection
    alive: each request opens its own, as separate clients would, so requests reach both web
    processes (one kept-alive connection is served by one)."""

    def __init__(self, base_url: str, token: str) -> None:
        import httpx

        assert base_url.startswith("http://127.0.0.1:")
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Token {token}"}, timeout=120,
                                 limits=httpx.Limits(max_keepalive_connections=0))

    def upload_manifest(self, path: Path, name: str) -> dict:
        """``POST /api/jobs/`` with ``path`` as the ``manifest`` part, streamed (see
        :func:`upload_manifest`)."""
        return upload_manifest(self.http, path, name)

    def post_prefix(self, uri: str, name: str) -> dict:
        """``POST /api/jobs/`` ``{"prefix": uri}``: ``{"status", "body", "sent", "end", "answered",
        "answer_s"}`` (Unix s; ``end`` = ``sent``: a JSON body of a few bytes)."""
        sent = time.time()
        r = self.http.post("/api/jobs/", json={"prefix": uri, "name": name})
        answered = time.time()
        return {"status": r.status_code, "body": r.json(), "sent": sent, "end": sent, "answered": answered,
                "answer_s": round(answered - sent, 3)}

    def job(self, job_id: str) -> tuple[dict, float]:
        """``GET /api/jobs/{id}/`` and its latency (ms)."""
        t0 = time.perf_counter()
        r = self.http.get(f"/api/jobs/{job_id}/")
        r.raise_for_status()
        return r.json(), (time.perf_counter() - t0) * 1000

    def cancel(self, job_id: str) -> int:
        return self.http.post(f"/api/jobs/{job_id}/cancel/").status_code

    def close(self) -> None:
        self.http.close()


def upload_manifest(http, path: Path, name: str) -> dict:
    """``POST /api/jobs/`` with the file at ``path`` as the ``manifest`` part, streamed by httpx
    from the file (``Content-Length`` from its size: Django reads no chunked request body).

    Returns:
        ``{"status", "body", "bytes", "sent", "end", "answered"}`` (Unix s: request begun, last
        byte of the file handed to the socket, answer received) and ``"answer_s"`` (answered − end),
        ``"upload_s"`` (end − sent).
    """
    size = path.stat().st_size
    with _TimedFile(path, "rb") as f:
        sent = time.time()
        r = http.post("/api/jobs/", files={"manifest": (path.name, f, "text/csv")}, data={"name": name})
        answered = time.time()
        end = f.eof_at or answered
    return {"status": r.status_code, "body": r.json(), "bytes": size, "sent": sent, "end": end, "answered": answered,
            "answer_s": round(answered - end, 3), "upload_s": round(end - sent, 3)}


def wait_idle(redis_url: str, *, timeout: float = 180.0) -> bool:
    """Wait until no message waits in any lane's queue (every kombu priority list) and no worker
    holds one (:data:`UNACKED_KEY`): a cancelled job's chunks dropped, the warm-up's last chunk
    done. True when idle, False after ``timeout`` s."""
    import redis

    from benchmarks.load import QueueSampler
    from project.lanes import ALL_QUEUES

    client = redis.Redis.from_url(redis_url)
    keys = [k for q in ALL_QUEUES for k in QueueSampler.lists(q)]
    try:
        return wait_until(lambda: sum(client.llen(k) for k in keys) + client.hlen(UNACKED_KEY) == 0, timeout=timeout)
    finally:
        client.close()


def wait_until(check: Callable[[], bool], *, timeout: float, every: float = 0.5) -> bool:
    """``check()`` every ``every`` s until it is true (True) or ``timeout`` s pass (False)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def warm_up(api: Api, db: Database, folder: Path, origin: str, *, log) -> dict:
    """Both web processes serve a job list and a manifest upload, and the bulk worker's children
    load the model: :data:`WARM_UP_JOBS` manifests of :data:`WARM_UP_ROWS` rows each, waited for
    until every row is settled (at most 5 min). Returns the first job's ``answer_s`` and the seconds
    from its upload's end to its first embedded image (the cold figure: model loading included)."""
    for _ in range(2 * WARM_UP_JOBS):
        api.http.get("/api/jobs/").raise_for_status()
    jobs, first = [], None
    for i in range(WARM_UP_JOBS):
        path = folder / f"warm-up-{i}.csv"
        write_manifest(path, WARM_UP_ROWS, origin, seed=100 + i, first=WARM_UP_BASE + i * WARM_UP_ROWS)
        answer = api.upload_manifest(path, f"warm-up {i}")
        if answer["status"] != 202:
            raise RuntimeError(f"warm-up manifest refused: {answer}")
        jobs.append(answer["body"]["id"])
        first = first or answer

    def settled() -> bool:
        counts = [db.counts(j) for j in jobs]
        return all(c["made"] == WARM_UP_ROWS and c["embedded"] + c["skipped"] + c["failed"] == WARM_UP_ROWS
                   for c in counts)

    ok = wait_until(settled, timeout=300, every=1.0)
    counts = [db.counts(j) for j in jobs]
    embedded_at = db.times(jobs[0])["first_embedded"]
    out = {"jobs": WARM_UP_JOBS, "rows": WARM_UP_ROWS, "settled": ok, "counts": counts,
           "answer_s": first["answer_s"],
           "first_embedded_cold_s": None if embedded_at is None else round(embedded_at - first["end"], 2)}
    log(f"warm-up: the first job answered in {out['answer_s']} s, its first image embedded after "
        f"{out['first_embedded_cold_s']} s (cold); all settled: {ok}")
    return out


def run_phase(api: Api, db: Database, stack, *, kind: str, post: Callable[[], dict], rows: int, seconds: float,
              every: float, log) -> dict:
    """One measured job (module docstring, parts 2 and 3): wait until the stack is idle, sample the
    web's and the fetch worker's memory, ``post()`` the job, follow it for ``seconds`` after the
    upload's (request's) end (longer, up to :data:`FIRST_WAIT_S` more, while no image is embedded
    yet; shorter when every row is settled), cancel it. Rates are over the first ``seconds``."""
    from benchmarks.load import Sampler, phase_cpu

    idle = wait_idle(stack.env["REDIS_URL"])
    pids = {n: stack.pid(n) for n in SAMPLED}
    sampler = Sampler(pids, every=0.2)
    sampler.start()
    time.sleep(BASELINE_S + 0.5)
    answer = post()
    log(f"{kind}: {answer['status']} {answer['answer_s']} s after the {'upload' if 'manifest' in kind else 'request'}"
        f"'s end: {answer['body']}")
    if answer["status"] != 202:
        sampler.stop.set()
        raise RuntimeError(f"{kind} job refused: {answer}")
    job_id = answer["body"]["id"]
    t0 = answer["end"]
    progress = Progress(db, job_id, every=every)
    progress.start()
    api_polls, job = [], {}
    while True:
        elapsed = time.time() - t0
        last = progress.samples[-1] if progress.samples else None
        if elapsed >= seconds and ((last and last["embedded"]) or elapsed >= seconds + FIRST_WAIT_S):
            break
        time.sleep(min(5.0, max(0.1, seconds - elapsed)) if elapsed < seconds else 1.0)
        if time.time() - t0 > seconds + 1:
            continue  # past the window: only waiting for the first embedded image
        body, ms = api.job(job_id)
        job = body
        api_polls.append({"t": round(time.time(), 3), "ms": round(ms, 1), "total": body.get("total"),
                          "reading": body.get("reading"), "status": body.get("status"),
                          "rows_read": (body.get("source") or {}).get("rows_read")})
        if last and not body.get("reading") and last["made"] >= rows and \
                last["embedded"] + last["skipped"] + last["failed"] + last["cancelled"] >= last["made"]:
            break
    end = time.time()
    progress.stop.set()
    progress.join()
    sampler.stop.set()
    sampler.join()
    times = db.times(job_id)
    final = db.counts(job_id)
    cancelled = api.cancel(job_id)
    window = [s for s in progress.samples if s["t"] <= t0 + seconds + every / 2]
    out = {
        "job_id": job_id, "status": answer["status"], "answer_s": answer["answer_s"],
        "upload_s": answer.get("upload_s"), "bytes": answer.get("bytes"), "idle_before": idle,
        "window_s": round(min(end, window[-1]["t"] if window else end) - t0, 1), "followed_s": round(end - t0, 1),
        "memory": {n: memory_growth(sampler.samples, n, answer["sent"], end) for n in pids},
        "cpu_cores": phase_cpu(sampler.samples, t0, min(end, t0 + seconds), pids),
        "job": {k: job.get(k) for k in ("status", "total", "reading", "counts", "timings_ms", "batches", "pipeline")},
        "first_embedded_s": None if times["first_embedded"] is None else round(times["first_embedded"] - t0, 2),
        "first_made_s": None if times["first_made"] is None else round(times["first_made"] - t0, 2),
        "reading_done_s": (round(times["last_made"] - t0, 1) if final["made"] >= rows and times["last_made"] else None),
        "rates": {k: rate_summary(window, k, t0) for k in ("made", "fetched", "embedded")},
        "fewest_waiting": (None if times["first_embedded"] is None
                           else fewest_waiting(progress.samples, times["first_embedded"], rows)),
        "counts_at_end": final, "api_polls": api_polls, "cancel_status": cancelled,
        "t0": t0, "samples": progress.samples,
        "memory_samples": sampler.samples,
    }
    log(f"{kind}: {summary_line(out)}")
    return out


def summary_line(p: dict) -> str:
    r = p["rates"]
    return (f"answered {p['answer_s']} s after the end; web +{p['memory']['web']['growth_mb']} MB; first embedded "
            f"{p['first_embedded_s']} s; in {p['window_s']} s: made {r['made']['count']} "
            f"({fmt(r['made']['per_s'])}/s), fetched {r['fetched']['count']} ({fmt(r['fetched']['per_s'])}/s), "
            f"embedded {r['embedded']['count']} ({fmt(r['embedded']['per_s'])}/s)")


def chunk_line(job: dict) -> str:
    """``"N; embed / total s"`` from the job's answer (``batches``, ``timings_ms``: per stage ms)."""
    t = job.get("timings_ms") or {}
    embed, total = (t.get(k, {}).get("avg") for k in ("embed", "total"))
    return f"{job.get('batches') or 0}; {fmt(embed and embed / 1000)} / {fmt(total and total / 1000)}"


def fmt(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


@contextlib.contextmanager
def database(choice: str, postgres: str) -> Iterator[tuple[str, str]]:
    """``(DATABASE_URL, name)``: a scratch PostgreSQL database on ``postgres``'s server (``auto``: when
    it answers) or ``("", "SQLite")``."""
    host_port = postgres.rsplit("@", 1)[-1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    if choice == "postgres" or (choice == "auto" and port_open(host, int(port or 5432))):
        from benchmarks.lanes import scratch_database

        with scratch_database(postgres) as url:
            yield url, "PostgreSQL"
    else:
        yield "", "SQLite"


def run_service(args, *, origin: str, moto: str | None, manifest: Path | None, folder: Path, log) -> dict:
    """Parts 2, 3 and 5 on one stack: warm-up, the manifest job and the prefix job as configured,
    then (``capacity``) the fetch worker restarted with ``FETCH_READ_AHEAD=0`` and both again for
    another user (none of the first user's images is a duplicate of theirs)."""
    import signal

    from scripts.stack import Stack

    env = {"CLIP_PRETRAINED": "random", "CLIP_PRECISION": "fp32", "DJANGO_DEBUG": "0",
           "FETCH_ALLOW_NETWORKS": "127.0.0.1/32", "METADATA_INDEXES": "category:keyword,price:float"}
    if moto:
        env.update({"SOURCE_BUCKETS": BUCKET, "S3_ENDPOINT_URL": moto, **S3_ENV})
    out: dict = {}
    var = folder / "stack"
    with database(args.database, args.postgres) as (db_url, db_name):
        out["database"] = db_name
        log(f"starting the stack ({db_name}) in {var} ...")
        with Stack(var, {**env, "DATABASE_URL": db_url}, private_redis=True, log=lambda *a: None) as stack:
            db = Database(db_url, var)
            rounds = [("", "ingest")] + ([("_unbounded", "ingest-unbounded")] if "capacity" in args.only else [])
            try:
                for suffix, user in rounds:
                    if suffix:
                        wait_idle(stack.env["REDIS_URL"])
                        stack.process_env["worker-fetch"] = {"FETCH_READ_AHEAD": "0"}
                        stack.restart("worker-fetch", sig=signal.SIGTERM)
                        log("fetch worker restarted with FETCH_READ_AHEAD=0 (reading not bounded by the model)")
                    api = Api(stack.web_url, stack.manage("apiuser", user).strip())
                    try:
                        if not suffix:
                            out["warm_up"] = warm_up(api, db, folder, origin, log=log)
                        phase = functools.partial(run_phase, api, db, stack, rows=args.rows, seconds=args.seconds,
                                                  every=args.every, log=log)
                        if manifest is not None:
                            out["manifest" + suffix] = phase(kind="manifest" + suffix, post=functools.partial(
                                api.upload_manifest, manifest, "bench manifest" + suffix))
                        if moto:
                            out["prefix" + suffix] = phase(kind="prefix" + suffix, post=functools.partial(
                                api.post_prefix, f"s3://{BUCKET}/{PREFIX}", "bench prefix" + suffix))
                    finally:
                        api.close()
            finally:
                db.close()
    return out


# --- part 4: the filtered search (benchmarks.store) ----------------------------------------------

def filtered_search(points: int, queries: int, folder: Path, *, log) -> dict:
    """``python -m benchmarks.store --filtered`` at ``points`` points, in its own process.

    Returns:
        ``{"points", "queries", "seconds", "rows": {row: {"p50_ms", "p95_ms", "max_ms", "recall10",
        "matching_pct"}}}`` for its ``group_and_owner`` row (the filter of the issue: together 1 % of
        the points) and its ``cat_and_owner`` row (a value held by 1 % of the points, AND one owner
        of four: 0.25-0.3 %), with the judged row's ``p95_ms`` and ``matching_pct`` on top.

    Raises:
        RuntimeError: the store benchmark failed (its output's tail in the message).
    """
    out_dir = folder / "store"
    cmd = [sys.executable, "-m", "benchmarks.store", "--filtered", "--sizes", str(points), "--queries", str(queries),
           "--out", str(out_dir)]
    log("filtered search: python " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    run = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"benchmarks.store --filtered failed ({run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    result = json.loads((out_dir / "filtered.json").read_text())["result"]
    rows = {name: {k: result[name][k] for k in ("p50_ms", "p95_ms", "max_ms", "recall10", "matching_pct")}
            for name in (JUDGED_FILTER, "cat_and_owner")}
    return {"points": result["n"], "queries": result["queries"], "seconds": round(time.perf_counter() - t0, 1),
            "p95_ms": rows[JUDGED_FILTER]["p95_ms"], "matching_pct": rows[JUDGED_FILTER]["matching_pct"],
            "rows": rows, "upsert_s": result.get("upsert_s"), "optimize_s": result.get("optimize_s")}


# --- report ---------------------------------------------------------------------------------------

def table(result: dict) -> str:
    """The figures as markdown: one table for the two sources, then the fetcher alone, the seeding
    and the filtered search."""
    kinds = [k for k in PHASES if result.get(k)]
    lines = []
    if kinds:
        def row(label: str, get, target: str = "") -> list:
            return [label, *[get(result[k]) for k in kinds], target]

        def rate(key: str, field: str = "per_s"):
            return lambda p: fmt(p["rates"][key][field])

        rows = [
            row("rows", lambda p: f"{result['rows']:,}"),
            row("answered (202) after the upload's / request's end (s)", lambda p: f"{p['answer_s']:.3f}",
                f"<= {ANSWER_S:g}"),
            row("upload (s; manifest MB)", lambda p: (f"{p['upload_s']:.2f} ({p['bytes'] / 1e6:.1f} MB)"
                                                     if p.get("upload_s") is not None else "–")),
            row("web RSS before → highest (MB)", lambda p: f"{p['memory']['web']['before_mb']:.0f} → "
                                                          f"{p['memory']['web']['max_mb']:.0f}"),
            row("web RSS growth (MB; anonymous)", lambda p: f"{p['memory']['web']['growth_mb']:+.1f} "
                                                           f"({p['memory']['web']['anon_growth_mb']:+.1f})",
                f"<= {WEB_GROWTH_MB:g}"),
            row("fetch worker RSS growth (MB; anonymous)",
                lambda p: f"{p['memory']['worker-fetch']['growth_mb']:+.1f} "
                          f"({p['memory']['worker-fetch']['anon_growth_mb']:+.1f})"),
            row("cores used in the window: fetch worker / bulk worker / web",
                lambda p: " / ".join(fmt(p.get("cpu_cores", {}).get(n), 2) for n in SAMPLED[1:] + SAMPLED[:1])),
            row("first row made (s)", lambda p: fmt(p["first_made_s"], 2)),
            row("first row fetched (s, ±1 sample)", lambda p: fmt(p["rates"]["fetched"]["first_s"], 1)),
            row("first image embedded (s)", lambda p: fmt(p["first_embedded_s"], 2), f"<= {FIRST_EMBEDDED_S:g}"),
            row("window (s): the rates below are over it", lambda p: f"{p['window_s']:.0f}"),
            row("rows made in it", lambda p: f"{p['rates']['made']['count']:,}"),
            row("rows made per s (while reading; peak over 5 s)",
                lambda p: f"{rate('made', 'active_per_s')(p)} ({rate('made', 'peak_per_s')(p)})"),
            row("whole source read after (s)", lambda p: fmt(p["reading_done_s"])),
            row("rows fetched in it", lambda p: f"{p['rates']['fetched']['count']:,}"),
            row("rows fetched per s (while fetching; peak over 5 s)",
                lambda p: f"{rate('fetched', 'active_per_s')(p)} ({rate('fetched', 'peak_per_s')(p)})"),
            row("images embedded in it", lambda p: f"{p['rates']['embedded']['count']:,}"),
            row("images embedded per s (over the window)", rate("embedded")),
            row("fewest rows fetched and waiting for the model after the first image",
                lambda p: ("every row fetched before it" if p["first_embedded_s"] is not None
                           and p.get("fewest_waiting") is None else fmt(p.get("fewest_waiting"), 0)),
                f">= {WAITING_MIN}"),
            row("bulk chunks done; their embed stage / whole chunk, mean (s)", lambda p: chunk_line(p["job"])),
            row("GET /api/jobs/{id}/ while reading, median / max (ms)",
                lambda p: (f"{statistics.median(a['ms'] for a in p['api_polls']):.0f} / "
                           f"{max(a['ms'] for a in p['api_polls']):.0f}") if p["api_polls"] else "–"),
        ]
        lines.append(markdown_table(["figure", *[PHASES[k] for k in kinds], "target"], rows))
    if w := result.get("warm_up"):
        lines.append(f"\nwarm-up: {w['jobs']} manifests of {w['rows']} rows; the first answered in {w['answer_s']} s "
                     f"and its first image was embedded {w['first_embedded_cold_s']} s after its upload "
                     f"(cold: the bulk worker's children loading the model)")
    if f := result.get("fetch_alone"):
        lines.append(f"\nfetch alone (workers.fetch.Fetcher.fetch_many, {f['threads']} threads, {f['per_host']} per "
                     f"host, no model, no database): {f['urls']:,} URLs in {f['seconds']} s = **{f['per_s']:,.0f} "
                     f"images/s** fetched whole, {f['failed']} failed{' ' + str(f['reasons']) if f.get('reasons') else ''} "
                     f"(target >= {FETCH_PER_S:g})")
    if s := result.get("seeding"):
        lines.append(f"\nseeding the bucket: {s['objects']:,} objects in {s['seconds']} s ({s['per_s']:,.0f}/s, "
                     f"32 threads through boto3 to moto_server)")
    if s := result.get("store"):
        names = {"group_and_owner": "group AND owner", "cat_and_owner": "cat AND owner"}
        lines.append(f"\nfiltered search (benchmarks.store --filtered: edge, {s['points']:,} points, optimised, "
                     f"{s['queries']} top-10 queries per filter; target p95 <= {FILTERED_P95_MS:g} ms at 1 %):\n")
        lines.append(markdown_table(["filter", "points matching %", "p50 ms", "p95 ms", "max ms", "recall@10"],
                                    [[names[k], r["matching_pct"], r["p50_ms"], r["p95_ms"], r["max_ms"], r["recall10"]]
                                     for k, r in s["rows"].items()]))
    return "\n".join(lines)


def plot(result: dict, path: Path, title: str) -> None:
    """Rows made, fetched and embedded against seconds since the upload's (request's) end, one panel
    per source, symlog y (thousands made beside tens embedded)."""
    kinds = [k for k in PHASES if result.get(k)]
    if not kinds:
        return
    plt = pyplot()
    cols = min(2, len(kinds))
    rows = (len(kinds) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(kinds):]:
        ax.set_visible(False)
    for ax, kind in zip(axes.flat, kinds):
        p = result[kind]
        t = [s["t"] - p["t0"] for s in p["samples"]]
        for key, style in (("made", "-"), ("fetched", "--"), ("embedded", ":")):
            ax.plot(t, [s[key] for s in p["samples"]], style, label=key)
        if p["first_embedded_s"] is not None:
            ax.axvline(p["first_embedded_s"], color="grey", lw=0.8)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("s since the upload's end" if kind.startswith("manifest") else "s since the request")
        ax.set_ylabel("rows of the job")
        ax.set_title(PHASES[kind], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None, help="manifest rows, bucket objects, URLs fetched alone and "
                                                            "filtered-search points (default 100,000; --quick 5,000)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds each job is followed after the upload's "
                                                                 "end (default 60; --quick 30)")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between database samples")
    ap.add_argument("--quick", action="store_true", help="5,000 rows, 30 s windows, 50 filtered queries")
    ap.add_argument("--only", nargs="+", choices=["fetch", "manifest", "prefix", "capacity", "store"],
                    default=["fetch", "manifest", "prefix", "capacity", "store"],
                    help="capacity: the manifest and prefix jobs again with FETCH_READ_AHEAD=0")
    ap.add_argument("--database", choices=["auto", "postgres", "sqlite"], default="auto",
                    help="auto: PostgreSQL when --postgres answers, else SQLite")
    ap.add_argument("--postgres", default=POSTGRES, help="PostgreSQL server (a scratch database is made on it)")
    ap.add_argument("--queries", type=int, default=None, help="filtered-search queries (default 200; --quick 50)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON of the run; the plot beside it (default docs/bench/ingest.json, --quick: ingest-quick.json)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (stack logs, manifest)")
    args = ap.parse_args(argv)
    args.rows = args.rows or (5_000 if args.quick else 100_000)
    args.seconds = args.seconds or (30.0 if args.quick else 60.0)
    args.queries = args.queries or (50 if args.quick else 200)
    out = args.out or ROOT / "docs" / "bench" / ("ingest-quick.json" if args.quick else "ingest.json")
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.1f} s] {msg}", flush=True)

    info = machine()
    print(machine_line(info) + f"; load average {info.get('load_average_1m')}", flush=True)
    result: dict = {"rows": args.rows, "seconds": args.seconds, "only": args.only,
                    "command": "python -m benchmarks.ingest " + " ".join(argv if argv is not None else sys.argv[1:])}
    folder = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    try:
        with contextlib.ExitStack() as servers:
            origin = servers.enter_context(origin_server())
            moto = None
            if "prefix" in args.only:
                moto = servers.enter_context(moto_server(folder / "moto.log"))
                log(f"seeding {args.rows:,} objects into s3://{BUCKET}/{PREFIX} on moto ...")
                result["seeding"] = seed_bucket(moto, args.rows)
                log(f"seeded: {result['seeding']}")
            if "fetch" in args.only:
                log(f"fetch alone: {args.rows:,} URLs ...")
                result["fetch_alone"] = fetch_alone(origin, args.rows)
                log(f"fetch alone: {result['fetch_alone']}")
            manifest = None
            if "manifest" in args.only:
                manifest = folder / "manifest.csv"
                size = write_manifest(manifest, args.rows, origin)
                log(f"manifest: {args.rows:,} rows, {size / 1e6:.1f} MB")
            if manifest is not None or moto:
                result.update(run_service(args, origin=origin, moto=moto, manifest=manifest, folder=folder, log=log))
        if "store" in args.only:
            result["store"] = filtered_search(args.rows, args.queries, folder, log=log)
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    info["load_average_1m_end"] = machine().get("load_average_1m")
    result["machine"] = info
    result["wall_s"] = round(time.time() - started, 1)
    checks = verdict(result)
    result["checks"] = checks
    header = (f"{machine_line(info)} (this run: fp32); {result.get('database', 'no database')}; load average "
              f"{info.get('load_average_1m')} → {info['load_average_1m_end']}")
    png = out.with_suffix(".png")
    plot(result, png, header)
    write_json(out, result)
    print("\n" + header + "\n\n" + table(result) + "\n")
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'}  {k}")
    print(f"\n(figures and samples in {out}; plot {png}; {result['wall_s']:.0f} s in all)")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
