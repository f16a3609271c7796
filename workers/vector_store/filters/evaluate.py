"""The exact evaluator: :func:`matches` reproduces Qdrant's semantics on one payload item."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .where import (
    EXTERNAL_ID,
    And,
    AnyOf,
    Eq,
    Exists,
    Not,
    Or,
    Range,
    Where,
    parse_date,
)


def field_values(item: Mapping, field: str) -> list:
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
    values = field_values(item, where.field)
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
