"""The benchmark-only encoder of ``benchmarks.fixed_encoder`` (issue 43 item 3): what it returns, and
that the product cannot select it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from benchmarks.fixed_encoder import FixedEncoder
from workers.config import PipelineConfig

ROOT = Path(__file__).resolve().parent.parent


def test_it_returns_distinct_unit_vectors_of_the_architectures_size_for_images_and_texts():
    enc = FixedEncoder(PipelineConfig(pretrained="random"))
    assert enc.embed_dim == 512 and enc.preprocess_config.size == (224, 224)
    pixels = torch.stack([torch.full((3, 224, 224), v) for v in (0.0, 0.5, -1.0)])
    pixels[2, :, :112] = 1.0
    vectors = enc.encode_images(pixels)
    assert vectors.shape == (3, 512) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert len({v.tobytes() for v in vectors}) == 3  # distinct pictures, distinct vectors (a uniform one too)
    np.testing.assert_array_equal(enc.encode_images(pixels), vectors)  # deterministic
    texts = enc.encode_texts(["a dog", "a cat", "a dog"])
    assert texts.shape == (3, 512) and np.allclose(texts[0], texts[2]) and not np.allclose(texts[0], texts[1])


def test_nothing_the_product_runs_can_select_it():
    """Only a process started through ``benchmarks.fixed_encoder`` gets it: no product module names it,
    and no configuration option does (``tests/test_import_direction.py`` keeps the product from
    importing ``benchmarks`` at all)."""
    for package in ("embeddings", "workers", "project", "queueing", "scripts"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert "fixed_encoder" not in text and "FixedEncoder" not in text, path
    assert "fixed" not in " ".join(PipelineConfig.__dataclass_fields__).lower()
