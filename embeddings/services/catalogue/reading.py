"""Catalogue jobs from where the catalogue lives (issue 41): a manifest (CSV, JSON Lines, Parquet),
uploaded or in a bucket, or an object-storage prefix.

The web request only checks what it can check at once (the format, the manifest's header, that the
bucket and prefix are allowed: ``SOURCE_BUCKETS``), keeps an uploaded manifest in the blob store,
and creates the job with ``reading`` set (:func:`job_create_from_manifest`,
:func:`job_create_from_prefix`). The fetch worker then reads the source as a stream
(:func:`job_read`): a slice of ``chunk_size`` rows at a time becomes image rows in one transaction
and one ``fetch_chunk`` message, so the first images are fetched and embedded while the rest of a
million-row manifest is still being read, and memory never holds more than a slice. A bad row is a
``failed`` row with its row number and reason code; it never fails the job. Reading records how
many rows it has consumed (``source["rows_read"]``), so a redelivered read continues where the
last one stopped instead of making rows twice.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import io
import itertools
import logging
import posixpath
import tempfile
import urllib.parse
from typing import BinaryIO, Iterable, Iterator

from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q

from embeddings import dispatch, runtime, spaces
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus, Job, JobPriority, JobStatus, Lane
from embeddings.objects import Allowed, ObjectError, list_prefix, parse_s3_uri
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.manifest_rows import ManifestRow, RowError
from embeddings.services.catalogue.manifests import (
    ManifestError,
    check_header,
    read_manifest,
    sniff_format,
)
from embeddings.services.catalogue.sources import safe_name
from embeddings.services.webhooks import endpoints as webhook_endpoints

log = logging.getLogger(__name__)

#: Rows of a job's first slice: its first chunk reaches the model alone and small, so the first
#: images are embedded seconds after the job starts (a 64-image chunk takes 7-15 s of CPU model
#: time on a 2-core machine: docs/benchmarks-ingest.md); every later slice is ``chunk_size``.
FIRST_SLICE_ROWS = 8

#: Seconds a read that is far enough ahead of the model waits before it looks again.
READ_AHEAD_WAIT_S = 2.0

#: Objects per listing page of a prefix job (S3's own maximum for ``ListObjectsV2``).
LIST_PAGE_SIZE = 1000

#: Bytes of a bucket manifest read by the web request to check its header (a CSV header or a JSON
#: line longer than this is refused there as ``manifest_header``).
_HEADER_BYTES = 1 << 20


def declared_types() -> dict[str, str]:
    """``{metadata field: type}`` of ``METADATA_INDEXES`` (``spaces.declared_fields``): how text
    manifests type those columns."""

    return spaces.declared_fields()


def allowed() -> Allowed:
    """The buckets and prefixes jobs may read (``SOURCE_BUCKETS``)."""
    return Allowed.parse(",".join(settings.SOURCE_BUCKETS))


def _refusal(e: ManifestError | ObjectError) -> ApplicationError:
    return ApplicationError(str(getattr(e, "message", e)), code=e.code, status=getattr(e, "status", 400),
                            extra=getattr(e, "extra", None))


def _job(*, owner, source: dict, name: str, priority: str, deadline: dt.datetime | None, callbacks: Iterable = (),
         key_prefix: str = "") -> Job:
    job = Job.objects.create(owner=owner, name=name[:200], priority=priority, deadline=deadline,
                             model_id=runtime.model_id(), chunk_size=settings.PIPELINE.batch_size, total=0,
                             source=source, reading=True, key_prefix=key_prefix)
    webhook_endpoints.job_endpoints_attach(job=job, endpoints=callbacks)  # its webhooks exist before its work is sent
    transaction.on_commit(lambda: dispatch.send_job_read(job_id=str(job.id), priority=priority))
    return job


def job_create_from_manifest(*, owner, upload=None, key: str | None = None, bucket: str | None = None,
                             name: str = "", priority: str = JobPriority.BACKGROUND,
                             deadline: dt.datetime | None = None, callbacks: Iterable = (),
                             key_prefix: str = "") -> Job:
    """A job whose images are the rows of a manifest: ``upload`` (a file of the request, kept in the
    blob store until read) or ``key`` (``s3://bucket/key`` of an allowed bucket).

    Args:
        bucket: the bucket (``s3://bucket[/prefix]``) that the manifest's bare ``key`` values name
            objects of; default: the manifest's own bucket (for ``key``), none for an upload.

    Raises:
        ApplicationError: ``manifest_format``, ``manifest_header``, ``manifest_encoding`` (400),
            ``source_uri_invalid`` (400), ``source_not_allowed`` (403), ``source_missing`` (400),
            ``source_forbidden`` (403: the credentials may not read it), ``source_unavailable`` (503,
            ``Retry-After``: the object storage cannot be reached or failed).
    """
    types = declared_types()
    blob = None
    try:
        if upload is not None:
            head = upload.read(64)
            upload.seek(0)
            fmt = sniff_format(upload.name or "", head)
            check_header(upload, fmt, types=types)
            if bucket:  # checked before the manifest is stored: a refused request leaves no blob
                allowed().check(*parse_s3_uri(bucket))
            blob, _, size = runtime.blob_store().put_file(upload)
            source = {"kind": "manifest", "format": fmt, "key": blob, "name": safe_name(upload.name, fallback="manifest"),
                      "bytes": size}
        else:
            b, k = parse_s3_uri(key)
            allowed().check(b, k)
            with _bucket_head(b, k) as f:
                fmt = sniff_format(k, f.read(64))
                f.seek(0)
                if fmt != "parquet":  # a Parquet file's schema is at its end: checked when read
                    check_header(f, fmt, types=types)
            source = {"kind": "manifest", "format": fmt, "key": f"s3://{b}/{k}", "name": posixpath.basename(k)}
            bucket = bucket or f"s3://{b}"
        if bucket:
            b, p = parse_s3_uri(bucket)
            allowed().check(b, p)
            source["bucket"] = b
    except (ManifestError, ObjectError) as e:
        raise _refusal(e) from e
    try:
        return _job(owner=owner, source=source, name=name or source["name"], priority=priority, deadline=deadline,
                    callbacks=callbacks, key_prefix=key_prefix)
    except BaseException:
        if blob is not None:  # no job will read it: the request leaves nothing behind
            _drop_manifest_blob(blob, None)
        raise


def job_create_from_prefix(*, owner, uri: str, extensions: Iterable[str] = (), name: str = "",
                           priority: str = JobPriority.BACKGROUND, deadline: dt.datetime | None = None,
                           callbacks: Iterable = (), key_prefix: str = "") -> Job:
    """A job whose images are the objects under ``uri`` (``s3://bucket/prefix``), optionally only
    those whose name ends in one of ``extensions`` (``.jpg``; case-insensitive). Listed by the fetch
    worker, page by page.

    Raises:
        ApplicationError: ``source_uri_invalid`` (400), ``source_not_allowed`` (403).

    ``callbacks`` (both): the job's own webhook endpoints, unsaved (``webhooks.endpoints.job_callbacks_prepare``).
    """
    try:
        b, p = parse_s3_uri(uri)
        allowed().check(b, p)
    except ObjectError as e:
        raise _refusal(e) from e
    exts = sorted({(e if e.startswith(".") else f".{e}").lower() for e in extensions if e})
    source = {"kind": "prefix", "uri": f"s3://{b}/{p}", "bucket": b, "prefix": p, "extensions": exts}
    return _job(owner=owner, source=source, name=name or source["uri"], priority=priority, deadline=deadline,
                callbacks=callbacks, key_prefix=key_prefix)


@contextlib.contextmanager
def _bucket_head(bucket: str, key: str) -> Iterator[BinaryIO]:
    """The first :data:`_HEADER_BYTES` of an object, as a seekable file."""


    try:
        body = runtime.source_client().get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{_HEADER_BYTES - 1}")["Body"]
        data = body.read()
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NoSuchBucket"):
            raise ObjectError("source_missing", f"s3://{bucket}/{key} does not exist") from e
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise ApplicationError(f"s3://{bucket}/{key} cannot be read with this deployment's credentials ({code})",
                                   code="source_forbidden", status=403) from e
        raise ApplicationError(f"object storage answered {code or 'an error'} for s3://{bucket}/{key}",
                               code="source_unavailable", status=503, headers={"Retry-After": "30"}) from e
    except BotoCoreError as e:  # the endpoint cannot be reached, a timeout, no credentials at all
        # botocore's words name the storage endpoint (an internal host name): the server's log only
        log.warning("object storage cannot be reached for s3://%s/%s: %s: %s", bucket, key, type(e).__name__, e)
        raise ApplicationError(f"object storage cannot be reached for s3://{bucket}/{key} ({type(e).__name__}; the "
                               f"server's log has the details)", code="source_unavailable", status=503,
                               headers={"Retry-After": "30"}) from e
    yield io.BytesIO(data)


@contextlib.contextmanager
def _manifest_file(source: dict) -> Iterator[BinaryIO]:
    """The job's manifest as a seekable binary file: the blob, or the bucket object spooled to a
    temporary file (read a block at a time; Parquet needs to seek to its footer)."""
    key = source["key"]
    if key.startswith("s3://"):
        bucket, _, name = key[len("s3://"):].partition("/")
        body = runtime.source_client().get_object(Bucket=bucket, Key=name)["Body"]
        with tempfile.TemporaryFile() as f:
            for block in iter(lambda: body.read(1 << 20), b""):
                f.write(block)
            f.seek(0)
            yield f
    else:
        store = runtime.blob_store()
        with store.storage.open(store._name(key), "rb") as f:
            yield f


class _PrefixRows:
    """The objects of a prefix job as rows (``key`` set; 1-based in listing order), a page at a
    time, from where an earlier read stopped (``source["resume"]``: the rows listed and the last
    key); objects over ``MAX_IMAGE_BYTES`` by their listed size are refused ``too_large`` here.
    :attr:`position` says where it is, as :class:`~.manifests.ManifestReader` does."""

    def __init__(self, source: dict) -> None:
        resume = source.get("resume") or {}
        self.row, self.after = int(resume.get("row", 0)), resume.get("after")
        self._rows = self._listing(source)

    def __iter__(self):
        return self

    def __next__(self) -> ManifestRow | RowError:
        return next(self._rows)

    @property
    def position(self) -> dict:
        return {"row": self.row, "after": self.after}

    def _listing(self, source: dict) -> Iterator[ManifestRow | RowError]:
        exts = set(source.get("extensions") or ()) or None
        for page in list_prefix(runtime.source_client(), source["bucket"], source["prefix"], extensions=exts,
                                page_size=LIST_PAGE_SIZE, start_after=self.after):
            for obj in page:
                self.row, self.after = self.row + 1, obj.key
                yield self._row(source, self.row, obj)

    @staticmethod
    def _row(source: dict, n: int, obj) -> ManifestRow | RowError:
        if obj.size > settings.PIPELINE.max_image_bytes:
            return RowError(row=n, code="too_large", external_id=None,
                            detail=f"s3://{source['bucket']}/{obj.key}: {obj.size} bytes > limit "
                                   f"{settings.PIPELINE.max_image_bytes} bytes")
        return ManifestRow(row=n, url=None, key=obj.key, external_id=None, metadata={})


def _origin(row: ManifestRow, source: dict) -> str:
    """The row's ``origin``: its URL, or ``s3://bucket/key`` (a bare key is in the job's bucket).

    Raises:
        ObjectError: ``source_not_allowed``, ``key_invalid`` (a bare key and no bucket).
    """
    if row.url:
        return row.url
    key = row.key
    if key.startswith("s3://"):
        bucket, key = parse_s3_uri(key)
    elif source.get("bucket"):
        bucket = source["bucket"]
    else:
        raise ObjectError("key_invalid", "a bare key needs a bucket: give the job's `bucket` (s3://bucket)")
    if source.get("kind") != "prefix":
        allowed().check(bucket, key)
    return f"s3://{bucket}/{key}"


def _display_name(origin: str, n: int) -> str:
    path = urllib.parse.urlsplit(origin).path if not origin.startswith("s3://") else origin.partition("/")[2]
    return safe_name(urllib.parse.unquote(path), fallback=f"row-{n}")


def _failed(job: Job, n: int, code: str, detail: str) -> Image:
    return Image(owner_id=job.owner_id, job=job, lane=Lane.BULK, status=ImageStatus.FAILED, reason=code[:32],
                 reason_detail=detail[:2000], sha256="", size_bytes=0, storage_key="", original_name=f"row {n}",
                 model_id=job.model_id, point_id=None, row=n, key_prefix=job.key_prefix)


def _slice_rows(job: Job, items: list[ManifestRow | RowError], *, claim_all: bool = False) -> list[Image]:
    """Image rows for one slice of a source, unsaved: unfetched ``queued`` rows, ``failed`` ones for
    bad rows. An ``external_id`` already met in this job is the row's error
    ``external_id_repeated``; one another of the owner's images holds is claimed (settled when the
    bytes are fetched: ``identity.claims_settle``); a free one is taken at once."""
    source = job.source
    wanted = {it.external_id for it in items if isinstance(it, ManifestRow) and it.external_id}
    in_job = set()
    held = set()
    if wanted:
        for ext, claim in Image.objects.filter(job=job).filter(
                Q(external_id__in=wanted) | Q(claimed_external_id__in=wanted)).values_list(
                "external_id", "claimed_external_id"):
            in_job |= {ext, claim} & wanted
        held = set(Image.objects.filter(owner_id=job.owner_id, source__isnull=True, external_id__in=wanted)
                   .values_list("external_id", flat=True))
    out, seen = [], set()
    for it in items:
        if isinstance(it, RowError):
            detail = it.detail + (f" (external_id {it.external_id!r})" if it.external_id else "")
            out.append(_failed(job, it.row, it.code, detail))
            continue
        ext = it.external_id
        if ext and (ext in seen or ext in in_job):
            out.append(_failed(job, it.row, "external_id_repeated",
                                f"external_id {ext!r} is given by an earlier row of this manifest"))
            continue
        try:
            origin = _origin(it, source)
        except ObjectError as e:
            out.append(_failed(job, it.row, e.code, str(getattr(e, "message", e))))
            continue
        if ext:
            seen.add(ext)
        claim = bool(ext) and (claim_all or ext in held)
        out.append(Image(owner_id=job.owner_id, job=job, lane=Lane.BULK, status=ImageStatus.QUEUED, sha256="",
                         size_bytes=0, storage_key="", origin=origin, original_name=_display_name(origin, it.row),
                         model_id=job.model_id, point_id=None, row=it.row, metadata=it.metadata or {},
                         external_id="" if claim or not ext else ext, claimed_external_id=ext if claim else "",
                         key_prefix=job.key_prefix))
    return out


def _store_slice(job: Job, items: list[ManifestRow | RowError], position: dict) -> list[str]:
    """Create one slice's rows and count them, in one transaction; its queued rows go to the fetch
    queue after commit. Returns their ids."""
    for claim_all in (False, True):  # a free id taken by another request meanwhile: claim instead
        images = _slice_rows(job, items, claim_all=claim_all)
        try:
            with transaction.atomic():
                Image.objects.bulk_create(images, batch_size=500)
                Job.objects.filter(id=job.id).update(total=F("total") + len(images))
                job.source = {**job.source, "rows_read": position["row"], "resume": position}
                Job.objects.filter(id=job.id).update(source=job.source)
                ids = [str(im.id) for im in images if im.status == ImageStatus.QUEUED]
                if ids:
                    transaction.on_commit(lambda ids=ids: dispatch.send_fetch_chunk(
                        job_id=str(job.id), image_ids=ids, priority=job.priority))
            return ids
        except IntegrityError:
            if claim_all:
                raise
    return []


def _rows(source: dict, f: BinaryIO | None):
    """The source's rows from where the last read stopped, with their ``position``."""
    if source["kind"] == "prefix":
        return _PrefixRows(source)
    return read_manifest(f, source["format"], types=declared_types(), max_rows=settings.MANIFEST_MAX_ROWS,
                         max_metadata_bytes=settings.METADATA_MAX_BYTES, resume=source.get("resume"))


def job_read(*, job_id: str) -> dict:
    """Read a job's manifest or prefix into rows, a slice of ``chunk_size`` at a time, sending each
    slice's rows to the fetch queue as it is committed; continue after the rows a previous read
    consumed. Stops early when the job is cancelled. A source that cannot be read as a whole (the
    object is gone, the file is not what its header promised) ends the reading with
    ``source["error"]`` (code and message) and the rows made so far.

    A read never runs more than ``FETCH_READ_AHEAD`` rows ahead of the model: while the job has
    that many images queued (made, fetched or not, not yet embedded) it stops, and reads on after
    :data:`READ_AHEAD_WAIT_S` (a ``job_read`` with a countdown). Reading and fetching a million rows
    at once would only take cores from the model (the fetch worker is as nice as the bulk worker)
    and hold bytes nobody will embed for hours; the bound keeps the model fed and no more.

    Returns:
        ``{"rows": rows made by this call, "rows_read": rows consumed in all}``, and ``"waiting":
        True`` when it stopped to let the model catch up.
    """
    job = Job.objects.filter(id=job_id).first()
    if job is None or not job.reading:
        return {"rows": 0, "rows_read": 0}
    source = dict(job.source)
    done = int(source.get("rows_read", 0))
    made = 0
    ahead = settings.FETCH_READ_AHEAD
    try:
        with (_manifest_file(source) if source["kind"] == "manifest" else contextlib.nullcontext()) as f:
            rows = _rows(source, f)  # from where an earlier read stopped: its rows are not read again
            while True:
                if ahead and _queued(job, ahead) >= ahead:
                    dispatch.send_job_read(job_id=str(job.id), priority=job.priority, countdown=READ_AHEAD_WAIT_S)
                    return {"rows": made, "rows_read": done, "waiting": True}
                size = min(FIRST_SLICE_ROWS, job.chunk_size) if done == 0 else job.chunk_size
                items = list(itertools.islice(rows, size))
                if not items:
                    break
                if Job.objects.filter(id=job.id, status=JobStatus.CANCELLED).exists():
                    break
                position = rows.position
                made += len(items)
                done = position["row"]
                _store_slice(job, items, position)
    except (ManifestError, ObjectError) as e:
        error = {"code": e.code, "message": str(getattr(e, "message", e))}
        if "row" in getattr(e, "extra", {}):  # where the reading stopped (a Parquet page, a row group)
            error["row"] = e.extra["row"]
        source = {**Job.objects.get(id=job.id).source, "error": error}
        Job.objects.filter(id=job.id).update(source=source)
        log.warning("job %s: its source cannot be read: %s", job_id, e)
    except Exception as e:
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "") if hasattr(e, "response") else ""
        if code not in ("NoSuchKey", "404", "NoSuchBucket", "AccessDenied"):
            raise  # systemic (database, network): the task is redelivered and continues after rows_read
        source = {**Job.objects.get(id=job.id).source, "error": {"code": "source_missing", "message": str(e)}}
        Job.objects.filter(id=job.id).update(source=source)
    Job.objects.filter(id=job.id).update(reading=False)
    if source.get("kind") == "manifest" and source["key"].startswith("blob/"):
        _drop_manifest_blob(source["key"], job.id)
    job_services.job_refresh(job_id=job.id)
    return {"rows": made, "rows_read": done}


def _queued(job: Job, limit: int) -> int:
    """The job's queued images, counted up to ``limit`` (a ``LIMIT`` subquery on the ``(job,
    status)`` index: the cost does not grow with the job)."""
    return Image.objects.filter(job=job, status=ImageStatus.QUEUED).values("id")[:limit].count()


def _drop_manifest_blob(key: str, job_id) -> None:
    """An uploaded manifest, once read (or when its job could not be made: ``job_id`` None), is not
    kept (no image row names it), unless another job still reads the same bytes."""
    if Job.objects.filter(reading=True, source__key=key).exclude(id=job_id).exists():
        return
    if Image.objects.filter(storage_key=key).exists():
        return
    runtime.blob_store().delete(key)
