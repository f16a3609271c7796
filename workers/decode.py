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
* **JPEG** goes through OpenCV (libjpeg-turbo): one decode, straight to RGB, optionally at 1/2, 1/4
  or 1/8 size through the decoder's DCT scaling. Before decoding, a marker scan (C-speed regex over
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

No Django, Celery or torch here: this module is a plain library.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import re
import struct
import threading

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from workers.errors import ImageRejected, Reason

try:  # HEIC/HEIF decoding through libheif; without it such files are ``unsupported_format``.
    import pillow_heif

    pillow_heif.register_heif_opener()
    _HAVE_HEIF = True
except ImportError:  # pragma: no cover - pillow-heif is a pinned runtime dependency
    _HAVE_HEIF = False

log = logging.getLogger(__name__)

#: Background for transparent pixels (RGB, uint8). Documented rule; never change silently: it is
#: baked into every stored embedding of an image with transparency.
ALPHA_BACKGROUND: tuple[int, int, int] = (255, 255, 255)

#: A JPEG with more scans than this is refused (``corrupt``). Real progressive files have about 10;
#: thousands of tiny scans make libjpeg spend O(scans × pixels) time (libjpeg-turbo advises 500).
MAX_JPEG_SCANS = 500

#: Structural walks are bounded too (a file of millions of empty segments or chunks would keep a
#: Python loop busy for seconds). Real files stay far below these.
MAX_JPEG_SEGMENTS = 10_000
MAX_PNG_CHUNKS = 200_000
MAX_ISOBMFF_BOXES = 10_000

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"II+\x00", "tiff"),  # BigTIFF
    (b"MM\x00+", "tiff"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "jpeg2000"),
    (b"\xff\x4f\xff\x51", "jpeg2000"),  # bare J2K codestream
    (b"qoif", "qoi"),
    (b"8BPS", "psd"),
    (b"\x59\xa6\x6a\x95", "sunraster"),
    # Recognised image formats that nothing here decodes: refused as ``unsupported_format``.
    (b"\xff\x0a", "jxl"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "jxl"),
    (b"\x76\x2f\x31\x01", "exr"),
    (b"#?RADIANCE", "hdr"),
    (b"#?RGBE", "hdr"),
    (b"DDS ", "dds"),
    (b"%!PS", "eps"),
    (b"\xc5\xd0\xd3\xc6", "eps"),
)

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
}

#: What Pillow plugins (and pillow-heif, libavif) raise for bad input.
_PILLOW_ERRORS = (
    OSError, ValueError, SyntaxError, EOFError, RuntimeError, struct.error, IndexError, TypeError, KeyError,
    ZeroDivisionError, OverflowError,
)

_HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"mif2"})
_AVIF_BRANDS = frozenset({b"avif", b"avis"})

_EXIF_ORIENTATION = 0x0112
_TIFF_WIDTH, _TIFF_HEIGHT = 256, 257

# cv2 flag bits: colour output in RGB order, no EXIF rotation (we apply it), DCT reduction.
_CV_RGB = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
_CV_UNCHANGED = cv2.IMREAD_UNCHANGED  # UNCHANGED never rotates
_CV_REDUCE = {1: 0, 2: cv2.IMREAD_REDUCED_COLOR_2 & ~cv2.IMREAD_COLOR,
              4: cv2.IMREAD_REDUCED_COLOR_4 & ~cv2.IMREAD_COLOR, 8: cv2.IMREAD_REDUCED_COLOR_8 & ~cv2.IMREAD_COLOR}

# A JPEG marker: 0xFF followed by anything but a stuffed 0x00, a restart marker (RST0-7, part of a
# scan) or another 0xFF (fill byte: the match then starts at the last 0xFF). No "\xff+": that would
# backtrack quadratically over long 0xFF runs.
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
# Netpbm: "P1".."P6" or "Pf"/"PF" (float), whitespace (comments allowed), then the width digits.
_PNM_HEADER = re.compile(rb"P[1-6fF]\s+(?:#[^\n]*\n\s*)*\d")
# SOF markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_LOSSLESS = frozenset({0xC3, 0xC7, 0xCB, 0xCF})  # no DCT, hence no DCT scaling
_JPEG_HIERARCHICAL = frozenset({0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF})  # libjpeg does not do these

# PNG IHDR: allowed bit depths per colour type (PNG spec, table 11.1).
_PNG_DEPTHS = {0: {1, 2, 4, 8, 16}, 2: {8, 16}, 3: {1, 2, 4, 8}, 4: {8, 16}, 6: {8, 16}}


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
# Sniffing


def sniff_format(data: bytes) -> str | None:
    """The image format named by the leading bytes of ``data``, or ``None`` if none matches.

    Args:
        data: the encoded file (only the first few KB are looked at).

    Returns:
        ``"jpeg"``, ``"png"``, ``"gif"``, ``"webp"``, ``"bmp"``, ``"tiff"``, ``"jpeg2000"``,
        ``"avif"``, ``"heif"``, ``"qoi"``, ``"psd"``, ``"ico"``, ``"sunraster"``, ``"pnm"``, or a
        recognised but undecodable format (``"jxl"``, ``"exr"``, ``"hdr"``, ``"dds"``, ``"eps"``,
        ``"svg"``); ``None`` for anything else.
    """
    head = bytes(data[:4096])
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[4:8] == b"ftyp":
        box = int.from_bytes(head[:4], "big")
        brands = {head[8:12]} | {head[i : i + 4] for i in range(16, min(box, len(head)) - 3, 4)}
        if brands & _AVIF_BRANDS:
            return "avif"
        if brands & _HEIF_BRANDS:
            return "heif"
        return None
    # Two-letter magics are weak; require what must follow them so text files are not "images".
    if head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in (12, 40, 52, 56, 64, 108, 124):
        return "bmp"
    if head[:4] == b"\x00\x00\x01\x00" and len(head) >= 6 and int.from_bytes(head[4:6], "little") > 0:
        return "ico"
    if _PNM_HEADER.match(head):
        return "pnm"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if (text.startswith(b"<svg") or text.startswith(b"<?xml")) and b"<svg" in head:
        return "svg"
    return None


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


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageRejected(Reason.CORRUPT, f"header declares an empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageRejected(
            Reason.TOO_MANY_PIXELS, f"{width}x{height} = {width * height} pixels > limit {max_pixels}"
        )


# --------------------------------------------------------------------------------------------------
# JPEG


@dataclasses.dataclass
class _JpegInfo:
    width: int = 0
    height: int = 0
    precision: int = 0
    sof: int = 0
    components: int = 0
    orientation: int = 1
    scans: int = 0


def _scan_jpeg(data: bytes) -> _JpegInfo:
    """Walk the JPEG marker structure up to the first EOI (the primary image of MPO/Ultra HDR).

    Tolerates what libjpeg tolerates (junk bytes between segments, fill bytes, trailing data after
    EOI). Only the first EXIF APP1 is read, for its orientation.

    Raises:
        ImageRejected: ``truncated`` (the file ends before EOI), ``corrupt`` (impossible structure,
            too many scans), ``unsupported_format`` (12/16-bit, hierarchical, DNL height).
    """
    n = len(data)
    info = _JpegInfo()
    exif_seen = False
    pos = 2  # after SOI
    for _ in range(MAX_JPEG_SEGMENTS):
        # The next marker. Like libjpeg, skip junk between segments; inside a scan, the regex steps
        # over entropy-coded data (stuffed 0xFF00, RSTn) at C speed.
        found = _JPEG_MARKER.search(data, pos)
        if found is None:
            raise ImageRejected(Reason.TRUNCATED, "JPEG ends before its end-of-image marker")
        marker = data[found.start() + 1]
        pos = found.start() + 2
        if marker == 0x01:
            continue  # TEM: a standalone marker without a length
        if marker == 0xD9:  # EOI
            if info.scans == 0:
                raise ImageRejected(Reason.CORRUPT, "JPEG ends (EOI) before any image data")
            return info
        if marker == 0xD8:
            raise ImageRejected(Reason.CORRUPT, "JPEG has a second start-of-image marker before its end")
        if pos + 2 > n:
            raise ImageRejected(Reason.TRUNCATED, f"JPEG ends inside the 0xFF{marker:02X} segment header")
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2:
            raise ImageRejected(Reason.CORRUPT, f"JPEG segment 0xFF{marker:02X} has impossible length {length}")
        end = pos + length
        if end > n:
            raise ImageRejected(
                Reason.TRUNCATED, f"JPEG ends inside the 0xFF{marker:02X} segment ({length} bytes declared)"
            )
        if marker in _JPEG_SOF:
            if info.sof:
                raise ImageRejected(Reason.CORRUPT, "JPEG has two frame (SOF) headers")
            if length < 8:
                raise ImageRejected(Reason.CORRUPT, "JPEG frame header too short")
            info.sof = marker
            info.precision = data[pos + 2]
            info.height = (data[pos + 3] << 8) | data[pos + 4]
            info.width = (data[pos + 5] << 8) | data[pos + 6]
            info.components = data[pos + 7]
            _check_jpeg_frame(info)
        elif marker == 0xE1 and not exif_seen and data[pos + 2 : pos + 8] == b"Exif\x00\x00":
            exif_seen = True
            info.orientation = _orientation_from_tiff(data[pos + 8 : end])
        elif marker == 0xDA:  # SOS: entropy-coded data follows, up to the next marker
            if not info.sof:
                raise ImageRejected(Reason.CORRUPT, "JPEG scan before its frame header")
            info.scans += 1
            if info.scans > MAX_JPEG_SCANS:
                raise ImageRejected(Reason.CORRUPT, f"JPEG has more than {MAX_JPEG_SCANS} scans")
        pos = end
    raise ImageRejected(Reason.CORRUPT, f"JPEG has more than {MAX_JPEG_SEGMENTS} segments")


def _check_jpeg_frame(info: _JpegInfo) -> None:
    name = f"SOF{info.sof - 0xC0}"
    if info.precision != 8:
        raise ImageRejected(
            Reason.UNSUPPORTED_FORMAT, f"{info.precision}-bit JPEG ({name}); only 8-bit samples are decoded"
        )
    if info.sof in _JPEG_HIERARCHICAL:
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"hierarchical JPEG ({name}) is not supported by libjpeg")
    if info.height == 0:
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, "JPEG height defined by a DNL marker is not supported")
    if info.width == 0 or info.components not in (1, 3, 4):
        raise ImageRejected(
            Reason.CORRUPT, f"JPEG frame header: width {info.width}, {info.components} components"
        )


def _jpeg_scale(width: int, height: int, min_side: int | None, lossless: bool) -> int:
    """Largest DCT reduction (1, 2, 4, 8) keeping the reduced shorter side >= ``min_side``."""
    scale = 1
    if min_side and not lossless:
        for s in (2, 4, 8):
            # libjpeg's scaled size is ceil(dim / s) (jdiv_round_up).
            if min(-(-width // s), -(-height // s)) >= min_side:
                scale = s
    return scale


def _decode_jpeg(data: bytes, max_pixels: int, min_side: int | None) -> DecodedImage:
    info = _scan_jpeg(data)  # full structure check before any pixel work
    _check_pixels(info.width, info.height, max_pixels)
    scale = _jpeg_scale(info.width, info.height, min_side, info.sof in _JPEG_LOSSLESS)
    # One decode, straight to RGB (CMYK/YCCK converted by OpenCV, Adobe-inverted like Pillow does).
    try:
        rgb = cv2.imdecode(np.frombuffer(data, np.uint8), _CV_RGB | _CV_REDUCE[scale])
    except cv2.error as e:
        raise ImageRejected(Reason.CORRUPT, f"libjpeg could not decode this JPEG: {e}") from e
    if rgb is None:
        raise ImageRejected(Reason.CORRUPT, "libjpeg could not decode this JPEG")
    expected = (-(-info.height // scale), -(-info.width // scale), 3)
    if rgb.shape != expected or rgb.dtype != np.uint8:
        raise ImageRejected(Reason.CORRUPT, f"decoded JPEG is {rgb.shape} {rgb.dtype}, header says {expected}")
    rgb = _orient(rgb, info.orientation)
    width, height = (info.height, info.width) if info.orientation >= 5 else (info.width, info.height)
    return DecodedImage(rgb=rgb, width=width, height=height, format="jpeg", scale=scale)


# --------------------------------------------------------------------------------------------------
# PNG


@dataclasses.dataclass
class _PngInfo:
    width: int = 0
    height: int = 0
    depth: int = 0
    color_type: int = 0
    trns: bool = False
    grey_key: int | None = None  # tRNS transparent grey value (colour type 0), at the IHDR bit depth
    orientation: int = 1


def _walk_png(data: bytes) -> _PngInfo:
    """Walk the PNG chunk list to IEND: IHDR fields, ``tRNS`` presence, ``eXIf`` orientation.

    CRCs are left to libpng (it checks every chunk). Trailing bytes after IEND are ignored.

    Raises:
        ImageRejected: ``truncated`` (ends before IEND), ``corrupt`` (bad IHDR, garbage chunk
            header, no IDAT), ``unsupported_format`` (Apple CgBI PNG).
    """
    n = len(data)
    pos = 8
    info: _PngInfo | None = None
    idat = False
    for _ in range(MAX_PNG_CHUNKS):
        if pos + 8 > n:
            raise ImageRejected(Reason.TRUNCATED, "PNG ends before its IEND chunk")
        length = int.from_bytes(data[pos : pos + 4], "big")
        ctype = data[pos + 4 : pos + 8]
        if not ctype.isalpha() or length > 0x7FFFFFFF:
            raise ImageRejected(Reason.CORRUPT, f"PNG chunk header at byte {pos} is garbage ({bytes(ctype)!r})")
        end = pos + 12 + length
        if end > n:
            raise ImageRejected(Reason.TRUNCATED, f"PNG ends inside its {ctype.decode()} chunk")
        body = pos + 8
        if info is None:
            if ctype == b"CgBI":
                raise ImageRejected(Reason.UNSUPPORTED_FORMAT, "Apple CgBI PNG (iOS-optimised, not standard PNG)")
            if ctype != b"IHDR" or length != 13:
                raise ImageRejected(Reason.CORRUPT, "PNG does not start with a valid IHDR chunk")
            width, height, depth, color_type, comp, filt, interlace = struct.unpack_from(">IIBBBBB", data, body)
            if depth not in _PNG_DEPTHS.get(color_type, ()) or comp or filt or interlace > 1:
                raise ImageRejected(
                    Reason.CORRUPT, f"PNG IHDR: invalid colour type {color_type} / bit depth {depth} combination"
                )
            if width == 0 or height == 0 or width > 0x7FFFFFFF or height > 0x7FFFFFFF:
                raise ImageRejected(Reason.CORRUPT, f"PNG IHDR: invalid size {width}x{height}")
            info = _PngInfo(width=width, height=height, depth=depth, color_type=color_type)
        elif ctype == b"IDAT":
            idat = True
        elif ctype == b"tRNS":
            info.trns = True
            if info.color_type == 0 and length >= 2:
                info.grey_key = int.from_bytes(data[body : body + 2], "big")
        elif ctype == b"eXIf":
            info.orientation = _orientation_from_tiff(data[body : body + length])
        elif ctype == b"IEND":
            break
        pos = end
    else:
        raise ImageRejected(Reason.CORRUPT, f"PNG has more than {MAX_PNG_CHUNKS} chunks")
    if not idat:
        raise ImageRejected(Reason.CORRUPT, "PNG has no image data (IDAT)")
    return info


def _decode_png(data: bytes, max_pixels: int) -> DecodedImage:
    info = _walk_png(data)
    _check_pixels(info.width, info.height, max_pixels)
    # The common case (8-bit or less, opaque) decodes straight to RGB; alpha, tRNS and 16-bit need
    # the raw samples so that we composite and scale by our rules rather than libpng's defaults.
    plain = info.color_type in (0, 2, 3) and not info.trns and info.depth <= 8
    try:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), _CV_RGB if plain else _CV_UNCHANGED)
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
    if fmt == "heif" and not _HAVE_HEIF:  # pragma: no cover - pillow-heif is pinned
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, "HEIF: pillow-heif is not installed")
    # Headers read here, before Pillow opens the file, because opening already allocates for these.
    if fmt == "webp":
        if len(data) < 8 + int.from_bytes(data[4:8], "little"):
            raise ImageRejected(Reason.TRUNCATED, "WebP ends before the size its RIFF header declares")
        size = _webp_size(data)
        if size is None:
            raise ImageRejected(Reason.CORRUPT, "WebP header is damaged")
        _check_pixels(*size, max_pixels)
    elif fmt == "tiff":
        _check_tiff(data, max_pixels)
    elif fmt in ("heif", "avif"):
        _check_isobmff(data, fmt)
    elif fmt == "ico":
        _check_pixels(*_ico_largest(data), max_pixels)
    elif fmt == "bmp":
        bmp = _bmp_header(data)
        if bmp is not None:
            width, height, compression = bmp
            if compression in (4, 5):
                kind = "JPEG" if compression == 4 else "PNG"
                raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"BMP with an embedded {kind} stream (BI_{kind})")
            _check_pixels(width, height, max_pixels)
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
        _check_pixels(im.width, im.height, max_pixels)
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
        value = im.getexif().get(_EXIF_ORIENTATION, 1)
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
    tags = _tiff_tags(data, {_TIFF_WIDTH, _TIFF_HEIGHT, _EXIF_ORIENTATION})
    if _TIFF_WIDTH not in tags or _TIFF_HEIGHT not in tags:
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"tiff: no decoder reads this file ({cause})") from cause
    width, height = tags[_TIFF_WIDTH], tags[_TIFF_HEIGHT]
    _check_pixels(width, height, max_pixels)
    orientation = tags.get(_EXIF_ORIENTATION, 1)
    try:
        return _decode_opencv(data, "tiff", width, height, orientation if 1 <= orientation <= 8 else 1, "TIFF")
    except ImageRejected as e:
        # The structure passed _check_tiff, so neither Pillow nor OpenCV knowing it means a TIFF
        # variant (compression, photometric) that no decoder here implements.
        raise ImageRejected(Reason.UNSUPPORTED_FORMAT, f"tiff: neither Pillow ({cause}) nor OpenCV reads it") from e


def _decode_opencv(data: bytes, fmt: str, width: int, height: int, orientation: int, what: str) -> DecodedImage:
    """Decode with OpenCV to RGB; the caller has already checked ``width × height``."""
    try:
        rgb = cv2.imdecode(np.frombuffer(data, np.uint8), _CV_RGB)
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
# Header readers for the formats whose decoders allocate on open


def _webp_size(data: bytes) -> tuple[int, int] | None:
    """Canvas width and height from a WebP's first chunk (VP8X, VP8 or VP8L), or ``None``."""
    if len(data) < 30:
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    return None


def _ico_largest(data: bytes) -> tuple[int, int]:
    """Width and height of the largest ICO entry, embedded PNGs measured from their own IHDR."""
    count = int.from_bytes(data[4:6], "little")
    best = (0, 0)
    for i in range(count):
        entry = 6 + 16 * i
        if entry + 16 > len(data):
            raise ImageRejected(Reason.TRUNCATED, "ICO ends inside its directory")
        w, h = data[entry] or 256, data[entry + 1] or 256
        length = int.from_bytes(data[entry + 8 : entry + 12], "little")
        offset = int.from_bytes(data[entry + 12 : entry + 16], "little")
        if offset + length > len(data):
            raise ImageRejected(Reason.TRUNCATED, "ICO ends before the image its directory points to")
        if data[offset : offset + 8] == b"\x89PNG\r\n\x1a\n" and data[offset + 12 : offset + 16] == b"IHDR":
            w, h = struct.unpack_from(">II", data, offset + 16)
        if w * h > best[0] * best[1]:
            best = (w, h)
    return best


def _bmp_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, |height|, compression) of a Windows BMP (INFOHEADER or later), ``None`` for OS/2."""
    if len(data) < 34 or int.from_bytes(data[14:18], "little") < 40:
        return None
    width, height = struct.unpack_from("<ii", data, 18)
    compression = int.from_bytes(data[30:34], "little")
    return abs(width), abs(height), compression


_TIFF_TYPES = {1: "B", 3: "H", 4: "I"}  # BYTE, SHORT, LONG: the ones we read values of
_TIFF_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}


def _tiff_ifd0(buf: bytes, wanted: set[int]) -> tuple[dict[int, tuple[int, ...]], bool] | None:
    """Values of the ``wanted`` BYTE/SHORT/LONG tags in IFD0 of a classic TIFF structure.

    Used for TIFF files and for EXIF blocks (which are TIFF structures). Never raises.

    Returns:
        ``(tags, complete)``: tag → values (a tag whose values lie beyond the end of ``buf`` is
        left out), and whether IFD0 and every value it points to lie inside ``buf``. ``None`` if
        ``buf`` is not a classic TIFF structure or IFD0 starts beyond its end (BigTIFF: ``None``).
    """
    if len(buf) < 8 or buf[:4] not in (b"II*\x00", b"MM\x00*"):
        return None
    e = "<" if buf[:2] == b"II" else ">"
    (offset,) = struct.unpack_from(e + "I", buf, 4)
    if offset + 2 > len(buf):
        return None
    (count,) = struct.unpack_from(e + "H", buf, offset)
    tags: dict[int, tuple[int, ...]] = {}
    complete = offset + 2 + 12 * count <= len(buf)
    for i in range(count):
        p = offset + 2 + 12 * i
        if p + 12 > len(buf):
            break
        tag, typ, n = struct.unpack_from(e + "HHI", buf, p)
        size = _TIFF_TYPE_SIZES.get(typ, 1) * n
        where = p + 8 if size <= 4 else struct.unpack_from(e + "I", buf, p + 8)[0]
        if where + size > len(buf):
            complete = False
            continue
        if tag in wanted and typ in _TIFF_TYPES and n >= 1:
            tags[tag] = struct.unpack_from(f"{e}{n}{_TIFF_TYPES[typ]}", buf, where)
    return tags, complete


def _tiff_tags(buf: bytes, wanted: set[int]) -> dict[int, int]:
    """First value of each ``wanted`` tag in IFD0 (see :func:`_tiff_ifd0`); ``{}`` if unreadable."""
    parsed = _tiff_ifd0(buf, wanted)
    return {tag: values[0] for tag, values in parsed[0].items()} if parsed else {}


_TIFF_EXTENTS = ((273, 279), (324, 325), (513, 514))  # strips, tiles, old-style JPEG stream


def _check_tiff(data: bytes, max_pixels: int) -> None:
    """Before Pillow: IFD0 present, size within ``max_pixels``, pixel data within the file.

    libtiff decodes what it can of a short file and Pillow returns it (old-style JPEG TIFFs come
    back partly grey), so a strip, tile or JPEG stream that ends past the end of the file means
    ``truncated``. BigTIFF is left to Pillow.
    """
    if data[2:4] in (b"+\x00", b"\x00+"):
        return
    wanted = {_TIFF_WIDTH, _TIFF_HEIGHT} | {t for pair in _TIFF_EXTENTS for t in pair}
    parsed = _tiff_ifd0(data, wanted)
    if parsed is None:
        raise ImageRejected(Reason.TRUNCATED, "TIFF ends before its first image directory")
    tags, complete = parsed
    if not complete:
        raise ImageRejected(Reason.TRUNCATED, "TIFF ends inside its first image directory or the values it points to")
    if _TIFF_WIDTH in tags and _TIFF_HEIGHT in tags:
        _check_pixels(tags[_TIFF_WIDTH][0], tags[_TIFF_HEIGHT][0], max_pixels)
    for offsets_tag, counts_tag in _TIFF_EXTENTS:
        offsets, counts = tags.get(offsets_tag), tags.get(counts_tag)
        if offsets is None:
            continue
        # Without byte counts (allowed for the old-style JPEG stream) only the start can be checked.
        ends = [o + c for o, c in zip(offsets, counts)] if counts else [o + 1 for o in offsets]
        if max(ends) > len(data):
            raise ImageRejected(Reason.TRUNCATED, "TIFF image data runs past the end of the file")


def _check_isobmff(data: bytes, fmt: str) -> None:
    """Top-level HEIF/AVIF boxes must be well formed and end inside the file."""
    n, pos = len(data), 0
    for _ in range(MAX_ISOBMFF_BOXES):
        if pos >= n:
            return
        if pos + 8 > n:
            raise ImageRejected(Reason.TRUNCATED, f"{fmt}: file ends inside a box header")
        size = int.from_bytes(data[pos : pos + 4], "big")
        header = 8
        if size == 1:
            if pos + 16 > n:
                raise ImageRejected(Reason.TRUNCATED, f"{fmt}: file ends inside a box header")
            size, header = int.from_bytes(data[pos + 8 : pos + 16], "big"), 16
        elif size == 0:
            size = n - pos  # "to the end of the file"
        if size < header:
            raise ImageRejected(Reason.CORRUPT, f"{fmt}: box at byte {pos} has impossible size {size}")
        if pos + size > n:
            raise ImageRejected(Reason.TRUNCATED, f"{fmt}: {data[pos + 4 : pos + 8]!r} box runs past the end of the file")
        pos += size
    raise ImageRejected(Reason.CORRUPT, f"{fmt}: more than {MAX_ISOBMFF_BOXES} top-level boxes")


def _orientation_from_tiff(buf: bytes) -> int:
    """EXIF orientation (1-8) from a TIFF-structured EXIF block; 1 if absent, invalid or damaged."""
    value = _tiff_tags(bytes(buf), {_EXIF_ORIENTATION}).get(_EXIF_ORIENTATION, 1)
    return value if 1 <= value <= 8 else 1


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
