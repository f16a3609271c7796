"""The image tower on another runtime (workers/backends.py): same vectors as open_clip, cache, fallbacks."""
from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

from tests.conftest import needs_shared, photo_paths
from workers import backends
from workers.backends import ADOPTED_CPU_BACKEND, build_image_tower, resolve_backend
from workers.config import PipelineConfig

#: Every backend's bound to open_clip's own vectors at the same precision, per image (workers.backends).
MIN_COSINE = 0.999
#: The backend under test: the one ``auto`` adopts, else the fastest alternative measured (OpenVINO).
BACKEND = ADOPTED_CPU_BACKEND or "openvino"


@pytest.fixture(scope="module")
def adopted(random_config, tmp_path_factory):
    """A bf16 encoder whose image tower runs on :data:`BACKEND` (one export for the module)."""
    pytest.importorskip(BACKEND)
    from workers.model import ClipEncoder

    cache = tmp_path_factory.mktemp("model-cache")
    enc = ClipEncoder(random_config.replace(precision="bf16", backend=BACKEND, backend_cache_dir=str(cache)))
    assert enc.backend == BACKEND and not enc.image_tower.stats.from_cache
    return enc


@pytest.fixture(scope="module")
def photo_pixels(encoder):
    """Every fourth real photo, decoded and preprocessed as the pipeline does: ``(21, 3, 224, 224) float32``."""
    from workers.decode import decode_image
    from workers.preprocess import preprocess_batch

    cfg = encoder.preprocess_config
    return preprocess_batch([decode_image(p.read_bytes(), min_side=cfg.min_side).rgb for p in photo_paths()[::4]], cfg)


@needs_shared
def test_the_backend_keeps_open_clips_vectors_on_real_photos(adopted, encoder, random_config, photo_pixels):
    from workers.model import ClipEncoder

    torch_bf16 = ClipEncoder(random_config.replace(precision="bf16", backend="torch"))
    assert torch_bf16.image_tower is None
    got = adopted.encode_images(photo_pixels)
    assert got.shape == (len(photo_pixels), 512) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    same_space = (got * torch_bf16.encode_images(photo_pixels)).sum(axis=1)
    fp32 = (got * encoder.encode_images(photo_pixels)).sum(axis=1)
    assert len(same_space) == 21 and same_space.min() >= MIN_COSINE, same_space.min()
    assert fp32.min() >= MIN_COSINE, fp32.min()
    # the text tower stays open_clip's: identical to the torch encoder's
    np.testing.assert_array_equal(adopted.encode_texts(["a dog"]), torch_bf16.encode_texts(["a dog"]))


def _small_tower() -> torch.nn.Module:
    """A tower of the ViT's first and last kinds of layer (patch conv, projection): the cache's
    behaviour without the cost of exporting a ViT again."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 32, stride=32), torch.nn.Flatten(), torch.nn.Linear(8 * 7 * 7, 16))


def test_a_second_build_loads_the_cached_export_and_a_corrupt_one_is_made_again(tmp_path, caplog):
    pytest.importorskip(BACKEND)
    kwargs = {"model_name": "small", "weights_id": "random-seed0", "precision": "fp32", "image_size": 224,
              "threads": 1, "cache_dir": tmp_path}
    first = build_image_tower(BACKEND, _small_tower(), **kwargs)
    again = build_image_tower(BACKEND, _small_tower(), **kwargs)
    assert not first.stats.from_cache and first.stats.export_s > 0
    assert again.stats.from_cache and again.stats.export_s == 0 and again.stats.path == first.stats.path
    assert [p.name for p in tmp_path.iterdir()] == [first.stats.path.name]  # one entry, no temporaries left
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    expected = _small_tower()(x).detach().numpy()
    np.testing.assert_allclose(again(x.numpy()), expected, rtol=0, atol=1e-4)
    other = build_image_tower(BACKEND, _small_tower(), **{**kwargs, "weights_id": "random-seed1"})
    assert not other.stats.from_cache and len(list(tmp_path.iterdir())) == 2  # other weights, other entry

    graph = next(p for p in first.stats.path.iterdir() if p.suffix in (".xml", ".onnx"))
    graph.write_bytes(b"not a model")  # a truncated or foreign file
    with caplog.at_level(logging.WARNING, logger="workers.backends"):
        rebuilt = build_image_tower(BACKEND, _small_tower(), **kwargs)
    assert rebuilt is not None and not rebuilt.stats.from_cache and rebuilt.stats.export_s > 0
    assert "does not load" in caplog.text and "exporting it again" in caplog.text
    np.testing.assert_allclose(rebuilt(x.numpy()), expected, rtol=0, atol=1e-4)


def test_a_missing_backend_falls_back_to_torch_with_a_warning(encoder, random_config, monkeypatch, caplog, tmp_path):
    from workers.model import ClipEncoder

    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    with caplog.at_level(logging.WARNING, logger="workers.backends"):
        enc = ClipEncoder(random_config.replace(backend="openvino", backend_cache_dir=str(tmp_path)))
    assert enc.backend == "torch" and enc.image_tower is None
    assert "MODEL_BACKEND openvino is not installed" in caplog.text and "runs on torch" in caplog.text
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(enc.encode_images(x), encoder.encode_images(x))
    assert resolve_backend("auto", "cpu") == "torch"  # auto never picks what is not installed
    assert list(tmp_path.iterdir()) == []


def test_a_backend_that_fails_to_compile_falls_back_to_torch(monkeypatch, caplog, tmp_path):
    pytest.importorskip("onnxruntime")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this operator")

    monkeypatch.setattr(backends, "_build_onnxruntime", broken)
    with caplog.at_level(logging.WARNING, logger="workers.backends"):
        tower = build_image_tower("onnxruntime", torch.nn.Identity(), model_name="ViT-B-32", weights_id="random-seed0",
                                  precision="fp32", image_size=224, threads=1, cache_dir=tmp_path)
    assert tower is None
    assert "onnxruntime could not build the image tower of ViT-B-32 (RuntimeError: no kernel" in caplog.text


def test_backend_choices_are_validated_and_resolved(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of auto, torch, openvino, onnxruntime, not 'tensorrt'"):
        PipelineConfig(backend="tensorrt")
    with pytest.raises(ValueError, match="auto, torch, openvino, onnxruntime"):
        resolve_backend("tensorrt", "cpu")
    assert PipelineConfig().backend == "torch"
    assert resolve_backend("auto", "cpu", installed=lambda b: True) == (ADOPTED_CPU_BACKEND or "torch")
    assert resolve_backend("auto", "cpu", installed=lambda b: False) == "torch"
    assert resolve_backend("auto", "cuda", installed=lambda b: True) == "torch"
    monkeypatch.setattr(backends, "ADOPTED_CPU_BACKEND", "openvino")  # once one is adopted, auto runs it on the CPU
    assert resolve_backend("auto", "cpu", installed=lambda b: True) == "openvino"
    assert resolve_backend("auto", "cpu", installed=lambda b: False) == "torch"
    assert resolve_backend("auto", "cuda", installed=lambda b: True) == "torch"
    assert resolve_backend("onnxruntime", "cuda") == "torch"
    assert resolve_backend("onnxruntime", "cpu") == "onnxruntime"
    assert build_image_tower("torch", torch.nn.Identity(), model_name="m", weights_id="w", precision="fp32",
                             image_size=224, threads=1) is None
