"""CPU decoding for the model in worker processes (or in the caller's threads): bytes → the
``(3, S, S) uint8`` crop the model needs, or the CPU decoder's reason code.

On a CUDA machine the CPU decodes what the device decoder does not take (progressive JPEGs, PNG,
the rest: ``workers.decode_route``). In threads of one process, the Python parts of decoding (the
marker walk, the policy, the resize set-up) hold the GIL, and one process feeding a GPU stalls at
about one core's worth of them; in processes, each decoder has a core of its own.

- ``processes = 0``: the calling threads decode (:func:`decode_for_model` in a thread pool): the
  CPU-only deployment's path, unchanged (its bulk workers are already prefork processes).
- ``processes > 0``: a ``spawn`` process pool (never ``fork``: the parent may hold a CUDA context,
  celery/celery#3402; the children import neither CUDA nor the model). Each child decodes with
  DCT scaling to the smallest scale whose short side is still ≥ the model's input
  (``workers.decode``), resizes and crops; only the crop (150 KB) comes back, plus the decoded
  pixels when the caller draws previews from them (``keep_rgb``).

Pixels and reason codes are those of ``workers.decode.decode_image`` + ``workers.preprocess.
resize_and_crop`` in-process, exactly (tests/workers/test_decode_route.py). A child that dies (a
decoder crash) breaks the pool: it is started again and each image that was in flight is tried
alone once more; one that kills its child again is refused ``corrupt``.

:func:`planned_processes` says how many processes a configuration gets (``DECODE_PROCESSES``).

Plain library: no Django, no Celery.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Sequence

import numpy as np

from workers.errors import ImageRejected, Reason

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CpuDecoded:
    """One image decoded for the model on the CPU.

    Attributes:
        pixels: ``(3, S_h, S_w) uint8`` resized and cropped, C-contiguous; ``None`` when refused.
        rgb: the decoded upright ``(H, W, 3) uint8`` pixels (possibly DCT-reduced), only with
            ``keep_rgb``; else ``None``.
        width: upright full-size width (pixels); 0 when refused.
        height: upright full-size height (pixels); 0 when refused.
        format: sniffed format (``""`` when refused).
        reason: the :class:`workers.errors.Reason` value when refused, else ``None``.
        detail: the refusal's sentence.
        decode_ms: decode time (ms, in the process that decoded).
        preprocess_ms: resize + crop time (ms).
    """

    pixels: np.ndarray | None
    rgb: np.ndarray | None = None
    width: int = 0
    height: int = 0
    format: str = ""
    reason: str | None = None
    detail: str = ""
    decode_ms: float = 0.0
    preprocess_ms: float = 0.0


def decode_for_model(data: bytes, cfg, *, max_pixels: int, max_bytes: int, timeout_s: float | None,
                     keep_rgb: bool = False) -> CpuDecoded:
    """Decode (DCT-scaled to ``cfg.min_side``), resize and crop one image; never raises for bad input.

    Args:
        data: the encoded file.
        cfg: the model's ``workers.preprocess.PreprocessConfig``.
        max_pixels, max_bytes, timeout_s: ``workers.decode.decode_image``'s limits.
        keep_rgb: also return the decoded pixels (for a preview drawn from them).
    """
    from workers.decode import decode_image
    from workers.preprocess import resize_and_crop

    t0 = time.perf_counter()
    try:
        decoded = decode_image(data, max_pixels=max_pixels, max_bytes=max_bytes, min_side=cfg.min_side,
                               timeout_s=timeout_s)
    except ImageRejected as e:
        return CpuDecoded(None, reason=e.reason.value, detail=e.detail, decode_ms=(time.perf_counter() - t0) * 1000)
    t1 = time.perf_counter()
    pixels = resize_and_crop(decoded.rgb, cfg).numpy()
    t2 = time.perf_counter()
    return CpuDecoded(np.ascontiguousarray(pixels), decoded.rgb if keep_rgb else None, decoded.width, decoded.height,
                      decoded.format, decode_ms=(t1 - t0) * 1000, preprocess_ms=(t2 - t1) * 1000)


def _child_init() -> None:
    """One thread per child: the pool is the parallelism (OpenCV's and torch's own pools would
    oversubscribe the cores)."""
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def _child_decode(data: bytes, cfg, limits: dict, keep_rgb: bool) -> CpuDecoded:
    return decode_for_model(data, cfg, keep_rgb=keep_rgb, **limits)


class CpuDecoder:
    """Decodes for the model in ``processes`` worker processes, or in ``threads`` threads when 0.

    Args:
        processes: worker processes; 0: the caller's process (a thread pool of ``threads``).
        threads: threads when ``processes`` is 0 (ignored otherwise).
        max_pixels, max_bytes, timeout_s: ``workers.decode.decode_image``'s limits.
    """

    def __init__(self, *, processes: int, threads: int = 1, max_pixels: int, max_bytes: int,
                 timeout_s: float | None) -> None:
        if processes < 0:
            raise ValueError(f"processes must be >= 0, not {processes}")
        self.processes = processes
        self.limits = {"max_pixels": max_pixels, "max_bytes": max_bytes, "timeout_s": timeout_s}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.Executor | None = None
        self._threads = max(1, threads)

    def _executor(self) -> concurrent.futures.Executor:
        with self._lock:
            if self._pool is None:
                if self.processes:
                    self._pool = concurrent.futures.ProcessPoolExecutor(
                        self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init)
                else:
                    self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="cpu-decode")
            return self._pool

    def submit(self, data: bytes, cfg, *, keep_rgb: bool = False) -> concurrent.futures.Future:
        """A future of :class:`CpuDecoded` for ``data``; collect it with :meth:`result`."""
        pool = self._executor()
        try:
            if self.processes:
                return pool.submit(_child_decode, bytes(data), cfg, self.limits, keep_rgb)
            return pool.submit(decode_for_model, data, cfg, keep_rgb=keep_rgb, **self.limits)
        except BrokenProcessPool:
            self._restart(pool)
            return self.submit(data, cfg, keep_rgb=keep_rgb)

    def result(self, future: concurrent.futures.Future, data: bytes, cfg, *, keep_rgb: bool = False) -> CpuDecoded:
        """``future``'s :class:`CpuDecoded`; if its process died, ``data`` is tried alone in a fresh
        pool once more, and refused ``corrupt`` if that process dies too."""
        try:
            return future.result()
        except BrokenProcessPool:
            log.warning("a CPU decode process died; restarting the pool and trying its images again one by one")
            self._restart(None)
        with self._lock:  # alone: only this image is in the pool while it is tried again
            retry = self._pool_for_retry()
            try:
                return retry.submit(_child_decode, bytes(data), cfg, self.limits, keep_rgb).result()
            except BrokenProcessPool:
                self._pool = None
                return CpuDecoded(None, reason=Reason.CORRUPT.value,
                                  detail="the decoder process died while decoding this image (twice)")

    def _pool_for_retry(self) -> concurrent.futures.Executor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init)
        return self._pool

    def _restart(self, broken: concurrent.futures.Executor | None) -> None:
        with self._lock:
            if self._pool is not None and (broken is None or self._pool is broken):
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def decode_many(self, blobs: Sequence[bytes], cfg, *, keep_rgb: bool = False) -> list[CpuDecoded]:
        """:class:`CpuDecoded` of each of ``blobs``, in order."""
        futures = [self.submit(b, cfg, keep_rgb=keep_rgb) for b in blobs]
        return [self.result(f, b, cfg, keep_rgb=keep_rgb) for f, b in zip(futures, blobs)]

    def close(self) -> None:
        """Stop the workers (processes end once their current image is done)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


def planned_processes(config, cpu_count: int | None = None) -> int:
    """CPU decode processes for one worker process of ``config`` (``PipelineConfig``).

    ``config.decode_processes`` when set (0: none). Automatic (``None``): 0 on the CPU (the CPU-only
    deployment's bulk workers are already one prefork process per share of the cores, each decoding
    in its own threads: a pool there would only add copies); on CUDA, the process's share of the
    cores (``cores // bulk_processes``) less one for the process itself (which loads, routes and
    feeds the device), at least 0.

    Raises:
        ValueError: a negative ``decode_processes``.
    """
    from workers.config import available_cores

    explicit = getattr(config, "decode_processes", None)
    if explicit is not None:
        if explicit < 0:
            raise ValueError(f"decode_processes must be >= 0 or None (automatic), not {explicit}")
        return explicit
    if config.device != "cuda":
        return 0
    cores = cpu_count or available_cores()
    return max(0, cores // config.bulk_processes - 1)
