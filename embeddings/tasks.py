"""Celery tasks: thin adapters. JSON primitives in (ids, storage keys, base64 vectors), one call to a
service, retry policy on the decorator. Which queue each runs on is decided by the ``*_options``
helpers below, from ``project.lanes``.

- ``interactive`` queue (interactive worker, threads pool + dynamic batcher): ``embed_interactive``,
  ``embed_query``, ``encode_text``.
- ``bulk`` queue (bulk worker, one chunk at a time): ``embed_chunk``.
- ``vectors`` queue (the vector store's owner): ``index_*``, ``search_*``, ``forget_point``.
"""
from __future__ import annotations

from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

from embeddings.services import pipeline
from project import lanes

#: Systemic failures talking to the vector store: retried with exponential backoff (never a bad
#: image, which is recorded, not retried).
_STORE_ERRORS = (ConnectionError, TimeoutError, OSError)


def bulk_options(priority: str) -> dict:
    """``apply_async`` options for a bulk chunk of a job with ``priority`` (urgent/background)."""
    p = lanes.PRIORITY_BULK_URGENT if priority == "urgent" else lanes.PRIORITY_BULK_BACKGROUND
    return {"queue": lanes.BULK, "priority": p}


def interactive_options(deadline_ts: float) -> dict:
    """Options for interactive work: highest priority; the broker drops it a minute after its
    deadline (the task itself already refuses to compute it once the deadline has passed)."""
    return {"queue": lanes.INTERACTIVE, "priority": lanes.PRIORITY_INTERACTIVE, "expires": deadline_ts + 60}


def vectors_options(*, interactive: bool, priority: str = "background") -> dict:
    """Options for vector-store work; searches and interactive writes go before bulk writes."""
    if interactive:
        p = lanes.PRIORITY_INTERACTIVE
    else:
        p = lanes.PRIORITY_BULK_URGENT if priority == "urgent" else lanes.PRIORITY_BULK_BACKGROUND
    return {"queue": lanes.VECTORS, "priority": p}


@shared_task(acks_late=True, reject_on_worker_lost=True, time_limit=settings.CELERY_BULK_TIME_LIMIT_S)
def embed_chunk(job_id: str, image_ids: list[str]) -> dict:
    """Embed one bulk chunk (≤ ``BULK_BATCH_SIZE`` image ids)."""
    return pipeline.chunk_embed(job_id=job_id, image_ids=image_ids)


@shared_task
def embed_interactive(image_ids: list[str], deadline_ts: float) -> dict:
    """Embed an interactive request's images (deadline as Unix time, s)."""
    return pipeline.interactive_embed(image_ids=image_ids, deadline_ts=deadline_ts)


@shared_task
def embed_query(storage_key: str, sha256: str) -> dict:
    """Embed a query image → ``{"vector": base64}`` or ``{"reason", "detail"}``."""
    return pipeline.query_embed(storage_key=storage_key, sha256=sha256)


@shared_task
def encode_text(text: str) -> dict:
    """Embed a text query → ``{"vector": base64}``."""
    return pipeline.text_embed(text=text)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=None)
def index_chunk(job_id: str, stat_id: int | None, items: list[dict]) -> dict:
    """Write a bulk chunk's points and mark its images embedded."""
    return pipeline.chunk_index(job_id=job_id, stat_id=stat_id, items=items)


@shared_task
def index_interactive(embedded: dict, owner_id: int | None, k: int, skipped_ids: list[str]) -> dict:
    """Write an interactive request's points; return each image's neighbours."""
    return pipeline.interactive_index(embedded=embedded, owner_id=owner_id, k=k, skipped_ids=skipped_ids)


@shared_task
def search_vector(query: dict, owner_id: int | None, k: int, job_id: str | None) -> dict:
    """Top-k by a query ``{"vector": base64}`` → ``{"results": [...]}`` (refusals pass through)."""
    return pipeline.vector_search(query=query, owner_id=owner_id, k=k, job_id=job_id)


@shared_task
def search_point(point_id: str, owner_id: int | None, k: int, job_id: str | None) -> list[dict] | None:
    """Top-k by a stored point's vector (None when the point does not exist)."""
    return pipeline.point_search(point_id=point_id, owner_id=owner_id, k=k, job_id=job_id)


@shared_task
def forget_point(point_id: str, sha256: str) -> str:
    """Delete a point (or its deleted row's share of it)."""
    return pipeline.point_forget(point_id=point_id, sha256=sha256)


@worker_ready.connect
def warm_model(sender, **kwargs) -> None:
    """Load the model as soon as an interactive worker is up, so no waiting person pays for it.

    Only for the ``threads``/``solo`` pools, where this process is the one that runs tasks; a
    prefork child loads lazily on its first chunk (never the parent: celery/celery#3402).
    """
    queues = {q.name for q in sender.task_consumer.queues} if getattr(sender, "task_consumer", None) else set()
    pool = type(sender.pool).__module__ if getattr(sender, "pool", None) else ""
    if lanes.INTERACTIVE in queues and ("thread" in pool or "solo" in pool):
        from embeddings import runtime

        runtime.dynamic_batcher()
        runtime.batch_runner().preprocess_config  # noqa: B018 - loads the model


@shared_task
def collection_stats() -> dict:
    """The collection's name and exact point count."""
    return pipeline.point_count()
