"""Jobs, images and per-batch stage timings. The database is the source of truth for every image's
state; Qdrant holds the vectors, keyed by a point id derived from content and model."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class Lane(models.TextChoices):
    """Which queue an image travels: someone waiting, or a catalogue with a deadline."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


class JobStatus(models.TextChoices):
    """Bulk job state machine: queued → running → done; paused ⇄ running; any → cancelled."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    CANCELLED = "cancelled"
    DONE = "done"


class JobPriority(models.TextChoices):
    """Bulk priority: urgent chunks run before background ones (both after interactive work)."""

    URGENT = "urgent"
    BACKGROUND = "background"


class ImageStatus(models.TextChoices):
    """Per-image state. Terminal: embedded, skipped, failed, expired, cancelled."""

    QUEUED = "queued"
    EMBEDDED = "embedded"
    SKIPPED = "skipped"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


TERMINAL_IMAGE_STATUSES = (
    ImageStatus.EMBEDDED,
    ImageStatus.SKIPPED,
    ImageStatus.FAILED,
    ImageStatus.EXPIRED,
    ImageStatus.CANCELLED,
)

#: Statuses of a row that holds (or is getting) its bytes' vector. Among the rows of one owner,
#: model and sha256, at most one in these statuses has no ``duplicate_of``: the *original*; every
#: other upload of those bytes is ``skipped`` and points at it. The database holds this
#: (``image_one_original``), so two concurrent uploads cannot both be embedded.
LIVE_ORIGINAL_STATUSES = (ImageStatus.QUEUED, ImageStatus.EMBEDDED)


class Job(models.Model):
    """A bulk embedding job: many images, split into chunks of ``chunk_size`` image ids."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    name = models.CharField(max_length=200, blank=True)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED)
    priority = models.CharField(max_length=16, choices=JobPriority.choices, default=JobPriority.BACKGROUND)
    deadline = models.DateTimeField(null=True, blank=True)
    model_id = models.CharField(max_length=200)
    chunk_size = models.PositiveIntegerField(default=64)
    total = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    #: ``{"interval_s": 1.0, "rows": [[unix_t, cpu_percent, gpu_percent|null, gpu_memory_mib|null], ...]}``:
    #: one sample per second while the job's chunks ran (``workers.utilisation``).
    utilisation = models.JSONField(default=dict, blank=True)
    #: The settings the bulk workers ran the job with: precision, device, preprocess, batch size,
    #: thread counts, processes (the collection name already carries the precision).
    pipeline = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return f"{self.name or self.id} ({self.status})"


class Image(models.Model):
    """One uploaded image and its embedding state.

    ``storage_key`` names the bytes (``blob/…`` in our store, or ``file:/abs/path`` for staff
    folder ingestion); messages carry image ids, never bytes. ``point_id`` = uuid5(model_id,
    sha256), so the same bytes under the same model share one Qdrant point.

    A ``skipped`` row is another upload of its ``duplicate_of``'s bytes (same owner and model): it
    carries the original's width, height and format (filled when the original is embedded) and is
    searched through the original's point. Whenever a row goes (deleted by the API, the admin, or a
    cascade from its job or owner: :func:`_image_deleted`), its vector, blob and duplicates are
    settled by ``services.images.image_deleted``.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="images")
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="images")
    lane = models.CharField(max_length=16, choices=Lane.choices)
    status = models.CharField(max_length=16, choices=ImageStatus.choices, default=ImageStatus.QUEUED)
    reason = models.CharField(max_length=32, blank=True, help_text="stable reason code when not embedded")
    reason_detail = models.TextField(blank=True)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.PositiveBigIntegerField()
    storage_key = models.CharField(max_length=1024)
    original_name = models.CharField(max_length=255, blank=True)
    model_id = models.CharField(max_length=200)
    point_id = models.UUIDField()
    duplicate_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    width = models.PositiveIntegerField(null=True, blank=True)
    height = models.PositiveIntegerField(null=True, blank=True)
    format = models.CharField(max_length=16, blank=True)
    deadline = models.DateTimeField(null=True, blank=True, help_text="interactive only")
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    embedded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("created_at",)
        indexes = [
            models.Index(fields=["owner", "model_id", "sha256"]),
            models.Index(fields=["job", "status"]),
            models.Index(fields=["point_id"]),
        ]
        constraints = [
            # One original per owner, model and bytes (issue 9: a check-then-insert let concurrent
            # uploads both be embedded). Partial unique indexes work on SQLite and PostgreSQL.
            models.UniqueConstraint(
                fields=["owner", "model_id", "sha256"],
                condition=models.Q(duplicate_of__isnull=True, status__in=LIVE_ORIGINAL_STATUSES),
                name="image_one_original",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.original_name or self.id} ({self.status})"


class BatchStat(models.Model):
    """Stage timings (ms) of one batch on one lane: see ``workers.timing`` for what each counts."""

    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="batches")
    lane = models.CharField(max_length=16, choices=Lane.choices)
    images = models.PositiveIntegerField()
    failed = models.PositiveIntegerField(default=0)
    load_ms = models.FloatField(default=0)
    decode_ms = models.FloatField(default=0)
    decode_wait_ms = models.FloatField(default=0)
    preprocess_ms = models.FloatField(default=0)
    embed_ms = models.FloatField(default=0)
    upsert_ms = models.FloatField(null=True, blank=True)
    total_ms = models.FloatField(default=0)
    worker = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("created_at",)
