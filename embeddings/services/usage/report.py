"""Usage read back: the counter rows of a date range, grouped and priced (``GET /api/usage/``, the
site's usage page).

Cost (docs/usage.md, "Cost"): ``cost = compute_s / 3600 × USAGE_PRICE_PER_WORKER_HOUR``, the price
of a worker-hour as ``benchmarks.bulk --price-per-hour`` prices it; ``cost_per_image`` is the cost
of the image kinds' compute over the images embedded (``None`` where none were).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import re

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import Sum

from embeddings.errors import ApplicationError
from embeddings.models import IMAGE_KINDS, UsageKind, UsageRecord

#: What a report may be grouped by: the request's name → the counter row's field.
GROUPS = {"key": "key_prefix", "model": "model_id", "day": "day", "kind": "kind", "owner": "owner_id"}

#: A date as the API takes it: ``YYYY-MM-DD`` (ISO 8601's calendar date, nothing else it allows).
DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")

#: The per-kind columns of every report row: its name → the kind it sums.
COLUMNS = {
    "images_interactive": UsageKind.IMAGE_INTERACTIVE, "images_bulk": UsageKind.IMAGE_BULK,
    "images_reembed": UsageKind.IMAGE_REEMBED, "texts": UsageKind.TEXT, "searches": UsageKind.SEARCH,
    "fetches": UsageKind.FETCH, "duplicates": UsageKind.DUPLICATE,
}


@dataclasses.dataclass(frozen=True)
class UsageQuery:
    """One report's question: the UTC days ``start``..``end`` (both counted), whose usage
    (``owner_id``; ``None``: every owner, staff only), grouped by ``group_by`` (names of :data:`GROUPS`,
    in the order given)."""

    start: dt.date
    end: dt.date
    owner_id: int | None
    group_by: tuple[str, ...] = ()


def usage_query(*, user, start: str | None, end: str | None, group_by: str | None, owner: str | None,
                today: dt.date | None = None) -> UsageQuery:
    """Check a report's parameters as the API and the site get them (text, or ``None`` when absent).

    Defaults: ``end`` today (UTC), ``start`` so that the range is 30 days (``USAGE_MAX_RANGE_DAYS``
    where that is fewer); ``group_by`` none (one total row); ``owner`` the caller. Staff may name
    another user by id, or ``all``. A name given twice in ``group_by`` counts once.

    Raises:
        ApplicationError: ``invalid_date`` (400: a date that is not ``YYYY-MM-DD``),
            ``usage_range_inverted`` (400: ``end`` before ``start``), ``usage_range_too_long`` (400:
            more than ``USAGE_MAX_RANGE_DAYS`` days, both ends counted), ``invalid_group_by`` (400: a
            name not in :data:`GROUPS`), ``forbidden`` (403: ``owner`` other than
            the caller, not staff), ``invalid_owner`` (400: neither an id nor ``all``), ``not_found``
            (404: no such user).
    """
    today = today or dt.datetime.now(dt.timezone.utc).date()
    # a parameter given empty is a date that is not one (400), not the default: the schema says so
    end_day = _date("end", end) if end is not None else today
    start_day = _date("start", start) if start is not None else end_day - dt.timedelta(days=min(30, settings.USAGE_MAX_RANGE_DAYS) - 1)
    if end_day < start_day:
        raise ApplicationError(f"end {end_day} is before start {start_day}", code="usage_range_inverted",
                               extra={"start": str(start_day), "end": str(end_day)})
    days = (end_day - start_day).days + 1
    if days > settings.USAGE_MAX_RANGE_DAYS:
        raise ApplicationError(f"{days} days; a usage report covers at most USAGE_MAX_RANGE_DAYS "
                               f"({settings.USAGE_MAX_RANGE_DAYS}) days", code="usage_range_too_long",
                               extra={"limit": "USAGE_MAX_RANGE_DAYS", "value": settings.USAGE_MAX_RANGE_DAYS,
                                      "days": days})
    names = tuple(dict.fromkeys(n.strip() for n in (group_by or "").split(",") if n.strip()))  # a repeat: once
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise ApplicationError(f"group_by takes {', '.join(GROUPS)}, comma-separated", code="invalid_group_by",
                               extra={"group_by": unknown[:10]})
    return UsageQuery(start=start_day, end=end_day, owner_id=_owner(user, owner), group_by=names)


def _date(name: str, text: str) -> dt.date:
    """``text`` as a date; raises ``invalid_date`` (400) naming the parameter ``name``."""
    try:
        if DATE.fullmatch(text):
            return dt.date.fromisoformat(text)
    except ValueError:
        pass
    raise ApplicationError(f"{name} must be a date, YYYY-MM-DD (UTC)", code="invalid_date", extra={"fields": [name]})


def _owner(user, owner: str | None) -> int | None:
    if owner == "":
        raise ApplicationError("owner is a user id or 'all'", code="invalid_owner", extra={"fields": ["owner"]})
    if owner is None or owner == str(user.id):
        return user.id
    if not user.is_staff:
        raise ApplicationError("only staff may read another owner's usage", code="forbidden", status=403)
    if owner == "all":
        return None
    if not owner.isascii() or not owner.isdigit() or len(owner) > 18:
        raise ApplicationError("owner is a user id or 'all'", code="invalid_owner", extra={"fields": ["owner"]})
    if not get_user_model().objects.filter(id=int(owner)).exists():
        raise ApplicationError("no such user", code="not_found", status=404)
    return int(owner)


def usage_report(query: UsageQuery) -> dict:
    """The usage ``query`` asks for.

    Returns:
        ``{"start", "end" (ISO dates), "owner" (id or None: all), "group_by": [...],
        "price_per_worker_hour", "data": [row, ...], "total": row}``; each row holds its group's
        values (``key``: the key's prefix or ``None`` for a session or legacy token; ``model``;
        ``day`` ISO; ``kind``; ``owner``), then :data:`COLUMNS` (units), ``images`` (the three image
        kinds), ``bytes`` (fetched), ``compute_s``, ``cost`` and ``cost_per_image`` (``None``
        without images). Rows are ordered by their group values (days ascending).
    """
    rows = UsageRecord.objects.filter(day__gte=query.start, day__lte=query.end)
    if query.owner_id is not None:
        rows = rows.filter(owner_id=query.owner_id)
    fields = [GROUPS[n] for n in query.group_by]
    per = fields if "kind" in fields else [*fields, "kind"]  # every row's kind says which column it adds to
    sums = (rows.values(*per).annotate(units=Sum("units"), nbytes=Sum("bytes"), compute=Sum("compute_s"))
            .order_by(*per))
    groups: dict[tuple, dict] = {}
    total = _empty()
    for r in sums:
        group = tuple(r[f] for f in fields)
        row = groups.setdefault(group, _empty())
        for target in (row, total):
            _add(target, r["kind"], r["units"] or 0, r["nbytes"] or 0, r["compute"] or 0.0)
    data = [{**{n: _shown(n, v) for n, v in zip(query.group_by, group)}, **_priced(row)}
            for group, row in groups.items()]
    return {"start": query.start.isoformat(), "end": query.end.isoformat(), "owner": query.owner_id,
            "group_by": list(query.group_by), "price_per_worker_hour": settings.USAGE_PRICE_PER_WORKER_HOUR,
            "data": data, "total": _priced(total)}


def _empty() -> dict:
    return {**{c: 0 for c in COLUMNS}, "bytes": 0, "compute_s": 0.0, "image_compute_s": 0.0}


def _add(row: dict, kind: str, units: int, nbytes: int, compute_s: float) -> None:
    for column, k in COLUMNS.items():
        if k == kind:
            row[column] += units
    row["bytes"] += nbytes
    row["compute_s"] += compute_s
    if kind in IMAGE_KINDS:
        row["image_compute_s"] += compute_s


def _priced(row: dict) -> dict:
    """A summed row with its images, cost and cost per image (``image_compute_s`` is only its basis)."""
    price = settings.USAGE_PRICE_PER_WORKER_HOUR
    out = {k: v for k, v in row.items() if k != "image_compute_s"}
    images = row["images_interactive"] + row["images_bulk"] + row["images_reembed"]
    out["images"] = images
    out["compute_s"] = round(row["compute_s"], 6)
    out["cost"] = row["compute_s"] / 3600 * price
    out["cost_per_image"] = row["image_compute_s"] / 3600 * price / images if images else None
    return out


def _shown(name: str, value):
    if name == "key":
        return value or None
    if name == "day":
        return value.isoformat()
    return value
