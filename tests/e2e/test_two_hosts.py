"""Issue 11 item 2: two hosts on this machine that share only Redis, PostgreSQL, object storage and
the vector store's owner.

- host A: the web process and the ``vectors`` worker (the embedded store's single owner, and the
  reconciler), with its own ``VAR_DIR``; it starts the private Redis.
- host B: the embedding workers (``interactive``, ``bulk``) with another ``VAR_DIR``; they reach the
  image bytes only through the S3 bucket (moto's standalone server over HTTP, started here), never
  through A's files: no blob is written under either ``VAR_DIR``.
- PostgreSQL: a scratch database on 127.0.0.1:5432 (SQLite is a file of one host); skipped with the
  reason when no PostgreSQL answers.

Interactive uploads and a bulk job complete; B's workers are SIGKILLed mid-job (their chunk stays
unacknowledged), a second B with a fresh ``VAR_DIR`` starts, and the job completes with one point
per distinct image (``GET /api/stats/``), the duplicate skipped, the bucket holding each distinct
image once.
"""
from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest

from scripts.soak import make_jpeg, soak_env, zip_of
from scripts.stack import Stack
from tests.e2e.conftest import Api
from tests.e2e.test_faults import assert_counts_match, wait_job
from tests.embeddings.test_storage_s3 import keys, moto  # noqa: F401 - moto is the fixture, shared

pytestmark = pytest.mark.e2e

PG = "postgresql://postgres@127.0.0.1:5432"
CHUNK = 8


@pytest.fixture(scope="module")
def pg_url():
    psycopg = pytest.importorskip("psycopg")
    try:
        with psycopg.connect(f"{PG}/postgres", autocommit=True, connect_timeout=3) as conn:
            name = f"clip_two_hosts_{uuid.uuid4().hex[:8]}"
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:
        pytest.skip(f"two hosts need a shared PostgreSQL at {PG} (SQLite is one host's file): {e}")
    yield f"{PG}/{name}"
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def blob_files(var_dir: Path) -> list[Path]:
    """Files under a host's blob folder (there must be none: the bytes are in the bucket)."""
    folder = var_dir / "blobs"
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_web_host_and_worker_hosts_share_only_redis_postgres_s3_and_the_store(tmp_path, pg_url, moto):
    env = soak_env(DATABASE_URL=pg_url, BULK_BATCH_SIZE=str(CHUNK), BULK_PROCESSES="1", ADMISSION_CONTROL="0",
                   INTERACTIVE_DEADLINE_S="60", INTERACTIVE_MAX_BATCH_SIZE="2", **moto.env(prefix="two-hosts"))
    quiet = dict(log=lambda *a: None)
    host_a = Stack(tmp_path / "host-a", env, private_redis=True, only=("web", "worker-vectors"), **quiet)
    hosts_b: list[Stack] = []
    t0, phases = time.monotonic(), {}
    try:
        # A migrates the shared database, then its web and vectors worker start while B1 starts.
        host_a.start(wait=False)
        shared = {**env, "REDIS_URL": host_a.env["REDIS_URL"]}  # B finds A's Redis answering and uses it

        def start_b(name: str) -> Stack:
            b = Stack(tmp_path / name, shared, only=("worker-interactive", "worker-bulk"), **quiet)
            hosts_b.append(b)
            return b.start()

        b1 = start_b("host-b1")
        phases["host B1 up"] = time.monotonic() - t0
        host_a.wait_ready(180)
        phases["host A up"] = time.monotonic() - t0
        api = Api(host_a.web_url, host_a.manage("apiuser", "two-hosts", "--staff").strip())

        r = api.post("/api/images/", files=[("files", ("i1.jpg", make_jpeg(1), "image/jpeg")),
                                             ("files", ("i2.jpg", make_jpeg(2), "image/jpeg"))])
        assert r.status_code == 200, r.text
        assert [im["status"] for im in r.json()["images"]] == ["embedded", "embedded"]
        phases["interactive on B1"] = time.monotonic() - t0

        files = [(f"j{i}.jpg", make_jpeg(100 + i)) for i in range(3 * CHUNK)] + [("again.jpg", make_jpeg(100))]
        r = api.post("/api/jobs/", files={"zip": ("job.zip", zip_of(files))})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        end = time.monotonic() + 120
        while (j := api.get(f"/api/jobs/{job_id}/").json())["embedded"] < CHUNK:
            assert time.monotonic() < end, f"no chunk embedded on host B in 120 s: {j['counts']}"
            time.sleep(0.1)
        for name in ("worker-bulk", "worker-interactive"):  # host B dies: its delivery stays unacknowledged
            b1.stop_process(name, sig=signal.SIGKILL)
        at_kill = api.get(f"/api/jobs/{job_id}/").json()
        assert at_kill["status"] == "running" and at_kill["embedded"] < 3 * CHUNK, at_kill["counts"]
        b1.stop()
        phases["B1 killed"] = time.monotonic() - t0

        b2 = start_b("host-b2")  # another worker host, nothing of B1's but the shared services
        phases["host B2 up"] = time.monotonic() - t0
        j = wait_job(api, job_id, timeout=240)
        phases["job done"] = time.monotonic() - t0
        assert (j["total"], j["embedded"], j["skipped"], j["failed"]) == (3 * CHUNK + 1, 3 * CHUNK, 1, 0), j["counts"]
        r = api.post("/api/images/", files=[("files", ("i3.jpg", make_jpeg(3), "image/jpeg"))])
        assert r.status_code == 200 and r.json()["images"][0]["status"] == "embedded", r.text

        phases["interactive on B2"] = time.monotonic() - t0
        print("\ntwo hosts, seconds from the start: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
        stats = assert_counts_match(api, host_a)  # one point per distinct image, nothing queued
        distinct = 3 * CHUNK + 3
        assert stats["points"] == distinct, stats
        originals = [k for k in keys(moto, "two-hosts/") if not k.startswith(("two-hosts/thumb/", "two-hosts/preview/"))]
        assert len(originals) == distinct
        for host in (host_a, b1, b2):
            assert blob_files(host.var_dir) == [], host.var_dir
        assert "source_missing" not in (b2.var_dir / "log" / "worker-bulk.log").read_text(errors="replace")
    finally:
        for b in hosts_b:
            b.stop()
        host_a.stop()
