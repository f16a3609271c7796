"""Every environment variable the service reads, declared once: name, type, default, group, meaning.

``project/settings.py`` takes each setting from :func:`read`, builds the pipeline's one typed object
with :func:`pipeline_config`, and ``project/processes.py`` sizes the command lines from :func:`read`
too; no other module reads the environment for a setting. The README's configuration tables are
generated from :data:`VARS` (``python -m project.configuration --markdown`` prints them, ``make
config-docs`` rewrites them in README.md; ``tests/test_configuration.py`` fails when they differ).

Framework-free (standard library, ``workers.config``, ``queueing.wait_model``): the process table
imports it without Django. Defaults with a source elsewhere are taken from it
(``PipelineConfig``'s fields, ``queueing.wait_model``'s margin policy), never repeated here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import environ as django_environ

from queueing import wait_model
from workers.config import Hardware, PipelineConfig, resolve_precision

#: The checkout's root: relative defaults (``var/``) live under it, as ``settings.BASE_DIR``.
BASE_DIR = Path(__file__).resolve().parent.parent
README = BASE_DIR / "README.md"
#: The lines the generated tables sit between in README.md.
BEGIN = "<!-- configuration:begin (generated from project/configuration.py by `make config-docs`: edit there) -->"
END = "<!-- configuration:end -->"

#: The groups, in the README's order: ``(key, heading)``.
GROUPS = (
    ("web", "Web: the web process, its security and its logs"),
    ("state", "State: the database, the broker, local files and recovery"),
    ("metrics", "Metrics"),
    ("models", "Models: the embedding space, migrations and the calibrated cutoff"),
    ("workers", "Workers: where and on how many threads the pipeline runs"),
    ("lanes", "Interactive lane: batching, deadlines and admission"),
    ("bulk", "Bulk lane: chunks, processes and yielding"),
    ("store", "Vector store"),
    ("storage", "Image storage"),
    ("catalogue", "Catalogues: manifests, object-storage prefixes, URL fetching and metadata"),
    ("webhooks", "Webhooks: signed callbacks when jobs and model migrations change state"),
    ("limits", "Limits"),
)


class ConfigurationError(ValueError):
    """A variable is required and unset, or its value does not parse (the message names it)."""


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a variable that must be set.
REQUIRED: Any = _Required()

#: A default computed from other variables' values: ``fn(get)``, ``get(name)`` the typed value of another.
Derived = Callable[[Callable[[str], Any]], Any]


#: The types each reading rule gives (see :class:`Var`'s ``rules``).
TYPES = {"environ": (str, bool, int, float, Path, list), "pipeline": (str, int, float)}


@dataclasses.dataclass(frozen=True)
class Var:
    """One environment variable.

    Attributes:
        name: the variable, e.g. ``"REDIS_URL"``.
        type: what the value becomes: ``str``, ``bool``, ``int``, ``float``, ``list`` (of ``str``,
            comma-separated) or ``Path``.
        default: the typed value when unset; ``None``: unset means "none" (automatic); a
            :data:`Derived` callable for a default that follows other variables; :data:`REQUIRED`.
        group: a key of :data:`GROUPS`.
        meaning: one line for the README.
        shown: the default as the README writes it, where the value alone would not say it (derived
            defaults, paths in the checkout, sizes).
        rules: how a set value is read. ``"environ"``: django-environ's rules (``environ.Env``), for
            the Django and service settings: an empty value is a value (``""`` is false, ``[]``,
            ``""``; an empty number fails), ``$OTHER`` stands for OTHER's value, a float may carry
            thousands separators or a decimal comma. ``"pipeline"``: the pipeline's own rules
            (``PipelineConfig``'s variables, which docker-compose passes as ``${CLIP_MODEL:-...}``
            and may leave empty): an empty value means unset, numbers through plain ``int()`` /
            ``float()``.
    """

    name: str
    type: type
    default: Any
    group: str
    meaning: str
    shown: str | None = None
    rules: Literal["environ", "pipeline"] = "environ"

    def __post_init__(self) -> None:
        if self.type not in TYPES[self.rules]:
            raise TypeError(f"{self.name}: {self.rules!r} values cannot be read as {self.type.__name__}")


_PIPELINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}
_GiB, _MiB = 1024 ** 3, 1024 ** 2


def _pipeline(name: str, field: str | None, type_: type, group: str, meaning: str, *, default: Any = None,
              shown: str | None = None) -> Var:
    """A variable of :class:`PipelineConfig`: its default is the field's (``field``), unless given."""
    value = _PIPELINE_DEFAULTS[field] if field else default
    return Var(name, type_, value, group, meaning, shown=shown, rules="pipeline")


VARS: tuple[Var, ...] = (
    # --- web ---------------------------------------------------------------------------------------
    Var("DJANGO_SECRET_KEY", str, REQUIRED, "web", "Django's secret (signs sessions and CSRF tokens); empty is refused",
        shown="required (`make` writes one to `.env`)"),
    Var("DJANGO_DEBUG", bool, False, "web", "Django's debug mode (never in production)"),
    Var("DJANGO_ALLOWED_HOSTS", list, ["127.0.0.1", "localhost", "testserver"], "web",
        "host names the web answers to"),
    Var("DJANGO_HTTPS", bool, False, "web",
        "behind TLS: HTTPS redirects (not `/healthz`), secure cookies and HSTS (`manage.py check --deploy` is clean)"),
    Var("DJANGO_HSTS_SECONDS", int, lambda get: 31_536_000 if get("DJANGO_HTTPS") else 0, "web",
        "HSTS max-age (s)", shown="`31536000` (a year) with `DJANGO_HTTPS`, else `0`"),
    Var("DJANGO_HSTS_INCLUDE_SUBDOMAINS", bool, lambda get: get("DJANGO_HTTPS"), "web",
        "HSTS covers subdomains", shown="`DJANGO_HTTPS`"),
    Var("DJANGO_HSTS_PRELOAD", bool, lambda get: get("DJANGO_HTTPS"), "web",
        "HSTS asks for the browsers' preload list", shown="`DJANGO_HTTPS`"),
    Var("DJANGO_BEHIND_PROXY", bool, False, "web", "trust the proxy's `X-Forwarded-Proto` header"),
    Var("DJANGO_CSRF_TRUSTED_ORIGINS", list, [], "web",
        "origins trusted for unsafe requests, e.g. `https://clip.example`"),
    Var("WEB_BIND", str, "127.0.0.1", "web", "address gunicorn listens on"),
    Var("WEB_PORT", str, "8000", "web", "port gunicorn listens on"),
    Var("WEB_THREADS", int, 32, "web",
        "gunicorn threads per web process (2 processes): each waiting interactive request holds one until its "
        "deadline, so this bounds how many can wait at once; a waiting thread holds no database connection"),
    Var("LOG_LEVEL", str, "INFO", "web", "level of the root logger (every process logs to stderr)"),
    # --- state -------------------------------------------------------------------------------------
    Var("VAR_DIR", Path, BASE_DIR / "var", "state", "database, blobs, embedded Qdrant, metrics, logs",
        shown="`var/` in the checkout"),
    Var("DATABASE_URL", str, "", "state", "database URL, e.g. `postgres://postgres@127.0.0.1:5432/clip`",
        shown="empty: SQLite at `$VAR_DIR/db.sqlite3` (WAL, busy timeout)"),
    Var("DB_CONN_MAX_AGE", int, 600, "state",
        "seconds a worker thread or request keeps its database connection (`0`: one per task); "
        "health-checked before reuse"),
    Var("REDIS_URL", str, "redis://127.0.0.1:6379/0", "state",
        "broker and result backend; the scripts start a private `redis-server` if none answers"),
    Var("DEPLOYMENT_NAME", str, "clip", "state",
        "this deployment's name: every Redis key it writes (Celery's queues, unacknowledged messages, "
        "results, events, lane control) starts with `<name>:`, so deployments sharing one Redis database never "
        "take each other's tasks; letters, digits, `.`, `_`, `-` (docs/operations.md)"),
    Var("CELERY_VISIBILITY_TIMEOUT_S", int, 3600, "state",
        "Redis redelivers a message unacknowledged this long (s), even if still running: chunks finish far inside it"),
    Var("BROKER_POLLING_INTERVAL_S", float, 0.2, "state",
        "Redis `BRPOP` timeout (s): bounds how long a gated worker takes to ask for bulk work again"),
    Var("CELERY_TASK_EVENTS", bool, False, "state", "Celery task events (sent, started, succeeded), for the lane tests "
        "and benchmarks"),
    Var("RECONCILE_INTERVAL_S", float, 30.0, "state",
        "seconds between reconciler rounds in the vectors worker (`0`: off; `manage.py reconcile` runs one)"),
    Var("RECONCILE_GRACE_S", float, 120.0, "state",
        "a queued image or unacknowledged delivery younger than this (s) is never treated as lost"),
    # --- metrics -----------------------------------------------------------------------------------
    Var("METRICS_DIR", str, lambda get: str(get("VAR_DIR") / "prometheus"), "metrics",
        "Prometheus multiprocess folder every process writes to (empty: each process serves its own metrics only)",
        shown="`$VAR_DIR/prometheus`"),
    Var("METRICS_PORT", int, 0, "metrics",
        "a Celery worker serves its host's metrics on this port (`0`: off; GPU hosts without a web process: "
        "`docs/scaling.md`)"),
    Var("METRICS_BIND", str, "0.0.0.0", "metrics", "address of the worker's metrics port"),
    Var("USAGE_PRICE_PER_WORKER_HOUR", float, 1.0, "metrics",
        "price of one worker-hour (any currency): usage's cost is compute seconds / 3600 × this, its cost per image "
        "that over the images embedded (`docs/usage.md`; `benchmarks.bulk --price-per-hour` prices the same hour)"),
    Var("USAGE_MAX_RANGE_DAYS", int, 93, "metrics",
        "longest `start`..`end` range of one `GET /api/usage/` (days, both ends counted); longer is a 400 "
        "`usage_range_too_long`"),
    # --- models ------------------------------------------------------------------------------------
    _pipeline("CLIP_MODEL", "model_name", str, "models",
              "open_clip architecture of the first embedding space; after the first start the active space (a "
              "database row) decides and a change is a migration (`docs/operations.md`, \"Changing the model\")"),
    _pipeline("CLIP_PRETRAINED", "pretrained", str, "models",
              "its weights: an open_clip tag, a checkpoint file (a whole model, or `visual.*` alone: an image-only "
              "space whose texts are refused, `text_tower_missing`), or `random` (seeded random weights, explicit only)"),
    _pipeline("CLIP_SEED", "seed", int, "models", "seed of the random weights"),
    _pipeline("CLIP_PRECISION", None, str, "models",
              "`auto`, `fp32`, `bf16` or `fp16` (CUDA only); `auto` is `bf16` where the hardware computes it "
              "natively, else `fp32` (see below)", default="auto"),
    _pipeline("MODEL_BACKEND", None, str, "models",
              "what runs the image tower: `auto`, `torch` (open_clip), `openvino` or `onnxruntime` (the same weights "
              "exported, cached under `$VAR_DIR/model-cache`); `auto` is torch (no runtime measured >= 1.5x faster on "
              "the CPU: `docs/benchmarks-model.md`) and always torch on CUDA; one that cannot load falls back to torch "
              "with a warning; not part of the embedding space (cosine >= 0.999 to open_clip's own)", default="auto"),
    Var("CLIP_MODELS", list, [], "models",
        "other models the workers may load, for migrations: `model:pretrained[:precision]`, comma-separated "
        "(precision defaults to `CLIP_PRECISION`)"),
    Var("SPACE_CACHE_S", float, 0.5, "models",
        "a promotion or rollback of the model is seen by every process within this many seconds"),
    Var("MIGRATION_GATE_THRESHOLD", float, 0.99, "models",
        "quality gate of a promotion: the share of re-encoded copies (3/4 size, JPEG 85) that find their original "
        "first"),
    Var("MIGRATION_GATE_SAMPLE", int, 200, "models", "images the quality gate probes"),
    Var("DUPLICATES_DEFAULT_THRESHOLD", float, 0.95, "models",
        "near-duplicate cosine threshold of a catalogue too small to calibrate (fewer than 8 sampled images; "
        "`docs/duplicates.md`)"),
    Var("DUPLICATES_CALIBRATION_SAMPLE", int, 48, "models",
        "images whose copies calibrate an owner's near-duplicate threshold (4 copies each, embedded on the bulk lane)"),
    Var("DUPLICATES_SCAN_SLICE", int, 512, "models",
        "points per near-duplicate scan task on the vectors worker (about 2 s at 100,000 points: interactive "
        "searches go between slices)"),
    Var("MIGRATION_BULK_SLOTS", int, 1, "models",
        "migration chunks computing at once per worker host (`0`: no limit, hosts whose lanes do not share cores)"),
    Var("MIGRATION_CHUNK_SIZE", int, 512, "models",
        "images per migration chunk task (a re-embed from previews runs at hundreds of images/s: per-chunk costs "
        "shared by 256-1,024 images; `docs/scaling.md`)"),
    Var("MIGRATION_MICRO_BATCH", int, 4, "models",
        "a migration chunk runs as forward passes of this many images (`0`: `BULK_MICRO_BATCH`)"),
    Var("MIGRATION_PASS_MS", float, 100.0, "models",
        "passes after a migration chunk's first grow while the last pass's time per image (decode and forward) "
        "keeps one under this (ms): a CPU model stays at `MIGRATION_MICRO_BATCH` (`0`: fixed passes; "
        "`workers/passes.py`)"),
    Var("MIGRATION_YIELD_MAX_S", float, 2.0, "models",
        "before each pass a migration waits at most this long (s) while interactive work is queued, running or "
        "unanswered (`0`: never; `docs/operations.md`, \"Start the migration\")"),
    Var("CUTOFF_PERCENTILE", float, 99.0, "models",
        "each space's calibrated `min_score`: this percentile of unrelated pairs' scores"),
    Var("CUTOFF_MIN_POINTS", int, 100, "models", "points a collection needs before it gets a cutoff"),
    # --- workers -----------------------------------------------------------------------------------
    _pipeline("CLIP_DEVICE", "device", str, "workers", "`cpu` or `cuda`"),
    _pipeline("PREPROCESS", "preprocess", str, "workers",
              "`cpu`, `gpu` (resize on the CPU, normalise on the device) or `gpu_decode` (JPEGs also decoded by "
              "nvJPEG); the last two need `CLIP_DEVICE=cuda`"),
    _pipeline("DECODE_THREADS", "decode_threads", int, "workers",
              "decode pool per process: `cores // BULK_PROCESSES` on the CPU (never oversubscribes; an explicit "
              "value wins, with a warning if it does)", shown="automatic"),
    _pipeline("TORCH_THREADS", "torch_threads", int, "workers",
              "torch intra-op threads per process: as `DECODE_THREADS` on the CPU, 1 on CUDA", shown="automatic"),
    Var("WORKER_NICE", int, 0, "workers", "CPU niceness a worker gives itself at start (`0`: unchanged)"),
    Var("WORKER_DRAIN_S", float, 45.0, "workers",
        "a stopping worker waits this long (s) for its tasks in flight, then hands them back to the queue: Celery's "
        "soft shutdown on SIGTERM, and the wait of `manage.py worker_drain` (a pod's `preStop`; `docs/deploy.md`)"),
    Var("WORKER_MAX_BATCH_FAILURES", int, 5, "workers",
        "batches (or canaries) in a row that fail in the model before a worker leaves the pool and exits for a "
        "restart (`0`: never)"),
    Var("CANARY_INTERVAL_S", float, 30.0, "workers",
        "`/readyz` sends each lane a canary (a tiny image and a text to embed) at most this often (s)"),
    Var("CANARY_TIMEOUT_S", float, 10.0, "workers",
        "a canary embedded slower than this (s) counts as failed"),
    Var("CANARY_MAX_AGE_S", float, 120.0, "workers",
        "`/readyz` counts a lane as working while one of its workers answered a canary within this many seconds"),
    Var("READY_LANES", list, ["interactive", "bulk", "vectors", "fetch"], "workers",
        "lanes `/readyz` requires a working worker for; a lane left out (bulk scaling to zero) fails only when it "
        "has workers and none of them works"),
    # --- lanes -------------------------------------------------------------------------------------
    _pipeline("INTERACTIVE_MAX_BATCH_SIZE", "interactive_max_batch_size", int, "lanes",
              "largest interactive forward pass (dynamic batcher)"),
    _pipeline("INTERACTIVE_MAX_QUEUE_DELAY_MS", "interactive_max_queue_delay_ms", float, "lanes",
              "longest a lone interactive request waits for company (ms)"),
    Var("INTERACTIVE_BATCH_WAIT", str, "announced", "lanes",
        "how an interactive batch waits for company: `announced`: only while requests the worker's task threads "
        "are decoding are still to arrive (a lone request on an idle lane goes to the model at once), never past "
        "`INTERACTIVE_MAX_QUEUE_DELAY_MS`; `window`: always the whole window (`workers/batcher.py`)"),
    Var("INTERACTIVE_THREADS", int, lambda get: 2 * get("INTERACTIVE_MAX_BATCH_SIZE"), "lanes",
        "task threads of the interactive worker: while one batch is in the model the next one's tasks are fetched "
        "and decoded, so under load every pass is a full batch", shown="`2 × INTERACTIVE_MAX_BATCH_SIZE`"),
    Var("INTERACTIVE_DEADLINE_S", float, 2.0, "lanes",
        "default (and longest) interactive deadline (s); a request still waiting then gets a 202 with a status URL"),
    Var("HOP_TRACE", bool, False, "lanes",
        "record where each interactive request's time goes (web, broker hops, each worker's stages) in Redis "
        "(`lanes:interactive:hops`, capped) for `benchmarks.lanes`; off in production: a few Redis writes per request"),
    Var("EMBEDDINGS_MAX_INPUTS", int, 256, "lanes",
        "inputs (texts and images) of one `POST /api/embeddings/` or `POST /v1/embeddings` request; more is a 400 "
        "`too_many_inputs` (`docs/embeddings-api.md`)"),
    Var("BATCH_MAX_FILE_BYTES", int, 200 * _MiB, "limits",
        "bytes of one `POST /v1/files` file (OpenAI's Batch API input; `docs/batch-api.md`); more is a 413 "
        "`file_too_large`"),
    Var("BATCH_MAX_LINES", int, 50_000, "limits",
        "requests (non-blank lines) of one batch input file; more is a 400 `too_many_lines`"),
    Var("BATCH_WINDOW_MIN_S", float, 3600.0, "limits",
        "shortest `completion_window` of `POST /v1/batches` (s; OpenAI accepts only `24h`)"),
    Var("BATCH_WINDOW_MAX_S", float, 7 * 86400.0, "limits", "longest `completion_window` of `POST /v1/batches` (s)"),
    Var("ADMISSION_CONTROL", bool, True, "lanes",
        "refuse interactive work with 429 + `Retry-After` when its predicted wait exceeds its deadline"),
    Var("ADMISSION_MARGIN_QUANTILE", float, wait_model.MARGIN_QUANTILE, "lanes",
        "admission's margin: the quantile of its own recent errors added to a prediction (`docs/lanes.md`, "
        "\"Admission control\")"),
    Var("ADMISSION_MIN_MARGIN_SHARE", float, wait_model.MIN_MARGIN_SHARE, "lanes",
        "the least margin, as a share of the predicted wait (`0`: the learnt margin alone)"),
    Var("ADMISSION_MAX_MARGIN_SHARE", float, wait_model.MAX_MARGIN_SHARE, "lanes",
        "the most margin, as a share of the deadline (`1`: no cap)"),
    # --- bulk --------------------------------------------------------------------------------------
    _pipeline("BULK_BATCH_SIZE", "batch_size", int, "bulk", "images per chunk and per bulk forward pass"),
    _pipeline("BULK_PROCESSES", "bulk_processes", int, "bulk",
              "prefork children of the bulk worker: one decodes while the other runs the model"),
    _pipeline("BULK_MICRO_BATCH", "micro_batch", int, "bulk",
              "run each chunk as forward passes of this many images, the next one decoded during the current one "
              "(in-task overlap; the alternative to a second process)", shown="unset"),
    Var("BULK_WORKER_NICE", int, 19, "bulk",
        "niceness of a bulk-only worker when `WORKER_NICE` is `0`: every other process runs first (`0`: off)"),
    Var("BULK_WORKER_SCHED_IDLE", bool, False, "bulk",
        "a bulk-only worker also runs under Linux's `SCHED_IDLE` (for hosts whose interactive worker runs 4+ "
        "torch threads)"),
    Var("BULK_BATCH_MEMORY_MB", int, 1024, "bulk",
        "a worker that consumes the bulk queue keeps freed blocks up to this size (MiB) for the next chunk instead "
        "of mapping each chunk's model input afresh (glibc's malloc thresholds; `0`: glibc's defaults)"),
    Var("CELERY_BULK_TIME_LIMIT_S", int, lambda get: get("CELERY_VISIBILITY_TIMEOUT_S") // 3, "bulk",
        "hard time limit of a bulk chunk (s)", shown="`CELERY_VISIBILITY_TIMEOUT_S // 3`"),
    Var("BULK_MAX_ATTEMPTS", int, 8, "bulk",
        "attempts at a bulk image before it fails with `attempts_exhausted` (a poison image never loops forever)"),
    Var("BULK_YIELD_MAX_S", float, 60.0, "bulk",
        "while admission refuses interactive requests, a background job's chunk waits before each pass at most "
        "this long (s) (`0`: never; urgent jobs and jobs whose `deadline` is at risk never wait; `docs/lanes.md`, "
        "\"Bulk waits while the interactive lane is at capacity\")"),
    Var("BULK_YIELD_REFUSED_S", float, 10.0, "bulk",
        "... when a request was refused within this many seconds and interactive work is queued, running or "
        "unanswered (`0`: whenever the lane has work)"),
    Var("BULK_YIELD_MICRO_BATCH", int, 8, "bulk", "... and runs as passes of this many images"),
    Var("BULK_SCHEDULER", str, "fair", "bulk",
        "`fair`: a job's chunks wait in the database and enter the broker just in time, in the order of "
        "`queueing.bulk_order` (urgent first, deadlines kept, fair shares across owners: docs/lanes.md, \"The bulk "
        "lane's order\"); `fifo`: every chunk is sent when made, first come first served"),
    Var("BULK_SCHEDULER_WINDOW", int, lambda get: 2 * get("BULK_PROCESSES"), "bulk",
        "`fair`: bulk chunks sent and not finished at once, the whole deployment's (one computing and one on deck per "
        "bulk worker process: raise it with the bulk workers)", shown="`2 × BULK_PROCESSES`"),
    Var("BULK_OWNER_WEIGHTS", list, [], "bulk",
        "`fair`: owners' weights in the lane's fair shares, `username=weight`, comma-separated (others: `1`)"),
    Var("BULK_LIFECYCLE_WEIGHT", float, 1.0, "bulk",
        "`fair`: the weight of the model lifecycle's re-embeds (migrations), one owner of their own"),
    Var("BULK_METRICS_OWNERS", int, 10, "bulk",
        "owners named in the bulk lane's per-owner metrics (the first this many a process counts; the rest are "
        "`other`)"),
    # --- store -------------------------------------------------------------------------------------
    Var("QDRANT_URL", str, "", "store", "Qdrant server URL", shown="unset"),
    Var("VECTOR_STORE", str, lambda get: "server" if get("QDRANT_URL") else "edge", "store",
        "`edge`: Qdrant's own engine in the vectors worker (segments, HNSW, payload indexes, WAL); `local`: "
        "qdrant-client's local mode (a pure Python scan, for old installations: `manage.py store_migrate`); `server`: "
        "the server at `QDRANT_URL`; the same ids, payloads and collection names in all three (`docs/operations.md`)",
        shown="`edge` (`server` when `QDRANT_URL` is set)"),
    Var("QDRANT_PATH", str,
        lambda get: str(get("VAR_DIR") / ("qdrant" if get("VECTOR_STORE") == "local" else "qdrant-edge")), "store",
        "embedded store folder: one shard folder per collection (edge)",
        shown="`$VAR_DIR/qdrant-edge` (`$VAR_DIR/qdrant` for `local`)"),
    Var("VECTOR_STORE_FSYNC", bool, False, "store",
        "edge: `0` acknowledges a write once it is in the write-ahead log (survives a killed worker); `1` also "
        "flushes to disk first (survives a power loss, costs milliseconds per write)"),
    Var("VECTOR_STORE_OPTIMIZE_IDLE_S", float, 30.0, "store",
        "edge: build HNSW / merge segments in the vectors worker after this long without a store call (`0`: never)"),
    Var("VECTOR_STORE_OPTIMIZE_MIN_POINTS", int, 5_000, "store", "... and with at least this many new points"),
    Var("VECTORS_WRITE_SLICE", int, lambda get: 64 if get("VECTOR_STORE") == "server" else 32, "store",
        "points a bulk chunk writes between two looks at the vectors queue, where interactive work goes first",
        shown="`32` (`64` with `server`)"),
    Var("STORE_OWNER", str, "vectors", "store",
        "which worker owns an embedded store (`edge`, `local`): `vectors`: the vectors worker, and an interactive "
        "request crosses three processes (web, interactive worker, vectors worker); `interactive`: the interactive "
        "worker, which then also consumes the vectors queue, and embeds, writes and searches an upload or a query "
        "in one task (no vectors worker; one interactive worker per deployment; `docs/lanes.md`). Not with `server`"),
    Var("VECTORS_CALL_TIMEOUT_S", float, 10.0, "store",
        "timeout of web → vectors-worker round trips that are not interactive embeds (s)"),
    # --- storage -----------------------------------------------------------------------------------
    Var("STORAGE_URL", str, "", "storage",
        "where image bytes and thumbnails live: `file:///folder`, or `s3://bucket[/prefix]` (S3-compatible, needed "
        "once embedding workers run on another host than the web; `docs/operations.md`, \"Image bytes\")",
        shown="unset: files under `$VAR_DIR/blobs`"),
    _pipeline("PREVIEW_SIDE", "preview_side", int, "storage",
              "short side (px) of the JPEG preview a worker keeps of each image it decodes, beside its thumbnail; "
              "re-embeds (model migrations, dual embedding) read it instead of the original when the model's input "
              "fits in it (`docs/previews.md`); 0: no previews"),
    Var("S3_ENDPOINT_URL", str, "", "storage", "a non-AWS S3 endpoint: MinIO, Ceph, R2, moto (`http://host:port`)",
        shown="unset (AWS)"),
    Var("AWS_ACCESS_KEY_ID", str, "", "storage", "S3 access key", shown="unset: boto3's own chain"),
    Var("AWS_SECRET_ACCESS_KEY", str, "", "storage", "S3 secret key", shown="unset: boto3's own chain"),
    Var("AWS_S3_REGION_NAME", str, "", "storage", "S3 region", shown="unset: boto3's own chain"),
    Var("AWS_S3_ADDRESSING_STYLE", str, "", "storage", "`path` for servers without per-bucket host names",
        shown="unset: boto3's choice"),
    # --- catalogues (issue 41) ---------------------------------------------------------------------
    Var("SOURCE_BUCKETS", list, [], "catalogue",
        "object-storage buckets (`bucket` or `bucket/prefix`) that manifests and prefix jobs may read, "
        "comma-separated; empty: none (reached with the `AWS_*` credentials and `S3_ENDPOINT_URL`)"),
    Var("SOURCE_COPY", bool, False, "catalogue",
        "copy objects of a prefix or `key` manifest into the blob store (off: read where they are, "
        "their sha256 checked on every read)"),
    Var("FETCH_CONNECT_TIMEOUT_S", float, 5.0, "catalogue", "seconds to connect to an image URL's host"),
    Var("FETCH_READ_TIMEOUT_S", float, 20.0, "catalogue", "seconds one read of an image URL's body may wait"),
    Var("FETCH_TOTAL_TIMEOUT_S", float, 60.0, "catalogue",
        "seconds one URL may take, redirects and retries included"),
    Var("FETCH_MAX_REDIRECTS", int, 5, "catalogue", "redirects followed per URL (each hop's address checked)"),
    Var("FETCH_RETRIES", int, 3, "catalogue",
        "retries of a URL on 429, 5xx, timeouts and connection errors (backoff, `Retry-After` honoured)"),
    Var("FETCH_PER_HOST", int, 8, "catalogue", "concurrent requests to one host per fetch worker process"),
    Var("FETCH_THREADS", int, 16, "catalogue", "URLs of one chunk fetched at once"),
    Var("FETCH_WORKER_THREADS", int, 4, "catalogue", "chunks the fetch worker handles at once (its threads)"),
    Var("FETCH_ALLOW_NETWORKS", list, [], "catalogue",
        "networks (CIDR) that image URLs may resolve to although private, loopback or link-local, "
        "comma-separated; empty: only public addresses (server-side request forgery refused)"),
    Var("MANIFEST_MAX_ROWS", int, 10_000_000, "catalogue", "data rows of one manifest"),
    Var("FETCH_READ_AHEAD", int, 1024, "catalogue",
        "rows a catalogue job reads and fetches ahead of the model: its reading waits while it has this "
        "many images queued (0: no bound)"),
    Var("METADATA_MAX_BYTES", int, 4096, "catalogue", "an image's metadata as compact JSON (UTF-8 bytes)"),
    Var("METADATA_INDEXES", str, "", "catalogue",
        "metadata fields searches filter on often, with their types, e.g. `category:keyword,price:float,"
        "date:datetime`: each gets a payload index in every collection"),
    # --- webhooks (issue 42) ------------------------------------------------------------------------
    Var("WEBHOOK_TIMEOUT_S", float, 10.0, "webhooks",
        "seconds one delivery attempt may take (connect, send, answer); past it the attempt failed"),
    Var("WEBHOOK_RETRY_SCHEDULE_S", list, ["0", "5", "300", "1800", "7200", "18000", "36000", "36000"], "webhooks",
        "seconds before each attempt of a delivery, counted from the previous one, comma-separated: one "
        "attempt per entry, then the delivery is `failed` (default about 27.6 h, Standard Webhooks' schedule)",
        shown="`0,5,300,1800,7200,18000,36000,36000`"),
    Var("WEBHOOK_MAX_ENDPOINTS", int, 20, "webhooks", "webhook endpoints one account may have (a job's own too)"),
    # --- limits ------------------------------------------------------------------------------------
    _pipeline("MAX_IMAGE_BYTES", "max_image_bytes", int, "limits", "largest accepted image file (bytes)",
              shown="`52428800` (50 MiB)"),
    _pipeline("MAX_IMAGE_PIXELS", "max_image_pixels", int, "limits",
              "largest accepted width × height, read from the header before decoding"),
    _pipeline("DECODE_TIMEOUT_S", "decode_timeout_s", float, "limits", "per-image decode time limit (s)"),
    Var("INTERACTIVE_MAX_FILES", int, 16, "limits",
        "files per interactive request (bigger sets go to `POST /api/jobs/`)"),
    Var("UPLOAD_MAX_FILES", int, 1000, "limits", "files per upload request"),
    Var("UPLOAD_MAX_FORM_BYTES", int, 10 * _MiB, "limits", "bytes of a request's non-file form fields",
        shown="`10485760` (10 MiB)"),
    Var("UPLOAD_MAX_REQUEST_BYTES", int, 2 * _GiB, "limits",
        "bytes of a whole request (checked from `Content-Length` before reading the body)",
        shown="`2147483648` (2 GiB)"),
    Var("ZIP_MAX_ENTRIES", int, 100_000, "limits", "entries of an uploaded zip (zip-bomb bound)"),
    # the web request inflates, hashes and stores a zip at ~60-100 MB/s on 2 cores (docs/catalogues.md):
    # 4 GiB stays inside gunicorn's --timeout 120 (docker-compose.yml)
    Var("ZIP_MAX_UNCOMPRESSED_BYTES", int, 4 * _GiB, "limits",
        "uncompressed bytes of an uploaded zip (entries over `MAX_IMAGE_BYTES`, refused without inflating, do "
        "not count)", shown="`4294967296` (4 GiB)"),
    # photos stored uncompressed (BMP) deflate 1.5× (the shared photos, measured), JPEG/PNG/WebP about 1×;
    # 20× leaves room for flat graphics and bounds a bomb to 20 times what was sent
    Var("ZIP_MAX_RATIO", float, 20.0, "limits",
        "uncompressed bytes of an uploaded zip per byte of the archive (entries over `MAX_IMAGE_BYTES` do not "
        "count; an archive may always expand to `MAX_IMAGE_BYTES`)"),
    Var("INGEST_ROOTS", list, [], "limits",
        "server folders staff may ingest from, comma-separated (path traversal and symlinks out are refused)"),
    # per-key limits (docs/api-keys.md): the defaults of keys whose limit staff left empty; a session or a
    # DRF token not yet migrated to a key is not limited by key
    Var("API_KEY_REQUESTS_PER_MINUTE", int, 3000, "limits",
        "API requests one API key may make per minute (a window from its first request); more: 429 `rate_limited`"),
    Var("API_KEY_IMAGES_PER_MINUTE", int, 1200, "limits",
        "interactive images (uploads to `POST /api/images/`, image inputs of the embeddings endpoints) one key may "
        "send per minute"),
    Var("API_KEY_BULK_IMAGES_PER_DAY", int, 1_000_000, "limits",
        "bulk images one key may submit per day (jobs; a job is refused at submission, never cut)"),
    Var("API_KEY_CONCURRENT_BULK_JOBS", int, 10, "limits",
        "bulk jobs of one key that may be unfinished at once (more: refused at submission)"),
)

BY_NAME: dict[str, Var] = {v.name: v for v in VARS}
#: The variables whose values are credentials: a deployment keeps them in a secret store, never in
#: plain configuration (``deploy/kubernetes``: the ``clip-secrets`` Secret, the rest a ConfigMap).
SECRET_NAMES = ("DJANGO_SECRET_KEY", "DATABASE_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
#: The variables :func:`pipeline_config` reads.
PIPELINE_NAMES = tuple(v.name for v in VARS if v.rules == "pipeline")

def _parse(raw: str, var: Var) -> Any:
    """A set value as ``var.type``: by django-environ's own rules (``"environ"``: bools as
    ``1``/``yes``/``on``…, floats with a decimal comma, lists without empty items), the rules
    settings.py read by before this declaration; the pipeline's plain ``int()``/``float()``."""
    return django_environ.Env.parse_value(raw, var.type) if var.rules == "environ" else var.type(raw)


def _raw(environ: Mapping[str, str], var: Var) -> tuple[str, str | None]:
    """``(name read, text)``: the text is ``None`` when the variable counts as unset under its rules;
    the name is the variable's own, or the last one a ``$OTHER`` value led to."""
    name, raw = var.name, environ.get(var.name)
    if var.rules == "pipeline":
        return name, raw or None
    seen = {name}
    while raw is not None and raw.startswith("$"):  # django-environ: "$OTHER" stands for OTHER's value
        name = raw.lstrip("$")
        if name in seen:
            raise ConfigurationError(f"{var.name}: {raw!r} refers back to itself")
        seen.add(name)
        raw = environ.get(name)
    return name, raw


def read(environ: Mapping[str, str] | None = None, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Typed values of ``names`` (default: every declared variable) from ``environ`` (default ``os.environ``).

    Returns:
        ``{name: value}``: a value of the variable's type, or its default when unset (``None`` for
        an unset optional number).

    Raises:
        ConfigurationError: a required variable is unset, or a value does not parse.
        KeyError: a name that is not declared.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in values:
            var = BY_NAME[name]
            read_from, raw = _raw(environ, var)
            if raw is not None:
                try:
                    values[name] = _parse(raw, var)
                except ValueError as e:
                    raise ConfigurationError(f"{name}={raw!r}: {e}") from e
            elif var.default is REQUIRED:
                raise ConfigurationError(f"Set the {read_from} environment variable")
            else:
                default = var.default(get) if callable(var.default) else var.default
                values[name] = list(default) if isinstance(default, list) else default  # never the declaration's own
        return values[name]

    wanted = [v.name for v in VARS] if names is None else list(names)
    return {name: get(name) for name in wanted}


def pipeline_config(environ: Mapping[str, str] | None = None, *, hardware: Hardware | None = None) -> PipelineConfig:
    """The pipeline's configuration from ``CLIP_*`` and the other pipeline variables (:data:`PIPELINE_NAMES`).

    ``CLIP_PRECISION`` (default ``"auto"``) is resolved by :func:`~workers.config.resolve_precision`
    against ``hardware`` (default: this machine). ``MODEL_BACKEND`` (default ``"auto"``) is resolved
    by the worker that loads the model (``workers.backends.resolve_backend``); exported towers are
    cached under ``$VAR_DIR/model-cache``.

    Raises:
        ConfigurationError: a variable does not parse; ``ValueError``: a value is out of range.
    """
    v = read(environ, (*PIPELINE_NAMES, "VAR_DIR"))
    return PipelineConfig(
        model_name=v["CLIP_MODEL"], pretrained=v["CLIP_PRETRAINED"], seed=v["CLIP_SEED"], device=v["CLIP_DEVICE"],
        precision=resolve_precision(v["CLIP_PRECISION"], v["CLIP_DEVICE"], hardware=hardware),
        batch_size=v["BULK_BATCH_SIZE"], preprocess=v["PREPROCESS"], bulk_processes=v["BULK_PROCESSES"],
        micro_batch=v["BULK_MICRO_BATCH"], interactive_max_batch_size=v["INTERACTIVE_MAX_BATCH_SIZE"],
        interactive_max_queue_delay_ms=v["INTERACTIVE_MAX_QUEUE_DELAY_MS"], decode_threads=v["DECODE_THREADS"],
        torch_threads=v["TORCH_THREADS"], max_image_bytes=v["MAX_IMAGE_BYTES"],
        max_image_pixels=v["MAX_IMAGE_PIXELS"], decode_timeout_s=v["DECODE_TIMEOUT_S"],
        preview_side=v["PREVIEW_SIDE"], backend=v["MODEL_BACKEND"],
        backend_cache_dir=str(Path(v["VAR_DIR"]) / "model-cache"),
    )


# --- the README's tables ---------------------------------------------------------------------------

_TYPE_NAMES = {str: "text", bool: "bool", int: "int", float: "float", list: "list", Path: "path"}


def _shown(var: Var) -> str:
    if var.shown is not None:
        return var.shown
    d = var.default
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return f"`{int(d)}`"
    if isinstance(d, list):
        return f"`{','.join(d)}`" if d else "empty"
    return f"`{d}`" if d != "" else "empty"


def markdown() -> str:
    """The README's configuration tables: one per group of :data:`GROUPS`, a row per variable."""
    lines = [BEGIN]
    for key, heading in GROUPS:
        lines += ["", f"**{heading}**", "", "| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
        lines += [f"| `{v.name}` | {_TYPE_NAMES[v.type]} | {_shown(v)} | {v.meaning} |" for v in VARS if v.group == key]
    return "\n".join([*lines, "", END])


def rewrite(text: str) -> str:
    """``text`` (README.md) with the part between :data:`BEGIN` and :data:`END` replaced by :func:`markdown`.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md needs the lines {BEGIN!r} and {END!r}, in that order")
    return text[:start] + markdown() + text[end + len(END):]


def main(argv: list[str] | None = None) -> None:
    """``python -m project.configuration --markdown`` prints the tables; ``--write [README.md]`` rewrites them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = ap.add_mutually_exclusive_group(required=True)
    action.add_argument("--markdown", action="store_true", help="print the README's configuration tables")
    action.add_argument("--write", nargs="?", const=str(README), metavar="README",
                        help="rewrite the tables between the markers in README (default: the checkout's README.md)")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown() + "\n")
        return
    path = Path(args.write)
    path.write_text(rewrite(path.read_text()))


if __name__ == "__main__":
    main()
