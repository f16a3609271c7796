"""The vector store contract, kept by all three backends: edge (Qdrant's engine in-process), local
(qdrant-client local mode) and server (a Qdrant server at ``QDRANT_URL``, skipped when none answers).

Same point ids, payloads, filters, errors and collection naming in each: idempotent upserts,
owner/job filters, exclusions, payload rewrites, deletes, copies (scroll), a size mismatch that
is an error naming both sizes and never recreates anything, and vectors that are not finite or are
all zeros: never written or searched with, and harmless when an older write left one stored.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from workers.errors import Reason
from workers.vector_store import CollectionMismatch, Point, StoreError, UnusableVector, VectorStore, open_store


def unit(seed: int, dim: int = 8) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
    return v / np.linalg.norm(v)


def _server_url() -> str | None:
    url = os.environ.get("QDRANT_URL", "")
    if not url:
        return None
    try:
        import httpx

        httpx.get(url.rstrip("/") + "/readyz", timeout=2).raise_for_status()
    except Exception:  # noqa: BLE001 - any failure means "no server here"
        return None
    return url


def open_backend(kind: str, tmp_path, collection: str, dim: int = 8) -> VectorStore:
    if kind == "server":
        url = _server_url()
        if url is None:
            pytest.skip("no Qdrant server answers at QDRANT_URL (set it to run the server backend's contract)")
        return open_store("server", collection=collection, dim=dim, url=url)
    return open_store(kind, collection=collection, dim=dim, path=str(tmp_path / kind))


@pytest.fixture(params=["edge", "local", "server"])
def kind(request):
    return request.param


@pytest.fixture
def store(kind, tmp_path):
    collection = f"test_coll_{uuid.uuid4().hex[:8]}" if kind == "server" else "test_coll"
    s = open_backend(kind, tmp_path, collection)
    s.ensure_collection()
    yield s
    if kind == "server":
        s.client.delete_collection(collection)
    s.close()


def test_upsert_is_idempotent_per_id(store):
    pid = uuid.uuid4()
    p = Point(pid, unit(1), {"sha256": "a", "owner_ids": [1], "job_ids": []})
    store.upsert([p])
    store.upsert([p])
    assert store.count() == 1
    hits = store.search(unit(1), k=3)
    assert hits[0].id == pid and hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert hits[0].payload == {"sha256": "a", "owner_ids": [1], "job_ids": []}


def test_filters_by_owner_and_job_and_excludes(store):
    pts = [Point(uuid.uuid4(), unit(i), {"sha256": str(i), "owner_ids": [i % 2], "job_ids": [f"j{i % 3}"]})
           for i in range(12)]
    store.upsert(pts)
    mine = store.search(unit(0), k=20, owner_id=0)
    assert len(mine) == 6 and all(0 in h.payload["owner_ids"] for h in mine)
    job = store.search(unit(0), k=20, job_id="j1")
    assert {h.payload["sha256"] for h in job} == {"1", "4", "7", "10"}
    both = store.search(unit(0), k=20, owner_id=1, job_id="j1")
    assert {h.payload["sha256"] for h in both} == {"1", "7"}
    excluded = store.search(unit(0), k=20, exclude=[pts[0].id])
    assert pts[0].id not in {h.id for h in excluded} and len(excluded) == 11
    assert store.search(unit(0), k=0) == []


def test_search_order_matches_an_exact_cosine_ranking(store):
    vecs = [unit(100 + i) for i in range(40)]
    pts = [Point(uuid.uuid4(), v, {"sha256": str(i), "owner_ids": [7], "job_ids": []}) for i, v in enumerate(vecs)]
    store.upsert(pts)
    q = unit(999)
    exact = np.argsort(-np.stack(vecs) @ q)[:5]
    hits = store.search(q, k=5, owner_id=7)
    assert [h.id for h in hits] == [pts[i].id for i in exact]
    np.testing.assert_allclose([h.score for h in hits], (np.stack(vecs) @ q)[exact], atol=1e-5)


def test_vectors_payloads_delete_and_payload_rewrite(store):
    pid = uuid.uuid4()
    store.upsert([Point(pid, unit(3), {"sha256": "x", "owner_ids": [1, 2], "job_ids": []})])
    np.testing.assert_allclose(store.vectors([pid])[pid], unit(3), atol=1e-6)
    store.set_payloads({pid: {"sha256": "x", "owner_ids": [2], "job_ids": []}})
    assert store.payloads([pid, uuid.uuid4()]) == {pid: {"sha256": "x", "owner_ids": [2], "job_ids": []}}
    assert store.search(unit(3), k=1, owner_id=1) == []
    store.delete([pid])
    store.delete([uuid.uuid4()])  # absent: ignored
    assert store.count() == 0 and store.vectors([pid]) == {} and store.payloads([pid]) == {}


def test_scroll_returns_every_point_once(store):
    pts = [Point(uuid.uuid4(), unit(i), {"sha256": str(i), "owner_ids": [1], "job_ids": ["j"]}) for i in range(23)]
    store.upsert(pts)
    batches = list(store.scroll(batch=10))
    assert [len(b) for b in batches] == [10, 10, 3]
    got = {p.id: p for b in batches for p in b}
    assert set(got) == {p.id for p in pts}
    np.testing.assert_allclose(got[pts[5].id].vector, pts[5].vector, atol=1e-6)
    assert got[pts[5].id].payload == pts[5].payload


def test_a_vector_of_the_wrong_size_is_refused_and_nothing_is_written(store):
    with pytest.raises(Exception) as e:
        store.upsert([Point(uuid.uuid4(), unit(1, dim=5), {"sha256": "a", "owner_ids": [1], "job_ids": []})])
    assert "8" in str(e.value) and "5" in str(e.value)
    assert store.count() == 0


def test_a_vector_that_is_not_finite_or_is_zeros_is_never_written_nor_searched_with(store):
    good = Point(uuid.uuid4(), unit(1), {"sha256": "a", "owner_ids": [1], "job_ids": []})
    for bad, reason in ((np.r_[np.nan, unit(2)[1:]], Reason.NON_FINITE_EMBEDDING),
                        (np.r_[np.inf, unit(2)[1:]], Reason.NON_FINITE_EMBEDDING),
                        (np.zeros(8, np.float32), Reason.ZERO_EMBEDDING)):
        with pytest.raises(UnusableVector) as e:  # the whole call: not even the good point before it
            store.upsert([good, Point(uuid.uuid4(), bad.astype(np.float32), {"sha256": "b", "owner_ids": [1],
                                                                             "job_ids": []})])
        assert e.value.reason is reason
        with pytest.raises(UnusableVector) as e:  # not an empty list: no similarity is defined
            store.search(bad.astype(np.float32), k=3)
        assert e.value.reason is reason
    assert store.count() == 0


def _write_unchecked(kind: str, store: VectorStore, pid: uuid.UUID, vector: list[float], payload: dict) -> None:
    """Write a point through the engine itself, as a write from before the store's check did."""
    if kind == "edge":
        import qdrant_edge as qe

        store.client.update(qe.UpdateOperation.upsert_points([qe.Point(str(pid), vector, payload)]))
    else:
        from qdrant_client import models

        store.client.upsert(store.collection, points=[models.PointStruct(id=str(pid), vector=vector, payload=payload)])


def test_a_stored_vector_that_is_not_finite_breaks_no_read(kind, store, tmp_path):
    if kind == "server":
        pytest.skip("a Qdrant server refuses such a vector in its JSON: it cannot hold one")
    pts = [Point(uuid.uuid4(), unit(10 + i), {"sha256": str(i), "owner_ids": [1], "job_ids": []}) for i in range(3)]
    store.upsert(pts)
    broken = uuid.uuid4()
    # the edge engine keeps NaN as given; local mode refuses NaN but keeps an infinity, as NaN
    bad = [float("nan")] * 8 if kind == "edge" else [float("inf")] + [0.5] * 7
    _write_unchecked(kind, store, broken, bad, {"sha256": "x", "owner_ids": [1], "job_ids": []})
    assert store.count() == 4
    for with_vectors in (False, True):
        hits = store.search(unit(10), k=10, with_vectors=with_vectors)
        assert [h.id for h in hits][:1] == [pts[0].id] and {h.id for h in hits} == {p.id for p in pts}
        assert all(np.isfinite(h.score) for h in hits)
        assert all(np.isfinite(h.vector).all() for h in hits) if with_vectors else True
    assert set(store.vectors([broken, pts[1].id])) == {pts[1].id}  # as if absent
    assert broken in {p.id for b in store.scroll() for p in b}  # a copy sees what is stored

    from workers.vector_store.migrate import copy_store

    target = open_store("edge", collection="copy", dim=8, path=str(tmp_path / "copy"))
    target.ensure_collection()
    report = copy_store(store, target, sample=10)
    assert (report.source_points, report.target_points, report.unusable) == (3, 3, [broken])
    target.close()


def test_existing_collection_with_other_size_is_an_error_naming_both(kind, store, tmp_path):
    store.upsert([Point(uuid.uuid4(), unit(1), {"sha256": "a", "owner_ids": [1], "job_ids": []})])
    if kind != "server":
        store.close()  # one owner per folder
    other = open_store(kind, collection=store.collection, dim=16, url=_server_url(), path=str(tmp_path / kind))
    with pytest.raises(CollectionMismatch, match="size 8 with distance Cosine, but this model produces size 16"):
        other.ensure_collection()
    if kind != "server":
        other.close()
        store = open_backend(kind, tmp_path, store.collection)
        store.ensure_collection()
    assert store.count() == 1  # never recreated
    if kind != "server":
        store.close()


def test_the_same_point_ids_and_payloads_in_every_backend(tmp_path):
    """A point written to edge and to local mode reads back identically (what store_migrate relies on)."""
    pts = [Point(uuid.uuid4(), unit(i), {"sha256": f"s{i}", "owner_ids": [i, 99], "job_ids": [str(uuid.uuid4())]})
           for i in range(5)]
    found = []
    for kind in ("edge", "local"):
        s = open_backend(kind, tmp_path, "same")
        s.ensure_collection()
        s.upsert(pts)
        found.append([(h.id, round(h.score, 5), h.payload) for h in s.search(unit(2), k=5, owner_id=99)])
        s.close()
    assert found[0] == found[1] and len(found[0]) == 5


# --- edge only: folder lock, durability, the background optimizer ---------------------------------

def test_edge_a_second_owner_of_the_folder_is_refused_with_a_clear_error(tmp_path):
    first = open_store("edge", collection="c", dim=8, path=str(tmp_path))
    first.ensure_collection()
    second = open_store("edge", collection="c", dim=8, path=str(tmp_path))
    with pytest.raises(StoreError, match="another process owns it"):
        second.ensure_collection()
    first.close()


def test_edge_acknowledged_points_survive_kill_9_of_the_writer(tmp_path):
    """A child process writes points and prints each acknowledged batch, then is SIGKILLed with no
    close(): every acknowledged point is there after reload, each once."""
    code = textwrap.dedent(f"""
        import os, signal, sys, uuid
        import numpy as np
        from workers.vector_store import Point, open_store
        s = open_store("edge", collection="c", dim=8, path={str(tmp_path)!r}, fsync=False)
        s.ensure_collection()
        rng = np.random.default_rng(0)
        for b in range(5):
            pts = [Point(uuid.UUID(int=b * 100 + i + 1), rng.normal(size=8).astype("float32"),
                         {{"sha256": str(i), "owner_ids": [b], "job_ids": []}}) for i in range(50)]
            s.upsert(pts)
            print("ack", b, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == -9, out.stderr
    assert out.stdout.split() == [w for b in range(5) for w in ("ack", str(b))]
    s = open_store("edge", collection="c", dim=8, path=str(tmp_path))
    s.ensure_collection()
    assert s.count() == 250
    assert len(s.vectors([uuid.UUID(int=b * 100 + i + 1) for b in range(5) for i in range(50)])) == 250
    s.close()


def test_edge_background_optimizer_waits_for_idle_and_enough_new_points(tmp_path):
    from workers.vector_store.edge import BackgroundOptimizer

    s = open_store("edge", collection="c", dim=8, path=str(tmp_path))
    s.ensure_collection()
    opt = BackgroundOptimizer(s, idle_s=0.2, min_points=100, poll_s=0.05)
    s.upsert([Point(uuid.uuid4(), unit(i), {"sha256": str(i), "owner_ids": [1], "job_ids": []}) for i in range(99)])
    assert not opt.due(s)  # too few new points
    s.upsert([Point(uuid.uuid4(), unit(500), {"sha256": "x", "owner_ids": [1], "job_ids": []})])
    assert not opt.due(s)  # just used: not idle
    opt.start()
    deadline = time.monotonic() + 10
    while not opt.runs and time.monotonic() < deadline:
        opt.stopped.wait(0.05)
    assert len(opt.runs) == 1 and s.unoptimized == 0
    assert s.count() == 100 and len(s.search(unit(3), k=5, owner_id=1)) == 5
    s.close()
    opt.join(timeout=5)
    assert not opt.is_alive()  # ends by itself once the store is closed
