"""Prometheus metrics (prometheus-client): stage timings per lane, images per status, batch sizes,
CPU/GPU utilisation; served by the web process at ``/metrics``.

**One scrape endpoint for every process.** Workers are prefork children (replaced when killed),
thread pools and gunicorn workers; a port per process would need discovery. So every process
writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess
mode; ``project/settings.py`` points it at ``$VAR_DIR/prometheus`` before anything imports the
client) and the web's ``/metrics`` aggregates them with ``MultiProcessCollector``. Without the
variable (a single process) the default registry is served. The folder should be emptied when
the whole service starts afresh (whoever starts the processes: ``scripts/stack.py``, the compose
entrypoint); files of processes that died since are still added up, which keeps counters
monotonic across worker restarts.

Metrics (``lane`` is ``bulk`` or ``interactive``):

- ``clip_stage_seconds{lane,stage}`` histogram: one observation per batch and stage (``load``,
  ``decode``, ``decode_wait`` and ``preprocess`` are summed over the batch's images, the others are
  wall times: see ``workers.timing``). Bulk ``upsert`` and ``total`` are observed once the points
  are written, so bulk ``total`` is end to end; interactive ``total`` ends with the forward pass.
- ``clip_batch_images{lane}`` histogram: images per batch.
- ``clip_images_processed_total{lane,status}`` counter: outcomes as workers record them
  (``embedded``, ``failed``, ``skipped``).
- ``clip_images{status}`` gauge: images per status in the database, read at scrape time.
- ``clip_cpu_percent``, ``clip_gpu_utilisation_percent``, ``clip_gpu_memory_bytes`` gauges: the
  latest utilisation sample of the embedding workers (``workers.utilisation``).
"""
from __future__ import annotations

import functools

from django.db.models.signals import post_save
from django.dispatch import receiver
from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from embeddings.models import BatchStat

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

STAGE_SECONDS = Histogram("clip_stage_seconds", "Per-batch stage time (s)", ["lane", "stage"],
                          buckets=_SECONDS_BUCKETS)
BATCH_IMAGES = Histogram("clip_batch_images", "Images per batch", ["lane"],
                         buckets=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256))
IMAGES_PROCESSED = Counter("clip_images_processed", "Images by outcome, as workers record them", ["lane", "status"])
CPU_PERCENT = Gauge("clip_cpu_percent", "Machine CPU use, latest 1 s sample (0-100, all cores)",
                    multiprocess_mode="mostrecent")
GPU_PERCENT = Gauge("clip_gpu_utilisation_percent", "NVML GPU utilisation, latest 1 s sample (0-100)",
                    multiprocess_mode="mostrecent")
GPU_MEMORY = Gauge("clip_gpu_memory_bytes", "GPU memory in use, latest sample", multiprocess_mode="mostrecent")

_PRE_UPSERT_STAGES = ("load", "decode", "decode_wait", "preprocess", "embed")


def observe_stages(*, lane: str, stages_ms: dict[str, float | None]) -> None:
    """One observation per stage given in ``stages_ms`` (milliseconds; ``None`` skipped)."""
    for stage, ms in stages_ms.items():
        if ms is not None:
            STAGE_SECONDS.labels(lane=lane, stage=stage).observe(ms / 1000)


def count_images(*, lane: str, status: str, n: int) -> None:
    """Add ``n`` images with outcome ``status`` on ``lane``."""
    if n:
        IMAGES_PROCESSED.labels(lane=lane, status=status).inc(n)


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
        from django.db.models import Count

        from embeddings.models import Image, ImageStatus

        family = GaugeMetricFamily("clip_images", "Images per status in the database", labels=["status"])
        counts = {s.value: 0 for s in ImageStatus}
        for row in Image.objects.values("status").annotate(n=Count("id")):
            counts[row["status"]] = row["n"]
        for status, n in counts.items():
            family.add_metric([status], n)
        yield family


def registry() -> CollectorRegistry:
    """What ``/metrics`` serves: every process's values (multiprocess mode) or this process's."""
    import os

    reg = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(reg)
    else:
        for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - re-serve the default collectors
            reg.register(collector)
    reg.register(_ImagesByStatus())
    return reg


def metrics_view(request) -> HttpResponse:
    """``GET /metrics``: Prometheus text exposition (unauthenticated, like most exporters; keep it
    off the public network)."""
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)


# --- utilisation stored with jobs, per-lane summaries ---------------------------------------------

@functools.cache
def worker_sampler():
    """The process's running ``workers.utilisation.Sampler``, feeding the utilisation gauges
    (started on first use, in the process that runs chunks: never in a Celery parent)."""
    from workers.utilisation import process_sampler

    sampler = process_sampler()
    sampler.on_sample(observe_utilisation)
    return sampler


def job_record_utilisation(*, job_id, since: float, config) -> int:
    """Append this process's utilisation samples taken while a chunk of ``job_id`` ran (and the
    worker's pipeline settings, once) to the job. Several bulk processes sample the same machine:
    one row per second is kept (``workers.utilisation.merge_rows``).

    Args:
        job_id: the job.
        since: ``time.time()`` one sample interval before the chunk began.
        config: the worker's ``PipelineConfig``.

    Returns:
        The number of new samples.
    """
    from django.db import transaction

    from embeddings.models import Job
    from workers.utilisation import merge_rows

    sampler = worker_sampler()
    new = sampler.take_new(str(job_id), since)
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(id=job_id).only("utilisation", "pipeline").first()
        if job is None:
            return 0
        fields = {}
        if new:
            rows = merge_rows(job.utilisation.get("rows", []), new)
            fields["utilisation"] = {"interval_s": sampler.interval_s, "rows": rows}
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
    """``{"summary": {...}, "interval_s": s, "rows": [...]}`` for the job API (rows as stored)."""
    from workers.utilisation import Sample, summarise

    rows = (job.utilisation or {}).get("rows", [])
    return {"summary": summarise(Sample.from_row(r) for r in rows),
            "interval_s": (job.utilisation or {}).get("interval_s"), "rows": rows}


def lane_summaries(*, last: int = 1000) -> dict[str, dict]:
    """Stage min / avg / max / p95 per lane over each lane's ``last`` batches."""
    from embeddings.models import Lane
    from embeddings.services.jobs import stage_summary

    out = {}
    for lane in Lane.values:
        ids = list(BatchStat.objects.filter(lane=lane).order_by("-id").values_list("id", flat=True)[:last])
        out[lane] = {"batches": len(ids), "timings_ms": stage_summary(BatchStat.objects.filter(id__in=ids))}
    return out
