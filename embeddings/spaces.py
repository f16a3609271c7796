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
from workers.model_config import embed_dim
from workers.vector_store.filters import parse_indexed_fields

_cache_lock = threading.Lock()
_cache: tuple[float, EmbeddingSpace] | None = None  # (monotonic time read, row)


def space_for_config(cfg: PipelineConfig) -> dict:
    """The identifying fields of ``cfg``'s space (``model_id``, names, ``collection``, ``dim``).

    Raises:
        ValueError: open_clip has no such architecture.
        FileNotFoundError: ``cfg.pretrained`` names a checkpoint file that does not exist.
    """

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


class ModelNotConfigured(LookupError):
    """Work for an embedding space whose model this process may not load: neither the configured
    model (CLIP_MODEL...), one of ``settings.CLIP_MODELS``, nor the active space. Stable reason code
    :data:`MODEL_NOT_CONFIGURED` (an image fails with it; ``POST /api/migrations/`` answers 400)."""

    code = "model_not_configured"


#: Reason code of :class:`ModelNotConfigured` (``workers.errors.Reason.MODEL_NOT_CONFIGURED``).
MODEL_NOT_CONFIGURED = ModelNotConfigured.code


def parse_model_spec(spec: str, base: PipelineConfig) -> PipelineConfig:
    """One ``CLIP_MODELS`` entry, ``model:pretrained[:precision]``, as ``base`` with that model.

    ``pretrained`` may be an open_clip tag, ``random`` (seeded with ``base.seed``, CLIP_SEED) or a
    checkpoint file path; the precision defaults to ``base.precision`` (CLIP_PRECISION).

    Raises:
        ValueError: no ``:`` (a model without weights), or an invalid precision.
    """
    parts = spec.strip().split(":")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"CLIP_MODELS entry {spec!r} is not model:pretrained[:precision]")
    precision = base.precision
    if len(parts) > 2 and parts[-1] in ("fp32", "bf16", "fp16", "auto"):
        precision = parts.pop()
    return base.replace(model_name=parts[0], pretrained=":".join(parts[1:]), precision=precision)


_configured_lock = threading.Lock()
_configured: dict[tuple, dict[str, PipelineConfig]] = {}


def configured_configs() -> dict[str, PipelineConfig]:
    """``{model_id: PipelineConfig}`` of the models this process is configured to load: the
    deployment's model (``settings.PIPELINE``) and every ``settings.CLIP_MODELS`` entry. Computed
    once per settings value (a checkpoint file is hashed for its model id).

    Raises:
        ValueError: a malformed ``CLIP_MODELS`` entry.
        FileNotFoundError: a ``CLIP_MODELS`` checkpoint file is missing.
    """
    base, extra = settings.PIPELINE, tuple(settings.CLIP_MODELS)
    key = (base, extra)
    with _configured_lock:
        if key in _configured:
            return _configured[key]
    out = {base.model_id: base}
    for spec in extra:
        cfg = parse_model_spec(spec, base)
        out[cfg.model_id] = cfg
    with _configured_lock:
        _configured[key] = out
    return out


def config_for_model_id(model_id: str) -> PipelineConfig:
    """The configuration a worker loads for space ``model_id``: a configured model
    (:func:`configured_configs`), or the active space's model (``config_of``).

    Raises:
        ModelNotConfigured: neither (a worker never loads a model it was not configured for).
    """
    configured = configured_configs()
    if model_id in configured:
        return configured[model_id]
    space = active()
    if space.model_id == model_id:
        return config_of(space)
    raise ModelNotConfigured(f"model {model_id} is not configured in this process (CLIP_MODEL, CLIP_MODELS: "
                             f"{', '.join(sorted(configured))}; active space {space.model_id})")


def declared_fields() -> dict[str, str]:
    """``{metadata field: type}`` declared by ``METADATA_INDEXES``: every collection's payload
    indexes, how text manifests type those columns, and the types their values must hold (the one
    reader of that setting)."""

    return parse_indexed_fields(settings.METADATA_INDEXES) if settings.METADATA_INDEXES else {}
