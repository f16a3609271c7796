"""Calibrated relevance cutoffs of an embedding space (issue 13): when is a hit a match?

A cosine score means nothing alone: its scale depends on the model (trained CLIP text–image matches
score ~0.3, seeded random weights put any two photos near 0.7). Each space therefore measures what
*unrelated* items score and takes a high percentile (``settings.CUTOFF_PERCENTILE``, default the
99th) as the default ``min_score`` of its searches:

- ``cutoff_image``: image–image pairs of distinct points (distinct sha256) sampled from the
  collection's stored vectors, for searches by an image or an image id;
- ``cutoff_text``: the fixed prompts of ``embeddings/calibration_prompts.txt`` (abstract words and
  non-words, unrelated to any photo) encoded by the space's text tower, against sampled image
  vectors, for text searches.

A space with fewer than ``settings.CUTOFF_MIN_POINTS`` (100) points has no cutoff (nothing is cut):
below that the top 1 % of its pairs are a few dozen pairs, set by whichever near-duplicates the first
uploads happen to hold. The percentile is the nearest-rank one (:func:`percentile_score`): an actual
score of the sample, the smallest that at least that share of the unrelated pairs do not exceed. ``space.calibration``
records the percentile, the pairs, the points in the collection at the time and when.

Calibration runs in the workers as one chain: ``cutoff_encode_texts`` on the bulk queue
(background; a worker holding the model) → ``cutoff_compute`` on the vectors queue (the store's
owner). The prompts' text vectors depend only on the space's model and the prompts, so the first
calibration keeps them in Redis (:func:`remember_prompt_vectors`) and the next ones send
``cutoff_compute`` alone with them (:func:`cached_prompt_vectors`): encoding the 63 prompts costs
~5 s of CPU, ~10 s in a bulk child that must load the model first, and each such burst slows the
interactive lane's forward passes by ~45 % for 7-14 s (measured: docs/benchmarks-load-history.md,
"What a 429 says, learnt"). It is started by ``gate_start`` (a migration's end) and by the
reconciler's rounds when the collection has grown by ≥ :data:`GROWTH_SHARE` or ≥ :data:`GROWTH_POINTS`
points since the last one (:func:`calibrate_if_due`). Cutoffs belong to their space, so they survive a switch.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import random
import time
import uuid
from pathlib import Path

import numpy as np
from celery import chain
from django.conf import settings
from django.utils import timezone

from embeddings import dispatch, lane_control, metrics, runtime
from embeddings.messages import decode_vector, encode_vector
from embeddings.models import (
    DUAL_EMBED_STATES,
    EmbeddingSpace,
    Image,
    ImageStatus,
    Lane,
    SpaceState,
)
from project.celery import app
from workers import screen

log = logging.getLogger(__name__)

#: The prompts file (one per line, ``#`` comments).
PROMPTS_FILE = Path(__file__).resolve().parents[2] / "calibration_prompts.txt"
#: Points sampled from the collection for one calibration (their vectors are read from the store).
SAMPLE_POINTS = 1000
#: Pairs scored per kind: all pairs when there are no more than this, else a seeded sample.
MAX_PAIRS = 5000
#: Recalibrate when the collection has grown by this share of its size at the last calibration...
GROWTH_SHARE = 0.25
#: ... or by this many points.
GROWTH_POINTS = 1000
#: A requested calibration not finished after this long (s) may be requested again.
PENDING_S = 600.0
#: Redis key of a space's prompt text vectors (:func:`encode_prompts`' answer, JSON), by model id
#: and the prompts' sha256: a new prompts file or another model never reads another's.
PROMPT_VECTORS_KEY = "cutoff:prompt-vectors:{model_id}:{prompts_sha256}"
#: They are kept this long (s) after the last calibration that used them; gone, they are encoded again.
PROMPT_VECTORS_TTL_S = 7 * 24 * 3600

#: Where a search's ``min_score`` came from (the API's ``min_score_source``).
CALIBRATED, REQUEST, UNCALIBRATED = "calibrated", "request", "uncalibrated"
#: Search kinds: a text query uses ``cutoff_text``; an image or an image id, ``cutoff_image``.
TEXT, IMAGE = "text", "image"
#: The answer's ``message`` when a cutoff left nothing.
NO_MATCH = "no match above the cutoff"


@functools.cache
def prompts() -> tuple[str, ...]:
    """The calibration prompts of :data:`PROMPTS_FILE` (non-empty, non-comment lines, in order)."""
    lines = PROMPTS_FILE.read_text(encoding="utf-8").splitlines()
    return tuple(s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#"))


def percentile_score(scores, percentile: float) -> float | None:
    """The nearest-rank ``percentile`` of ``scores``: the ⌈p/100 · n⌉-th smallest (at least the
    1st), i.e. numpy's ``method="inverted_cdf"``; ``None`` for no scores.

    Raises:
        ValueError: ``percentile`` outside [0, 100].
    """
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    s = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    if not len(s):
        return None
    rank = max(1, math.ceil(percentile / 100 * len(s) - 1e-9))
    return float(s[rank - 1])


def pair_scores(vectors: np.ndarray, *, max_pairs: int = MAX_PAIRS, seed: int = 0) -> np.ndarray:
    """Cosine scores of pairs of distinct rows of ``vectors`` ``(N, D) float32``, L2-normalised:
    every pair ``i < j`` when there are at most ``max_pairs``, else ``max_pairs`` pairs drawn with
    ``numpy.random.default_rng(seed)`` (``i ≠ j``, with replacement).

    Returns:
        ``(P,) float64`` scores (P = 0 for fewer than two rows).
    """
    v = np.asarray(vectors, dtype=np.float64)
    n = len(v)
    if n < 2:
        return np.empty(0)
    if n * (n - 1) // 2 <= max_pairs:
        i, j = np.triu_indices(n, 1)
    else:
        rng = np.random.default_rng(seed)
        i = rng.integers(0, n, max_pairs)
        j = (i + rng.integers(1, n, max_pairs)) % n  # never i
    return np.einsum("pd,pd->p", v[i], v[j])


def cross_scores(texts: np.ndarray, images: np.ndarray, *, max_pairs: int = MAX_PAIRS, seed: int = 0) -> np.ndarray:
    """Cosine scores of text–image pairs, ``texts`` ``(T, D)`` against ``images`` ``(N, D)``: all
    ``T × N`` when at most ``max_pairs``, else ``max_pairs`` pairs drawn with ``default_rng(seed)``.

    Returns:
        ``(P,) float64`` scores.
    """
    t, im = np.asarray(texts, dtype=np.float64), np.asarray(images, dtype=np.float64)
    if not len(t) or not len(im):
        return np.empty(0)
    if len(t) * len(im) <= max_pairs:
        return (t @ im.T).ravel()
    rng = np.random.default_rng(seed)
    i, j = rng.integers(0, len(t), max_pairs), rng.integers(0, len(im), max_pairs)
    return np.einsum("pd,pd->p", t[i], im[j])


def _space(space_or_id) -> EmbeddingSpace:
    return space_or_id if isinstance(space_or_id, EmbeddingSpace) else EmbeddingSpace.objects.get(pk=space_or_id)


def sample_points(space: EmbeddingSpace, *, size: int = SAMPLE_POINTS, seed: int = 0) -> list[uuid.UUID]:
    """Up to ``size`` distinct point ids of ``space`` (one per embedded sha256, all owners), drawn
    with ``random.Random(seed)`` from the points ordered by id."""
    pids = sorted({pid for pid in Image.objects.filter(model_id=space.model_id, status=ImageStatus.EMBEDDED)
                   .values_list("point_id", flat=True)}, key=str)
    return random.Random(seed).sample(pids, min(size, len(pids)))


def _prompt_vectors_key(model_id: str) -> str:
    sha = hashlib.sha256("\n".join(prompts()).encode("utf-8")).hexdigest()
    return lane_control.key(PROMPT_VECTORS_KEY.format(model_id=model_id, prompts_sha256=sha))


def _redis():
    """Admission's Redis client (the broker's server), or ``None`` under eager Celery (tests), where
    nothing is queued and the machine's Redis is not this service's to write."""

    if app.conf.task_always_eager:
        return None

    return lane_control.redis_client()


def cached_prompt_vectors(model_id: str) -> dict | None:
    """The prompts' text vectors of ``model_id`` kept by an earlier calibration
    (``{"vectors": [base64, ...]}``, one per prompt), or ``None``: none kept, another number of
    prompts, eager Celery, or Redis unreadable (then they are encoded again; never raises)."""
    try:
        client = _redis()
        raw = client.get(_prompt_vectors_key(model_id)) if client is not None else None
        texts = json.loads(raw) if raw else None
    except Exception as e:  # noqa: BLE001 - a cache: encoding again is always right
        log.warning("cannot read the kept prompt vectors of %s: %s", model_id, e)
        return None
    if not texts or len(texts.get("vectors") or ()) != len(prompts()):
        return None
    return {"vectors": texts["vectors"]}


def remember_prompt_vectors(model_id: str, texts: dict) -> bool:
    """Keep :func:`encode_prompts`' answer for ``model_id`` for :data:`PROMPT_VECTORS_TTL_S` s
    (an answer with an error, or with another number of vectors than prompts, is not kept).

    Returns:
        Whether it was kept (never raises).
    """
    if len(texts.get("vectors") or ()) != len(prompts()):
        return False
    try:
        client = _redis()
        if client is None:
            return False
        client.set(_prompt_vectors_key(model_id), json.dumps({"vectors": texts["vectors"]}), ex=PROMPT_VECTORS_TTL_S)
        return True
    except Exception as e:  # noqa: BLE001 - a cache
        log.warning("cannot keep the prompt vectors of %s: %s", model_id, e)
        return False


def calibrate_start(space_or_id) -> None:
    """Recompute a space's cutoffs in the workers: ``cutoff_compute`` with the prompts' text
    vectors an earlier calibration kept (:func:`cached_prompt_vectors`), else ``cutoff_encode_texts``
    → ``cutoff_compute``; marks ``calibration`` as requested (``pending_since``) so the reconciler
    does not ask twice. Inline with eager Celery."""


    space = _space(space_or_id)
    calibration = {**(space.calibration or {}), "pending_since": time.time()}
    EmbeddingSpace.objects.filter(pk=space.pk).update(calibration=calibration)
    compute_options = dispatch.vectors_options(interactive=False)
    kept = cached_prompt_vectors(space.model_id)
    if kept is not None:  # no text tower to run: nothing for the bulk worker's cores
        dispatch.task("cutoff_compute", kept, space.model_id, **compute_options).apply_async()
        return
    encode = dispatch.task("cutoff_encode_texts", space.model_id, immutable=True, **dispatch.bulk_options("background"))
    compute = dispatch.task("cutoff_compute", space.model_id, **compute_options)
    chain(encode, compute).apply_async()


def encode_prompts(*, model_id: str) -> dict:
    """The calibration prompts through ``model_id``'s text tower (bulk worker).

    Returns:
        ``{"vectors": [base64, ...]}`` (one per prompt), or ``{"error": code, "detail"}`` when this
        process cannot load the model, when it has no text tower (``text_tower_missing``), or when a prompt's vector is not finite or is all zeros
        (code ``non_finite_embedding`` / ``zero_embedding``, counted: ``workers.screen``; a NaN
        would make the text cutoff NaN): the image cutoff is then computed alone.
    """

    try:
        encoder = runtime.encoder_holder(model_id).get()
    except Exception as e:  # noqa: BLE001 - ModelNotConfigured, WeightsUnavailable, a missing checkpoint
        return {"error": getattr(e, "code", None) or "weights_unavailable", "detail": f"{type(e).__name__}: {e}"}
    if not encoder.has_text:
        return {"error": "text_tower_missing", "detail": f"{model_id} has no text tower: no text cutoff"}
    vectors = encoder.encode_texts(list(prompts()))
    refused = [r for r in screen.faults(vectors) if r is not None]
    if refused:
        metrics.count_refused_embeddings(lane=Lane.BULK, reasons=refused)
        return {"error": refused[0].value,
                "detail": f"{len(refused)} of {len(vectors)} prompts: {screen.detail(refused[0])}"}
    return {"vectors": [encode_vector(v) for v in vectors]}


def calibrate(*, model_id: str, texts: dict, seed: int = 0) -> dict:
    """Compute and store ``model_id``'s cutoffs from its stored vectors (vectors worker).

    Args:
        texts: :func:`encode_prompts`' answer (its vectors, or its error: the text cutoff is kept).

    Returns:
        The space's new ``calibration``: ``percentile``, ``points`` (in the collection now),
        ``sampled`` (points whose vectors were read), ``image_pairs``, ``text_pairs``, ``prompts``,
        ``image``/``text`` (the cutoffs), ``at`` (ISO time), ``seed``, and ``text_error`` when the
        prompts could not be encoded.
    """

    space = EmbeddingSpace.objects.get(model_id=model_id)
    store = runtime.vector_store(model_id)
    p = settings.CUTOFF_PERCENTILE
    got = store.vectors(sample_points(space, seed=seed))
    images = np.stack(list(got.values())) if got else np.empty((0, space.dim), dtype=np.float32)
    image_scores = pair_scores(images, seed=seed)
    text_vectors = np.stack([decode_vector(s) for s in texts.get("vectors", [])]) if texts.get("vectors") else None
    text_scores = cross_scores(text_vectors, images, seed=seed) if text_vectors is not None else np.empty(0)
    enough = len(images) >= settings.CUTOFF_MIN_POINTS
    cut_image = percentile_score(image_scores, p) if enough else None
    if text_vectors is not None or not enough:
        cut_text = percentile_score(text_scores, p) if enough else None
    else:  # the prompts could not be encoded here: the last text cutoff stands
        cut_text = space.cutoff_text
    calibration = {"percentile": p, "points": store.count(), "sampled": len(images), "image_pairs": len(image_scores),
                   "text_pairs": len(text_scores), "prompts": len(prompts()), "seed": seed,
                   "image": cut_image, "text": cut_text, "at": timezone.now().isoformat()}
    if not enough:
        calibration["note"] = f"fewer than CUTOFF_MIN_POINTS={settings.CUTOFF_MIN_POINTS} points: no cutoff yet"
    if "error" in texts:
        calibration["text_error"] = f"{texts['error']}: {texts.get('detail', '')}"
    EmbeddingSpace.objects.filter(pk=space.pk).update(cutoff_image=cut_image, cutoff_text=cut_text,
                                                       calibration=calibration)
    remember_prompt_vectors(model_id, texts)  # the next calibration needs no text tower
    log.info("calibrated %s: image cutoff %s over %d pairs, text cutoff %s over %d pairs (%d points)", model_id,
             cut_image, len(image_scores), cut_text, len(text_scores), calibration["points"])
    return calibration


def calibration_due(space: EmbeddingSpace, points: int, *, now: float | None = None) -> bool:
    """Whether ``space``, whose collection holds ``points`` points, should be recalibrated: it has
    ``settings.CUTOFF_MIN_POINTS`` points or more and has no cutoff yet, or has grown by ≥ :data:`GROWTH_SHARE` or ≥
    :data:`GROWTH_POINTS` since its last calibration; not while a request younger than
    :data:`PENDING_S` is pending."""
    cal = space.calibration or {}
    now = time.time() if now is None else now
    pending = cal.get("pending_since")
    if pending is not None and now - pending < PENDING_S:  # requested; ``calibrate`` drops the mark
        return False
    last = cal.get("points")
    if points < settings.CUTOFF_MIN_POINTS:
        return False
    if last is None or cal.get("image") is None:
        return True
    return points - last >= GROWTH_POINTS or (points > last and points >= last * (1 + GROWTH_SHARE))


def calibrate_if_due() -> list[str]:
    """The reconciler's hook (vectors worker): start a calibration of each live space (active,
    candidate, standby) whose collection has grown enough (:func:`calibration_due`).

    Returns:
        The model ids calibrations were started for.
    """

    started = []
    for space in EmbeddingSpace.objects.filter(state__in=(SpaceState.ACTIVE, *DUAL_EMBED_STATES)):
        points = runtime.vector_store(space.model_id).count()
        if calibration_due(space, points):
            calibrate_start(space)
            started.append(space.model_id)
    return started


def min_score_for(space: EmbeddingSpace, kind: str, requested: float | None) -> tuple[float | None, str]:
    """The ``min_score`` a search of ``kind`` (:data:`TEXT` or :data:`IMAGE`) applies in ``space``.

    Args:
        requested: the caller's ``min_score`` in [-1, 1]; ``None``: the calibrated default; ``0``:
            no cutoff (the issue's off switch; scores below 0 are then kept too).

    Returns:
        ``(value, source)``: ``value`` None when nothing is cut; ``source`` :data:`REQUEST`,
        :data:`CALIBRATED`, or :data:`UNCALIBRATED` (no calibration yet: nothing is cut).
    """
    if requested is not None:
        return (None if requested == 0 else float(requested)), REQUEST
    value = space.cutoff_text if kind == TEXT else space.cutoff_image
    return (None, UNCALIBRATED) if value is None else (float(value), CALIBRATED)


def apply_min_score(results: list[dict], *, space: EmbeddingSpace, kind: str, requested: float | None) -> dict:
    """A search's answer with the cutoff applied: hits scoring below it dropped (best first kept).

    Returns:
        ``{"results", "model_id", "min_score", "min_score_source"}`` plus ``"message":``
        :data:`NO_MATCH` when a cutoff applied and nothing is left.
    """
    value, source = min_score_for(space, kind, requested)
    kept = results if value is None else [r for r in results if r["score"] >= value]
    out = {"results": kept, "model_id": space.model_id, "min_score": value, "min_score_source": source}
    if value is not None and not kept:
        out["message"] = NO_MATCH
    return out
