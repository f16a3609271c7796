"""Webhook endpoints (issue 42, docs/webhooks.md): where messages go, made, changed and deleted.

An endpoint is an account's (every job of its owner; for staff, every model migration too) or a
job's own (``callback_url`` of ``POST /api/jobs/``, saved with the job). Each subscribes to event
types (``[]``: all of them) and signs with its own ``whsec_`` secret, shown once when it is made or
rotated. A callback URL is checked here as far as it can be without resolving it: its form and a
literal address in a refused network; a host name is checked at every attempt
(``webhooks.delivery``).
"""
from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import re
import secrets
from collections.abc import Iterable

from django.conf import settings
from django.utils import timezone

from embeddings.errors import ApplicationError
from embeddings.models import Job, WebhookEndpoint, WebhookEvent
from workers.errors import ImageRejected, Reason
from workers.fetch import address_refusal, parse_url

#: Standard Webhooks' secret form: ``whsec_`` + base64 of 24..64 random bytes; 32 bytes = the
#: HMAC-SHA256 block's natural key strength.
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
#: After a rotation the previous secret signs too (a second signature) for this long, so a receiver
#: can deploy the new one without rejecting messages in between (Standard Webhooks: key rotation).
ROTATION_GRACE = dt.timedelta(hours=24)
#: Callback URLs one ``POST /api/jobs/`` may name.
MAX_JOB_CALLBACKS = 5


def _callback_url_pattern() -> str:
    """The form of a callback URL (:data:`CALLBACK_URL_PATTERN`), from RFC 3986's grammar narrowed to
    what ``workers.fetch.parse_url`` (httpx underneath) accepts: a host name of its ``HOST_NAME``
    form (at most 253 characters, not four all-digit labels, which httpx reads as IPv4), an IPv4
    address or a bracketed IPv6 address, a port in 1..65535, and printable ASCII after."""
    octet = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    ipv4 = f"{octet}(\\.{octet}){{3}}"
    h16 = "[0-9A-Fa-f]{1,4}"
    ls32 = f"({h16}:{h16}|{ipv4})"

    def head(n: int) -> str:  # [ *n( h16 ":" ) h16 ]
        return "" if n < 0 else f"(({h16}:){{0,{n}}}{h16})?"

    ipv6 = "|".join([f"({h16}:){{6}}{ls32}", f"::({h16}:){{5}}{ls32}", f"{head(0)}::({h16}:){{4}}{ls32}",
                     f"{head(1)}::({h16}:){{3}}{ls32}", f"{head(2)}::({h16}:){{2}}{ls32}",
                     f"{head(3)}::{h16}:{ls32}", f"{head(4)}::{ls32}", f"{head(5)}::{h16}", f"{head(6)}::"])
    end = "(?=[:/?#]|$)"
    name = f"(?![0-9]+(\\.[0-9]+){{3}}{end})(?=[^:/?#]{{1,253}}{end})[A-Za-z0-9_-]+(\\.[A-Za-z0-9_-]+)*\\.?"
    port = "(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|0*[1-9][0-9]{0,3})"
    return f"^[Hh][Tt][Tt][Pp][Ss]?://({ipv4}{end}|\\[({ipv6})\\]|{name})(:{port})?([/?#][!-~]*)?$"


#: A callback URL's form, checked before anything else (``callback_url_check``) and stated in the
#: OpenAPI schema (``embeddings.api.schema_rules``): the schema and the service refuse the same URLs.
CALLBACK_URL_PATTERN = _callback_url_pattern()
_CALLBACK_URL = re.compile(CALLBACK_URL_PATTERN)


def secret_new() -> str:
    """A fresh endpoint secret: ``whsec_`` + base64 of :data:`SECRET_BYTES` random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def callback_url_check(url: str) -> str:
    """A callback URL as the deliveries will use it, refused when it can be refused now.

    What is checked here is what costs nothing: the URL's form (:data:`CALLBACK_URL_PATTERN`, then
    the fetcher's rules: http or https, a host, no credentials) and a literal IP address in a refused network (loopback, private,
    link-local such as the cloud metadata 169.254.169.254, ...) unless ``FETCH_ALLOW_NETWORKS``
    allows it. A host name is resolved at every delivery attempt instead (its DNS may change).

    Returns:
        The URL, normalised (IDNA host, percent-encoding).

    Raises:
        ApplicationError: ``invalid_callback_url`` (400) or ``fetch_refused_address`` (400), with
            ``extra.url``.
    """
    if not isinstance(url, str) or not _CALLBACK_URL.fullmatch(url):
        raise ApplicationError(f"callback URL refused: {str(url)[:200]!r} is not an http or https URL of a host name or "
                               f"address, a port in 1..65535 and printable ASCII after (CALLBACK_URL_PATTERN)",
                               code="invalid_callback_url", extra={"url": str(url)[:2048]})
    try:
        parsed = parse_url(url)
    except ImageRejected as e:
        raise ApplicationError(f"callback URL refused: {e.detail}", code="invalid_callback_url",
                               extra={"url": str(url)[:2048]}) from None
    host = parsed.raw_host.decode("ascii", "replace").strip("[]")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        allow = tuple(ipaddress.ip_network(n, strict=False) for n in settings.FETCH_ALLOW_NETWORKS)
        why = address_refusal(literal, allow)
        if why is not None:
            kind = f"{'an' if why[0] in 'aeiou' else 'a'} {why} address"
            raise ApplicationError(f"callback URL refused: {host} is {kind}, refused unless FETCH_ALLOW_NETWORKS "
                                   f"allows it", code=Reason.FETCH_REFUSED_ADDRESS.value, extra={"url": str(url)[:2048]})
    out = str(parsed)
    if len(out) > 2048:
        raise ApplicationError("callback URL refused: longer than 2048 characters", code="invalid_callback_url",
                               extra={"url": out[:2048]})
    return out


def events_check(events: Iterable[str] | None, *, migrations: bool = True) -> list[str]:
    """The event types an endpoint subscribes to, sorted and deduplicated (``[]``: every event).

    Args:
        migrations: whether the endpoint can hear ``migration.*`` events (a staff account's own
            endpoint); asking for one that it never would hear is refused.

    Raises:
        ApplicationError: ``invalid_events`` (400) naming the unknown (or never sent) types and the known ones.
    """
    events = sorted(set(events or ()))
    known = [e for e in WebhookEvent.values if migrations or not e.startswith("migration.")]
    unknown = [e for e in events if e not in known]
    if unknown:
        why = "unknown event types" if migrations else "event types this endpoint never hears (migration.* go to " \
                                                       "staff accounts' own endpoints) or unknown ones"
        raise ApplicationError(f"{why}: {', '.join(map(str, unknown))}", code="invalid_events",
                               extra={"unknown": unknown, "known": known})
    return events


def _check_room(owner, adding: int) -> None:
    """Raises ApplicationError ``too_many_webhooks`` (400) past ``WEBHOOK_MAX_ENDPOINTS``."""
    limit = settings.WEBHOOK_MAX_ENDPOINTS
    if WebhookEndpoint.objects.filter(owner=owner).count() + adding > limit:
        raise ApplicationError(f"an account has at most WEBHOOK_MAX_ENDPOINTS = {limit} webhook endpoints",
                               code="too_many_webhooks", extra={"limit": "WEBHOOK_MAX_ENDPOINTS", "value": limit})


def endpoint_prepare(*, owner, url: str, events: Iterable[str] | None = None, description: str = "",
                     job_callback: bool = False) -> WebhookEndpoint:
    """An endpoint checked and given its secret, not saved yet (a job's callbacks are saved with
    their job: :func:`job_endpoints_attach`). The caller shows ``endpoint.secret`` once.

    Raises:
        ApplicationError: as :func:`callback_url_check` and :func:`events_check`.
    """
    return WebhookEndpoint(owner=owner, url=callback_url_check(url),
                           events=events_check(events, migrations=owner.is_staff and not job_callback),
                           description=description[:200], secret=secret_new())


def job_callbacks_prepare(*, owner, urls: Iterable[str], events: Iterable[str] | None = None) -> list[WebhookEndpoint]:
    """The unsaved endpoints of a job's ``callback_url`` values (at most :data:`MAX_JOB_CALLBACKS`).

    Raises:
        ApplicationError: as :func:`endpoint_prepare`; ``too_many_webhooks`` (400).
    """
    urls = [u for u in urls if u]
    if len(urls) > MAX_JOB_CALLBACKS:
        raise ApplicationError(f"a job names at most {MAX_JOB_CALLBACKS} callback URLs", code="too_many_webhooks",
                               extra={"value": MAX_JOB_CALLBACKS})
    endpoints = [endpoint_prepare(owner=owner, url=u, events=events, description="job callback", job_callback=True)
                 for u in urls]
    if endpoints:
        _check_room(owner, len(endpoints))
    return endpoints


def job_endpoints_attach(*, job: Job, endpoints: Iterable[WebhookEndpoint]) -> None:
    """Save a job's callback endpoints (from :func:`job_callbacks_prepare`) as the job's own.
    Called right after the job row exists, before any of its work is sent, so no event of the job
    can come before them."""
    endpoints = list(endpoints)
    for endpoint in endpoints:
        endpoint.job = job
    WebhookEndpoint.objects.bulk_create(endpoints)


def endpoint_create(*, owner, url: str, events: Iterable[str] | None = None, description: str = "") -> WebhookEndpoint:
    """An account endpoint: every job of ``owner`` (and, for staff, every model migration).

    Raises:
        ApplicationError: as :func:`endpoint_prepare`; ``too_many_webhooks`` (400).
    """
    endpoint = endpoint_prepare(owner=owner, url=url, events=events, description=description)
    _check_room(owner, 1)
    endpoint.save()
    return endpoint


def endpoint_update(*, endpoint: WebhookEndpoint, url: str | None = None, events: Iterable[str] | None = None,
                    active: bool | None = None, description: str | None = None) -> WebhookEndpoint:
    """Change what was given (None: unchanged). Messages already made keep their endpoint and are
    sent to its URL as it is at each attempt.

    Raises:
        ApplicationError: as :func:`endpoint_prepare`.
    """
    if url is not None:
        endpoint.url = callback_url_check(url)
    if events is not None:
        endpoint.events = events_check(events, migrations=endpoint.owner.is_staff and endpoint.job_id is None)
    if active is not None:
        endpoint.active = active
    if description is not None:
        endpoint.description = description[:200]
    endpoint.save(update_fields=["url", "events", "active", "description"])
    return endpoint


def endpoint_rotate(*, endpoint: WebhookEndpoint) -> WebhookEndpoint:
    """A new secret; the old one still signs (a second signature) for :data:`ROTATION_GRACE`.
    The caller shows ``endpoint.secret`` once."""
    endpoint.previous_secret = endpoint.secret
    endpoint.previous_secret_expires_at = timezone.now() + ROTATION_GRACE
    endpoint.secret = secret_new()
    endpoint.save(update_fields=["secret", "previous_secret", "previous_secret_expires_at"])
    return endpoint


def endpoint_delete(*, endpoint: WebhookEndpoint) -> None:
    """Delete the endpoint with its deliveries (pending ones are not sent)."""
    endpoint.delete()
