"""What files and batches share: one row of an owner's by id, and a page of an owner's rows after
another one (keyset pagination on ``(created_at, id)``), each a 404 naming the id when it is not
the owner's."""
from __future__ import annotations

import re

from django.db.models import Model, Q, QuerySet

from embeddings.errors import ApplicationError


def owned_get(model: type[Model], pattern: re.Pattern, *, owner, pk, noun: str, param: str) -> Model:
    """The owner's ``model`` row ``pk``; an id that does not match ``pattern`` names none and is never
    sent to the database.

    Raises:
        ApplicationError: ``not_found`` (404, ``param``): no such row, or another owner's.
    """
    row = model.objects.filter(id=pk, owner=owner).first() if pattern.fullmatch(str(pk)) else None
    if row is None:
        raise ApplicationError(f"{'after: ' if param == 'after' else ''}no {noun} {str(pk)[:64]!r}", code="not_found",
                               status=404, extra={"param": param})
    return row


def page_after(rows: QuerySet, pattern: re.Pattern, *, owner, after: str | None, limit: int, noun: str,
               order: str = "desc") -> tuple[list, bool]:
    """At most ``limit`` of ``rows`` (an owner's) by creation time (``desc``: newest first), those
    after the row ``after`` (its id) only. Returns ``(rows, has_more)``.

    Raises:
        ApplicationError: ``not_found`` (404, ``param`` after): ``after`` names no row of the owner.
    """
    if after:
        mark = owned_get(rows.model, pattern, owner=owner, pk=after, noun=noun, param="after")
        newer = Q(created_at__gt=mark.created_at) | Q(created_at=mark.created_at, id__gt=mark.id)
        older = Q(created_at__lt=mark.created_at) | Q(created_at=mark.created_at, id__lt=mark.id)
        rows = rows.filter(older if order == "desc" else newer)
    rows = rows.order_by(*(("-created_at", "-id") if order == "desc" else ("created_at", "id")))
    page = list(rows[:limit + 1])
    return page[:limit], len(page) > limit
