"""Preview: one small upright copy of a picture per distinct bytes, drawn by the worker that decoded
the original and read instead of the original by a re-embed whose model input fits in it.

A re-embed (a model migration, the dual embedding that keeps a standby space current) is bounded
by decoding: a 12 MP progressive JPEG costs tens of ms, its preview about one (docs/previews.md).
The preview is drawn from the pixels the worker has just decoded for the first embedding (no second
decode), and its short side is ``min(short_side, short side of those pixels)``: those pixels may be
DCT-reduced (``workers.decode``, ``min_side``) but always cover the model that drew them, and a
picture is never enlarged.

Two forms (chosen in docs/previews.md, "Format"), told apart by their first bytes:

- a picture shrunk for its preview: **baseline JPEG, quality 90, 4:2:0** (OpenCV's libjpeg-turbo),
  with one comment segment (COM) right after SOI holding the facts below;
- a picture that is its own preview (short side at most the preview's, not DCT-reduced: every one
  of its pixels is kept): a **lossless copy**, ``b"\\x89clip-rgb\\n"``, the facts line, ``b"\\n"``,
  then the raw ``(h, w, 3)`` RGB bytes (zlib level 1 above :data:`RAW_MAX_BYTES`). Lossy
  compression of a full-resolution picture is what a fine pattern does not survive (the
  gamma-scaling trap of the odd set: cosine 0.909 as JPEG q90), and raw bytes decode at memory speed.

The facts: the original's upright full size and format, and a CRC-32 of them and the pixels, so that
a re-embed needs neither the original nor the database for an image's facts, and a damaged preview
is refused instead of embedded (libjpeg conceals damaged entropy-coded data rather than failing).
Pixels are stored upright and carry no EXIF: :func:`preview_read` decodes JPEGs with
``IMREAD_IGNORE_ORIENTATION``, so nothing rotates twice.

Plain library: no Django, no Celery.
"""
from __future__ import annotations

import dataclasses
import re
import struct
import zlib
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

#: Default short side of a preview (px): issue 43, after img2dataset's 384 px inputs that let
#: clip-retrieval reach 2,500 images/s per A100 (rom1504/clip-retrieval
#: ``docs/distributed_clip_inference.md``). Configured by ``PREVIEW_SIDE`` (``PipelineConfig.preview_side``).
PREVIEW_SIDE = 384
#: JPEG quality (1..100): docs/previews.md, "Format" (q95 decodes 22 % slower, is 43 % larger, same cosine).
QUALITY = 90
#: Largest side libjpeg encodes (``JPEG_MAX_DIMENSION``, jmorecfg.h; the format's own 16-bit limit is 65,535).
MAX_SIDE = 65_500
#: A lossless copy larger than this (raw bytes) is stored zlib-compressed (level 1): only pictures
#: far longer than wide (384 × 910 px and up) reach it. Chosen here.
RAW_MAX_BYTES = 1 << 20
#: No lossless copy beyond this (raw bytes; a 384 × 14,500 px line): such a picture gets no
#: preview and its re-embeds read the original. Chosen here: 16 MiB per image in the store.
RAW_LIMIT_BYTES = 16 << 20
_RAW_MAGIC = b"\x89clip-rgb\n"
_FACTS = re.compile(rb"clip-preview/1 w=([0-9]{1,9}) h=([0-9]{1,9}) f=([a-z0-9_]{1,16}) crc=([0-9a-f]{8})( z=[01])?")


class PreviewUnreadable(ValueError):
    """A stored preview that cannot be used (not ours, damaged, cut short): read the original."""


class PreviewTooLong(ValueError):
    """A picture whose preview would be a JPEG with a side over :data:`MAX_SIDE`, or a lossless copy
    over :data:`RAW_LIMIT_BYTES` (a line image): none is drawn, its re-embeds read the original."""


class PreviewStore(Protocol):
    """Where the runner finds previews (``BatchRunner.prepare(..., previews=...)``), by image key."""

    def read(self, key: str) -> bytes:
        """The stored preview of ``key``. Raises ``FileNotFoundError`` when there is none."""

    def discard(self, key: str) -> None:
        """Remove the preview of ``key`` (found unreadable), so that the fallback to the original
        draws it again."""


@dataclasses.dataclass(frozen=True)
class Preview:
    """A decoded preview.

    Attributes:
        rgb: ``(h, w, 3) uint8`` upright RGB, C-contiguous.
        width, height: the ORIGINAL's upright full size (px), as ``DecodedImage.width/height``.
        format: the original's format (``DecodedImage.format``: ``"jpeg"``, ``"png"``...).
    """

    rgb: np.ndarray
    width: int
    height: int
    format: str

    @property
    def short_side(self) -> int:
        return int(min(self.rgb.shape[:2]))

    @property
    def full(self) -> bool:
        """True when the preview holds every pixel of the original (a small picture, not reduced)."""
        return self.rgb.shape[:2] == (self.height, self.width)

    def fits(self, min_side: int) -> bool:
        """Whether a model needing a source short side of ``min_side`` px
        (``PreprocessConfig.min_side``) can read this instead of the original: its short side
        covers it, or it is the whole original anyway."""
        return self.full or self.short_side >= min_side


@dataclasses.dataclass
class PreviewTally:
    """What the runner did about previews for a batch (counts of images).

    Attributes:
        used: embedded from their preview.
        missing: no preview stored: the original was read (logged; ``manage.py previews`` draws them).
        unreadable: a preview that did not decode or failed its CRC: discarded, the original read.
        too_small: the model's input exceeds the preview (the configured side, or this preview's
            own short side): the original read, by design.
    """

    used: int = 0
    missing: int = 0
    unreadable: int = 0
    too_small: int = 0

    def add(self, other: "PreviewTally") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def fallbacks(self) -> int:
        """Previews expected and not usable: ``missing + unreadable``."""
        return self.missing + self.unreadable

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def preview_size(width: int, height: int, short_side: int = PREVIEW_SIDE) -> tuple[int, int]:
    """``(width, height)`` scaled so the shorter side is ``short_side`` px, never enlarged, each
    side at least 1 px. Raises ``ValueError`` for a size or side that is not positive."""
    if width <= 0 or height <= 0 or short_side <= 0:
        raise ValueError(f"sizes must be positive, got {width}×{height} and side {short_side}")
    scale = min(1.0, short_side / min(width, height))
    if scale == 1.0:
        return width, height
    # the short side lands exactly on short_side; the long side is rounded
    if width <= height:
        return short_side, max(1, round(height * scale))
    return max(1, round(width * scale)), short_side


def preview_pixels(rgb: np.ndarray, short_side: int = PREVIEW_SIDE) -> np.ndarray:
    """The preview's pixels: ``rgb`` ``(H, W, 3) uint8`` shrunk so its short side is at most
    ``short_side`` (the same array when it already is).

    Shrinking by 2× or more: INTER_AREA, which averages every source pixel (INTER_LINEAR would skip
    some and alias). Less than 2× (most pictures the model's decode left DCT-reduced, a short side
    of 224..447 px): INTER_LINEAR, whose two taps per axis still reach every source pixel, at a
    third of INTER_AREA's cost on such fractional ratios (docs/previews.md, "What it costs the first
    embedding").
    """
    import cv2

    h, w = rgb.shape[:2]
    tw, th = preview_size(w, h, short_side)
    if (tw, th) == (w, h):
        return rgb
    linear = min(h, w) < 2 * min(tw, th)
    return cv2.resize(rgb, (tw, th), interpolation=cv2.INTER_LINEAR if linear else cv2.INTER_AREA)


def _facts(width: int, height: int, format: str, payload: bytes, extra: bytes = b"") -> bytes:
    """The facts line; its CRC-32 covers the facts before it and ``payload``."""
    head = b"clip-preview/1 w=%d h=%d f=%s" % (width, height, format.encode())
    return head + b" crc=%08x%s" % (zlib.crc32(payload, zlib.crc32(head)), extra)


def preview_encode(pixels: np.ndarray, *, width: int, height: int, format: str, quality: int = QUALITY) -> bytes:
    """Encode preview pixels (:func:`preview_pixels`) with the original's facts: a lossless copy
    when ``pixels`` is the whole original (its size is ``width`` × ``height``), else a JPEG.

    Args:
        pixels: ``(h, w, 3) uint8`` upright RGB.
        width, height: the original's upright full size (px); each at least the pixels' own.
        format: the original's format, ``[a-z0-9_]{1,16}``.
        quality: JPEG quality 1..100.

    Returns:
        The preview file (the module docstring's two forms).

    Raises:
        PreviewTooLong: a JPEG side over :data:`MAX_SIDE`, or a lossless copy over :data:`RAW_LIMIT_BYTES`.
        ValueError: ``pixels`` is not ``(h, w, 3) uint8``, the facts are malformed, or the encoder refuses.
    """
    import cv2

    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected (H, W, 3) uint8 RGB, got {pixels.shape} {pixels.dtype}")
    h, w = pixels.shape[:2]
    if not re.fullmatch(r"[a-z0-9_]{1,16}", format) or w > width or h > height:
        raise ValueError(f"bad facts for a {w}×{h} preview: {width}×{height} {format!r}")
    if (w, h) == (width, height):
        if pixels.nbytes > RAW_LIMIT_BYTES:
            raise PreviewTooLong(f"a lossless copy of {w}×{h} would hold over {RAW_LIMIT_BYTES} bytes")
        raw = np.ascontiguousarray(pixels).tobytes()
        zipped = len(raw) > RAW_MAX_BYTES
        payload = zlib.compress(raw, 1) if zipped else raw
        return _RAW_MAGIC + _facts(width, height, format, payload, b" z=%d" % zipped) + b"\n" + payload
    if max(h, w) > MAX_SIDE:
        raise PreviewTooLong(f"a {w}×{h} preview has a side over libjpeg's {MAX_SIDE}")
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError(f"the JPEG encoder refused a {w}×{h} image")
    body = buf.tobytes()[2:]  # after SOI
    facts = _facts(width, height, format, body)
    return b"\xff\xd8\xff\xfe" + struct.pack(">H", len(facts) + 2) + facts + body


def preview_bytes(rgb: np.ndarray, *, width: int, height: int, format: str, short_side: int = PREVIEW_SIDE,
                  quality: int = QUALITY) -> tuple[bytes, np.ndarray]:
    """:func:`preview_pixels` then :func:`preview_encode`: ``(file bytes, the preview's pixels)``
    (a thumbnail is then drawn from the smaller pixels). Raises as :func:`preview_encode`."""
    pixels = preview_pixels(rgb, short_side)
    return preview_encode(pixels, width=width, height=height, format=format, quality=quality), pixels


@dataclasses.dataclass(frozen=True)
class PreviewFacts:
    """What a stored preview says of itself, checked (:func:`preview_facts`) but not decoded.

    Attributes:
        width, height: the ORIGINAL's upright full size (px).
        format: the original's format.
        jpeg: True when the pixels are a JPEG (``data`` is the whole file, decodable as it is),
            False for a lossless copy.
        payload: the lossless copy's bytes (possibly zlib-compressed: ``compressed``); empty for a JPEG.
    """

    width: int
    height: int
    format: str
    jpeg: bool
    payload: bytes = b""
    compressed: bool = False


def preview_facts(data: bytes) -> PreviewFacts:
    """Check a preview written by :func:`preview_encode` (its form, its facts, its CRC) without
    decoding its pixels: what a device decoder needs before it takes the JPEG (``workers.runner``).

    Raises:
        PreviewUnreadable: neither form, no facts, or a CRC that does not match (damaged or cut short).
    """
    if data[:4] == b"\xff\xd8\xff\xfe" and len(data) >= 6:
        (length,) = struct.unpack(">H", data[4:6])
        facts, payload = data[6 : 4 + length], data[4 + length :]
    elif data[: len(_RAW_MAGIC)] == _RAW_MAGIC and b"\n" in data[len(_RAW_MAGIC):len(_RAW_MAGIC) + 128]:
        facts, _, payload = data[len(_RAW_MAGIC):].partition(b"\n")
    else:
        raise PreviewUnreadable("not a preview: neither a JPEG with facts nor a lossless copy")
    m = _FACTS.fullmatch(facts)
    if m is None or (m[5] is None) != (data[0] == 0xFF):
        raise PreviewUnreadable("not a preview: no clip-preview/1 facts")
    width, height, crc = int(m[1]), int(m[2]), int(m[4], 16)
    if zlib.crc32(payload, zlib.crc32(facts[: facts.index(b" crc=")])) != crc:
        raise PreviewUnreadable(f"CRC mismatch over {len(payload)} bytes (damaged or cut short)")
    if m[5] is None:
        return PreviewFacts(width=width, height=height, format=m[3].decode(), jpeg=True)
    return PreviewFacts(width=width, height=height, format=m[3].decode(), jpeg=False, payload=payload,
                        compressed=m[5] == b" z=1")


def preview_fits(pixels_hw: tuple[int, int], facts: PreviewFacts, min_side: int) -> bool:
    """:meth:`Preview.fits` from the preview's pixel size ``(h, w)`` alone (read from its JPEG
    header before any decode)."""
    return tuple(pixels_hw) == (facts.height, facts.width) or min(pixels_hw) >= min_side


def preview_read(data: bytes) -> Preview:
    """Decode a preview written by :func:`preview_encode` (on the CPU).

    Returns:
        :class:`Preview` with upright pixels (never rotated here: they were stored upright).

    Raises:
        PreviewUnreadable: neither form, a CRC that does not match (damaged or cut short), or pixels
            that do not decode to a picture no larger than its original.
    """
    import cv2

    f = preview_facts(data)
    width, height = f.width, f.height
    if not f.jpeg:
        try:
            raw = zlib.decompress(f.payload) if f.compressed else f.payload
        except zlib.error as e:
            raise PreviewUnreadable(f"lossless copy does not inflate: {e}") from e
        if width == 0 or height == 0 or len(raw) != width * height * 3:
            raise PreviewUnreadable(f"lossless copy holds {len(raw)} bytes, not {width}×{height}×3")
        rgb = np.frombuffer(raw, np.uint8).reshape(height, width, 3)
    else:
        rgb = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
        if rgb is None or rgb.ndim != 3 or rgb.shape[0] > height or rgb.shape[1] > width:
            raise PreviewUnreadable(f"does not decode to a picture within {width}×{height}")
    return Preview(rgb=rgb, width=width, height=height, format=f.format)


def device_pixels(chw: "torch.Tensor", short_side: int = PREVIEW_SIDE) -> np.ndarray:
    """The decode hook's pixels from a ``(3, H, W) uint8`` tensor decoded on a device (a GPU JPEG
    decode): shrunk there to a short side of ``short_side`` (never enlarged; antialiased bilinear),
    so only a preview-sized picture is copied back; the preview and the thumbnail are drawn from it.
    ``short_side`` 0 (previews off): as ``workers.thumbnail.thumbnail_source``.

    Returns:
        ``(h, w, 3) uint8`` RGB on the CPU.
    """
    import torch

    from workers.thumbnail import thumbnail_source

    if not short_side:
        return thumbnail_source(chw)
    _, h, w = chw.shape
    tw, th = preview_size(w, h, short_side)
    if (tw, th) != (w, h):
        chw = torch.nn.functional.interpolate(chw[None].float(), size=(th, tw), mode="bilinear",
                                              antialias=True, align_corners=False)[0].round().clamp(0, 255).byte()
    return chw.permute(1, 2, 0).contiguous().cpu().numpy()
