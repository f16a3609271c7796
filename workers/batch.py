"""A batch's records: what a runner is given (the image loader, the hooks) and what it gives back
(each refused image with its reason, each embedded image's facts, the prepared pixels, the
vectors), and the screening of the model's vectors. ``workers.runner`` makes them; the bulk and
interactive lanes read them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import numpy as np
import torch

from workers import screen
from workers.errors import Reason
from workers.preview import PreviewTally
from workers.timing import StageTimings

log = logging.getLogger(__name__)

#: Reads the encoded bytes of one image given its key. Raises ImageRejected (source_missing, ...).
Loader = Callable[[str], bytes]
#: Called before each forward pass of a micro-batched run (and before the next micro-batch's
#: preparation starts): blocks while the caller's work must give way (a migration waiting for the
#: interactive lane to fall idle, ``bulk_yield.yield_to_interactive``) and returns the milliseconds it waited.
BeforePass = Callable[[], float]
#: Called on a decode thread with an image's key, its upright ``(H, W, 3) uint8`` RGB pixels
#: (possibly DCT-reduced, see ``DecodedImage.scale``; after a device decode, shrunk there to a short
#: side of ``PipelineConfig.preview_side``) and its :class:`ImageMeta` (the original's full size and
#: format) right after a successful decode of the original: the hook that draws the preview and the
#: thumbnail where the image is already decoded (``workers.preview``, ``workers.thumbnail``). Never
#: called for an image read from its preview. Its time counts as ``preprocess``; an exception it
#: raises is logged and never fails the image.
OnDecoded = Callable[[str, np.ndarray, "ImageMeta"], None]


@dataclasses.dataclass(frozen=True)
class Failed:
    """An image refused with a stable reason code."""

    key: str
    reason: str
    detail: str


@dataclasses.dataclass(frozen=True)
class ImageMeta:
    """Facts about a decoded image: upright full-size ``width`` × ``height`` (pixels), ``format``."""

    key: str
    width: int
    height: int
    format: str


@dataclasses.dataclass
class PreparedBatch:
    """Images ready for the model.

    Attributes:
        pixels: ``(M, 3, S, S) uint8`` resized and cropped, not yet normalised (M may be 0); on the
            CPU, or on the model's device after a device JPEG decode.
        metas: one :class:`ImageMeta` per row of ``pixels``, same order.
        failed: images refused while loading or decoding.
        timings: load / decode / decode_wait / preprocess so far.
        started: ``time.perf_counter()`` when preparation began.
        previews: what was read from previews and what fell back to originals (all zeros without
            ``previews``).
    """

    pixels: torch.Tensor
    metas: list[ImageMeta]
    failed: list[Failed]
    timings: StageTimings
    started: float
    previews: PreviewTally = dataclasses.field(default_factory=PreviewTally)


@dataclasses.dataclass
class BatchResult:
    """Embeddings for a batch.

    Attributes:
        vectors: ``(M, D) float32`` L2-normalised, row i belongs to ``metas[i]``.
        metas: the embedded images, in input order (failed ones removed).
        failed: refused images with reasons.
        timings: every stage up to ``embed``; ``total`` is wall time from the start of ``prepare``.
        paused_ms: time spent waiting in ``before_pass`` (ms; within ``total`` when the run had several
            passes, before it when one; 0 without a hook).
        previews: as :attr:`PreparedBatch.previews`, over every pass.
    """

    vectors: np.ndarray
    metas: list[ImageMeta]
    failed: list[Failed]
    timings: StageTimings
    paused_ms: float = 0.0
    previews: PreviewTally = dataclasses.field(default_factory=PreviewTally)


def call_on_decoded(on_decoded: OnDecoded, key: str, rgb: np.ndarray, meta: ImageMeta) -> None:
    """Run the decode hook; a failure there (a full disk for thumbnails) must not refuse the image:
    it is logged with its traceback and the embedding goes on."""
    try:
        on_decoded(key, rgb, meta)
    except Exception:  # noqa: BLE001 - logged with its traceback; the embedding goes on
        log.exception("on_decoded hook failed for %s", key)


def screened(metas: Sequence[ImageMeta], vectors: np.ndarray) -> tuple[list[ImageMeta], np.ndarray, list[Failed]]:
    """Split the model's ``vectors`` ``(N, D)`` (row i of ``metas[i]``) into the usable rows and the
    refused images (``workers.screen``: ``non_finite_embedding``, ``zero_embedding``), order kept.

    Returns:
        ``(metas kept, their vectors (M, D), refused images)``.
    """
    reasons = screen.faults(vectors)
    if not any(reasons):
        return list(metas), vectors, []
    keep = [i for i, r in enumerate(reasons) if r is None]
    refused = [Failed(m.key, r.value, screen.detail(r)) for m, r in zip(metas, reasons) if r is not None]
    return [metas[i] for i in keep], vectors[keep], refused


def expired(key: str) -> Failed:
    """The :class:`Failed` record for an interactive request whose deadline passed."""
    return Failed(key, Reason.EXPIRED.value, "deadline passed before the model ran")
