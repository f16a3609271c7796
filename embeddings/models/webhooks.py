"""Webhook endpoints, their deliveries and each delivery's attempts (docs/webhooks.md)."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from .catalogue import Job


class WebhookEvent(models.TextChoices):
    """What a webhook tells (docs/webhooks.md): a job's end or risk, a model migration's steps."""

    JOB_DONE = "job.done"
    JOB_FAILED = "job.failed"
    JOB_CANCELLED = "job.cancelled"
    JOB_AT_RISK = "job.at_risk"
    MIGRATION_READY = "migration.ready"
    MIGRATION_PROMOTED = "migration.promoted"
    MIGRATION_ROLLED_BACK = "migration.rolled_back"
    BATCH_COMPLETED = "batch.completed"
    BATCH_FAILED = "batch.failed"
    BATCH_EXPIRED = "batch.expired"
    BATCH_CANCELLED = "batch.cancelled"


class DeliveryStatus(models.TextChoices):
    """A delivery is ``pending`` until an attempt is answered 2xx (``delivered``) or its last
    scheduled attempt fails (``failed``)."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class WebhookEndpoint(models.Model):
    """A URL that receives signed event messages (Standard Webhooks, issue 42).

    An account's endpoint (``job`` null) receives the events of every job of its owner (and, for a
    staff owner, the model migrations'); a job's own endpoint (``callback_url`` of ``POST
    /api/jobs/``) only that job's. ``events`` empty means every event.

    ``secret`` is the ``whsec_``-prefixed base64 key the messages are signed with, shown once when
    made (or rotated); ``previous_secret`` still signs (a second signature) until
    ``previous_secret_expires_at``, so a receiver can switch keys without dropping messages.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhooks")
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=2048)
    secret = models.CharField(max_length=100)
    previous_secret = models.CharField(max_length=100, blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    events = models.JSONField(default=list, blank=True)
    active = models.BooleanField(default=True)
    description = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("created_at",)

    def __str__(self) -> str:
        return self.url


class WebhookDelivery(models.Model):
    """One event message for one endpoint, and how its attempts went.

    ``key`` names the event's occurrence (``job.done:<job id>``); the pair (endpoint, key) is
    unique, so code that emits an event twice (a redelivered task) makes no second message.
    ``message_id`` (``msg_…``) is the ``webhook-id`` header, the same on every attempt: receivers
    deduplicate by it. ``attempts`` counts the attempts started; ``next_attempt_at`` is when the
    next one is due (also a lease: a started attempt pushes it past its timeout, so an attempt
    whose worker died is tried again later); null once ``delivered`` or ``failed``.
    """

    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=32, choices=WebhookEvent.choices)
    key = models.CharField(max_length=200)
    message_id = models.CharField(max_length=40, unique=True)
    payload = models.JSONField()
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_reason = models.CharField(max_length=32, blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        ordering = ("created_at", "id")
        indexes = [models.Index(fields=["status", "next_attempt_at"])]
        constraints = [
            # Exactly once per endpoint and occurrence, whatever runs twice (issue 42).
            models.UniqueConstraint(fields=["endpoint", "key"], name="webhook_delivery_once"),
        ]

    def __str__(self) -> str:
        return f"{self.event} → {self.endpoint} ({self.status})"


class WebhookAttempt(models.Model):
    """One attempt of a delivery: when, how long (ms), the answer's status or the failure."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.FloatField(default=0)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    reason = models.CharField(max_length=32, blank=True, default="")
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ("started_at", "id")

    def __str__(self) -> str:
        return f"attempt {self.number}"
