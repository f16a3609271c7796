"""Scopes: what a key may be made with, and what a request's credential holds.

The vocabulary is :data:`embeddings.models.SCOPES`; a key names scopes and presets
(:data:`embeddings.models.PRESETS`). A session, or a DRF token not yet migrated, holds every scope
its user may hold: :data:`~embeddings.models.USER_SCOPES`, and ``admin`` for staff (they predate
scopes: nothing they did before is taken away).
"""
from __future__ import annotations

from collections.abc import Iterable

from embeddings.errors import ApplicationError
from embeddings.models import ADMIN_SCOPE, PRESETS, SCOPES, USER_SCOPES, ApiKey


def scopes_resolve(*, names: Iterable[str], owner) -> list[str]:
    """The scopes ``names`` stand for (scopes and presets), in :data:`SCOPES` order, for a key of ``owner``.

    Raises:
        ApplicationError: 400 ``unknown_scope`` (``extra.unknown``: the names neither a scope nor a
            preset; ``extra.scopes``, ``extra.presets``: the valid ones); 400 ``no_scopes`` when empty;
            403 ``scope_not_allowed`` for ``admin`` asked by someone not staff.
    """
    names = list(names)
    unknown = sorted({n for n in names if n not in SCOPES and n not in PRESETS}, key=str)
    if unknown:
        raise ApplicationError(f"unknown scopes: {', '.join(map(str, unknown))}", code="unknown_scope",
                               extra={"unknown": unknown[:10], "scopes": list(SCOPES), "presets": list(PRESETS)})
    wanted = set()
    for n in names:
        wanted.update(PRESETS.get(n, (n,)))
    if not wanted:
        raise ApplicationError("a key needs at least one scope or preset", code="no_scopes",
                               extra={"scopes": list(SCOPES), "presets": list(PRESETS)})
    if ADMIN_SCOPE in wanted and not owner.is_staff:
        raise ApplicationError("the admin scope is for staff only", code="scope_not_allowed", status=403,
                               extra={"scope": ADMIN_SCOPE})
    return [s for s in SCOPES if s in wanted]


def scopes_held(*, user, auth) -> frozenset[str]:
    """The scopes a request holds: an :class:`ApiKey`'s own (``admin`` only while its owner is
    staff), else (a session, a DRF token) every scope ``user`` may hold."""
    if isinstance(auth, ApiKey):
        held = frozenset(auth.scopes)
        return held if user.is_staff else held - {ADMIN_SCOPE}
    return frozenset(USER_SCOPES) | ({ADMIN_SCOPE} if user.is_staff else frozenset())
