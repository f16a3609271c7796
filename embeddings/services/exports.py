"""Exports of stored vectors: a job's, or all of a caller's (staff: everyone's), as Parquet, JSON
Lines or a NumPy ``.npz``, written a page at a time so memory stays bounded whatever the row count.

Rows are read in keyset order (by id, :data:`PAGE_ROWS` at a time) and each page's vectors come
from the store in one call (``services.vectors.point_vectors``). Which rows, and what a long export
sees of concurrent changes, is :func:`export_start`'s docstring (docs/exports.md says it for users).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import tempfile
import zipfile
from typing import Iterable, Iterator

import numpy as np
from django.db.models import QuerySet
from django.utils import timezone

from embeddings import spaces
from embeddings.errors import ApplicationError
from embeddings.messages import encode_vector
from embeddings.models import EmbeddingSpace, Image, SpaceState
from embeddings.selectors import images_visible_to, jobs_visible_to
from embeddings.services.vectors import holding_vectors, point_vectors, points_in_space

#: Rows per page: one database query and one store call each (1,000 × 512 float32 = 2 MiB of
#: vectors in a task result, well inside a Redis reply), and one Parquet row group each.
PAGE_ROWS = 1000

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


@dataclasses.dataclass
class Page:
    """One page of exported rows, all holding a vector: ``ids`` (UUID strings), ``external_ids``
    (None when the row has none), ``sha256s``, ``metadata`` (dicts), ``vectors`` ``(n, D) float32``."""

    ids: list[str]
    external_ids: list[str | None]
    sha256s: list[str]
    metadata: list[dict]
    vectors: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass
class VectorExport:
    """What :func:`export_start` chose: the ``space``, the ``rows`` (not yet restricted to those
    with a vector in it), the moment it began (``as_of``) and the job filter (``job_id``)."""

    space: EmbeddingSpace
    rows: QuerySet[Image]
    as_of: dt.datetime
    job_id: str | None = None
    page_rows: int = PAGE_ROWS

    def space_info(self) -> dict:
        """The space the vectors are in, written into every export: ``model_id``, ``model_name``,
        ``pretrained``, ``seed``, ``precision``, ``dim``, ``dtype`` (float32), ``distance`` (cosine),
        ``normalized`` (unit length: Qdrant stores cosine vectors normalised), ``preprocess`` (the
        architecture's open_clip preprocessing: ``workers.model_config.preprocess_config``),
        ``collection``, ``state``, ``as_of`` (ISO 8601) and ``job_id`` (None: all rows)."""
        from workers.model_config import preprocess_config

        sp = self.space
        try:
            preprocess = preprocess_config(sp.model_name)
        except ValueError:  # an architecture this installation's open_clip does not know
            preprocess = None
        return {"model_id": sp.model_id, "model_name": sp.model_name, "pretrained": sp.pretrained, "seed": sp.seed,
                "precision": sp.precision, "dim": sp.dim, "dtype": "float32", "distance": "cosine",
                "normalized": True, "preprocess": preprocess, "collection": sp.collection, "state": sp.state,
                "as_of": self.as_of.isoformat(), "job_id": self.job_id}

    def pages(self) -> Iterator[Page]:
        """The rows with a vector in the space, :attr:`page_rows` at a time in id order, each page
        with its vectors (one query and one store call per page).

        Raises:
            ApplicationError: the store is unavailable (503, ``services.vectors.point_vectors``).
        """
        model_id = self.space.model_id
        rows = holding_vectors(self.rows).order_by("id")
        after = None
        while True:
            batch = list((rows if after is None else rows.filter(id__gt=after))
                         .values_list("id", "external_id", "sha256", "model_id", "metadata")[:self.page_rows])
            if not batch:
                return
            after = batch[-1][0]
            points = points_in_space(((str(r[0]), r[2], r[3]) for r in batch), model_id=model_id)
            vectors = point_vectors(list(points.values()), model_id=model_id)
            # a row whose point is not in the store (deleted meanwhile, or not written yet) is left
            # out: every row written carries its own bytes' vector, never a placeholder
            kept = [(r, vectors[points[str(r[0])]]) for r in batch if points.get(str(r[0])) in vectors]
            if kept:
                yield Page(ids=[str(r[0]) for r, _ in kept], external_ids=[r[1] or None for r, _ in kept],
                           sha256s=[r[2] for r, _ in kept], metadata=[r[4] or {} for r, _ in kept],
                           vectors=np.stack([v for _, v in kept]).astype(np.float32, copy=False))
            if len(batch) < self.page_rows:
                return


def export_start(*, user, job_id: str | None = None, model_id: str | None = None,
                 page_rows: int = PAGE_ROWS) -> VectorExport:
    """Choose what an export writes.

    Rows: the caller's images (staff: everyone's; never migration copies), of job ``job_id`` when
    given, ``embedded`` or ``skipped`` duplicates of an embedded original (their own id, external id
    and metadata, their original's vector), that have a vector in the space, created before the
    export began (``as_of``). Rows created after it are left out; a row deleted while the export
    runs is written if its page was read before the deletion, and left out after it (its page's
    store read then finds no point, or the database no row); a ``PATCH`` shows in the rows read after
    it. No row is ever written without its vector.

    Args:
        job_id: one of the caller's jobs (any job for staff).
        model_id: the space (default: the active one); any space that is not dropped.

    Raises:
        ApplicationError: ``not_found`` (404): no such job visible to the caller, or no such space
            (or a dropped one).
    """
    if job_id is not None and not jobs_visible_to(user).filter(id=job_id).exists():
        raise ApplicationError("no such job", code="not_found", status=404, extra={"job": job_id})
    if model_id is None:
        space = spaces.active()
    else:
        space = EmbeddingSpace.objects.exclude(state=SpaceState.DROPPED).filter(model_id=model_id).first()
        if space is None:
            raise ApplicationError(f"no embedding space {model_id!r}", code="not_found", status=404,
                                   extra={"space": model_id})
    as_of = timezone.now()
    rows = images_visible_to(user).filter(created_at__lte=as_of)
    if job_id is not None:
        rows = rows.filter(job_id=job_id)
    return VectorExport(space=space, rows=rows, as_of=as_of, job_id=job_id, page_rows=page_rows)


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
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("external_id", pa.string()), ("sha256", pa.string()),
                      ("model_id", pa.string()), ("metadata", pa.string()),
                      ("vector", pa.list_(pa.float32(), dim))],
                     metadata={SPACE_KEY: json.dumps(space_info)})


def _arrow_table(page: Page, schema, model_id: str, *, with_vectors: bool = True):
    import pyarrow as pa

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
    import pyarrow.parquet as pq

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
    import pyarrow as pa
    import pyarrow.parquet as pq

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
