"""Unit tests of :mod:`workers.containers`: container structure read without decoding pixels.

End-to-end refusals (truncation, pixel limits, unsupported variants) are exercised through
:func:`workers.decode.decode_image` in ``test_decode.py``.
"""
from __future__ import annotations

import pytest

from workers import decode as decode_module
from workers.containers import sniff_format

# --------------------------------------------------------------------------------------------------
# Sniffing


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "jpeg"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR", "png"),
        (b"GIF89a\x01\x00", "gif"),
        (b"GIF87a\x01\x00", "gif"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "webp"),
        (b"II*\x00\x08\x00\x00\x00", "tiff"),
        (b"MM\x00*\x00\x00\x00\x08", "tiff"),
        (b"BM" + b"\x00" * 12 + b"\x28\x00\x00\x00", "bmp"),
        (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "jpeg2000"),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf", "avif"),
        (b"\x00\x00\x00\x1cftypmif1\x00\x00\x00\x00mif1avifmiaf", "avif"),  # AVIF under a mif1 major brand
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "heif"),
        (b"qoif\x00\x00\x00\x01", "qoi"),
        (b"8BPS\x00\x01", "psd"),
        (b"\x00\x00\x01\x00\x01\x00", "ico"),
        (b"P5\n128 128\n255\n", "pnm"),
        (b"Pf\n1 1\n-1.0\n", "pnm"),
        (b"\xff\x0a\xfa", "jxl"),
        (b"%!PS-Adobe-3.0 EPSF", "eps"),
        (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "svg"),
        (b"", None),
        (b"hello, world", None),
        (b"BM is a band name, not a bitmap", None),
        (b"P5 is a paper size", None),
        (b"%PDF-1.7\n", None),
        (b"\x00\x00\x00\x18ftypisom\x00\x00\x00\x00isomiso2", None),  # an MP4 video
        (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", None),  # OLE2 (.doc)
    ],
)
def test_sniff_format(head: bytes, expected: str | None) -> None:
    assert sniff_format(head) == expected
    assert decode_module.sniff_format is sniff_format  # still re-exported by workers.decode
