"""Runner: composes load → decode → preprocess → embed for one batch and times every stage.

``prepare`` does the CPU-side work for each image on a small thread pool (OpenCV and torch's
resize release the GIL), ``embed`` runs one forward pass. They are separate so that a caller can
overlap them (prepare batch k+1 while batch k is in the model) and so that the interactive
dynamic batcher can merge several requests' prepared images into one forward pass.

A bad image never fails its batch: it is returned in ``failed`` with its reason code.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Callable, Sequence

import numpy as np
import torch

from workers.config import PipelineConfig
from workers.decode import decode_image
from workers.errors import ImageRejected, Reason
from workers.model import EncoderHolder
from workers.preprocess import PreprocessConfig, normalize, resize_and_crop
from workers.timing import StageTimings

#: Reads the encoded bytes of one image given its key. Raises ImageRejected (source_missing, ...).
Loader = Callable[[str], bytes]


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
        pixels: ``(M, 3, S, S) uint8`` resized and cropped, not yet normalised (M may be 0).
        metas: one :class:`ImageMeta` per row of ``pixels``, same order.
        failed: images refused while loading or decoding.
        timings: load / decode / decode_wait / preprocess so far.
        started: ``time.perf_counter()`` when preparation began.
    """

    pixels: torch.Tensor
    metas: list[ImageMeta]
    failed: list[Failed]
    timings: StageTimings
    started: float


@dataclasses.dataclass
class BatchResult:
    """Embeddings for a batch.

    Attributes:
        vectors: ``(M, D) float32`` L2-normalised, row i belongs to ``metas[i]``.
        metas: the embedded images, in input order (failed ones removed).
        failed: refused images with reasons.
        timings: every stage up to ``embed``; ``total`` is wall time from the start of ``prepare``.
    """

    vectors: np.ndarray
    metas: list[ImageMeta]
    failed: list[Failed]
    timings: StageTimings


class BatchRunner:
    """Runs batches through the pipeline for one worker process.

    Args:
        config: pipeline configuration (limits, thread counts, batch size).
        encoder: lazily-loaded model holder shared by the process.
    """

    def __init__(self, config: PipelineConfig, encoder: EncoderHolder) -> None:
        self.config = config
        self.encoder = encoder
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, config.decode_threads), thread_name_prefix="decode"
        )

    @property
    def preprocess_config(self) -> PreprocessConfig:
        """The model's preprocessing (loads the model on first use)."""
        return self.encoder.get().preprocess_config

    def prepare(self, keys: Sequence[str], loader: Loader) -> PreparedBatch:
        """Load, decode, resize and crop each image in parallel; keep input order.

        Raises:
            Exception: only systemic errors (model cannot load); bad images go to ``failed``.
        """
        cfg = self.preprocess_config  # loads the model on first use: not part of any stage's time
        started = submitted = time.perf_counter()
        futures = [self._pool.submit(self._prepare_one, key, loader, cfg, submitted) for key in keys]
        timings = StageTimings()
        tensors, metas, failed = [], [], []
        for key, fut in zip(keys, futures):
            outcome, stage_ms = fut.result()
            for stage, ms in stage_ms.items():
                setattr(timings, stage, getattr(timings, stage) + ms)
            if isinstance(outcome, Failed):
                failed.append(outcome)
            else:
                tensor, meta = outcome
                tensors.append(tensor)
                metas.append(meta)
        h, w = cfg.size
        pixels = torch.stack(tensors) if tensors else torch.empty((0, 3, h, w), dtype=torch.uint8)
        return PreparedBatch(pixels=pixels, metas=metas, failed=failed, timings=timings, started=started)

    def _prepare_one(self, key: str, loader: Loader, cfg: PreprocessConfig, submitted: float):
        t0 = time.perf_counter()
        ms = {"decode_wait": (t0 - submitted) * 1000}
        try:
            data = loader(key)
            t1 = time.perf_counter()
            ms["load"] = (t1 - t0) * 1000
            decoded = decode_image(
                data,
                max_pixels=self.config.max_image_pixels,
                max_bytes=self.config.max_image_bytes,
                min_side=cfg.min_side,
            )
            t2 = time.perf_counter()
            ms["decode"] = (t2 - t1) * 1000
            tensor = resize_and_crop(decoded.rgb, cfg)
            ms["preprocess"] = (time.perf_counter() - t2) * 1000
        except ImageRejected as e:
            return Failed(key, e.reason.value, e.detail), ms
        meta = ImageMeta(key=key, width=decoded.width, height=decoded.height, format=decoded.format)
        return (tensor, meta), ms

    def embed(self, prepared: PreparedBatch) -> BatchResult:
        """One forward pass over ``prepared.pixels`` (none if every image failed)."""
        encoder = self.encoder.get()
        timings = prepared.timings
        if len(prepared.metas):
            with timings.measure("preprocess"):
                x = normalize(prepared.pixels, encoder.preprocess_config)
            with timings.measure("embed"):
                vectors = encoder.encode_images(x)
        else:
            vectors = np.empty((0, encoder.embed_dim), dtype=np.float32)
        timings.total = (time.perf_counter() - prepared.started) * 1000
        return BatchResult(vectors=vectors, metas=prepared.metas, failed=prepared.failed, timings=timings)

    def run(self, keys: Sequence[str], loader: Loader) -> BatchResult:
        """``embed(prepare(keys, loader))``."""
        return self.embed(self.prepare(keys, loader))

    def close(self) -> None:
        """Stop the decode threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def expired(key: str) -> Failed:
    """The :class:`Failed` record for an interactive request whose deadline passed."""
    return Failed(key, Reason.EXPIRED.value, "deadline passed before the model ran")
