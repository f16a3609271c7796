"""Upload sources turned into one shape, :class:`SourceFile`: uploaded files, zip entries, folders.

Zip archives are read entry by entry without extracting to disk by name; entries with absolute
paths or ``..`` are refused (zip slip), and before any entry is inflated the archive's layout is
checked (entries that overlap or leave the file: CVE-2024-0450's bomb, which Python's own zipfile
only refuses from 3.11.8 / 3.12.2) and the entry count and the bytes it would inflate to are
bounded, absolutely and by a ratio of the archive's own size (zip bombs). Folders are confined to
``settings.INGEST_ROOTS`` unless the caller is the server's own command line; symlinks that leave
the folder are refused.

Every uploaded file and every zip entry that is not a directory becomes one source, whatever its
name: the display name is :func:`safe_name` of the name sent, and a name with nothing usable left
(empty, ``.``, ``..``, ending in ``/``, only control characters) is replaced by a fallback that
says where the file was: ``upload-N`` (N-th part of the request body) or ``entry-N`` (N-th record
of the zip). ``SourceFile.raw_name`` keeps the name as sent when the display name differs.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import struct
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Callable, Iterator

from embeddings.errors import ApplicationError
from workers.errors import ImageRejected, Reason


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


def from_zip(upload, *, max_entries: int, max_uncompressed: int, max_ratio: float | None = None,
             max_entry_bytes: int | None = None) -> list[SourceFile]:
    """Entries of a zip archive (directories skipped) → sources, checked without inflating any.

    A directory is an entry whose name ends in ``/`` and that holds no bytes; an entry with bytes
    is a file whatever its name, named by :func:`safe_name` (directories kept) with the fallback
    ``entry-N`` (N: its 1-based position in the archive's central directory).

    Checked from the central directory and the entries' local headers only, in this order: the
    number of entries; the layout (:func:`_check_layout`: no entry overlaps another, none leaves
    the file); each entry's path, encryption and compression method; then the bytes the archive
    would inflate to. An entry declared larger than ``max_entry_bytes`` is never inflated: it
    becomes a source whose ``open`` raises ``too_large``, so it fails alone; the other entries'
    declared sizes must add up to at most ``max_uncompressed`` and, with ``max_ratio``, to at most
    ``max_ratio`` × the archive's size (but always allow ``max_entry_bytes``: one image's worth).

    Entries are read lazily, never more than their declared size, so a header that understates an
    entry's size cannot inflate more than it declares; one whose data turns out damaged (bad CRC,
    broken deflate stream) raises :class:`~workers.errors.ImageRejected` ``corrupt`` when read, so
    it fails alone.

    Args:
        upload: the archive, a seekable binary file.
        max_entries: ``ZIP_MAX_ENTRIES``.
        max_uncompressed: ``ZIP_MAX_UNCOMPRESSED_BYTES``.
        max_ratio: ``ZIP_MAX_RATIO``; None: no ratio bound.
        max_entry_bytes: ``MAX_IMAGE_BYTES``; None: no per-entry bound.

    Raises:
        ApplicationError: ``zip_invalid`` (400), ``zip_unsafe`` (400: entries that overlap or point
            outside the archive), ``zip_unsafe_path`` (400), ``zip_unsupported`` (400: an encrypted
            entry or an unknown compression method), ``zip_too_many_entries`` (413) or
            ``zip_too_large`` (413: ``extra.limit`` names the bound, ``ZIP_MAX_UNCOMPRESSED_BYTES``
            or ``ZIP_MAX_RATIO``).
    """
    try:
        archive = zipfile.ZipFile(upload)
        every = archive.infolist()
        infos = [(n, i) for n, i in enumerate(every, start=1) if not (i.is_dir() and i.file_size == 0)]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise ApplicationError(f"not a readable zip archive: {e}", code="zip_invalid") from e
    if len(infos) > max_entries:
        raise ApplicationError(
            f"zip has {len(infos)} entries; the limit is {max_entries}", code="zip_too_many_entries", status=413,
            extra={"limit": max_entries, "entries": len(infos)},
        )
    _check_layout(upload, list(enumerate(every, start=1)), archive.start_dir)
    for _, info in infos:
        _check_entry(info)
    oversized = {n for n, i in infos if max_entry_bytes is not None and i.file_size > max_entry_bytes}
    total = sum(i.file_size for n, i in infos if n not in oversized)
    upload.seek(0, os.SEEK_END)
    archive_bytes = upload.tell()
    bounds = [("ZIP_MAX_UNCOMPRESSED_BYTES", max_uncompressed)]
    if max_ratio is not None:
        bounds.append(("ZIP_MAX_RATIO", max(int(max_ratio * archive_bytes), max_entry_bytes or 0)))
    for name, limit in bounds:
        if total > limit:
            raise ApplicationError(
                f"zip expands to {total} bytes; the limit is {limit} ({name})", code="zip_too_large", status=413,
                extra={"limit": name, "value": limit, "uncompressed_bytes": total, "archive_bytes": archive_bytes},
            )
    out = []
    for n, info in infos:
        name = safe_name(info.filename, fallback=f"entry-{n}", keep_dirs=True)
        if n in oversized:
            opener = functools.partial(_refuse_too_large, info.filename, info.file_size, max_entry_bytes)
        else:
            opener = functools.partial(_BoundedEntry, archive, info)
        out.append(SourceFile(name=name, size=info.file_size, open=opener,
                              raw_name=None if name == info.filename else info.filename))
    return out


def _check_entry(info: zipfile.ZipInfo) -> None:
    """Refuse a zip entry whose path is absolute, climbs out (``..``) or names a drive
    (``zip_unsafe_path``, 400), or that is encrypted or compressed by a method not read here
    (``zip_unsupported``, 400): raises :class:`ApplicationError`, from its header alone."""
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


#: A local file header: signature, then 22 bytes of versions, flags, method, time, CRC and sizes,
#: then the name's and the extra field's lengths (APPNOTE.TXT 4.3.7); 30 bytes in all.
_LOCAL_HEADER = struct.Struct("<4s22xHH")


def _check_layout(f: BinaryIO, infos: list[tuple[int, zipfile.ZipInfo]], start_dir: int) -> None:
    """Refuse an archive whose entries overlap or leave the file, reading each local header.

    Each entry occupies ``[header_offset, header_offset + 30 + name + extra + compress_size)``,
    the name's and the extra field's lengths read from its local header. Those ranges must start
    with a local header's signature, end at or before the central directory (``start_dir``) and
    not overlap: 24 directory entries pointing at one 60 MiB deflate stream inflate 1.4 GiB from
    62 KB (CVE-2024-0450; CPython's fix bounds each entry by the next entry's offset, and fails
    when one is opened). Every entry is checked here, directories too, before any is inflated.

    Args:
        infos: ``(1-based position in the central directory, entry)`` of every entry.

    Raises:
        ApplicationError: ``zip_unsafe`` (400), ``extra.entries`` naming the one or two entries
            (``{"entry": position, "name": name}``).
    """
    spans = []
    for n, info in infos:
        head = b""
        if 0 <= info.header_offset < start_dir:
            f.seek(info.header_offset)
            head = f.read(_LOCAL_HEADER.size)
        if len(head) < _LOCAL_HEADER.size or head[:4] != zipfile.stringFileHeader:
            raise _unsafe(f"zip entry {n} ({info.filename!r}) has no local header where the directory says",
                          (n, info))
        name_len, extra_len = _LOCAL_HEADER.unpack(head)[1:]
        end = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len + info.compress_size
        if end > start_dir:
            raise _unsafe(f"zip entry {n} ({info.filename!r}) runs past the archive's data into its directory",
                          (n, info))
        spans.append((info.header_offset, end, (n, info)))
    spans.sort(key=lambda s: (s[0], s[1]))
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise _unsafe(f"zip entries {a[0]} ({a[1].filename!r}) and {b[0]} ({b[1].filename!r}) overlap: "
                          "a zip bomb (CVE-2024-0450)", a, b)


def _unsafe(message: str, *infos: tuple[int, zipfile.ZipInfo]) -> ApplicationError:
    return ApplicationError(message, code="zip_unsafe",
                            extra={"entries": [{"entry": n, "name": i.filename} for n, i in infos]})


def _refuse_too_large(name: str, size: int, limit: int):
    """``open`` of an entry declared over the per-image limit: refused ``too_large``, never inflated."""

    raise ImageRejected(Reason.TOO_LARGE, f"zip entry {name!r} declares {size} bytes > limit {limit} bytes; "
                                          "not inflated")


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
