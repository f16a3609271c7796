"""Preprocess stage: upright RGB ``(H, W, 3) uint8`` → model input ``(3, S, S) float32``.

Equal to open_clip's own transform (``Resize(S, bicubic, antialias) → CenterCrop(S) → ToTensor →
Normalize(mean, std)``), with every parameter read from the model's preprocess config
(``open_clip.get_model_preprocess_cfg``), not hard-coded. The resize runs on a tensor with
torchvision's antialiased bicubic kernel, which reproduces PIL's filter; the test suite checks the
cosine between our embeddings and open_clip's PIL pipeline is >= 0.999 on every photo.

**Bounded cost, whatever the shape** (``docs/decoding.md``, "Extreme aspect ratios"): resizing the
short side of a 1 × 60000 line to 224 first would make a 224 × 13,440,000 image (9 GB) of which the
crop keeps 224 × 224. When the resized image would be more than :data:`MAX_DIRECT_RATIO` times the
output, ``"shortest"`` crops first: it cuts from the source only the window the kept output pixels
read (the crop's box in source coordinates plus the filter's support) and resamples that box with
PIL, the reference's own resampler, with the same box and scale, so the result is open_clip's up to
float rounding. ``"squash"`` resizes the long axis first; ``"longest"`` only ever shrinks the long
side. Every path then allocates at most a small multiple of the source plus the output.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

_INTERPOLATION = {
    "bicubic": InterpolationMode.BICUBIC,
    "bilinear": InterpolationMode.BILINEAR,
    "nearest": InterpolationMode.NEAREST,
}
_PIL_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR,
                 "nearest": Image.Resampling.NEAREST}
#: Half-width of each filter in output-pixel units at scale 1 (Pillow's ``Resample.c``: bicubic 2,
#: bilinear 1, nearest 0.5); times ``max(scale, 1)`` when antialiasing a downscale.
_SUPPORT = {"bicubic": 2.0, "bilinear": 1.0, "nearest": 0.5}

#: ``"shortest"`` resizes the whole image and then crops only while the resized image has at most
#: this many times the output's pixels (an aspect ratio up to about 4:1: every ordinary photo and
#: most panoramas, which keep the fast tensor path). Beyond it the crop comes first. Chosen here,
#: not from a source: the direct path's resized image is then at most 4 × 224 × 224 × 3 bytes (600 KB).
MAX_DIRECT_RATIO = 4

#: An axis longer than this (pixels) is shrunk :data:`SLICE` output pixels at a time: one call
#: would build a filter table of about 4 entries per source pixel (16 MB of doubles here, 600 MB
#: and 9 s for a 16,000,000-pixel line). Chosen here; below it one call costs < 0.2 s.
SLICE_OVER = 1 << 18
SLICE = 8


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    """The model's own preprocessing (mirror of open_clip's ``PreprocessCfg``).

    Attributes:
        size: output ``(height, width)`` in pixels, e.g. ``(224, 224)``.
        mean: per-channel RGB mean on the 0..1 scale.
        std: per-channel RGB standard deviation on the 0..1 scale.
        interpolation: ``"bicubic"``, ``"bilinear"`` or ``"nearest"``.
        resize_mode: ``"shortest"`` (resize the short side, centre crop), ``"longest"`` (resize the
            long side, pad with ``fill_color``) or ``"squash"`` (resize both sides).
        fill_color: padding value 0..255 for ``"longest"``.
    """

    size: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bicubic"
    resize_mode: str = "shortest"
    fill_color: int = 0

    @classmethod
    def from_open_clip(cls, cfg: Mapping) -> "PreprocessConfig":
        """From ``open_clip.get_model_preprocess_cfg(model)``.

        Raises:
            ValueError: an interpolation or resize mode this module does not implement.
        """
        size = cfg["size"]
        size = (size, size) if isinstance(size, int) else tuple(size)
        out = cls(
            size=size,
            mean=tuple(cfg["mean"]),
            std=tuple(cfg["std"]),
            interpolation=cfg.get("interpolation", "bicubic"),
            resize_mode=cfg.get("resize_mode", "shortest"),
            fill_color=int(cfg.get("fill_color", 0)),
        )
        if out.interpolation not in _INTERPOLATION:
            raise ValueError(f"unsupported interpolation {out.interpolation!r}")
        if out.resize_mode not in ("shortest", "longest", "squash"):
            raise ValueError(f"unsupported resize_mode {out.resize_mode!r}")
        return out

    @property
    def min_side(self) -> int:
        """Smallest source short side (pixels) that still covers the output without upsampling."""
        return max(self.size)


def resize_and_crop(rgb: np.ndarray, cfg: PreprocessConfig) -> torch.Tensor:
    """Geometric part of preprocessing.

    Args:
        rgb: ``(H, W, 3) uint8``.

    Returns:
        ``(3, S_h, S_w) uint8`` tensor.
    """
    if cfg.resize_mode == "shortest":
        window = crop_window(rgb.shape[0], rgb.shape[1], cfg)
        if window is not None:  # before any copy: only the window is read
            (r0, r1), (c0, c1) = window.rows, window.cols
            return _crop_first(rgb[r0:r1, c0:c1], window, cfg)
    if not rgb.flags.writeable:  # torch.from_numpy needs a writable buffer (Pillow's are read-only)
        rgb = rgb.copy()
    return resize_and_crop_tensor(torch.from_numpy(rgb).permute(2, 0, 1), cfg)


def resize_and_crop_tensor(x: torch.Tensor, cfg: PreprocessConfig) -> torch.Tensor:
    """:func:`resize_and_crop` for a ``(3, H, W) uint8`` tensor on any device (GPU JPEG decode).

    Off the CPU the antialiased kernels take floating point only: the resize runs in float32 and
    is rounded back to uint8, so both paths hand ``normalize`` the same kind of input.

    Returns:
        ``(3, S_h, S_w) uint8`` tensor on ``x.device``.
    """
    window = crop_window(x.shape[-2], x.shape[-1], cfg) if cfg.resize_mode == "shortest" else None
    if window is not None:  # crop first (on a device: before the source is widened to float)
        (r0, r1), (c0, c1) = window.rows, window.cols
        return _crop_first(x[:, r0:r1, c0:c1].permute(1, 2, 0).cpu().numpy(), window, cfg).to(x.device)
    if x.device.type != "cpu":
        out = _resize_and_crop(x.to(torch.float32), cfg)
        return out.round_().clamp_(0, 255).to(torch.uint8)
    return _resize_and_crop(x, cfg)


def orient_tensor(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply EXIF ``orientation`` (1-8) to a ``(C, H, W)`` tensor: the upright picture.

    The same transforms as Pillow's ``ImageOps.exif_transpose``; 5-8 swap height and width.
    """
    if orientation in (2, 4):
        return x.flip(-1 if orientation == 2 else -2)
    if orientation == 3:
        return x.flip(-1).flip(-2)
    t = x.transpose(-1, -2)
    if orientation == 5:
        return t
    if orientation == 6:  # rotate 90° clockwise
        return t.flip(-1)
    if orientation == 7:
        return t.flip(-1).flip(-2)
    if orientation == 8:  # rotate 90° anticlockwise
        return t.flip(-2)
    return x


def _resize_and_crop(x: torch.Tensor, cfg: PreprocessConfig) -> torch.Tensor:
    interp = _INTERPOLATION[cfg.interpolation]
    h, w = cfg.size
    if cfg.resize_mode == "shortest":  # (the crop-first case is decided by the callers)
        x = F.resize(x, [min(h, w)], interpolation=interp, antialias=True)
        return F.center_crop(x, [h, w])
    if cfg.resize_mode == "squash":
        return _resize_long_axis_first(x, (h, w), cfg)
    # "longest": scale the long side to the target, then pad to a square with fill_color.
    scale = max(h, w) / max(x.shape[-2:])
    new = (max(1, round(x.shape[-2] * scale)), max(1, round(x.shape[-1] * scale)))
    x = _resize_long_axis_first(x, new, cfg)
    pad_h, pad_w = h - new[0], w - new[1]
    return F.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=cfg.fill_color)


def _resize_long_axis_first(x: torch.Tensor, size: tuple[int, int], cfg: PreprocessConfig) -> torch.Tensor:
    """Antialiased resize of ``(3, H, W)`` to ``size = (h, w)``, one axis at a time, long axis first.

    In one call, torchvision (like Pillow) runs the horizontal pass first, so squashing a
    1,000,000 × 3 line made a 1,000,000 × 224 intermediate (670 MB, 5 s); long axis first, the
    intermediate is ``S × short side``. The filter is separable: only the uint8 rounding between
    the passes can differ from a one-call resize.
    """
    axes = (-2, -1) if x.shape[-2] >= x.shape[-1] else (-1, -2)
    for axis in axes:
        x = _resize_axis(x, axis, size[axis], cfg)
    return x


def _resize_axis(x: torch.Tensor, axis: int, n: int, cfg: PreprocessConfig) -> torch.Tensor:
    """Resize one axis (``-2`` rows, ``-1`` columns) of ``(3, H, W)`` to ``n``, antialiased."""
    if x.shape[axis] == n:
        return x
    if x.shape[axis] > SLICE_OVER and x.device.type == "cpu" and x.dtype == torch.uint8:
        return _shrink_in_slices(x, axis, n, cfg.interpolation)
    size = [n, x.shape[-1]] if axis == -2 else [x.shape[-2], n]
    return F.resize(x, size, interpolation=_INTERPOLATION[cfg.interpolation], antialias=True)


def _shrink_in_slices(x: torch.Tensor, axis: int, n: int, interpolation: str) -> torch.Tensor:
    """:func:`_resize_axis` for a very long axis: :data:`SLICE` outputs at a time.

    Shrinking an axis of length L to n, torchvision and Pillow both build a filter table of
    ``n × (4 · L / n)`` entries up front (bicubic): for a 16,000,000-pixel line, 600 MB and 9 s.
    Each slice of outputs is instead a Pillow resize of the box those outputs cover (same scale,
    same centres, same weights), cut from only the source span that its filter reads.
    """
    length = x.shape[axis]
    scale = length / n
    resample = _PIL_RESAMPLE[interpolation]
    parts = []
    for a in range(0, n, SLICE):
        b = min(n, a + SLICE)
        lo, hi = _window(a * scale, b * scale, b - a, length, interpolation)
        seg = Image.fromarray(np.ascontiguousarray(x.narrow(axis, lo, hi - lo).permute(1, 2, 0).numpy()), "RGB")
        start, stop = a * scale - lo, b * scale - lo
        if axis == -2:
            out = seg.resize((seg.width, b - a), resample, box=(0, start, seg.width, stop))
        else:
            out = seg.resize((b - a, seg.height), resample, box=(start, 0, stop, seg.height))
        parts.append(torch.from_numpy(np.array(out)).permute(2, 0, 1))
    return torch.cat(parts, dim=axis)


@dataclasses.dataclass(frozen=True)
class CropWindow:
    """Where the ``"shortest"`` output comes from in the source, for the crop-first path.

    Attributes:
        rows: source rows ``[start, stop)`` that any kept output pixel's filter reads (plus 1 px).
        cols: source columns ``[start, stop)``, likewise.
        box: ``(left, top, right, bottom)`` in source pixels (floats), relative to the window:
            the region that open_clip's ``Resize(S)`` + ``CenterCrop(S)`` maps onto the output.
        vertical_first: the pass order Pillow picks for the reference's whole-image resize
            (it rounds to uint8 between passes, so the order decides the last bit).
    """

    rows: tuple[int, int]
    cols: tuple[int, int]
    box: tuple[float, float, float, float]
    vertical_first: bool


def crop_window(height: int, width: int, cfg: PreprocessConfig) -> CropWindow | None:
    """The crop-first plan for a ``height × width`` source in ``"shortest"`` mode, or ``None``.

    ``None`` when the direct path (resize all, then crop) is cheap: its resized image has at most
    :data:`MAX_DIRECT_RATIO` times the output's pixels, or the crop does not fit inside it (a
    non-square ``size`` with a near-square image: the reference pads).

    The geometry is torchvision's, which open_clip's transform runs: the short side becomes
    ``min(size)``, the long side ``int(min(size) · long / short)``, and ``CenterCrop`` keeps rows
    from ``int(round((new_h − S_h) / 2))``. Those output pixels cover the source box
    ``[top · H / new_h, (top + S_h) · H / new_h)`` (and likewise across); a resample of exactly that
    box to ``S_h × S_w`` uses the same scale and the same sample centres, hence the same weights.
    """
    h_out, w_out = cfg.size
    short = min(h_out, w_out)
    if width <= height:
        new_w, new_h = short, int(short * height / width)
    else:
        new_h, new_w = short, int(short * width / height)
    if new_h * new_w <= MAX_DIRECT_RATIO * h_out * w_out or new_h < h_out or new_w < w_out:
        return None
    top = round((new_h - h_out) / 2.0)  # Python's round (half to even), as torchvision's CenterCrop
    left = round((new_w - w_out) / 2.0)
    y0, y1 = top * height / new_h, min((top + h_out) * height / new_h, float(height))
    x0, x1 = left * width / new_w, min((left + w_out) * width / new_w, float(width))
    rows = _window(y0, y1, h_out, height, cfg.interpolation)
    cols = _window(x0, x1, w_out, width, cfg.interpolation)
    # Pillow 13 (libImaging/Resample.c, ImagingResampleInner) runs the vertical pass first "if
    # height is being scaled down more than twice the amount the width is"; judged, as in the
    # reference, on the whole image's resize (height → new_h, width → new_w).
    vertical_first = 0 < height - new_h and height - new_h > (width - new_w) * 2
    return CropWindow(rows=rows, cols=cols, box=(x0 - cols[0], y0 - rows[0], x1 - cols[0], y1 - rows[0]),
                      vertical_first=vertical_first)


def _window(start: float, stop: float, out: int, size: int, interpolation: str) -> tuple[int, int]:
    """Source pixels ``[a, b)`` read when ``[start, stop)`` is resampled to ``out`` pixels.

    Pillow's taps for output ``i`` are ``[int(c − s + 0.5), int(c + s + 0.5))`` with centre
    ``c = start + (i + 0.5) · scale`` and support ``s = support · max(scale, 1)``; one more pixel
    each side absorbs float rounding (a pixel outside the taps gets no weight).
    """
    support = _SUPPORT[interpolation] * max((stop - start) / out, 1.0)
    return max(0, math.floor(start - support) - 1), min(size, math.ceil(stop + support) + 1)


def _crop_first(rgb: np.ndarray, window: CropWindow, cfg: PreprocessConfig) -> torch.Tensor:
    """Resample ``window.box`` of ``rgb`` to a ``(3, S_h, S_w) uint8`` CPU tensor.

    Args:
        rgb: ``source[window.rows, window.cols]``, ``(h, w, 3) uint8``.

    Pillow is what open_clip's transform calls (``Image.resize``); given the box it computes the
    reference's own weights for just the kept pixels. The window is at most about
    ``(short side + 2 · support)²`` pixels, so the copy to the CPU (for device tensors) is small.
    The two passes run as two one-axis resizes in the reference's order, so that the uint8
    rounding between them is the reference's too.
    """
    src = Image.fromarray(np.ascontiguousarray(rgb), "RGB")
    h_out, w_out = cfg.size
    resample = _PIL_RESAMPLE[cfg.interpolation]
    left, top, right, bottom = window.box
    if window.vertical_first:
        tmp = src.resize((src.width, h_out), resample, box=(0, top, src.width, bottom))
        out = tmp.resize((w_out, h_out), resample, box=(left, 0, right, h_out))
    else:
        tmp = src.resize((w_out, src.height), resample, box=(left, 0, right, src.height))
        out = tmp.resize((w_out, h_out), resample, box=(0, top, w_out, bottom))
    return torch.from_numpy(np.array(out)).permute(2, 0, 1)


def normalize(x: torch.Tensor, cfg: PreprocessConfig) -> torch.Tensor:
    """``(..., 3, H, W) uint8`` → ``float32`` scaled to 0..1 and normalised by the model's mean/std."""
    # x / 255 * (1 / std) - mean / std as one multiply and one subtract, in place on the one float
    # copy: three temporaries of a 64-image batch (38 MB each) cost twice the arithmetic in page faults
    scale = torch.tensor([1.0 / (255.0 * s) for s in cfg.std], dtype=torch.float32, device=x.device).view(3, 1, 1)
    shift = torch.tensor([m / s for m, s in zip(cfg.mean, cfg.std)], dtype=torch.float32, device=x.device).view(3, 1, 1)
    return x.to(torch.float32, copy=True).mul_(scale).sub_(shift)


def preprocess(rgb: np.ndarray, cfg: PreprocessConfig) -> torch.Tensor:
    """One image: ``(H, W, 3) uint8`` → ``(3, S, S) float32``, normalised."""
    return normalize(resize_and_crop(rgb, cfg), cfg)


def preprocess_batch(images: Sequence[np.ndarray], cfg: PreprocessConfig) -> torch.Tensor:
    """Several images → ``(N, 3, S, S) float32``. Raises ``ValueError`` on an empty sequence."""
    if not images:
        raise ValueError("preprocess_batch needs at least one image")
    return normalize(torch.stack([resize_and_crop(im, cfg) for im in images]), cfg)
