"""Prometheus metrics (prometheus-client): stage timings per lane, images per status, batch sizes,
CPU/GPU utilisation; served by the web process at ``/metrics``.

**One scrape endpoint for every process.** Workers are prefork children (replaced when killed),
thread pools and gunicorn workers; a port per process would need discovery. So every process
writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess
mode; ``project/settings.py`` points it at ``$VAR_DIR/prometheus`` before anything imports the
client) and the web's ``/metrics`` aggregates them with ``MultiProcessCollector``. Without the
variable (a single process) the default registry is served. The folder should be emptied when
the whole service starts afresh (whoever starts the processes: ``scripts/stack.py``, the compose
entrypoint). Each scrape settles the files of processes that died since
(``embeddings.metric_files``): their gauges leave it; their counters and histograms are folded
into one file per type and still added up, which keeps counters monotonic across worker restarts.

Metrics (``lane`` is ``bulk`` or ``interactive``):

- ``clip_stage_seconds{lane,stage}`` histogram: one observation per batch and stage (``load``,
  ``decode``, ``decode_wait`` and ``preprocess`` are summed over the batch's images, the others are
  wall times: see ``workers.timing``). Bulk ``upsert`` and ``total`` are observed once the points
  are written, so bulk ``total`` is end to end; interactive ``total`` ends with the forward pass.
- ``clip_batch_images{lane}`` histogram: images per batch.
- ``clip_images_processed_total{lane,status}`` counter: outcomes as workers record them
  (``embedded``, ``failed``, ``skipped``).
- ``clip_embeddings_refused_total{lane,reason}`` counter: vectors the model gave as NaN, infinity
  (``non_finite_embedding``) or all zeros (``zero_embedding``), refused before any store
  (``workers.screen``): uploads, bulk and migration chunks, queries, embeddings requests, the
  quality gate's copies and the calibration prompts. Queries count in the ``interactive`` lane.
- ``clip_preview_reads_total{source}`` counter: images of re-embeds (migration and dual embedding
  chunks) by what was read (``docs/previews.md``): ``used`` (the preview), ``missing`` and
  ``unreadable`` (the original, a preview was expected: fallbacks), ``too_small`` (the original,
  the model's input exceeds the preview: by design).
- ``clip_usage_units_total{kind,lane,model}``, ``clip_usage_compute_seconds_total{kind,lane,model}`` and
  ``clip_usage_fetched_bytes_total{kind,lane,model}`` counters: usage as it is committed
  (docs/usage.md), never labelled by key or owner (those are ``GET /api/usage/``'s).
- ``clip_images{status}`` gauge: images per status in the database, read at scrape time.
- ``clip_bulk_backlog_images{priority}`` gauge: images of queued or running bulk jobs not embedded
  yet, per job priority, read at scrape time (web ``/metrics`` only): what the bulk lane's
  autoscaler sizes it on (deploy/kubernetes/components/keda).
- ``clip_cpu_percent``, ``clip_gpu_utilisation_percent``, ``clip_gpu_memory_bytes`` gauges: the
  latest utilisation sample of the embedding workers (``workers.utilisation``).
- ``clip_queue_messages{lane,priority}`` and ``clip_queue_oldest_age_seconds{lane,priority}``
  gauges: messages waiting in each queue per priority step (kombu's Redis lists) and how long the
  oldest has waited, read from Redis at scrape time (web ``/metrics`` only): what an autoscaler
  scales embedding workers on. ``clip_broker_up`` is 0 when Redis could not be read.

**Past one host** (issue 11): a multiprocess folder is per host, so the web's ``/metrics`` only adds
up the processes of its own host. A worker started with ``METRICS_PORT`` serves its host's folder
on that port (:func:`serve_worker_metrics`; the first worker process of the host to bind the port
serves it, the others find it taken and leave it), so each GPU host is one more scrape target.
Cluster-wide gauges (``clip_images``, the queue gauges) stay on the web's endpoint, so nothing is
counted twice when the web and a worker share a host and a folder, don't scrape both there.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time

from celery.signals import before_task_publish, worker_ready
from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.http import HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from embeddings import lane_control
from embeddings.metric_files import LiveProcessCollector
from embeddings.models import BatchStat, Image, ImageStatus, Job, JobPriority, JobStatus, Lane
from embeddings.selectors import stage_summary
from project import lanes
from workers import screen
from workers.utilisation import Sample, merge_rows, process_sampler, summarise

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

STAGE_SECONDS = Histogram("clip_stage_seconds", "Per-batch stage time (s)", ["lane", "stage"],
                          buckets=_SECONDS_BUCKETS)
BATCH_IMAGES = Histogram("clip_batch_images", "Images per batch", ["lane"],
                         buckets=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256))
IMAGES_PROCESSED = Counter("clip_images_processed", "Images by outcome, as workers record them", ["lane", "status"])
EMBEDDINGS_REFUSED = Counter("clip_embeddings_refused", "Vectors the model gave that were refused before any store "
                             "(NaN, infinity, all zeros), by lane and reason", ["lane", "reason"])
PREVIEW_READS = Counter("clip_preview_reads", "Images of re-embeds by what was read: their preview (used) or "
                        "their original (missing, unreadable, too_small)", ["source"])
# livemostrecent: the latest sample of a process still alive; a dead sampler's value leaves the
# scrape (embeddings.metric_files), where "mostrecent" served it frozen until the folder was emptied
CPU_PERCENT = Gauge("clip_cpu_percent", "Machine CPU use, latest 1 s sample (0-100, all cores)",
                    multiprocess_mode="livemostrecent")
GPU_PERCENT = Gauge("clip_gpu_utilisation_percent", "NVML GPU utilisation, latest 1 s sample (0-100)",
                    multiprocess_mode="livemostrecent")
GPU_MEMORY = Gauge("clip_gpu_memory_bytes", "GPU memory in use, latest sample", multiprocess_mode="livemostrecent")

_PRE_UPSERT_STAGES = ("load", "decode", "decode_wait", "preprocess", "embed")


def observe_stages(*, lane: str, stages_ms: dict[str, float | None]) -> None:
    """One observation per stage given in ``stages_ms`` (milliseconds; ``None`` skipped)."""
    for stage, ms in stages_ms.items():
        if ms is not None:
            STAGE_SECONDS.labels(lane=lane, stage=stage).observe(ms / 1000)


#: Bulk images whose chunk finished, by the job's class and owner: ``rate()`` of it is images/s per
#: class and per owner. Owners are named for the first ``BULK_METRICS_OWNERS`` a process counts (the
#: model lifecycle's re-embeds are the owner ``lifecycle``), the rest are ``other``: the label set is bounded.
BULK_OWNER_IMAGES = Counter("clip_bulk_owner_images", "Bulk images whose chunk finished, by class (urgent, "
                            "background) and owner (the first BULK_METRICS_OWNERS a process counts, then other)",
                            ["priority", "owner"])
#: Chunks the fair scheduler sent, by the rule that chose them (``queueing.bulk_order``: urgent, fair, deadline).
BULK_PICKS = Counter("clip_bulk_picks", "Bulk chunks the fair scheduler sent, by the rule that chose them", ["rule"])
#: The owners this process names in :data:`BULK_OWNER_IMAGES` (at most ``BULK_METRICS_OWNERS``).
_named_owners: set[str] = set()


def bulk_owner_label(owner: str) -> str:
    """``owner`` if this process names it (one of the first ``BULK_METRICS_OWNERS`` it counted), else ``other``."""
    if owner in _named_owners:
        return owner
    if len(_named_owners) < settings.BULK_METRICS_OWNERS:
        _named_owners.add(owner)
        return owner
    return "other"


def count_bulk_chunk(*, priority: str, owner: str, n: int) -> None:
    """Add a finished bulk chunk's ``n`` images to ``clip_bulk_owner_images_total{priority, owner}``."""
    if n:
        BULK_OWNER_IMAGES.labels(priority=priority, owner=bulk_owner_label(owner)).inc(n)


def count_bulk_pick(rule: str) -> None:
    """Count one chunk the fair scheduler sent under ``rule``."""
    BULK_PICKS.labels(rule=rule).inc()


def count_images(*, lane: str, status: str, n: int) -> None:
    """Add ``n`` images with outcome ``status`` on ``lane``."""
    if n:
        IMAGES_PROCESSED.labels(lane=lane, status=status).inc(n)


def count_preview_reads(tally) -> None:
    """Add a batch's ``workers.preview.PreviewTally`` to ``clip_preview_reads_total{source}``."""
    for source, n in tally.as_dict().items():
        if n:
            PREVIEW_READS.labels(source=source).inc(n)


def count_refused_embeddings(*, lane: str, reasons) -> None:
    """Count each reason in ``reasons`` (reason codes of any refusal: those of ``workers.screen``,
    ``non_finite_embedding`` and ``zero_embedding``, are counted, the others ignored) on ``lane``."""
    for reason in screen.REASONS:
        n = sum(1 for r in reasons if r == reason)
        if n:
            EMBEDDINGS_REFUSED.labels(lane=lane, reason=reason.value).inc(n)


#: Usage as it is committed (``services.usage.meter``), by kind (``models.UsageKind``), the lane it
#: ran on and the embedding space: never by key or owner, so the label set stays bounded (kinds ×
#: lanes × spaces); per key and owner, usage is ``GET /api/usage/``.
USAGE_UNITS = Counter("clip_usage_units", "Metered units committed (images, texts, searches, fetches, duplicates), "
                      "by kind, lane and model", ["kind", "lane", "model"])
USAGE_COMPUTE = Counter("clip_usage_compute_seconds", "Worker compute seconds of the metered units, by kind, lane "
                        "and model", ["kind", "lane", "model"])
USAGE_BYTES = Counter("clip_usage_fetched_bytes", "Bytes fetched for metered work, by kind, lane and model",
                      ["kind", "lane", "model"])


def count_usage(*, kind: str, lane: str, model: str, units: int, compute_s: float, nbytes: int) -> None:
    """Add committed usage to ``clip_usage_units_total``, ``clip_usage_compute_seconds_total`` and
    ``clip_usage_fetched_bytes_total`` (``compute_s`` in s, ``nbytes`` in bytes)."""
    labels = {"kind": kind, "lane": lane, "model": model}
    if units:
        USAGE_UNITS.labels(**labels).inc(units)
    if compute_s:
        USAGE_COMPUTE.labels(**labels).inc(compute_s)
    if nbytes:
        USAGE_BYTES.labels(**labels).inc(nbytes)


def observe_utilisation(sample) -> None:
    """Set the utilisation gauges from a ``workers.utilisation.Sample``."""
    CPU_PERCENT.set(sample.cpu_percent)
    if sample.gpu_percent is not None:
        GPU_PERCENT.set(sample.gpu_percent)
    if sample.gpu_memory_mib is not None:
        GPU_MEMORY.set(sample.gpu_memory_mib * 2**20)


@receiver(post_save, sender=BatchStat, dispatch_uid="embeddings.metrics.batch_stat_saved")
def _batch_stat_saved(sender, instance: BatchStat, created: bool, **kwargs) -> None:
    """Every batch of either lane is recorded as a ``BatchStat``: observe it once, when created."""
    if not created:
        return
    stages = {s: getattr(instance, f"{s}_ms") for s in _PRE_UPSERT_STAGES}
    if instance.lane != "bulk":  # bulk total is observed end to end by chunk_index
        stages["total"] = instance.total_ms
    observe_stages(lane=instance.lane, stages_ms=stages)
    BATCH_IMAGES.labels(lane=instance.lane).observe(instance.images)


class _ImagesByStatus:
    """Collector: images per status, counted in the database at scrape time (web process)."""

    def collect(self):


        family = GaugeMetricFamily("clip_images", "Images per status in the database", labels=["status"])
        counts = {s.value: 0 for s in ImageStatus}
        for row in Image.objects.values("status").annotate(n=Count("id")):
            counts[row["status"]] = row["n"]
        for status, n in counts.items():
            family.add_metric([status], n)
        yield family


class BulkBacklog:
    """Collector: ``clip_bulk_backlog_images{priority}``, the images of bulk jobs that are queued or
    running (not paused, not finished) and not embedded yet, per job priority (``urgent``,
    ``background``), counted in the database at scrape time (web process). What an autoscaler sizes
    the bulk lane on: a chunk message holds 64 images (a migration's 512), so messages are not
    images. A paused job's images leave it, so a paused job never keeps workers up.
    """

    def collect(self):
        family = GaugeMetricFamily("clip_bulk_backlog_images",
                                   "Images of queued or running bulk jobs not embedded yet, per job priority",
                                   labels=["priority"])
        counts = dict.fromkeys(JobPriority.values, 0)
        rows = (Image.objects.filter(status=ImageStatus.QUEUED, job__status__in=(JobStatus.QUEUED, JobStatus.RUNNING))
                .values("job__priority").annotate(n=Count("id")))
        for row in rows:
            counts[row["job__priority"]] = row["n"]
        for priority, n in counts.items():
            family.add_metric([priority], n)
        yield family


#: Message header (Unix time, s) set on every task message as it is published: the queue gauges read
#: the oldest waiting message's age from it (Celery's own headers carry no send time).
PUBLISHED_AT = "published_at"


@before_task_publish.connect(dispatch_uid="embeddings.metrics.stamp_published_at")
def _stamp_published_at(sender=None, headers=None, **kwargs) -> None:
    """Stamp the publish time on each message (a retry is a new publish: its wait starts again)."""
    if headers is not None:
        headers[PUBLISHED_AT] = time.time()


class QueueGauges:
    """Collector: per queue (``lane``) and priority step, the messages waiting and the age (s) of
    the oldest, read from the broker's Redis at scrape time in one pipelined round trip (``LLEN`` and
    ``LINDEX -1`` per list: kombu ``LPUSH``es and workers ``BRPOP``, so the tail is the oldest).

    Args:
        client: a ``redis.Redis`` on the broker; ``None``: ``lane_control.redis_client()``.
        queues: queue names (default every lane of ``project.lanes``).
        clock: ``time.time``-like, for the age.

    A message without the :data:`PUBLISHED_AT` header (sent by a process that never imported this
    module) counts in the depth; its age is reported as 0. When Redis cannot be read,
    ``clip_broker_up`` is 0 and no queue sample is given (a wrong 0 would tell an autoscaler to
    scale in).
    """

    def __init__(self, client=None, queues: tuple[str, ...] | None = None, clock=time.time):
        self._client, self._queues, self._clock = client, queues, clock

    def read(self) -> list[tuple[str, int, int, float]]:
        """``[(lane, priority step, messages, oldest age s), ...]``; raises the client's errors."""

        client = self._client or lane_control.redis_client()
        keys = []  # queue_keys lists one key per priority step, in the steps' order
        for queue in self._queues or lanes.ALL_QUEUES:
            for step, key in zip(_priority_steps(), lane_control.queue_keys(queue)):
                keys.append((queue, step, key))
        pipe = client.pipeline(transaction=False)
        for _, _, key in keys:
            pipe.llen(key)
            pipe.lindex(key, -1)
        replies = pipe.execute()
        now = self._clock()
        out = []
        for n, (queue, step, key) in enumerate(keys):
            depth, oldest = replies[2 * n], replies[2 * n + 1]
            out.append((queue, step, int(depth), _age(oldest, now)))
        return out

    def collect(self):
        up = GaugeMetricFamily("clip_broker_up", "1 when the queue gauges could read the broker's Redis")
        try:
            rows = self.read()
        except Exception as e:  # noqa: BLE001 - a scrape must answer; the gauge says Redis was unreadable
            logging.getLogger(__name__).warning("queue gauges: cannot read the broker: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        depth = GaugeMetricFamily("clip_queue_messages", "Messages waiting per queue and priority step",
                                  labels=["lane", "priority"])
        age = GaugeMetricFamily("clip_queue_oldest_age_seconds", "Age of the oldest waiting message (s; 0: none)",
                                labels=["lane", "priority"])
        for queue, step, n, oldest in rows:
            depth.add_metric([queue, str(step)], n)
            age.add_metric([queue, str(step)], oldest)
        yield up
        yield depth
        yield age


def _priority_steps() -> list[int]:

    return list(settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("priority_steps", [0, 3, 6, 9]))


def _age(raw: bytes | None, now: float) -> float:
    """Seconds since the message ``raw`` (kombu's JSON envelope) was published; 0 if unknown."""
    if not raw:
        return 0.0
    try:
        published = json.loads(raw)["headers"][PUBLISHED_AT]
    except (ValueError, KeyError, TypeError):
        return 0.0
    return max(0.0, now - float(published))


def _host_registry() -> CollectorRegistry:
    """This host's process metrics: every process's files (multiprocess mode) or this process's."""

    reg = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):

        LiveProcessCollector(reg)  # dead processes' files settled at each scrape
    else:
        for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - re-serve the default collectors
            reg.register(collector)
    return reg


def registry() -> CollectorRegistry:
    """What ``/metrics`` serves: this host's process metrics, plus the cluster-wide gauges (images
    per status and the bulk backlog from the database, queue depth and age from Redis)."""
    reg = _host_registry()
    reg.register(_ImagesByStatus())
    reg.register(BulkBacklog())
    reg.register(QueueGauges())
    return reg


def worker_endpoint(port: int, addr: str = "0.0.0.0"):
    """Serve this host's process metrics (no database or Redis reads) over HTTP on ``port``.

    Returns:
        ``(server, thread)`` from ``prometheus_client.start_http_server``, or ``None`` when the port
        is taken (another worker process of this host serves the same folder already).
    """

    try:
        return start_http_server(port, addr=addr, registry=_host_registry())
    except OSError as e:
        logging.getLogger(__name__).info("metrics port %s not bound (%s): another process of this host serves it",
                                         port, e)
        return None


@worker_ready.connect(dispatch_uid="embeddings.metrics.serve_worker_metrics")
def serve_worker_metrics(sender=None, **kwargs):
    """In a Celery worker's main process once it is ready: serve :func:`worker_endpoint` on
    ``settings.METRICS_PORT`` (0: not served). A thread in the parent, started after the pool's
    children fork (they write their files; it reads them). Returns what :func:`worker_endpoint`
    returns (``None`` when not served)."""

    port = getattr(settings, "METRICS_PORT", 0)
    if port:
        return worker_endpoint(port, addr=getattr(settings, "METRICS_BIND", "0.0.0.0"))
    return None


def metrics_view(request) -> HttpResponse:
    """``GET /metrics``: Prometheus text exposition (unauthenticated, like most exporters; keep it
    off the public network)."""
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)


# --- utilisation stored with jobs, per-lane summaries ---------------------------------------------

@functools.cache
def worker_sampler():
    """The process's running ``workers.utilisation.Sampler``, feeding the utilisation gauges
    (started on first use, in the process that runs chunks: never in a Celery parent)."""

    sampler = process_sampler()
    sampler.on_sample(observe_utilisation)
    return sampler


def job_record_utilisation(*, job_id, since: float, config) -> int:
    """Append this process's utilisation samples taken while a chunk of ``job_id`` ran (and the
    worker's pipeline settings, once) to the job. Several bulk processes sample the same machine:
    one row per second is kept, merged into longer buckets past ``workers.utilisation.MAX_JOB_ROWS``
    rows (``workers.utilisation.merge_rows``), so the JSON stays small however long the job runs.

    Args:
        job_id: the job.
        since: ``time.time()`` one sample interval before the chunk began.
        config: the worker's ``PipelineConfig``.

    Returns:
        The number of new samples.
    """


    sampler = worker_sampler()
    new = sampler.take_new(str(job_id), since)
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(id=job_id).only("utilisation", "pipeline").first()
        if job is None:
            return 0
        fields = {}
        if new:
            rows, interval_s = merge_rows(job.utilisation.get("rows", []), new,
                                          interval_s=job.utilisation.get("interval_s") or sampler.interval_s)
            fields["utilisation"] = {"interval_s": interval_s, "rows": rows}
        if not job.pipeline:
            fields["pipeline"] = pipeline_settings(config)
        if fields:
            Job.objects.filter(id=job_id).update(**fields)
    return len(new)


def pipeline_settings(config) -> dict:
    """What a job records about how it was run (``Job.pipeline``)."""
    threads = config.threads()
    return {
        "model_id": config.model_id, "device": config.device, "precision": config.precision,
        "preprocess": config.preprocess, "batch_size": config.batch_size,
        "bulk_processes": config.bulk_processes, "decode_threads": threads.decode,
        "torch_threads": threads.torch, "cores": threads.cores,
    }


def job_utilisation(job) -> dict:
    """``{"summary": {...}, "interval_s": s, "rows": [...]}`` for the job API (rows as stored: one a
    second, or buckets of ``interval_s`` with their sample count as a fifth element)."""

    rows = (job.utilisation or {}).get("rows", [])
    return {"summary": summarise(Sample.from_row(r) for r in rows),
            "interval_s": (job.utilisation or {}).get("interval_s"), "rows": rows}


def lane_summaries(*, last: int = 1000) -> dict[str, dict]:
    """Stage min / avg / max / p95 per lane over each lane's ``last`` batches."""

    out = {}
    for lane in Lane.values:
        ids = list(BatchStat.objects.filter(lane=lane).order_by("-id").values_list("id", flat=True)[:last])
        out[lane] = {"batches": len(ids), "timings_ms": stage_summary(BatchStat.objects.filter(id__in=ids))}
    return out
