"""Thumbnail: a small JPEG of a decoded picture, drawn once on the worker that already decoded it.

Pages show thumbnails, never originals: the web process must not decode anything (it never loads
OpenCV's decoders on a request's path), so the decode stage hands its upright RGB pixels to a
callback (``BatchRunner.prepare(..., on_decoded=...)``) that turns them into bytes with
:func:`thumbnail_bytes`. Plain library: no Django, no Celery. Import-light (the web process reads
its constants): OpenCV and torch are imported where they are used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

#: Longest side of a thumbnail (px). 256 fills a 2×-density grid cell of 128 CSS px and keeps a
#: 50-result grid near 50 × 10-20 KB (the issue's budget: ≤ 1.5 MB for 50).
LONG_SIDE = 256
#: JPEG quality (0-100) of a thumbnail.
QUALITY = 80
#: MIME type and file suffix of every thumbnail drawn now. JPEG, not WebP: at 256 px libjpeg-turbo
#: encodes in 0.3 ms what libwebp takes 10 ms for (Pillow's fastest WebP method 4 ms), for a quarter
#: more bytes; on the bulk path that was a third of a photo's decode time (docs/scaling.md).
CONTENT_TYPE = "image/jpeg"
SUFFIX = ".jpg"
#: Thumbnails drawn before that change are WebP, under the same key with this suffix.
LEGACY_SUFFIX = ".webp"


def content_type(data: bytes) -> str:
    """MIME type of stored thumbnail bytes: ``image/webp`` for a RIFF/WEBP file (drawn by an older
    release), else :data:`CONTENT_TYPE`."""
    return "image/webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else CONTENT_TYPE


def thumbnail_size(width: int, height: int, long_side: int = LONG_SIDE) -> tuple[int, int]:
    """``(width, height)`` scaled so the longer side is ``long_side`` (never enlarged; each ≥ 1 px)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}×{height}")
    scale = min(1.0, long_side / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def thumbnail_bytes(rgb: np.ndarray, *, long_side: int = LONG_SIDE, quality: int = QUALITY) -> bytes:
    """Encode a JPEG thumbnail (baseline, 4:2:0) of an upright picture.

    Args:
        rgb: ``(H, W, 3) uint8`` RGB pixels (as ``workers.decode.DecodedImage.rgb``).
        long_side: longest side of the result (px); smaller pictures keep their size.
        quality: JPEG quality 1..100.

    Returns:
        JPEG bytes, longest side ``min(long_side, max(H, W))``.

    Raises:
        ValueError: ``rgb`` is not ``(H, W, 3) uint8``, or the encoder refuses it.
    """
    import cv2

    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"expected (H, W, 3) uint8 RGB, got {rgb.shape} {rgb.dtype}")
    h, w = rgb.shape[:2]
    tw, th = thumbnail_size(w, h, long_side)
    # Shrinking by 2x or more: INTER_AREA averages every source pixel (INTER_LINEAR would skip some
    # and alias). Less than 2x (a thumbnail drawn from a preview's pixels, usually): INTER_LINEAR,
    # whose two taps per axis still reach every source pixel, at a fifth of INTER_AREA's cost on
    # such fractional ratios; the preview's rule (workers.preview.preview_pixels).
    linear = max(h, w) < 2 * max(tw, th)
    small = (cv2.resize(rgb, (tw, th), interpolation=cv2.INTER_LINEAR if linear else cv2.INTER_AREA)
             if (tw, th) != (w, h) else rgb)
    ok, buf = cv2.imencode(SUFFIX, cv2.cvtColor(small, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError(f"the JPEG encoder refused a {tw}×{th} image")
    return buf.tobytes()


def thumbnail_source(chw: "torch.Tensor", *, long_side: int = LONG_SIDE) -> np.ndarray:
    """Pixels for :func:`thumbnail_bytes` from a decoded ``(3, H, W) uint8`` tensor (e.g. on a GPU
    after a device JPEG decode): shrunk on its device first, so only a small image is copied back.

    Returns:
        ``(h, w, 3) uint8`` RGB on the CPU, longest side at most ``2 * long_side`` (the final
        area-average resize in :func:`thumbnail_bytes` then sees every pixel of this one).
    """
    import torch

    _, h, w = chw.shape
    tw, th = thumbnail_size(w, h, 2 * long_side)
    if (tw, th) != (w, h):
        chw = torch.nn.functional.interpolate(chw[None].float(), size=(th, tw), mode="bilinear",
                                              antialias=True, align_corners=False)[0].round().clamp(0, 255).byte()
    return chw.permute(1, 2, 0).contiguous().cpu().numpy()
