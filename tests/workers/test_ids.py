import uuid

import pytest

from workers.ids import point_id, sha256_hex


def test_point_id_is_deterministic_per_content_and_model():
    sha = sha256_hex(b"abc")
    a = point_id(sha, "ViT-B-32/random-seed0/fp32")
    assert a == point_id(sha, "ViT-B-32/random-seed0/fp32")
    assert isinstance(a, uuid.UUID) and a.version == 5
    assert a != point_id(sha, "ViT-B-32/random-seed0/bf16")
    assert a != point_id(sha256_hex(b"abd"), "ViT-B-32/random-seed0/fp32")
    # pinned: changing the namespace would orphan every stored point
    assert str(point_id("0" * 64, "m")) == str(uuid.uuid5(uuid.uuid5(uuid.NAMESPACE_URL, "clip-embeddings/points"), "m:" + "0" * 64))


def test_point_id_refuses_non_hex():
    with pytest.raises(ValueError):
        point_id("xyz", "m")
