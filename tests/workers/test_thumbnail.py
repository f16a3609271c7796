"""Thumbnails: size and format, drawn from the runner's decode hook, a failing hook fails nothing."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from workers.thumbnail import LONG_SIDE, thumbnail_bytes, thumbnail_size, thumbnail_source


def rgb_gradient(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), np.full_like(x, 90)], -1).astype(np.uint8)


def decode_jpeg(data: bytes) -> np.ndarray:
    assert data[:3] == b"\xff\xd8\xff"
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


@pytest.mark.parametrize(("size", "expected"), [
    ((1000, 600), (256, 154)), ((600, 1000), (154, 256)), ((256, 256), (256, 256)),
    ((100, 40), (100, 40)), ((60000, 1), (256, 1)), ((1, 60000), (1, 256)),
])
def test_thumbnail_size_scales_the_long_side_and_never_enlarges(size, expected):
    assert thumbnail_size(*size) == expected


def test_thumbnail_size_refuses_an_empty_picture():
    with pytest.raises(ValueError, match="positive"):
        thumbnail_size(0, 10)


def test_thumbnail_is_a_small_jpeg_of_the_picture():
    rgb = rgb_gradient(1200, 1600)
    data = thumbnail_bytes(rgb)
    out = decode_jpeg(data)
    assert out.shape == (192, 256, 3)
    assert len(data) < 30_000  # ≤ 1.5 MB for a 50-result grid needs < 30 KB each
    reference = cv2.resize(rgb, (256, 192), interpolation=cv2.INTER_AREA).astype(int)
    assert np.abs(out.astype(int) - reference).mean() < 4  # lossy, but the same picture and colours


def test_a_small_picture_keeps_its_size():
    assert decode_jpeg(thumbnail_bytes(rgb_gradient(40, 100))).shape == (40, 100, 3)


def test_thumbnail_refuses_what_is_not_rgb():
    with pytest.raises(ValueError, match="uint8"):
        thumbnail_bytes(np.zeros((10, 10), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        thumbnail_bytes(np.zeros((10, 10, 3), np.float32))


def test_thumbnail_source_shrinks_a_tensor_on_its_device():
    chw = torch.from_numpy(rgb_gradient(2000, 3000)).permute(2, 0, 1).contiguous()
    small = thumbnail_source(chw)
    assert small.shape == (341, 512, 3) and small.dtype == np.uint8
    assert decode_jpeg(thumbnail_bytes(small)).shape == (170, 256, 3)  # 341 × 256/512, rounded


def test_the_runner_hands_each_decoded_picture_to_the_hook_once(runner):
    pictures = {"wide": rgb_gradient(300, 500), "tall": rgb_gradient(500, 300)}
    blobs = {k: cv2.imencode(".png", cv2.cvtColor(v, cv2.COLOR_RGB2BGR))[1].tobytes() for k, v in pictures.items()}
    blobs["text"] = b"not an image at all"
    seen: dict[str, list] = {}

    def hook(key, rgb, meta):
        assert (meta.key, meta.width, meta.height) == (key, *pictures[key].shape[1::-1])
        seen.setdefault(key, []).append(rgb)

    result = runner.run(list(blobs), blobs.__getitem__, hook)
    assert [m.key for m in result.metas] == ["wide", "tall"] and [f.key for f in result.failed] == ["text"]
    assert sorted(seen) == ["tall", "wide"] and all(len(v) == 1 for v in seen.values())
    for key, rgb in pictures.items():
        assert np.array_equal(seen[key][0], rgb)  # upright RGB, exactly what was decoded
    assert max(decode_jpeg(thumbnail_bytes(seen["wide"][0])).shape[:2]) == LONG_SIDE


def test_a_failing_hook_fails_no_image(runner):
    data = cv2.imencode(".png", rgb_gradient(240, 320))[1].tobytes()

    def hook(key, rgb, meta):
        raise OSError("disk full")

    result = runner.run(["a", "b"], lambda key: data, hook)
    assert [m.key for m in result.metas] == ["a", "b"] and result.failed == []
    assert result.vectors.shape == (2, 512)
