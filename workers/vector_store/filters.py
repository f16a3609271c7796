"""Metadata filters for similarity search: a typed filter (:data:`Where`), its JSON form, an exact
evaluator, and the Qdrant payload filters that apply it inside the vector query.

A point stands for every image with the same bytes in one embedding space, so its payload holds one
item per image: ``{"sha256", "owner_ids": [int], "job_ids": [str], "items": [{"image": "<uuid>",
"owner": int, "job": "<uuid>" (absent when none), "external_id": str (absent when none), "m":
{metadata}}]}``. A point matches a search when ONE of its items satisfies the owner (if given), the
job (if given) and the filter. That is a Qdrant nested condition on ``items``, evaluated by the
engine while it ranks (:func:`to_edge`, :func:`to_client`), never after: top-k returns k points
whenever k points match (exact below the edge store's HNSW threshold, ``edge.INDEXING_THRESHOLD_KB``).

JSON form (the API's ``filter`` object, read by :func:`parse`; :func:`json_schema` gives it as JSON
Schema for OpenAPI)::

    where     := {"and": [where, ...]} | {"or": [where, ...]} | {"not": where} | condition
    condition := {"field": FIELD, "eq": string | integer | number | boolean}
               | {"field": FIELD, "in": [string, ...] | [integer, ...]}
               | {"field": FIELD, "gt"|"gte"|"lt"|"lte": number | DATE, ...}   at least one bound,
                                                                             all numbers or all dates
               | {"field": FIELD, "exists": boolean}                         false: the field is absent
    FIELD     := SEGMENT ("." SEGMENT){0,2}     a metadata key, or a dotted path into nested objects;
                 SEGMENT := [A-Za-z_][A-Za-z0-9_]{0,63}        "external_id" is the image's external id
    DATE      := ISO 8601 string, "YYYY-MM-DD" or "YYYY-MM-DDThh:mm:ssZ" (no offset: UTC)

Bounds (:data:`MAX_DEPTH`, :data:`MAX_CONDITIONS`, :data:`MAX_IN`, :data:`MAX_STRING`): a filter is
user input evaluated per item of every candidate point, so its size is capped.

Semantics (Qdrant's, which :func:`matches` reproduces exactly; the property tests hold the engines
to it): a list value matches when any element does; ``eq`` on a string is exact (case-sensitive;
an ``external_id`` value is first put in the form ids are stored in, stripped and Unicode NFC);
``eq``/``in`` on integers match integer values only (``3.0`` is a float: use a range), booleans only
booleans (``true`` is not ``1``); ``eq`` with a float is the range ``gte = lte = value``; a numeric
range matches int and float values, never strings or booleans; a date range matches strings that
parse as dates (Qdrant core's formats, naive = UTC); ``exists`` is false for a missing field and an
empty list; paths go through nested objects, never through lists.

Payload indexes (``indexed_fields``, ``METADATA_INDEXES``): a declared type is a promise about the
values. The engine answers a selective condition from the index, which holds only values of its
type (an integer index has no ``3.5``, a datetime index no ``"soon"``), so a value of another type in
an indexed field may be missed or seen depending on the query plan. :func:`check_metadata` rejects
such values where metadata comes in.

Errors: :class:`FilterError` (a ``ValueError``, reason code ``invalid_filter``) with ``path``, where
in the JSON object it is (``"and[2].field"``; ``""`` for the whole object).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import unicodedata
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

#: Nesting of and/or/not objects, a condition at the top counting 1: deeper is a generated or
#: hostile filter, and every level is one more recursion per candidate item.
MAX_DEPTH = 8
#: Conditions (leaves) in one filter.
MAX_CONDITIONS = 64
#: Values in one ``in`` list.
MAX_IN = 256
#: Characters in one string value of a filter, a date included: longer is not a value to look up.
MAX_STRING = 256
#: Segments of a dotted field path: metadata objects nest at most 3 deep.
MAX_PATH_DEPTH = 3
#: The field name that addresses an item's ``external_id`` instead of its metadata.
EXTERNAL_ID = "external_id"
#: Payload index types a deployment may declare for a metadata field (``METADATA_INDEXES``); each is
#: the Qdrant payload schema type of the same name.
INDEX_TYPES = ("keyword", "integer", "float", "bool", "datetime")
#: The item-level index every nested search uses (the owner of a matching item).
OWNER_INDEX = "items[].owner"

_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
#: Qdrant stores integers as i64: a value outside it cannot be in a payload it compares with.
_I64 = (-(2**63), 2**63 - 1)
_BOUNDS = ("gt", "gte", "lt", "lte")
_LEAF_KEYS = frozenset(("field", "eq", "in", "exists") + _BOUNDS)


class FilterError(ValueError):
    """A filter that cannot be read: ``message`` says why, ``path`` where (``"and[2].field"``).

    Attributes:
        code: the stable reason code the API answers with (400 ``invalid_filter``).
    """

    code = "invalid_filter"

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.message = message
        self.path = path


def _join(path: str, key: str) -> str:
    if not path:
        return key
    return path + key if key.startswith("[") else f"{path}.{key}"


# --- the typed filter ------------------------------------------------------------------------------


def check_field(field: Any) -> str:
    """``field`` if it is a valid field name (module docstring: FIELD), else :class:`FilterError`."""
    if not isinstance(field, str):
        raise FilterError("a field name is a string", "field")
    parts = field.split(".")
    if len(parts) > MAX_PATH_DEPTH or not all(_SEGMENT.match(p) for p in parts):
        raise FilterError(f"{field[:80]!r} is not a field name: up to {MAX_PATH_DEPTH} dot-separated keys of "
                          f"letters, digits and _ (not starting with a digit, at most 64 each)", "field")
    return field


def _check_string(value: str, path: str) -> str:
    if len(value) > MAX_STRING:
        raise FilterError(f"a string value has at most {MAX_STRING} characters", path)
    return value


def _normal_id(value: str) -> str:
    """An ``external_id`` filter value in the form ids are stored in: outer whitespace stripped,
    Unicode NFC (``embeddings.services.catalogue.metadata.normal_external_id``, the same rule), so
    ``Café`` typed as ``e`` + U+0301 finds the id stored with U+00E9."""
    return unicodedata.normalize("NFC", value.strip())


def _check_int(value: int, path: str) -> int:
    if not _I64[0] <= value <= _I64[1]:
        raise FilterError("an integer value must fit in 64 bits", path)
    return value


def _check_number(value: Any, path: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FilterError("expected a number", path)
    if isinstance(value, float) and not math.isfinite(value):
        raise FilterError("a number must be finite", path)
    return _check_int(value, path) if isinstance(value, int) else value


@dataclasses.dataclass(frozen=True)
class Eq:
    """``field`` equals ``value`` (str / int / bool exactly; a float as the range gte = lte = value)."""

    field: str
    value: str | int | float | bool

    def __post_init__(self) -> None:
        check_field(self.field)
        v = self.value
        if isinstance(v, str):
            _check_string(v, "eq")
            if self.field == EXTERNAL_ID:
                object.__setattr__(self, "value", _normal_id(v))
        elif isinstance(v, bool):
            pass
        elif isinstance(v, (int, float)):
            _check_number(v, "eq")
        else:
            raise FilterError("eq takes a string, number or boolean", "eq")


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """``field`` equals one of ``values``: all strings or all integers, 1 to :data:`MAX_IN` of them."""

    field: str
    values: tuple[str, ...] | tuple[int, ...]

    def __post_init__(self) -> None:
        check_field(self.field)
        values = self.values
        if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
            raise FilterError("in takes a list", "in")
        if not 1 <= len(values) <= MAX_IN:
            raise FilterError(f"in takes 1 to {MAX_IN} values", "in")
        kind = str if isinstance(values[0], str) else int
        for i, v in enumerate(values):
            path = f"in[{i}]"
            if kind is str and isinstance(v, str):
                _check_string(v, path)
            elif kind is int and isinstance(v, int) and not isinstance(v, bool):
                _check_int(v, path)
            else:
                raise FilterError("in takes strings or integers, all of one kind", path)
        if self.field == EXTERNAL_ID and kind is str:
            values = [_normal_id(v) for v in values]
        object.__setattr__(self, "values", tuple(values))


@dataclasses.dataclass(frozen=True)
class Range:
    """``field`` within bounds: all numbers (int / float) or all dates (aware ``datetime``; an ISO
    string or a naive datetime given here is read as UTC). At least one bound."""

    field: str
    gt: float | int | datetime | None = None
    gte: float | int | datetime | None = None
    lt: float | int | datetime | None = None
    lte: float | int | datetime | None = None

    def __post_init__(self) -> None:
        check_field(self.field)
        given = [(name, getattr(self, name)) for name in _BOUNDS if getattr(self, name) is not None]
        if not given:
            raise FilterError("a range needs at least one of gt, gte, lt, lte")
        is_date = isinstance(given[0][1], (str, datetime))
        for name, v in given:
            if is_date:
                if isinstance(v, str):
                    v = parse_date(_check_string(v, name))
                    if v is None:
                        raise FilterError("not a date: expected ISO 8601, e.g. YYYY-MM-DD or YYYY-MM-DDThh:mm:ssZ",
                                          name)
                elif isinstance(v, datetime):
                    v = v if v.tzinfo else v.replace(tzinfo=UTC)
                else:
                    raise FilterError("range bounds are all numbers or all dates", name)
                object.__setattr__(self, name, v)
            else:
                if isinstance(v, (str, datetime)):
                    raise FilterError("range bounds are all numbers or all dates", name)
                _check_number(v, name)

    @property
    def is_date(self) -> bool:
        """Whether the bounds are dates (else numbers)."""
        return any(isinstance(getattr(self, b), datetime) for b in _BOUNDS)

    def bounds(self) -> dict[str, Any]:
        """The given bounds by name."""
        return {b: getattr(self, b) for b in _BOUNDS if getattr(self, b) is not None}


@dataclasses.dataclass(frozen=True)
class Exists:
    """``field`` is present with a value other than an empty list."""

    field: str

    def __post_init__(self) -> None:
        check_field(self.field)


def _check_items(op: str, items: Any) -> tuple:
    if not isinstance(items, (list, tuple)) or not items:
        raise FilterError(f"{op} takes a non-empty list of filters", op)
    for i, item in enumerate(items):
        if not isinstance(item, _NODES):
            raise FilterError("expected a filter", f"{op}[{i}]")
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class And:
    """Every one of ``items`` holds (for the same item of the point)."""

    items: tuple[Where, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", _check_items("and", self.items))


@dataclasses.dataclass(frozen=True)
class Or:
    """At least one of ``items`` holds (for the same item of the point)."""

    items: tuple[Where, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", _check_items("or", self.items))


@dataclasses.dataclass(frozen=True)
class Not:
    """``item`` does not hold (for that item of the point)."""

    item: Where

    def __post_init__(self) -> None:
        if not isinstance(self.item, _NODES):
            raise FilterError("expected a filter", "not")


#: A filter: a tree of conditions under and / or / not.
Where = And | Or | Not | Eq | AnyOf | Range | Exists
_NODES = (And, Or, Not, Eq, AnyOf, Range, Exists)


# --- JSON ------------------------------------------------------------------------------------------


def parse(obj: Any) -> Where:
    """The filter that the API's JSON object ``obj`` describes (module docstring: the grammar).

    ``{"field": f, "exists": false}`` becomes ``Not(Exists(f))``.

    Raises:
        FilterError: ``obj`` breaks the grammar or a bound; ``path`` says where.
    """
    return _parse(obj, "", 1, [0])


def _parse(obj: Any, path: str, depth: int, count: list[int]) -> Where:
    if not isinstance(obj, dict):
        raise FilterError("a filter is an object", path)
    if depth > MAX_DEPTH:
        raise FilterError(f"filters nest at most {MAX_DEPTH} levels deep", path)
    ops = [k for k in ("and", "or", "not") if k in obj]
    if ops:
        op = ops[0]
        other = next((k for k in obj if k != op), None)
        if other is not None:
            raise FilterError(f"an object with {op!r} has no other key", _join(path, str(other)))
        if op == "not":
            return Not(_parse(obj["not"], _join(path, "not"), depth + 1, count))
        items = obj[op]
        if not isinstance(items, list) or not items:
            raise FilterError(f"{op} takes a non-empty list of filters", _join(path, op))
        if len(items) > MAX_CONDITIONS:
            raise FilterError(f"{op} takes at most {MAX_CONDITIONS} filters", _join(path, op))
        parsed = tuple(_parse(item, _join(path, f"{op}[{i}]"), depth + 1, count) for i, item in enumerate(items))
        return And(parsed) if op == "and" else Or(parsed)
    if "field" not in obj:
        raise FilterError('expected an object with "and", "or", "not" or "field"', path)
    count[0] += 1
    if count[0] > MAX_CONDITIONS:
        raise FilterError(f"a filter has at most {MAX_CONDITIONS} conditions", path)
    unknown = next((k for k in obj if k not in _LEAF_KEYS), None)
    if unknown is not None:
        raise FilterError(f"unknown key {str(unknown)[:80]!r}: a condition has field and one of eq, in, "
                          f"gt/gte/lt/lte, exists", _join(path, str(unknown)))
    kinds = [k for k in ("eq", "in", "exists") if k in obj] + (["range"] if any(b in obj for b in _BOUNDS) else [])
    if len(kinds) != 1:
        raise FilterError("a condition has exactly one of eq, in, a range (gt/gte/lt/lte) or exists; "
                          "combine conditions with and", path)
    field = obj["field"]
    try:
        if kinds[0] == "eq":
            if obj["eq"] is None:
                raise FilterError("eq takes a string, number or boolean (metadata has no null)", "eq")
            return Eq(field, obj["eq"])
        if kinds[0] == "in":
            return AnyOf(field, obj["in"])
        if kinds[0] == "exists":
            if not isinstance(obj["exists"], bool):
                raise FilterError("exists takes true or false", "exists")
            return Exists(field) if obj["exists"] else Not(Exists(field))
        for b in _BOUNDS:  # a bound is a number or a date string, nothing else
            v = obj.get(b)
            if v is not None and not isinstance(v, str):
                _check_number(v, b)
            elif b in obj and v is None:
                raise FilterError("a bound is a number or a date string", b)
        return Range(field, **{b: obj[b] for b in _BOUNDS if b in obj})
    except FilterError as e:
        raise FilterError(e.message, _join(path, e.path)) from None


def dump(where: Where) -> dict:
    """The JSON object of ``where`` (the inverse of :func:`parse`; dates as ISO 8601 UTC strings)."""
    if isinstance(where, And):
        return {"and": [dump(w) for w in where.items]}
    if isinstance(where, Or):
        return {"or": [dump(w) for w in where.items]}
    if isinstance(where, Not):
        return {"not": dump(where.item)}
    if isinstance(where, Eq):
        return {"field": where.field, "eq": where.value}
    if isinstance(where, AnyOf):
        return {"field": where.field, "in": list(where.values)}
    if isinstance(where, Exists):
        return {"field": where.field, "exists": True}
    if isinstance(where, Range):
        return {"field": where.field, **{b: _iso(v) if isinstance(v, datetime) else v
                                         for b, v in where.bounds().items()}}
    raise TypeError(f"not a filter: {where!r}")


def json_schema(ref: str = "#/$defs/") -> dict[str, dict]:
    """The JSON Schema of the ``filter`` object: ``{"MetadataFilter": ..., "MetadataCondition": ...}``
    and the condition's five forms (``MetadataEquals``, ``MetadataIn``, ``MetadataExists``,
    ``MetadataNumberRange``, ``MetadataDateRange``), referring to each other as ``ref + name``
    (``"#/components/schemas/"`` inside OpenAPI).

    The schema states the grammar and the per-value caps; :func:`parse` also checks what a schema
    cannot (depth, condition count, date strings, one operator per condition).
    """
    where = {"$ref": ref + "MetadataFilter"}
    seg = r"[A-Za-z_][A-Za-z0-9_]{0,63}"
    field = {"type": "string", "pattern": rf"^{seg}(\.{seg}){{0,{MAX_PATH_DEPTH - 1}}}$",
             "description": "metadata key or dotted path; external_id is the image's external id"}
    # A date bound: RFC 3339's date-time or full-date, which Qdrant's parser (parse_date) reads
    date = {"oneOf": [{"type": "string", "format": "date-time"}, {"type": "string", "format": "date"}],
            "description": "ISO 8601 date, e.g. YYYY-MM-DD or YYYY-MM-DDThh:mm:ssZ"}

    def condition(operators: dict, any_of: bool = False) -> dict:
        """A condition object: ``field`` and the ``operators`` (one required; ``any_of``: one or more)."""
        out = {"type": "object", "properties": {"field": field, **operators}, "additionalProperties": False}
        out["required"] = ["field"] if any_of else ["field", *operators]
        if any_of:
            out["minProperties"] = 2
        return out

    listed = {"type": "array", "minItems": 1, "maxItems": MAX_CONDITIONS, "items": where}
    return {
        "MetadataFilter": {
            "description": "A metadata filter: conditions combined with and / or / not; a point matches when "
                           "one of its images' items satisfies it.",
            "oneOf": [
                {"type": "object", "properties": {"and": listed}, "required": ["and"], "additionalProperties": False},
                {"type": "object", "properties": {"or": listed}, "required": ["or"], "additionalProperties": False},
                {"type": "object", "properties": {"not": where}, "required": ["not"], "additionalProperties": False},
                {"$ref": ref + "MetadataCondition"},
            ],
        },
        "MetadataCondition": {
            "description": "One condition on one metadata field: exactly one of eq, in, a range (gt/gte/lt/lte: "
                           "all numbers or all dates) or exists.",
            "oneOf": [{"$ref": ref + name} for name in ("MetadataEquals", "MetadataIn", "MetadataExists",
                                                        "MetadataNumberRange", "MetadataDateRange")],
        },
        "MetadataEquals": condition({"eq": {"oneOf": [{"type": "string", "maxLength": MAX_STRING}, {"type": "number"},
                                                      {"type": "boolean"}]}}),
        "MetadataIn": condition({"in": {"oneOf": [  # strings or integers, all of one kind
            {"type": "array", "minItems": 1, "maxItems": MAX_IN, "items": {"type": "string", "maxLength": MAX_STRING}},
            {"type": "array", "minItems": 1, "maxItems": MAX_IN, "items": {"type": "integer", "minimum": -2 ** 63, "maximum": 2 ** 63 - 1}}]}}),
        "MetadataExists": condition({"exists": {"type": "boolean"}}),
        "MetadataNumberRange": condition({b: {"type": "number"} for b in _BOUNDS}, any_of=True),
        "MetadataDateRange": condition({b: date for b in _BOUNDS}, any_of=True),
    }


# --- exact evaluation ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def parse_date(text: str) -> datetime | None:
    """``text`` as an aware datetime when Qdrant core reads it as one (naive = UTC), else None.

    Uses qdrant-client's port of core's parser (the formats of core's ``DateTimeWrapper``), the one
    its local mode filters with, so the evaluator, local mode and the engine agree on what is a date.
    """
    from qdrant_client.local.datetime_utils import (
        parse as qdrant_parse,  # import-light module top
    )

    try:
        dt = qdrant_parse(text)
    except (ValueError, OverflowError):
        return None
    return dt if dt is None or dt.tzinfo else dt.replace(tzinfo=UTC)


def _values(item: Mapping, field: str) -> list:
    """The values ``field`` holds in ``item`` (a list value flattened one level; [] when missing)."""
    if field == EXTERNAL_ID:
        v = item.get(EXTERNAL_ID)
    else:
        v = item.get("m")
        for key in field.split("."):
            if not isinstance(v, dict):
                return []
            v = v.get(key)
    if v is None:
        return []
    return v if isinstance(v, list) else [v]


def _same(value: Any, wanted: str | int | bool) -> bool:
    # Qdrant keeps string, integer, float and boolean apart: True is not 1, 3.0 is not 3.
    return type(value) is type(wanted) and value == wanted


def _in_range(r: Range, value: Any) -> bool:
    if r.is_date:
        if not isinstance(value, str):
            return False
        value = parse_date(value)
        if value is None:
            return False
        bounds = r.bounds()
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        value = float(value)  # the engine compares as f64
        bounds = {b: float(v) for b, v in r.bounds().items()}
    return (("gt" not in bounds or value > bounds["gt"]) and ("gte" not in bounds or value >= bounds["gte"])
            and ("lt" not in bounds or value < bounds["lt"]) and ("lte" not in bounds or value <= bounds["lte"]))


def matches(where: Where, item: Mapping) -> bool:
    """Whether one payload item (``{"owner", "job"?, "external_id"?, "m"}``) satisfies ``where``,
    exactly as Qdrant evaluates the filter (module docstring: semantics)."""
    if isinstance(where, And):
        return all(matches(w, item) for w in where.items)
    if isinstance(where, Or):
        return any(matches(w, item) for w in where.items)
    if isinstance(where, Not):
        return not matches(where.item, item)
    values = _values(item, where.field)
    if isinstance(where, Exists):
        return bool(values)
    if isinstance(where, Eq):
        if isinstance(where.value, float):
            return any(_in_range(Range(where.field, gte=where.value, lte=where.value), v) for v in values)
        return any(_same(v, where.value) for v in values)
    if isinstance(where, AnyOf):
        return any(_same(v, w) for v in values for w in where.values)
    if isinstance(where, Range):
        return any(_in_range(where, v) for v in values)
    raise TypeError(f"not a filter: {where!r}")


def item_matches(item: Mapping, where: Where | None = None, *, owner_id: int | None = None,
                 job_id: str | None = None) -> bool:
    """Whether ``item`` belongs to ``owner_id`` (if given), to ``job_id`` (if given) and satisfies ``where``."""
    if owner_id is not None and not _same(item.get("owner"), int(owner_id)):
        return False
    if job_id is not None and item.get("job") != str(job_id):
        return False
    return where is None or matches(where, item)


def matching_items(payload: Mapping, where: Where | None = None, *, owner_id: int | None = None,
                   job_id: str | None = None) -> list[dict]:
    """The items of a point's ``payload`` that make it a hit (:func:`item_matches`), in payload order."""
    return [it for it in payload.get("items") or () if item_matches(it, where, owner_id=owner_id, job_id=job_id)]


# --- Qdrant filters --------------------------------------------------------------------------------


def item_key(field: str) -> str:
    """The key of ``field`` inside one payload item (``m.<field>``; ``external_id`` as is)."""
    return field if field == EXTERNAL_ID else f"m.{field}"


def _iso(dt: datetime) -> str:
    return dt.astimezone(UTC).isoformat()


def to_edge(where: Where | None, *, owner_id: int | None = None, job_id: str | None = None,
            exclude: Iterable = ()):
    """The ``qdrant_edge.Filter`` for a search (None when there is nothing to filter).

    Without ``where``: the top-level ``owner_ids`` / ``job_ids`` conditions (their indexes are the
    fastest path). With it: one nested condition on ``items`` holding owner, job and ``where``, so
    all three hold for the same item; the top-level ``owner_ids`` / ``job_ids`` conditions stay
    beside it (implied by the item's, and they let the planner start from their indexes).
    ``exclude``: point ids left out.
    """
    import numpy as np
    import qdrant_edge as qe

    def field_eq(key: str, value):
        # qdrant-edge reads a Python bool as the integer 1 or 0 (it tries int first); numpy's bool_
        # is not an int, so it arrives as a JSON boolean.
        return qe.FieldCondition(key, match=qe.MatchValue(np.bool_(value) if isinstance(value, bool) else value))

    def conv(w):
        if isinstance(w, And):
            return qe.Filter(must=[conv(x) for x in w.items])
        if isinstance(w, Or):
            return qe.Filter(should=[conv(x) for x in w.items])
        if isinstance(w, Not):
            return qe.Filter(must_not=[conv(w.item)])
        key = item_key(w.field)
        if isinstance(w, Exists):
            return qe.Filter(must_not=[qe.IsEmptyCondition(key)])
        if isinstance(w, Eq):
            if isinstance(w.value, float):
                return qe.FieldCondition(key, range=qe.RangeFloat(gte=w.value, lte=w.value))
            return field_eq(key, w.value)
        if isinstance(w, AnyOf):
            return qe.FieldCondition(key, match=qe.MatchAny(list(w.values)))
        if isinstance(w, Range):
            if w.is_date:
                return qe.FieldCondition(key, range=qe.RangeDateTime(**{b: _iso(v) for b, v in w.bounds().items()}))
            return qe.FieldCondition(key, range=qe.RangeFloat(**{b: float(v) for b, v in w.bounds().items()}))
        raise TypeError(f"not a filter: {w!r}")

    must = []
    if owner_id is not None:
        must.append(field_eq("owner_ids", int(owner_id)))
    if job_id is not None:
        must.append(field_eq("job_ids", str(job_id)))
    if where is not None:
        inner = ([field_eq("owner", int(owner_id))] if owner_id is not None else []) + \
                ([field_eq("job", str(job_id))] if job_id is not None else []) + [conv(where)]
        must.append(qe.NestedCondition("items", qe.Filter(must=inner)))
    exclude = {str(i) for i in exclude}
    must_not = [qe.HasIdCondition(exclude)] if exclude else None
    return qe.Filter(must=must or None, must_not=must_not) if (must or must_not) else None


def to_client(where: Where | None, *, owner_id: int | None = None, job_id: str | None = None,
              exclude: Iterable = ()):
    """The ``qdrant_client.models.Filter`` for a search (None when there is nothing to filter):
    the same conditions as :func:`to_edge`, for the ``local`` and ``server`` backends."""
    from qdrant_client import models

    def field_eq(key: str, value):
        return models.FieldCondition(key=key, match=models.MatchValue(value=value))

    def conv(w):
        if isinstance(w, And):
            return models.Filter(must=[conv(x) for x in w.items])
        if isinstance(w, Or):
            return models.Filter(should=[conv(x) for x in w.items])
        if isinstance(w, Not):
            return models.Filter(must_not=[conv(w.item)])
        key = item_key(w.field)
        if isinstance(w, Exists):
            return models.Filter(must_not=[models.IsEmptyCondition(is_empty=models.PayloadField(key=key))])
        if isinstance(w, Eq):
            if isinstance(w.value, float):
                return models.FieldCondition(key=key, range=models.Range(gte=w.value, lte=w.value))
            return field_eq(key, w.value)
        if isinstance(w, AnyOf):
            return models.FieldCondition(key=key, match=models.MatchAny(any=list(w.values)))
        if isinstance(w, Range):
            if w.is_date:
                return models.FieldCondition(key=key, range=models.DatetimeRange(**w.bounds()))
            return models.FieldCondition(key=key, range=models.Range(**{b: float(v) for b, v in w.bounds().items()}))
        raise TypeError(f"not a filter: {w!r}")

    must = []
    if owner_id is not None:
        must.append(field_eq("owner_ids", int(owner_id)))
    if job_id is not None:
        must.append(field_eq("job_ids", str(job_id)))
    if where is not None:
        inner = ([field_eq("owner", int(owner_id))] if owner_id is not None else []) + \
                ([field_eq("job", str(job_id))] if job_id is not None else []) + [conv(where)]
        must.append(models.NestedCondition(nested=models.Nested(key="items", filter=models.Filter(must=inner))))
    exclude = [str(i) for i in exclude]
    must_not = [models.HasIdCondition(has_id=exclude)] if exclude else None
    return models.Filter(must=must or None, must_not=must_not) if (must or must_not) else None


# --- payload indexes -------------------------------------------------------------------------------


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
        for v in _values({"m": metadata}, field):
            if not _fits(v, kind):
                what = {"keyword": "a string", "integer": "an integer", "float": "a number", "bool": "a boolean",
                        "datetime": "an ISO 8601 date"}[kind]
                raise ValueError(f"metadata field {field!r} is indexed as {kind}: {repr(v)[:80]} is not {what}")


def payload_indexes(indexed_fields: Mapping[str, str] | None) -> dict[str, str]:
    """Item-level payload indexes to keep: ``{"items[].owner": "integer", "items[].m.<field>": type}``."""
    return {OWNER_INDEX: "integer",
            **{f"items[].{item_key(f)}": t for f, t in check_indexed_fields(indexed_fields).items()}}


__all__ = ["EXTERNAL_ID", "INDEX_TYPES", "MAX_CONDITIONS", "MAX_DEPTH", "MAX_IN", "MAX_STRING", "And", "AnyOf",
           "Eq", "Exists", "FilterError", "Not", "Or", "Range", "Where", "check_field", "check_indexed_fields",
           "check_metadata",
           "dump", "item_key", "item_matches", "json_schema", "matches", "matching_items", "parse",
           "parse_date", "parse_indexed_fields", "payload_indexes", "to_client", "to_edge"]
