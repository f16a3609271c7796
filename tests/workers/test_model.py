"""Model loading: explicit random weights, checkpoint files, clear errors; encoders' outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.config import PipelineConfig
from workers.model import ClipEncoder, EncoderHolder, TextTowerMissing, WeightsUnavailable


def test_embeddings_are_unit_norm_float32(encoder):
    x = torch.randn(3, 3, 224, 224)
    v = encoder.encode_images(x)
    assert v.shape == (3, 512) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    t = encoder.encode_texts(["a dog", "a cat"])
    assert t.shape == (2, 512) and t.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, atol=1e-5)
    with pytest.raises(ValueError):
        encoder.encode_texts([])


def test_random_weights_are_seeded_and_deterministic(encoder, random_config):
    """Two processes with the same seed must produce the same vectors (interactive vs bulk worker)."""
    other = ClipEncoder(random_config)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(encoder.encode_images(x), other.encode_images(x))
    reseeded = ClipEncoder(random_config.replace(seed=1))
    assert not np.allclose(encoder.encode_images(x), reseeded.encode_images(x))


def test_checkpoint_file_loads_through_the_checkpoint_path(encoder, tmp_path):
    path = tmp_path / "vit-b-32.pt"
    torch.save(encoder.model.state_dict(), path)
    cfg = PipelineConfig(pretrained=str(path))
    assert cfg.is_checkpoint_file and cfg.weights_id.startswith("file-")
    loaded = ClipEncoder(cfg)
    x = torch.randn(2, 3, 224, 224)
    np.testing.assert_allclose(loaded.encode_images(x), encoder.encode_images(x), atol=1e-6)
    assert cfg.model_id == f"ViT-B-32/{cfg.weights_id}/fp32"


def test_an_image_tower_checkpoint_is_a_space_without_texts(encoder, tmp_path):
    path = tmp_path / "visual-only.pt"
    torch.save({f"visual.{k}": v for k, v in encoder.model.visual.state_dict().items()}, path)
    loaded = ClipEncoder(PipelineConfig(pretrained=str(path)))
    assert loaded.has_text is False and encoder.has_text is True
    x = torch.randn(2, 3, 224, 224)
    np.testing.assert_allclose(loaded.encode_images(x), encoder.encode_images(x), atol=1e-6)
    with pytest.raises(TextTowerMissing, match="only an image tower") as e:
        loaded.encode_texts(["a dog"])
    assert e.value.code == "text_tower_missing"
    # an image tower that does not fit the architecture is refused, never half loaded
    torch.save({"visual.proj": torch.zeros(3, 3)}, path)
    with pytest.raises(WeightsUnavailable, match="does not load"):
        ClipEncoder(PipelineConfig(pretrained=str(path)))


def test_missing_checkpoint_names_the_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="open_clip tag .* or 'random'"):
        ClipEncoder(PipelineConfig(pretrained=str(tmp_path / "missing.pt")))


def test_unknown_tag_names_the_known_ones():
    with pytest.raises(WeightsUnavailable, match="laion2b_s34b_b79k"):
        ClipEncoder(PipelineConfig(pretrained="no_such_tag"))


def test_known_tag_without_network_fails_loudly_never_random(monkeypatch):
    """A real tag that cannot be downloaded is an error naming the options, not a silent fallback."""
    import open_clip

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(open_clip, "create_model", offline)
    with pytest.raises(WeightsUnavailable, match="checkpoint file or 'random'|'random' for seeded"):
        ClipEncoder(PipelineConfig(pretrained="laion2b_s34b_b79k"))


def test_holder_loads_once(random_config):
    holder = EncoderHolder(random_config)
    assert not holder.loaded
    assert holder.get() is holder.get()
    assert holder.loaded


def test_bf16_is_close_to_fp32(encoder, random_config):
    bf16 = ClipEncoder(random_config.replace(precision="bf16"))
    x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    cos = (encoder.encode_images(x) * bf16.encode_images(x)).sum(axis=1)
    assert cos.min() >= 0.99
