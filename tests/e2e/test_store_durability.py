"""``kill -9`` of the vectors worker in the middle of a bulk write, with real processes: a private
Redis, the real vectors worker on the embedded edge store, SQLite. Precomputed vectors are fed as
``index_chunk`` messages (``benchmarks/sink.py``), so no model runs and the kill lands mid-write.

What must hold: every image marked embedded (acknowledged) has its point in the store after the
kill, with the vector that was sent; the points not yet acknowledged are at most the chunk part being
written (its images are marked once all its slices are written: issue 43); when the work is delivered again (as the reconciler or a redelivery does) every image ends
embedded with exactly one point each: nothing lost, nothing duplicated.
"""
from __future__ import annotations

import signal
import time
import uuid

import numpy as np
import pytest

from benchmarks.sink import django_call, embedded_count, unit_vector
from scripts.stack import Stack

pytestmark = pytest.mark.e2e

#: 128 chunks of 64: the sink writes ~2,500 points/s, so all of them take seconds, and the kill after
#: the first three chunks lands mid-write (with 1,024, every point was written before the test
#: process, which sends them, could look).
N = 8_192


def _wait(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _store(var_dir, collection: str, dim: int):
    from workers.vector_store import open_store

    s = open_store("edge", collection=collection, dim=dim, path=str(var_dir / "qdrant-edge"))
    s.ensure_collection()
    return s


def _embedded_ids(db, job_id: str) -> set[uuid.UUID]:
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
        return {uuid.UUID(r[0]) for r in con.execute(
            "SELECT point_id FROM embeddings_image WHERE job_id = ? AND status = 'embedded'", (uuid.UUID(job_id).hex,))}


def test_kill_9_of_the_vectors_worker_mid_bulk_write_loses_and_duplicates_nothing(tmp_path):
    env = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "DATABASE_URL": "", "VECTOR_STORE": "edge",
           "RECONCILE_INTERVAL_S": "0", "VECTORS_WRITE_SLICE": "8"}
    with Stack(tmp_path / "var", env, private_redis=True, only=("worker-vectors",), log=lambda *a: None) as stack:
        sent = django_call(stack, f"import json; from benchmarks.sink import seed_and_send as f; o = f({N}); "
                                  f"print(json.dumps({{k: o[k] for k in ('job_id', 'collection', 'dim')}}))")
        db, job_id = stack.var_dir / "db.sqlite3", sent["job_id"]
        # Kill once a few chunks are written and most are not: mid-write, with the WAL unflushed.
        _wait(lambda: embedded_count(db, job_id) >= 3 * 64, timeout=120, what="the first chunks to be written")
        stack.stop_process("worker-vectors", sig=signal.SIGKILL)
        acknowledged = _embedded_ids(db, job_id)
        assert 3 * 64 <= len(acknowledged) < N

        store = _store(stack.var_dir, sent["collection"], sent["dim"])
        vectors = store.vectors(sorted(acknowledged))
        assert set(vectors) == acknowledged  # every acknowledged point survived the kill
        in_store = store.count()
        # at most the chunk part being written: its slices are written, then its images marked at once
        assert len(acknowledged) <= in_store <= len(acknowledged) + 64
        payloads = store.payloads(sorted(acknowledged))
        index = {p["sha256"]: int(p["sha256"], 16) for p in payloads.values()}
        for pid, payload in payloads.items():
            np.testing.assert_allclose(vectors[pid], unit_vector(index[payload["sha256"]], sent["dim"]), atol=1e-6)
        store.close()

        # The work is delivered again, all of it (what a redelivery or the reconciler does): the
        # restarted worker rewrites the same point ids and marks only what is still queued.
        stack.restart("worker-vectors")
        resend = (f"import json; from benchmarks.sink import send_chunks, CHUNK, unit_vector; "
                  f"from embeddings.messages import encode_vector; from embeddings.models import Image; "
                  f"rows = list(Image.objects.filter(job_id='{job_id}').order_by('sha256')); "
                  f"items = [{{'id': str(r.id), 'point_id': str(r.point_id), 'sha256': r.sha256, 'width': 224, "
                  f"'height': 224, 'format': 'JPEG', 'vector': encode_vector(unit_vector(int(r.sha256, 16), {sent['dim']}))}} "
                  f"for r in rows]; send_chunks('{job_id}', [items[i:i + CHUNK] for i in range(0, len(items), CHUNK)]); "
                  f"print(json.dumps({{'sent': len(items)}}))")
        assert django_call(stack, resend) == {"sent": N}
        _wait(lambda: embedded_count(db, job_id) == N, timeout=180, what="every image to be embedded")
        # Drain: the first deliveries' messages (killed mid-task, late acks) may still come back; they
        # find nothing queued. Stop the worker so the store can be opened here.
        stack.stop_process("worker-vectors", sig=signal.SIGTERM)
        store = _store(stack.var_dir, sent["collection"], sent["dim"])
        assert store.count() == N  # one point per image: nothing duplicated
        assert set(store.vectors(sorted(_embedded_ids(db, job_id)))) == _embedded_ids(db, job_id)
        store.close()
