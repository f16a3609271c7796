"""Where image bytes live: a content-addressed blob store, plus in-place files for folder ingestion.

Keys are what messages and the database carry, never the bytes:
- ``blob/<aa>/<bb>/<sha256>``: a file under ``BLOB_ROOT`` written once, atomically.
- ``file:<absolute path>``: a file ingested in place from a server-side folder (staff only).
- ``tmp/<uuid>``: a query image, kept only while its search runs (``put_temporary``), never shared.

``read`` checks the sha256 again, so a file changed on disk after ingestion is refused
(``source_changed``) rather than embedded under the wrong id.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from pathlib import Path
from typing import BinaryIO, Iterable

from workers.errors import ImageRejected, Reason

_FILE_PREFIX = "file:"
_TMP_PREFIX = "tmp/"


class BlobStore:
    """Content-addressed storage under ``root`` (created on first write)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def put(self, chunks: Iterable[bytes]) -> tuple[str, str, int]:
        """Write a stream of bytes once.

        Returns:
            ``(key, sha256 hex, size in bytes)``. Writing the same bytes twice stores them once.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    h.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
            sha = h.hexdigest()
            key = f"blob/{sha[:2]}/{sha[2:4]}/{sha}"
            dest = self.root / key.removeprefix("blob/")
            if dest.exists():
                os.unlink(tmp)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, dest)  # atomic: readers never see a half-written blob
            return key, sha, size
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def put_temporary(self, chunks: Iterable[bytes]) -> tuple[str, str, int]:
        """Write bytes under a fresh ``tmp/<uuid>`` key that no image shares (a query image): the
        caller deletes it when done. Returns ``(key, sha256 hex, size in bytes)``."""
        key = f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        h, size = hashlib.sha256(), 0
        try:
            with open(dest, "xb") as f:
                for chunk in chunks:
                    h.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return key, h.hexdigest(), size

    def put_file(self, f: BinaryIO) -> tuple[str, str, int]:
        """``put`` from an open binary file, read in 1 MiB blocks."""
        return self.put(iter(lambda: f.read(1 << 20), b""))

    def path(self, key: str) -> Path:
        """Filesystem path of ``key``. Raises ``ValueError`` for a malformed key."""
        if key.startswith(_FILE_PREFIX):
            return Path(key[len(_FILE_PREFIX):])
        if key.startswith("blob/") and ".." not in key:
            return self.root / key.removeprefix("blob/")
        if key.startswith(_TMP_PREFIX) and key[len(_TMP_PREFIX):].isalnum():
            return self.root / key
        raise ValueError(f"malformed storage key {key!r}")

    def read(self, key: str, sha256: str) -> bytes:
        """The bytes of ``key``, verified against ``sha256``.

        Raises:
            ImageRejected: ``source_missing`` (gone) or ``source_changed`` (different bytes).
        """
        try:
            data = self.path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError) as e:
            raise ImageRejected(Reason.SOURCE_MISSING, f"{key}: {e}") from e
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ImageRejected(Reason.SOURCE_CHANGED, f"{key} no longer has sha256 {sha256}")
        return data

    def delete(self, key: str) -> None:
        """Remove a blob or a temporary file (in-place files are never deleted). Missing ones are
        ignored."""
        if key.startswith(("blob/", _TMP_PREFIX)):
            self.path(key).unlink(missing_ok=True)


def file_key(path: Path) -> str:
    """The storage key of a file ingested in place."""
    return _FILE_PREFIX + str(Path(path).resolve())


# --- thumbnails (issue 12) -----------------------------------------------------------------------
# Stored beside the originals, in the same store, under ``thumb/<aa>/<sha256>.webp``: keyed by the
# original's sha256, so every row sharing those bytes (a skipped duplicate) shares one thumbnail,
# and the sha is also the thumbnail's ETag.

def thumbnail_key(sha256: str) -> str:
    """Storage key of the thumbnail of the bytes with ``sha256``. Raises ``ValueError`` if it is not hex."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return f"thumb/{sha256[:2]}/{sha256}.webp"


def thumbnail_path(store: BlobStore, sha256: str) -> Path:
    """Filesystem path of the thumbnail of ``sha256`` in ``store`` (it may not exist)."""
    return store.root / thumbnail_key(sha256)


def thumbnail_exists(store: BlobStore, sha256: str) -> bool:
    """True when ``store`` already holds the thumbnail of ``sha256`` (made once, never redrawn)."""
    return thumbnail_path(store, sha256).is_file()


def thumbnail_put(store: BlobStore, sha256: str, data: bytes) -> bool:
    """Write the thumbnail of ``sha256`` atomically, unless it exists. Returns True when written."""
    dest = thumbnail_path(store, sha256)
    if dest.is_file():
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".thumb-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)  # atomic: a page never reads half a thumbnail
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def thumbnail_read(store: BlobStore, sha256: str) -> bytes | None:
    """The thumbnail bytes of ``sha256``, or None when none was drawn (the image never decoded)."""
    try:
        return thumbnail_path(store, sha256).read_bytes()
    except FileNotFoundError:
        return None
