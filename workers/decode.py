"""Decode stage: encoded bytes → upright RGB ``(H, W, 3) uint8``, or :class:`ImageRejected`.

The policy is written out in ``docs/decoding.md``; this docstring is the short version.

* **Format** is sniffed from the content (magic bytes), never from a file name or a client header.
  Content that matches no image format is ``not_an_image``; an image format that no installed
  decoder reads (12-bit JPEG, JPEG XL, SVG, BMP with an embedded JPEG, ...) is
  ``unsupported_format``.
* **Limits first**: the file size is checked against ``max_bytes`` and the header's width × height
  against ``max_pixels`` before any decoder allocates pixels. For JPEG, PNG, WebP, ICO, BMP and
  TIFF we read the header ourselves, because some decoders allocate while "only opening" a file
  (libwebp's animation decoder allocates its canvas; Pillow's ICO plugin decodes on open).
* **Truncation**: a file that ends before its image data does is refused (``truncated``), never
  returned grey-filled or padded: JPEG needs its EOI, PNG its IEND; WebP's RIFF size, TIFF strips
  and tiles, HEIF/AVIF boxes and ICO entries must lie inside the file; Pillow raises for the rest.
* **JPEG** goes through libjpeg-turbo (simplejpeg for 3-component DCT JPEGs, OpenCV for the rest:
  the same pixels): one decode, straight to RGB, optionally at 1/2, 1/4 or 1/8 size through the
  decoder's DCT scaling. Before decoding, a marker scan (C-speed regex over
  the entropy-coded data) checks the structure: a JPEG that ends before its end-of-image marker is
  ``truncated`` (OpenCV would silently fill the rest with grey); 12-bit, hierarchical and
  DNL-sized JPEGs are ``unsupported_format``; files with absurd scan counts (a known libjpeg CPU
  DoS) are ``corrupt``. EXIF orientation is parsed by us and applied with ``cv2`` transposes, so
  reported sizes never depend on guessing from aspect ratios.
* **PNG** goes through OpenCV (libpng, which checks every chunk's CRC and bounds text chunks) after a
  chunk walk that reads IHDR, finds ``tRNS``/``eXIf`` and tells truncation from corruption.
* **Everything else** goes through Pillow (plus pillow-heif for HEIC/HEIF), restricted to the plugin
  of the sniffed format; CIELab and other TIFFs Pillow cannot identify fall back to OpenCV; RLE
  BMPs go to OpenCV because Pillow silently pads bad or short RLE data.
* **Orientation**: EXIF orientation 1-8 (JPEG, PNG ``eXIf``, WebP, TIFF) and HEIF ``irot``/``imir``
  (AVIF via Pillow's EXIF view; HEIC applied by libheif) give upright pixels; ``width``/``height``
  are the upright full-size dimensions.
* **Transparency**: every pixel is composited on :data:`ALPHA_BACKGROUND` (opaque white) in 8-bit
  sRGB values: ``out = round((c·a + bg·(255 − a)) / 255)``. A fully transparent pixel becomes
  exactly the background, whatever colour is stored under it.
* **Depth**: 16-bit samples become 8-bit by ``round(v / 257)`` (scaling, never clipping). Float
  images have no declared range: values in [0, 1] are multiplied by 255, values in [0, 255] are
  kept, anything else is stretched linearly from its min..max to 0..255.
* **Time**: ``timeout_s`` runs the decode in a daemon thread and gives up waiting after that long
  (``decode_timeout``). C decoders cannot be interrupted, so the thread runs on to its end; see
  :func:`abandoned_decodes`.

Reading container structure without decoding pixels (sniffing, header sizes, truncation checks,
orientation tags) lives in :mod:`workers.containers`; this module decodes and converts pixels.

No Django, Celery or torch here: this module is a plain library.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import struct
import threading

import cv2
import numpy as np
import pillow_heif
from PIL import Image, UnidentifiedImageError

# MAX_* and sniff_format are re-exported: callers and tests import them from this module.
from workers.containers import (
    EXIF_ORIENTATION,
    JPEG_LOSSLESS,
    MAX_ISOBMFF_BOXES,  # noqa: F401 - re-exported
    MAX_JPEG_SCANS,  # noqa: F401 - re-exported
    MAX_JPEG_SEGMENTS,  # noqa: F401 - re-exported
    MAX_PNG_CHUNKS,  # noqa: F401 - re-exported
    TIFF_HEIGHT,
    TIFF_WIDTH,
    bmp_header,
    check_isobmff,
    check_pixels,
    check_tiff,
    check_webp,
    ico_largest,
    jpeg_scale,
    scan_jpeg,
    sniff_format,
    tiff_tags,
    walk_png,
)
from workers.errors import ImageRejected, Reason

try:  # pinned in requirements.txt; without it every JPEG goes through OpenCV, pixel for pixel the same
    import simplejpeg as _simplejpeg
except ImportError:  # pragma: no cover - an install without it
    _simplejpeg = None

# HEIC/HEIF decoding through libheif (pillow-heif: pinned in requirements.txt, wheels bundle libheif).
pillow_heif.register_heif_opener()

log = logging.getLogger(__name__)

#: Background for transparent pixels (RGB, uint8). Documented rule; never change silently: it is
#: baked into every stored embedding of an image with transparency.
ALPHA_BACKGROUND: tuple[int, int, int] = (255, 255, 255)

#: Sniffed formats with no decoder here (EPS would run Ghostscript: never hand it to Pillow).
_UNSUPPORTED = frozenset({"jxl", "exr", "hdr", "dds", "eps", "svg"})

#: Pillow plugin ids allowed for each sniffed format (``Image.open(formats=...)``), so a file is never
#: handed to a plugin other than the one its magic bytes name.
_PILLOW_FORMATS: dict[str, tuple[str, ...]] = {
    "gif": ("GIF",),
    "bmp": ("BMP",),
    "tiff": ("TIFF",),
    "jpeg2000": ("JPEG2000",),
    "qoi": ("QOI",),
    "psd": ("PSD",),
    "ico": ("ICO",),
    "sunraster": ("SUN",),
    "webp": ("WEBP",),
    "avif": ("AVIF",),
    "heif": ("HEIF",),
    "pnm": ("PPM",),
    "png": ("PNG",),  # only for sides beyond OpenCV's limit (see _CV_MAX_SIDE)
}

#: What Pillow plugins (and pillow-heif, libavif) raise for bad input.
_PILLOW_ERRORS = (
    OSError, ValueError, SyntaxError, EOFError, RuntimeError, struct.error, IndexError, TypeError, KeyError,
    ZeroDivisionError, OverflowError,
)

# cv2 flag bits: colour output in RGB order, no EXIF rotation (we apply it), DCT reduction.
CV_RGB = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
_CV_UNCHANGED = cv2.IMREAD_UNCHANGED  # UNCHANGED never rotates
CV_REDUCE = {1: 0, 2: cv2.IMREAD_REDUCED_COLOR_2 & ~cv2.IMREAD_COLOR,
             4: cv2.IMREAD_REDUCED_COLOR_4 & ~cv2.IMREAD_COLOR, 8: cv2.IMREAD_REDUCED_COLOR_8 & ~cv2.IMREAD_COLOR}


#: OpenCV refuses to decode an image with a side longer than this (``CV_IO_MAX_IMAGE_WIDTH`` /
#: ``_HEIGHT`` in opencv/modules/imgcodecs/src/loadsave.cpp: 1 << 20 unless these environment
#: variables say otherwise), whatever its pixel count: a valid 1 × 2,000,000 PNG is 6 MB of pixels.
_CV_MAX_SIDE = (int(os.environ.get("OPENCV_IO_MAX_IMAGE_WIDTH", str(1 << 20))),
                int(os.environ.get("OPENCV_IO_MAX_IMAGE_HEIGHT", str(1 << 20))))


def _cv_fits(width: int, height: int) -> bool:
    """Whether OpenCV's per-side limit lets ``imdecode`` read a ``width × height`` image."""
    return width <= _CV_MAX_SIDE[0] and height <= _CV_MAX_SIDE[1]


@dataclasses.dataclass(frozen=True)
class DecodedImage:
    """A decoded, upright picture.

    Attributes:
        rgb: ``(H, W, 3) uint8`` RGB pixels, C-contiguous, upright; possibly reduced (see ``scale``).
        width: upright width of the full-size image (pixels).
        height: upright height of the full-size image (pixels).
        format: sniffed container format (``"jpeg"``, ``"png"``, ``"webp"``, ...).
        scale: DCT reduction used for JPEGs: 1, 2, 4 or 8; ``rgb`` is
            ``ceil(height / scale) × ceil(width / scale)``. Always 1 for other formats.
    """

    rgb: np.ndarray
    width: int
    height: int
    format: str
    scale: int = 1


# --------------------------------------------------------------------------------------------------
# Public entry point


def decode_image(
    data: bytes,
    *,
    max_pixels: int = 50_000_000,
    max_bytes: int = 50 * 1024 * 1024,
    min_side: int | None = None,
    timeout_s: float | None = None,
) -> DecodedImage:
    """Decode ``data`` to upright RGB.

    Args:
        data: the encoded file (``bytes``, ``bytearray`` or ``memoryview``).
        max_pixels: refuse images whose header width × height exceeds this (pixels). Checked
            before any pixel buffer is allocated.
        max_bytes: refuse files larger than this (bytes).
        min_side: if set, a (DCT-coded) JPEG is decoded at 1/2, 1/4 or 1/8 size through libjpeg's
            DCT scaling, the largest reduction whose shorter side is still >= ``min_side`` pixels.
            ``None`` decodes at full size. Other formats are always decoded at full size.
        timeout_s: if set, give up after this many seconds (wall clock) with ``decode_timeout``.
            The decode runs in a daemon thread that cannot be interrupted and finishes in the
            background (see :func:`abandoned_decodes`). ``None``: decode in the calling thread.

    Returns:
        :class:`DecodedImage` with ``rgb`` of shape ``(H, W, 3)``, dtype ``uint8``, C-contiguous.

    Raises:
        ImageRejected: and nothing else; reason ``empty``, ``too_large``, ``not_an_image``,
            ``unsupported_format``, ``too_many_pixels``, ``truncated``, ``corrupt`` or
            ``decode_timeout``.
    """
    if timeout_s is None:
        return _decode_guarded(data, max_pixels, max_bytes, min_side)
    return _decode_with_timeout(data, max_pixels, max_bytes, min_side, timeout_s)


_abandoned_lock = threading.Lock()
_abandoned = 0


def abandoned_decodes() -> int:
    """How many timed-out decode threads are still running (they finish on their own).

    A worker whose count keeps growing is being fed hostile files faster than they finish; the
    process-level guard (Celery's hard ``time_limit``, a worker restart) is what reclaims the CPU.
    """
    with _abandoned_lock:
        return _abandoned


def _decode_with_timeout(
    data: bytes, max_pixels: int, max_bytes: int, min_side: int | None, timeout_s: float
) -> DecodedImage:
    global _abandoned
    box: dict[str, object] = {}
    state = {"done": False, "abandoned": False}

    def run() -> None:
        global _abandoned
        try:
            box["result"] = _decode_guarded(data, max_pixels, max_bytes, min_side)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e
        finally:
            with _abandoned_lock:
                state["done"] = True
                if state["abandoned"]:
                    _abandoned -= 1

    # A daemon thread, not a pool: a decoder stuck in C must not block interpreter exit.
    thread = threading.Thread(target=run, name="decode_image", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with _abandoned_lock:
        if not state["done"]:
            state["abandoned"] = True
            _abandoned += 1
            raise ImageRejected(
                Reason.DECODE_TIMEOUT, f"decoding took longer than {timeout_s:g} s (left running in the background)"
            )
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def _decode_guarded(data: bytes, max_pixels: int, max_bytes: int, min_side: int | None) -> DecodedImage:
    """:func:`_decode`, with any stray decoder exception turned into ``corrupt``.

    Decoders signal bad input with a zoo of exception types (``struct.error``, ``IndexError``,
    ``cv2.error``, ...); callers are promised :class:`ImageRejected` only. An unexpected type is
    logged with its traceback so that a bug in this module stays visible.
    """
    try:
        return _decode(data, max_pixels, max_bytes, min_side)
    except ImageRejected:
        raise
    except MemoryError as e:
        raise ImageRejected(Reason.TOO_MANY_PIXELS, f"out of memory while decoding ({e})") from e
    except Exception as e:  # noqa: BLE001 - see docstring
        log.warning("unexpected %s while decoding; refusing the image as corrupt", type(e).__name__, exc_info=True)
        raise ImageRejected(Reason.CORRUPT, f"decoder error {type(e).__name__}: {e}") from e


def _decode(data: bytes, max_pixels: int, max_bytes: int, min_side: int | None) -> DecodedImage:
    if not isinstance(data, (bytes, bytearray)):
        data = bytes(data)
    if not data:
        raise ImageRejected(Reason.EMPTY, "the file has zero bytes")
    if len(data) > max_bytes:
        raise ImageRejected(Reason.TOO_LARGE, f"{len(data)} bytes > limit {max_bytes} bytes")
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageRejected(Reason.NOT_AN_IMAGE, "content matches no known image format")
    if fmt in _UNSUPPORTED:
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"{fmt}: recognised, but no installed decoder reads it")
    if fmt == "jpeg":
        return _decode_jpeg(data, max_pixels, min_side)
    if fmt == "png":
        return _decode_png(data, max_pixels)
    return _decode_pillow(data, fmt, max_pixels)


# --------------------------------------------------------------------------------------------------
# JPEG


def _decode_jpeg(data: bytes, max_pixels: int, min_side: int | None) -> DecodedImage:
    info = scan_jpeg(data)  # full structure check before any pixel work
    check_pixels(info.width, info.height, max_pixels)
    scale = jpeg_scale(info.width, info.height, min_side, info.sof in JPEG_LOSSLESS)
    expected = (-(-info.height // scale), -(-info.width // scale), 3)
    # One decode, straight to RGB. Three-component DCT JPEGs through simplejpeg (the same
    # libjpeg-turbo, the same pixels as OpenCV at the same scale, 1.1-1.4x faster: docs/decoding.md);
    # the rest (greyscale, CMYK/YCCK converted by OpenCV, Adobe-inverted like Pillow does; lossless)
    # through OpenCV.
    rgb = None
    if _simplejpeg is not None and info.components == 3 and info.sof not in JPEG_LOSSLESS:
        try:
            rgb = _simplejpeg.decode_jpeg(data, "rgb", min_height=expected[0], min_width=expected[1], strict=False)
        except ValueError:
            rgb = None  # what TurboJPEG refuses, OpenCV decides (and refuses with a reason)
    if rgb is None:
        try:
            rgb = cv2.imdecode(np.frombuffer(data, np.uint8), CV_RGB | CV_REDUCE[scale])
        except cv2.error as e:
            raise ImageRejected(Reason.CORRUPT, f"libjpeg could not decode this JPEG: {e}") from e
    if rgb is None:
        raise ImageRejected(Reason.CORRUPT, "libjpeg could not decode this JPEG")
    if rgb.shape != expected or rgb.dtype != np.uint8:
        raise ImageRejected(Reason.CORRUPT, f"decoded JPEG is {rgb.shape} {rgb.dtype}, header says {expected}")
    rgb = _orient(rgb, info.orientation)
    width, height = (info.height, info.width) if info.orientation >= 5 else (info.width, info.height)
    return DecodedImage(rgb=rgb, width=width, height=height, format="jpeg", scale=scale)


# --------------------------------------------------------------------------------------------------
# PNG


def _decode_png(data: bytes, max_pixels: int) -> DecodedImage:
    info = walk_png(data)
    check_pixels(info.width, info.height, max_pixels)
    if not _cv_fits(info.width, info.height):
        # A line-shaped PNG (1 × 2,000,000) within the pixel cap: libpng through Pillow has no
        # per-side limit. Pillow does not verify IDAT CRCs and reduces 16-bit RGB by v >> 8.
        return _decode_pillow(data, "png", max_pixels)
    # The common case (8-bit or less, opaque) decodes straight to RGB; alpha, tRNS and 16-bit need
    # the raw samples so that we composite and scale by our rules rather than libpng's defaults.
    plain = info.color_type in (0, 2, 3) and not info.trns and info.depth <= 8
    try:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), CV_RGB if plain else _CV_UNCHANGED)
    except cv2.error as e:
        raise ImageRejected(Reason.CORRUPT, f"libpng could not decode this PNG: {e}") from e
    if arr is None:
        raise ImageRejected(Reason.CORRUPT, "libpng refused this PNG (bad CRC or damaged image data)")
    if arr.shape[:2] != (info.height, info.width):
        raise ImageRejected(Reason.CORRUPT, f"decoded PNG is {arr.shape}, IHDR says {info.width}x{info.height}")
    if plain:
        rgb = arr
    elif arr.ndim == 2 and info.grey_key is not None:
        # libpng (as OpenCV drives it) ignores a grey tRNS key: apply it here. Samples below 8 bits
        # arrive scaled to 0..255 (1-bit 1 → 255, 4-bit 1 → 17), so scale the key the same way.
        key = info.grey_key if info.depth == 16 else info.grey_key * (255 // ((1 << info.depth) - 1))
        transparent = arr == key
        rgb = _cv_unchanged_to_rgb(arr)
        rgb[transparent] = ALPHA_BACKGROUND
    else:
        rgb = _cv_unchanged_to_rgb(arr)
    rgb = _orient(rgb, info.orientation)
    h, w = rgb.shape[:2]
    return DecodedImage(rgb=rgb, width=w, height=h, format="png")


def _cv_unchanged_to_rgb(arr: np.ndarray) -> np.ndarray:
    """OpenCV ``IMREAD_UNCHANGED`` result (grey / BGR / BGRA, uint8 or uint16) → ``(H, W, 3) uint8``."""
    if arr.dtype == np.uint16:
        arr = _u16_to_u8(arr)
    elif arr.dtype != np.uint8:
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"unexpected sample type {arr.dtype}")
    if arr.ndim == 2:
        return cv2.cvtColor(arr, cv2.COLOR_GRAY2RGB)
    if arr.shape[2] == 3:
        return cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    if arr.shape[2] == 4:
        return composite_on_background(cv2.cvtColor(arr, cv2.COLOR_BGRA2RGBA))
    raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"unexpected channel count {arr.shape[2]}")


# --------------------------------------------------------------------------------------------------
# Everything else: Pillow (+ pillow-heif), with OpenCV for the variants Pillow gets wrong


def _decode_pillow(data: bytes, fmt: str, max_pixels: int) -> DecodedImage:
    # Headers read here, before Pillow opens the file, because opening already allocates for these.
    if fmt == "webp":
        check_webp(data, max_pixels)
    elif fmt == "tiff":
        check_tiff(data, max_pixels)
    elif fmt in ("heif", "avif"):
        check_isobmff(data, fmt)
    elif fmt == "ico":
        check_pixels(*ico_largest(data), max_pixels)
    elif fmt == "bmp":
        bmp = bmp_header(data)
        if bmp is not None:
            width, height, compression = bmp
            if compression in (4, 5):
                kind = "JPEG" if compression == 4 else "PNG"
                raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"BMP with an embedded {kind} stream (BI_{kind})")
            check_pixels(width, height, max_pixels)
            if compression in (1, 2):
                # Pillow pads short or invalid RLE data silently; OpenCV refuses it.
                return _decode_opencv(data, fmt, width, height, orientation=1, what="RLE BMP")
    try:
        im = Image.open(io.BytesIO(data), formats=_PILLOW_FORMATS[fmt])
    except UnidentifiedImageError as e:
        if fmt == "tiff":
            return _decode_tiff_opencv(data, max_pixels, e)
        # HEIF/AVIF structure was checked above, so a refusal there means a codec or feature
        # libheif/libavif lack (JPEG- or VVC-coded HEIF, ...); elsewhere it means damage.
        reason = Reason.UNSUPPORTED_FORMAT if fmt in ("heif", "avif") else Reason.CORRUPT
        raise ImageRejected(reason, f"{fmt}: the decoder does not recognise this file ({e})") from e
    except Image.DecompressionBombError as e:
        raise ImageRejected(Reason.TOO_MANY_PIXELS, f"{fmt}: {e}") from e
    except _PILLOW_ERRORS as e:
        raise _pillow_error(fmt, e) from e
    with im:
        check_pixels(im.width, im.height, max_pixels)
        # ImageFile.load feeds the decoder 64 KB reads and re-joins what it has not consumed
        # (``b = b + s``); a row decoder consumes nothing until a whole row is there, so a 48 MB
        # row (a 16,000,000 × 1 BMP) cost 17 GB of copying and 30 s. The bytes are in memory
        # already: hand them over in one read.
        im.decodermaxblock = max(im.decodermaxblock, len(data))
        try:
            # The frame Pillow opens on is the picture: first frame of GIF/APNG/WebP/AVIF, first
            # TIFF page, the PSD composite, the largest ICO entry, the HEIF primary image.
            im.load()
            orientation = _pillow_orientation(im)
            rgb = _pillow_to_rgb(im)
        except ImageRejected:
            raise
        except Image.DecompressionBombError as e:
            raise ImageRejected(Reason.TOO_MANY_PIXELS, f"{fmt}: {e}") from e
        except _PILLOW_ERRORS as e:
            raise _pillow_error(fmt, e) from e
    rgb = _orient(rgb, orientation)
    h, w = rgb.shape[:2]
    return DecodedImage(rgb=rgb, width=w, height=h, format=fmt)


def _pillow_error(fmt: str, e: BaseException) -> ImageRejected:
    """Map a Pillow open/load exception to a reason (its messages are the only signal it gives)."""
    msg = str(e)
    low = msg.lower()
    if "truncated" in low or isinstance(e, EOFError) and "seek" not in low:
        return ImageRejected(Reason.TRUNCATED, f"{fmt}: {msg}")
    if "unsupported" in low or "not supported" in low or "not available" in low or "unknown" in low:
        return ImageRejected(Reason.UNSUPPORTED_FORMAT, f"{fmt}: {msg}")
    return ImageRejected(Reason.CORRUPT, f"{fmt}: {type(e).__name__}: {msg}")


def _pillow_orientation(im: Image.Image) -> int:
    """EXIF orientation Pillow exposes (WebP/TIFF EXIF, AVIF irot/imir), 1 if absent or unreadable.

    Metadata must never sink an image: a corrupt EXIF block counts as orientation 1. pillow-heif
    applies HEIF transforms itself and removes the tag, so HEIC comes back as 1 here.
    """
    try:
        value = im.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - any metadata error means "no orientation"
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _pillow_to_rgb(im: Image.Image) -> np.ndarray:
    """A loaded Pillow image of any mode → ``(H, W, 3) uint8`` by this module's rules."""
    mode = im.mode
    if mode.startswith("I;16"):
        arr = np.asarray(im)
        return cv2.cvtColor(_u16_to_u8(arr.astype(np.uint16, copy=False)), cv2.COLOR_GRAY2RGB)
    if mode == "I":
        arr = np.asarray(im)
        lo, hi = int(arr.min()), int(arr.max())
        # Pillow stores 16-bit PGM/PNG/TIFF samples (PGM rescaled from maxval) as mode I.
        grey = _u16_to_u8(arr.astype(np.uint16)) if lo >= 0 and hi <= 65535 else _stretch(arr.astype(np.float64))
        return cv2.cvtColor(grey, cv2.COLOR_GRAY2RGB)
    if mode == "F":
        return cv2.cvtColor(_float_to_u8(np.asarray(im)), cv2.COLOR_GRAY2RGB)
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        return composite_on_background(np.asarray(im.convert("RGBA")))
    if mode == "RGB":
        return np.ascontiguousarray(np.asarray(im))
    if mode == "LAB":
        from PIL import ImageCms

        transform = ImageCms.buildTransform(ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"), "LAB", "RGB")
        return np.asarray(ImageCms.applyTransform(im, transform))
    # 1, L, P, CMYK (naive conversion, as for JPEG), YCbCr, HSV, RGBX.
    return np.asarray(im.convert("RGB"))


def _decode_tiff_opencv(data: bytes, max_pixels: int, cause: Exception) -> DecodedImage:
    """TIFF variants Pillow cannot identify (CIELab, ...) through OpenCV's libtiff."""
    tags = tiff_tags(data, {TIFF_WIDTH, TIFF_HEIGHT, EXIF_ORIENTATION})
    if TIFF_WIDTH not in tags or TIFF_HEIGHT not in tags:
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"tiff: no decoder reads this file ({cause})") from cause
    width, height = tags[TIFF_WIDTH], tags[TIFF_HEIGHT]
    check_pixels(width, height, max_pixels)
    orientation = tags.get(EXIF_ORIENTATION, 1)
    try:
        return _decode_opencv(data, "tiff", width, height, orientation if 1 <= orientation <= 8 else 1, "TIFF")
    except ImageRejected as e:
        # The structure passed check_tiff, so neither Pillow nor OpenCV knowing it means a TIFF
        # variant (compression, photometric) that no decoder here implements.
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"tiff: neither Pillow ({cause}) nor OpenCV reads it") from e


def _decode_opencv(data: bytes, fmt: str, width: int, height: int, orientation: int, what: str) -> DecodedImage:
    """Decode with OpenCV to RGB; the caller has already checked ``width × height``."""
    if not _cv_fits(width, height):
        raise ImageRejected(
            Reason.UNSUPPORTED_FORMAT, f"{what}: {width}x{height} has a side longer than OpenCV decodes ({_CV_MAX_SIDE})"
        )
    try:
        rgb = cv2.imdecode(np.frombuffer(data, np.uint8), CV_RGB)
    except cv2.error as e:
        raise ImageRejected(Reason.CORRUPT, f"{what}: OpenCV could not decode it: {e}") from e
    if rgb is None:
        raise ImageRejected(Reason.CORRUPT, f"{what}: OpenCV could not decode it (damaged or unsupported data)")
    if rgb.shape[:2] != (height, width):
        raise ImageRejected(Reason.CORRUPT, f"{what}: decoded {rgb.shape}, header says {width}x{height}")
    rgb = _orient(rgb, orientation)
    h, w = rgb.shape[:2]
    return DecodedImage(rgb=rgb, width=w, height=h, format=fmt)


# --------------------------------------------------------------------------------------------------
# Pixel rules


def _orient(rgb: np.ndarray, orientation: int) -> np.ndarray:
    """Apply EXIF ``orientation`` (1-8) to ``(H, W, C)`` pixels; result C-contiguous.

    Same transforms as ``PIL.ImageOps.exif_transpose``: 2 mirror, 3 rotate 180, 4 flip, 5
    transpose, 6 rotate 90° clockwise, 7 transverse, 8 rotate 90° anticlockwise.
    """
    if orientation == 2:
        rgb = cv2.flip(rgb, 1)
    elif orientation == 3:
        rgb = cv2.rotate(rgb, cv2.ROTATE_180)
    elif orientation == 4:
        rgb = cv2.flip(rgb, 0)
    elif orientation == 5:
        rgb = cv2.transpose(rgb)
    elif orientation == 6:
        rgb = cv2.rotate(rgb, cv2.ROTATE_90_CLOCKWISE)
    elif orientation == 7:
        rgb = cv2.flip(cv2.transpose(rgb), -1)
    elif orientation == 8:
        rgb = cv2.rotate(rgb, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return np.ascontiguousarray(rgb)


def composite_on_background(rgba: np.ndarray) -> np.ndarray:
    """Composite ``(H, W, 4) uint8`` RGBA on :data:`ALPHA_BACKGROUND` → ``(H, W, 3) uint8`` RGB.

    ``out = (c·a + bg·(255 − a) + 127) // 255`` per channel, in 8-bit sRGB values (what browsers
    do). Fully transparent pixels become exactly the background; opaque ones keep their colour.
    The arithmetic fits uint16 (at most 255·255 + 127).
    """
    alpha = rgba[..., 3]
    if alpha.min() == 255:  # opaque RGBA (common for "RGBA" photos): nothing to blend
        return np.ascontiguousarray(rgba[..., :3])
    a = alpha.astype(np.uint16)
    out = rgba[..., :3].astype(np.uint16)
    out *= a[..., None]
    a = 255 - a  # now the background's weight; reused to keep temporaries small
    for channel, value in enumerate(ALPHA_BACKGROUND):
        out[..., channel] += a * np.uint16(value)
    out += 127
    out //= 255
    return out.astype(np.uint8)


def _u16_to_u8(arr: np.ndarray) -> np.ndarray:
    """uint16 samples → uint8 by ``round(v / 257)``: 0 → 0, 65535 → 255, linear, never clipped."""
    return cv2.convertScaleAbs(arr, alpha=1.0 / 257.0)


def _float_to_u8(arr: np.ndarray) -> np.ndarray:
    """Float samples (no declared range) → uint8.

    Rule: non-finite values count as 0; if every value is in [0, 1] → ``v × 255``; else if in
    [0, 255] → ``v``; else a linear stretch of min..max to 0..255. Rounded, never clipped.
    """
    arr = np.asarray(arr, dtype=np.float64)
    arr = np.where(np.isfinite(arr), arr, 0.0)
    lo, hi = float(arr.min()), float(arr.max())
    if lo >= 0.0 and hi <= 1.0:
        return np.rint(arr * 255.0).astype(np.uint8)
    if lo >= 0.0 and hi <= 255.0:
        return np.rint(arr).astype(np.uint8)
    return _stretch(arr)


def _stretch(arr: np.ndarray) -> np.ndarray:
    """Linear map of ``arr``'s min..max onto 0..255 (uint8); a constant image becomes 0."""
    lo, hi = float(arr.min()), float(arr.max())
    if hi <= lo:
        return np.zeros(arr.shape, np.uint8)
    return np.rint((arr - lo) * (255.0 / (hi - lo))).astype(np.uint8)
