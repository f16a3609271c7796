"""The one configuration object: parsing, validation, derived names."""
import pytest

from workers.config import PipelineConfig


def test_defaults_and_derived_names():
    cfg = PipelineConfig()
    assert (cfg.model_name, cfg.pretrained, cfg.batch_size) == ("ViT-B-32", "laion2b_s34b_b79k", 64)
    assert cfg.model_id == "ViT-B-32/laion2b_s34b_b79k/fp32"
    assert cfg.collection_name == "clip_vit_b_32_laion2b_s34b_b79k_fp32"
    assert PipelineConfig(pretrained="random", seed=3).model_id == "ViT-B-32/random-seed3/fp32"
    assert PipelineConfig(precision="bf16").collection_name.endswith("_bf16")


def test_from_env():
    cfg = PipelineConfig.from_env({"CLIP_PRETRAINED": "random", "BULK_BATCH_SIZE": "16", "CLIP_PRECISION": "bf16",
                                   "TORCH_THREADS": "2", "INTERACTIVE_MAX_QUEUE_DELAY_MS": "2.5"})
    assert (cfg.pretrained, cfg.batch_size, cfg.precision, cfg.torch_threads) == ("random", 16, "bf16", 2)
    assert cfg.interactive_max_queue_delay_ms == 2.5
    with pytest.raises(ValueError, match="BULK_BATCH_SIZE"):
        PipelineConfig.from_env({"BULK_BATCH_SIZE": "many"})


@pytest.mark.parametrize("bad", [dict(precision="int8"), dict(device="tpu"), dict(precision="fp16"), dict(batch_size=0)])
def test_invalid_values_are_refused(bad):
    with pytest.raises(ValueError):
        PipelineConfig(**bad)
