"""Django settings, read once from the environment (and an optional ``.env`` file).

Every knob is an environment variable declared in ``project/configuration.py`` (type, default,
meaning; the README's configuration tables are generated from it): this module takes each value
from ``configuration.read`` and reads the environment nowhere else. Production defaults: DEBUG off,
the secret key required from the environment.
"""
import os
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from project import configuration, lanes

BASE_DIR = configuration.BASE_DIR
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)  # .env fills what the environment leaves unset
try:  # an unset required variable or a value that does not parse stops the start, naming the variable
    config = configuration.read()
    PIPELINE = configuration.pipeline_config()  # the pipeline's one typed object (workers.config)
except configuration.ConfigurationError as e:
    raise ImproperlyConfigured(str(e)) from e

DEBUG = config["DJANGO_DEBUG"]
SECRET_KEY = config["DJANGO_SECRET_KEY"]
if not SECRET_KEY.strip():  # Django itself only notices when something signs; refuse at start-up
    raise ImproperlyConfigured("DJANGO_SECRET_KEY is empty: set a long random secret in the environment")
ALLOWED_HOSTS = config["DJANGO_ALLOWED_HOSTS"]
VAR_DIR = config["VAR_DIR"]
# Prometheus multiprocess mode (embeddings/metrics.py): every process (gunicorn workers, Celery
# pool children) writes its metrics to METRICS_DIR and the web's /metrics adds them up. Set here,
# before prometheus_client is first imported, from this process's own VAR_DIR (an inherited
# PROMETHEUS_MULTIPROC_DIR is replaced); METRICS_DIR="" serves each process's own metrics only.
METRICS_DIR = config["METRICS_DIR"]
if METRICS_DIR:
    Path(METRICS_DIR).mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = METRICS_DIR
else:
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
# A Celery worker serves its host's metrics on this port (0: not served; embeddings/metrics.py), so
# GPU hosts without a web process are scrape targets too (issue 11).
METRICS_PORT = config["METRICS_PORT"]
METRICS_BIND = config["METRICS_BIND"]
# Usage metering (docs/usage.md): the price of a worker-hour its cost is counted in, and the longest
# date range one GET /api/usage/ reads.
USAGE_PRICE_PER_WORKER_HOUR = config["USAGE_PRICE_PER_WORKER_HOUR"]
if USAGE_PRICE_PER_WORKER_HOUR < 0:
    raise ImproperlyConfigured(f"USAGE_PRICE_PER_WORKER_HOUR must be >= 0, not {USAGE_PRICE_PER_WORKER_HOUR}")
USAGE_MAX_RANGE_DAYS = config["USAGE_MAX_RANGE_DAYS"]
if USAGE_MAX_RANGE_DAYS < 1:
    raise ImproperlyConfigured(f"USAGE_MAX_RANGE_DAYS must be at least 1, not {USAGE_MAX_RANGE_DAYS}")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI / Redoc served from our own static files, no CDN
    "embeddings",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files from the web process itself, under gunicorn as under runserver (issue 12)
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # Django's, with a 308 (method and body kept) for a URL missing its trailing slash (embeddings/transport.py)
    "embeddings.transport.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # a body without a length (411), control characters in the URL or a site form (400); before the
    # CSRF check reads the body, after the user is known (the site's error page shows who is signed in)
    "embeddings.transport.RequestGuardMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # a key's x-ratelimit-* headers on every answer (embeddings/api/access.py)
    "embeddings.api.access.RateLimitHeadersMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# SQLite by default; several processes write (web + three workers), so WAL mode, IMMEDIATE
# transactions and a busy timeout keep "database is locked" away. DATABASE_URL selects PostgreSQL.
DATABASES = {
    "default": environ.Env.db_url_config(config["DATABASE_URL"] or f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
    }
# Persistent connections (issue 11): a worker task or request reuses its thread's connection instead
# of opening one (a PostgreSQL connection costs a process fork and an auth round trip on the
# server); the health check replaces one the server closed meanwhile. A worker closes a connection
# only when it is unusable or older than CONN_MAX_AGE (seconds; 0: one per task), checked before
# each task (project/celery.py), as Django does before each request.
DATABASES["default"]["CONN_MAX_AGE"] = config["DB_CONN_MAX_AGE"]
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# Celery 5.7's Django fix-up closes every connection before and after each task unless this is set
# (celery/fixups/django.py, close_database); set, it closes them every that many tasks only. A new
# connection per task costs about a millisecond of CPU on SQLite and ten on PostgreSQL, on every task
# of every worker, and the vectors worker runs dozens of tasks a second (docs/benchmarks.md).
CELERY_DB_REUSE_MAX = 1000 if DATABASES["default"]["CONN_MAX_AGE"] else None
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# WhiteNoise serves STATIC_ROOT (filled by `collectstatic`, which scripts/stack.py runs at start,
# gzip/brotli copies included); with USE_FINDERS it also finds files in the apps themselves, so a
# process started without collectstatic (honcho, runserver, tests) still serves every stylesheet.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns at start when it is missing
WHITENOISE_MAX_AGE = 3600  # not hashed names: an hour, so a new release is seen the same day
# The site (embeddings/site): Django sessions; pages need a signed-in user.
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "site-search"
LOGOUT_REDIRECT_URL = "login"

# Uploads: limits that Django enforces itself; the API turns their errors into a 4xx naming them.
DATA_UPLOAD_MAX_NUMBER_FILES = config["UPLOAD_MAX_FILES"]
DATA_UPLOAD_MAX_MEMORY_SIZE = config["UPLOAD_MAX_FORM_BYTES"]
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024
#: Whole-request cap on uploaded bytes (checked from Content-Length before reading the body).
UPLOAD_MAX_REQUEST_BYTES = config["UPLOAD_MAX_REQUEST_BYTES"]
#: Files per interactive request (someone is waiting; bigger sets go to POST /api/jobs/).
INTERACTIVE_MAX_FILES = config["INTERACTIVE_MAX_FILES"]
ZIP_MAX_ENTRIES = config["ZIP_MAX_ENTRIES"]
ZIP_MAX_UNCOMPRESSED_BYTES = config["ZIP_MAX_UNCOMPRESSED_BYTES"]
ZIP_MAX_RATIO = config["ZIP_MAX_RATIO"]
#: Per-key limits' defaults (embeddings.services.access.limits; docs/api-keys.md): a key's own value,
#: set by staff, wins. Must each be at least 1.
API_KEY_REQUESTS_PER_MINUTE = config["API_KEY_REQUESTS_PER_MINUTE"]
API_KEY_IMAGES_PER_MINUTE = config["API_KEY_IMAGES_PER_MINUTE"]
API_KEY_BULK_IMAGES_PER_DAY = config["API_KEY_BULK_IMAGES_PER_DAY"]
API_KEY_CONCURRENT_BULK_JOBS = config["API_KEY_CONCURRENT_BULK_JOBS"]
for _name in ("API_KEY_REQUESTS_PER_MINUTE", "API_KEY_IMAGES_PER_MINUTE", "API_KEY_BULK_IMAGES_PER_DAY",
              "API_KEY_CONCURRENT_BULK_JOBS"):
    if globals()[_name] < 1:
        raise ImproperlyConfigured(f"{_name} must be at least 1, not {globals()[_name]}")
#: Server-side folders staff may ingest from (path traversal and symlinks out are refused).
INGEST_ROOTS = [Path(p).resolve() for p in config["INGEST_ROOTS"]]

# Catalogues from where they live (issue 41): object storage read with the AWS_* credentials,
# image URLs fetched by the fetch worker under these bounds (embeddings.services.catalogue.fetching).
SOURCE_BUCKETS = config["SOURCE_BUCKETS"]
SOURCE_COPY = config["SOURCE_COPY"]
FETCH_CONNECT_TIMEOUT_S = config["FETCH_CONNECT_TIMEOUT_S"]
FETCH_READ_TIMEOUT_S = config["FETCH_READ_TIMEOUT_S"]
FETCH_TOTAL_TIMEOUT_S = config["FETCH_TOTAL_TIMEOUT_S"]
FETCH_MAX_REDIRECTS = config["FETCH_MAX_REDIRECTS"]
FETCH_RETRIES = config["FETCH_RETRIES"]
FETCH_PER_HOST = config["FETCH_PER_HOST"]
FETCH_THREADS = config["FETCH_THREADS"]
FETCH_ALLOW_NETWORKS = config["FETCH_ALLOW_NETWORKS"]
MANIFEST_MAX_ROWS = config["MANIFEST_MAX_ROWS"]
FETCH_READ_AHEAD = config["FETCH_READ_AHEAD"]
METADATA_MAX_BYTES = config["METADATA_MAX_BYTES"]
METADATA_INDEXES = config["METADATA_INDEXES"]

# Webhooks (issue 42, docs/webhooks.md): each delivery is one task on the fetch queue; attempts after
# the first are due times in the database, sent by the reconciler (no hour-long countdowns on Redis).
WEBHOOK_TIMEOUT_S = config["WEBHOOK_TIMEOUT_S"]
WEBHOOK_RETRY_SCHEDULE_S = [float(s) for s in config["WEBHOOK_RETRY_SCHEDULE_S"]]
WEBHOOK_MAX_ENDPOINTS = config["WEBHOOK_MAX_ENDPOINTS"]

REST_FRAMEWORK = {
    # API keys (and DRF tokens not yet migrated) as "Authorization: Token <key>" and as "Bearer <key>"
    # (OpenAI clients send that); docs/api-keys.md
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "embeddings.api.authentication.KeyAuthentication",
        "embeddings.api.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # every view declares the scope it needs (embeddings/api/access.py): 403 insufficient_scope
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated", "embeddings.api.access.HasScope"],
    # a key's requests per minute, counted in Redis across web processes: 429 rate_limited
    "DEFAULT_THROTTLE_CLASSES": ["embeddings.api.access.KeyRequestLimit"],
    # each operation's scope in the schema (x-required-scope)
    "DEFAULT_SCHEMA_CLASS": "embeddings.api.schema_scopes.ScopedAutoSchema",
    "EXCEPTION_HANDLER": "embeddings.api.errors.exception_handler",
    # No multipart part vanishes, and an unparseable Content-Type is a 400 (embeddings/api/parsers.py)
    "DEFAULT_PARSER_CLASSES": [
        "embeddings.api.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "embeddings.api.parsers.DrfMultiPartParser",
    ],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "embeddings.api.parsers.ContentNegotiation",
    # JSON only: DRF's browsable renderer fails (500) on views without a queryset, and a browser's
    # Accept (text/html, ..., */*) gets the JSON; an Accept nothing matches gets 406 not_acceptable
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "CLIP embeddings", "VERSION": "1.0.0",
    # Swagger UI from drf-spectacular-sidecar's pinned copy, through our static files (no Redoc: its
    # page template loads Google Fonts)
    "SWAGGER_UI_DIST": "SIDECAR", "SWAGGER_UI_FAVICON_HREF": "SIDECAR", "REDOC_DIST": "SIDECAR",
    # The schema is versioned in docs/openapi.yaml (make schema); the file names no server, so a
    # generated client is given its base URL.
    "DESCRIPTION": "CLIP image embeddings: interactive uploads, bulk jobs, similarity search (README.md).",
    "COMPONENT_SPLIT_REQUEST": True,  # request and response shapes as their own components
    # Tags (a generated client's modules: images, jobs, search, ...) are the path's segment after
    # /api/ or /v1/; left to guess, the prefix common to both would be "/" and every tag "api".
    "SCHEMA_PATH_PREFIX": r"/(api|v1)/",
    "ENUM_NAME_OVERRIDES": {"ImageStatusEnum": "embeddings.models.ImageStatus",
                            "JobStatusEnum": "embeddings.models.JobStatus",
                            "WebhookEventEnum": "embeddings.models.WebhookEvent",
                            "DeliveryStatusEnum": "embeddings.models.DeliveryStatus",
                            "DuplicateKindEnum": "embeddings.models.DuplicateKind",
                            "GroupStatusEnum": "embeddings.models.GroupStatus",
                            "ScanStateEnum": "embeddings.models.ScanState",
                            # a space's state keeps the name it had before scans had one
                            "StateEnum": "embeddings.models.SpaceState",
                            # POST /api/embeddings/: an input's kind (a job's kind keeps its name); how a
                            # vector is encoded (float | base64)
                            "KindEnum": "embeddings.models.JobKind",
                            "EmbeddingKindEnum": [("image", "image"), ("text", "text")],
                            "EncodingFormatEnum": [("float", "float"), ("base64", "base64")],
                            # OpenAI's object names (/v1): a list, a file, a batch; a file's purpose
                            "OpenAIListObjectEnum": [("list", "list")],
                            "FileObjectEnum": [("file", "file")],
                            "BatchObjectEnum": [("batch", "batch")],
                            "FilePurposeEnum": "embeddings.models.FilePurpose",
                            # GET /api/usage/: what a unit is, and what a report's rows are per
                            "UsageKindEnum": "embeddings.models.UsageKind",
                            "UsageGroupByEnum": [(g, g) for g in ("key", "model", "day", "kind", "owner")]},
    # 401 on every secured operation and 404 on every one with a path parameter (embeddings/api/schema.py)
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "embeddings.api.schema.postprocess", "embeddings.api.schema_rules.postprocess"],
}

# --- The pipeline -------------------------------------------------------------------------------
# PIPELINE (built at the top) holds the model a deployment starts with (CLIP_MODEL, CLIP_PRETRAINED,
# CLIP_PRECISION, CLIP_SEED): the first embedding space. Once the database has an active space, that
# row decides (embeddings/spaces.py); changing these variables afterwards is a migration, not a switch.
#: Other models the workers may load, for migrations: comma-separated ``model:pretrained[:precision]``
#: (e.g. ``ViT-B-16:openai,ViT-L-14:/models/l14.pt:fp32``; precision defaults to CLIP_PRECISION). A
#: worker process holds at most these and the active model (docs/operations.md: memory per model).
CLIP_MODELS = config["CLIP_MODELS"]
#: How long (s) a process may keep using its cached copy of the active-space row: a promotion or a
#: rollback takes effect in every process within this time.
SPACE_CACHE_S = config["SPACE_CACHE_S"]
#: Quality gate (embeddings/services/lifecycle/gate.py): the lowest share of re-encoded copies (3/4 size, JPEG
#: 85) that must find their original first for ``promote`` (the issue's 0.99), and how many images
#: are probed (200: one miss passes, two do not).
MIGRATION_GATE_THRESHOLD = config["MIGRATION_GATE_THRESHOLD"]
MIGRATION_GATE_SAMPLE = config["MIGRATION_GATE_SAMPLE"]
#: Near-duplicate groups (embeddings/services/duplicates/): the threshold of a catalogue too small to
#: calibrate, the images a calibration copies, the points one scan task queries.
DUPLICATES_DEFAULT_THRESHOLD = config["DUPLICATES_DEFAULT_THRESHOLD"]
DUPLICATES_CALIBRATION_SAMPLE = config["DUPLICATES_CALIBRATION_SAMPLE"]
DUPLICATES_SCAN_SLICE = config["DUPLICATES_SCAN_SLICE"]
#: Calibrated cutoff (embeddings/services/lifecycle/cutoff.py): the percentile of cosine scores between
#: unrelated pairs (image–image, text–image) taken as a space's default ``min_score``.
CUTOFF_PERCENTILE = config["CUTOFF_PERCENTILE"]
#: Points a collection needs before it gets a cutoff (fewer: nothing is cut): 100 points give 4,950
#: pairs, so the 99th percentile rests on the top ~50 of them, not on a few near-duplicates.
CUTOFF_MIN_POINTS = config["CUTOFF_MIN_POINTS"]
BLOB_ROOT = VAR_DIR / "blobs"
# Image bytes and thumbnails (embeddings/storage.py) go through Django's storage API, STORAGES["blobs"]:
# STORAGE_URL empty: files under BLOB_ROOT (one host). s3://bucket[/prefix]: S3-compatible object
# storage through django-storages + boto3 (several hosts); S3_ENDPOINT_URL names a non-AWS endpoint
# (MinIO, Ceph, moto), credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or boto3's
# own chain: instance roles, ~/.aws) and the region from AWS_S3_REGION_NAME.
STORAGE_URL = config["STORAGE_URL"]
if not STORAGE_URL or STORAGE_URL.startswith("file://"):
    if STORAGE_URL:
        BLOB_ROOT = Path(STORAGE_URL.removeprefix("file://"))
    STORAGES["blobs"] = {"BACKEND": "embeddings.storage.ContentFileSystemStorage"}  # location: BLOB_ROOT
elif STORAGE_URL.startswith("s3://"):
    _bucket, _, _prefix = STORAGE_URL.removeprefix("s3://").partition("/")
    STORAGES["blobs"] = {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
        "bucket_name": _bucket, "location": _prefix.strip("/"),
        "endpoint_url": config["S3_ENDPOINT_URL"] or None,
        "region_name": config["AWS_S3_REGION_NAME"] or None,
        "access_key": config["AWS_ACCESS_KEY_ID"] or None,
        "secret_key": config["AWS_SECRET_ACCESS_KEY"] or None,
        "addressing_style": config["AWS_S3_ADDRESSING_STYLE"] or None,  # "path" for most non-AWS servers
        "file_overwrite": True,  # content-addressed: the same name always holds the same bytes
        "default_acl": None, "querystring_auth": False,
    }}
else:
    raise ImproperlyConfigured(
        f"STORAGE_URL must be empty, file:///folder or s3://bucket[/prefix], not {STORAGE_URL!r}")
#: How the fetch worker reaches the buckets of SOURCE_BUCKETS (the blob store's endpoint and keys).
SOURCE_S3 = {
    "endpoint_url": config["S3_ENDPOINT_URL"] or None, "region": config["AWS_S3_REGION_NAME"] or None,
    "access_key": config["AWS_ACCESS_KEY_ID"] or None, "secret_key": config["AWS_SECRET_ACCESS_KEY"] or None,
    "addressing_style": config["AWS_S3_ADDRESSING_STYLE"] or None,
}
QDRANT_URL = config["QDRANT_URL"]
#: Vector store backend (workers/vector_store): ``edge`` (Qdrant's engine in-process, the default),
#: ``local`` (qdrant-client local mode, for installations not yet moved: ``manage.py store_migrate``)
#: or ``server`` (``QDRANT_URL``; the default when it is set).
VECTOR_STORE = config["VECTOR_STORE"]
#: Folder of the embedded store: one shard folder per collection (edge), or local mode's folder.
QDRANT_PATH = config["QDRANT_PATH"]
#: Edge: a write is acknowledged once it is in the write-ahead log (survives a killed worker, as a
#: Qdrant server's default does); 1: also flushed (fsync) first, which survives a power loss but costs
#: milliseconds per write, more on a busy disk (docs/operations.md).
VECTOR_STORE_FSYNC = config["VECTOR_STORE_FSYNC"]
#: Edge: optimise (build HNSW, merge segments) in the vectors worker after this many seconds with no
#: store call and at least VECTOR_STORE_OPTIMIZE_MIN_POINTS new points (0: never in the worker).
VECTOR_STORE_OPTIMIZE_IDLE_S = config["VECTOR_STORE_OPTIMIZE_IDLE_S"]
VECTOR_STORE_OPTIMIZE_MIN_POINTS = config["VECTOR_STORE_OPTIMIZE_MIN_POINTS"]
#: Which worker owns an embedded store: ``vectors`` (the vectors worker) or ``interactive`` (the
#: interactive worker, which then consumes the vectors queue too: ``project.processes``,
#: ``embeddings.sink.WriteTarget.INTERACTIVE_WORKER``). A server has no owner: every process opens it.
STORE_OWNER = config["STORE_OWNER"]
if STORE_OWNER not in ("vectors", "interactive"):
    raise ImproperlyConfigured(f"STORE_OWNER must be 'vectors' or 'interactive', not {STORE_OWNER!r}")
if STORE_OWNER == "interactive" and VECTOR_STORE == "server":
    raise ImproperlyConfigured("STORE_OWNER=interactive is for an embedded store (VECTOR_STORE edge or local): "
                               "with a Qdrant server every process opens the store itself")
#: Interactive requests wait at most this long (s) before answering 202 with a status URL.
INTERACTIVE_DEADLINE_S = config["INTERACTIVE_DEADLINE_S"]
#: How the interactive lane's dynamic batcher waits for company (workers/batcher.py, ``WAIT_POLICIES``).
INTERACTIVE_BATCH_WAIT = config["INTERACTIVE_BATCH_WAIT"]
if INTERACTIVE_BATCH_WAIT not in ("window", "announced"):
    raise ImproperlyConfigured(f"INTERACTIVE_BATCH_WAIT must be 'announced' or 'window', not {INTERACTIVE_BATCH_WAIT!r}")
HOP_TRACE = config["HOP_TRACE"]
if HOP_TRACE:  # outermost: the web's whole time of a request, rendering included (benchmarks.lanes)
    MIDDLEWARE.insert(0, "embeddings.lane_control.hops.HopMiddleware")
#: Inputs of one embeddings request (POST /api/embeddings/, POST /v1/embeddings): every one is an
#: interactive request's work within its deadline; a catalogue goes to POST /api/jobs/.
EMBEDDINGS_MAX_INPUTS = config["EMBEDDINGS_MAX_INPUTS"]
#: OpenAI's Batch API (docs/batch-api.md): an input file's bytes and lines, the completion windows accepted.
BATCH_MAX_FILE_BYTES = config["BATCH_MAX_FILE_BYTES"]
BATCH_MAX_LINES = config["BATCH_MAX_LINES"]
BATCH_WINDOW_MIN_S = config["BATCH_WINDOW_MIN_S"]
BATCH_WINDOW_MAX_S = config["BATCH_WINDOW_MAX_S"]
#: Refuse interactive work with 429 + Retry-After when its predicted wait exceeds its deadline
#: (embeddings/lane_control/admission.py).
ADMISSION_CONTROL = config["ADMISSION_CONTROL"]
#: Default number of neighbours (top-k) returned.
SEARCH_DEFAULT_K = 10
SEARCH_MAX_K = 100
#: Timeout for web → vectors-worker round trips that are not interactive embeds (s).
VECTORS_CALL_TIMEOUT_S = config["VECTORS_CALL_TIMEOUT_S"]
#: Points a bulk chunk writes between two looks at the vectors queue: when interactive work waits
#: there, the rest of the chunk goes back to the queue behind it (``queues.vectors.chunk_index``), so an
#: interactive request waits behind at most one slice, not a whole chunk. Each slice costs one store
#: call, two UPDATEs and a look at the queue (one Redis command); the chunk's rows are read once
#: (issue 10). The embedded stores: half a chunk (32), the most that still keeps an interactive
#: request from waiting for a whole chunk; smaller slices cost the vectors worker more CPU per point
#: (docs/benchmarks.md). A Qdrant server prefers bigger requests, and there each embedding worker
#: writes its own points (nothing to yield to): one slice per chunk of 64.
VECTORS_WRITE_SLICE = config["VECTORS_WRITE_SLICE"]

# --- Celery (see ../shared/NOTES.md for why each knob is set) ------------------------------------
REDIS_URL = config["REDIS_URL"]
CELERY_BROKER_URL = REDIS_URL
#: This deployment's name; every Redis key it writes starts with ``REDIS_KEY_PREFIX`` (``"<name>:"``):
#: kombu's queues and bookkeeping (``global_keyprefix`` below), results, lane control's keys. Two
#: deployments on one Redis database then never take each other's tasks (project/lanes.py).
DEPLOYMENT_NAME = config["DEPLOYMENT_NAME"]
try:
    REDIS_KEY_PREFIX = lanes.key_prefix(DEPLOYMENT_NAME)
except ValueError as e:
    raise ImproperlyConfigured(str(e)) from e
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = lanes.transport_options(DEPLOYMENT_NAME)
# Celery's Redis backend, keeping a result someone waits for only until that wait's deadline
# (project/results.py); CELERY_RESULT_EXPIRES is the ceiling for any other stored result.
CELERY_RESULT_BACKEND = "project.results:DeadlineRedisBackend+" + REDIS_URL
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Prefetch 1: a worker reserves no more than it runs, so bulk chunks are never hoarded
# (celery/celery#3434) and an interactive message is never stuck behind prefetched bulk work.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Late acks + reject on worker lost: a chunk killed mid-run is redelivered, not lost
# (celery/celery#1628). Writes are idempotent (deterministic point ids), so redelivery is safe.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
#: Redis redelivers an unacknowledged message after this (s), even if it is still running
#: (celery/celery#5935): chunks must finish far inside it (checked at worker start-up).
CELERY_VISIBILITY_TIMEOUT_S = config["CELERY_VISIBILITY_TIMEOUT_S"]
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": CELERY_VISIBILITY_TIMEOUT_S,
    # Redis: 0 is the highest priority; steps bucket 0-9. Queues consumed by one worker are taken
    # in the listed order (interactive first), not round-robin. The strategy is kombu's "priority"
    # plus a gate: a worker consuming both lanes holds at most two bulk messages, one computing and
    # one on deck (deployment (b), docs/lanes.md).
    "priority_steps": [0, 3, 6, 9],
    "queue_order_strategy": "embeddings.lane_control.bulk_yield:LaneGateCycle",
    # BRPOP timeout (s): bounds how long a gated worker takes to ask for bulk work again (the
    # on-deck chunk hides it while chunks take longer).
    "polling_interval": config["BROKER_POLLING_INTERVAL_S"],
    **lanes.transport_options(DEPLOYMENT_NAME),
}
CELERY_TASK_DEFAULT_QUEUE = lanes.BULK
CELERY_TASK_DEFAULT_PRIORITY = lanes.PRIORITY_BULK_BACKGROUND
CELERY_TASK_CREATE_MISSING_QUEUES = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Task events for the lane tests and benchmarks, off by default: task-sent from the publisher (the
# moment a message entered its queue), task-started/-succeeded from the worker.
CELERY_WORKER_SEND_TASK_EVENTS = config["CELERY_TASK_EVENTS"]
CELERY_TASK_SEND_SENT_EVENT = CELERY_WORKER_SEND_TASK_EVENTS
#: CPU niceness a worker gives itself at start (its pool children inherit it); 0 = unchanged.
WORKER_NICE = config["WORKER_NICE"]
#: Niceness of a worker that consumes the bulk queue only (deployment (a)) when ``WORKER_NICE`` is 0:
#: the kernel runs every other process first (interactive worker, web, vectors worker) and gives bulk
#: every idle cycle: "bulk yields" at the CPU. 19 holds both lane targets where the lanes share
#: cores (docs/benchmarks.md); 0 turns it off.
BULK_WORKER_NICE = config["BULK_WORKER_NICE"]
#: MiB of freed memory a worker consuming the bulk queue keeps for its next chunk, and the block size
#: from which glibc would otherwise map (and fault in) each block afresh (``workers.memory``).
BULK_BATCH_MEMORY_MB = config["BULK_BATCH_MEMORY_MB"]
#: On: a bulk-only worker also puts its threads (and so its prefork children's) under Linux's
#: ``SCHED_IDLE`` policy: they run only on a core nothing else wants, and a waking interactive thread
#: preempts them at once, where a nice-19 thread keeps its slice. That helps an interactive pass
#: spread over several torch threads; on one thread (what it gets on 2 cores) it gains nothing and
#: bulk embeds fewer images (``make bench-sched``; docs/benchmarks-load-history.md, "The bulk worker
#: under SCHED_IDLE"). So off by default; for hosts whose interactive worker runs several torch
#: threads (4+ cores). Ignored (a warning) where the OS has no SCHED_IDLE.
BULK_WORKER_SCHED_IDLE = config["BULK_WORKER_SCHED_IDLE"]
#: A bulk chunk must finish well inside the visibility timeout: hard limit at a third of it.
CELERY_BULK_TIME_LIMIT_S = config["CELERY_BULK_TIME_LIMIT_S"]
#: A stopping worker's bound (s) on its tasks in flight: SIGTERM with REMAP_SIGTERM=SIGQUIT (the
#: Kubernetes manifests and docker-compose.yml set it) is Celery's soft shutdown: it stops consuming,
#: waits this long for the tasks running, then hands back what still runs (acks_late: requeued at
#: once, not after the visibility timeout). Celery's default SIGTERM is a warm shutdown with no bound,
#: which a pod's grace period cuts with SIGKILL (docs/deploy.md, "Drain").
WORKER_DRAIN_S = config["WORKER_DRAIN_S"]
CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT = WORKER_DRAIN_S
#: Failed forward passes in a row (an exception, or every vector refused) after which a worker
#: leaves the pool: it stops and exits for its supervisor to restart it (embeddings/worker_health.py).
WORKER_MAX_BATCH_FAILURES = config["WORKER_MAX_BATCH_FAILURES"]
#: Readiness (embeddings/services/readiness.py, /readyz): canaries sent at most every
#: CANARY_INTERVAL_S per lane, failed when slower than CANARY_TIMEOUT_S, a lane working while one of
#: its workers answered one within CANARY_MAX_AGE_S; READY_LANES must have a working worker.
CANARY_INTERVAL_S = config["CANARY_INTERVAL_S"]
CANARY_TIMEOUT_S = config["CANARY_TIMEOUT_S"]
CANARY_MAX_AGE_S = config["CANARY_MAX_AGE_S"]
READY_LANES = config["READY_LANES"]
_unknown_lanes = set(READY_LANES) - set(lanes.ALL_QUEUES)
if _unknown_lanes:
    raise ImproperlyConfigured(f"READY_LANES names no lane: {sorted(_unknown_lanes)} "
                               f"(lanes: {', '.join(lanes.ALL_QUEUES)})")

# --- Recovery (embeddings/services/reconcile.py, docs/operations.md) ----------------------------
#: Seconds between reconciler rounds, run by the vectors worker (0: off; `manage.py reconcile` runs one).
RECONCILE_INTERVAL_S = config["RECONCILE_INTERVAL_S"]
#: A queued image or an unacknowledged delivery younger than this (s) is never treated as lost.
RECONCILE_GRACE_S = config["RECONCILE_GRACE_S"]
#: Attempts at a bulk image (deliveries that started it + reconciler re-dispatches) before it fails
#: with ``attempts_exhausted``: a poison image must not loop through worker crashes forever.
BULK_MAX_ATTEMPTS = config["BULK_MAX_ATTEMPTS"]
#: Admission's margin: the quantile of its own recent errors (actual − predicted wait, s) that is added
#: to a prediction before it is compared with the deadline (queueing/wait_model.py fit_wait,
#: _upper_bound: read off the late errors' spread). Issue 15 asks that at least 95 % of admitted
#: requests answer within their deadline; under overload nearly every admitted request sits at the
#: admission threshold, so the late share is about 1 - this quantile plus the model's lag: the 99th
#: percentile leaves room for the lag with goodput still at the measured capacity, the 95th does not
#: (docs/benchmarks-load.md).
ADMISSION_MARGIN_QUANTILE = config["ADMISSION_MARGIN_QUANTILE"]
#: The margin is never less than this share of the predicted wait (wait_model.margin_s): at long
#: deadlines the learnt margin lags by one wait. 0.2 cuts the late answers at long deadlines and
#: leaves short ones nearly unchanged in replays of load-benchmark runs (docs/benchmarks-load.md); 0:
#: the learnt margin alone.
ADMISSION_MIN_MARGIN_SHARE = config["ADMISSION_MIN_MARGIN_SHARE"]
#: ... and never more than this share of the deadline (wait_model.margin_s): a burst of late answers
#: (an overload that starts at once) can raise the learnt margin to nearly the whole deadline, which
#: admits nothing but requests to an empty lane, and the lane then starves for seconds while its few
#: answers teach the model the truth (docs/benchmarks-load-history.md, "Starved lanes"). 1: no cap.
ADMISSION_MAX_MARGIN_SHARE = config["ADMISSION_MAX_MARGIN_SHARE"]
#: Migration chunks computing at once per worker host (embeddings/lane_control/bulk_yield.py
#: migration_slot): a migration runs at background priority and must not double the interactive p95
#: on shared cores (docs/benchmarks-migration.md). 0: no limit (e.g. a GPU host with spare capacity).
MIGRATION_BULK_SLOTS = config["MIGRATION_BULK_SLOTS"]
#: A migration chunk runs as forward passes of this many images (0: the bulk lane's BULK_MICRO_BATCH)
#: and, before each, waits while the interactive lane has work, at most MIGRATION_YIELD_MAX_S (0:
#: never waits; e.g. a GPU host whose lanes do not share cores): bulk_yield.migration_yield.
MIGRATION_MICRO_BATCH = config["MIGRATION_MICRO_BATCH"]
#: Passes after a migration chunk's first grow while the last pass's time per image (decode and
#: forward) keeps one under this many ms (0: fixed passes): a pass is what the interactive lane may
#: wait behind, and on a GPU 4 images take well under a millisecond (workers/passes.py).
MIGRATION_PASS_MS = config["MIGRATION_PASS_MS"]
#: Images per migration chunk task: its SQL, Celery message, store write and Redis traffic are paid
#: once per chunk, so a re-embed from previews at hundreds of images/s needs chunks of hundreds
#: (docs/scaling.md); its passes are MIGRATION_MICRO_BATCH images, or as MIGRATION_PASS_MS lets them grow.
MIGRATION_CHUNK_SIZE = config["MIGRATION_CHUNK_SIZE"]
if MIGRATION_CHUNK_SIZE < 1:
    raise ImproperlyConfigured(f"MIGRATION_CHUNK_SIZE must be at least 1 image, not {MIGRATION_CHUNK_SIZE}")
MIGRATION_YIELD_MAX_S = config["MIGRATION_YIELD_MAX_S"]
#: A background ingest job's chunk runs as forward passes of BULK_YIELD_MICRO_BATCH images and,
#: before each, waits while the interactive lane has work and admission has refused a request within
#: BULK_YIELD_REFUSED_S (the lane at capacity; 0: whenever it has work), at most BULK_YIELD_MAX_S
#: (0: never waits, the chunk runs as one pass; e.g. a host whose lanes do not share cores),
#: all its waits at most half of CELERY_BULK_TIME_LIMIT_S: bulk_yield.ingest_yielder. Urgent jobs,
#: and a job at risk of missing its deadline (jobs.job_deadline_at_risk), never wait.
BULK_YIELD_MAX_S = config["BULK_YIELD_MAX_S"]
BULK_YIELD_REFUSED_S = config["BULK_YIELD_REFUSED_S"]
BULK_YIELD_MICRO_BATCH = config["BULK_YIELD_MICRO_BATCH"]
#: The bulk lane's order (embeddings.bulk_schedule, queueing.bulk_order; docs/lanes.md, "The bulk
#: lane's order"): `fair` keeps each job's unsent chunks in the database and sends one when a chunk
#: of the window leaves it, so a job that arrives behind a big one waits for the window, not for the
#: big job; `fifo` sends every chunk when it is made (first come, first served inside a priority).
BULK_SCHEDULER = config["BULK_SCHEDULER"]
if BULK_SCHEDULER not in ("fair", "fifo"):
    raise ImproperlyConfigured(f"BULK_SCHEDULER must be 'fair' or 'fifo', not {BULK_SCHEDULER!r}")
#: Chunks sent and not finished at once: enough that no bulk process waits for its next chunk (one
#: computing, one on deck), few enough that a new job's chunk is chosen a chunk's time after it arrives.
BULK_SCHEDULER_WINDOW = config["BULK_SCHEDULER_WINDOW"]
if BULK_SCHEDULER_WINDOW < 1:
    raise ImproperlyConfigured(f"BULK_SCHEDULER_WINDOW must be at least 1 chunk, not {BULK_SCHEDULER_WINDOW}")


def _weights(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, weight = item.rpartition("=")
        try:
            out[name.strip()] = float(weight)
        except ValueError:
            raise ImproperlyConfigured(f"BULK_OWNER_WEIGHTS: {item!r} is not username=weight") from None
        if not sep or not name.strip() or out[name.strip()] <= 0:
            raise ImproperlyConfigured(f"BULK_OWNER_WEIGHTS: {item!r} is not username=weight (weight > 0)")
    return out


BULK_OWNER_WEIGHTS = _weights(config["BULK_OWNER_WEIGHTS"])
BULK_LIFECYCLE_WEIGHT = config["BULK_LIFECYCLE_WEIGHT"]
if BULK_LIFECYCLE_WEIGHT <= 0:
    raise ImproperlyConfigured(f"BULK_LIFECYCLE_WEIGHT must be > 0, not {BULK_LIFECYCLE_WEIGHT}")
BULK_METRICS_OWNERS = config["BULK_METRICS_OWNERS"]

# --- Production security (`manage.py check --deploy` is clean with DJANGO_HTTPS=1) ---------------
# DEBUG is off and SECRET_KEY required from the environment (above). Behind TLS, DJANGO_HTTPS=1
# turns on HTTPS redirects, secure cookies and HSTS; DJANGO_BEHIND_PROXY=1 trusts the proxy's
# X-Forwarded-Proto. /healthz and /readyz stay reachable over plain HTTP for probes.
HTTPS = config["DJANGO_HTTPS"]
SECURE_SSL_REDIRECT = HTTPS
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
SESSION_COOKIE_SECURE = HTTPS
CSRF_COOKIE_SECURE = HTTPS
SECURE_HSTS_SECONDS = config["DJANGO_HSTS_SECONDS"]
SECURE_HSTS_INCLUDE_SUBDOMAINS = config["DJANGO_HSTS_INCLUDE_SUBDOMAINS"]
SECURE_HSTS_PRELOAD = config["DJANGO_HSTS_PRELOAD"]
if config["DJANGO_BEHIND_PROXY"]:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
CSRF_TRUSTED_ORIGINS = config["DJANGO_CSRF_TRUSTED_ORIGINS"]
X_FRAME_OPTIONS = "DENY"
# A form posted without its CSRF token: the site's page (or the API's shape under /api/, /v1/)
CSRF_FAILURE_VIEW = "embeddings.transport.csrf_failure"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": config["LOG_LEVEL"]},
}
