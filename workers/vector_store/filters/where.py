"""The typed filter (:data:`Where`), its bounds and errors, and its JSON form (:func:`parse`, :func:`dump`,
:func:`json_schema`); the package docstring gives the grammar and the semantics."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import unicodedata
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
        return {"field": where.field, **{b: iso_utc(v) if isinstance(v, datetime) else v
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


def iso_utc(dt: datetime) -> str:
    """``dt`` in UTC as RFC 3339 (what Qdrant's datetime conditions and indexes read)."""
    return dt.astimezone(UTC).isoformat()
