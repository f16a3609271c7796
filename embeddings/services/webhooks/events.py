"""Webhook events (issue 42, docs/webhooks.md): the messages made when a state changes.

An event is emitted by the service where its state changes (``catalogue.jobs`` for a job's end,
cancellation and deadline risk; ``lifecycle`` for a model migration), inside that change's
transaction where there is one: :func:`event_emit` writes one ``WebhookDelivery`` row per
subscribed endpoint, and the first attempt is queued when the transaction commits. The pair
(endpoint, event key) is unique, so an emitter that runs twice (a redelivered task, a reconciler
round after a crash) makes no second message. Sending, signing and retrying are
``webhooks.delivery``'s.

Messages follow Standard Webhooks (https://www.standardwebhooks.com/): ``{"type", "timestamp",
"data"}``, signed with the endpoint's ``whsec_`` secret.
"""
from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from embeddings.models import Job, WebhookDelivery, WebhookEndpoint, WebhookEvent
from embeddings.services.webhooks.delivery import DISPATCH_LEASE, delivery_queue


def message_id_new() -> str:
    """A message id (``webhook-id``): ``msg_`` + 32 hex digits, unique per delivery."""
    return f"msg_{uuid.uuid4().hex}"


def job_recipients(job: Job) -> list[WebhookEndpoint]:
    """Active endpoints that hear about ``job``: its own, and its owner's account endpoints."""

    return list(WebhookEndpoint.objects.filter(Q(job=job) | Q(owner_id=job.owner_id, job__isnull=True), active=True))


def staff_recipients() -> list[WebhookEndpoint]:
    """Active account endpoints of staff users: model migrations are staff work."""
    return list(WebhookEndpoint.objects.filter(owner__is_staff=True, job__isnull=True, active=True))


def event_emit(*, event: str, key: str, data: dict, endpoints: Iterable[WebhookEndpoint],
               at: dt.datetime | None = None, body: dict | None = None) -> list[WebhookDelivery]:
    """Make one message of ``event`` for each endpoint subscribed to it, unless that endpoint
    already has one with ``key``; queue each new one's first attempt when the transaction commits.

    Args:
        event: a :class:`WebhookEvent` value.
        key: names this occurrence (``"job.done:<job id>"``): at most one message per endpoint.
        data: the message's ``data`` (JSON-serialisable).
        endpoints: candidates (e.g. :func:`job_recipients`); those not subscribed are skipped.
        at: the event's time (``timestamp``), default now.
        body: the whole message instead of ``{"type", "timestamp", "data"}`` (a ``batch.*`` event
            carries OpenAI's event object: ``services.batches``); signed and sent the same way.

    Returns:
        The deliveries made now (none for an occurrence already emitted).
    """
    WebhookEvent(event)
    now = timezone.now()
    payload = body if body is not None else {"type": event, "timestamp": (at or now).isoformat(), "data": data}
    rows = [WebhookDelivery(endpoint=e, event=event, key=key[:200], message_id=message_id_new(), payload=payload,
                            next_attempt_at=now + DISPATCH_LEASE)
            for e in endpoints if not e.events or event in e.events]
    if not rows:
        return []
    # The unique (endpoint, key) drops the rows of an occurrence emitted before; what is left has
    # the message ids made here.
    WebhookDelivery.objects.bulk_create(rows, ignore_conflicts=True)
    made = list(WebhookDelivery.objects.filter(message_id__in=[r.message_id for r in rows]))
    for delivery in made:
        transaction.on_commit(lambda d=delivery.id: delivery_queue(delivery_id=d, attempt=1))
    return made
