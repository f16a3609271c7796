"""Every file of the shared real-image set through :func:`workers.decode.decode_image`.

``/work/shared/data/images/MANIFEST.tsv`` lists 84 photos and 76 odd files; its ``expected`` column
says what a correct pipeline does with each odd file. :data:`ODD_EXPECTED` turns that text (and a
look at each decoded result) into checks: the upright size and a few pixel properties for files
that decode, the exact reason code for files that must be refused. Where we chose an outcome the
``expected`` text leaves open, the entry says so; ``docs/decoding.md`` has the full table.

Pixel references are computed independently of the module under test wherever possible: Pillow's
own decode plus ``ImageOps.exif_transpose``, OpenCV ``IMREAD_UNCHANGED`` raw samples, float
arithmetic for the alpha and 16-bit rules, or another file of the set showing the same picture.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import io
import time
from typing import Callable

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from workers.decode import ALPHA_BACKGROUND, DecodedImage, decode_image
from workers.errors import ImageRejected, Reason

from tests.conftest import IMAGES as DATA  # ../shared/data/images, or $SHARED_DIR/data/images
MANIFEST = DATA / "MANIFEST.tsv"

pytestmark = pytest.mark.skipif(not MANIFEST.is_file(), reason=f"shared image data not found at {DATA}")


def _manifest() -> list[dict[str, str]]:
    if not MANIFEST.is_file():
        return []
    with MANIFEST.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


ROWS = _manifest()
PHOTO_ROWS = [r for r in ROWS if r["path"].startswith("photos/")]


# --------------------------------------------------------------------------------------------------
# Helpers (cached: several rows compare against the same reference file)


@functools.lru_cache(maxsize=None)
def _bytes(path: str) -> bytes:
    return (DATA / path).read_bytes()


@functools.lru_cache(maxsize=None)
def _decoded(path: str) -> DecodedImage:
    return decode_image(_bytes(path))


def _mad(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute difference of two uint8 arrays of equal shape, in 0..255 levels."""
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def _float_composite(rgb: np.ndarray, alpha: np.ndarray, top: float) -> np.ndarray:
    """The documented alpha rule in float arithmetic (independent of the module's integer code)."""
    a = alpha.astype(np.float64)[..., None] / top
    c = rgb.astype(np.float64) / top * 255.0
    return np.rint(c * a + np.asarray(ALPHA_BACKGROUND, np.float64) * (1.0 - a)).astype(np.uint8)


def _pillow_reference(path: str) -> np.ndarray:
    """Pillow's own decode: exif_transpose, alpha composited by the documented rule."""
    with Image.open(io.BytesIO(_bytes(path))) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
            rgba = np.asarray(im.convert("RGBA"))
            return _float_composite(rgba[..., :3], rgba[..., 3], 255.0)
        return np.asarray(im.convert("RGB"))


def _opencv_raw_reference(path: str) -> np.ndarray:
    """OpenCV ``IMREAD_UNCHANGED`` samples, 16-bit scaled by /257, alpha composited in float."""
    raw = cv2.imdecode(np.frombuffer(_bytes(path), np.uint8), cv2.IMREAD_UNCHANGED)
    top = 65535.0 if raw.dtype == np.uint16 else 255.0
    if raw.ndim == 2:
        raw = np.repeat(raw[..., None], 3, axis=2)
    if raw.shape[2] == 4:
        rgb = raw[..., 2::-1]
        return _float_composite(rgb, raw[..., 3], top)
    return np.rint(raw[..., ::-1].astype(np.float64) / top * 255.0).astype(np.uint8)


# Check builders: each returns ``check(rgb)`` that asserts a property of the decoded pixels.
Check = Callable[[np.ndarray], None]


def same_as(other: str, tol: float) -> Check:
    """Same picture as another odd/ file (decoded by the module), mean abs diff <= ``tol``."""

    def check(rgb: np.ndarray) -> None:
        assert _mad(rgb, _decoded(other).rgb) <= tol

    return check


def like_pillow(path: str, tol: float = 1.0) -> Check:
    def check(rgb: np.ndarray) -> None:
        assert _mad(rgb, _pillow_reference(path)) <= tol

    return check


def like_opencv_raw(path: str, tol: float = 1.0) -> Check:
    def check(rgb: np.ndarray) -> None:
        ref = _opencv_raw_reference(path)
        assert _mad(rgb, ref) <= tol
        assert np.abs(rgb.astype(np.int16) - ref).max() <= 1  # 16-bit rounding at most one level

    return check


def natural(rgb: np.ndarray) -> None:
    """Looks like a photograph: contrast, not flat grey, many distinct colours."""
    step = max(1, int((rgb.shape[0] * rgb.shape[1] / 65536) ** 0.5))  # ~64k pixels is plenty
    sample = rgb[::step, ::step].astype(np.int32)
    assert sample.std() > 20
    assert 30 < sample.mean() < 225
    packed = (sample[..., 0] << 16) | (sample[..., 1] << 8) | sample[..., 2]
    assert len(np.unique(packed)) > 500


def grey(rgb: np.ndarray) -> None:
    assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()


def only_values(*values: int) -> Check:
    def check(rgb: np.ndarray) -> None:
        assert set(np.unique(rgb).tolist()) <= set(values)

    return check


def pixel(x: int, y: int, expected: tuple[int, int, int], tol: int = 0) -> Check:
    def check(rgb: np.ndarray) -> None:
        assert np.abs(rgb[y, x].astype(int) - expected).max() <= tol, f"pixel ({x},{y}) = {rgb[y, x]}"

    return check


def corners_background(rgb: np.ndarray) -> None:
    """Transparent corners come out exactly as the documented background."""
    for y, x in ((0, 0), (0, -1), (-1, 0), (-1, -1)):
        assert tuple(rgb[y, x]) == ALPHA_BACKGROUND


def scaled_not_clipped(rgb: np.ndarray) -> None:
    """16-bit or float data mapped onto the full 0..255 range, not saturated at 255."""
    assert rgb.min() == 0 and rgb.max() == 255
    assert (rgb == 255).mean() < 0.25
    assert len(np.unique(rgb)) > 16


def transposed_raw(path: str) -> Check:
    """Equals the stored (coded) pixels mirrored across the main diagonal (EXIF orientation 5)."""

    def check(rgb: np.ndarray) -> None:
        with Image.open(io.BytesIO(_bytes(path))) as im:
            raw = np.asarray(im.convert("RGB"))
        assert _mad(rgb, raw.transpose(1, 0, 2)) <= 0.5

    return check


def first_frame_like_pillow(path: str, tol: float = 1.0) -> Check:
    """Pillow's frame 0 (the frame it opens on) by the same alpha rule."""
    return like_pillow(path, tol)


@dataclasses.dataclass(frozen=True)
class Decodes:
    """The file decodes; ``size`` is the upright (width, height) of the full image."""

    size: tuple[int, int]
    checks: tuple[Check, ...] = ()
    fmt: str | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Refused:
    """The file is refused with exactly ``reason``; ``fast`` ones must not decode anything."""

    reason: Reason
    fast: bool = False
    note: str = ""


O = "odd/"
LANDSCAPE_1 = O + "jpeg_exif_orientation_1__Landscape_1.jpg"
HOPPER = O + "tiff_lzw__hopper_lzw.tif"
ISS634_APNG = O + "png_apng_animated__iss634.apng"


def _landscape(n: int) -> Decodes:
    # Every orientation variant is the same scene: upright 1800x1200, matching orientation 1
    # (measured mean abs diff <= 3.7 levels; a wrong rotation/mirror gives tens of levels).
    return Decodes((1800, 1200), (same_as(LANDSCAPE_1, tol=5.0), natural), "jpeg")


#: One entry per odd/ row of the manifest: what decode_image must do with it.
ODD_EXPECTED: dict[str, Decodes | Refused] = {
    O + "avif_irot_imir__rot1mir0.avif": Decodes(
        (640, 427), (transposed_raw(O + "avif_irot_imir__rot1mir0.avif"), natural), "avif",
        note="irot=1 + imir=0 is EXIF orientation 5 (transpose): the labels read upright"),
    O + "avif_photo__example.avif": Decodes((800, 533), (natural,), "avif"),
    O + "bmp_bad_rle__badrle.bmp": Refused(
        Reason.CORRUPT, note="expected allows reject or flagged partial; Pillow pads bad RLE silently, we refuse"),
    O + "bmp_embedded_jpeg__rgb24jpeg.bmp": Refused(Reason.UNSUPPORTED_FORMAT),
    O + "bmp_huge_dims__reallybig.bmp": Refused(Reason.TOO_MANY_PIXELS, fast=True),
    O + "bmp_photo__shira_bird8.bmp": Decodes((192, 144), (natural, like_pillow(O + "bmp_photo__shira_bird8.bmp", 0.0)), "bmp"),
    O + "bmp_rgba32_bitfields__rgba32.bmp": Decodes(
        (127, 64), (like_pillow(O + "bmp_rgba32_bitfields__rgba32.bmp", 0.5),), "bmp"),
    O + "bmp_rle8__pal8rle.bmp": Decodes((127, 64), (like_pillow(O + "bmp_rle8__pal8rle.bmp", 0.0),), "bmp"),
    O + "gif_animated__iss634.gif": Decodes(
        (245, 245), (first_frame_like_pillow(O + "gif_animated__iss634.gif", 0.0), same_as(ISS634_APNG, 1.0)), "gif"),
    O + "gif_decompression_bomb__decompression_bomb.gif": Refused(Reason.TOO_MANY_PIXELS, fast=True),
    O + "gif_transparent__transparent.gif": Decodes(
        (200, 150),
        (corners_background, like_pillow(O + "gif_transparent__transparent.gif", 0.0),
         same_as(O + "webp_alpha__transparent.webp", 4.0)),
        "gif"),
    O + "gif_zero_width__zero_width.gif": Refused(Reason.CORRUPT),
    O + "heic_photo__example.heic": Decodes((1280, 854), (natural,), "heif", note="decoded by pillow-heif (libheif)"),
    O + "ico_multi_size__pillow.ico": Decodes(
        (256, 256), (corners_background, like_pillow(O + "ico_multi_size__pillow.ico", 0.5)), "ico"),
    O + "jp2_photo__relax.jp2": Decodes((320, 240), (natural, like_opencv_raw(O + "jp2_photo__relax.jp2", 1.0)), "jpeg2000"),
    O + "jpeg_12bit__monkey12.jpg": Refused(Reason.UNSUPPORTED_FORMAT),
    O + "jpeg_arithmetic__testimgari.jpg": Decodes(
        (227, 149), (natural, same_as(O + "jpeg_lossless__testimgl.jpg", 2.0)), "jpeg"),
    O + "jpeg_bad_exif__hopper_bad_exif.jpg": Decodes(
        (500, 500), (grey, like_pillow(O + "jpeg_bad_exif__hopper_bad_exif.jpg", 1.0)), "jpeg"),
    O + "jpeg_cmyk_adobe__pil_sample_cmyk.jpg": Decodes(
        (100, 100),
        # Pillow's own test of this file: top-left is red (C=0, M,Y > 0.8), bottom-right black.
        (pixel(0, 0, (255, 0, 0), tol=60), pixel(99, 99, (0, 0, 0), tol=40),
         like_pillow(O + "jpeg_cmyk_adobe__pil_sample_cmyk.jpg", 2.0)),
        "jpeg"),
    O + "jpeg_cmyk_icc__Channel_digital_image_CMYK_color.jpg": Decodes(
        (500, 333), (natural, like_pillow(O + "jpeg_cmyk_icc__Channel_digital_image_CMYK_color.jpg", 2.0)), "jpeg",
        note="naive (non-ICC) CMYK->RGB, not inverted; the expected text accepts that"),
    O + "jpeg_corrupt_header__corrupt-header.jpg": Refused(Reason.TRUNCATED, note="ends inside its APP1 segment"),
    **{O + f"jpeg_exif_orientation_{n}__Landscape_{n}.jpg": _landscape(n) for n in range(1, 9)},
    O + "jpeg_exif_orientation_8_tiny__orientation_rectangle.jpg": Decodes(
        (1, 2), (like_pillow(O + "jpeg_exif_orientation_8_tiny__orientation_rectangle.jpg", 1.0),), "jpeg"),
    O + "jpeg_gamma_trap__gamma_dalai_lama_gray.jpg": Decodes(
        (258, 222), (like_pillow(O + "jpeg_gamma_trap__gamma_dalai_lama_gray.jpg", 1.0),), "jpeg",
        note="decode is plain; the gamma trap is a resize concern (preprocess stage)"),
    O + "jpeg_huge_280MP__giant-image.jpg": Refused(
        Reason.TOO_MANY_PIXELS, fast=True,
        note="at the default 50 MP limit; with a higher limit and min_side it decodes at 1/8 (test_decode.py)"),
    O + "jpeg_junk_between_markers__junk_jpeg_header.jpg": Decodes(
        (1024, 768), (natural, like_pillow(O + "jpeg_junk_between_markers__junk_jpeg_header.jpg", 1.0)), "jpeg"),
    O + "jpeg_lossless__testimgl.jpg": Decodes((227, 149), (natural,), "jpeg"),
    O + "jpeg_mpo_stereo__sugarshack.mpo": Decodes(
        (640, 480), (natural, like_pillow(O + "jpeg_mpo_stereo__sugarshack.mpo", 1.0)), "jpeg"),
    O + "jpeg_progressive_bigicc__icc_profile_big.jpg": Decodes(
        (425, 250), (natural, like_pillow(O + "jpeg_progressive_bigicc__icc_profile_big.jpg", 1.0)), "jpeg"),
    O + "jpeg_truncated_10kB__truncated.jpg": Refused(Reason.TRUNCATED),
    O + "jpeg_truncated_progressive__truncated_jpeg.jpg": Refused(
        Reason.TRUNCATED, note="policy choice in expected: we refuse rather than flag a partial decode"),
    O + "jpeg_ultrahdr_gainmap__gain-map.jpg": Decodes((3840, 2160), (natural,), "jpeg"),
    O + "not_an_image__test-ole-file.doc": Refused(Reason.NOT_AN_IMAGE),
    O + "pfm_float__hopper.pfm": Decodes(
        (128, 128), (grey, same_as(O + "pgm_16bit__hopper_16bit.pgm", 1.5)), "pnm",
        note="float values 1..255 lie in [0, 255] and are kept as they are"),
    O + "pgm_16bit__hopper_16bit.pgm": Decodes(
        (128, 128), (grey, scaled_not_clipped, like_opencv_raw(O + "pgm_16bit__hopper_16bit.pgm")), "pnm"),
    O + "png_16bit_gray_alpha__16-bit-grey-alpha.png": Decodes(
        (109, 96), (grey, like_opencv_raw(O + "png_16bit_gray_alpha__16-bit-grey-alpha.png")), "png",
        note="black with at most 6% alpha: composited on white it is a faint grey pattern"),
    O + "png_16bit_rgb__basn2c16.png": Decodes(
        (32, 32), (scaled_not_clipped, like_opencv_raw(O + "png_16bit_rgb__basn2c16.png")), "png"),
    O + "png_16bit_rgba__basn6a16.png": Decodes(
        (32, 32), (like_opencv_raw(O + "png_16bit_rgba__basn6a16.png"),), "png"),
    O + "png_1bit_gray__basn0g01.png": Decodes(
        (32, 32), (grey, only_values(0, 255), like_pillow(O + "png_1bit_gray__basn0g01.png", 0.0)), "png"),
    O + "png_1x1__s01n3p01.png": Decodes((1, 1), (like_pillow(O + "png_1x1__s01n3p01.png", 0.0),), "png"),
    O + "png_apng_animated__iss634.apng": Decodes(
        (245, 245), (first_frame_like_pillow(ISS634_APNG, 0.0),), "png"),
    O + "png_bad_colortype__xc1n0g08.png": Refused(Reason.CORRUPT),
    O + "png_bad_idat_crc__xcsn0g01.png": Refused(Reason.CORRUPT, note="libpng checks the IDAT CRC; Pillow does not"),
    O + "png_bad_signature__xs1n0g01.png": Refused(Reason.NOT_AN_IMAGE, note="no PNG signature, so by content no image"),
    O + "png_broken_chunk_stream__broken_data_stream.png": Refused(Reason.CORRUPT),
    O + "png_crlf_mangled__xcrn0g04.png": Refused(Reason.NOT_AN_IMAGE, note="signature mangled: no known magic"),
    O + "png_gamma_0.35__g03n2c08.png": Decodes(
        (32, 32), (like_pillow(O + "png_gamma_0.35__g03n2c08.png", 0.0),), "png",
        note="gAMA ignored: stored values returned, like Pillow and OpenCV"),
    O + "png_interlaced__basi2c08.png": Decodes((32, 32), (like_pillow(O + "png_interlaced__basi2c08.png", 0.0),), "png"),
    O + "png_missing_idat__xdtn0g01.png": Refused(Reason.CORRUPT),
    O + "png_palette_trns__tbbn3p08.png": Decodes(
        (32, 32), (corners_background, like_pillow(O + "png_palette_trns__tbbn3p08.png", 0.0)), "png"),
    O + "png_pixel_bomb_65536x65536__65536-uint32-limit.png": Refused(Reason.TOO_MANY_PIXELS, fast=True),
    O + "png_rgb_colorkey_trns__tbrn2c08.png": Decodes(
        (32, 32),
        (corners_background, like_pillow(O + "png_rgb_colorkey_trns__tbrn2c08.png", 0.0),
         same_as(O + "png_palette_trns__tbbn3p08.png", 1.0)),
        "png"),
    O + "png_text_chunk_bomb__png_decompression_dos.png": Decodes(
        (1, 1), (), "png", note="libpng bounds the zTXt inflation; Pillow would refuse the file"),
    O + "png_truncated__truncated_image.png": Refused(Reason.TRUNCATED),
    O + "psd_layers__hopper.psd": Decodes((128, 128), (same_as(HOPPER, 3.0),), "psd", note="the merged composite"),
    O + "qoi__hopper.qoi": Decodes((128, 128), (same_as(HOPPER, 0.0),), "qoi"),
    O + "tiff_16bit_rgb__tiff_16bit_RGB.tiff": Decodes(
        (100, 40), (like_opencv_raw(O + "tiff_16bit_rgb__tiff_16bit_RGB.tiff"),), "tiff"),
    O + "tiff_ccitt_g3_fax__G31D.TIF": Decodes((2464, 3248), (grey, only_values(0, 255)), "tiff"),
    O + "tiff_cielab__cielab-dagams.tiff": Decodes(
        (400, 266), (natural, lambda rgb: _assert_green_dominant(rgb)), "tiff",
        note="Pillow cannot identify it; OpenCV (libtiff) converts Lab to RGB"),
    O + "tiff_cmyk_jpeg__tiff_strip_cmyk_jpeg.tif": Decodes(
        (100, 100), (same_as(O + "jpeg_cmyk_adobe__pil_sample_cmyk.jpg", 2.0),), "tiff",
        note="same picture as pil_sample_cmyk.jpg: converted, not a negative"),
    O + "tiff_float32__10ct_32bit_128.tiff": Decodes(
        (128, 128), (grey, scaled_not_clipped, lambda rgb: _assert_float_stretched(rgb)), "tiff"),
    O + "tiff_jpeg_ycbcr__tiff_strip_ycbcr_jpeg_2x2_sampling.tif": Decodes(
        (480, 360), (natural, like_pillow(O + "tiff_jpeg_ycbcr__tiff_strip_ycbcr_jpeg_2x2_sampling.tif", 0.0)), "tiff"),
    O + "tiff_lzw__hopper_lzw.tif": Decodes((128, 128), (natural, like_pillow(HOPPER, 0.0)), "tiff"),
    O + "tiff_multipage__multipage.tiff": Decodes(
        (10, 10), (like_pillow(O + "tiff_multipage__multipage.tiff", 0.0),), "tiff", note="first page"),
    O + "tiff_old_jpeg__old-style-jpeg-compression.tif": Decodes(
        (4160, 870), (lambda rgb: _assert_neutral_chart(rgb),), "tiff"),
    O + "webp_alpha__transparent.webp": Decodes(
        (200, 150), (corners_background, like_pillow(O + "webp_alpha__transparent.webp", 0.0)), "webp"),
    O + "webp_animated__iss634.webp": Decodes((245, 245), (same_as(ISS634_APNG, 1.0),), "webp"),
    O + "webp_exif_orientation_6__hopper_orientation_6.webp": Decodes(
        (128, 128), (same_as(HOPPER, 8.0),), "webp",
        note="upright matches hopper (mean diff 4.5 levels; unrotated it is ~74)"),
    O + "webp_lossy_photo__4.webp": Decodes((1024, 772), (natural,), "webp"),
}


def _assert_green_dominant(rgb: np.ndarray) -> None:
    """A bird in grass: green is the strongest channel (a Lab file read as RGB is not)."""
    r, g, b = rgb.reshape(-1, 3).mean(axis=0)
    assert g > r > b


def _assert_float_stretched(rgb: np.ndarray) -> None:
    """Phase map in [-pi, pi]: min..max stretched linearly onto 0..255."""
    with Image.open(io.BytesIO(_bytes(O + "tiff_float32__10ct_32bit_128.tiff"))) as im:
        raw = np.asarray(im, dtype=np.float64)
    expected = np.rint((raw - raw.min()) / (raw.max() - raw.min()) * 255.0)
    assert np.abs(rgb[..., 0] - expected).max() <= 1


def _assert_neutral_chart(rgb: np.ndarray) -> None:
    """A scanned grey-scale chart: near-neutral, with a dark-to-light ramp of steps."""
    mean = rgb.reshape(-1, 3).mean(axis=0)
    assert np.ptp(mean) < 12
    assert rgb.std() > 20
    assert like_pillow(O + "tiff_old_jpeg__old-style-jpeg-compression.tif", 1.0)(rgb) is None


def test_table_covers_every_odd_row() -> None:
    odd = {r["path"] for r in ROWS if r["path"].startswith("odd/")}
    assert len(odd) == 76
    assert set(ODD_EXPECTED) == odd


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")  # Pillow, reading a reference
@pytest.mark.parametrize("path", sorted(ODD_EXPECTED))
def test_odd_file(path: str) -> None:
    expected = ODD_EXPECTED[path]
    data = _bytes(path)
    if isinstance(expected, Refused):
        start = time.perf_counter()
        with pytest.raises(ImageRejected) as info:
            decode_image(data)
        assert info.value.reason == expected.reason, info.value.detail
        if expected.fast:
            assert time.perf_counter() - start < 0.5  # refused from the header, nothing decoded
        return
    result = decode_image(data)
    assert (result.width, result.height) == expected.size
    assert result.rgb.shape == (expected.size[1], expected.size[0], 3)
    assert result.rgb.dtype == np.uint8 and result.rgb.flags.c_contiguous
    assert result.scale == 1
    if expected.fmt:
        assert result.format == expected.fmt
    for check in expected.checks:
        check(result.rgb)


def _upright_manifest_size(row: dict[str, str]) -> tuple[int, int]:
    """The manifest's stored size, swapped when EXIF orientation (read by Pillow) is 5-8."""
    width, height = int(row["width"]), int(row["height"])
    with Image.open(DATA / row["path"]) as im:
        orientation = im.getexif().get(0x0112, 1)
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def test_photo_rows_are_all_here() -> None:
    assert len(PHOTO_ROWS) == 84


@pytest.mark.parametrize("path", [r["path"] for r in PHOTO_ROWS])
def test_photo(path: str) -> None:
    row = next(r for r in PHOTO_ROWS if r["path"] == path)
    data = _bytes(path)
    assert len(data) == int(row["bytes"])
    width, height = _upright_manifest_size(row)

    full = decode_image(data)
    assert (full.width, full.height) == (width, height)
    assert full.rgb.shape == (height, width, 3) and full.rgb.dtype == np.uint8 and full.rgb.flags.c_contiguous
    assert full.rgb.std() > 10  # a picture, not a flat fill

    # The fast path: reduced JPEG decode keeps the short side >= min_side and full-size dims.
    reduced = decode_image(data, min_side=224)
    assert (reduced.width, reduced.height) == (width, height)
    h, w = reduced.rgb.shape[:2]
    assert (h, w) == (-(-height // reduced.scale), -(-width // reduced.scale))
    if reduced.scale > 1:
        assert min(h, w) >= 224
        assert min(-(-height // (reduced.scale * 2)), -(-width // (reduced.scale * 2))) < 224 or reduced.scale == 8
    else:
        assert full.format != "jpeg" or min(-(-height // 2), -(-width // 2)) < 224
