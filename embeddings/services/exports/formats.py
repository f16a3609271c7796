"""The files of a vector export: Parquet, JSON Lines or a NumPy ``.npz``, written a page at a time
(pages from ``exports.rows``) so memory stays bounded whatever the row count, and streamed as they
are written (docs/exports.md).
"""
from __future__ import annotations

import io
import json
import tempfile
import zipfile
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embeddings.errors import ApplicationError
from embeddings.messages import encode_vector
from embeddings.services.exports.rows import Page, VectorExport

#: Export formats: ``{name: (media type, file name)}``.
FORMATS = {
    "parquet": ("application/vnd.apache.parquet", "vectors.parquet"),
    "jsonl": ("application/x-ndjson", "vectors.jsonl"),
    "npz": ("application/zip", "vectors.npz"),
}

#: How a vector is written in JSON (JSON Lines exports, ``include=vector``): ``float``, a list of
#: numbers (each the float32 value's shortest float64 form: read back as float32 it is the stored
#: value, bit for bit); ``base64``, the little-endian float32 bytes (a third the size).
VECTOR_FORMATS = ("float", "base64")

#: Parquet key-value metadata key (and ``space.json`` in an ``.npz``; HTTP header
#: ``Embedding-Space``) holding the space the vectors are in (:meth:`VectorExport.space_info`).
SPACE_KEY = "embedding_space"


# --- writers: each turns pages into the bytes of one file, a piece at a time ----------------------

class _Drain(io.RawIOBase):
    """A write-only, unseekable file whose written bytes are taken out as they come (:meth:`take`):
    the writers write into it and the response streams what it took."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = bytes(b)
        self._parts.append(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return False

    def seek(self, *args):
        raise io.UnsupportedOperation("seek")  # zipfile then writes data descriptors, never seeks back

    def take(self) -> bytes:
        """The bytes written since the last call."""
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def _arrow_schema(dim: int, space_info: dict):

    return pa.schema([("id", pa.string()), ("external_id", pa.string()), ("sha256", pa.string()),
                      ("model_id", pa.string()), ("metadata", pa.string()),
                      ("vector", pa.list_(pa.float32(), dim))],
                     metadata={SPACE_KEY: json.dumps(space_info)})


def _arrow_table(page: Page, schema, model_id: str, *, with_vectors: bool = True):

    columns = [pa.array(page.ids, pa.string()), pa.array(page.external_ids, pa.string()),
               pa.array(page.sha256s, pa.string()), pa.array([model_id] * len(page), pa.string()),
               pa.array([json.dumps(m, ensure_ascii=False) for m in page.metadata], pa.string())]
    if not with_vectors:
        return pa.Table.from_arrays(columns, schema=schema)
    dim = schema.field("vector").type.list_size
    flat = pa.array(np.ascontiguousarray(page.vectors, np.float32).reshape(-1), pa.float32())
    return pa.Table.from_arrays(columns + [pa.FixedSizeListArray.from_arrays(flat, dim)], schema=schema)


def write_parquet(export: VectorExport, pages: Iterable[Page]) -> Iterator[bytes]:
    """A Parquet file, one row group per page: columns ``id``, ``external_id`` (null: none),
    ``sha256``, ``model_id``, ``metadata`` (JSON text), ``vector`` (``fixed_size_list<float32>[D]``:
    the stored values, bit for bit); the space in the key-value metadata :data:`SPACE_KEY` (JSON)."""

    info = export.space_info()
    schema = _arrow_schema(export.space.dim, info)
    sink = _Drain()
    # vectors do not compress (random-looking float32): only the text columns are
    writer = pq.ParquetWriter(sink, schema, compression={"id": "zstd", "external_id": "zstd", "sha256": "zstd",
                                                         "model_id": "zstd", "metadata": "zstd", "vector": "none"},
                              use_dictionary=["model_id"])
    for page in pages:
        writer.write_table(_arrow_table(page, schema, export.space.model_id), row_group_size=len(page))
        yield sink.take()
    writer.close()
    yield sink.take()


def vector_json(v: np.ndarray, vector_format: str):
    """One vector as JSON: a list of numbers (``float``) or base64 of little-endian float32
    (``base64``) (:data:`VECTOR_FORMATS`)."""
    return encode_vector(v) if vector_format == "base64" else np.asarray(v, np.float32).tolist()


def write_jsonl(export: VectorExport, pages: Iterable[Page], *, vector_format: str = "float") -> Iterator[bytes]:
    """JSON Lines, one row per line, every line a row (no header line: the space travels in the
    ``Embedding-Space`` response header and each row's ``model_id``): ``{"id", "external_id"
    (null: none), "sha256", "model_id", "metadata" (an object), "vector"}`` (:func:`vector_json`)."""
    model_id = export.space.model_id
    for page in pages:
        yield "".join(json.dumps({"id": i, "external_id": e, "sha256": s, "model_id": model_id, "metadata": m,
                                  "vector": vector_json(v, vector_format)}, ensure_ascii=False) + "\n"
                      for i, e, s, m, v in zip(page.ids, page.external_ids, page.sha256s, page.metadata,
                                               page.vectors)).encode()


#: Bytes copied at a time from the spooled vectors into ``vectors.npy``.
_COPY_BYTES = 1 << 20


def write_npz(export: VectorExport, pages: Iterable[Page]) -> Iterator[bytes]:
    """A zip (stored, not compressed) that ``numpy.load`` opens as an ``.npz``: ``space.json`` (the
    space), ``ids.parquet`` (the Parquet export's columns without ``vector``, row ``i`` describing
    vector ``i``) and ``vectors.npy`` (``(n, D)`` little-endian float32, C order).

    ``ids.parquet`` is written while the pages are read; the vectors wait in a temporary file
    (n × D × 4 bytes of disk, not memory), since ``vectors.npy``'s header holds the row count, known
    only once every page was read; then it is streamed from there."""

    info = export.space_info()
    dim = export.space.dim
    out = _Drain()
    zf = zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
    zf.writestr("space.json", json.dumps(info, indent=1))
    yield out.take()
    schema = _arrow_schema(dim, info)
    ids_schema = pa.schema([f for f in schema if f.name != "vector"], metadata=schema.metadata)
    rows = 0
    with tempfile.TemporaryFile(prefix="vectors-", suffix=".f32") as spool:
        with zf.open("ids.parquet", "w", force_zip64=True) as entry:
            parquet = _Drain()
            writer = pq.ParquetWriter(parquet, ids_schema, compression="zstd", use_dictionary=["model_id"])
            for page in pages:
                writer.write_table(_arrow_table(page, ids_schema, export.space.model_id, with_vectors=False),
                                   row_group_size=len(page))
                spool.write(np.ascontiguousarray(page.vectors, "<f4").tobytes())
                rows += len(page)
                entry.write(parquet.take())
                yield out.take()
            writer.close()
            entry.write(parquet.take())
        yield out.take()
        spool.seek(0)
        with zf.open("vectors.npy", "w", force_zip64=True) as entry:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                          "shape": (rows, dim)})
            entry.write(header.getvalue())
            while block := spool.read(_COPY_BYTES):
                entry.write(block)
                yield out.take()
        zf.close()
        yield out.take()


def export_stream(export: VectorExport, fmt: str, *, vector_format: str = "float") -> Iterator[bytes]:
    """The bytes of ``export`` in format ``fmt`` (:data:`FORMATS`), a piece at a time. The first
    page is read (database and store) before this returns, so an unavailable store is raised here,
    before any byte is sent.

    Raises:
        ApplicationError: ``unsupported_export_format`` / ``invalid`` (400), or the store is
            unavailable (503, before the first byte).
    """
    if fmt not in FORMATS:
        raise ApplicationError(f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}",
                               code="unsupported_export_format", extra={"formats": list(FORMATS)})
    if vector_format not in VECTOR_FORMATS:
        raise ApplicationError(f"vector_format is one of {', '.join(VECTOR_FORMATS)}", code="invalid",
                               extra={"fields": {"vector_format": list(VECTOR_FORMATS)}})
    if vector_format != "float" and fmt != "jsonl":  # Parquet and .npz hold float32 itself
        raise ApplicationError(f"vector_format={vector_format} is for JSON Lines only; {fmt} holds float32",
                               code="invalid", extra={"fields": {"vector_format": ["float"]}})
    pages = export.pages()
    first = next(pages, None)  # the first store call, while an error can still be an error response
    pages = iter(()) if first is None else _chain(first, pages)
    if fmt == "parquet":
        return write_parquet(export, pages)
    if fmt == "jsonl":
        return write_jsonl(export, pages, vector_format=vector_format)
    return write_npz(export, pages)


def _chain(first: Page, rest: Iterator[Page]) -> Iterator[Page]:
    yield first
    yield from rest
