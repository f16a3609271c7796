"""API keys: made (the secret returned once, a hash kept), checked on every request, revoked, and
made from DRF's plaintext tokens (``manage.py apikeys migrate-tokens``).

A secret is ``ck_<prefix>_<43 URL-safe characters>`` (256 random bits); the key row keeps its
SHA-256 (hex) and the public ``ck_<prefix>``. A migrated DRF token keeps its own 40 hexadecimal
characters as the secret (its clients change nothing); only its hash is kept. Lookup is by the
hash (unique index), then compared in constant time.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import logging
import math
import re
import secrets
from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.utils import timezone
from rest_framework.authtoken.models import Token

from embeddings.errors import ApplicationError
from embeddings.models import ADMIN_SCOPE, BULK_WEIGHT_MAX, BULK_WEIGHT_MIN, LIMIT_SETTINGS, USER_SCOPES, ApiKey

from .scopes import scopes_resolve

log = logging.getLogger(__name__)

#: A credential as it may appear after ``Bearer``/``Token``: URL-safe characters, 20-200 of them
#: (a key is 55, a DRF token 40). Anything else is ``key_malformed`` before any lookup.
WELL_FORMED = re.compile(r"[A-Za-z0-9_\-]{20,200}\Z")
_PREFIX_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
#: The largest limit a key holds (its columns are PostgreSQL integers).
LIMIT_MAX = 2 ** 31 - 1
#: What staff set per key: the counted limits (:data:`LIMIT_SETTINGS`) and the bulk lane's weight.
LIMITS = (*LIMIT_SETTINGS, "bulk_weight")
#: ``last_used_at`` is written when older than this (s): one UPDATE per key per minute, not per request.
TOUCH_EVERY_S = 60.0


def secret_hash(secret: str) -> str:
    """SHA-256 of ``secret`` (UTF-8) as 64 hexadecimal characters: what a key row stores."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _new_prefix() -> str:
    return "ck_" + "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(8))


@dataclass(frozen=True)
class NewKey:
    """A key just made: the row, and its secret (never stored, shown once)."""

    key: ApiKey
    secret: str


def _limits_check(limits: dict) -> dict:
    """``limits``: names of :data:`LIMIT_SETTINGS` → a whole number in 1..:data:`LIMIT_MAX`;
    ``bulk_weight`` → a finite number in :data:`BULK_WEIGHT_MIN`..:data:`BULK_WEIGHT_MAX`; either
    ``None``: the default.

    Raises:
        ApplicationError: 400 ``invalid_limit`` (``extra.limit``, ``extra.value``).
    """
    out = {}
    for name, value in limits.items():
        if name not in LIMITS:
            raise ApplicationError(f"unknown limit {name!r} (limits: {', '.join(LIMITS)})",
                                   code="invalid_limit", extra={"limit": str(name)[:100], "value": None})
        if value is None:
            out[name] = None
        elif name == "bulk_weight":
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not BULK_WEIGHT_MIN <= value <= BULK_WEIGHT_MAX):
                raise ApplicationError(f"bulk_weight must be a number from {BULK_WEIGHT_MIN:g} to "
                                       f"{BULK_WEIGHT_MAX:g} (or null: the owner's weight)",
                                       code="invalid_limit", extra={"limit": name, "value": str(value)[:100]})
            out[name] = float(value)
        elif isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LIMIT_MAX:
            raise ApplicationError(f"{name} must be a whole number from 1 to {LIMIT_MAX} (or null: the default)",
                                   code="invalid_limit", extra={"limit": name, "value": str(value)[:100]})
        else:
            out[name] = value
    return out


def key_create(*, owner, name: str, scopes: list[str], expires_at: dt.datetime | None = None,
               limits: dict | None = None, by_staff: bool = False) -> NewKey:
    """A new key of ``owner``: ``scopes`` (scopes and presets) resolved, the secret made and hashed.

    Args:
        limits: per-key limits (:data:`LIMITS` names); only staff (``by_staff``) may set them.

    Raises:
        ApplicationError: ``unknown_scope``/``no_scopes``/``scope_not_allowed`` (:func:`scopes_resolve`);
            400 ``invalid_expiry`` (``expires_at`` not in the future); 403 ``forbidden`` (limits by a
            non-staff caller); 400 ``invalid_limit``.
    """
    resolved = scopes_resolve(names=scopes, owner=owner)
    if expires_at is not None and expires_at <= timezone.now():
        raise ApplicationError("expires_at must be in the future", code="invalid_expiry",
                               extra={"expires_at": expires_at.isoformat()})
    limits = _limits_check(limits or {})
    if limits and not by_staff:
        raise ApplicationError("only staff set a key's limits", code="forbidden", status=403)
    for _ in range(5):  # a prefix collision (36^8 of them) is retried with a new one
        prefix = _new_prefix()
        secret = f"{prefix}_{secrets.token_urlsafe(32)}"
        try:
            with transaction.atomic():
                key = ApiKey.objects.create(owner=owner, name=name, prefix=prefix, secret_hash=secret_hash(secret),
                                            scopes=resolved, expires_at=expires_at, **limits)
        except IntegrityError:
            continue
        log.info("api key %s made for user %s (scopes %s)", prefix, owner.pk, ",".join(resolved))
        return NewKey(key, secret)
    raise RuntimeError("no free key prefix after 5 tries")


def key_revoke(*, key: ApiKey) -> ApiKey:
    """``key`` revoked now (a revoked key stays revoked: its first time is kept)."""
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        log.info("api key %s revoked", key.prefix)
    return key


class KeyRefused(Exception):
    """A credential that authenticates nothing: ``code`` is ``key_malformed``, ``key_unknown``,
    ``key_revoked``, ``key_expired`` or ``user_inactive``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def key_authenticate(secret: str) -> ApiKey | None:
    """The active key whose secret is ``secret`` (its ``owner`` loaded), or ``None`` when no key has
    that hash (it may still be a DRF token not yet migrated). Writes ``last_used_at`` at most once a
    minute.

    Raises:
        KeyRefused: ``key_malformed`` (not :data:`WELL_FORMED`), ``key_revoked``, ``key_expired``,
            ``user_inactive``.
    """
    if not WELL_FORMED.match(secret):
        raise KeyRefused("the key is malformed: 20-200 letters, digits, '-' or '_'", "key_malformed")
    digest = secret_hash(secret)
    # secret_hash is unique: a slice, not first(), whose ORDER BY on the join doubles the query's
    # build time on every authenticated request (docs/benchmarks-lanes.md, "What holds today")
    key = next(iter(ApiKey.objects.select_related("owner").filter(secret_hash=digest)[:1]), None)
    if key is None or not hmac.compare_digest(key.secret_hash, digest):
        return None
    now = timezone.now()
    state = key.state(now)
    if state != "active":
        raise KeyRefused(f"the key {key.prefix} is {state}", f"key_{state}")
    if not key.owner.is_active:
        raise KeyRefused("the key's user is inactive", "user_inactive")
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() >= TOUCH_EVERY_S:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key


def tokens_migrate() -> list[ApiKey]:
    """Every DRF ``authtoken`` token turned into a key whose hash is of the same secret (scopes
    ``all``, and ``admin`` for a staff owner: what the token could do), named ``migrated token``,
    its ``created_at`` the token's; then the plaintext row deleted. Idempotent: a token whose key
    exists already is only deleted. Returns the keys made."""
    made = []
    for token in Token.objects.select_related("user").order_by("created"):
        with transaction.atomic():
            digest = secret_hash(token.key)
            if not ApiKey.objects.filter(secret_hash=digest).exists():
                scopes = [*USER_SCOPES, *([ADMIN_SCOPE] if token.user.is_staff else [])]
                for _ in range(5):
                    try:
                        with transaction.atomic():
                            made.append(ApiKey.objects.create(
                                owner=token.user, name="migrated token", prefix=_new_prefix(), secret_hash=digest,
                                scopes=scopes, created_at=token.created))
                        break
                    except IntegrityError:
                        continue
            Token.objects.filter(pk=token.pk).delete()
    return made
