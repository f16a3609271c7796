"""The Qdrant sink on embedded Qdrant: idempotent upserts, owner/job filters, mismatch refusal."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from workers.vector_store import CollectionMismatch, Point, VectorStore, open_client


def unit(seed: int, dim: int = 8) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
    return v / np.linalg.norm(v)


@pytest.fixture
def store(tmp_path):
    client = open_client(url=None, path=str(tmp_path / "q"))
    s = VectorStore(client, "test_coll", 8)
    s.ensure_collection()
    yield s
    client.close()


def test_upsert_is_idempotent_per_id(store):
    pid = uuid.uuid4()
    p = Point(pid, unit(1), {"sha256": "a", "owner_ids": [1], "job_ids": []})
    store.upsert([p])
    store.upsert([p])
    assert store.count() == 1
    hits = store.search(unit(1), k=3)
    assert hits[0].id == pid and hits[0].score == pytest.approx(1.0, abs=1e-5)


def test_filters_by_owner_and_job_and_excludes(store):
    pts = [Point(uuid.uuid4(), unit(i), {"sha256": str(i), "owner_ids": [i % 2], "job_ids": [f"j{i % 3}"]})
           for i in range(12)]
    store.upsert(pts)
    mine = store.search(unit(0), k=20, owner_id=0)
    assert len(mine) == 6 and all(0 in h.payload["owner_ids"] for h in mine)
    job = store.search(unit(0), k=20, job_id="j1")
    assert {h.payload["sha256"] for h in job} == {"1", "4", "7", "10"}
    excluded = store.search(unit(0), k=20, exclude=[pts[0].id])
    assert pts[0].id not in {h.id for h in excluded} and len(excluded) == 11


def test_vectors_delete_and_payloads(store):
    pid = uuid.uuid4()
    store.upsert([Point(pid, unit(3), {"sha256": "x", "owner_ids": [1, 2], "job_ids": []})])
    np.testing.assert_allclose(store.vectors([pid])[pid], unit(3), atol=1e-6)
    store.set_payloads({pid: {"sha256": "x", "owner_ids": [2], "job_ids": []}})
    assert store.search(unit(3), k=1, owner_id=1) == []
    store.delete([pid])
    assert store.count() == 0 and store.vectors([pid]) == {}


def test_existing_collection_with_other_size_is_an_error_naming_both(store):
    other = VectorStore(store.client, "test_coll", 16)
    with pytest.raises(CollectionMismatch, match="size 8 .* size 16"):
        other.ensure_collection()
    assert store.count() == 0 and store.client.collection_exists("test_coll")  # never recreated
