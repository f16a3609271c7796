"""Sending webhook messages (issue 42, docs/webhooks.md): queue, sign, POST, record, reschedule,
and send again on request (:func:`delivery_redeliver`).

One attempt is one ``send_webhook_delivery`` task on the ``fetch`` queue (threads pool, no model):
a receiver that never answers holds one thread for at most ``WEBHOOK_TIMEOUT_S`` and never delays
another delivery; the fetcher's per-host bound applies. The POST goes through the fetcher
(``workers.fetch.Fetcher.post``): the host is resolved and every address checked at each attempt
(``fetch_refused_address``), the socket connects to the checked address, no redirect is followed.

Attempt *n* is due ``WEBHOOK_RETRY_SCHEDULE_S[n-1]`` seconds after attempt *n-1* failed; the first
is queued at once when its event commits. Due times live in the database (``next_attempt_at``),
never in a broker countdown (Redis redelivers a message held past its visibility timeout, an hour
by default): the reconciler queues what is due (:func:`deliveries_due_send`). Two messages for the
same attempt (the first one queued, then the reconciler's after a lost message) cannot both send:
an attempt starts with a conditional update of ``attempts`` that only one of them wins.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import logging
import time

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from embeddings import dispatch, runtime
from embeddings.models import (
    DeliveryStatus,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
)
from embeddings.services.webhooks.endpoints import SECRET_PREFIX
from workers.errors import ImageRejected, Reason

log = logging.getLogger(__name__)

#: Past the timeout, the time a started attempt keeps its lease (recording it, a slow database):
#: after it, an attempt whose worker died is due again.
ATTEMPT_MARGIN_S = 60.0
#: A queued attempt has this long to start before the reconciler queues it again (a lost message).
DISPATCH_LEASE = dt.timedelta(minutes=5)
#: Deliveries the reconciler queues per round (the rest wait for the next round).
DUE_BATCH = 1000


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks' signature: ``v1,`` + base64(HMAC-SHA256(key, f"{id}.{timestamp}." + body)),
    the key being the base64 after ``whsec_``.

    Args:
        secret: ``whsec_…``.
        message_id: the ``webhook-id``.
        timestamp: the ``webhook-timestamp`` (Unix s, integer).
        body: the exact body bytes sent.
    """
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode("ascii")


def signatures(endpoint: WebhookEndpoint, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: the current secret's signature, and the previous secret's
    while a rotation's grace lasts, space-separated (a receiver accepts any that matches)."""
    out = [sign(endpoint.secret, message_id, timestamp, body)]
    if endpoint.previous_secret and endpoint.previous_secret_expires_at and \
            endpoint.previous_secret_expires_at > timezone.now():
        out.append(sign(endpoint.previous_secret, message_id, timestamp, body))
    return " ".join(out)


def body_of(payload: dict) -> bytes:
    """A message's body: compact JSON with sorted keys, UTF-8, so every attempt sends the same
    bytes whatever order the database kept the keys in."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def delivery_attempt(*, delivery_id: int, attempt: int) -> dict:
    """Make attempt number ``attempt`` (1-based) of a delivery, if it is still the next one.

    Returns:
        ``{"sent": False}`` when another message had this attempt already (or the delivery is no
        longer pending), else ``{"sent": True, "ok", "status_code", "reason"}``.
    """
    now = timezone.now()
    lease = now + dt.timedelta(seconds=settings.WEBHOOK_TIMEOUT_S + ATTEMPT_MARGIN_S)
    won = WebhookDelivery.objects.filter(id=delivery_id, status=DeliveryStatus.PENDING, attempts=attempt - 1).update(
        attempts=attempt, next_attempt_at=lease)
    if not won:
        return {"sent": False}
    delivery = WebhookDelivery.objects.select_related("endpoint").get(id=delivery_id)
    endpoint = delivery.endpoint
    if not endpoint.active:
        _settle(delivery, attempt, now, ok=False, status_code=None, reason="endpoint_inactive",
                error="the endpoint was deactivated", final=True)
        return {"sent": False}
    body = body_of(delivery.payload)
    timestamp = int(time.time())
    headers = [("Content-Type", "application/json"), ("webhook-id", delivery.message_id),
               ("webhook-timestamp", str(timestamp)),
               ("webhook-signature", signatures(endpoint, delivery.message_id, timestamp, body))]
    t0 = time.monotonic()
    try:
        answer = runtime.webhook_poster().post(endpoint.url, body, headers)
    except ImageRejected as e:
        status_code, reason, error = None, e.reason.value, e.detail
    else:
        status_code = answer.status
        ok = 200 <= status_code < 300
        reason = "" if ok else Reason.FETCH_STATUS.value
        error = "" if ok else f"HTTP {status_code} from {endpoint.url}: {answer.data[:200].decode('utf-8', 'replace')}"
    duration_ms = (time.monotonic() - t0) * 1000
    WebhookAttempt.objects.create(delivery_id=delivery_id, number=attempt, started_at=now,
                                  duration_ms=round(duration_ms, 3), status_code=status_code, reason=reason,
                                  error=error[:2000])
    ok = reason == ""
    final = ok or attempt >= len(settings.WEBHOOK_RETRY_SCHEDULE_S)
    _settle(delivery, attempt, now, ok=ok, status_code=status_code, reason=reason, error=error, final=final)
    if not ok:
        log.info("webhook %s attempt %s to %s failed: %s %s", delivery.message_id, attempt, endpoint.url, reason,
                 error[:200])
    return {"sent": True, "ok": ok, "status_code": status_code, "reason": reason}


def _settle(delivery: WebhookDelivery, attempt: int, started: dt.datetime, *, ok: bool, status_code: int | None,
            reason: str, error: str, final: bool) -> None:
    """Record an attempt's outcome on its delivery: delivered, failed for good, or due again after
    the schedule's next wait (counted from this attempt's start). Only while the delivery is still
    at this attempt (a redeliver meanwhile starts over and wins)."""
    fields = {"last_status_code": status_code, "last_reason": reason, "last_error": error[:2000]}
    if ok:
        fields.update(status=DeliveryStatus.DELIVERED, delivered_at=timezone.now(), next_attempt_at=None)
    elif final:
        fields.update(status=DeliveryStatus.FAILED, next_attempt_at=None)
    else:
        wait = settings.WEBHOOK_RETRY_SCHEDULE_S[attempt]
        fields.update(next_attempt_at=started + dt.timedelta(seconds=wait))
    WebhookDelivery.objects.filter(id=delivery.id, attempts=attempt, status=DeliveryStatus.PENDING).update(**fields)


def deliveries_due_send(*, now: dt.datetime | None = None, limit: int = DUE_BATCH) -> int:
    """Queue the next attempt of every pending delivery due by ``now`` (the reconciler, each
    round). Each is first pushed :data:`DISPATCH_LEASE` ahead by a conditional update, so a
    second round (or a second reconciler) does not queue it again while its message waits.

    Returns:
        How many attempts were queued.
    """
    now = now or timezone.now()
    due = list(WebhookDelivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
               .order_by("next_attempt_at").values_list("id", "attempts", "next_attempt_at")[:limit])
    sent = 0
    for delivery_id, attempts, at in due:
        if WebhookDelivery.objects.filter(id=delivery_id, attempts=attempts, next_attempt_at=at,
                                          status=DeliveryStatus.PENDING).update(
                next_attempt_at=timezone.now() + DISPATCH_LEASE):
            delivery_queue(delivery_id=delivery_id, attempt=attempts + 1)
            sent += 1
    return sent


def delivery_queue(*, delivery_id: int, attempt: int) -> None:
    """Queue ``attempt`` of a delivery on the fetch queue. A failure to publish (broker down) is
    logged: the row stays due, and the reconciler queues it again after :data:`DISPATCH_LEASE`."""
    try:
        dispatch.send_webhook_delivery(delivery_id=delivery_id, attempt=attempt)
    except Exception:
        log.exception("webhook delivery %s: attempt %s not queued; the reconciler will", delivery_id, attempt)


def delivery_redeliver(*, delivery: WebhookDelivery) -> WebhookDelivery:
    """Send a delivery again from its first attempt, whatever its status (same ``webhook-id``: a
    receiver that had it deduplicates). Its attempt log is kept."""
    now = timezone.now()
    WebhookDelivery.objects.filter(id=delivery.id).update(status=DeliveryStatus.PENDING, attempts=0,
                                                          next_attempt_at=now + DISPATCH_LEASE)
    transaction.on_commit(lambda: delivery_queue(delivery_id=delivery.id, attempt=1))
    delivery.refresh_from_db()
    return delivery
