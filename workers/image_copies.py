"""Degraded copies of an image (re-encoded, resized, cropped, grey, watermarked): what a catalogue's
near-duplicates are made of. The duplicate threshold is calibrated on copies of the catalogue's own
images (``embeddings.services.duplicates.calibration``); the labelled benchmark
(``benchmarks/duplicates.py``) builds its true groups from them.

Every copy is JPEG bytes of an upright RGB picture (``workers.decode.decode_image`` first).
"""
from __future__ import annotations

import cv2
import numpy as np

#: Copy kinds and what their ``amount`` means: ``jpeg`` quality (1–100), ``resize`` the side
#: factor (0–1], ``crop`` the kept share of each side, centred (0–1], ``grey`` none (ignored),
#: ``watermark`` the mark's height as a share of the picture's.
KINDS = ("jpeg", "resize", "crop", "grey", "watermark")

#: The copies a calibration makes of each sampled image: the quality gate's re-encoded copy
#: (3/4 of each side, JPEG 85, ``lifecycle.gate``), a low-quality save, a half-size thumbnail and a
#: shop's mark in a corner: copies that a person calls "the same photo". Crops and greyscale are
#: left out: a model may place them as far as merely similar pictures (measured:
#: docs/duplicates-benchmarks.md), and the threshold is for precision first.
CALIBRATION_COPIES = (("resize", 0.75), ("jpeg", 50), ("resize", 0.5), ("watermark", 0.06))

#: JPEG quality of every copy that is not itself a ``jpeg`` copy (the gate's figure).
DEFAULT_QUALITY = 85


def _jpeg(rgb: np.ndarray, quality: int = DEFAULT_QUALITY) -> bytes:
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:  # pragma: no cover - OpenCV encodes any uint8 RGB array
        raise ValueError("OpenCV could not encode the copy as JPEG")
    return buf.tobytes()


def copy_of(rgb: np.ndarray, kind: str, amount: float = 0.0) -> bytes:
    """A copy of ``rgb`` (``(H, W, 3) uint8``, upright) of ``kind`` (:data:`KINDS`), as JPEG bytes.

    Raises:
        ValueError: an unknown kind, or an amount outside its range.
    """
    h, w = rgb.shape[:2]
    if kind == "jpeg":
        if not 1 <= amount <= 100:
            raise ValueError(f"JPEG quality must be in [1, 100], got {amount}")
        return _jpeg(rgb, int(amount))
    if kind in ("resize", "crop", "watermark") and not 0 < amount <= 1:
        raise ValueError(f"a {kind} amount must be in (0, 1], got {amount}")
    if kind == "resize":
        size = (max(1, round(w * amount)), max(1, round(h * amount)))
        return _jpeg(cv2.resize(rgb, size, interpolation=cv2.INTER_AREA))
    if kind == "crop":
        ch, cw = max(1, round(h * amount)), max(1, round(w * amount))
        y, x = (h - ch) // 2, (w - cw) // 2
        return _jpeg(np.ascontiguousarray(rgb[y:y + ch, x:x + cw]))
    if kind == "grey":
        g = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
        return _jpeg(cv2.cvtColor(g, cv2.COLOR_GRAY2RGB))
    if kind == "watermark":
        # a shop's mark: white text on a dark band in the bottom-right corner
        marked = rgb.copy()
        band = max(4, round(h * amount))
        x0 = w - min(w, band * 5)
        marked[h - band:, x0:] = (marked[h - band:, x0:] * 0.4).astype(np.uint8)
        cv2.putText(marked, "(c) shop", (x0 + band // 4, h - band // 4), cv2.FONT_HERSHEY_SIMPLEX,
                    band / 40, (255, 255, 255), max(1, band // 12), cv2.LINE_AA)
        return _jpeg(marked)
    raise ValueError(f"unknown copy kind {kind!r}: expected one of {', '.join(KINDS)}")
