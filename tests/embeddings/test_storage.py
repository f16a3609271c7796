"""The content-addressed blob store and in-place file keys."""
from __future__ import annotations

import hashlib

import pytest

from embeddings.storage import BlobStore, file_key
from workers.errors import ImageRejected


def test_put_is_content_addressed_and_stored_once(tmp_path):
    store = BlobStore(tmp_path)
    key, sha, size = store.put([b"abc", b"def"])
    assert sha == hashlib.sha256(b"abcdef").hexdigest() and size == 6
    assert key == f"blob/{sha[:2]}/{sha[2:4]}/{sha}"
    assert store.put([b"abcdef"])[0] == key
    assert store.read(key, sha) == b"abcdef"
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [sha]  # no temp files left


def test_read_refuses_missing_and_changed_bytes(tmp_path):
    store = BlobStore(tmp_path)
    key, sha, _ = store.put([b"hello"])
    with pytest.raises(ImageRejected) as e:
        store.read(key, "0" * 64)
    assert e.value.reason.value == "source_changed"
    store.delete(key)
    with pytest.raises(ImageRejected) as e:
        store.read(key, sha)
    assert e.value.reason.value == "source_missing"


def test_in_place_files_and_malformed_keys(tmp_path):
    f = tmp_path / "photo.jpg"
    f.write_bytes(b"jpeg bytes")
    store = BlobStore(tmp_path / "blobs")
    key = file_key(f)
    assert key == f"file:{f.resolve()}"
    assert store.read(key, hashlib.sha256(b"jpeg bytes").hexdigest()) == b"jpeg bytes"
    store.delete(key)  # never deletes a user's file
    assert f.exists()
    with pytest.raises(ImageRejected):
        store.read("blob/../../etc/passwd", "0" * 64)
