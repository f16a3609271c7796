"""Upload sources turned into one shape, :class:`SourceFile`: uploaded files, zip entries, folders.

Zip archives are read entry by entry without extracting to disk by name; entries with absolute
paths or ``..`` are refused (zip slip), and the entry count and total uncompressed size are bounded
before anything is read (zip bombs). Folders are confined to ``settings.INGEST_ROOTS`` unless the
caller is the server's own command line; symlinks that leave the folder are refused.

Every uploaded file and every zip entry that is not a directory becomes one source, whatever its
name: the display name is :func:`safe_name` of the name sent, and a name with nothing usable left
(empty, ``.``, ``..``, ending in ``/``, only control characters) is replaced by a fallback that
says where the file was: ``upload-N`` (N-th part of the request body) or ``entry-N`` (N-th record
of the zip). ``SourceFile.raw_name`` keeps the name as sent when the display name differs.
"""
from __future__ import annotations

import dataclasses
import os
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Callable, Iterator

from embeddings.errors import ApplicationError


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file to ingest: a display ``name``, its ``size`` in bytes, and how to ``open`` it.

    ``in_place`` is set for server-side files that are embedded where they are (not copied);
    ``raw_name`` is the name as sent when ``name`` differs from it (see :func:`safe_name`);
    ``external_id`` and ``metadata`` are the caller's id and attributes for it, validated
    (``services.catalogue.metadata``).
    """

    name: str
    size: int
    open: Callable[[], BinaryIO]
    in_place: Path | None = None
    raw_name: str | None = None
    external_id: str | None = None
    metadata: dict | None = None


#: Longest display name, in characters (``Image.original_name`` is a ``CharField(max_length=255)``).
MAX_NAME_CHARS = 255


def _clean(segment: str) -> str:
    # str.isprintable() is False for control (Cc), format (Cf: e.g. U+202E, right-to-left
    # override, a classic extension spoof), separator and unassigned characters, except " ".
    return "".join(ch for ch in segment if ch.isprintable()).strip()


def safe_name(raw: str | None, *, fallback: str, keep_dirs: bool = False) -> str:
    """A display name for a file from an untrusted name: never empty, no control characters.

    Backslashes count as path separators; each segment loses its non-printable characters and
    outer spaces. The name is the last segment (``keep_dirs``: the cleaned path, without empty,
    ``.`` or ``..`` segments), at most :data:`MAX_NAME_CHARS` characters, extension kept.

    Returns:
        ``fallback`` when ``raw`` is None or its last segment is empty, ``.`` or ``..`` once
        cleaned (``""``, ``"holiday.png/"``, ``".."``, a tab), else the cleaned name.
    """
    if raw is None:
        return fallback
    segments = [_clean(s) for s in raw.replace("\\", "/").split("/")]
    base = segments[-1]
    if base in ("", ".", ".."):
        return fallback
    name = "/".join([s for s in segments[:-1] if s not in ("", ".", "..")] + [base]) if keep_dirs else base
    if len(name) > MAX_NAME_CHARS:
        name = base
    if len(name) > MAX_NAME_CHARS:
        stem, ext = os.path.splitext(name)
        ext = ext if len(ext) <= 16 else ""
        name = stem[: MAX_NAME_CHARS - len(ext)] + ext
    return name


def from_uploads(files) -> list[SourceFile]:
    """Django ``UploadedFile`` objects → sources, one per file, in order.

    The name is :func:`safe_name` of ``raw_name`` (set by :mod:`embeddings.api.parsers`: the name
    as sent) or of ``name``; the fallback is ``upload-N``, N the file's ``part`` (its position in
    the request body) or its 1-based position in ``files``.
    """
    out = []
    for i, f in enumerate(files, start=1):
        def _open(f=f):
            f.seek(0)
            return f
        raw = getattr(f, "raw_name", None)
        raw = f.name if raw is None else raw
        name = safe_name(raw, fallback=f"upload-{getattr(f, 'part', i)}")
        out.append(SourceFile(name=name, size=f.size, open=_open, raw_name=None if raw == name else raw))
    return out


def from_zip(upload, *, max_entries: int, max_uncompressed: int) -> list[SourceFile]:
    """Entries of a zip archive (directories skipped) → sources.

    A directory is an entry whose name ends in ``/`` and that holds no bytes; an entry with bytes
    is a file whatever its name, named by :func:`safe_name` (directories kept) with the fallback
    ``entry-N`` (N: its 1-based position in the archive's central directory).

    Entries are read lazily, never more than their declared size; one whose data turns out damaged
    (bad CRC, broken deflate stream) raises :class:`~workers.errors.ImageRejected` ``corrupt`` when
    read, so it fails alone.

    Raises:
        ApplicationError: ``zip_invalid`` (400), ``zip_unsafe_path`` (400), ``zip_unsupported``
            (400: an encrypted entry or an unknown compression method), ``zip_too_many_entries`` (413)
            or ``zip_too_large`` (413).
    """
    try:
        archive = zipfile.ZipFile(upload)
        infos = [(n, i) for n, i in enumerate(archive.infolist(), start=1) if not (i.is_dir() and i.file_size == 0)]
    except (zipfile.BadZipFile, OSError) as e:
        raise ApplicationError(f"not a readable zip archive: {e}", code="zip_invalid") from e
    if len(infos) > max_entries:
        raise ApplicationError(
            f"zip has {len(infos)} entries; the limit is {max_entries}", code="zip_too_many_entries", status=413,
            extra={"limit": max_entries, "entries": len(infos)},
        )
    total = sum(i.file_size for _, i in infos)
    if total > max_uncompressed:
        raise ApplicationError(
            f"zip expands to {total} bytes; the limit is {max_uncompressed}", code="zip_too_large", status=413,
            extra={"limit": max_uncompressed, "uncompressed_bytes": total},
        )
    out = []
    for n, info in infos:
        p = PurePosixPath(info.filename.replace("\\", "/"))
        if p.is_absolute() or ".." in p.parts or (p.parts and ":" in p.parts[0]):
            raise ApplicationError(
                f"zip entry {info.filename!r} has an absolute or parent path", code="zip_unsafe_path",
                extra={"entry": info.filename},
            )
        if info.flag_bits & 0x1 or info.compress_type not in _ZIP_METHODS:
            raise ApplicationError(
                f"zip entry {info.filename!r} is encrypted or uses an unsupported compression method "
                f"({info.compress_type})", code="zip_unsupported", extra={"entry": info.filename},
            )
        name = safe_name(info.filename, fallback=f"entry-{n}", keep_dirs=True)
        out.append(SourceFile(name=name, size=info.file_size, open=lambda info=info: _BoundedEntry(archive, info),
                              raw_name=None if name == info.filename else info.filename))
    return out


#: Compression methods Python's zipfile reads (others raise NotImplementedError on open).
_ZIP_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
#: What reading a damaged entry raises: bad CRC, broken deflate/bzip2/lzma streams, early EOF.
_ZIP_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, RuntimeError, NotImplementedError)


class _BoundedEntry:
    """Reads a zip entry but never more than its declared size (a lying header cannot bomb us).

    Raises:
        ImageRejected: ``corrupt`` when the entry's data is damaged (opening or reading it).
    """

    def __init__(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
        self._name = info.filename
        self._left = info.file_size
        try:
            self._f = archive.open(info)
        except _ZIP_READ_ERRORS as e:
            raise self._corrupt(e) from e

    def _corrupt(self, e: Exception):
        from workers.errors import ImageRejected, Reason

        return ImageRejected(Reason.CORRUPT, f"zip entry {self._name!r} cannot be read: {type(e).__name__}: {e}")

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        n = self._left if n < 0 else min(n, self._left)
        try:
            data = self._f.read(n)
        except _ZIP_READ_ERRORS as e:
            raise self._corrupt(e) from e
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()


def from_folder(folder: str | os.PathLike, *, roots: list[Path] | None) -> list[SourceFile]:
    """Regular files under ``folder`` (recursive, sorted) → in-place sources.

    Args:
        roots: allowed roots; ``None`` means any folder (the server's own command line).

    Raises:
        ApplicationError: ``folder_not_allowed`` (403) outside the roots, ``folder_missing`` (400).
    """
    base = Path(folder)
    try:
        resolved = base.resolve(strict=True)
    except (FileNotFoundError, RuntimeError) as e:
        raise ApplicationError(f"folder {str(folder)!r} does not exist", code="folder_missing") from e
    if not resolved.is_dir():
        raise ApplicationError(f"{str(folder)!r} is not a folder", code="folder_missing")
    if roots is not None and not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        raise ApplicationError(
            f"folder {str(folder)!r} is outside the configured ingest roots", code="folder_not_allowed", status=403
        )
    out = []
    for dirpath, dirnames, filenames in os.walk(resolved):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            real = p.resolve()
            if not (real == resolved or real.is_relative_to(resolved)) or not real.is_file():
                continue  # a symlink out of the folder, or not a regular file
            if name.startswith("."):
                continue
            out.append(SourceFile(name=str(p.relative_to(resolved)), size=real.stat().st_size,
                                  open=lambda real=real: real.open("rb"), in_place=real))
    return out


def iter_blocks(f: BinaryIO, block: int = 1 << 20) -> Iterator[bytes]:
    """Read ``f`` in blocks of ``block`` bytes."""
    return iter(lambda: f.read(block), b"")
