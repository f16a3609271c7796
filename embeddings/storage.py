"""Where image bytes live: a content-addressed blob store over Django's storage API, plus in-place
files for folder ingestion.

The bytes go through a Django :class:`~django.core.files.storage.Storage` (``STORAGES["blobs"]``,
built by :func:`embeddings.runtime.blob_store`): files under ``BLOB_ROOT`` by default
(:class:`ContentFileSystemStorage`), or S3-compatible object storage (django-storages'
``S3Storage`` over boto3) when ``STORAGE_URL`` is ``s3://bucket[/prefix]``, which is what lets
an embedding worker on another host read what the web host stored.

Keys are what messages and the database carry, never the bytes; each maps to one storage name:
- ``blob/<aa>/<bb>/<sha256>`` → name ``<aa>/<bb>/<sha256>``: written once per distinct bytes.
- ``tmp/<uuid hex>`` → name ``tmp/<uuid hex>``: a query image or an embeddings request's image,
  kept only while its request runs (``put_temporary``), never shared; one whose process died first
  is deleted by the reconciler (``temporaries_delete``).
- ``file:<absolute path>``: a file ingested in place from a server-side folder (staff only); it is
  read from the local filesystem, so every worker host must see that folder at the same path.
- ``s3://<bucket>/<key>``: an object of a catalogue bucket read where it lives (issue 41,
  ``SOURCE_BUCKETS``), through the ``objects`` reader the store was given; never written or deleted.
Thumbnails live in the same storage under ``thumb/<aa>/<sha256>.jpg`` (``.webp`` when an older
release drew it), previews (what re-embeds read, ``workers.preview``: a JPEG or a lossless copy) under ``preview/<aa>/<sha256>``.

``read`` checks the sha256 again, so bytes changed after ingestion are refused (``source_changed``)
rather than embedded under the wrong id.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import tempfile
import uuid
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from django.core.files import File
from django.core.files.base import ContentFile
from django.core.files.storage import FileSystemStorage, Storage

from workers import thumbnail
from workers.errors import ImageRejected, Reason

_FILE_PREFIX = "file:"
_OBJECT_PREFIX = "s3://"
_BLOB_PREFIX = "blob/"
_TMP_PREFIX = "tmp/"
_HEX = frozenset("0123456789abcdef")
#: Bytes kept in memory while a blob is hashed before it is stored; larger ones spill to a temporary
#: file (``max_image_bytes`` is 50 MiB by default: a whole image need not sit in memory).
_SPOOL_BYTES = 8 << 20


@contextlib.contextmanager
def _spooled(chunks: Iterable[bytes]) -> Iterator[tuple[BinaryIO, str, int]]:
    """Spool a stream of bytes (in memory up to :data:`_SPOOL_BYTES`, then a temporary file) while
    hashing it: ``(spool rewound to 0, sha256 hex, size in bytes)``, valid inside the block."""
    h, size = hashlib.sha256(), 0
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
        for chunk in chunks:
            h.update(chunk)
            size += len(chunk)
            spool.write(chunk)
        spool.seek(0)
        yield spool, h.hexdigest(), size


class ContentFileSystemStorage(FileSystemStorage):
    """Django's ``FileSystemStorage`` for content-addressed names: a name is saved as given (same
    name, same bytes: never renamed to ``name_<random>``), atomically (written to a temporary file
    in the same folder, then ``os.replace``), so a reader never sees half a file, and two writers
    of the same bytes both succeed."""

    def get_available_name(self, name, max_length=None):
        return name

    def _save(self, name, content):
        dest = Path(self.path(name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                if hasattr(content, "seek"):
                    content.seek(0)
                for chunk in content.chunks():
                    f.write(chunk)
            if self.file_permissions_mode is not None:
                os.chmod(tmp, self.file_permissions_mode)
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return name


class BlobStore:
    """Content-addressed bytes in a Django storage.

    Args:
        storage: the storage backend, or a folder (then a :class:`ContentFileSystemStorage` there,
            created on first write).
        objects: ``(bucket, key) -> bytes`` reading catalogue objects for ``s3://`` keys (raises
            ``ImageRejected``); None: such keys are ``source_missing``.

    Attributes:
        root: the folder of a filesystem storage, ``None`` for object storage.
    """

    def __init__(self, storage: Storage | str | os.PathLike, *, objects=None) -> None:
        if isinstance(storage, (str, os.PathLike)):
            storage = ContentFileSystemStorage(location=str(storage))
        self.storage = storage
        self.objects = objects
        self.root = Path(storage.location) if isinstance(storage, FileSystemStorage) else None

    def put(self, chunks: Iterable[bytes]) -> tuple[str, str, int]:
        """Store a stream of bytes once, under the key of their sha256.

        The bytes are hashed while spooled (in memory up to 8 MiB, then a temporary file); a storage
        that already holds the name is not written again.

        Returns:
            ``(key, sha256 hex, size in bytes)``. Writing the same bytes twice stores them once.
        """
        with _spooled(chunks) as (spool, sha, size):
            key = f"{_BLOB_PREFIX}{sha[:2]}/{sha[2:4]}/{sha}"
            name = self._name(key)
            if not self.storage.exists(name):
                self.storage.save(name, File(spool, name=name))
        return key, sha, size

    def put_temporary(self, chunks: Iterable[bytes]) -> tuple[str, str, int]:
        """Write bytes under a fresh ``tmp/<uuid>`` key that no image shares (a query image): the
        caller deletes it when done. Returns ``(key, sha256 hex, size in bytes)``."""
        key = f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with _spooled(chunks) as (spool, sha, size):
            self.storage.save(self._name(key), File(spool, name=key))
        return key, sha, size

    def put_file(self, f: BinaryIO) -> tuple[str, str, int]:
        """``put`` from an open binary file, read in 1 MiB blocks."""
        return self.put(iter(lambda: f.read(1 << 20), b""))

    @staticmethod
    def _name(key: str) -> str:
        """The storage name of a ``blob/`` or ``tmp/`` key. Raises ``ValueError`` for any other key."""
        if key.startswith(_BLOB_PREFIX):
            parts = key[len(_BLOB_PREFIX):].split("/")
            if len(parts) == 3 and len(parts[2]) == 64 and set(parts[2]) <= _HEX \
                    and parts[0] == parts[2][:2] and parts[1] == parts[2][2:4]:
                return "/".join(parts)
        elif key.startswith(_TMP_PREFIX) and key[len(_TMP_PREFIX):].isalnum() and key[len(_TMP_PREFIX):].isascii():
            return key
        raise ValueError(f"malformed storage key {key!r}")

    def path(self, key: str) -> Path:
        """Filesystem path of ``key`` (an in-place file, or a blob of a filesystem storage).

        Raises:
            ValueError: a malformed key, or a blob key when the storage is not a filesystem.
        """
        if key.startswith(_FILE_PREFIX):
            return Path(key[len(_FILE_PREFIX):])
        if self.root is None:
            raise ValueError(f"{key!r} is in object storage: it has no local path")
        return Path(self.storage.path(self._name(key)))

    def exists(self, key: str) -> bool:
        """True when the bytes of ``key`` are stored (an in-place file: when it exists). Raises
        ``ValueError`` for a malformed key."""
        if key.startswith(_FILE_PREFIX):
            return Path(key[len(_FILE_PREFIX):]).is_file()
        if key.startswith(_OBJECT_PREFIX):
            return True  # read where it lives: its absence shows as source_missing when read
        return self.storage.exists(self._name(key))

    def read(self, key: str, sha256: str) -> bytes:
        """The bytes of ``key``, verified against ``sha256``.

        Raises:
            ImageRejected: ``source_missing`` (gone, or a malformed key) or ``source_changed``
                (different bytes). Errors of the storage itself (network, credentials) propagate.
        """
        try:
            if key.startswith(_OBJECT_PREFIX):
                if self.objects is None:
                    raise ValueError("no reader of catalogue objects is configured")
                bucket, _, name = key[len(_OBJECT_PREFIX):].partition("/")
                data = self.objects(bucket, name)
            elif key.startswith(_FILE_PREFIX):
                data = Path(key[len(_FILE_PREFIX):]).read_bytes()
            else:
                with self.storage.open(self._name(key), "rb") as f:
                    data = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError) as e:
            raise ImageRejected(Reason.SOURCE_MISSING, f"{key}: {e}") from e
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ImageRejected(Reason.SOURCE_CHANGED, f"{key} no longer has sha256 {sha256}")
        return data

    def open(self, key: str) -> BinaryIO:
        """A ``blob/`` key's bytes as an open binary file (the caller closes it): read a part of a
        large blob (a batch's input lines) without holding the rest in memory. Not checked against
        a sha256: the caller that needs it hashes what it reads.

        Raises:
            ImageRejected: ``source_missing`` (gone, or not a ``blob/`` key).
        """
        try:
            if not key.startswith(_BLOB_PREFIX):
                raise ValueError(f"{key!r} is not a blob key")
            return self.storage.open(self._name(key), "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError) as e:
            raise ImageRejected(Reason.SOURCE_MISSING, f"{key}: {e}") from e

    def delete(self, key: str) -> None:
        """Remove a blob or a temporary file (in-place files are never deleted). Missing ones are
        ignored. Raises ``ValueError`` for a malformed blob or temporary key."""
        if key.startswith((_BLOB_PREFIX, _TMP_PREFIX)):
            self.storage.delete(self._name(key))

    def temporaries_delete(self, *, older_than: dt.datetime) -> int:
        """Delete what ``tmp/`` holds that was last written before ``older_than`` (aware): the
        temporary files of requests whose process died before deleting them (a request deletes its
        own when it ends), and a filesystem storage's unfinished writes there. Returns how many."""
        try:
            _, names = self.storage.listdir(_TMP_PREFIX.rstrip("/"))
        except FileNotFoundError:  # a filesystem storage that never held one
            return 0
        deleted = 0
        for name in names:
            path = f"{_TMP_PREFIX}{name}"
            try:
                if self.storage.get_modified_time(path) < older_than:
                    self.storage.delete(path)
                    deleted += 1
            except FileNotFoundError:  # its request deleted it meanwhile
                continue
        return deleted


def file_key(path: Path) -> str:
    """The storage key of a file ingested in place."""
    return _FILE_PREFIX + str(Path(path).resolve())


# --- thumbnails (issue 12) -----------------------------------------------------------------------
# Stored beside the originals, in the same store, under ``thumb/<aa>/<sha256>.jpg`` (``.webp`` when
# an older release drew it): keyed by the original's sha256, so every row sharing those bytes (a skipped duplicate) shares one thumbnail,
# and the sha is also the thumbnail's ETag.

def thumbnail_key(sha256: str, *, suffix: str = thumbnail.SUFFIX) -> str:
    """Storage key of the thumbnail of the bytes with ``sha256`` (``suffix``: ``thumbnail.LEGACY_SUFFIX``
    for one drawn by an older release). Raises ``ValueError`` if it is not hex."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return f"thumb/{sha256[:2]}/{sha256}{suffix}"


def _thumbnail_keys(sha256: str) -> tuple[str, str]:
    # the current key first: a thumbnail is drawn once, so at most one of them exists
    return thumbnail_key(sha256), thumbnail_key(sha256, suffix=thumbnail.LEGACY_SUFFIX)


def thumbnail_path(store: BlobStore, sha256: str) -> Path:
    """Filesystem path of the thumbnail of ``sha256`` in a filesystem ``store`` (it may not exist).
    Raises ``ValueError`` when the store is object storage."""
    if store.root is None:
        raise ValueError("thumbnails in object storage have no local path")
    return Path(store.storage.path(thumbnail_key(sha256)))


def thumbnail_exists(store: BlobStore, sha256: str) -> bool:
    """True when ``store`` already holds the thumbnail of ``sha256`` (made once, never redrawn; a
    WebP one of an older release counts)."""
    return any(store.storage.exists(k) for k in _thumbnail_keys(sha256))


def thumbnail_put(store: BlobStore, sha256: str, data: bytes) -> bool:
    """Write the thumbnail of ``sha256`` (atomically on a filesystem), unless it exists. Returns
    True when written."""

    name = thumbnail_key(sha256)
    if thumbnail_exists(store, sha256):
        return False
    store.storage.save(name, ContentFile(data, name=name))
    return True


def thumbnail_read(store: BlobStore, sha256: str) -> bytes | None:
    """The thumbnail bytes of ``sha256`` (JPEG, or WebP when an older release drew it:
    ``workers.thumbnail.content_type`` tells), or None when none was drawn (the image never decoded)."""
    for key in _thumbnail_keys(sha256):
        try:
            with store.storage.open(key, "rb") as f:
                return f.read()
        except FileNotFoundError:
            continue
    return None


def thumbnail_delete(store: BlobStore, sha256: str) -> None:
    """Remove the thumbnail of ``sha256``, either format (missing: nothing to do)."""
    for key in _thumbnail_keys(sha256):
        store.storage.delete(key)


# --- previews (issue 43) -------------------------------------------------------------------------
# One per distinct bytes, beside the thumbnail, under ``preview/<aa>/<sha256>`` (``workers.preview``:
# a JPEG or a lossless copy, hence no suffix): what a re-embed reads instead of the original when
# its model fits in it.

def preview_key(sha256: str) -> str:
    """Storage key of the preview of the bytes with ``sha256``. Raises ``ValueError`` if it is not hex."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return f"preview/{sha256[:2]}/{sha256}"


def preview_exists(store: BlobStore, sha256: str) -> bool:
    """True when ``store`` holds the preview of ``sha256``."""
    return store.storage.exists(preview_key(sha256))


def preview_put(store: BlobStore, sha256: str, data: bytes) -> bool:
    """Write the preview of ``sha256`` (atomically on a filesystem), unless it exists. Returns True
    when written."""

    name = preview_key(sha256)
    if store.storage.exists(name):
        return False
    store.storage.save(name, ContentFile(data, name=name))
    return True


def preview_read(store: BlobStore, sha256: str) -> bytes:
    """The preview bytes of ``sha256``. Raises ``FileNotFoundError`` when none was drawn."""
    with store.storage.open(preview_key(sha256), "rb") as f:
        return f.read()


def preview_delete(store: BlobStore, sha256: str) -> None:
    """Remove the preview of ``sha256`` (missing: nothing to do)."""
    store.storage.delete(preview_key(sha256))
