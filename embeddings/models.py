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


class DuplicateKind(models.TextChoices):
    """``exact``: the same bytes (sha256) uploaded more than once; ``near``: different bytes whose
    vectors are within the owner's threshold (re-encoded, resized, cropped copies)."""

    EXACT = "exact"
    NEAR = "near"


class GroupStatus(models.TextChoices):
    """A group's review: ``open`` (nobody decided), ``resolved`` (one kept, the rest deleted),
    ``dismissed`` (a person said "not duplicates": its pairs never group again)."""

    OPEN = "open"
    RESOLVED = "resolved"
    DISMISSED = "dismissed"


class ScanState(models.TextChoices):
    CALIBRATING = "calibrating"
    SCANNING = "scanning"
    DONE = "done"
    FAILED = "failed"


class DuplicateScan(models.Model):
    """The near-duplicate scan of one owner's images in one embedding space
    (``services.duplicates``): its threshold and how it was calibrated, progress, timings. One row
    per owner and space; a new scan replaces the previous one's open groups. Once ``done``, images
    embedded later are grouped incrementally at its threshold."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="duplicate_scans")
    model_id = models.CharField(max_length=200)
    state = models.CharField(max_length=16, choices=ScanState.choices, default=ScanState.CALIBRATING)
    #: The cosine at or above which two images are near-duplicates (None while calibrating).
    threshold = models.FloatField(null=True, blank=True)
    #: ``workers.duplicates.calibrate``'s report, or ``{"source": "given"}`` for a threshold set by the caller.
    calibration = models.JSONField(default=dict, blank=True)
    #: A unique token of the running scan: a slice task of an older scan sees another and stops.
    run = models.CharField(max_length=32, blank=True, default="")
    scanned = models.PositiveIntegerField(default=0)
    edges = models.PositiveIntegerField(default=0)
    groups = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_s = models.FloatField(null=True, blank=True)
    #: Seconds inside the store's neighbour queries, summed over the slices.
    query_s = models.FloatField(default=0)
    #: When the owner's exact groups were last regrouped from the database (``scan.refresh_exact``).
    exact_checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "model_id"], name="duplicate_scan_one_per_space")]

    def __str__(self) -> str:
        return f"duplicates of {self.owner_id} in {self.model_id} ({self.state})"


class DuplicateEdge(models.Model):
    """A scan's working set: one pair of points above the threshold, found by a slice; read by the
    scan's last step to build groups, then deleted."""

    scan = models.ForeignKey(DuplicateScan, on_delete=models.CASCADE, related_name="+")
    a = models.UUIDField()
    b = models.UUIDField()
    score = models.FloatField()


class DuplicateGroup(models.Model):
    """A group of one owner's images that are copies of each other, exact or near, in one space."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="duplicate_groups")
    model_id = models.CharField(max_length=200)
    kind = models.CharField(max_length=8, choices=DuplicateKind.choices)
    status = models.CharField(max_length=16, choices=GroupStatus.choices, default=GroupStatus.OPEN)
    #: The threshold the group was formed at (1.0 for exact copies).
    threshold = models.FloatField()
    #: The kept image once resolved.
    kept = models.ForeignKey(Image, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    reviewed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at",)
        indexes = [models.Index(fields=["owner", "model_id", "status"])]

    def __str__(self) -> str:
        return f"{self.kind} group {self.id} ({self.status})"


class DuplicateMember(models.Model):
    """One image of a group, with its cosine to the group's representative (1.0 for the
    representative and for exact copies)."""

    group = models.ForeignKey(DuplicateGroup, on_delete=models.CASCADE, related_name="members")
    image = models.ForeignKey(Image, on_delete=models.CASCADE, related_name="+")
    point_id = models.UUIDField(null=True, blank=True)
    score = models.FloatField()
    representative = models.BooleanField(default=False)

    class Meta:
        ordering = ("-representative", "-score")
        constraints = [models.UniqueConstraint(fields=["group", "image"], name="duplicate_member_once")]


class NotDuplicate(models.Model):
    """A person's "not duplicates" for two pictures of one owner, by their bytes (sha256, in
    sorted order), so it holds in every embedding space and after a re-scan."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    sha_a = models.CharField(max_length=64)
    sha_b = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "sha_a", "sha_b"], name="not_duplicate_once")]


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
    created_at = models.DateTimeField(auto_now_add=True)
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

    class Meta:
        ordering = ("batch", "index")
        constraints = [models.UniqueConstraint(fields=["batch", "index"], name="batch_part_once")]
        indexes = [models.Index(fields=["batch", "state"])]
