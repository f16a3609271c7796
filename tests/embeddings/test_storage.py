"""The content-addressed blob store and in-place file keys."""
from __future__ import annotations

import hashlib
import io

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


def test_the_filesystem_backend_keeps_names_and_layout(tmp_path):
    """The default backend (Django's FileSystemStorage, content-addressed): the layout under
    ``BLOB_ROOT`` is the one earlier versions wrote, a name is never renamed, thumbnails, previews and
    temporary keys sit in the same folder, and ``exists``/``path`` answer per key."""
    from embeddings.storage import (ContentFileSystemStorage, preview_delete, preview_exists, preview_put,
                                    preview_read, thumbnail_delete, thumbnail_exists, thumbnail_path, thumbnail_put,
                                    thumbnail_read)

    store = BlobStore(tmp_path)
    assert isinstance(store.storage, ContentFileSystemStorage) and store.root == tmp_path
    key, sha, _ = store.put([b"x" * 10])
    assert store.path(key) == tmp_path / sha[:2] / sha[2:4] / sha and store.exists(key)
    # a second save of the same name replaces it in place (Django's default would write name_<random>)
    store.storage.save(key.removeprefix("blob/"), io.BytesIO(b"x" * 10))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == \
        [f"{sha[:2]}/{sha[2:4]}/{sha}"]
    tmp_key, tmp_sha, _ = store.put_temporary([b"query"])
    assert store.path(tmp_key) == tmp_path / tmp_key and store.read(tmp_key, tmp_sha) == b"query"
    store.delete(tmp_key)
    assert not store.exists(tmp_key)
    assert thumbnail_put(store, sha, b"thumb") and not thumbnail_put(store, sha, b"again")
    assert thumbnail_path(store, sha) == tmp_path / "thumb" / sha[:2] / f"{sha}.jpg"
    assert thumbnail_exists(store, sha) and thumbnail_read(store, sha) == b"thumb"
    thumbnail_delete(store, sha)
    assert thumbnail_read(store, sha) is None and not thumbnail_exists(store, sha)
    assert preview_put(store, sha, b"preview") and not preview_put(store, sha, b"again")
    assert (tmp_path / "preview" / sha[:2] / sha).read_bytes() == b"preview" == preview_read(store, sha)
    preview_delete(store, sha)
    assert not preview_exists(store, sha) and not (tmp_path / "preview" / sha[:2] / sha).exists()
    with pytest.raises(FileNotFoundError):
        preview_read(store, sha)
    with pytest.raises(ValueError, match="not a sha256"):
        preview_read(store, "../" + sha[3:])
    assert not [p for p in tmp_path.rglob(".upload-*")]  # no temporary file left behind
    for bad in ("blob/aa/bb/" + "0" * 64, "tmp/../x", "thumb/x", "nope"):
        with pytest.raises(ValueError):
            store.exists(bad)


def test_blob_store_follows_the_storages_setting(settings, tmp_path):
    """``runtime.blob_store()`` builds ``STORAGES["blobs"]``; a filesystem backend without a
    location takes ``BLOB_ROOT`` as it is now."""
    from embeddings import runtime

    settings.BLOB_ROOT = tmp_path / "here"
    runtime.blob_store.cache_clear()
    try:
        assert runtime.blob_store().root == tmp_path / "here"
        settings.STORAGES = {**settings.STORAGES, "blobs": {
            "BACKEND": "embeddings.storage.ContentFileSystemStorage", "OPTIONS": {"location": str(tmp_path / "there")}}}
        runtime.blob_store.cache_clear()
        assert runtime.blob_store().root == tmp_path / "there"
    finally:
        runtime.blob_store.cache_clear()


def test_a_webp_thumbnail_of_an_older_release_is_still_read_and_never_redrawn(tmp_path):
    """Thumbnails were WebP before they became JPEG: one already stored is read, counts as drawn
    (no second thumbnail is written beside it), is served as image/webp, and is deleted with its image."""
    from embeddings.storage import thumbnail_delete, thumbnail_exists, thumbnail_put, thumbnail_read
    from workers.thumbnail import content_type

    store = BlobStore(tmp_path)
    sha = hashlib.sha256(b"older").hexdigest()
    legacy = tmp_path / "thumb" / sha[:2] / f"{sha}.webp"
    legacy.parent.mkdir(parents=True)
    webp = b"RIFF\x10\x00\x00\x00WEBPVP8 "
    legacy.write_bytes(webp)
    assert thumbnail_exists(store, sha) and thumbnail_read(store, sha) == webp
    assert thumbnail_put(store, sha, b"\xff\xd8\xff new") is False
    assert not (tmp_path / "thumb" / sha[:2] / f"{sha}.jpg").exists()
    assert content_type(thumbnail_read(store, sha)) == "image/webp" and content_type(b"\xff\xd8\xff") == "image/jpeg"
    thumbnail_delete(store, sha)
    assert not legacy.exists() and thumbnail_read(store, sha) is None
