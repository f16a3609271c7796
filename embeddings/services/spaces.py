"""Embedding spaces (issue 13): which model's collection searches and uploads use.

Every reader asks :func:`active` (one indexed row, cached for at most ``settings.SPACE_CACHE_S`` per
process), so a promotion or a rollback, one transaction moving the ``active`` state, takes effect
everywhere within that time. The first call in a new deployment creates the active space from the
configured model (``settings.PIPELINE``: CLIP_MODEL, CLIP_PRETRAINED, CLIP_PRECISION, CLIP_SEED).
"""
from __future__ import annotations

import threading
import time

from django.conf import settings
from django.db import IntegrityError, transaction

from embeddings.models import DUAL_EMBED_STATES, EmbeddingSpace, SpaceState
from workers.config import PipelineConfig

_cache_lock = threading.Lock()
_cache: tuple[float, EmbeddingSpace] | None = None  # (monotonic time read, row)


def space_for_config(cfg: PipelineConfig) -> dict:
    """The identifying fields of ``cfg``'s space (``model_id``, names, ``collection``, ``dim``).

    Raises:
        ValueError: open_clip has no such architecture.
        FileNotFoundError: ``cfg.pretrained`` names a checkpoint file that does not exist.
    """
    from workers.model_config import embed_dim

    return {"model_id": cfg.model_id, "model_name": cfg.model_name, "pretrained": cfg.pretrained, "seed": cfg.seed,
            "precision": cfg.precision, "collection": cfg.collection_name, "dim": embed_dim(cfg.model_name)}


def config_of(space: EmbeddingSpace) -> PipelineConfig:
    """``settings.PIPELINE`` with ``space``'s model, weights, seed and precision (the rest: batch
    sizes, threads, limits, device, as configured for this process)."""
    return settings.PIPELINE.replace(model_name=space.model_name, pretrained=space.pretrained, seed=space.seed,
                                     precision=space.precision)


def _bootstrap() -> EmbeddingSpace:
    """The active row, created from ``settings.PIPELINE`` when the database has none."""
    space = EmbeddingSpace.objects.filter(state=SpaceState.ACTIVE).first()
    if space is not None:
        return space
    fields = space_for_config(settings.PIPELINE)
    try:
        with transaction.atomic():
            space, created = EmbeddingSpace.objects.get_or_create(
                model_id=fields["model_id"], defaults={**fields, "state": SpaceState.ACTIVE})
            if not created and space.state != SpaceState.ACTIVE:
                # the configured model exists as a non-active space but nothing is active (never
                # left so by promote/rollback, which move the state in one transaction)
                space.state = SpaceState.ACTIVE
                space.save(update_fields=["state"])
    except IntegrityError:  # another process created the active row first
        pass
    return EmbeddingSpace.objects.get(state=SpaceState.ACTIVE)


def active(*, fresh: bool = False) -> EmbeddingSpace:
    """The active embedding space, at most ``settings.SPACE_CACHE_S`` old (``fresh``: read now)."""
    global _cache
    now = time.monotonic()
    with _cache_lock:
        if not fresh and _cache is not None and now - _cache[0] < settings.SPACE_CACHE_S:
            return _cache[1]
    space = _bootstrap()
    with _cache_lock:
        _cache = (now, space)
    return space


def forget_cache() -> None:
    """Drop this process's cached active row (tests; after this process promoted a space)."""
    global _cache
    with _cache_lock:
        _cache = None


def dual_targets() -> list[EmbeddingSpace]:
    """Spaces besides the active one whose collections receive every new upload
    (``candidate`` and ``standby``: :data:`embeddings.models.DUAL_EMBED_STATES`)."""
    return list(EmbeddingSpace.objects.filter(state__in=DUAL_EMBED_STATES))


def by_model_id(model_id: str) -> EmbeddingSpace:
    """The space of ``model_id``.

    Raises:
        EmbeddingSpace.DoesNotExist: no such space.
    """
    return EmbeddingSpace.objects.get(model_id=model_id)
