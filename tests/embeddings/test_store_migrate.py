"""``manage.py store_migrate``: a local-mode folder copied into the edge store, verified, source kept."""
from __future__ import annotations

import io
import uuid

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from workers.vector_store import Point, open_store


def _local_folder(path, n: int, dim: int = 16) -> list[Point]:
    rng = np.random.default_rng(3)
    pts = [Point(uuid.uuid4(), rng.normal(size=dim).astype(np.float32),
                 {"sha256": f"s{i}", "owner_ids": [i % 4], "job_ids": [f"j{i % 3}"]}) for i in range(n)]
    src = open_store("local", collection="space", dim=dim, path=str(path))
    src.ensure_collection()
    src.upsert(pts)
    src.close()
    return pts


@pytest.fixture
def edge_settings(settings, tmp_path):
    settings.VECTOR_STORE = "edge"
    settings.QDRANT_PATH = str(tmp_path / "edge")
    settings.QDRANT_URL = ""
    return settings


def test_copies_every_point_verifies_and_keeps_the_source(edge_settings, tmp_path):
    pts = _local_folder(tmp_path / "old", 300)
    out = io.StringIO()
    call_command("store_migrate", source=str(tmp_path / "old"), collection="space", sample=50, stdout=out)
    assert "copied 300 points" in out.getvalue() and "the target holds 300; 50 sampled" in out.getvalue()
    dst = open_store("edge", collection="space", dim=16, path=edge_settings.QDRANT_PATH)
    dst.ensure_collection()
    assert dst.count() == 300
    got = dst.vectors([p.id for p in pts])
    assert all(np.allclose(got[p.id], p.vector / np.linalg.norm(p.vector), atol=1e-6) for p in pts)
    assert dst.payloads([pts[7].id]) == {pts[7].id: pts[7].payload}
    assert [h.payload["sha256"] for h in dst.search(pts[5].vector, k=1, owner_id=1)] == ["s5"]
    dst.close()
    src = open_store("local", collection="space", dim=16, path=str(tmp_path / "old"))
    assert src.count() == 300  # never deleted
    src.close()
    call_command("store_migrate", source=str(tmp_path / "old"), collection="space", stdout=io.StringIO())  # again: idempotent
    dst = open_store("edge", collection="space", dim=16, path=edge_settings.QDRANT_PATH)
    dst.ensure_collection()
    assert dst.count() == 300
    dst.close()


def test_refuses_a_missing_source_or_collection_with_a_clear_error(edge_settings, tmp_path):
    with pytest.raises(CommandError, match="not a qdrant-client local-mode folder"):
        call_command("store_migrate", source=str(tmp_path / "nothing"), collection="space")
    _local_folder(tmp_path / "old", 3)
    with pytest.raises(CommandError, match="no collection 'other' .* it has: space"):
        call_command("store_migrate", source=str(tmp_path / "old"), collection="other")


def test_refuses_while_the_target_is_owned_by_a_running_worker(edge_settings, tmp_path):
    _local_folder(tmp_path / "old", 3)
    owner = open_store("edge", collection="space", dim=16, path=edge_settings.QDRANT_PATH)
    owner.ensure_collection()
    with pytest.raises(CommandError, match="stop the vectors worker first"):
        call_command("store_migrate", source=str(tmp_path / "old"), collection="space")
    owner.close()
