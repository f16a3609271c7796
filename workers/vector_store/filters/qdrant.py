"""The Qdrant payload filters that apply a :data:`Where` inside the vector query (edge and client)."""
from __future__ import annotations

from collections.abc import Iterable

from .where import EXTERNAL_ID, And, AnyOf, Eq, Exists, Not, Or, Range, Where, iso_utc


def item_key(field: str) -> str:
    """The key of ``field`` inside one payload item (``m.<field>``; ``external_id`` as is)."""
    return field if field == EXTERNAL_ID else f"m.{field}"


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
                return qe.FieldCondition(key, range=qe.RangeDateTime(**{b: iso_utc(v) for b, v in w.bounds().items()}))
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
