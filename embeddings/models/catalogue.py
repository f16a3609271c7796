"""Jobs, images, embedding spaces, bulk chunks and per-batch stage timings. The database is the source
of truth for every image's state; Qdrant holds the vectors, keyed by a point id derived from content
and model."""
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


class JobKind(models.TextChoices):
    """What a bulk job does: embed new images, or re-embed the catalogue under another model."""

    INGEST = "ingest"
    MIGRATION = "migration"
    #: An OpenAI Batch API batch (``services.batches``): its lines run as this job's chunks on the
    #: bulk lane; its vectors are written to output files, never to the store.
    BATCH = "batch"


class SpaceState(models.TextChoices):
    """An embedding space's role (issue 13, docs/operations.md "Changing the model").

    - ``active``: searches and new uploads use it; exactly one space is active.
    - ``candidate``: the target of a migration (its collection is being filled, or is full and
      waits to be promoted); new uploads are embedded in it too.
    - ``standby``: the previously active space, kept for a rollback; new uploads are still embedded
      in it, so a rollback loses nothing.
    - ``dropped``: its collection was deleted explicitly; kept as a record.
    """

    ACTIVE = "active"
    CANDIDATE = "candidate"
    STANDBY = "standby"
    DROPPED = "dropped"


#: States whose collection receives every new upload (dual embedding), besides the active one.
DUAL_EMBED_STATES = (SpaceState.CANDIDATE, SpaceState.STANDBY)


class EmbeddingSpace(models.Model):
    """One model's embedding space: the open_clip architecture, weights and precision that made its
    vectors, and the Qdrant collection holding them. Vectors are comparable only within a space.

    The active space is one row that every reader consults (``embeddings.spaces.active``,
    cached ≤ ``SPACE_CACHE_S`` per process): promoting another space or rolling back is one
    transaction that moves the ``active`` state (the partial unique constraint keeps it to one row).

    Attributes:
        model_id: ``"<model>/<weights_id>/<precision>"`` (``workers.config.PipelineConfig.model_id``).
        pretrained: open_clip tag, checkpoint file path, or ``"random"`` (with ``seed``).
        collection: ``PipelineConfig.collection_name`` of the space.
        dim: embedding dimension (512 for ViT-B-32), float32 vectors, cosine distance.
        cutoff_image, cutoff_text: calibrated ``min_score`` defaults (cosine) for image and text
            queries; ``None`` until calibrated. ``calibration`` records how (percentile, pairs,
            points at the time, when).
        job: the migration job that fills this space (``None`` for the space a deployment started with).
        source: the space the migration re-embeds from.
        gate_report: the quality gate's last report (sample size, hits, rate, threshold, failures).
    """

    model_id = models.CharField(max_length=200, unique=True)
    model_name = models.CharField(max_length=100)
    pretrained = models.CharField(max_length=1024)
    seed = models.IntegerField(default=0)
    precision = models.CharField(max_length=8)
    collection = models.CharField(max_length=200)
    dim = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=SpaceState.choices, default=SpaceState.CANDIDATE)
    created_at = models.DateTimeField(auto_now_add=True)
    promoted_at = models.DateTimeField(null=True, blank=True)
    #: When it last stopped being the active space (a rollback goes to the most recent one).
    demoted_at = models.DateTimeField(null=True, blank=True)
    dropped_at = models.DateTimeField(null=True, blank=True)
    job = models.ForeignKey("Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    source = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    gate_report = models.JSONField(default=dict, blank=True)
    cutoff_image = models.FloatField(null=True, blank=True)
    cutoff_text = models.FloatField(null=True, blank=True)
    calibration = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ("created_at",)
        constraints = [
            models.UniqueConstraint(fields=["state"], condition=models.Q(state="active"), name="one_active_space"),
        ]

    def __str__(self) -> str:
        return f"{self.model_id} ({self.state})"


class Job(models.Model):
    """A bulk embedding job: many images, split into chunks of ``chunk_size`` image ids. A
    ``migration`` job re-embeds the catalogue's live images under ``model_id`` (issue 13)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    name = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=16, choices=JobKind.choices, default=JobKind.INGEST)
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
    #: Where a catalogue job's images come from when they are not in the request (issue 41):
    #: ``{"kind": "manifest", "format", "key" (blob key or ``s3://bucket/key``), "name"}`` or
    #: ``{"kind": "prefix", "uri": "s3://bucket/prefix", "extensions": [...]}``; ``{}`` otherwise.
    source = models.JSONField(default=dict, blank=True)
    #: True while the fetch worker is still reading the source (making rows, sending chunks): the job
    #: is not ``done`` before the last row exists, however fast the first chunks finish.
    reading = models.BooleanField(default=False)
    #: The API key that created it (its public prefix, ``ApiKey.prefix``); ``""``: a session or a
    #: legacy token. Its images' usage is metered to it (docs/usage.md).
    key_prefix = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return f"{self.name or self.id} ({self.status})"


class Image(models.Model):
    """One uploaded image and its embedding state.

    ``storage_key`` names the bytes (``blob/…`` in our store, ``file:/abs/path`` for staff
    folder ingestion, ``s3://bucket/key`` for an object read where it lives); messages carry image
    ids, never bytes. ``point_id`` = uuid5(model_id, sha256), so the same bytes under the same model
    share one Qdrant point.

    A row of a catalogue job made from a manifest or a prefix (issue 41) starts *unfetched*:
    ``origin`` holds its URL or ``s3://`` object, ``sha256`` is ``""`` and ``point_id`` null until
    the fetch worker has its bytes (``services.catalogue.fetching``). ``external_id`` is the
    caller's id (unique per owner among the users' rows); a row that will take an id some other
    row holds waits with it in ``claimed_external_id`` until its bytes are known: the same bytes
    leave the holder in place, new bytes replace it. ``metadata`` is the caller's JSON object
    (``services.catalogue.metadata``), also in the point's payload.

    A ``skipped`` row is another upload of its ``duplicate_of``'s bytes (same owner and model): it
    carries the original's width, height and format (filled when the original is embedded) and is
    searched through the original's point. Whenever a row goes (deleted by the API, the admin, or a
    cascade from its job or owner: :func:`_image_deleted`), its vector, blob and duplicates are
    settled by ``services.images.image_deleted``.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of their own: the composite indexes below lead with each (``owner, …``, ``job, …``)
    # and serve every look-up and cascade by it; one index fewer for every insert and mark to write.
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="images",
                              db_index=False)
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="images",
                            db_index=False)
    lane = models.CharField(max_length=16, choices=Lane.choices)
    status = models.CharField(max_length=16, choices=ImageStatus.choices, default=ImageStatus.QUEUED)
    reason = models.CharField(max_length=32, blank=True, help_text="stable reason code when not embedded")
    reason_detail = models.TextField(blank=True)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.PositiveBigIntegerField()
    storage_key = models.CharField(max_length=1024)
    original_name = models.CharField(max_length=255, blank=True)
    model_id = models.CharField(max_length=200)
    point_id = models.UUIDField(null=True, blank=True)
    external_id = models.CharField(max_length=256, blank=True, default="")
    claimed_external_id = models.CharField(max_length=256, blank=True, default="")
    metadata = models.JSONField(default=dict, blank=True)
    #: Where the bytes were fetched from: an http(s) URL or ``s3://bucket/key`` ("" for uploads).
    origin = models.TextField(blank=True, default="")
    #: The 1-based data row of the job's manifest that made this row (None otherwise).
    row = models.PositiveIntegerField(null=True, blank=True)
    duplicate_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    #: Set on a row that re-embeds a user's upload under another space (a migration, or dual
    #: embedding of a new upload): the user's row. Such rows are internal: lists and search results
    #: show the user's row, whose id never changes across a model switch. Deleting it deletes them.
    source = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="copies")
    width = models.PositiveIntegerField(null=True, blank=True)
    height = models.PositiveIntegerField(null=True, blank=True)
    format = models.CharField(max_length=16, blank=True)
    deadline = models.DateTimeField(null=True, blank=True, help_text="interactive only")
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    embedded_at = models.DateTimeField(null=True, blank=True)
    #: The API key whose request created the row, or its job (its public prefix); ``""``: a session
    #: or a legacy token. A copy in another space carries its source row's. Its usage is metered to
    #: it (docs/usage.md), read by the very ``UPDATE`` that marks the row embedded.
    key_prefix = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        ordering = ("created_at",)
        indexes = [
            models.Index(fields=["owner", "model_id", "sha256"]),
            models.Index(fields=["job", "status"]),
            models.Index(fields=["point_id"]),
            models.Index(fields=["owner", "external_id"]),
            models.Index(fields=["job", "claimed_external_id"]),
            # an export pages the caller's (or a job's) rows in id order: keyset pages, no sort
            models.Index(fields=["owner", "id"]),
            models.Index(fields=["job", "id"]),
        ]
        constraints = [
            # One original per owner, model and bytes (a check-then-insert would let concurrent
            # uploads both be embedded: issue 9). Partial unique indexes work on SQLite and PostgreSQL.
            models.UniqueConstraint(
                fields=["owner", "model_id", "sha256"],
                condition=models.Q(duplicate_of__isnull=True, status__in=LIVE_ORIGINAL_STATUSES) & ~models.Q(sha256=""),
                name="image_one_original",
            ),
            # The caller's id names one of their images (issue 41); copies in other spaces carry none.
            models.UniqueConstraint(
                fields=["owner", "external_id"], condition=models.Q(source__isnull=True) & ~models.Q(external_id=""),
                name="image_one_external_id",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.original_name or self.id} ({self.status})"


class ChunkState(models.TextChoices):
    """A bulk chunk's place (``BULK_SCHEDULER=fair``): waiting in the database, sent to the broker
    (waiting there or computing), or finished (its row is deleted by the reconciler)."""

    PENDING = "pending"
    SENT = "sent"
    DONE = "done"


class BulkChunk(models.Model):
    """One chunk of a bulk job under the fair scheduler (``embeddings.bulk_schedule``): the image ids
    an ``embed_chunk`` message will carry. The database holds every unsent chunk; at most
    ``BULK_SCHEDULER_WINDOW`` are ``sent`` at once, and when one finishes the next is chosen by
    ``queueing.bulk_order``. The images' own statuses stay the truth about what is done: a chunk row
    only says what has been handed to the broker."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="chunks")
    image_ids = models.JSONField()
    images = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=ChunkState.choices, default=ChunkState.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("id",)
        indexes = [models.Index(fields=["state", "job"])]

    def __str__(self) -> str:
        return f"chunk {self.id} of {self.job_id} ({self.state}, {self.images} images)"


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
