"""Routing by what the bytes are: which decoder gets an image, decided from its header.

On CUDA (``PREPROCESS=gpu_decode``) a JPEG the device decodes fast and faithfully goes to the
batched device decoder; everything else goes to CPU decoding (``workers.decode_pool``):

- ``device_jpeg``: a **baseline or extended sequential** (SOF0/SOF1) 8-bit Huffman JPEG with 1 or 3
  components, whose marker structure passed :func:`workers.containers.scan_jpeg` (complete up to
  its EOI, at most ``MAX_JPEG_SCANS`` scans) and whose size is within the limits. The hardware JPEG
  decoder (nvJPEG's A100/H100/H200 engine) takes only baseline JPEGs; torchvision and nvImageCodec
  decode progressive ones on the CUDA cores one at a time, slower than a CPU core with DCT scaling.
- ``cpu``: progressive (SOF2), arithmetic-coded (SOF9/SOF10) and lossless (SOF3) JPEGs, CMYK/YCCK
  (4 components), PNG and every other format, and every file the header checks refuse: the CPU
  path (``workers.decode.decode_image``) then refuses it with its own reason code, so routing never
  changes what an image is refused for.

The route carries why it was chosen (:data:`WHY`), counted per batch, so that a mix of images
explains its own throughput. Only headers are read (and the JPEG marker walk, which steps over
entropy-coded data at C speed: ~0.1 ms per photo here): no pixel is decoded.

Plain library: no Django, no Celery, no torch.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Iterable

from workers.containers import JPEG_LOSSLESS, scan_jpeg, sniff_format
from workers.errors import ImageRejected


class Route(enum.StrEnum):
    """Where an image is decoded."""

    DEVICE_JPEG = "device_jpeg"  #: the batched device decoder (nvImageCodec, else torchvision nvJPEG)
    CPU = "cpu"  #: CPU decoding (``workers.decode``), in processes on CUDA machines


#: Why a route was chosen: stable strings (counted in benchmarks and logs).
WHY = (
    "baseline_jpeg",  # SOF0/SOF1, 8-bit, 1 or 3 components: device
    "progressive_jpeg",  # SOF2: the hardware decoder refuses it
    "arithmetic_jpeg",  # SOF9/SOF10: nvJPEG has no arithmetic decoder
    "lossless_jpeg",  # SOF3: no DCT
    "cmyk_jpeg",  # 4 components: converted by libjpeg/OpenCV's rule on the CPU
    "png",
    "other_format",  # any other sniffed format
    "refused",  # the header checks refuse it: the CPU path says why, with its reason code
)

_DEVICE_SOF = frozenset({0xC0, 0xC1})
_ARITHMETIC_SOF = frozenset({0xC9, 0xCA})


@dataclasses.dataclass(frozen=True)
class Routed:
    """Where one image goes and why.

    Attributes:
        route: :class:`Route`.
        why: one of :data:`WHY`.
        format: sniffed format (``None``: no known format).
        width: stored frame width of a JPEG (pixels, before orientation); 0 for other formats.
        height: stored frame height of a JPEG (pixels); 0 for other formats.
        orientation: EXIF orientation 1-8 of a JPEG (1 otherwise).
    """

    route: Route
    why: str
    format: str | None = None
    width: int = 0
    height: int = 0
    orientation: int = 1

    @property
    def upright_size(self) -> tuple[int, int]:
        """``(width, height)`` of the upright picture (pixels)."""
        return (self.height, self.width) if self.orientation >= 5 else (self.width, self.height)


def route(data: bytes, *, max_pixels: int, max_bytes: int) -> Routed:
    """Where ``data`` is decoded, from its header (never raises).

    Args:
        data: the encoded file.
        max_pixels: the pipeline's header pixel limit (pixels); above it: ``cpu`` / ``refused``.
        max_bytes: the pipeline's file size limit (bytes); above it: ``cpu`` / ``refused``.
    """
    if not data or len(data) > max_bytes:
        return Routed(Route.CPU, "refused")
    fmt = sniff_format(data)
    if fmt is None:
        return Routed(Route.CPU, "refused")
    if fmt == "png":
        return Routed(Route.CPU, "png", fmt)
    if fmt != "jpeg":
        return Routed(Route.CPU, "other_format", fmt)
    try:
        info = scan_jpeg(data)
    except ImageRejected:
        return Routed(Route.CPU, "refused", fmt)
    if info.width * info.height > max_pixels:
        return Routed(Route.CPU, "refused", fmt)
    if info.sof in _DEVICE_SOF:
        why = "baseline_jpeg" if info.components in (1, 3) else "cmyk_jpeg"
    elif info.sof == 0xC2:
        why = "progressive_jpeg"
    elif info.sof in _ARITHMETIC_SOF:
        why = "arithmetic_jpeg"
    elif info.sof in JPEG_LOSSLESS:
        why = "lossless_jpeg"
    else:
        why = "progressive_jpeg"  # SOF6/7/E/F are hierarchical: refused by scan_jpeg already
    where = Route.DEVICE_JPEG if why == "baseline_jpeg" else Route.CPU
    return Routed(where, why, fmt, info.width, info.height, info.orientation)


def route_counts(blobs: Iterable[bytes], *, max_pixels: int = 50_000_000,
                 max_bytes: int = 50 * 1024 * 1024) -> collections.Counter:
    """``Counter`` of ``(route, why)`` over ``blobs`` (benchmarks, tests, logs)."""
    return collections.Counter((r.route.value, r.why) for r in
                               (route(b, max_pixels=max_pixels, max_bytes=max_bytes) for b in blobs))


def centre_square(width: int, height: int) -> tuple[int, int, int, int]:
    """``(top, left, bottom, right)`` of the centred square of side ``min(width, height)`` (pixels).

    The part of a picture that ``"shortest"`` resize + centre crop to a square keeps, up to the
    rounding of the crop's offset and the resize filter's reach beyond its edges (so a square
    resized straight to the model's side is close to, not equal to, the whole picture resized and
    cropped: docs/decoding.md). A centred square stays centred under every EXIF orientation, so
    the stored image's square is the upright image's square.
    """
    side = min(width, height)
    top, left = (height - side) // 2, (width - side) // 2
    return top, left, top + side, left + side
