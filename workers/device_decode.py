"""Batched JPEG decoding on the device for the ``device_jpeg`` route (``workers.decode_route``).

Two decoders (:func:`device_decoder` picks):

- :class:`NvImageCodecDecoder` (``nvidia.nvimgcodec``, pip ``nvidia-nvimgcodec-cu13``): one
  batched call for the whole batch on nvJPEG's hardware engine (A100/H100/H200) and CUDA
  backends, never its CPU backend (CPU decoding is ours: ``workers.decode_pool``); with ``roi``
  only the centred square the model's crop keeps is decoded (nvJPEG's ROI decode).
- :class:`TorchvisionDecoder` (``torchvision.io.decode_jpeg(list, device=...)``): one lock per
  process, baseline JPEGs only on the hardware engine. Chosen on CUDA only when asked for
  (``prefer="torchvision"``); it is what runs on the CPU in tests (``device="cpu"``): the same
  code path without a GPU. Without nvImageCodec on CUDA, everything is decoded on the CPU.

Both return, per JPEG, the decoded ``(3, H, W) uint8`` tensor on the device as stored (orientation
is applied by the caller from our own EXIF parse, as the CPU path does), or ``None`` where the
device refused that image: the caller then decodes it on the CPU, whose policy gives the reason
code of a truly bad file. With ``roi`` the tensor is the stored image's centred square
(:func:`workers.decode_route.centre_square`).

Neither decoder is measured on a GPU yet (docs/decoding.md, "Routing by what the bytes are").

Plain library: no Django, no Celery.
"""
from __future__ import annotations

import logging
from typing import Protocol, Sequence

import torch

from workers.decode_route import centre_square

log = logging.getLogger(__name__)

#: CPU threads nvImageCodec may use (its hybrid backend's Huffman decoding): few, because the CPU
#: decode processes have the cores. Chosen here, unmeasured.
NVIMGCODEC_CPU_THREADS = 2


class DeviceJob(Protocol):
    """What a device decoder needs of one JPEG."""

    data: bytes
    width: int  # stored size (pixels), from the header
    height: int


class DeviceDecoder(Protocol):
    """Decodes a batch of routed JPEGs on one device."""

    name: str

    def decode(self, jobs: Sequence[DeviceJob], *, roi: int = 0) -> list[torch.Tensor | None]:
        """Per job, ``(3, H, W) uint8`` on the device (stored orientation) or ``None`` where the
        device refused it. ``roi`` > 0 (the model's input side): only ``centre_square(width,
        height)``, decoded natively or cut from the whole image."""


class NvImageCodecDecoder:
    """nvImageCodec's batched decoder (hardware engine first, then its CUDA backends).

    Raises:
        ImportError: ``nvidia.nvimgcodec`` is not installed.
    """

    name = "nvimgcodec"

    def __init__(self, device: torch.device) -> None:
        from nvidia import nvimgcodec

        self._nv = nvimgcodec
        self.device = device
        kinds = (nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.GPU_ONLY,
                 nvimgcodec.BackendKind.HYBRID_CPU_GPU)
        # fancy upsampling on: libjpeg's (and so the CPU path's) chroma upsampling
        self._decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=NVIMGCODEC_CPU_THREADS,
                                           backends=[nvimgcodec.Backend(k) for k in kinds],
                                           options=":fancy_upsampling=1")
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                               allow_any_depth=False)

    def decode(self, jobs: Sequence[DeviceJob], *, roi: int = 0) -> list[torch.Tensor | None]:
        nv = self._nv
        streams = []
        for job in jobs:
            stream = nv.CodeStream(job.data)
            if roi:
                stream = stream.get_sub_code_stream(region=nv.Region(*centre_square(job.width, job.height)))
            streams.append(stream)
        cuda_stream = torch.cuda.current_stream(self.device)
        images = self._decoder.decode(streams, params=self._params, cuda_stream=cuda_stream.cuda_stream)
        out: list[torch.Tensor | None] = []
        for job, image in zip(jobs, images):
            if image is None:  # the library logs why; the CPU path decodes it
                out.append(None)
                continue
            hwc = torch.from_dlpack(image)  # (H, W, 3) uint8, ordered on cuda_stream
            out.append(hwc.permute(2, 0, 1))
        return out


class TorchvisionDecoder:
    """``torchvision.io.decode_jpeg`` on a list (nvJPEG on CUDA, libjpeg on the CPU)."""

    name = "torchvision"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def decode(self, jobs: Sequence[DeviceJob], *, roi: int = 0) -> list[torch.Tensor | None]:
        from torchvision.io import ImageReadMode, decode_jpeg

        raw = [torch.frombuffer(bytearray(job.data), dtype=torch.uint8) for job in jobs]
        try:
            images = decode_jpeg(raw, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:  # one bad file fails the whole call: one by one
            images = []
            for r in raw:
                try:
                    images.append(decode_jpeg(r, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    images.append(None)
        if roi:  # the whole image was decoded; keep what a ROI decode would have given
            images = [None if im is None else _square(im, job, roi) for im, job in zip(images, jobs)]
        return images


def _square(image: torch.Tensor, job: DeviceJob, roi: int) -> torch.Tensor | None:
    if tuple(image.shape[-2:]) != (job.height, job.width):
        return None
    top, left, bottom, right = centre_square(job.width, job.height)
    return image[:, top:bottom, left:right]


_missing_logged = False


def device_decoder(device: torch.device, prefer: str = "auto") -> DeviceDecoder | None:
    """The batched decoder for ``device``, or ``None``: decode everything on the CPU.

    Args:
        device: where the decoded tensors go. On the CPU (tests, rehearsals) torchvision's libjpeg
            decoder runs the same code path without a GPU.
        prefer: ``"auto"`` (CUDA: nvImageCodec where importable, else ``None``), ``"nvimgcodec"``
            (raises ``ImportError`` when missing) or ``"torchvision"`` (its nvJPEG path, measured at
            233 images/s on the photo mix with every JPEG sent to it: kept for comparison).

    A missing nvImageCodec is logged once per process; its JPEGs then go down the CPU path with
    everything else (progressive JPEGs and PNG already do).
    """
    global _missing_logged
    if prefer not in ("auto", "nvimgcodec", "torchvision"):
        raise ValueError(f"prefer must be auto, nvimgcodec or torchvision, not {prefer!r}")
    if device.type != "cuda" or prefer == "torchvision":
        return TorchvisionDecoder(device)
    try:
        return NvImageCodecDecoder(device)
    except ImportError as e:
        if prefer == "nvimgcodec":
            raise
        if not _missing_logged:
            _missing_logged = True
            log.warning("nvImageCodec is not installed (%s): every image is decoded on the CPU "
                        "(pip install nvidia-nvimgcodec-cu13 for the device JPEG route)", e)
        return None
