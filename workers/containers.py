"""Container structure without decoding pixels: format sniffing, header sizes, truncation checks, orientation tags."""
from __future__ import annotations

import dataclasses
import re
import struct

from workers.errors import ImageRejected, Reason

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

_HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"mif2"})
_AVIF_BRANDS = frozenset({b"avif", b"avis"})

#: TIFF/EXIF tag numbers: Orientation (values 1-8), ImageWidth and ImageLength (pixels).
EXIF_ORIENTATION = 0x0112
TIFF_WIDTH, TIFF_HEIGHT = 256, 257

# A JPEG marker: 0xFF followed by anything but a stuffed 0x00, a restart marker (RST0-7, part of a
# scan) or another 0xFF (fill byte: the match then starts at the last 0xFF). No "\xff+": that would
# backtrack quadratically over long 0xFF runs.
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
# Netpbm: "P1".."P6" or "Pf"/"PF" (float), whitespace (comments allowed), then the width digits.
_PNM_HEADER = re.compile(rb"P[1-6fF]\s+(?:#[^\n]*\n\s*)*\d")
# SOF markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: Lossless SOF markers (``JpegInfo.sof`` values): no DCT, hence no DCT scaling.
JPEG_LOSSLESS = frozenset({0xC3, 0xC7, 0xCB, 0xCF})
_JPEG_HIERARCHICAL = frozenset({0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF})  # libjpeg does not do these

# PNG IHDR: allowed bit depths per colour type (PNG spec, table 11.1).
_PNG_DEPTHS = {0: {1, 2, 4, 8, 16}, 2: {8, 16}, 3: {1, 2, 4, 8}, 4: {8, 16}, 6: {8, 16}}


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


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """Refuse a header-declared size that is empty or above the pixel limit.

    Args:
        width: declared width (pixels).
        height: declared height (pixels).
        max_pixels: largest allowed ``width × height`` (pixels, inclusive).

    Raises:
        ImageRejected: ``corrupt`` if a side is 0 or negative, ``too_many_pixels`` if
            ``width × height > max_pixels``.
    """
    if width <= 0 or height <= 0:
        raise ImageRejected(Reason.CORRUPT, f"header declares an empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageRejected(
            Reason.TOO_MANY_PIXELS, f"{width}x{height} = {width * height} pixels > limit {max_pixels}"
        )


# --------------------------------------------------------------------------------------------------
# JPEG


@dataclasses.dataclass
class JpegInfo:
    """What :func:`scan_jpeg` read from a JPEG's structure.

    Attributes:
        width: frame width (pixels), as stored (before orientation).
        height: frame height (pixels), as stored (before orientation).
        precision: sample precision (bits; always 8 once :func:`scan_jpeg` returns).
        sof: the frame's SOF marker byte (``0xC0``..``0xCF``), e.g. ``0xC2`` progressive; see
            :data:`JPEG_LOSSLESS`.
        components: colour components (1, 3 or 4).
        orientation: EXIF orientation 1-8 from the first EXIF APP1 segment; 1 if absent or damaged.
        scans: number of scans (SOS segments) before EOI.
    """

    width: int = 0
    height: int = 0
    precision: int = 0
    sof: int = 0
    components: int = 0
    orientation: int = 1
    scans: int = 0


def scan_jpeg(data: bytes) -> JpegInfo:
    """Walk the JPEG marker structure up to the first EOI (the primary image of MPO/Ultra HDR).

    Tolerates what libjpeg tolerates (junk bytes between segments, fill bytes, trailing data after
    EOI). Only the first EXIF APP1 is read, for its orientation. Bounded by
    :data:`MAX_JPEG_SEGMENTS` and :data:`MAX_JPEG_SCANS`.

    Args:
        data: the whole file, starting with SOI (``FF D8``).

    Returns:
        :class:`JpegInfo` of the frame, with at least one scan.

    Raises:
        ImageRejected: ``truncated`` (the file ends before EOI), ``corrupt`` (impossible structure,
            too many scans), ``unsupported_format`` (12/16-bit, hierarchical, DNL height).
    """
    n = len(data)
    info = JpegInfo()
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


def _check_jpeg_frame(info: JpegInfo) -> None:
    """Refuse SOF headers libjpeg (8-bit) cannot decode: ``unsupported_format`` or ``corrupt``."""
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


def jpeg_scale(width: int, height: int, min_side: int | None, lossless: bool) -> int:
    """Largest DCT reduction (1, 2, 4, 8) keeping the reduced shorter side >= ``min_side``.

    Args:
        width: frame width (pixels).
        height: frame height (pixels).
        min_side: smallest acceptable shorter side after reduction (pixels); ``None`` or 0: no
            reduction.
        lossless: the frame is lossless (no DCT, so it cannot be scaled).

    Returns:
        1, 2, 4 or 8; libjpeg's reduced size is ``ceil(width / scale) × ceil(height / scale)``.
    """
    scale = 1
    if min_side and not lossless:
        for s in (2, 4, 8):
            # libjpeg's scaled size is ceil(dim / s) (jdiv_round_up).
            if min(-(-width // s), -(-height // s)) >= min_side:
                scale = s
    return scale


# --------------------------------------------------------------------------------------------------
# PNG


@dataclasses.dataclass
class PngInfo:
    """What :func:`walk_png` read from a PNG's chunks.

    Attributes:
        width: IHDR width (pixels).
        height: IHDR height (pixels).
        depth: IHDR bit depth (bits per sample: 1, 2, 4, 8 or 16).
        color_type: IHDR colour type (0 grey, 2 RGB, 3 palette, 4 grey + alpha, 6 RGBA).
        trns: a ``tRNS`` chunk is present.
        grey_key: ``tRNS`` transparent grey value (colour type 0), at the IHDR bit depth.
        orientation: EXIF orientation 1-8 from ``eXIf``; 1 if absent or damaged.
    """

    width: int = 0
    height: int = 0
    depth: int = 0
    color_type: int = 0
    trns: bool = False
    grey_key: int | None = None
    orientation: int = 1


def walk_png(data: bytes) -> PngInfo:
    """Walk the PNG chunk list to IEND: IHDR fields, ``tRNS`` presence, ``eXIf`` orientation.

    CRCs are left to libpng (it checks every chunk). Trailing bytes after IEND are ignored.
    Bounded by :data:`MAX_PNG_CHUNKS`.

    Args:
        data: the whole file, starting with the 8-byte PNG signature.

    Returns:
        :class:`PngInfo`.

    Raises:
        ImageRejected: ``truncated`` (ends before IEND), ``corrupt`` (bad IHDR, garbage chunk
            header, no IDAT), ``unsupported_format`` (Apple CgBI PNG).
    """
    n = len(data)
    pos = 8
    info: PngInfo | None = None
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
            info = PngInfo(width=width, height=height, depth=depth, color_type=color_type)
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


# --------------------------------------------------------------------------------------------------
# Header readers for the formats whose decoders allocate on open


def check_webp(data: bytes, max_pixels: int) -> None:
    """Before Pillow: the RIFF size fits in the file and the canvas is within ``max_pixels``.

    Args:
        data: the whole file (``RIFF....WEBP``).
        max_pixels: largest allowed canvas width × height (pixels).

    Raises:
        ImageRejected: ``truncated`` (shorter than its RIFF header declares), ``corrupt`` (no
            readable VP8X/VP8/VP8L header), ``too_many_pixels`` (see :func:`check_pixels`).
    """
    if len(data) < 8 + int.from_bytes(data[4:8], "little"):
        raise ImageRejected(Reason.TRUNCATED, "WebP ends before the size its RIFF header declares")
    size = _webp_size(data)
    if size is None:
        raise ImageRejected(Reason.CORRUPT, "WebP header is damaged")
    check_pixels(*size, max_pixels)


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


def ico_largest(data: bytes) -> tuple[int, int]:
    """Width and height of the largest ICO entry, embedded PNGs measured from their own IHDR.

    Args:
        data: the whole file (``00 00 01 00`` and a non-zero entry count).

    Returns:
        ``(width, height)`` in pixels of the entry with the most pixels (a directory size of 0
        means 256); ``(0, 0)`` if the directory has no entries.

    Raises:
        ImageRejected: ``truncated`` if the directory, or an image it points to, ends past the end
            of the file.
    """
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


def bmp_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, |height|, compression) of a Windows BMP (INFOHEADER or later), ``None`` for OS/2.

    Never raises.

    Returns:
        ``(width, height, compression)``: absolute sizes in pixels (height is negative for
        top-down BMPs), and the ``biCompression`` code (0 BI_RGB, 1 RLE8, 2 RLE4, 3 BITFIELDS,
        4 JPEG, 5 PNG, ...); ``None`` for an OS/2 (12-byte) header or a file too short to hold one.
    """
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


def tiff_tags(buf: bytes, wanted: set[int]) -> dict[int, int]:
    """First value of each ``wanted`` tag in IFD0 of a classic TIFF structure. Never raises.

    Args:
        buf: a TIFF file or an EXIF block (both TIFF structures; BigTIFF is not read).
        wanted: tag numbers (e.g. :data:`TIFF_WIDTH`, :data:`EXIF_ORIENTATION`).

    Returns:
        tag → first value, for the wanted BYTE/SHORT/LONG tags whose values lie inside ``buf``;
        ``{}`` if ``buf`` is not a readable classic TIFF structure.
    """
    parsed = _tiff_ifd0(buf, wanted)
    return {tag: values[0] for tag, values in parsed[0].items()} if parsed else {}


_TIFF_EXTENTS = ((273, 279), (324, 325), (513, 514))  # strips, tiles, old-style JPEG stream


def check_tiff(data: bytes, max_pixels: int) -> None:
    """Before Pillow: IFD0 present, size within ``max_pixels``, pixel data within the file.

    libtiff decodes what it can of a short file and Pillow returns it (old-style JPEG TIFFs come
    back partly grey), so a strip, tile or JPEG stream that ends past the end of the file means
    ``truncated``. BigTIFF is left to Pillow.

    Args:
        data: the whole file (classic TIFF, either byte order, or BigTIFF).
        max_pixels: largest allowed IFD0 width × height (pixels), when IFD0 has both tags.

    Raises:
        ImageRejected: ``truncated`` (IFD0, a value it points to, or a strip, tile or JPEG stream
            ends past the end of the file), or what :func:`check_pixels` raises.
    """
    if data[2:4] in (b"+\x00", b"\x00+"):
        return
    wanted = {TIFF_WIDTH, TIFF_HEIGHT} | {t for pair in _TIFF_EXTENTS for t in pair}
    parsed = _tiff_ifd0(data, wanted)
    if parsed is None:
        raise ImageRejected(Reason.TRUNCATED, "TIFF ends before its first image directory")
    tags, complete = parsed
    if not complete:
        raise ImageRejected(Reason.TRUNCATED, "TIFF ends inside its first image directory or the values it points to")
    if TIFF_WIDTH in tags and TIFF_HEIGHT in tags:
        check_pixels(tags[TIFF_WIDTH][0], tags[TIFF_HEIGHT][0], max_pixels)
    for offsets_tag, counts_tag in _TIFF_EXTENTS:
        offsets, counts = tags.get(offsets_tag), tags.get(counts_tag)
        if offsets is None:
            continue
        # Without byte counts (allowed for the old-style JPEG stream) only the start can be checked.
        ends = [o + c for o, c in zip(offsets, counts)] if counts else [o + 1 for o in offsets]
        if max(ends) > len(data):
            raise ImageRejected(Reason.TRUNCATED, "TIFF image data runs past the end of the file")


def check_isobmff(data: bytes, fmt: str) -> None:
    """Top-level HEIF/AVIF boxes must be well formed and end inside the file.

    Bounded by :data:`MAX_ISOBMFF_BOXES`.

    Args:
        data: the whole file (starting with its ``ftyp`` box).
        fmt: ``"heif"`` or ``"avif"``, used in messages only.

    Raises:
        ImageRejected: ``truncated`` (a box header or box runs past the end of the file),
            ``corrupt`` (a box smaller than its header, too many boxes).
    """
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
    value = tiff_tags(bytes(buf), {EXIF_ORIENTATION}).get(EXIF_ORIENTATION, 1)
    return value if 1 <= value <= 8 else 1
