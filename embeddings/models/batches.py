"""The OpenAI Files and Batch APIs' records: files, batches and a batch's parts (docs/batch-api.md)."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from .catalogue import Job


class FilePurpose(models.TextChoices):
    """What a file of the OpenAI Files API is for: ``batch`` (uploaded: a batch's input lines) or
    ``batch_output`` (made by a batch: its output or error lines)."""

    BATCH = "batch"
    BATCH_OUTPUT = "batch_output"


class BatchFile(models.Model):
    """A file of ``/v1/files`` (OpenAI's Files API): JSON Lines in the blob store under ``storage_key``
    (content-addressed: two files of the same bytes share one blob, deleted with the last of them).

    Attributes:
        id: ``file-`` + 32 hex digits.
        bytes: size in bytes; ``lines``: its non-blank lines (counted when uploaded or written).
    """

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="batch_files")
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    lines = models.PositiveIntegerField(default=0)
    storage_key = models.CharField(max_length=1024)
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("-created_at", "-id")
        indexes = [models.Index(fields=["owner", "created_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class BatchStatus(models.TextChoices):
    """OpenAI's batch states: ``validating`` → ``in_progress`` → ``finalizing`` → ``completed``;
    ``failed`` (the input file failed validation); ``expired`` (the completion window passed);
    ``cancelling`` → ``cancelled``."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class Batch(models.Model):
    """A batch of ``/v1/batches``: the lines of ``input_file`` run as the bulk ``job`` (kind
    ``batch``, its deadline the end of the completion window), a part (:class:`BatchPart`) per chunk.

    Counts are derived from the parts (``request_counts``); ``total`` is the input's line count once
    validated. Each transition's time is kept, as OpenAI's batch object shows them.
    """

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="openai_batches")
    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="openai_batch")
    input_file = models.ForeignKey(BatchFile, null=True, on_delete=models.SET_NULL, related_name="+")
    #: The input file's id and blob, kept if the file is deleted while the batch runs (its blob stays
    #: until no file and no unfinished batch names it).
    input_file_name = models.CharField(max_length=40)
    input_key = models.CharField(max_length=1024)
    input_sha256 = models.CharField(max_length=64)
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=16)
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=BatchStatus.choices, default=BatchStatus.VALIDATING)
    #: ``[{"code", "message", "param", "line"}, ...]``: why validation failed (``failed``).
    errors = models.JSONField(default=list, blank=True)
    model_id = models.CharField(max_length=200, blank=True, default="")
    total = models.PositiveIntegerField(default=0)
    output_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    #: ``expires_at`` is this instant plus the completion window, both from one clock reading, so the
    #: two unix seconds differ by exactly the window (OpenAI's clients show the difference).
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        indexes = [models.Index(fields=["owner", "created_at"]), models.Index(fields=["status", "expires_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"


class PartState(models.TextChoices):
    """A batch part: ``pending`` (queued), ``running`` (a worker claimed it), ``done`` (its lines are
    in its output and error blobs), ``cancelled`` / ``expired`` (never run: its lines become
    ``batch_cancelled`` / ``batch_expired`` error lines when the batch is finalised)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class BatchPart(models.Model):
    """One chunk of a batch: input lines ``first_line .. first_line + lines - 1`` (0-based), the
    bytes ``offset .. offset + size`` of the input file. Once ``done``, its finished lines are the
    blobs ``output_key`` (successes) and ``error_key`` (refusals) ("" when it has none)."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="parts")
    index = models.PositiveIntegerField()
    first_line = models.PositiveIntegerField()
    lines = models.PositiveIntegerField()
    offset = models.PositiveBigIntegerField()
    size = models.PositiveBigIntegerField()
    state = models.CharField(max_length=16, choices=PartState.choices, default=PartState.PENDING)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    output_key = models.CharField(max_length=1024, blank=True, default="")
    output_sha256 = models.CharField(max_length=64, blank=True, default="")
    error_key = models.CharField(max_length=1024, blank=True, default="")
    error_sha256 = models.CharField(max_length=64, blank=True, default="")
    #: The part's image URLs fetched ahead by the fetch worker: ``{"<line>.<input>": {"key", "sha256"}
    #: | {"reason", "detail"}}`` (blobs released once the part is done or the batch finalised).
    staged = models.JSONField(default=dict, blank=True)
    #: When the part was last queued or claimed by a worker: one open longer than
    #: ``services.batches.batches.PART_LEASE`` has lost its message and is queued again.
    leased_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("batch", "index")
        constraints = [models.UniqueConstraint(fields=["batch", "index"], name="batch_part_once")]
        indexes = [models.Index(fields=["batch", "state"])]
