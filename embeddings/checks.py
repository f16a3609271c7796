"""Start-up checks: configuration that would break the "nothing lost, nothing duplicated" promise.

Redis redelivers an unacknowledged message once ``visibility_timeout`` has passed, even while the
first delivery is still running (celery/celery#5935). Writes are idempotent (deterministic point
ids), so a redelivery never duplicates a point, but a chunk that routinely outlives the timeout
would run twice, forever. So a bulk chunk's hard time limit must be shorter than the visibility
timeout, and the broker must be told the same timeout the settings name.

Two hooks run :func:`time_limit_errors`:
- a Django system check (``manage.py check``, ``migrate``, ``runserver``) reports them as errors;
- a Celery ``worker_init`` handler refuses to start a worker (exit status 78, EX_CONFIG), because
  Celery runs Django's checks without acting on them.

The broker's Redis must keep every queued message: at its ``maxmemory`` it must refuse writes
(``noeviction``, which Celery's docs ask for; the API then answers 503 ``broker_full``), never
evict keys, which would drop queued messages, results and lane state silently.
:func:`broker_eviction_warning` says so as the system check ``embeddings.W003`` and in each
worker's log at start-up; a warning, not a refusal: Redis is someone else's to configure, and
nothing is lost until memory fills.
"""
from __future__ import annotations

import logging

import redis
from celery.signals import worker_init
from django.conf import settings
from django.core import checks
from django.db import DatabaseError

from embeddings import runtime

log = logging.getLogger(__name__)

#: ``sysexits.h`` EX_CONFIG: a worker refuses to start on a configuration error.
EX_CONFIG = 78


def time_limit_errors() -> list[str]:
    """Human sentences naming each broken invariant between chunk time limits and redelivery.

    Returns:
        ``[]`` when ``CELERY_BULK_TIME_LIMIT_S`` < ``CELERY_VISIBILITY_TIMEOUT_S`` and the broker's
        transport options carry that same visibility timeout.
    """
    errors = []
    limit = settings.CELERY_BULK_TIME_LIMIT_S
    timeout = settings.CELERY_VISIBILITY_TIMEOUT_S
    broker_timeout = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout")
    if limit <= 0:
        errors.append(f"CELERY_BULK_TIME_LIMIT_S is {limit}; a bulk chunk needs a positive hard time limit")
    if limit >= timeout:
        errors.append(
            f"CELERY_BULK_TIME_LIMIT_S ({limit} s) must be shorter than CELERY_VISIBILITY_TIMEOUT_S ({timeout} s): "
            f"Redis would deliver a running chunk a second time (celery/celery#5935)"
        )
    if broker_timeout != timeout:
        errors.append(
            f"the broker's visibility_timeout ({broker_timeout}) differs from CELERY_VISIBILITY_TIMEOUT_S ({timeout})"
        )
    return errors


@checks.register(checks.Tags.compatibility)
def check_time_limits(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """Django system check: each :func:`time_limit_errors` sentence as an error ``embeddings.E001``."""
    return [checks.Error(e, id="embeddings.E001", hint="lower CELERY_BULK_TIME_LIMIT_S or raise "
                         "CELERY_VISIBILITY_TIMEOUT_S (docs/operations.md)") for e in time_limit_errors()]


@checks.register(checks.Tags.compatibility)
def check_configured_model(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """Django system check ``embeddings.W002``: CLIP_MODEL (and its weights and precision) names
    another model than the active embedding space's (the active row decides, issue 13: changing
    the variables does not point the service at an empty collection). Silent without a database."""

    try:
        warning = runtime.configured_model_warning()
    except (DatabaseError, FileNotFoundError, ValueError):
        return []
    if warning is None:
        return []
    return [checks.Warning(warning, id="embeddings.W002", hint="python manage.py model_migration start --model ... "
                           "(docs/operations.md \"Changing the model\"), or set CLIP_MODEL back")]


def broker_eviction_warning(client=None) -> str | None:
    """A sentence when the broker's Redis may evict keys at its memory limit, else None.

    Read with ``INFO memory`` (``CONFIG`` is often disabled on managed Redis): a ``maxmemory``
    set (not 0) with a ``maxmemory_policy`` other than ``noeviction``. None too when Redis cannot
    be read (its outage is reported where it is used).

    Args:
        client: a ``redis.Redis`` on the broker; default one on ``CELERY_BROKER_URL`` with
            half-second timeouts (a check must not hang when Redis is away).
    """

    try:
        if client is None:
            client = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=0.5, socket_connect_timeout=0.5)
        memory = client.info("memory")
    except (redis.RedisError, OSError, ValueError):
        return None
    limit, policy = int(memory.get("maxmemory") or 0), str(memory.get("maxmemory_policy") or "noeviction")
    if not limit or policy == "noeviction":
        return None
    return (f"the broker's Redis evicts keys at its memory limit (maxmemory {limit} bytes, maxmemory-policy "
            f"{policy}): when it fills, queued messages, results and lane state are dropped without a word")


@checks.register(checks.Tags.compatibility)
def check_broker_eviction(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """Django system check ``embeddings.W003``: :func:`broker_eviction_warning`."""
    warning = broker_eviction_warning()
    if warning is None:
        return []
    return [checks.Warning(warning, id="embeddings.W003", hint="set maxmemory-policy noeviction on the broker's "
                           "Redis (the API then answers 503 broker_full when it is full; docs/operations.md)")]


@worker_init.connect(dispatch_uid="embeddings.checks.warn_evicting_broker")
def warn_evicting_broker(sender=None, **kwargs) -> None:
    """Log :func:`broker_eviction_warning` when a Celery worker starts (Celery runs Django's checks
    without showing their warnings)."""
    warning = broker_eviction_warning()
    if warning is not None:
        log.warning("%s; set maxmemory-policy noeviction (docs/operations.md)", warning)


@worker_init.connect(dispatch_uid="embeddings.checks.refuse_unsafe_worker")
def refuse_unsafe_worker(sender=None, **kwargs) -> None:
    """Refuse to start a Celery worker whose chunks could outlive the visibility timeout.

    Raises:
        SystemExit: status :data:`EX_CONFIG`, after logging each error (``SystemExit`` because
            Celery logs and ignores ordinary exceptions raised by signal handlers).
    """
    errors = time_limit_errors()
    if errors:
        for e in errors:
            log.critical("refusing to start: %s", e)
        raise SystemExit(EX_CONFIG)
