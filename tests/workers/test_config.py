"""The one configuration object: parsing, validation, derived names."""
import pytest

from project.configuration import pipeline_config
from workers.config import PipelineConfig


def test_defaults_and_derived_names():
    cfg = PipelineConfig()
    assert (cfg.model_name, cfg.pretrained, cfg.batch_size) == ("ViT-B-32", "laion2b_s34b_b79k", 64)
    assert cfg.model_id == "ViT-B-32/laion2b_s34b_b79k/fp32"
    assert cfg.collection_name == "clip_vit_b_32_laion2b_s34b_b79k_fp32"
    assert PipelineConfig(pretrained="random", seed=3).model_id == "ViT-B-32/random-seed3/fp32"
    assert PipelineConfig(precision="bf16").collection_name.endswith("_bf16")


def test_pipeline_config_reads_the_environment():
    cfg = pipeline_config({"CLIP_PRETRAINED": "random", "BULK_BATCH_SIZE": "16", "CLIP_PRECISION": "bf16",
                           "TORCH_THREADS": "2", "INTERACTIVE_MAX_QUEUE_DELAY_MS": "2.5"})
    assert (cfg.pretrained, cfg.batch_size, cfg.precision, cfg.torch_threads) == ("random", 16, "bf16", 2)
    assert cfg.interactive_max_queue_delay_ms == 2.5
    with pytest.raises(ValueError, match="BULK_BATCH_SIZE"):
        pipeline_config({"BULK_BATCH_SIZE": "many"})


@pytest.mark.parametrize("bad", [dict(precision="int8"), dict(device="tpu"), dict(precision="fp16"), dict(batch_size=0)])
def test_invalid_values_are_refused(bad):
    with pytest.raises(ValueError):
        PipelineConfig(**bad)


# --- precision follows the hardware (issue 9, kind 6) -----------------------------------------------

from workers.config import Hardware, emulated_precision_warning, read_cpuinfo, resolve_precision  # noqa: E402

AVX2_ONLY = Hardware(cpu_model="AMD EPYC 7B13", cpu_flags=frozenset({"sse4_2", "avx", "avx2", "fma"}))
AVX512_BF16 = Hardware(cpu_model="AMD EPYC 9B14", cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = Hardware(cpu_model="Intel Xeon Platinum 8481C",
               cpu_flags=frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile", "amx_int8"}))
AVX512_NO_BF16 = Hardware(cpu_model="Intel Xeon Platinum 8259CL", cpu_flags=frozenset({"avx2", "avx512f"}))


@pytest.mark.parametrize(("hardware", "expected"), [(AVX2_ONLY, "fp32"), (AVX512_NO_BF16, "fp32"),
                                                    (AVX512_BF16, "bf16"), (AMX, "bf16"), (Hardware(), "fp32")])
def test_auto_is_bf16_only_where_the_cpu_computes_it_natively(hardware, expected):
    assert resolve_precision("auto", "cpu", hardware=hardware) == expected
    cfg = pipeline_config({"CLIP_PRETRAINED": "random"}, hardware=hardware)  # CLIP_PRECISION unset: auto
    assert cfg.precision == expected
    assert cfg.model_id == f"ViT-B-32/random-seed0/{expected}"  # resolved before it names anything
    assert cfg.collection_name == f"clip_vit_b_32_random_seed0_{expected}"


def test_an_explicit_precision_is_kept_whatever_the_hardware():
    for requested in ("fp32", "bf16"):
        assert resolve_precision(requested, "cpu", hardware=AVX2_ONLY) == requested
        assert pipeline_config({"CLIP_PRECISION": requested}, hardware=AVX512_BF16).precision == requested
    assert pipeline_config({"CLIP_PRECISION": "fp16", "CLIP_DEVICE": "cuda"}, hardware=Hardware()).precision \
        == "fp16"
    with pytest.raises(ValueError, match="auto, fp32, bf16 or fp16"):
        pipeline_config({"CLIP_PRECISION": "bf17"}, hardware=AVX2_ONLY)


@pytest.mark.parametrize(("capabilities", "expected"), [((), "fp32"), (((7, 5),), "fp32"), (((8, 0),), "bf16"),
                                                        (((9, 0), (9, 0)), "bf16"), (((9, 0), (7, 0)), "fp32")])
def test_auto_on_cuda_follows_the_gpus_compute_capability(capabilities, expected):
    # CPU flags do not matter on CUDA; NVML's order need not be CUDA's, so every GPU must qualify
    hardware = Hardware(cpu_model="x", cpu_flags=AMX.cpu_flags, cuda_capabilities=capabilities)
    assert resolve_precision("auto", "cuda", hardware=hardware) == expected


def test_the_constructor_resolves_auto_on_this_machine_and_defaults_to_fp32():
    assert PipelineConfig().precision == "fp32"  # library default: the same on every machine
    cfg = PipelineConfig(precision="auto")
    assert cfg.precision in ("fp32", "bf16") and cfg.replace(seed=1).precision == cfg.precision


def test_cpuinfo_is_read_without_torch(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\n"
                    "flags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nmodel name\t: other\n"
                    "flags\t\t: fpu\n")
    assert read_cpuinfo(info) == ("AMD EPYC 9B14", frozenset({"fpu", "sse", "avx2", "avx512f", "avx512_bf16"}))
    assert read_cpuinfo(tmp_path / "missing") == ("", frozenset())


def test_explicit_bf16_on_emulating_hardware_gets_a_warning_naming_the_cpu():
    cfg = PipelineConfig(precision="bf16")
    warning = emulated_precision_warning(cfg, hardware=AVX2_ONLY)
    assert warning is not None and "AMD EPYC 7B13" in warning and "avx2" in warning and "SLOWER" in warning
    assert emulated_precision_warning(cfg, hardware=AVX512_BF16) is None
    assert emulated_precision_warning(PipelineConfig(), hardware=AVX2_ONLY) is None  # fp32: nothing to say


def test_every_benchmark_header_names_the_cpu_its_flags_and_what_auto_picks(monkeypatch):
    import benchmarks._common as common
    from workers import config as config_module

    monkeypatch.setattr(config_module, "detect_hardware", lambda cuda=False: AVX2_ONLY)
    info = common.machine()
    assert info["cpu"] == "AMD EPYC 7B13" and info["precision_auto"] == "fp32"
    assert info["cpu_flags"] == {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False,
                                 "amx_tile": False}
    assert common.machine_line(info).startswith(
        f"CPU: AMD EPYC 7B13, {info['cores']} cores; flags: avx2 (no avx512f, avx512_bf16, amx_bf16, amx_tile); "
        "CLIP_PRECISION=auto -> fp32")
