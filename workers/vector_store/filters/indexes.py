"""Payload indexes a deployment declares for metadata fields, and the check of metadata against them."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .evaluate import field_values
from .qdrant import item_key
from .where import (
    EXTERNAL_ID,
    INDEX_TYPES,
    OWNER_INDEX,
    FilterError,
    check_field,
    parse_date,
)


def check_indexed_fields(fields: Mapping[str, str] | None) -> dict[str, str]:
    """``fields`` (metadata field → one of :data:`INDEX_TYPES`) checked, as a new dict ({} for None).

    Raises:
        ValueError: a field that is not a field name, or an unknown type; the message names it.
    """
    out = {}
    for field, kind in (fields or {}).items():
        try:
            check_field(field)
        except FilterError as e:
            raise ValueError(f"indexed field {field!r}: {e.message}") from None
        if kind not in INDEX_TYPES:
            raise ValueError(f"indexed field {field!r}: unknown type {kind!r}, expected one of {', '.join(INDEX_TYPES)}")
        out[field] = kind
    return out


def parse_indexed_fields(text: str) -> dict[str, str]:
    """Read a declaration ``"category:keyword,price:float,date:datetime"`` (``METADATA_INDEXES``).

    Parts are comma-separated ``field:type`` (spaces around them ignored; empty text: no fields).

    Raises:
        ValueError: a part without ``:``, a bad field name, an unknown type or a field named twice;
            the message quotes the part.
    """
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        field, sep, kind = (s.strip() for s in part.partition(":"))
        if not sep:
            raise ValueError(f"metadata index {part!r}: expected field:type, type one of {', '.join(INDEX_TYPES)}")
        if field in out:
            raise ValueError(f"metadata index {part!r}: field {field!r} is declared twice")
        try:
            out.update(check_indexed_fields({field: kind.lower()}))
        except ValueError as e:
            raise ValueError(f"metadata index {part!r}: {e}") from None
    return out


def _fits(value: Any, kind: str) -> bool:
    if kind == "keyword":
        return isinstance(value, str)
    if kind == "integer":
        return type(value) is int
    if kind == "float":
        return type(value) in (int, float)
    if kind == "bool":
        return type(value) is bool
    return isinstance(value, str) and parse_date(value) is not None  # datetime


def check_metadata(metadata: Mapping, indexed_fields: Mapping[str, str] | None) -> None:
    """Check that every value of an indexed field in ``metadata`` has the field's declared type
    (keyword: str; integer: int; float: int or float; bool: bool; datetime: a date string; a list:
    each element). Fields that are absent, and fields that are not indexed, may hold anything.

    Raises:
        ValueError: ``metadata field 'price' is indexed as float: '12 EUR' is not a float``.
    """
    for field, kind in (indexed_fields or {}).items():
        if field == EXTERNAL_ID:
            continue
        for v in field_values({"m": metadata}, field):
            if not _fits(v, kind):
                what = {"keyword": "a string", "integer": "an integer", "float": "a number", "bool": "a boolean",
                        "datetime": "an ISO 8601 date"}[kind]
                raise ValueError(f"metadata field {field!r} is indexed as {kind}: {repr(v)[:80]} is not {what}")


def payload_indexes(indexed_fields: Mapping[str, str] | None) -> dict[str, str]:
    """Item-level payload indexes to keep: ``{"items[].owner": "integer", "items[].m.<field>": type}``."""
    return {OWNER_INDEX: "integer",
            **{f"items[].{item_key(f)}": t for f, t in check_indexed_fields(indexed_fields).items()}}
