"""Decoding routed by what the bytes are (issue 43 item 2): the route of every photo and odd file,
the CPU decode processes giving the in-process pixels and reason codes, and every way back to the
CPU path (nvImageCodec missing, a device refusing an image, a device decoder failing)."""
from __future__ import annotations

import logging
import re
import sys

import numpy as np
import pytest
import torch

from tests.conftest import IMAGES, manifest_rows, needs_shared, photo_paths
from workers.config import PipelineConfig
from workers.decode_pool import CpuDecoder, decode_for_model, planned_processes
from workers.decode_route import Route, centre_square, route, route_counts
from workers.model import EncoderHolder
from workers.runner import BatchRunner

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and nvImageCodec for the device route)")
LIMITS = {"max_pixels": 50_000_000, "max_bytes": 50 * 1024 * 1024}


def runner_for(config: PipelineConfig, encoder, **kw) -> BatchRunner:
    holder = EncoderHolder(config)
    holder._encoder = encoder
    return BatchRunner(config, holder, **kw)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1)


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in photo_paths()}


@pytest.fixture(scope="module")
def odd() -> dict[str, bytes]:
    return {r["path"]: (IMAGES / r["path"]).read_bytes() for r in manifest_rows("odd/")}


@pytest.fixture(scope="module")
def cpu_result(random_config, encoder, photos):
    """The CPU path (threads), every photo: the reference for the other routes."""
    r = runner_for(random_config, encoder)
    try:
        return r.run(list(photos), photos.__getitem__)
    finally:
        r.close()


# --- routes -----------------------------------------------------------------------------------------

@needs_shared
def test_the_photos_route_36_baseline_jpegs_to_the_device_and_the_progressive_ones_and_pngs_to_the_cpu(photos):
    assert len(photos) == 84
    assert route_counts(photos.values()) == {
        ("device_jpeg", "baseline_jpeg"): 36,  # 35 colour + 1 greyscale
        ("cpu", "progressive_jpeg"): 14,
        ("cpu", "png"): 34,
    }


@needs_shared
def test_the_odd_files_route_exactly(odd):
    assert len(odd) == 76
    assert route_counts(odd.values()) == {
        ("device_jpeg", "baseline_jpeg"): 14,
        ("cpu", "progressive_jpeg"): 1,
        ("cpu", "arithmetic_jpeg"): 1,
        ("cpu", "lossless_jpeg"): 1,
        ("cpu", "cmyk_jpeg"): 2,
        ("cpu", "png"): 17,
        ("cpu", "other_format"): 32,
        ("cpu", "refused"): 8,  # truncated, 12-bit, 280 MP, not JPEG at all...: the CPU path says why
    }


def test_route_reads_sizes_and_orientation_and_refuses_nothing_itself():
    import cv2

    img = np.zeros((30, 50, 3), np.uint8)
    base = cv2.imencode(".jpg", img)[1].tobytes()
    prog = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    r = route(base, **LIMITS)
    assert (r.route, r.why, r.format, r.width, r.height, r.orientation) == (Route.DEVICE_JPEG, "baseline_jpeg", "jpeg",
                                                                           50, 30, 1)
    assert route(prog, **LIMITS).why == "progressive_jpeg"
    assert route(cv2.imencode(".png", img)[1].tobytes(), **LIMITS).why == "png"
    for bad in (b"", b"text", base[:200]):  # empty, not an image, truncated: the CPU path says which
        assert (route(bad, **LIMITS).route, route(bad, **LIMITS).why) == (Route.CPU, "refused")
    assert route(base + b"x" * 10, **LIMITS).route is Route.DEVICE_JPEG  # data after EOI, as libjpeg allows
    assert route(base, max_pixels=1000, max_bytes=1 << 20).why == "refused"  # over a limit: the CPU refuses
    assert route(base, max_pixels=10**6, max_bytes=100).why == "refused"
    assert centre_square(50, 30) == (0, 10, 30, 40) and centre_square(30, 51) == (10, 0, 40, 30)


# --- the CPU path in processes ----------------------------------------------------------------------

@needs_shared
def test_the_decode_processes_give_the_in_process_pixels_and_reason_codes(photos, odd, encoder):
    cfg = encoder.preprocess_config
    blobs = {**dict(list(photos.items())[::2]), **odd}  # half the photos: the test stays under ~30 s
    limits = {**LIMITS, "timeout_s": 10.0}
    pool = CpuDecoder(processes=2, **limits)
    try:
        in_pool = pool.decode_many(list(blobs.values()), cfg)
    finally:
        pool.close()
    embedded = refused = 0
    for name, data, got in zip(blobs, blobs.values(), in_pool):
        here = decode_for_model(data, cfg, **limits)
        assert (got.reason, got.width, got.height, got.format) == (here.reason, here.width, here.height,
                                                                   here.format), name
        if here.reason is None:
            assert got.pixels.shape == (3, 224, 224) and np.array_equal(got.pixels, here.pixels), name
            embedded += 1
        else:
            same = re.sub(r"0x[0-9a-f]+", "0x", got.detail) == re.sub(r"0x[0-9a-f]+", "0x", here.detail)
            assert got.pixels is None and same, name  # (but for a Python object's address)
            refused += 1
    assert (embedded, refused) == (42 + 57, 19)  # 57 odd files embed (tests/workers/test_preview.py)


@needs_shared
def test_a_runner_with_decode_processes_gives_the_threads_vectors_reasons_and_preview_pixels(
        random_config, encoder, photos, cpu_result):
    names = list(photos)[::6] + ["zero", "text", "cut"]
    blobs = {**photos, "zero": b"", "text": b"not an image", "cut": photos[names[0]][:3000]}
    seen: dict[str, dict[str, np.ndarray]] = {"threads": {}, "processes": {}}
    results = {}
    for how, processes in (("threads", 0), ("processes", 2)):
        r = runner_for(random_config.replace(decode_processes=processes), encoder)
        assert r.cpu_processes == processes
        try:
            results[how] = r.run(names, blobs.__getitem__, lambda k, rgb, meta, how=how: seen[how].__setitem__(k, rgb))
        finally:
            r.close()
    a, b = results["threads"], results["processes"]
    assert [m for m in a.metas] == [m for m in b.metas] and len(a.metas) == len(names) - 3
    assert [(f.key, f.reason) for f in a.failed] == [(f.key, f.reason) for f in b.failed] == [
        ("zero", "empty"), ("text", "not_an_image"), ("cut", "truncated")]
    np.testing.assert_allclose(a.vectors, b.vectors, atol=1e-6)
    assert seen["threads"].keys() == seen["processes"].keys()
    assert all(np.array_equal(seen["threads"][k], seen["processes"][k]) for k in seen["threads"])
    assert b.timings.decode > 0 and b.timings.preprocess > 0


def test_planned_processes_are_none_on_the_cpu_and_the_share_less_one_on_cuda():
    cpu = PipelineConfig(pretrained="random")
    assert planned_processes(cpu, 2) == 0 and planned_processes(cpu, 64) == 0  # the CPU-only path is unchanged
    gpu = PipelineConfig(pretrained="random", device="cuda", preprocess="gpu_decode")
    assert planned_processes(gpu, 16) == 7  # 2 bulk processes: 8 cores each, one for the process itself
    assert planned_processes(gpu.replace(bulk_processes=1), 16) == 15
    assert planned_processes(gpu.replace(bulk_processes=4), 4) == 0
    assert planned_processes(cpu.replace(decode_processes=3), 2) == 3
    with pytest.raises(ValueError, match="decode_processes"):
        planned_processes(cpu.replace(decode_processes=-1))


# --- back to the CPU path ---------------------------------------------------------------------------

@needs_shared
def test_without_nvimgcodec_every_image_takes_the_cpu_path_with_the_same_vectors_and_reasons(
        random_config, encoder, photos, cpu_result, monkeypatch, caplog):
    from workers import device_decode

    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # import raises ImportError
    monkeypatch.setattr(device_decode, "_missing_logged", False)
    names = list(photos)[:20] + ["text"]
    blobs = {**photos, "text": b"not an image"}
    with caplog.at_level(logging.WARNING, logger="workers.device_decode"):
        r = runner_for(random_config, encoder, jpeg_device="cuda")  # no GPU needed: nothing reaches it
        try:
            result = r.run(names, blobs.__getitem__)
            again = r.run(names[:3], blobs.__getitem__)
        finally:
            r.close()
        assert r.device_decoder() is None
        assert device_decode.device_decoder(torch.device("cuda")) is None
    assert len([x for x in caplog.records if "nvImageCodec is not installed" in x.getMessage()]) == 1
    assert [m.key for m in result.metas] == names[:20] and [(f.key, f.reason) for f in result.failed] == [
        ("text", "not_an_image")]
    np.testing.assert_allclose(result.vectors, cpu_result.vectors[:20], atol=1e-5)
    assert len(again.metas) == 3


class RefusingDecoder:
    """A device decoder (torchvision's, on the CPU) that refuses some images, or every batch."""

    name = "fake"

    def __init__(self, refuse: set[int], fail: bool = False) -> None:
        from workers.device_decode import TorchvisionDecoder

        self.inner, self.refuse, self.fail, self.batches = TorchvisionDecoder(torch.device("cpu")), refuse, fail, []

    def decode(self, jobs, *, roi):
        self.batches.append(len(jobs))
        if self.fail:
            raise RuntimeError("device lost")
        out = self.inner.decode(jobs, roi=roi)
        return [None if i in self.refuse else t for i, t in enumerate(out)]


@needs_shared
@pytest.mark.parametrize("fail", [False, True], ids=["one refused", "the whole call fails"])
def test_an_image_the_device_refuses_is_decoded_on_the_cpu(random_config, encoder, photos, cpu_result, fail):
    names = list(photos)
    device_names = [n for n in names if route(photos[n], **LIMITS).route is Route.DEVICE_JPEG][:4]
    keys = device_names + ["progressive", "truncated"]
    prog = next(n for n in names if route(photos[n], **LIMITS).why == "progressive_jpeg")
    blobs = {**photos, "progressive": photos[prog], "truncated": photos[device_names[0]][:-2000]}
    fake = RefusingDecoder({1}, fail=fail)
    r = runner_for(random_config, encoder, jpeg_device="cpu")
    r._device_decoder, r._device_decoder_made = fake, True
    try:
        result = r.run(keys, blobs.__getitem__)
    finally:
        r.close()
    assert fake.batches == [4]  # the progressive and the truncated JPEG never reached the device
    assert [m.key for m in result.metas] == keys[:5]
    assert [(f.key, f.reason) for f in result.failed] == [("truncated", "truncated")]
    ref = {m.key: v for m, v in zip(cpu_result.metas, cpu_result.vectors)}
    cos = cosines(np.stack([ref[k] for k in device_names] + [ref[prog]]), result.vectors)
    # refused ones come from the CPU path: its exact vector; the device ones within the bound
    cpu_decoded = [1, 4] if not fail else [0, 1, 2, 3, 4]
    assert all(cos[i] > 0.99999 for i in cpu_decoded), cos
    assert cos.min() >= 0.99, cos


@needs_shared
def test_the_centre_square_decode_keeps_the_embedding_within_the_device_bound(random_config, encoder, photos,
                                                                              cpu_result):
    """What the device's ROI decode gives (the centred square resized straight to 224, instead of the
    whole picture resized and cropped), emulated with the CPU decoder on a third of the baseline
    photos: same images and sizes, vectors within the device path's bound (0.99) of the CPU path's
    (over all 36: min 0.9951, the reason it is off by default)."""
    names = [n for n in photos if route(photos[n], **LIMITS).route is Route.DEVICE_JPEG][::3]
    r = runner_for(random_config, encoder, jpeg_device="cpu")
    r.device_roi = True
    try:
        result = r.run(names, photos.__getitem__)
        with_hook = r.prepare(names[:2], photos.__getitem__, on_decoded=lambda *a: None)
    finally:
        r.close()
    ref = {m.key: v for m, v in zip(cpu_result.metas, cpu_result.vectors)}
    assert [m.key for m in result.metas] == names and len(names) == 12
    assert [(m.width, m.height) for m in result.metas] == [(m.width, m.height) for m in cpu_result.metas
                                                           if m.key in names]
    cos = cosines(np.stack([ref[k] for k in names]), result.vectors)
    assert cos.min() >= 0.99, sorted(cos)[:3]
    assert r._device_roi(encoder.preprocess_config, None) == 224
    assert r._device_roi(encoder.preprocess_config, lambda *a: None) == 0  # previews need the whole picture
    assert len(with_hook.metas) == 2


# --- on a GPU ---------------------------------------------------------------------------------------

@cuda
@needs_shared
@pytest.mark.parametrize("decoder", ["nvimgcodec", "torchvision"])
def test_the_routed_device_decode_matches_the_cpu_path_on_cuda(random_config, photos, cpu_result, decoder):
    if decoder == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed")
    from workers.model import ClipEncoder

    cfg = random_config.replace(device="cuda", preprocess="gpu_decode", torch_threads=None)
    r = runner_for(cfg, ClipEncoder(cfg), jpeg_decoder=decoder)
    try:
        result = r.run(list(photos), photos.__getitem__)
    finally:
        r.close()
    assert r.device_decoder().name == decoder
    assert [m.key for m in result.metas] == list(photos) and not result.failed
    assert cosines(cpu_result.vectors, result.vectors).min() >= 0.99


# --- simplejpeg, adopted in workers.decode for 3-component DCT JPEGs ---------------------------------

@needs_shared
def test_simplejpeg_gives_opencvs_pixels_at_every_dct_scale(photos, odd, monkeypatch):
    """workers.decode decodes 3-component JPEGs with simplejpeg: the same libjpeg-turbo, so the same
    pixels and the same reason codes as OpenCV at every scale (checked on every JPEG here)."""
    from workers import decode
    from workers.errors import ImageRejected

    def outcome(data, min_side):
        try:
            d = decode.decode_image(data, min_side=min_side)
        except ImageRejected as e:
            return e.reason.value
        return d.rgb, d.scale, d.width, d.height

    jpegs = {k: v for k, v in {**photos, **odd}.items() if decode.sniff_format(v) == "jpeg"}
    assert len(jpegs) == 50 + 24
    compared = 0
    for min_side in (None, 224, 64):
        with_sj = {k: outcome(v, min_side) for k, v in jpegs.items()}
        monkeypatch.setattr(decode, "_simplejpeg", None)
        with_cv = {k: outcome(v, min_side) for k, v in jpegs.items()}
        monkeypatch.undo()
        for k in jpegs:
            a, b = with_sj[k], with_cv[k]
            if isinstance(a, str) or isinstance(b, str):
                assert a == b, k
            else:
                assert a[1:] == b[1:] and np.array_equal(a[0], b[0]), (k, min_side)
                compared += 1
    assert compared > 3 * 50
