"""Files of ``/v1/files`` (OpenAI's Files API, docs/batch-api.md): uploaded batch inputs and the
output and error files batches write, JSON Lines in the blob store, each visible to its owner only.

A file's bytes are a content-addressed blob (``storage.BlobStore.put``): the same bytes uploaded twice
are stored once, and a blob is deleted with the last file (and the last unfinished batch) naming it.
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Iterator

from django.conf import settings
from django.db import transaction

from embeddings import runtime
from embeddings.errors import ApplicationError
from embeddings.models import Batch, BatchFile, BatchPart, BatchStatus, FilePurpose, Image
from embeddings.services.batches.owned import owned_get, page_after
from embeddings.services.catalogue.sources import iter_blocks

#: Batch states whose input blob is still read.
UNFINISHED = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)
#: The most files one list answers (OpenAI's ``limit`` bound for files is 10,000; lists here are pages).
LIST_MAX = 10_000


#: A file's id as :func:`file_id_new` makes it; any other text names no file, and is never sent to the
#: database (a NUL or a lone surrogate there is an error of the driver's, not a missing row).
FILE_ID = re.compile(r"file-[0-9a-f]{32}")


def file_id_new() -> str:
    """``file-`` + 32 hex digits."""
    return f"file-{uuid.uuid4().hex}"


class _LineCounter:
    """Counts the non-blank lines of a stream of bytes as it passes, refusing it past a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines = 0
        self.open_line = False  # the current line has a character other than whitespace

    def count(self, blocks: Iterable[bytes]) -> Iterator[bytes]:
        """``blocks`` unchanged, counted.

        Raises:
            ApplicationError: ``too_many_lines`` (400) past ``limit``.
        """
        for block in blocks:
            for piece in block.split(b"\n")[:-1]:
                if self.open_line or piece.strip():
                    self._one()
                self.open_line = False
            tail = block.rsplit(b"\n", 1)[-1]
            self.open_line = self.open_line or bool(tail.strip())
            yield block
        if self.open_line:
            self._one()

    def _one(self) -> None:
        self.lines += 1
        if self.lines > self.limit:
            raise ApplicationError(f"more than BATCH_MAX_LINES ({self.limit}) lines in one batch input file",
                                   code="too_many_lines", extra={"param": "file", "limit": "BATCH_MAX_LINES",
                                                                 "value": self.limit})


def file_upload(*, owner, filename: str, size: int, stream, purpose: str) -> BatchFile:
    """Store an uploaded batch input file (JSON Lines) and its row.

    Only the size and the line count are checked here; the lines themselves are checked when a batch
    reads the file (``validation.batch_validate``), as OpenAI does.

    Args:
        size: its size in bytes as received; ``stream``: an open binary file of it.
        purpose: ``batch`` (the only purpose this service reads).

    Raises:
        ApplicationError: ``invalid_purpose`` (400, ``param`` purpose), ``file_too_large`` (413, over
            ``BATCH_MAX_FILE_BYTES``), ``too_many_lines`` (400, over ``BATCH_MAX_LINES``), ``empty_file``
            (400, no line).
    """
    if purpose != FilePurpose.BATCH:
        raise ApplicationError(f"purpose {str(purpose)[:40]!r}: this service takes files for purpose 'batch' only",
                               code="invalid_purpose", extra={"param": "purpose"})
    file_size_check(size)
    counter = _LineCounter(settings.BATCH_MAX_LINES)
    key, sha, stored = runtime.blob_store().put(counter.count(iter_blocks(stream)))
    if not counter.lines:
        blob_release(key)
        raise ApplicationError("the file has no line: a batch input is one JSON request per line",
                               code="empty_file", extra={"param": "file"})
    return BatchFile.objects.create(id=file_id_new(), owner=owner, purpose=FilePurpose.BATCH,
                                    filename=(filename or "upload.jsonl")[:255], bytes=stored, lines=counter.lines,
                                    storage_key=key, sha256=sha)


def file_size_check(size: int) -> None:
    """Raises ApplicationError ``file_too_large`` (413) when ``size`` exceeds ``BATCH_MAX_FILE_BYTES``."""
    limit = settings.BATCH_MAX_FILE_BYTES
    if size > limit:
        raise ApplicationError(f"the file has {size} bytes; at most BATCH_MAX_FILE_BYTES ({limit})",
                               code="file_too_large", status=413,
                               extra={"param": "file", "limit": "BATCH_MAX_FILE_BYTES", "value": limit})


def file_write(*, owner, filename: str, chunks: Iterable[bytes], lines: int) -> BatchFile:
    """Store a file a batch made (purpose ``batch_output``) from a stream of bytes (spooled, never
    whole in memory: ``BlobStore.put``)."""
    key, sha, size = runtime.blob_store().put(chunks)
    return BatchFile.objects.create(id=file_id_new(), owner=owner, purpose=FilePurpose.BATCH_OUTPUT,
                                    filename=filename[:255], bytes=size, lines=lines, storage_key=key, sha256=sha)


def file_get(*, owner, file_id: str) -> BatchFile:
    """The owner's file ``file_id``.

    Raises:
        ApplicationError: ``not_found`` (404): no such file, or another owner's.
    """
    return owned_get(BatchFile, FILE_ID, owner=owner, pk=file_id, noun="file", param="file_id")


def files_list(*, owner, purpose: str | None = None, after: str | None = None, limit: int = 20,
               order: str = "desc") -> tuple[list[BatchFile], bool]:
    """The owner's files by creation time (``order`` ``desc``: newest first), those after the file
    ``after`` (its id) only, at most ``limit``. Returns ``(files, has_more)``.

    Raises:
        ApplicationError: ``not_found`` (404, ``param`` after): ``after`` names no file of the owner.
    """
    rows = BatchFile.objects.filter(owner=owner)
    if purpose:
        rows = rows.filter(purpose=purpose)
    return page_after(rows, FILE_ID, owner=owner, after=after, limit=limit, noun="file", order=order)


def file_open(f: BatchFile):
    """The file's bytes as an open binary file (the caller closes it)."""
    return runtime.blob_store().open(f.storage_key)


def file_delete(*, file: BatchFile) -> None:
    """Delete a file's row; its blob goes after the commit when nothing else names it (:func:`file_deleted`)."""
    file.delete()


def blobs_release_on_commit(keys: Iterable[str]) -> None:
    """After the current transaction commits, release each blob of ``keys`` (:func:`blob_release`):
    a row deleted in a transaction that is rolled back keeps its blob."""
    keys = sorted({k for k in keys if k})
    if keys:
        transaction.on_commit(lambda: [blob_release(k) for k in keys])


def row_deleted(row: BatchFile | Batch | BatchPart) -> None:
    """A file's, batch's or part's row deleted (``post_delete``, ``embeddings/apps.py``): its blobs
    released after the commit (:func:`file_deleted`, :func:`batch_deleted`, :func:`part_deleted`)."""
    if isinstance(row, BatchFile):
        file_deleted(file=row)
    elif isinstance(row, Batch):
        batch_deleted(batch=row)
    elif isinstance(row, BatchPart):
        part_deleted(part=row)


def file_deleted(*, file: BatchFile) -> None:
    """A file's row deleted, however it went (the API, the admin, the cascade from its owner): its
    blob released after the commit."""
    blobs_release_on_commit([file.storage_key])


def batch_deleted(*, batch: Batch) -> None:
    """A batch's row deleted (the cascade from its job or its owner): its input's blob released
    after the commit (kept while a file or another unfinished batch names it). Its output and error
    files are rows of their own, released as files (:func:`file_deleted`), its parts as parts."""
    blobs_release_on_commit([batch.input_key])


def part_deleted(*, part: BatchPart) -> None:
    """A batch part's row deleted (the cascade from its batch): its output and error blobs and the
    images the fetch worker staged for it released after the commit."""
    staged = [v["key"] for v in (part.staged or {}).values() if isinstance(v, dict) and "key" in v]
    blobs_release_on_commit([part.output_key, part.error_key, *staged])


def blob_release(key: str) -> None:
    """Delete blob ``key`` unless a file, an unfinished batch's input or an image names it."""
    if BatchFile.objects.filter(storage_key=key).exists() or \
            Batch.objects.filter(input_key=key, status__in=UNFINISHED).exists() or \
            Image.objects.filter(storage_key=key).exists():
        return
    runtime.blob_store().delete(key)

