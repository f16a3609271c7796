"""Catalogue manifests read as a stream (issue 41): CSV (or TSV), JSON Lines or Parquet, one image
per row, each row checked on its own.

A row names its image by ``url`` (http or https) or by ``key`` (an object in an allowed bucket:
``s3://bucket/key``, or a key the job resolves against its own bucket), with an optional
``external_id`` (the caller's id) and any other fields as metadata. Reading never holds more
than a bounded part of the file: CSV and JSON Lines are read line by line from the binary stream
with a hard cap per line (``max_line_bytes``), Parquet a batch of ``parquet_batches.BATCH_ROWS`` rows at a
time (plus the row group pyarrow decodes them from).

A Parquet file's decoded size is not its file size: a dictionary page lets 285 bytes stand for a
thousand rows of 256 KiB each, compression lets 72 KB stand for 1 GiB of plain values. So every
size is bounded before it is materialised: the footer's row groups first (at most
:data:`MAX_ROW_GROUP_ROWS` rows and :data:`MAX_ROW_GROUP_BYTES` uncompressed bytes each, else
``manifest_row_group_too_large`` before any row); then one row group at a time, in batches of
about :data:`~parquet_batches.BATCH_BYTES`, with Arrow's freed memory given back after each group; every
dictionary-encoded string column is read as dictionary indices (``read_dictionary``: a value is
decoded once per dictionary, not once per row); each row's decoded size is computed from the Arrow
buffers (the dictionary's value lengths taken by index), and a row over ``max_line_bytes``, the
bound CSV and JSON Lines rows have, is a ``row_too_long`` error that is never turned into Python
objects. The rows that pass are turned into Python objects at most :data:`~parquet_batches.MAX_DECODED_BYTES` at a
time.

What is checked where:

- the whole manifest (its format, its header, a CSV header's encoding) raises
  :class:`ManifestError` before any row: ``manifest_format`` (415), ``manifest_header`` (400),
  ``manifest_encoding`` (400), ``manifest_row_group_too_large`` (413, Parquet; ``extra`` gives the
  row group and its first ``row``). :func:`check_header` runs these checks alone, for the web request
  to answer before it accepts the job;
- each row yields a ``ManifestRow`` or a ``RowError`` with a stable code: ``row_encoding``,
  ``row_too_long``, ``row_invalid`` from reading it here, then its own checks
  (``catalogue.manifest_rows``): ``url_invalid``, ``key_invalid``, ``source_missing_column``,
  ``external_id_invalid``, ``metadata_invalid``, ``metadata_too_large``, ``metadata_too_deep``; a
  bad row never stops the rows after it. ``manifest_too_many_rows`` is the one error after the
  last row read, when the manifest has more than ``max_rows`` rows.

CSV cells are text: a declared field (``types``) is read by its type, an undeclared one that is
written as a JSON number or ``true``/``false`` becomes that (``manifest_rows.infer``), anything else
stays text.

Not checked here: an ``external_id`` repeated inside one manifest (the job service checks each
slice of rows against the database, so no set of every id is held in memory); whether a URL's
host resolves to an address the fetcher may reach (the fetcher checks every hop); whether a
``key``'s bucket is allowed (``objects.Allowed``, with the job's configuration).
"""
from __future__ import annotations

import codecs
import csv
import json
from collections.abc import Iterator, Mapping
from pathlib import PurePosixPath
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from embeddings.errors import ApplicationError
from embeddings.services.catalogue import parquet_batches
from embeddings.services.catalogue.manifest_rows import (
    METADATA_FIELD,
    SOURCE_FIELDS,
    ManifestRow,
    RowError,
    checked_rows,
)
from embeddings.services.catalogue.metadata import KEY, RESERVED_KEYS, check_types

#: Longest line (a CSV record, a JSON line), line break included: 1 MiB, far above any real row
#: (a URL, an id and 4 KiB of metadata) and small enough to hold one in memory.
MAX_LINE_BYTES = 1 << 20
#: Most rows in one Parquet row group: pyarrow's default row group size, so a file any pandas or
#: pyarrow writer makes with its defaults passes.
MAX_ROW_GROUP_ROWS = 1 << 20
#: Most uncompressed bytes in one Parquet row group (the footer's ``total_uncompressed_size`` of its
#: column chunks): Arrow decompresses a data page whole and a writer may put a column chunk in one
#: page, so this bounds what reading one group can take in memory (about twice this at the most,
#: given back after the group). Spark's and parquet-mr's default row group size; about 600,000
#: rows of a URL, an id and a few metadata fields.
MAX_ROW_GROUP_BYTES = 128 << 20
#: Bytes read per call while skipping the rest of an over-long line.
_SKIP_BYTES = 1 << 16
_BOM = codecs.BOM_UTF8
_FORMATS = ("csv", "jsonl", "parquet")
_STATUS = {"manifest_format": 415, "manifest_row_group_too_large": 413}


class ManifestError(ApplicationError, ValueError):
    """The whole manifest refused before any row: a stable ``code`` (``manifest_format``,
    ``manifest_header``, ``manifest_encoding``, ``manifest_row_group_too_large``), a ``message``
    saying what to fix and, where it is about some rows, ``extra["row"]``: the first of them."""

    def __init__(self, code: str, message: str, *, extra: dict | None = None) -> None:
        super().__init__(message, code=code, status=_STATUS.get(code, 400), extra=extra)


def sniff_format(name: str, head: bytes) -> str:
    """The manifest's format from its file name and first bytes.

    Parquet by its ``PAR1`` magic whatever the name; else by extension (``.csv``, ``.tsv`` →
    ``"csv"``; ``.jsonl``, ``.ndjson`` → ``"jsonl"``); else by content: a first non-blank byte
    ``{`` is JSON Lines, a first line of UTF-8 text without NUL bytes is CSV.

    Args:
        name: the uploaded file's name or the object's key (may be empty).
        head: the file's first bytes (a few KiB are plenty).

    Returns:
        ``"csv"``, ``"jsonl"`` or ``"parquet"``.

    Raises:
        ManifestError: ``manifest_format`` when none of these fits (a ``.parquet`` name without the
            magic, gzip, images, empty content with no telling name).
    """
    if head[:4] == b"PAR1":
        return "parquet"
    suffix = PurePosixPath((name or "").replace("\\", "/")).suffix.lower()
    if suffix in (".csv", ".tsv"):
        return "csv"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".parquet":
        raise ManifestError("manifest_format", f"{name!r} does not start with Parquet's PAR1 magic")
    text = head.removeprefix(_BOM).lstrip(b" \t\r\n")
    if text[:1] == b"{":
        return "jsonl"
    first = text.split(b"\n", 1)[0]
    if first and b"\x00" not in first:
        try:  # final=False: the head may end inside a multi-byte character
            codecs.getincrementaldecoder("utf-8")().decode(first, final=False)
            return "csv"
        except UnicodeDecodeError:
            pass
    raise ManifestError("manifest_format", "not a CSV, JSON Lines or Parquet manifest")


def check_header(f: BinaryIO, fmt: str, *, types: Mapping[str, str] | None = None,
                 max_line_bytes: int = MAX_LINE_BYTES) -> list[str]:
    """Run the whole-manifest checks of :func:`read_manifest` alone, reading only the header (CSV:
    its first record; JSON Lines: its first line; Parquet: its footer), then put the stream back
    where it was (``f`` must be seekable).

    Returns:
        The column names: the CSV header, the Parquet schema's names; ``[]`` for JSON Lines, which
        has no header.

    Raises:
        ManifestError: ``manifest_format``, ``manifest_header`` or ``manifest_encoding``.
        MetadataError: ``metadata_invalid`` for ``types`` naming an unknown type or a bad field.
    """
    position = f.tell()
    try:
        check_types(types)
        return _open(f, fmt, max_line_bytes)[1]
    finally:
        f.seek(position)


def read_manifest(f: BinaryIO, fmt: str, *, types: Mapping[str, str] | None = None,
                  max_line_bytes: int = MAX_LINE_BYTES, max_rows: int | None = None,
                  max_metadata_bytes: int = 4096, resume: dict | None = None) -> "ManifestReader":
    """The manifest's rows, one at a time, each a :class:`ManifestRow` or a :class:`RowError`.

    The header is read and checked when this is called (so whole-manifest errors raise here,
    before any row); the rows are read as the iterator is consumed.

    Rows are numbered from 1 over the data: the CSV header is not a row, so data row ``n`` is
    line ``n + 1`` of a CSV file without multi-line cells (row ``n + 1`` in a spreadsheet), and line
    ``n`` of a JSON Lines file. Blank lines keep their number and yield nothing.

    Formats:
        - CSV: UTF-8 (a BOM is accepted), comma-separated, or tab-separated when the header holds
          tabs and no comma; RFC 4180 quoting, a quoted cell may span lines (the record's bytes
          count against ``max_line_bytes`` together). Column names are case-sensitive: ``url``,
          ``key``, ``external_id``, and every other column is a metadata field whose name must be
          a metadata key. Empty (or all-blank) cells are absent; cells of fields in ``types`` are
          converted by ``metadata.coerce``, others stay strings.
        - JSON Lines: one object per line; ``url``, ``key``, ``external_id`` at the top level;
          metadata as an object under ``"metadata"`` and/or as the other top-level keys, merged,
          the ``"metadata"`` object winning where both give a key.
        - Parquet: native types; dates, times and timestamps become ISO-8601 strings, decimals
          floats; a ``metadata`` struct column merges as in JSON Lines. A row whose values decode
          to more than ``max_line_bytes`` (UTF-8 bytes of its strings, 8 per other value) is a
          ``row_too_long`` error, found before its values are decoded.

        In every format a string value of a field declared in ``types`` is converted by
        ``metadata.coerce`` (``{"price": "float"}`` reads ``"12.50"`` as ``12.5``).

    Args:
        f: a binary stream with ``readline(size)`` (a file, ``BytesIO``, an uploaded file);
            Parquet also needs ``seek``.
        fmt: ``"csv"``, ``"jsonl"`` or ``"parquet"`` (:func:`sniff_format`).
        types: declared metadata field types, ``{field: kind}`` (``metadata.KINDS``).
        max_line_bytes: longest line or CSV record, line break included; a longer one is one
            ``row_too_long`` error and the reader goes on after its next line break without
            buffering it.
        max_rows: most data rows read (``MANIFEST_MAX_ROWS``); when the manifest has more, one
            ``RowError(max_rows + 1, "manifest_too_many_rows", ...)`` ends the iteration.
        max_metadata_bytes: a row's metadata bound (``METADATA_MAX_BYTES``).
        resume: a :attr:`ManifestReader.position` of an earlier read of this file: go on after it
            (the header is read and checked again; the rows before it are not parsed).

    Raises:
        ManifestError: ``manifest_format`` (unknown ``fmt``, an unreadable Parquet file, also when
            a Parquet data page turns out unreadable during iteration), ``manifest_row_group_too_large``
            (a Parquet row group over :data:`MAX_ROW_GROUP_ROWS` or :data:`MAX_ROW_GROUP_BYTES`), ``manifest_header`` (an
            empty file; a CSV header without a ``url`` or ``key`` column, with duplicate, empty or
            invalid column names; a Parquet schema with those faults or binary columns),
            ``manifest_encoding`` (a CSV header that is not UTF-8). A JSON line that is not an
            object, the first one included, is a row error, not a header error.
        MetadataError: ``metadata_invalid`` for bad ``types``.

    Not detected: an ``external_id`` repeated inside the manifest; the job service checks ids
    against the database a slice of rows at a time, so memory stays bounded.
    """
    types = check_types(types)
    source, _ = _open(f, fmt, max_line_bytes)
    cursor = _Cursor(fmt, source)
    if resume:
        cursor.resume(resume)
    return ManifestReader(checked_rows(_ROWS[fmt](source, cursor), types, max_rows, max_metadata_bytes,
                                       nested=fmt != "csv"), cursor)


class _Cursor:
    """Where a reader is: the data rows consumed and, for line formats, the byte offset after them."""

    def __init__(self, fmt: str, source: Any) -> None:
        self.fmt, self.source, self.row, self.skip = fmt, source, 0, 0

    @property
    def lines(self) -> _Lines | None:
        return self.source[0] if self.fmt == "csv" else self.source if self.fmt == "jsonl" else None

    def position(self) -> dict:
        lines = self.lines
        return {"row": self.row} if lines is None else {"row": self.row, "offset": lines.offset}

    def resume(self, position: dict) -> None:
        self.row = int(position["row"])
        lines = self.lines
        if lines is not None:
            lines.seek(int(position["offset"]))
        else:
            self.skip = self.row  # Parquet: whole row groups and batches before it are passed over


class ManifestReader:
    """The rows of a manifest (an iterator of :class:`ManifestRow` / :class:`RowError`) and where
    the reading is: :attr:`position`, valid between two rows, resumes a later read of the same file
    exactly there (``read_manifest(..., resume=position)``) without parsing the rows before it."""

    def __init__(self, rows: Iterator[ManifestRow | RowError], cursor: _Cursor) -> None:
        self._rows, self._cursor = rows, cursor

    def __iter__(self) -> "ManifestReader":
        return self

    def __next__(self) -> ManifestRow | RowError:
        return next(self._rows)

    @property
    def position(self) -> dict:
        """``{"row": data rows consumed, "offset": byte offset after them}`` (CSV, JSON Lines) or
        ``{"row": ...}`` (Parquet): JSON, kept with the job."""
        return self._cursor.position()


# --- reading lines ------------------------------------------------------------------------------


class _LineProblem(Exception):
    """A line that cannot be a row: ``code`` is ``row_encoding`` or ``row_too_long``."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class _Lines:
    """Decoded lines of a binary stream, each at most ``cap`` bytes: an iterator for ``csv.reader``.

    ``record_bytes`` counts the bytes of the record being read (a CSV record may span lines); the
    reader sets it to 0 before each record. A line over the cap raises ``_LineProblem`` after the
    stream has been moved past its line break, reading at most ``_SKIP_BYTES`` at a time; a line
    that is not UTF-8 raises it after being consumed. The iterator stays usable after either.
    """

    def __init__(self, f: BinaryIO, cap: int) -> None:
        self.f = f
        self.cap = cap
        self.record_bytes = 0
        self.first = True
        self.pushed: str | _LineProblem | None = None
        #: bytes of the stream consumed so far (a pushed-back line included): where the next line starts
        self.offset = f.tell() if hasattr(f, "tell") else 0

    def seek(self, offset: int) -> None:
        """Go on reading at byte ``offset`` (the start of a line: an :class:`ManifestReader`
        position), forgetting any pushed-back line."""
        self.f.seek(offset)
        self.offset, self.first, self.pushed = offset, False, None

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        if self.pushed is not None:
            item, self.pushed = self.pushed, None
            if isinstance(item, _LineProblem):
                raise item
            return item
        budget = self.cap - self.record_bytes
        raw = self.f.readline(budget + 1)
        if not raw:
            raise StopIteration
        self.offset += len(raw)
        if self.first:
            self.first = False
            raw = raw.removeprefix(_BOM)
        if len(raw) > budget:
            if not raw.endswith(b"\n"):
                while chunk := self.f.readline(_SKIP_BYTES):
                    self.offset += len(chunk)
                    if chunk.endswith(b"\n"):
                        break
            raise _LineProblem("row_too_long", f"longer than {self.cap} bytes")
        self.record_bytes += len(raw)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _LineProblem("row_encoding", f"byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8 "
                                               "(save the manifest as UTF-8)") from None

    def pull(self) -> str | _LineProblem | None:
        """The next line, or the problem with it, or ``None`` at the end (for header checks)."""
        self.record_bytes = 0
        try:
            return next(self)
        except StopIteration:
            return None
        except _LineProblem as problem:
            return problem


# --- opening each format: the whole-manifest checks ----------------------------------------------


def _open(f: BinaryIO, fmt: str, cap: int) -> tuple[Any, list[str]]:
    """``(what the format's row reader needs, the column names)``, after the whole-manifest checks."""
    if fmt == "csv":
        return _open_csv(f, cap)
    if fmt == "jsonl":
        return _open_jsonl(f, cap)
    if fmt == "parquet":
        return _open_parquet(f, cap)
    raise ManifestError("manifest_format", f"format {fmt!r} is not one of {', '.join(_FORMATS)}")


def _open_csv(f: BinaryIO, cap: int) -> tuple[Any, list[str]]:
    lines = _Lines(f, cap)
    first = lines.pull()
    if first is None:
        raise ManifestError("manifest_header", "the manifest is empty")
    if isinstance(first, _LineProblem):
        if first.code == "row_encoding":
            raise ManifestError("manifest_encoding", f"the CSV header is not UTF-8: {first.detail}")
        raise ManifestError("manifest_header", f"the CSV header is {first.detail}")
    if not first.strip():
        raise ManifestError("manifest_header", "the CSV header (the first line) is blank")
    delimiter = "\t" if "\t" in first and "," not in first else ","
    lines.pushed = first  # read again by the csv reader; its bytes already count against the cap
    reader = csv.reader(lines, delimiter=delimiter, strict=True)
    try:
        header = next(reader)
    except _LineProblem as problem:  # a quoted header cell that runs on into bad lines
        raise ManifestError("manifest_header", f"the CSV header is not readable: {problem.detail}") from None
    except csv.Error as e:
        raise ManifestError("manifest_header", f"the CSV header is not valid CSV: {e}") from None
    columns = [c.strip() for c in header]
    _check_columns(columns, "CSV header")
    return (lines, reader, columns), columns


def _open_jsonl(f: BinaryIO, cap: int) -> tuple[Any, list[str]]:
    lines = _Lines(f, cap)
    first = lines.pull()
    if first is None:
        raise ManifestError("manifest_header", "the manifest is empty")
    lines.pushed = first  # whatever it holds, it is row 1's business
    return lines, []


def _open_parquet(f: BinaryIO, cap: int) -> tuple[Any, list[str]]:

    position = f.tell()
    empty = not f.read(1)
    f.seek(position)
    if empty:
        raise ManifestError("manifest_header", "the manifest is empty")
    try:
        parquet = pq.ParquetFile(f)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ManifestError("manifest_format", f"not a readable Parquet file: {e}") from e
    schema = parquet.schema_arrow
    _check_columns(schema.names, "Parquet schema")
    for field in schema:
        kind = field.type
        if pa.types.is_dictionary(kind):  # a categorical column (pandas, pyarrow) is read as its values
            kind = kind.value_type
        if field.name in ("url", "key") and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                                                 or pa.types.is_null(kind)):
            raise ManifestError("manifest_header", f"Parquet column {field.name!r} is {kind}, not a string")
        if field.name == METADATA_FIELD and not (pa.types.is_struct(kind) or pa.types.is_null(kind)):
            raise ManifestError("manifest_header", f"Parquet column 'metadata' is {kind}, not a struct")
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
            raise ManifestError("manifest_header", f"Parquet column {field.name!r} holds bytes; metadata is JSON")
    _check_row_groups(parquet.metadata)
    # every dictionary-encoded string column (nested ones included) read as dictionary indices: a
    # value is then decoded once, not once per row that points at it (see _parquet_rows). A plain
    # one is read as it is: its decoded size is its pages' size, and reading it as a dictionary
    # would make Arrow hash every value into a dictionary that grows with the row group.
    meta = parquet.metadata
    strings = [parquet.schema.column(i).path for i in range(len(parquet.schema))
               if parquet.schema.column(i).physical_type == "BYTE_ARRAY"
               and any(meta.row_group(g).column(i).has_dictionary_page for g in range(meta.num_row_groups))]
    if strings:
        f.seek(position)
        try:
            parquet = pq.ParquetFile(f, metadata=parquet.metadata, read_dictionary=strings)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise ManifestError("manifest_format", f"not a readable Parquet file: {e}") from e
    return (parquet, cap), list(schema.names)


def _check_row_groups(metadata) -> None:
    """Refuse a row group over :data:`MAX_ROW_GROUP_ROWS` rows or :data:`MAX_ROW_GROUP_BYTES`
    uncompressed bytes, from the footer alone (``manifest_row_group_too_large``, 413, with the
    group's first row)."""
    first = 1
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        size = sum(group.column(c).total_uncompressed_size for c in range(group.num_columns))
        where = {"row_group": g, "row": first}
        if group.num_rows > MAX_ROW_GROUP_ROWS:
            raise ManifestError("manifest_row_group_too_large",
                                f"Parquet row group {g} (from row {first}) has {group.num_rows} rows; at most "
                                f"{MAX_ROW_GROUP_ROWS} (write it with a smaller row_group_size)", extra=where)
        if size > MAX_ROW_GROUP_BYTES:
            raise ManifestError("manifest_row_group_too_large",
                                f"Parquet row group {g} (from row {first}) holds {size} bytes uncompressed; at "
                                f"most {MAX_ROW_GROUP_BYTES} (write it with a smaller row_group_size)", extra=where)
        first += group.num_rows


def _check_columns(columns: list[str], where: str) -> None:
    seen = set()
    for i, name in enumerate(columns, 1):
        if not name:
            raise ManifestError("manifest_header", f"{where}: column {i} has no name")
        if name in seen:
            raise ManifestError("manifest_header", f"{where}: column {name!r} appears twice")
        seen.add(name)
        if name in SOURCE_FIELDS:
            continue
        if not KEY.match(name) or name in RESERVED_KEYS:
            raise ManifestError("manifest_header", f"{where}: column {name[:80]!r} is not a metadata field name "
                                                   "(letters, digits and _, not starting with a digit, at most 64)")
    if "url" not in seen and "key" not in seen:
        raise ManifestError("manifest_header", f"{where} has neither a 'url' nor a 'key' column")


# --- raw rows per format: (row, fields) or (row, RowError) ----------------------------------------


def _csv_rows(source, cursor: _Cursor) -> Iterator[tuple[int, dict | RowError | None]]:
    lines, reader, columns = source
    width = len(columns)
    while True:
        row = cursor.row
        lines.record_bytes = 0
        try:
            cells = next(reader)
        except StopIteration:
            return
        except _LineProblem as problem:
            row = cursor.row = row + 1
            yield row, RowError(row, problem.code, problem.detail, None)
            continue
        except csv.Error as e:
            row = cursor.row = row + 1
            yield row, RowError(row, "row_invalid", f"not valid CSV: {e}", None)
            continue
        row = cursor.row = row + 1
        if len(cells) == width:
            fields = {name: cell for name, cell in zip(columns, cells) if cell.strip()}
            yield row, fields or None  # no cell with text: a blank line
        elif not any(c.strip() for c in cells):
            yield row, None
        else:
            yield row, RowError(row, "row_invalid", f"{len(cells)} cells; the header has {width} columns", None)


def _jsonl_rows(lines: _Lines, cursor: _Cursor) -> Iterator[tuple[int, dict | RowError | None]]:
    while True:
        row = cursor.row
        lines.record_bytes = 0
        try:
            text = next(lines)
        except StopIteration:
            return
        except _LineProblem as problem:
            row = cursor.row = row + 1
            yield row, RowError(row, problem.code, problem.detail, None)
            continue
        row = cursor.row = row + 1
        if not text.strip():
            yield row, None
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
            yield row, RowError(row, "row_invalid", f"not valid JSON: {str(e)[:200]}", None)
            continue
        if not isinstance(obj, dict):
            yield row, RowError(row, "row_invalid", f"a JSON line must be an object, not {type(obj).__name__}", None)
            continue
        yield row, obj


def _parquet_rows(source, cursor: _Cursor) -> Iterator[tuple[int, dict | RowError | None]]:
    """Each row's decoded size is computed from the batch's Arrow buffers (string columns hold
    dictionary indices) before any value becomes a Python object: a row over ``cap`` is a
    ``row_too_long`` error and is never decoded; the others are decoded at most
    :data:`~parquet_batches.MAX_DECODED_BYTES` at a time."""
    parquet, cap = source
    # Python's datetime and time stop at microseconds: nanosecond columns are truncated to them
    # (pyarrow refuses to convert nanoseconds it would lose without pandas).
    schema = parquet.schema_arrow
    micro = pa.schema([parquet_batches.microseconds(field) for field in schema])
    # a resumed read starts at the row group holding its next row, and passes over whole batches
    skip, first_group = cursor.skip, 0
    while first_group < parquet.num_row_groups and skip >= parquet.metadata.row_group(first_group).num_rows:
        skip -= parquet.metadata.row_group(first_group).num_rows
        first_group += 1
    batches = parquet_batches.batches(parquet, first_group)
    while True:
        row = cursor.row
        try:
            batch = next(batches)
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            if skip:
                batch, skip = batch.slice(skip), 0
            if micro != schema:
                batch = batch.cast(micro, safe=False)
            sizes = parquet_batches.row_sizes(batch)
        except StopIteration:
            return
        except (pa.ArrowException, OSError, ValueError) as e:
            raise ManifestError("manifest_format", f"Parquet data after row {row} is not readable: {e}",
                                extra={"row": row + 1}) from e
        for start, stop, too_long in parquet_batches.runs(sizes, cap):
            if too_long:
                row = cursor.row = row + 1
                yield row, RowError(row, "row_too_long", f"decodes to {int(sizes[start])} bytes; at most {cap}",
                                    None)
                continue
            try:
                records = parquet_batches.decode(batch, start, stop)
            except (pa.ArrowException, ValueError) as e:
                raise ManifestError("manifest_format", f"Parquet data after row {row} is not readable: {e}",
                                    extra={"row": row + 1}) from e
            for record in records:
                row = cursor.row = row + 1
                fields = {name: parquet_batches.native(value) for name, value in record.items() if value is not None}
                # a row of nulls is a blank line (as a CSV row of empty cells): it keeps its number
                # and makes nothing, so a few KB declaring a million null rows make no million rows
                yield row, fields or None


_ROWS = {"csv": _csv_rows, "jsonl": _jsonl_rows, "parquet": _parquet_rows}
