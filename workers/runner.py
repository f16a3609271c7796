"""Runner: composes load → decode → preprocess → embed for one batch and times every stage.

``prepare`` does the CPU-side work for each image on a small thread pool (OpenCV and torch's
resize release the GIL), ``embed`` runs one forward pass. They are separate so that a caller can
overlap them (``run_many`` prepares batch k+1 while batch k is in the model) and so that the
interactive dynamic batcher can merge several requests' prepared images into one forward pass.

Where preprocessing runs follows ``PipelineConfig.preprocess``:

- ``cpu``: decode, resize and crop on the decode threads; normalise on the CPU in ``embed``; the
  float32 batch is copied to the device.
- ``gpu``: as ``cpu`` up to the crop; the uint8 batch is copied to the device (4× fewer bytes) and
  normalised there.
- ``gpu_decode``: each image is routed by what its bytes are (``workers.decode_route``) on the
  decode threads: baseline JPEGs are decoded in one batched call on the device
  (``workers.device_decode``: nvImageCodec, only the centred square the crop keeps when no decode
  hook needs the whole picture), turned upright, resized and cropped there. Progressive JPEGs, PNG,
  the rest, any JPEG the device refuses, and everything when nvImageCodec is missing go through the
  CPU path, so refusals keep their reason codes. Timings: ``decode`` adds the per-image routing to
  the wall time of the batched device decode; ``preprocess`` adds the wall time of the device
  resize (device work is waited for before each clock read, so no stage's time leaks into the next).

The CPU path runs in the decode threads, or, where ``workers.decode_pool.planned_processes`` gives
processes (CUDA machines; never by default on the CPU-only deployment), in that many ``spawn``
processes: the decode threads then only load and route, and the device decode runs while the
processes decode. Same pixels, same reason codes either way; ``decode`` / ``preprocess`` then add
the times measured in the processes.

A bad image never fails its batch: it is returned in ``failed`` with its reason code, and so is
one whose vector the model gave as NaN, infinity or zeros (``workers.screen``), after the pass.

Previews (``workers.preview``, docs/previews.md): given ``previews``, each image is first read from
its stored preview when the model's input fits in it, and from its original otherwise; a preview
that is missing or unreadable falls back to the original (counted in ``previews``, logged). The
decode hook (``on_decoded``) is where a first embedding draws the preview.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import Iterable, Iterator, Sequence

import cv2
import numpy as np
import torch

from workers.batch import (  # noqa: F401 - the batch's records, importable from the runner that makes them
    BatchResult,
    BeforePass,
    Failed,
    ImageMeta,
    Loader,
    OnDecoded,
    PreparedBatch,
    call_on_decoded,
    expired,
    screened,
)
from workers.config import PipelineConfig
from workers.decode import decode_image
from workers.decode_pool import CpuDecoder, planned_processes
from workers.decode_route import Route, centre_square, route
from workers.errors import ImageRejected
from workers.model import EncoderHolder
from workers.preprocess import PreprocessConfig, normalize, orient_tensor, resize_and_crop, resize_and_crop_tensor
from workers.passes import Passes
from workers.preview import (
    PreviewFacts,
    PreviewStore,
    PreviewTally,
    PreviewUnreadable,
    preview_facts,
    preview_fits,
    preview_read,
)
from workers.timing import StageTimings

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class _Pending:
    """An image handed to the CPU decode processes."""

    key: str
    data: bytes
    future: concurrent.futures.Future


@dataclasses.dataclass(frozen=True)
class _Jpeg:
    """A JPEG routed to the device (``device_jpeg``) that waits for the batched device decode."""

    key: str
    data: bytes
    width: int  # stored (not upright) size from the header
    height: int
    orientation: int


@dataclasses.dataclass(frozen=True)
class _PreviewJpeg(_Jpeg):
    """A stored preview (a JPEG, checked: ``workers.preview.preview_facts``) routed to the device
    decoder with the originals' JPEGs. ``width``/``height`` are the preview's pixels; the meta the
    embedding gets is the original's (``original``)."""

    original: PreviewFacts | None = None


class BatchRunner:
    """Runs batches through the pipeline for one worker process.

    Args:
        config: pipeline configuration (limits, thread counts, batch size, where preprocessing runs).
        encoder: lazily-loaded model holder shared by the process.
        jpeg_device: decode the ``device_jpeg`` route's JPEGs on this device. Default:
            ``config.device`` when ``config.preprocess == "gpu_decode"``, else the CPU path only.
            Tests and benchmarks pass ``"cpu"`` to exercise that path without a GPU (torchvision's
            decoder on the CPU).
        jpeg_decoder: ``workers.device_decode.device_decoder``'s ``prefer``: ``"auto"``
            (nvImageCodec on CUDA, else everything on the CPU), ``"nvimgcodec"``, ``"torchvision"``.
    """

    def __init__(self, config: PipelineConfig, encoder: EncoderHolder, *, jpeg_device: str | None = None,
                 jpeg_decoder: str = "auto") -> None:
        self.config = config
        self.encoder = encoder
        self.threads = config.threads()
        if self.threads.oversubscribed:
            log.warning("DECODE_THREADS=%s / TORCH_THREADS=%s × %s bulk processes ask for more busy threads than "
                        "the %s cores", self.threads.decode, self.threads.torch, config.bulk_processes,
                        self.threads.cores)
        # The decode pool is the parallelism; OpenCV's own pool on top of it would oversubscribe.
        cv2.setNumThreads(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.threads.decode, thread_name_prefix="decode"
        )
        if jpeg_device is None and config.preprocess == "gpu_decode":
            jpeg_device = config.device
        self.jpeg_device = torch.device(jpeg_device) if jpeg_device else None
        self.jpeg_decoder = jpeg_decoder
        self._device_decoder = None  # made on first use: nvImageCodec initialises CUDA
        self._device_decoder_made = False
        #: Decode only the centred square on the device (nvImageCodec's ROI decode; torchvision cuts
        #: it from the whole picture, which checks the geometry on the CPU). Off by default: the
        #: square resized straight to the model's side moved the random-weight embedding of one
        #: photo to cosine 0.995 of the CPU path's (docs/decoding.md), and its gain is unmeasured.
        self.device_roi = False
        self.cpu_processes = planned_processes(config)
        self._cpu = CpuDecoder(processes=self.cpu_processes, max_pixels=config.max_image_pixels,
                               max_bytes=config.max_image_bytes,
                               timeout_s=config.decode_timeout_s) if self.cpu_processes else None
        self._side_stream = None

    def device_decoder(self):
        """The batched device JPEG decoder (``workers.device_decode``), ``None`` without one."""
        if not self._device_decoder_made and self.jpeg_device is not None:
            from workers.device_decode import device_decoder

            self._device_decoder = device_decoder(self.jpeg_device, self.jpeg_decoder)
            self._device_decoder_made = True
        return self._device_decoder

    @property
    def preprocess_config(self) -> PreprocessConfig:
        """The model's preprocessing (loads the model on first use)."""
        return self.encoder.get().preprocess_config

    def prepare(self, keys: Sequence[str], loader: Loader, on_decoded: OnDecoded | None = None,
                previews: PreviewStore | None = None) -> PreparedBatch:
        """Load, decode, resize and crop each image in parallel; keep input order. ``on_decoded``
        sees each decoded original (:data:`OnDecoded`).

        Args:
            previews: where the images' previews are (a re-embed); ``None``: originals only. Not
                read at all when the model's input exceeds ``config.preview_side`` (counted
                ``too_small``) or previews are off (``preview_side`` 0).

        Raises:
            Exception: only systemic errors (model cannot load); bad images go to ``failed``.
        """
        cfg = self.preprocess_config  # loads the model on first use: not part of any stage's time
        started = submitted = time.perf_counter()
        with_jpeg = self.device_decoder() is not None
        tally = PreviewTally()
        if previews is not None and not self.config.preview_side:
            previews = None
        elif previews is not None and cfg.min_side > self.config.preview_side:
            tally.too_small, previews = len(keys), None  # no preview can hold this model's input
        futures = [self._pool.submit(self._prepare_one, key, loader, cfg, submitted, with_jpeg, on_decoded, previews)
                   for key in keys]
        timings = StageTimings()
        outcomes = []
        for fut in futures:
            outcome, stage_ms, source = fut.result()
            timings.add(stage_ms)
            outcomes.append(outcome)
            if source is not None:
                setattr(tally, source, getattr(tally, source) + 1)
        if with_jpeg:
            outcomes = self._decode_jpegs_on_device(outcomes, loader, cfg, timings, on_decoded)
        if self._cpu is not None:
            outcomes = self._collect_cpu(outcomes, cfg, timings, on_decoded)
        tensors, metas, failed = [], [], []
        for outcome in outcomes:
            if isinstance(outcome, Failed):
                failed.append(outcome)
            else:
                tensor, meta = outcome
                tensors.append(tensor)
                metas.append(meta)
        h, w = cfg.size
        if tensors and with_jpeg:
            with self._device_stream():  # beside a forward pass that may be running (run_many)
                pixels = torch.stack([t.to(self.jpeg_device) for t in tensors])
                self._sync(self.jpeg_device)
        elif tensors:
            pixels = torch.stack(tensors)
        else:
            pixels = torch.empty((0, 3, h, w), dtype=torch.uint8)
        return PreparedBatch(pixels=pixels, metas=metas, failed=failed, timings=timings, started=started,
                             previews=tally)

    def _prepare_one(self, key: str, loader: Loader, cfg: PreprocessConfig, submitted: float, with_jpeg: bool,
                     on_decoded: OnDecoded | None = None, previews: PreviewStore | None = None):
        """``(outcome, stage ms, preview source)``: the source is a :class:`PreviewTally` field
        (``used``, or why the original was read), ``None`` without ``previews``."""
        t0 = time.perf_counter()
        ms = {"decode_wait": (t0 - submitted) * 1000}
        source = None
        if previews is not None:
            outcome, source = self._from_preview(key, previews, cfg, ms, device=with_jpeg)
            if outcome is not None:
                return outcome, ms, source
            t0 = time.perf_counter()
        try:
            data = loader(key)
        except ImageRejected as e:
            return Failed(key, e.reason.value, e.detail), ms, source
        _merge(ms, {"load": (time.perf_counter() - t0) * 1000})
        if with_jpeg:
            t1 = time.perf_counter()
            routed = route(data, max_pixels=self.config.max_image_pixels, max_bytes=self.config.max_image_bytes)
            _merge(ms, {"decode": (time.perf_counter() - t1) * 1000})  # the routing; the decode is added later
            if routed.route is Route.DEVICE_JPEG:
                return _Jpeg(key, data, routed.width, routed.height, routed.orientation), ms, source
        if self._cpu is not None:
            future = self._cpu.submit(data, cfg, keep_rgb=on_decoded is not None)
            return _Pending(key, data, future), ms, source
        outcome, more = self._decode_on_cpu(key, data, cfg, on_decoded)
        _merge(ms, more)
        return outcome, ms, source

    def _from_preview(self, key: str, previews: PreviewStore, cfg: PreprocessConfig, ms: dict[str, float], *,
                      device: bool = False):
        """``((tensor, meta), "used")`` from the preview of ``key``, or ``(None, why)`` (``missing``,
        ``unreadable``: logged; ``too_small``) when the original must be read. An unreadable one is
        discarded, so that the original's decode hook draws it again. Stage times go into ``ms``.

        ``device`` (a device decoder is there): a JPEG preview that passes its checks (facts, CRC,
        a baseline JPEG the device takes, big enough for the model) comes back as a
        :class:`_PreviewJpeg`, decoded later with the batch's other JPEGs on the device
        (:meth:`_decode_jpegs_on_device`); a lossless one, or one the device would not take, is
        decoded here on the CPU."""
        t0 = time.perf_counter()
        try:
            data = previews.read(key)
        except FileNotFoundError:
            log.debug("no preview of %s: reading its original", key)  # counted; the caller logs the batch's count
            return None, "missing"
        except Exception as e:  # noqa: BLE001 - a storage error: the original may still be readable
            log.warning("preview of %s not read (%s: %s): reading its original", key, type(e).__name__, e)
            return None, "unreadable"
        finally:
            _merge(ms, {"load": (time.perf_counter() - t0) * 1000})
        t1 = time.perf_counter()
        if device:
            queued = self._preview_to_device(key, data, cfg)
            if queued is not None:
                _merge(ms, {"decode": (time.perf_counter() - t1) * 1000})  # the checks; the decode is added later
                return queued
        try:
            preview = preview_read(data)
        except PreviewUnreadable as e:
            log.warning("preview of %s unreadable (%s): discarded, reading its original", key, e)
            try:
                previews.discard(key)
            except Exception:  # noqa: BLE001 - logged; the original is read all the same
                log.exception("could not discard the unreadable preview of %s", key)
            return None, "unreadable"
        finally:
            _merge(ms, {"decode": (time.perf_counter() - t1) * 1000})
        if not preview.fits(cfg.min_side):
            return None, "too_small"
        t2 = time.perf_counter()
        tensor = resize_and_crop(preview.rgb, cfg)
        _merge(ms, {"preprocess": (time.perf_counter() - t2) * 1000})
        return (tensor, ImageMeta(key=key, width=preview.width, height=preview.height, format=preview.format)), "used"

    def _preview_to_device(self, key: str, data: bytes, cfg: PreprocessConfig):
        """``(_PreviewJpeg, "used")`` for a JPEG preview the device decoder takes, ``(None,
        "too_small")`` for one too small for the model, or ``None``: decode it on the CPU (a
        lossless copy, a JPEG the router keeps on the CPU, or one whose checks fail: the CPU path
        then gives the reason and discards it)."""
        try:
            facts = preview_facts(data)
        except PreviewUnreadable:
            return None
        if not facts.jpeg:
            return None
        routed = route(data, max_pixels=self.config.max_image_pixels, max_bytes=self.config.max_image_bytes)
        if routed.route is not Route.DEVICE_JPEG:
            return None
        if not preview_fits((routed.height, routed.width), facts, cfg.min_side):
            return None, "too_small"
        # stored upright with no EXIF: never rotated (orientation 1), as preview_read ignores any
        return _PreviewJpeg(key, data, routed.width, routed.height, 1, original=facts), "used"

    def _preview_on_cpu(self, jpeg: _PreviewJpeg, loader: Loader, cfg: PreprocessConfig,
                        on_decoded: OnDecoded | None):
        """A preview the device refused, decoded on the CPU as the CPU path does; one the CPU cannot
        read either falls back to its original (decoded on the CPU). ``(outcome, stage ms)``."""
        t0 = time.perf_counter()
        try:
            preview = preview_read(jpeg.data)
        except PreviewUnreadable as e:
            log.warning("preview of %s unreadable (%s): reading its original", jpeg.key, e)
            try:
                data = loader(jpeg.key)
            except ImageRejected as e2:
                return Failed(jpeg.key, e2.reason.value, e2.detail), {}
            return self._decode_on_cpu(jpeg.key, data, cfg, on_decoded)
        t1 = time.perf_counter()
        tensor = resize_and_crop(preview.rgb, cfg)
        meta = ImageMeta(key=jpeg.key, width=preview.width, height=preview.height, format=preview.format)
        return (tensor, meta), {"decode": (t1 - t0) * 1000, "preprocess": (time.perf_counter() - t1) * 1000}

    def _decode_on_cpu(self, key: str, data: bytes, cfg: PreprocessConfig, on_decoded: OnDecoded | None = None):
        ms = {}
        t1 = time.perf_counter()
        try:
            decoded = decode_image(
                data,
                max_pixels=self.config.max_image_pixels,
                max_bytes=self.config.max_image_bytes,
                min_side=cfg.min_side,
                timeout_s=self.config.decode_timeout_s,  # a hostile file cannot hold this thread
            )
            t2 = time.perf_counter()
            ms["decode"] = (t2 - t1) * 1000
            meta = ImageMeta(key=key, width=decoded.width, height=decoded.height, format=decoded.format)
            tensor = resize_and_crop(decoded.rgb, cfg)
            if on_decoded is not None:
                call_on_decoded(on_decoded, key, decoded.rgb, meta)
            ms["preprocess"] = (time.perf_counter() - t2) * 1000
        except ImageRejected as e:
            ms.setdefault("decode", (time.perf_counter() - t1) * 1000)
            return Failed(key, e.reason.value, e.detail), ms
        return (tensor, meta), ms

    def _collect_cpu(self, outcomes: list, cfg: PreprocessConfig, timings: StageTimings,
                     on_decoded: OnDecoded | None) -> list:
        """Replace each :class:`_Pending` in ``outcomes`` by its ``(tensor, meta)`` or :class:`Failed`."""
        outcomes = list(outcomes)
        keep_rgb = on_decoded is not None
        for i, o in enumerate(outcomes):
            if not isinstance(o, _Pending):
                continue
            r = self._cpu.result(o.future, o.data, cfg, keep_rgb=keep_rgb)
            timings.decode += r.decode_ms
            timings.preprocess += r.preprocess_ms
            if r.reason is not None:
                outcomes[i] = Failed(o.key, r.reason, r.detail)
                continue
            meta = ImageMeta(key=o.key, width=r.width, height=r.height, format=r.format)
            if on_decoded is not None:
                with timings.measure("preprocess"):
                    call_on_decoded(on_decoded, o.key, r.rgb, meta)
            outcomes[i] = (torch.from_numpy(r.pixels), meta)
        return outcomes

    def _device_roi(self, cfg: PreprocessConfig, on_decoded: OnDecoded | None) -> int:
        """The model's input side when the device decodes only the centred square (the crop keeps
        only it: ``shortest`` to a square, and no decode hook needs the whole picture: previews,
        thumbnails), else 0."""
        ok = self.device_roi and on_decoded is None and cfg.resize_mode == "shortest" and cfg.size[0] == cfg.size[1]
        return cfg.size[0] if ok else 0

    def _decode_jpegs_on_device(self, outcomes: list, loader: Loader, cfg: PreprocessConfig,
                                timings: StageTimings, on_decoded: OnDecoded | None = None) -> list:
        """Replace each :class:`_Jpeg` in ``outcomes`` by ``(uint8 tensor on the device, meta)``; one
        the device refuses is decoded on the CPU (its reason code, if it is bad, is the CPU path's)."""
        jpegs = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, _Jpeg)]
        if not jpegs:
            return outcomes
        device = self.jpeg_device
        decoder = self.device_decoder()
        roi = self._device_roi(cfg, on_decoded)
        outcomes = list(outcomes)
        with self._device_stream():
            t0 = time.perf_counter()
            try:
                images = decoder.decode([o for _, o in jpegs], roi=roi)
            except Exception:  # noqa: BLE001 - the whole call failed: every one of them goes to the CPU
                log.exception("the %s device decoder failed on a batch of %d JPEGs: decoding them on the CPU",
                              decoder.name, len(jpegs))
                images = [None] * len(jpegs)
            self._sync(device)
            t1 = time.perf_counter()
            timings.decode += (t1 - t0) * 1000
            refused = 0
            for (i, jpeg), image in zip(jpegs, images):
                if roi:
                    top, left, bottom, right = centre_square(jpeg.width, jpeg.height)
                    expected = (bottom - top, right - left)
                else:
                    expected = (jpeg.height, jpeg.width)
                if image is None or tuple(image.shape[-2:]) != expected:
                    refused += 1
                    if isinstance(jpeg, _PreviewJpeg):
                        outcome, ms = self._preview_on_cpu(jpeg, loader, cfg, on_decoded)
                    else:
                        outcome, ms = self._decode_on_cpu(jpeg.key, jpeg.data, cfg, on_decoded)
                    timings.add(ms)
                    outcomes[i] = outcome
                    continue
                if isinstance(jpeg, _PreviewJpeg):  # upright already; the original's meta; no decode hook
                    o = jpeg.original
                    outcomes[i] = (resize_and_crop_tensor(image, cfg), ImageMeta(jpeg.key, o.width, o.height, o.format))
                    continue
                upright = orient_tensor(image, jpeg.orientation)
                width, height = (jpeg.height, jpeg.width) if jpeg.orientation >= 5 else (jpeg.width, jpeg.height)
                meta = ImageMeta(jpeg.key, width, height, "jpeg")
                if on_decoded is not None:  # shrunk on the device: only a small picture comes back
                    from workers.preview import device_pixels

                    call_on_decoded(on_decoded, jpeg.key, device_pixels(upright, self.config.preview_side), meta)
                outcomes[i] = (resize_and_crop_tensor(upright, cfg), meta)
            if refused:
                log.info("%d of %d JPEGs refused by the %s device decoder: decoded on the CPU", refused, len(jpegs),
                         decoder.name)
            self._sync(device)
            timings.preprocess += (time.perf_counter() - t1) * 1000
        return outcomes

    def _device_stream(self):
        """A side CUDA stream for device decoding, so it can overlap the forward pass of another
        batch (``run_many``); a no-op context off CUDA."""
        import contextlib

        if self.jpeg_device is None or self.jpeg_device.type != "cuda":
            return contextlib.nullcontext()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.jpeg_device)
        return torch.cuda.stream(self._side_stream)

    @staticmethod
    def _sync(device: torch.device) -> None:
        # Stage times are wall times: wait for queued device work before reading the clock.
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def embed(self, prepared: PreparedBatch) -> BatchResult:
        """Normalise and copy to the device (``preprocess``), then one forward pass (``embed``); a
        vector that is not finite or is all zeros fails its image (:func:`screened`)."""
        encoder = self.encoder.get()
        timings = prepared.timings
        metas, failed = prepared.metas, prepared.failed
        if len(metas):
            with timings.measure("preprocess"):
                x = self.model_input(prepared.pixels)
            with timings.measure("embed"):
                vectors = encoder.encode_images(x)
            metas, vectors, refused = screened(metas, vectors)
            failed = failed + refused
        else:
            vectors = np.empty((0, encoder.embed_dim), dtype=np.float32)
        timings.total = (time.perf_counter() - prepared.started) * 1000
        return BatchResult(vectors=vectors, metas=metas, failed=failed, timings=timings, previews=prepared.previews)

    def model_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(N, 3, S, S) uint8`` → normalised float32 on the model's device, where the config says.

        ``cpu``: normalised on the CPU, float32 copied. ``gpu`` / ``gpu_decode``: uint8 copied (if
        not already there), normalised on the device. Returns after the device has finished.
        """
        encoder = self.encoder.get()
        device = encoder.device
        if self.config.preprocess == "cpu":
            x = normalize(pixels, encoder.preprocess_config).to(device, non_blocking=True)
        else:
            x = normalize(pixels.to(device, non_blocking=True), encoder.preprocess_config)
        self._sync(device)
        return x

    def run(self, keys: Sequence[str], loader: Loader, on_decoded: OnDecoded | None = None, *,
            micro_batch: int | None = None, before_pass: BeforePass | None = None,
            previews: PreviewStore | None = None, pass_ms: float | None = None) -> BatchResult:
        """``embed(prepare(keys, loader, on_decoded, previews))``; with a micro-batch size
        (``micro_batch``, else ``config.micro_batch``) smaller than ``len(keys)``, forward passes of
        that many images, merged into one result in input order (stages and preview counts summed
        over the passes, ``total`` the wall time of them all, ``paused_ms`` the time ``before_pass``
        waited). ``pass_ms``: passes after the first grow while the last pass's time per image
        (preparing and the forward pass) keeps one under this many ms, never below the micro-batch
        (``workers.passes``).

        The passes overlap (:meth:`run_many`: the next one decoded while the model runs) where
        :meth:`overlaps` says so; otherwise they run one after another, each decoded then embedded.
        """
        mb = micro_batch or self.config.micro_batch
        if not mb or len(keys) <= mb:
            paused = before_pass() if before_pass else 0.0
            result = self.embed(self.prepare(keys, loader, on_decoded, previews))
            result.paused_ms = paused
            return result
        started = time.perf_counter()
        batches = Passes(keys, mb, pass_ms)
        if self.overlaps:
            parts = self.run_many(batches, loader, on_decoded, before_pass=before_pass, previews=previews)
        else:
            parts = (self.run(batch, loader, on_decoded, micro_batch=len(batch), before_pass=before_pass,
                              previews=previews) for batch in batches)
        parts = [_recorded(batches, part) for part in parts]
        timings = StageTimings()
        tally = PreviewTally()
        for part in parts:
            timings.add({s: getattr(part.timings, s) for s in ("load", "decode", "decode_wait", "preprocess", "embed")})
            tally.add(part.previews)
        timings.total = (time.perf_counter() - started) * 1000
        return BatchResult(
            vectors=np.concatenate([p.vectors for p in parts]),
            metas=[m for p in parts for m in p.metas],
            failed=[f for p in parts for f in p.failed],
            timings=timings,
            paused_ms=sum(p.paused_ms for p in parts),
            previews=tally,
        )

    @property
    def overlaps(self) -> bool:
        """Whether :meth:`run`'s passes overlap decoding with the model (:meth:`run_many`): when the
        model runs on a device, or the configuration plans it on the CPU (``micro_batch`` set: the
        process's cores are split between decode and torch threads, ``PipelineConfig.threads``).
        Not when a caller alone asks for passes (a migration's or a yielding ingest's) on the CPU:
        there a process decodes *or* runs the model, its sibling processes keep the cores busy, and
        a decode thread beside the forward pass only trades the GIL back and forth (each torch op
        that releases it waits up to the 5 ms switch interval to get it back)."""
        return self.config.device != "cpu" or self.config.micro_batch is not None

    def run_many(self, batches: Iterable[Sequence[str]], loader: Loader,
                 on_decoded: OnDecoded | None = None, *, before_pass: BeforePass | None = None,
                 previews: PreviewStore | None = None) -> Iterator[BatchResult]:
        """Results of ``run`` for each batch, in order, with batch k+1 being loaded, decoded and
        preprocessed (on a helper thread and the decode pool) while batch k is in the model.

        Each result's ``total`` runs from the start of its own preparation to the end of its
        forward pass, so it includes any wait for the model to finish the previous batch.
        ``before_pass`` (when given) runs before the first preparation and before each forward pass
        (batch k+1's preparation starts after it too), so neither decoding nor the model runs
        while it blocks; each result's ``paused_ms`` is what it waited before that batch's pass.
        """
        it = iter(batches)
        ahead = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare-ahead")
        try:
            first = next(it, None)
            paused = before_pass() if before_pass and first is not None else 0.0
            pending = None if first is None else ahead.submit(self.prepare, first, loader, on_decoded, previews)
            while pending is not None:
                prepared = pending.result()
                if before_pass is not None:
                    paused += before_pass()
                following = next(it, None)
                pending = None if following is None else ahead.submit(self.prepare, following, loader, on_decoded,
                                                                      previews)
                result = self.embed(prepared)
                result.paused_ms, paused = paused, 0.0
                yield result
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Stop the decode threads and the CPU decode processes."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._cpu is not None:
            self._cpu.close()


def _recorded(passes: Passes, part: BatchResult) -> BatchResult:
    """``part``, its time per image told to ``passes`` (which cuts the next pass by it): its whole
    ``total`` (preparing, then the forward pass), over every image it held, refused ones too."""
    passes.record(len(part.metas) + len(part.failed), part.timings.total)
    return part


def _merge(into: dict[str, float], more: dict[str, float]) -> None:
    for stage, ms in more.items():
        into[stage] = into.get(stage, 0.0) + ms
