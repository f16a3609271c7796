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
