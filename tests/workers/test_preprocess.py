"""Preprocessing equals open_clip's own pipeline: cosine >= 0.999 on every real photo."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tests.conftest import needs_shared, photo_paths
from workers.decode import ALPHA_BACKGROUND, decode_image
from workers.preprocess import PreprocessConfig, preprocess, preprocess_batch, resize_and_crop


def reference_pil(path) -> Image.Image:
    """open_clip's reference input: PIL, upright (exif_transpose), alpha on the same background."""
    im = ImageOps.exif_transpose(Image.open(path))
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        bg = Image.new("RGBA", im.size, ALPHA_BACKGROUND + (255,))
        im = Image.alpha_composite(bg, im.convert("RGBA"))
    return im.convert("RGB")


def test_config_is_read_from_the_model(encoder):
    import open_clip

    cfg = encoder.preprocess_config
    want = open_clip.get_model_preprocess_cfg(encoder.model)
    assert cfg.size == tuple(want["size"]) == (224, 224)
    assert cfg.mean == tuple(want["mean"]) and cfg.std == tuple(want["std"])
    assert (cfg.interpolation, cfg.resize_mode) == ("bicubic", "shortest")


def test_output_shape_dtype_and_order(encoder):
    cfg = encoder.preprocess_config
    rgb = np.zeros((300, 500, 3), np.uint8)
    rgb[..., 0] = 255  # pure red
    x = preprocess(rgb, cfg)
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    # channel 0 is red: (1 - mean) / std; channel 1 is 0: (0 - mean) / std
    assert x[0].mean().item() == pytest.approx((1 - cfg.mean[0]) / cfg.std[0], abs=1e-4)
    assert x[1].mean().item() == pytest.approx((0 - cfg.mean[1]) / cfg.std[1], abs=1e-4)
    assert preprocess_batch([rgb, rgb], cfg).shape == (2, 3, 224, 224)


def test_centre_crop_keeps_the_middle():
    cfg = PreprocessConfig(size=(224, 224), mean=(0, 0, 0), std=(1, 1, 1))
    rgb = np.zeros((224, 448, 3), np.uint8)
    rgb[:, 112:336] = 200  # the central square is bright, the sides dark
    out = resize_and_crop(rgb, cfg)
    assert out.shape == (3, 224, 224)
    assert int(out[:, :, 5:-5].min()) >= 195


def test_other_resize_modes():
    rgb = np.full((100, 200, 3), 50, np.uint8)
    base = dict(size=(224, 224), mean=(0, 0, 0), std=(1, 1, 1))
    padded = resize_and_crop(rgb, PreprocessConfig(**base, resize_mode="longest", fill_color=0))
    assert padded.shape == (3, 224, 224) and int(padded[:, 0, :].max()) == 0 and padded[:, 112, 112].tolist() == [50, 50, 50]
    squashed = resize_and_crop(rgb, PreprocessConfig(**base, resize_mode="squash"))
    assert squashed.shape == (3, 224, 224) and int(squashed.min()) == 50
    with pytest.raises(ValueError, match="resize_mode"):
        PreprocessConfig.from_open_clip({**base, "resize_mode": "zoom"})


@needs_shared
def test_matches_open_clip_reference_on_every_photo(encoder):
    """Our path (OpenCV decode, DCT-reduced where allowed, tensor resize) vs PIL + open_clip's
    transform, embedded by the same model: cosine >= 0.999 for each of the 84 photos."""
    import open_clip

    _, _, reference = open_clip.create_model_and_transforms("ViT-B-32", pretrained=None)
    cfg = encoder.preprocess_config
    paths = photo_paths()
    assert len(paths) == 84
    worst = []
    for i in range(0, len(paths), 16):
        group = paths[i : i + 16]
        ours = torch.stack([preprocess(decode_image(p.read_bytes(), min_side=cfg.min_side).rgb, cfg) for p in group])
        ref = torch.stack([reference(reference_pil(p)) for p in group])
        a, b = encoder.encode_images(ours), encoder.encode_images(ref)
        worst += [(float(np.dot(x, y)), p.name) for x, y, p in zip(a, b, group)]
    low = [w for w in worst if w[0] < 0.999]
    assert not low, f"cosine below 0.999: {sorted(low)[:5]}"


# --------------------------------------------------------------------------------------------------
# Extreme aspect ratios: bounded cost, same result (../shared/data/cases/n01_*, docs/decoding.md)

PLAIN = dict(size=(224, 224), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def stripes(height: int, width: int, seed: int = 0) -> np.ndarray:
    """``(height, width, 3) uint8`` with detail along both axes (smoothed noise plus stripes)."""
    import cv2

    rng = np.random.default_rng(seed)
    rgb = cv2.GaussianBlur(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), (0, 0), 1.5)
    rgb[..., 2] = ((np.arange(height)[:, None] // 3 + np.arange(width)[None, :] // 5) % 2) * 200
    return rgb


def open_clip_uint8(rgb: np.ndarray, resize_mode: str) -> np.ndarray:
    """open_clip's own eval transform (PIL) with mean 0 / std 1, back on the 0..255 scale."""
    import open_clip

    transform = open_clip.image_transform(224, is_train=False, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
                                          resize_mode=resize_mode, interpolation="bicubic")
    return (transform(Image.fromarray(rgb)) * 255).round().to(torch.uint8).numpy()


def assert_equal_up_to_rounding(ours: torch.Tensor, ref: np.ndarray) -> None:
    """Every value within one level, and at most 0.1 % of them off by that one level."""
    diff = np.abs(ours.numpy().astype(int) - ref.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() <= 0.001, (int(diff.max()), int((diff > 0).sum()))


@pytest.mark.parametrize("height, width", [(4000, 3), (3, 5000), (1000, 7), (9, 2000), (451, 100), (3000, 700),
                                           (1, 6000), (6000, 1)])
def test_crop_first_equals_open_clip(height, width):
    """Moderately extreme shapes that the reference can still afford (its resized image is at
    most 224 × 1.4 million pixels here; 1 × 20000 lines, 224 × 4.5 million, took 23 s of the CI's
    15 minutes and test nothing a 1 × 6000 line does not: the crop-first path is the same): ours
    equals open_clip's transform up to float rounding (in practice bit for bit on most shapes: same
    weights, same pass order as Pillow)."""
    from workers.preprocess import crop_window

    cfg = PreprocessConfig(**PLAIN)
    rgb = stripes(height, width)
    assert crop_window(height, width, cfg) is not None  # the crop-first path is the one tested
    ours = resize_and_crop(rgb, cfg)
    assert ours.shape == (3, 224, 224) and ours.dtype == torch.uint8
    assert_equal_up_to_rounding(ours, open_clip_uint8(rgb, "shortest"))


def test_crop_window_reads_only_what_the_output_needs():
    """1 × 60000 (n01): the reference would resize to 224 × 13,440,000 (9 GB); the window is a few
    source pixels. Ordinary photos (aspect ratio up to 4:1) keep the direct path."""
    from workers.preprocess import crop_window

    cfg = PreprocessConfig(**PLAIN)
    window = crop_window(60000, 1, cfg)
    assert window.cols == (0, 1)
    assert window.rows[1] - window.rows[0] == 8  # 1 source pixel of output, 2 + 1 either side (support, margin)
    assert 29995 <= window.rows[0] < 30000  # the middle of the line, as CenterCrop keeps it
    for h, w in [(3000, 4000), (1080, 1920), (224, 896), (100, 60), (500, 2000)]:
        assert crop_window(h, w, cfg) is None


def test_tensor_path_equals_array_path_on_a_line():
    """The device entry point (here a CPU tensor) crops first the same way."""
    from workers.preprocess import resize_and_crop_tensor

    cfg = PreprocessConfig(**PLAIN)
    rgb = stripes(5000, 6)
    assert torch.equal(resize_and_crop_tensor(torch.from_numpy(rgb).permute(2, 0, 1), cfg), resize_and_crop(rgb, cfg))


@pytest.mark.parametrize("resize_mode", ["squash", "longest"])
@pytest.mark.parametrize("height, width", [(6000, 40), (40, 7000), (300, 2)])
def test_other_modes_long_axis_first_and_sliced(monkeypatch, resize_mode, height, width):
    """``squash`` / ``longest`` resize the long axis first, a very long one in slices of outputs;
    both equal open_clip's transform up to the rounding between the two passes. (Thinner lines
    than these make open_clip's own ``longest`` raise: it rounds the short side to 0 pixels.)"""
    import workers.preprocess as pre

    rgb = stripes(height, width, seed=1)
    ref = open_clip_uint8(rgb, resize_mode)
    cfg = PreprocessConfig(**PLAIN, resize_mode=resize_mode)
    whole = resize_and_crop(rgb, cfg)
    monkeypatch.setattr(pre, "SLICE_OVER", 100)  # force the sliced path on these small lines
    sliced = resize_and_crop(rgb, cfg)
    for ours in (whole, sliced):
        assert ours.shape == (3, 224, 224)
        diff = np.abs(ours.numpy().astype(int) - ref.astype(int))
        assert diff.max() <= 1, int(diff.max())


def test_line_embedding_matches_open_clip(encoder):
    """Through the model: a 4000 × 3 line embeds like open_clip's pipeline (cosine >= 0.9999)."""
    import open_clip

    _, _, reference = open_clip.create_model_and_transforms("ViT-B-32", pretrained=None)
    rgb = stripes(4000, 3, seed=2)
    ours = preprocess(rgb, encoder.preprocess_config)[None]
    ref = reference(Image.fromarray(rgb))[None]
    a, b = encoder.encode_images(ours), encoder.encode_images(ref)
    assert float(np.dot(a[0], b[0])) >= 0.9999


@needs_shared
def test_n01_files_embed_within_bounds():
    """The four ``n01`` line files and the control decode and preprocess to ``(3, 224, 224)``."""
    from tests.conftest import SHARED

    cfg = PreprocessConfig(**PLAIN)
    files = sorted((SHARED / "data" / "cases").glob("n01_*"))
    assert len(files) == 5
    for path in files:
        out = preprocess(decode_image(path.read_bytes(), min_side=cfg.min_side).rgb, cfg)
        assert out.shape == (3, 224, 224), path.name
