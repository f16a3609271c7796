"""Unit tests of :mod:`workers.decode` on small synthetic files (plus a few shared real ones)."""
from __future__ import annotations

import io
import struct
import threading
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps

from workers import decode as decode_module
from workers.decode import (
    ALPHA_BACKGROUND,
    MAX_JPEG_SCANS,
    DecodedImage,
    abandoned_decodes,
    decode_image,
)
from workers.errors import ImageRejected, Reason

from tests.conftest import IMAGES as DATA  # ../shared/data/images, or $SHARED_DIR/data/images
needs_data = pytest.mark.skipif(not (DATA / "MANIFEST.tsv").is_file(), reason=f"shared image data not found at {DATA}")


def encode(im: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def photo(width: int = 64, height: int = 48, seed: int = 0) -> np.ndarray:
    """A smooth, asymmetric test picture (gradients + a bright top-left block): ``(H, W, 3) uint8``."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    rgb[: height // 4, : width // 4] = (250, 30, 30)
    return (rgb + rng.integers(0, 3, rgb.shape)).clip(0, 255).astype(np.uint8)


def rejected(data: bytes, **kwargs) -> ImageRejected:
    with pytest.raises(ImageRejected) as info:
        decode_image(data, **kwargs)
    return info.value


def png_chunk(ctype: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + ctype + body + struct.pack(">I", zlib.crc32(ctype + body))


def forbid_decoders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any pixel decode (OpenCV, Pillow open or load) fail the test."""

    def boom(*args, **kwargs):
        raise AssertionError("a decoder was called for a file that should be refused from its header")

    monkeypatch.setattr(decode_module.cv2, "imdecode", boom)
    monkeypatch.setattr(ImageFile.ImageFile, "load", boom)


# --------------------------------------------------------------------------------------------------
# Basic refusals (format sniffing itself: test_containers.py)


def test_empty() -> None:
    assert rejected(b"").reason == Reason.EMPTY


@pytest.mark.parametrize("data", [b"hello world\n" * 20, b"%PDF-1.7\n" + b"\x00" * 100, b"\xd0\xcf\x11\xe0" + b"\x00" * 60])
def test_not_an_image_is_detected_by_content(data: bytes) -> None:
    assert rejected(data).reason == Reason.NOT_AN_IMAGE


@pytest.mark.parametrize("data", [b"\xff\x0a\xfa\x00" * 8, b"%!PS-Adobe-3.0\n" * 4, b"<svg xmlns='x'></svg>", b"DDS " + b"\x00" * 60])
def test_recognised_but_unsupported_formats(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_decoders(monkeypatch)  # EPS in particular must never reach Pillow (Ghostscript)
    monkeypatch.setattr(decode_module.Image, "open", lambda *a, **k: (_ for _ in ()).throw(AssertionError("opened")))
    assert rejected(data).reason == Reason.UNSUPPORTED_FORMAT


def test_too_large_is_checked_before_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(Image.fromarray(photo()), "PNG")
    forbid_decoders(monkeypatch)
    error = rejected(data, max_bytes=len(data) - 1)
    assert error.reason == Reason.TOO_LARGE


def test_bytes_like_inputs() -> None:
    data = encode(Image.fromarray(photo()), "PNG")
    for variant in (data, bytearray(data), memoryview(data)):
        result = decode_image(variant)
        assert result.rgb.shape == (48, 64, 3)


# --------------------------------------------------------------------------------------------------
# Pixel limits: refused from the header, before any decoder allocates


def png_header_claiming(width: int, height: int) -> bytes:
    """A tiny, well-formed PNG (valid CRCs, IDAT, IEND) whose IHDR claims ``width`` × ``height``."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


def test_png_claiming_65536_squared_is_refused_before_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    data = png_header_claiming(65536, 65536)
    assert len(data) < 200
    forbid_decoders(monkeypatch)
    start = time.perf_counter()
    error = rejected(data)
    assert error.reason == Reason.TOO_MANY_PIXELS
    assert "65536x65536" in error.detail
    assert time.perf_counter() - start < 0.1


def test_jpeg_claiming_huge_size_is_refused_before_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytearray(encode(Image.fromarray(photo()), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 60000, 60000)
    forbid_decoders(monkeypatch)
    assert rejected(bytes(data)).reason == Reason.TOO_MANY_PIXELS


def test_gif_claiming_huge_size_is_refused_before_load(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytearray(encode(Image.fromarray(photo()).convert("P"), "GIF"))
    data[6:10] = struct.pack("<HH", 60000, 60000)  # logical screen
    frame = data.index(b"\x2c")  # image descriptor
    data[frame + 5 : frame + 9] = struct.pack("<HH", 60000, 60000)
    forbid_decoders(monkeypatch)
    assert rejected(bytes(data)).reason == Reason.TOO_MANY_PIXELS


def test_webp_canvas_is_checked_before_pillow_opens_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # libwebp's animation decoder allocates its canvas while Pillow "only opens" the file.
    data = bytearray(encode(Image.fromarray(photo()), "WEBP", lossless=False))
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00" + (16383 - 1).to_bytes(3, "little") * 2
    data = data[:12] + vp8x + data[12:]
    data[4:8] = struct.pack("<I", len(data) - 8)
    forbid_decoders(monkeypatch)
    monkeypatch.setattr(decode_module.Image, "open", lambda *a, **k: (_ for _ in ()).throw(AssertionError("opened")))
    assert rejected(bytes(data)).reason == Reason.TOO_MANY_PIXELS


def test_ico_with_embedded_png_bomb_is_checked_before_pillow_opens_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pillow's ICO plugin decodes on open; the directory says 256x256, the embedded PNG says more.
    png = png_header_claiming(40000, 40000)
    directory = struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 22)
    monkeypatch.setattr(decode_module.Image, "open", lambda *a, **k: (_ for _ in ()).throw(AssertionError("opened")))
    assert rejected(directory + png).reason == Reason.TOO_MANY_PIXELS


def test_pixel_limit_is_inclusive() -> None:
    data = encode(Image.fromarray(photo(64, 48)), "PNG")
    assert decode_image(data, max_pixels=64 * 48).rgb.shape == (48, 64, 3)
    assert rejected(data, max_pixels=64 * 48 - 1).reason == Reason.TOO_MANY_PIXELS


@needs_data
def test_huge_jpeg_decodes_reduced_when_the_limit_allows() -> None:
    """The 280 MP / 1.1 MB JPEG: refused at the default limit, 1/8-size decode when allowed."""
    data = (DATA / "odd/jpeg_huge_280MP__giant-image.jpg").read_bytes()
    assert rejected(data).reason == Reason.TOO_MANY_PIXELS
    result = decode_image(data, max_pixels=300_000_000, min_side=224)
    assert (result.width, result.height, result.scale) == (20000, 14000, 8)
    assert result.rgb.shape == (1750, 2500, 3)


# --------------------------------------------------------------------------------------------------
# Transparency


def rgba_with_hidden(hidden: tuple[int, int, int]) -> np.ndarray:
    """Visible pixels identical; fully transparent pixels hide ``hidden``; one half-transparent row."""
    rgba = np.zeros((16, 20, 4), np.uint8)
    rgba[..., :3] = photo(20, 16)
    rgba[..., 3] = 255
    rgba[4:10, 5:15, :3] = hidden
    rgba[4:10, 5:15, 3] = 0
    rgba[12, :, :3] = (0, 0, 0)
    rgba[12, :, 3] = 128
    return rgba


@pytest.mark.parametrize(
    "fmt, params",
    # (Pillow writes RGBA BMPs as BI_RGB, whose fourth byte is "reserved", not alpha: not here.)
    [("PNG", {}), ("WEBP", {"lossless": True, "exact": True}), ("TIFF", {})],
)
def test_alpha_rule_hidden_colour_does_not_matter(fmt: str, params: dict) -> None:
    a = decode_image(encode(Image.fromarray(rgba_with_hidden((255, 0, 0)), "RGBA"), fmt, **params))
    b = decode_image(encode(Image.fromarray(rgba_with_hidden((0, 0, 255)), "RGBA"), fmt, **params))
    assert np.array_equal(a.rgb, b.rgb)
    assert (a.rgb[4:10, 5:15] == ALPHA_BACKGROUND).all()
    # Half-transparent black on white: round((0 * 128 + 255 * 127) / 255) = 127.
    assert (np.abs(a.rgb[12].astype(int) - 127) <= 1).all()
    # Opaque pixels keep their colour exactly.
    assert np.array_equal(a.rgb[0], photo(20, 16)[0])


def test_alpha_rule_same_picture_same_pixels_across_formats() -> None:
    rgba = rgba_with_hidden((12, 34, 56))
    png = decode_image(encode(Image.fromarray(rgba, "RGBA"), "PNG")).rgb
    webp = decode_image(encode(Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True)).rgb
    la = decode_image(encode(Image.fromarray(rgba, "RGBA").convert("LA"), "PNG")).rgb
    assert np.array_equal(png, webp)
    assert (la[4:10, 5:15] == ALPHA_BACKGROUND).all()


def test_palette_and_colour_key_transparency() -> None:
    # Palette (GIF, PNG tRNS): the transparent index is composited whatever colour it holds.
    pal = np.zeros((8, 8), np.uint8)
    pal[:4] = 1
    for hidden in ((255, 0, 0), (0, 255, 0)):
        im = Image.fromarray(pal, "P")
        im.putpalette(list(hidden) + [10, 20, 30] + [0] * 762)
        for fmt in ("GIF", "PNG"):
            rgb = decode_image(encode(im, fmt, transparency=0)).rgb
            assert (rgb[4:] == ALPHA_BACKGROUND).all() and (rgb[:4] == (10, 20, 30)).all()
    # RGB colour key (PNG tRNS in colour type 2).
    rgb = np.full((8, 8, 3), (1, 2, 3), np.uint8)
    rgb[:4] = (10, 20, 30)
    out = decode_image(encode(Image.fromarray(rgb), "PNG", transparency=(10, 20, 30))).rgb
    assert (out[:4] == ALPHA_BACKGROUND).all() and (out[4:] == (1, 2, 3)).all()
    # Grey colour key, 8-bit and 16-bit (libpng leaves these to us).
    grey = np.full((8, 8), 200, np.uint8)
    grey[:4] = 10
    out = decode_image(encode(Image.fromarray(grey, "L"), "PNG", transparency=10)).rgb
    assert (out[:4] == ALPHA_BACKGROUND).all() and (out[4:] == 200).all()
    grey16 = np.full((8, 8), 40000, np.uint16)
    grey16[:4] = 5000
    out = decode_image(encode(Image.fromarray(grey16), "PNG", transparency=5000)).rgb
    assert (out[:4] == ALPHA_BACKGROUND).all() and (out[4:] == round(40000 / 257)).all()


# --------------------------------------------------------------------------------------------------
# Bit depth


def test_16bit_is_scaled_not_clipped() -> None:
    values = np.array([[0, 1000, 257 * 100, 40000, 65535]], np.uint16)
    out = decode_image(encode(Image.fromarray(values), "PNG")).rgb[..., 0]
    assert out.tolist() == [[0, 4, 100, round(40000 / 257), 255]]


def test_16bit_rgba_png_composited_after_scaling() -> None:
    # 16-bit RGBA written by hand (Pillow cannot write it): red at alpha 65535 and at alpha 0.
    rows = [
        b"\x00" + struct.pack(">4H", 65535, 0, 0, 65535) + struct.pack(">4H", 0, 65535, 0, 0),
    ]
    ihdr = struct.pack(">IIBBBBB", 2, 1, 16, 6, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + png_chunk(b"IEND", b"")
    )
    out = decode_image(data).rgb
    assert out[0, 0].tolist() == [255, 0, 0]
    assert tuple(out[0, 1]) == ALPHA_BACKGROUND


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.0, 0.5, 1.0], [0, 128, 255]),  # in [0, 1]: times 255
        ([0.0, 100.0, 255.0], [0, 100, 255]),  # in [0, 255]: as is
        ([-1.0, 1.0, 3.0], [0, 128, 255]),  # anything else: min..max stretched
        ([-2.0, float("nan"), 2.0], [0, 128, 255]),  # non-finite counts as 0, then the rule
    ],
)
def test_float_rule(values: list[float], expected: list[int]) -> None:
    im = Image.fromarray(np.array([values], np.float32), "F")
    out = decode_image(encode(im, "TIFF")).rgb
    assert out[0, :, 0].tolist() == expected
    assert (out[..., 0] == out[..., 1]).all()


def test_1bit_and_greyscale_become_rgb() -> None:
    bits = Image.fromarray(np.array([[0, 1, 0, 1]], np.uint8) * 255).convert("1")
    out = decode_image(encode(bits, "PNG")).rgb
    assert out[0, :, 0].tolist() == [0, 255, 0, 255] and out.shape == (1, 4, 3)


# --------------------------------------------------------------------------------------------------
# Orientation and DCT scaling


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pillow_exif_transpose(orientation: int) -> None:
    rgb = photo(7, 5)
    exif = Image.Exif()
    exif[0x0112] = orientation
    im = Image.fromarray(rgb)
    im.info["exif"] = exif.tobytes()
    im.getexif()[0x0112] = orientation
    expected = np.asarray(ImageOps.exif_transpose(im))
    got = decode_module._orient(rgb, orientation)
    assert got.flags.c_contiguous
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
@pytest.mark.parametrize("orientation", [1, 3, 5, 6, 8])
def test_exif_orientation_is_applied(fmt: str, orientation: int) -> None:
    rgb = photo(64, 48)
    exif = Image.Exif()
    exif[0x0112] = orientation
    params = {"quality": 95} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}
    data = encode(Image.fromarray(rgb), fmt, exif=exif, **params)
    result = decode_image(data)
    reference = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert (result.width, result.height) == reference.size
    assert result.rgb.shape == (reference.size[1], reference.size[0], 3)
    assert np.abs(result.rgb.astype(int) - np.asarray(reference)).mean() < 1.0


def test_corrupt_exif_is_ignored() -> None:
    data = encode(Image.fromarray(photo()), "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\xff\xff")
    assert decode_image(data).rgb.shape == (48, 64, 3)


def jpeg_with_orientation(width: int, height: int, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(Image.fromarray(photo(width, height)), "JPEG", exif=exif, quality=90)


def test_dct_reduced_decode_keeps_min_side_and_reports_full_size() -> None:
    data = jpeg_with_orientation(1000, 999, 6)  # nearly square, rotated: 1/8 size is 125 x 125
    full = decode_image(data)
    assert (full.width, full.height, full.scale) == (999, 1000, 1)
    for min_side, scale in [(100, 8), (125, 8), (126, 4), (250, 4), (251, 2), (500, 2), (501, 1), (None, 1)]:
        result = decode_image(data, min_side=min_side)
        assert result.scale == scale, min_side
        assert (result.width, result.height) == (999, 1000)  # upright full size, always
        h, w = result.rgb.shape[:2]
        assert (h, w) == (-(-1000 // scale), -(-999 // scale))
        if min_side:
            assert min(h, w) >= min_side
        # Reduced pixels are the full picture, upright: compare against a box-filtered full decode.
        if scale > 1:
            crop = full.rgb[: h * scale - scale, : w * scale - scale].astype(float)
            small = crop.reshape(h - 1, scale, w - 1, scale, 3).mean(axis=(1, 3))
            assert np.abs(small - result.rgb[: h - 1, : w - 1]).mean() < 6


def test_min_side_is_ignored_for_other_formats() -> None:
    result = decode_image(encode(Image.fromarray(photo(640, 480)), "PNG"), min_side=64)
    assert result.scale == 1 and result.rgb.shape == (480, 640, 3)


@needs_data
def test_lossless_jpeg_is_never_dct_scaled() -> None:
    data = (DATA / "odd/jpeg_lossless__testimgl.jpg").read_bytes()
    result = decode_image(data, min_side=16)
    assert result.scale == 1 and result.rgb.shape == (149, 227, 3)


# --------------------------------------------------------------------------------------------------
# Truncated and corrupt files


def test_truncated_jpeg_is_refused_not_grey_filled() -> None:
    data = encode(Image.fromarray(photo(256, 256)), "JPEG", quality=90)
    for cut in (len(data) // 3, len(data) // 2, len(data) - 2):
        assert rejected(data[:cut]).reason == Reason.TRUNCATED
        # zero padding (common in partial downloads) does not hide the missing end marker
        assert rejected(data[:cut] + b"\x00" * 64).reason == Reason.TRUNCATED
    progressive = encode(Image.fromarray(photo(256, 256)), "JPEG", progressive=True)
    assert rejected(progressive[: len(progressive) // 2]).reason == Reason.TRUNCATED


def test_jpeg_trailing_bytes_after_eoi_are_fine() -> None:
    data = encode(Image.fromarray(photo()), "JPEG")
    assert decode_image(data + b"\x00\x01garbage after the end\xff\xd8").rgb.shape == (48, 64, 3)


def test_jpeg_12bit_is_unsupported() -> None:
    data = bytearray(encode(Image.fromarray(photo()), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 1] = 0xC1
    data[sof + 4] = 12  # precision
    error = rejected(bytes(data))
    assert error.reason == Reason.UNSUPPORTED_FORMAT and "12-bit" in error.detail


def test_jpeg_with_too_many_scans_is_refused_without_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    sof = b"\xff\xc2\x00\x0b\x08\x00\x10\x00\x10\x01\x01\x11\x00"
    sos = b"\xff\xda\x00\x08\x01\x01\x00\x00\x00\x00" + b"\x12\x34"
    data = b"\xff\xd8" + sof + sos * (MAX_JPEG_SCANS + 1) + b"\xff\xd9"
    forbid_decoders(monkeypatch)
    error = rejected(data)
    assert error.reason == Reason.CORRUPT and "scans" in error.detail


def test_truncated_png_is_refused() -> None:
    data = encode(Image.fromarray(photo(128, 128)), "PNG")
    assert rejected(data[: len(data) // 2]).reason == Reason.TRUNCATED
    assert rejected(data[:-12]).reason == Reason.TRUNCATED  # only IEND missing: still the rule


def test_png_bad_crc_is_corrupt() -> None:
    data = bytearray(encode(Image.fromarray(photo()), "PNG"))
    idat = data.index(b"IDAT")
    length = int.from_bytes(data[idat - 4 : idat], "big")
    data[idat + 4 + length] ^= 0xFF  # first CRC byte
    assert rejected(bytes(data)).reason == Reason.CORRUPT


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "BMP", "TIFF"])
def test_truncated_other_formats_are_refused(fmt: str) -> None:
    im = Image.fromarray(photo(96, 64))
    data = encode(im.convert("P") if fmt == "GIF" else im, fmt)
    error = rejected(data[: len(data) // 2])
    assert error.reason in (Reason.TRUNCATED, Reason.CORRUPT)


@needs_data
def test_truncated_rle_bmp_is_refused() -> None:
    data = (DATA / "odd/bmp_rle8__pal8rle.bmp").read_bytes()
    assert decode_image(data).rgb.shape == (64, 127, 3)
    assert rejected(data[: len(data) * 2 // 3]).reason == Reason.CORRUPT


def test_unexpected_exceptions_become_corrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a decoder bug")

    monkeypatch.setattr(decode_module, "_decode", broken)
    error = rejected(b"anything")
    assert error.reason == Reason.CORRUPT and "ZeroDivisionError" in error.detail


# --------------------------------------------------------------------------------------------------
# Time limit


def test_timeout_gives_up_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    finished = threading.Event()

    def stuck(*args, **kwargs):
        release.wait(10)
        finished.set()
        raise ImageRejected(Reason.CORRUPT, "released")

    monkeypatch.setattr(decode_module, "_decode", stuck)
    before = abandoned_decodes()
    start = time.perf_counter()
    error = rejected(b"\x89PNG", timeout_s=0.2)
    assert error.reason == Reason.DECODE_TIMEOUT
    assert 0.2 <= time.perf_counter() - start < 2.0
    assert abandoned_decodes() == before + 1
    release.set()
    assert finished.wait(5)
    deadline = time.monotonic() + 5
    while abandoned_decodes() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned_decodes() == before


def test_timeout_path_returns_results_and_rejections() -> None:
    data = encode(Image.fromarray(photo()), "PNG")
    with_limit = decode_image(data, timeout_s=10)
    assert isinstance(with_limit, DecodedImage)
    assert np.array_equal(with_limit.rgb, decode_image(data).rgb)
    assert rejected(b"", timeout_s=10).reason == Reason.EMPTY
    assert rejected(data[:40], timeout_s=10).reason == Reason.TRUNCATED
