"""Object storage as a catalogue source (issue 41): ``s3://`` URIs, the buckets and prefixes a
deployment allows, listing a prefix page by page, and reading one object under a size cap.

Plain functions over a boto3 S3 client, no Django: the caller builds the client with
:func:`make_client` from ``settings.SOURCE_S3`` and the allow-list with :meth:`Allowed.parse` from
``settings.SOURCE_BUCKETS``. A listing is never held whole: :func:`list_prefix` yields one page
(at most ``page_size`` objects) at a time.

Errors are :class:`ObjectError` with a stable ``code``: ``source_uri_invalid`` (400),
``key_invalid`` (400), ``source_not_allowed`` (403), ``source_missing`` (400: the request names a
bucket or object that does not exist), ``too_large`` (413).
"""
from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from embeddings.errors import ApplicationError

#: S3 bucket names: 3 to 63 lowercase letters, digits, dots and hyphens, starting and ending with
#: a letter or digit (AWS "Bucket naming rules"; MinIO and Ceph follow them).
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
#: Longest object key, in UTF-8 bytes (AWS "Naming Amazon S3 objects": keys are up to 1,024 bytes).
MAX_KEY_BYTES = 1024
#: Objects one ``ListObjectsV2`` page returns at most (the S3 API's ``MaxKeys`` ceiling).
MAX_PAGE_SIZE = 1000
#: Bytes read from an object's body per call while streaming it.
CHUNK_BYTES = 1 << 20

_STATUS = {"source_uri_invalid": 400, "key_invalid": 400, "source_not_allowed": 403, "source_missing": 400,
           "too_large": 413}
#: Error codes S3-compatible servers send for a missing object or bucket (404 on ``HeadObject``,
#: which has no body, arrives as the bare status).
_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}


class ObjectError(ApplicationError, ValueError):
    """An object-storage source refused or unreadable: a stable ``code`` (module docstring) and a
    ``message``; the HTTP status follows the code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code, status=_STATUS.get(code, 400))


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its ``key``, ``size`` in bytes and ``etag`` (quotes removed; the MD5 of
    the bytes for single-part uploads, an opaque version tag otherwise)."""

    key: str
    size: int
    etag: str


def key_problem(key: str, *, prefix: bool = False) -> str | None:
    """Why ``key`` cannot name an object (``prefix``: a listing prefix, which may be empty or end
    in ``/``), or ``None`` when it can. Refused: empty keys, more than :data:`MAX_KEY_BYTES`,
    control characters, a leading ``/``, ``.`` or ``..`` segments (a key that a file-system backed
    server or a later copy to disk would resolve outside its folder), a key ending in ``/`` (a
    "folder" marker, not an image)."""
    if not isinstance(key, str):
        return "must be a string"
    if not key and not prefix:
        return "is empty"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode"
    if size > MAX_KEY_BYTES:
        return f"is {size} bytes; at most {MAX_KEY_BYTES}"
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        return "holds control characters"
    if key.startswith("/"):
        return "starts with '/'"
    segments = key.split("/")
    if any(s in (".", "..") for s in (segments[:-1] if prefix else segments)) or (segments[-1] == ".."):
        return "has a '.' or '..' segment"
    if not prefix and key.endswith("/"):
        return "ends with '/' (a folder, not an object)"
    return None


#: ``s3://bucket[/prefix]`` as :func:`parse_s3_uri` takes it, for the OpenAPI schema
#: (``embeddings.api.schema_rules``): a :data:`BUCKET` name, then a prefix of at most
#: :data:`MAX_KEY_BYTES` characters with no control character, no leading ``/``, no ``.`` or ``..``
#: segment before its last and no ``..`` last (:func:`key_problem`). A prefix of non-ASCII
#: characters can pass the pattern and be over the limit in UTF-8 bytes: that one is refused by
#: :func:`parse_s3_uri` alone.
S3_URI_PATTERN = ("^[Ss]3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
                  "(/(?!/)(?!([^/]*/)*(\\.\\.?/|\\.\\.$))[^\\x00-\\x1f\\x7f]{0,%d})?$" % MAX_KEY_BYTES)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` as ``(bucket, prefix)``; the prefix is ``""`` for the whole bucket
    and is kept exactly as written after the bucket's slash (``s3://b/photos/`` → ``("b",
    "photos/")``).

    Raises:
        ObjectError: ``source_uri_invalid`` for another scheme, a bad bucket name, or a prefix that
            :func:`key_problem` refuses (``..`` segments, a leading ``/``, control characters).
    """
    if not isinstance(uri, str) or uri[:5].lower() != "s3://":
        raise ObjectError("source_uri_invalid", f"{str(uri)[:200]!r} is not an s3://bucket/prefix URI")
    bucket, _, prefix = uri[5:].partition("/")
    if not BUCKET.match(bucket):
        raise ObjectError("source_uri_invalid", f"{bucket[:100]!r} is not a valid bucket name")
    problem = key_problem(prefix, prefix=True)
    if problem:
        raise ObjectError("source_uri_invalid", f"prefix {prefix[:200]!r} {problem}")
    return bucket, prefix


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The buckets, and optionally prefixes inside them, a deployment lets jobs read
    (``SOURCE_BUCKETS``): ``rules`` is a tuple of ``(bucket, prefix)``, ``prefix`` ``""`` for the
    whole bucket, else ending in ``/`` (a configured ``bucket/photos`` means the folder
    ``photos/``, so ``photos-private/`` is not inside it). No rules: nothing is allowed."""

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, spec: str | Iterable[str]) -> Allowed:
        """From ``"bucket-a/photos/,bucket-b"`` or a list of such entries (``s3://`` optional);
        blank entries are skipped.

        Raises:
            ObjectError: ``source_uri_invalid`` for an entry :func:`parse_s3_uri` refuses.
        """
        entries = spec.split(",") if isinstance(spec, str) else spec
        rules = []
        for entry in entries:
            entry = entry.strip()
            if not entry:
                continue
            bucket, prefix = parse_s3_uri(entry if entry[:5].lower() == "s3://" else "s3://" + entry)
            if prefix and not prefix.endswith("/"):
                prefix += "/"
            rules.append((bucket, prefix))
        return cls(tuple(rules))

    def check(self, bucket: str, key_or_prefix: str = "") -> None:
        """Pass when ``bucket`` is allowed and ``key_or_prefix`` (an object key, or a listing
        prefix) lies inside an allowed prefix of it; a listing prefix must therefore end at or below
        the allowed folder (``photos/`` or ``photos/2024``, not ``photos``).

        Raises:
            ObjectError: ``source_not_allowed`` (403), also for a key or prefix with a ``..``
                segment or a leading ``/``, whatever the rules.
        """
        problem = key_problem(key_or_prefix, prefix=True)
        if problem:
            raise ObjectError("source_not_allowed", f"{key_or_prefix[:200]!r} {problem}")
        for rule_bucket, rule_prefix in self.rules:
            if rule_bucket == bucket and key_or_prefix.startswith(rule_prefix):
                return
        raise ObjectError("source_not_allowed",
                          f"s3://{bucket}/{key_or_prefix[:200]} is not inside a bucket or prefix this server may read")


def list_prefix(client: Any, bucket: str, prefix: str, *, extensions: Iterable[str] | None = None,
                page_size: int = MAX_PAGE_SIZE, start_after: str | None = None) -> Iterator[list[ObjectInfo]]:
    """The objects under ``prefix``, one ``ListObjectsV2`` page at a time, in the server's (key)
    order; the whole listing is never held.

    Args:
        client: a boto3 S3 client (:func:`make_client`).
        bucket, prefix: what to list (``prefix`` ``""``: the whole bucket); check them with
            :meth:`Allowed.check` first.
        extensions: keep only keys ending in one of these, case-insensitive (``{".jpg", "png"}``:
            the dot is optional); ``None``: every key.
        page_size: objects asked for per request, 1 to :data:`MAX_PAGE_SIZE`.
        start_after: list only the keys after this one (``StartAfter``): where an earlier listing of
            the same prefix stopped.

    Yields:
        Lists of :class:`ObjectInfo`, one per page, without "folders" (keys ending in ``/``) and
        keys outside ``extensions``; a page left empty by that filter is not yielded.

    Raises:
        ObjectError: ``source_missing`` when the bucket does not exist.
        botocore.exceptions.ClientError: other server errors (access denied, throttling).
    """
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be 1..{MAX_PAGE_SIZE}, not {page_size}")
    suffixes = None
    if extensions is not None:
        suffixes = tuple({("" if e.startswith(".") else ".") + e.lower() for e in extensions})
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size},
        **({"StartAfter": start_after} if start_after else {}))
    try:
        for page in pages:
            infos = [ObjectInfo(o["Key"], int(o["Size"]), o.get("ETag", "").strip('"'))
                     for o in page.get("Contents", ())
                     if not o["Key"].endswith("/") and (suffixes is None or o["Key"].lower().endswith(suffixes))]
            if infos:
                yield infos
    except ClientError as e:
        if _code(e) in _MISSING:
            raise ObjectError("source_missing", f"bucket {bucket!r} does not exist") from e
        raise


def copy_object(client: Any, bucket: str, key: str, dest: BinaryIO, *, max_bytes: int) -> int:
    """Stream one object's bytes into ``dest`` (a file, a ``SpooledTemporaryFile``), at most
    :data:`CHUNK_BYTES` in memory at a time; a manifest named by its key is read this way.

    Returns:
        The number of bytes written.

    Raises:
        ObjectError: ``source_missing`` (no such key or bucket), ``too_large`` (the object is, or
            turns out while reading to be, over ``max_bytes``; ``dest`` then holds a partial copy).
        botocore.exceptions.ClientError: other server errors.
    """
    try:
        response = client.get_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if _code(e) in _MISSING:
            raise ObjectError("source_missing", f"s3://{bucket}/{key} does not exist") from e
        raise
    body = response["Body"]
    try:
        length = response.get("ContentLength")
        if length is not None and length > max_bytes:
            raise ObjectError("too_large", f"s3://{bucket}/{key} is {length} bytes; at most {max_bytes}")
        written = 0
        # The advertised length is checked above, and the bytes counted here too: a server may
        # send more than it said, and a length that is absent bounds nothing.
        while chunk := body.read(min(CHUNK_BYTES, max_bytes + 1 - written)):
            written += len(chunk)
            if written > max_bytes:
                raise ObjectError("too_large", f"s3://{bucket}/{key} is over {max_bytes} bytes")
            dest.write(chunk)
        return written
    finally:
        body.close()


def open_object(client: Any, bucket: str, key: str, *, max_bytes: int) -> bytes:
    """One object's bytes, read as a stream and refused beyond ``max_bytes``.

    Raises:
        ObjectError: ``source_missing`` or ``too_large``, as :func:`copy_object`.
    """
    buffer = io.BytesIO()
    copy_object(client, bucket, key, buffer, max_bytes=max_bytes)
    return buffer.getvalue()


def make_client(*, endpoint_url: str | None = None, region: str | None = None, access_key: str | None = None,
                secret_key: str | None = None, addressing_style: str | None = None) -> Any:
    """A boto3 S3 client; the keyword names are those of ``settings.SOURCE_S3`` (built from
    ``S3_ENDPOINT_URL``, ``AWS_S3_REGION_NAME``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_S3_ADDRESSING_STYLE``). Empty values leave boto3's own chain to decide (instance roles,
    ``~/.aws``); ``addressing_style="path"`` for servers without per-bucket host names (MinIO,
    moto, Ceph)."""

    config = Config(s3={"addressing_style": addressing_style}) if addressing_style else None
    return boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region or None,
                        aws_access_key_id=access_key or None, aws_secret_access_key=secret_key or None,
                        config=config)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
