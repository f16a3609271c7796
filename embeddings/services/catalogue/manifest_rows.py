"""One catalogue manifest row checked and mapped (issue 41), whatever its format: the fields that
say which image it is (``url``, ``key``, ``external_id``), its metadata (declared ``types``
converted, merged from a nested ``metadata`` object), each fault a :class:`RowError` with a stable
code: ``url_invalid``, ``key_invalid``, ``source_missing_column``, ``external_id_invalid``,
``metadata_invalid``, ``metadata_too_large``, ``metadata_too_deep``, and
``manifest_too_many_rows`` after the last row read. The per-format readers
(``catalogue.manifests``) hand their raw rows to :func:`checked_rows`.

CSV cells are text: a declared field (``types``) is read by its type, an undeclared one that is
written as a JSON number or ``true``/``false`` becomes that (:func:`infer`), anything else stays text.

Not checked here: whether a URL's host resolves to an address the fetcher may reach (the fetcher
checks every hop); whether a ``key``'s bucket is allowed (``objects.Allowed``, with the job's
configuration).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from embeddings.objects import ObjectError, key_problem, parse_s3_uri
from embeddings.services.catalogue.metadata import (
    MetadataError,
    check_declared,
    coerce,
    validate_external_id,
    validate_metadata,
)

#: Longest URL, in characters: the sitemaps.org protocol's limit, which crawlers and CDNs share.
MAX_URL_CHARS = 2048
#: The fields that say which image a row is; every other field is metadata.
SOURCE_FIELDS = ("url", "key", "external_id")
#: Where JSON Lines and Parquet rows may also give metadata as one object.
METADATA_FIELD = "metadata"


@dataclasses.dataclass(frozen=True)
class ManifestRow:
    """One accepted row: its 1-based ``row`` number, exactly one of ``url`` and ``key``, the
    caller's ``external_id`` (stripped; ``None`` when not given) and the checked ``metadata``."""

    row: int
    url: str | None
    key: str | None
    external_id: str | None
    metadata: dict


@dataclasses.dataclass(frozen=True)
class RowError:
    """One refused row: its 1-based ``row`` number, a stable ``code``, a ``detail`` for people, and
    the row's ``external_id`` when it was given and valid (``None`` otherwise)."""

    row: int
    code: str
    detail: str
    external_id: str | None


def checked_rows(rows: Iterator[tuple[int, dict | RowError | None]], types: dict[str, str], max_rows: int | None,
                 max_metadata_bytes: int, *, nested: bool) -> Iterator[ManifestRow | RowError]:
    """A format reader's raw rows (``(row, fields)``, ``(row, RowError)``, or ``(row, None)`` for a
    blank line) checked one at a time: each a :class:`ManifestRow` or a :class:`RowError`; blank
    lines yield nothing; past ``max_rows``, one ``manifest_too_many_rows`` error ends the rows.
    ``nested``: JSON Lines and Parquet, where ``metadata`` is an object to merge."""
    for row, item in rows:
        if item is None:  # a blank line keeps its number and yields nothing
            continue
        if max_rows is not None and row > max_rows:
            yield RowError(row, "manifest_too_many_rows",
                           f"the manifest has more than {max_rows} rows; rows from {row} on were not read", None)
            return
        yield item if isinstance(item, RowError) else _row(row, item, types, max_metadata_bytes, nested)


def _row(row: int, fields: dict, types: dict[str, str], max_metadata_bytes: int,
         nested: bool) -> ManifestRow | RowError:
    """One row's fields checked (``nested``: JSON Lines and Parquet, where ``metadata`` is an
    object to merge; in CSV it is an ordinary text column)."""
    url = _present(fields.pop("url", None))
    key = _present(fields.pop("key", None))
    external_id = None
    raw_id = fields.pop("external_id", None)
    if raw_id is not None and raw_id != "":
        try:
            external_id = validate_external_id(raw_id)
        except MetadataError as e:
            return RowError(row, e.code, e.message, None)
    if url is None and key is None:
        return RowError(row, "source_missing_column", "the row has neither a url nor a key", external_id)
    if url is not None and key is not None:
        return RowError(row, "source_missing_column", "the row has both a url and a key; give one", external_id)
    if url is not None:
        problem = _url_problem(url)
        if problem:
            return RowError(row, "url_invalid", f"url {problem}", external_id)
    else:
        problem = _key_problem(key)
        if problem:
            return RowError(row, "key_invalid", f"key {problem}", external_id)
    merged = fields
    if nested and METADATA_FIELD in fields:
        inner = fields.pop(METADATA_FIELD)
        if inner is not None and not isinstance(inner, dict):
            return RowError(row, "metadata_invalid", f"'metadata' must be an object, not {type(inner).__name__}",
                            external_id)
        merged = {**fields, **inner} if inner else fields
    try:
        for field, kind in types.items():
            value = merged.get(field)
            if isinstance(value, str):
                try:
                    merged[field] = coerce(value, kind)
                except MetadataError as e:
                    raise MetadataError(e.code, f"{field}: {e.message}") from None
        if not nested:  # CSV cells are text: an undeclared one that is plainly a number or a boolean is one
            merged = {k: v if k in types else infer(v) for k, v in merged.items()}
        metadata = check_declared(validate_metadata(merged, max_bytes=max_metadata_bytes), types)
    except MetadataError as e:
        return RowError(row, e.code, e.message, external_id)
    return ManifestRow(row, url.strip() if url is not None else None, key.strip() if key is not None else None,
                       external_id, metadata)


#: A CSV cell read as a number when undeclared: JSON's own number syntax, so ``00123`` (an id with
#: leading zeros), ``1,5``, ``1e`` or ``+3`` stay text.
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def infer(value: Any) -> Any:
    """The value of an undeclared CSV cell: an int or a float when it is written as a JSON number
    (a float only when finite; ints beyond ±2**53 stay text, as JSON readers would round them),
    ``True``/``False`` for ``true``/``false``, else the text unchanged. Declared fields
    (``METADATA_INDEXES``) are read by their type instead (:func:`metadata.coerce`)."""
    if not isinstance(value, str):
        return value
    if value in ("true", "false"):
        return value == "true"
    if _NUMBER.fullmatch(value):
        if "." not in value and "e" not in value.lower():
            n = int(value)
            return n if abs(n) <= 2 ** 53 else value
        f = float(value)
        return f if f not in (float("inf"), float("-inf")) else value
    return value


def _present(value: Any) -> Any:
    """``None`` for an absent value: ``None``, or a string that is empty once stripped."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return value


def _url_problem(url: Any) -> str | None:
    """Why ``url`` cannot be fetched, or ``None``: http or https with a host, at most
    :data:`MAX_URL_CHARS`, no spaces or control characters. Where its host points is the
    fetcher's check (it resolves each hop)."""
    if not isinstance(url, str):
        return f"must be a string, not {type(url).__name__}"
    url = url.strip()
    if len(url) > MAX_URL_CHARS:
        return f"has {len(url)} characters; at most {MAX_URL_CHARS}"
    if not url.isprintable() or " " in url:
        return "holds spaces or control characters (percent-encode them)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        return f"is not a valid URL: {e}"
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        return f"scheme {scheme + ':' if scheme else '(none)'} is not http or https"
    if not parts.hostname:
        return "has no host"
    return None


def _key_problem(key: Any) -> str | None:
    """Why ``key`` cannot name an object, or ``None``: ``s3://bucket/key`` with a valid bucket, or
    a bare key, either one passing ``objects.key_problem``."""
    if not isinstance(key, str):
        return f"must be a string, not {type(key).__name__}"
    key = key.strip()
    if key[:5].lower() == "s3://":
        try:
            _, key = parse_s3_uri(key)
        except ObjectError as e:
            return e.message
    return key_problem(key)
