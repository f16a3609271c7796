"""Property test: mutated real files never crash, hang or over-allocate the decoder.

Seeds are small real files from the shared set (baseline and progressive JPEG, JPEG with EXIF
orientation, palette+tRNS and 16-bit RGBA PNG, transparent GIF, WebP with EXIF and with alpha, RLE
BMP, TIFF). Hypothesis applies bit flips, truncations, byte insertions and header overwrites; for
every result ``decode_image`` must either return a well-formed :class:`DecodedImage` within the
pixel limit, or raise :class:`ImageRejected` (never another exception), and never hit the time
limit. Runs derandomised (same examples every run, no example database written) so CI is stable.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.decode import DecodedImage, decode_image
from workers.errors import ImageRejected, Reason

from tests.conftest import IMAGES as DATA  # ../shared/data/images, or $SHARED_DIR/data/images

SEEDS = (
    "photos/triton_car.jpg",  # baseline JPEG, 8 KB
    "photos/clipretrieval_208_495.jpg",  # progressive JPEG, 18 KB
    "odd/jpeg_exif_orientation_8_tiny__orientation_rectangle.jpg",  # EXIF orientation 8
    "odd/png_palette_trns__tbbn3p08.png",
    "odd/png_16bit_rgba__basn6a16.png",
    "odd/gif_transparent__transparent.gif",
    "odd/webp_exif_orientation_6__hopper_orientation_6.webp",
    "odd/webp_alpha__transparent.webp",
    "odd/bmp_rle8__pal8rle.bmp",
    "odd/tiff_lzw__hopper_lzw.tif",
)

pytestmark = pytest.mark.skipif(
    not all((DATA / s).is_file() for s in SEEDS), reason=f"shared image data not found at {DATA}"
)

MAX_PIXELS = 1_000_000  # small, so a mutated header cannot make the test allocate much
MAX_BYTES = 1 << 20
TIMEOUT_S = 10.0  # far above any honest decode of these files (< 50 ms); hitting it is a hang


def _seed_bytes() -> list[bytes]:
    return [(DATA / s).read_bytes() if (DATA / s).is_file() else b"" for s in SEEDS]


SEED_BYTES = _seed_bytes()

# One mutation: (kind, position as a fraction of the length, a byte or bit, inserted bytes).
mutation = st.tuples(
    st.sampled_from(["flip", "truncate", "insert", "overwrite_header", "delete"]),
    st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
    st.integers(min_value=0, max_value=255),
    st.binary(min_size=1, max_size=16),
)


def mutate(data: bytes, mutations: list[tuple[str, float, int, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, where, value, blob in mutations:
        if not out:
            break
        pos = min(int(where * len(out)), len(out) - 1)
        if kind == "flip":
            out[pos] ^= 1 << (value % 8)
        elif kind == "truncate":
            del out[pos:]
        elif kind == "insert":
            out[pos:pos] = blob
        elif kind == "delete":
            del out[pos : pos + 1 + value % 64]
        else:  # the first 64 bytes hold the sizes, depths and magic numbers decoders trust
            out[min(int(where * 64), len(out) - 1)] = value
    return bytes(out)


def check_result(data: bytes, min_side: int | None) -> None:
    try:
        result = decode_image(data, max_pixels=MAX_PIXELS, max_bytes=MAX_BYTES, min_side=min_side, timeout_s=TIMEOUT_S)
    except ImageRejected as e:
        assert isinstance(e.reason, Reason)
        assert e.reason != Reason.DECODE_TIMEOUT, f"decode hung: {e}"
        return
    assert isinstance(result, DecodedImage)
    rgb = result.rgb
    assert isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3
    assert rgb.flags.c_contiguous
    assert result.width > 0 and result.height > 0 and rgb.shape[0] > 0 and rgb.shape[1] > 0
    assert result.width * result.height <= MAX_PIXELS
    assert rgb.shape[:2] == (math.ceil(result.height / result.scale), math.ceil(result.width / result.scale))


@settings(
    max_examples=1000, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    seed=st.integers(min_value=0, max_value=len(SEEDS) - 1),
    mutations=st.lists(mutation, min_size=1, max_size=4),
    min_side=st.sampled_from([None, 16]),
)
def test_mutated_real_files_decode_or_are_rejected(seed: int, mutations: list, min_side: int | None) -> None:
    check_result(mutate(SEED_BYTES[seed], mutations), min_side)


MAGICS = (
    b"\xff\xd8\xff",
    b"\x89PNG\r\n\x1a\n",
    b"GIF89a",
    b"RIFF\x00\x10\x00\x00WEBPVP8 ",
    b"II*\x00",
    b"BM\x00\x00\x00\x00\x00\x00\x00\x00\x36\x00\x00\x00\x28\x00\x00\x00",
    b"\x00\x00\x01\x00\x01\x00",
    b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf",
    b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic",
    b"qoif",
    b"8BPS",
    b"P6\n",
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(magic=st.sampled_from(MAGICS), tail=st.binary(max_size=512))
def test_random_bytes_behind_a_magic_number(magic: bytes, tail: bytes) -> None:
    check_result(magic + tail, None)
