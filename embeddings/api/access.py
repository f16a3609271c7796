"""Scopes and per-key limits at the API's door (docs/api-keys.md).

- :class:`HasScope` (a default permission): each view declares once the scope it needs,
  ``required_scope`` = a scope, or ``{method: scope}`` where reading and writing differ (``HEAD``
  and ``OPTIONS`` read as ``GET``); a credential without it is refused with 403 ``insufficient_scope``.
- :class:`KeyRequestLimit` (a default throttle): one request of a key's per-minute limit, after
  authentication and the scope check; a refusal is 429 ``rate_limited`` with ``Retry-After``.
- :func:`scope_check`: a second scope an option needs; :func:`images_taken`, :func:`bulk_job`: what
  the views that take images call.
- :class:`RateLimitHeadersMiddleware`: the ``x-ratelimit-*`` headers on every answer to a key.
"""
from __future__ import annotations

import contextlib

from rest_framework import exceptions
from rest_framework.permissions import BasePermission
from rest_framework.throttling import BaseThrottle

from embeddings.errors import ApplicationError
from embeddings.models import ADMIN_SCOPE, ApiKey
from embeddings.services.access import limits
from embeddings.services.access.scopes import scopes_held

#: The attribute of Django's request the answer's ``x-ratelimit-*`` headers are gathered in.
HEADERS_ATTR = "ratelimit_headers"


class InsufficientScope(ApplicationError, exceptions.PermissionDenied):
    """403 ``insufficient_scope`` (``extra.required``, ``extra.held``): an ApplicationError for the
    error shape, and DRF's ``PermissionDenied`` for DRF's own permission probes (an ``OPTIONS``
    answer lists only the methods the credential may use)."""

    def __init__(self, scope: str | None, held: frozenset[str]) -> None:
        message = f"this key lacks the scope {scope!r}" if scope else "this operation declares no scope: no key " \
                                                                        "may call it"
        ApplicationError.__init__(self, message, code="insufficient_scope", status=403,
                                  extra={"required": scope, "held": sorted(held)})
        self.detail = exceptions.ErrorDetail(message, code="insufficient_scope")


def required_scope(view, method: str) -> str | None:
    """The scope ``view`` declares for ``method`` (``None``: it declares none for that method)."""
    declared = getattr(view, "required_scope", None)
    if declared is None or isinstance(declared, str):
        return declared
    if method in ("HEAD", "OPTIONS"):
        return declared.get("GET") or next(iter(declared.values()))
    return declared.get(method)


class HasScope(BasePermission):
    """The request's credential holds its view's scope (:func:`required_scope`).

    ``admin`` asked of a user who is not staff is 403 ``forbidden`` ("staff only"), as the staff-only
    views answer themselves. A view under the API that declares no scope is refused to every key (a
    route nobody declared is closed, not open); sessions and DRF tokens hold every scope their user
    may hold (``scopes.scopes_held``).

    Raises:
        ApplicationError: 403 ``insufficient_scope`` (``extra.required``, ``extra.held``); 403 ``forbidden``.
    """

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated):
            return True  # IsAuthenticated, before this, answers 401 where a credential is needed
        scope = required_scope(view, request.method)
        if scope is None:
            if getattr(view, "required_scope", None) is None and isinstance(request.auth, ApiKey):
                raise InsufficientScope(None, frozenset())
            return True  # a method the view does not have: its 405
        held = scopes_held(user=user, auth=request.auth)
        if scope == ADMIN_SCOPE and not (user.is_staff or getattr(request.auth, "staff_owner", False)):
            raise ApplicationError("staff only", code="forbidden", status=403)  # no scope makes a user staff
        if scope not in held:
            raise InsufficientScope(scope, held)
        return True


def scope_check(request, scope: str) -> None:
    """For what one option of an operation adds (``store`` of the embeddings endpoint writes
    images): the request's credential holds ``scope`` too.

    Raises:
        ApplicationError: 403 ``insufficient_scope``.
    """
    held = scopes_held(user=request.user, auth=request.auth)
    if scope not in held:
        raise InsufficientScope(scope, held)


def _gather(request, headers: dict[str, str]) -> None:
    django_request = getattr(request, "_request", request)
    getattr(django_request, HEADERS_ATTR, None) or setattr(django_request, HEADERS_ATTR, {})
    getattr(django_request, HEADERS_ATTR).update(headers)


class KeyRequestLimit(BaseThrottle):
    """One request of an API key against its requests-per-minute limit (``limits.request_admit``);
    other credentials pass.

    Raises:
        ApplicationError: 429 ``rate_limited`` with ``Retry-After`` and the ``x-ratelimit-*-requests`` headers.
    """

    def allow_request(self, request, view) -> bool:
        if isinstance(request.auth, ApiKey):
            _gather(request, limits.request_admit(key=request.auth))
        return True


def images_taken(request, images: int) -> None:
    """Count ``images`` interactive images of the request's key (``limits.images_admit``); other
    credentials pass. Raises its ApplicationErrors (429 ``rate_limited``, 413 ``exceeds_key_limit``)."""
    if isinstance(request.auth, ApiKey):
        _gather(request, limits.images_admit(key=request.auth, images=images))


@contextlib.contextmanager
def bulk_job(request, images: int):
    """Around the making of a bulk job of ``images`` images (0: not known at submission): a slot
    of the key's concurrent jobs and the day's bulk images, refused before anything is made; yields
    a function the block calls with the job's id once made. Other credentials pass.

    Raises:
        ApplicationError: 429 ``rate_limited`` (``Retry-After``), 413 ``exceeds_key_limit``.
    """
    key = request.auth if isinstance(request.auth, ApiKey) else None
    if key is None:
        yield lambda job_id: None
        return
    slot = limits.job_slot_reserve(key=key)
    made = []
    try:
        _gather(request, limits.bulk_images_admit(key=key, images=images))
        yield made.append
    finally:
        if made:
            slot.fill(made[0])
        else:
            slot.release()


class RateLimitHeadersMiddleware:
    """Adds the ``x-ratelimit-*`` headers gathered while answering a key's request."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        for name, value in (getattr(request, HEADERS_ATTR, None) or {}).items():
            if name not in response:
                response[name] = value
        return response
