"""Previews (``workers/preview.py``, docs/previews.md): size, layout, damage detection, and the
runner reading them instead of originals when the model fits, falling back when it cannot.

The fidelity test embeds every photo and every odd file that embeds from its original (drawing
previews as a worker does), then from those previews, with the real ViT-B-32 architecture and
seeded random weights: cosine per image >= 0.99 (real weights should be checked again).
"""
from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import IMAGES, needs_shared
from workers.preview import (
    MAX_SIDE,
    PreviewTooLong,
    PreviewUnreadable,
    device_pixels,
    preview_bytes,
    preview_facts,
    preview_read,
    preview_size,
)
from workers.runner import BatchRunner


def picture(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth random picture with an asymmetric marker (top-left red block) to see rotations."""
    rng = np.random.default_rng(seed)
    rgb = cv2.resize(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8), (w, h), interpolation=cv2.INTER_CUBIC)
    rgb[: h // 5, : w // 5] = (255, 0, 0)
    return rgb


def png(rgb: np.ndarray) -> bytes:
    return cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))[1].tobytes()


def rotated_jpeg(rgb: np.ndarray) -> bytes:
    """A JPEG whose stored pixels are ``rgb`` turned 90° anticlockwise, with EXIF orientation 6
    (rotate 90° clockwise to display): upright, it is ``rgb``."""
    stored = np.ascontiguousarray(np.rot90(rgb, 1))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(stored).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


class Previews:
    """An in-memory ``PreviewStore`` that counts reads and discards."""

    def __init__(self, blobs: dict[str, bytes] | None = None) -> None:
        self.blobs = dict(blobs or {})
        self.reads: list[str] = []
        self.discarded: list[str] = []

    def read(self, key: str) -> bytes:
        self.reads.append(key)
        if key not in self.blobs:
            raise FileNotFoundError(key)
        return self.blobs[key]

    def discard(self, key: str) -> None:
        self.discarded.append(key)
        self.blobs.pop(key, None)


class Originals:
    """A loader over ``blobs`` that counts reads per key."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs
        self.reads: list[str] = []

    def __call__(self, key: str) -> bytes:
        self.reads.append(key)
        return self.blobs[key]


def drawer(store: Previews, side: int = 384):
    """A decode hook that draws previews the way the worker does (``services.queues.blobs.thumbnailer``)."""
    def on_decoded(key, rgb, meta):
        store.blobs[key] = preview_bytes(rgb, width=meta.width, height=meta.height, format=meta.format,
                                         short_side=side)[0]
    return on_decoded


def cosines(a, b) -> np.ndarray:
    assert [m.key for m in a.metas] == [m.key for m in b.metas]
    return np.sum(a.vectors * b.vectors, axis=1)


@pytest.fixture(scope="module")
def small_side_runner(random_config, encoder):
    """A runner whose configured preview side (160 px) is below the model's input (224 px)."""
    from workers.model import EncoderHolder

    holder = EncoderHolder(random_config)
    holder._encoder = encoder
    r = BatchRunner(random_config.replace(decode_threads=2, preview_side=160), holder)
    yield r
    r.close()


# --- the library ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("size", "expected"), [
    ((4000, 3000), (512, 384)), ((3000, 4000), (384, 512)), ((384, 384), (384, 384)), ((1000, 385), (997, 384)),
    ((300, 200), (300, 200)), ((1, 60000), (1, 60000)), ((60000, 500), (46080, 384)),
])
def test_preview_size_puts_the_short_side_on_384_and_never_enlarges(size, expected):
    assert preview_size(*size) == expected


def test_a_shrunk_picture_is_a_jpeg_holding_its_originals_facts():
    rgb = picture(900, 1200)
    data, pixels = preview_bytes(rgb, width=4800, height=3600, format="jpeg")
    assert pixels.shape == (384, 512, 3) and data[:4] == b"\xff\xd8\xff\xfe"  # SOI, then the COM of facts
    assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR).shape == (384, 512, 3)  # a plain JPEG
    p = preview_read(data)
    assert (p.width, p.height, p.format, p.rgb.shape, p.short_side, p.full) == (4800, 3600, "jpeg", (384, 512, 3),
                                                                              384, False)
    assert np.abs(p.rgb.astype(int) - pixels).mean() < 2.5  # JPEG q90 of the area-averaged picture
    assert p.fits(224) and p.fits(384) and not p.fits(385)


@pytest.mark.parametrize(("h", "w", "zipped"), [(80, 100, False), (384, 1000, True), (1, 60000, False)])
def test_a_picture_that_is_its_own_preview_is_kept_lossless(h, w, zipped):
    rgb = picture(h, w) if h > 1 else np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)
    data, pixels = preview_bytes(rgb, width=w, height=h, format="png")
    assert pixels is rgb and data.startswith(b"\x89clip-rgb\n") and data.split(b"\n")[1].endswith(
        b" z=1" if zipped else b" z=0")
    assert len(data) < rgb.nbytes if zipped else len(data) > rgb.nbytes
    p = preview_read(data)
    assert np.array_equal(p.rgb, rgb) and p.full and p.fits(224) and (p.width, p.height, p.format) == (w, h, "png")


@pytest.mark.parametrize("form", ["jpeg", "lossless"])
@pytest.mark.parametrize("damage", ["flipped byte", "cut short", "facts changed"])
def test_a_damaged_preview_is_unreadable(form, damage):
    width, height = (600, 400) if form == "lossless" else (1200, 800)
    data = preview_bytes(picture(400, 600), width=width, height=height, format="png")[0]
    at = len(data) - 500
    bad = {"flipped byte": data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:], "cut short": data[: len(data) // 2],
           "facts changed": data.replace(b"f=png", b"f=gif")}[damage]
    with pytest.raises(PreviewUnreadable):
        preview_read(bad)


@pytest.mark.parametrize("foreign", [b"", b"\xff\xd8\xff\xe0", b"\x89PNG\r\n\x1a\n", b"\x89clip-rgb\nnothing"])
def test_what_is_not_a_preview_is_unreadable(foreign):
    with pytest.raises(PreviewUnreadable, match="not a preview"):
        preview_read(foreign)
    with pytest.raises(PreviewUnreadable, match="not a preview"):
        preview_read(cv2.imencode(".jpg", picture(40, 60))[1].tobytes())  # a JPEG without our facts


def test_a_picture_too_long_for_a_preview_gets_none():
    with pytest.raises(PreviewTooLong, match="65500"):  # shrunk, still over libjpeg's longest side
        preview_bytes(np.zeros((2, MAX_SIDE + 1, 3), np.uint8), width=2 * (MAX_SIDE + 1), height=4, format="png")
    with pytest.raises(PreviewTooLong, match="lossless"):  # whole, over 16 MiB
        preview_bytes(np.zeros((384, 15_000, 3), np.uint8), width=15_000, height=384, format="png")


def test_device_pixels_shrink_to_the_preview_side_on_the_tensors_device():
    chw = torch.from_numpy(picture(1500, 2000)).permute(2, 0, 1).contiguous()
    assert device_pixels(chw, 384).shape == (384, 512, 3)
    assert device_pixels(chw[:, :300, :200].contiguous(), 384).shape == (300, 200, 3)  # never enlarged
    assert device_pixels(chw, 0).shape == (384, 512, 3)  # previews off: the thumbnail's 2 × 256 long side


# --- the runner ----------------------------------------------------------------------------------

def test_a_first_embedding_draws_previews_and_a_re_embed_reads_only_them(runner):
    upright = picture(1000, 800, seed=1)
    originals = Originals({"png": png(picture(600, 800)), "rotated": rotated_jpeg(upright),
                           "small": png(picture(90, 120, seed=2))})
    stored = Previews()
    first = runner.run(list(originals.blobs), originals, drawer(stored))
    assert sorted(stored.blobs) == ["png", "rotated", "small"] and first.previews.as_dict() == {
        "used": 0, "missing": 0, "unreadable": 0, "too_small": 0}
    previews = {k: preview_read(v) for k, v in stored.blobs.items()}
    # the PNG: short side exactly 384; the JPEG (800 px short side) was decoded at 1/2 for the 224 px
    # model, 400 × 500 upright, and its preview drawn from those pixels: 384 × 480; the small one whole
    assert {k: p.rgb.shape for k, p in previews.items()} == {"png": (384, 512, 3), "rotated": (480, 384, 3),
                                                             "small": (90, 120, 3)}
    assert np.array_equal(previews["small"].rgb, picture(90, 120, seed=2))  # lossless
    # stored upright (EXIF orientation 6 applied once, at the first decode): its pixels are the
    # upright picture's, red block top left
    expected = cv2.resize(upright, (384, 480), interpolation=cv2.INTER_AREA)
    assert np.abs(previews["rotated"].rgb.astype(int) - expected).mean() < 4
    assert (previews["rotated"].width, previews["rotated"].height) == (800, 1000)
    originals.reads.clear()
    again = runner.run(list(originals.blobs), originals, previews=stored)
    assert originals.reads == [] and sorted(stored.reads) == ["png", "rotated", "small"]
    assert again.previews.as_dict() == {"used": 3, "missing": 0, "unreadable": 0, "too_small": 0}
    assert [(m.width, m.height, m.format) for m in again.metas] == [(800, 600, "png"), (800, 1000, "jpeg"),
                                                                   (120, 90, "png")]
    assert cosines(first, again).min() >= 0.99


def test_missing_and_unreadable_previews_fall_back_to_the_original(runner):
    originals = Originals({k: png(picture(500, 700, seed=i)) for i, k in enumerate(("ok", "missing", "broken"))})
    stored = Previews()
    first = runner.run(list(originals.blobs), originals, drawer(stored))
    del stored.blobs["missing"]
    stored.blobs["broken"] = stored.blobs["broken"][:-10]  # cut short
    redrawn = Previews()
    originals.reads.clear()
    again = runner.run(list(originals.blobs), originals, drawer(redrawn), previews=stored)
    assert sorted(originals.reads) == ["broken", "missing"]
    assert again.previews.as_dict() == {"used": 1, "missing": 1, "unreadable": 1, "too_small": 0}
    assert stored.discarded == ["broken"]  # so that the hook below could draw it again
    assert sorted(redrawn.blobs) == ["broken", "missing"]  # the originals' decode drew theirs
    assert [m.key for m in again.metas] == ["ok", "missing", "broken"] and cosines(first, again).min() >= 0.99


def test_a_model_whose_input_exceeds_the_preview_reads_the_original(runner, small_side_runner):
    big = {"big": png(picture(600, 800))}
    stored = Previews()
    runner.run(["big"], Originals(big), drawer(stored, side=160))  # a 160 px preview (short side)
    originals = Originals(big)
    result = runner.run(["big"], originals, previews=stored)  # read: 160 < 224, then the original
    assert (originals.reads, stored.reads, result.previews.too_small, result.previews.used) == (["big"], ["big"], 1, 0)
    # the configured side itself is below the model's input: no preview is even read
    stored.reads.clear()
    originals = Originals(big)
    result = small_side_runner.run(["big"], originals, previews=stored)
    assert (originals.reads, stored.reads, result.previews.as_dict()) == (
        ["big"], [], {"used": 0, "missing": 0, "unreadable": 0, "too_small": 1})
    assert result.metas[0].width == 800


def test_previews_count_over_micro_batches(runner):
    originals = Originals({str(i): png(picture(300, 400, seed=i)) for i in range(5)})
    stored = Previews()
    runner.run(list(originals.blobs), originals, drawer(stored))
    del stored.blobs["3"]
    result = runner.run(list(originals.blobs), originals, previews=stored, micro_batch=2)
    assert result.previews.as_dict() == {"used": 4, "missing": 1, "unreadable": 0, "too_small": 0}


# --- fidelity on the shared real images ----------------------------------------------------------

def _fidelity(runner, paths) -> tuple[int, np.ndarray]:
    blobs = {p.name: p.read_bytes() for p in paths}
    stored = Previews()
    first = runner.run(list(blobs), blobs.__getitem__, drawer(stored))
    originals = Originals(blobs)
    again = runner.run([m.key for m in first.metas], originals, previews=stored)
    assert originals.reads == [] and again.previews.used == len(first.metas)
    return len(first.metas), cosines(first, again)


@needs_shared
def test_embeddings_from_previews_match_the_originals_on_every_photo_and_odd_file(runner):
    """docs/previews.md, "Fidelity": min >= 0.99 over the 84 photos and every odd file that embeds."""
    photos = sorted((IMAGES / "photos").iterdir())
    n, cos = _fidelity(runner, photos)
    assert n == 84 and cos.min() >= 0.99, (cos.min(), cos.mean())
    odd = sorted(p for p in (IMAGES / "odd").iterdir() if p.is_file())
    n, cos = _fidelity(runner, odd)
    assert n == ODD_EMBEDDED and cos.min() >= 0.99, (cos.min(), cos.mean())


#: Odd files (../shared/data/images/odd) that embed with the default limits
#: (tests/workers/test_decode_manifest.py says which and why).
ODD_EMBEDDED = 57


# --- the device JPEG path (``PREPROCESS=gpu_decode``) ---------------------------------------------

@pytest.mark.parametrize("device", [
    "cpu",  # the same code with torchvision's CPU decoder
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_the_device_jpeg_path_draws_previews_shrunk_on_the_device(random_config, encoder, device):
    from workers.model import ClipEncoder, EncoderHolder

    config = random_config.replace(decode_threads=2)
    if device == "cuda":
        config = config.replace(device="cuda", preprocess="gpu_decode", torch_threads=None)
    holder = EncoderHolder(config)
    holder._encoder = encoder if device == "cpu" else ClipEncoder(config)
    runner = BatchRunner(config, holder, jpeg_device=device)
    try:
        upright = picture(1500, 2000, seed=3)
        originals = Originals({"landscape": cv2.imencode(".jpg", cv2.cvtColor(upright, cv2.COLOR_RGB2BGR))[1]
                               .tobytes(), "rotated": rotated_jpeg(picture(1000, 800, seed=1))})
        stored = Previews()
        first = runner.run(list(originals.blobs), originals, drawer(stored))
        previews = {k: preview_read(v) for k, v in stored.blobs.items()}
        # decoded at full size on the device, shrunk there: exactly 384 px, upright
        assert {k: p.rgb.shape for k, p in previews.items()} == {"landscape": (384, 512, 3), "rotated": (480, 384, 3)}
        assert [(p.width, p.height) for p in previews.values()] == [(2000, 1500), (800, 1000)]
        expected = cv2.resize(picture(1000, 800, seed=1), (384, 480), interpolation=cv2.INTER_AREA)
        assert np.abs(previews["rotated"].rgb.astype(int) - expected).mean() < 4
        originals.reads.clear()
        again = runner.run(list(originals.blobs), originals, previews=stored)
        assert originals.reads == [] and again.previews.used == 2 and cosines(first, again).min() >= 0.99
    finally:
        runner.close()


# --- previews on the device decoder (issue 58) ----------------------------------------------------

class CountingDecoder:
    """torchvision's decoder on the CPU (the device path without a GPU), recording what it is given
    and refusing the jobs at the indexes in ``refuse``."""

    name = "counting"

    def __init__(self, refuse: frozenset[int] = frozenset()) -> None:
        from workers.device_decode import TorchvisionDecoder

        self.inner, self.refuse, self.jobs = TorchvisionDecoder(torch.device("cpu")), refuse, []

    def decode(self, jobs, *, roi: int = 0):
        self.jobs += list(jobs)
        out = self.inner.decode(jobs, roi=roi)
        return [None if i in self.refuse else t for i, t in enumerate(out)]


def _stored_previews(runner) -> tuple[Originals, Previews]:
    """Four pictures (one EXIF-rotated, one PNG) embedded once by ``runner`` on the CPU path, their
    previews drawn as the worker draws them; the originals' read counts cleared."""
    originals = Originals({"landscape": cv2.imencode(".jpg", cv2.cvtColor(picture(900, 1200, seed=3),
                                                                        cv2.COLOR_RGB2BGR))[1].tobytes(),
                           "portrait": cv2.imencode(".jpg", picture(1000, 700, seed=4))[1].tobytes(),
                           "rotated": rotated_jpeg(picture(1000, 800, seed=1)),
                           "png": png(picture(600, 800, seed=5))})
    stored = Previews()
    runner.run(list(originals.blobs), originals, drawer(stored))
    originals.reads.clear()
    return originals, stored


@pytest.fixture
def device_runner(random_config, encoder):
    """A runner whose device JPEG route decodes on the CPU (torchvision), as on CUDA without a GPU."""
    from workers.model import EncoderHolder

    holder = EncoderHolder(random_config)
    holder._encoder = encoder
    r = BatchRunner(random_config.replace(decode_threads=2), holder, jpeg_device="cpu")
    yield r
    r.close()


def test_previews_are_decoded_by_the_device_decoder_with_the_originals_meta(runner, device_runner):
    originals, stored = _stored_previews(runner)
    keys = list(originals.blobs)
    cpu = runner.prepare(keys, originals, previews=stored)
    counting = CountingDecoder()
    device_runner._device_decoder, device_runner._device_decoder_made = counting, True
    dev = device_runner.prepare(keys, originals, previews=stored)
    # every preview is a JPEG (the PNG's too: previews are JPEGs unless tiny): all four on the device
    assert sorted(j.key for j in counting.jobs) == sorted(keys)
    assert originals.reads == [] and dev.previews.used == 4 and cpu.previews.used == 4
    assert [(m.key, m.width, m.height, m.format) for m in dev.metas] == [
        (m.key, m.width, m.height, m.format) for m in cpu.metas]
    assert [(m.width, m.height) for m in dev.metas] == [(1200, 900), (700, 1000), (800, 1000), (800, 600)]
    # the same pixels but for the two libraries' resizes (libjpeg decodes both)
    diff = (dev.pixels.int() - cpu.pixels.int()).abs().float()
    assert dev.pixels.shape == cpu.pixels.shape == (4, 3, 224, 224) and diff.mean() < 1.5, diff.mean()
    a, b = device_runner.embed(dev), runner.embed(cpu)
    assert cosines(a, b).min() >= 0.999


def test_a_preview_the_device_refuses_gives_the_cpu_paths_exact_tensor(runner, device_runner):
    originals, stored = _stored_previews(runner)
    keys = list(originals.blobs)
    cpu = runner.prepare(keys, originals, previews=stored)
    refusing = CountingDecoder(refuse=frozenset(range(4)))
    device_runner._device_decoder, device_runner._device_decoder_made = refusing, True
    dev = device_runner.prepare(keys, originals, previews=stored)
    assert len(refusing.jobs) == 4 and originals.reads == [] and dev.previews.used == 4
    assert torch.equal(dev.pixels, cpu.pixels)
    assert [(m.key, m.width, m.height) for m in dev.metas] == [(m.key, m.width, m.height) for m in cpu.metas]


def test_a_preview_neither_decoder_reads_falls_back_to_its_original(runner, device_runner):
    originals, stored = _stored_previews(runner)
    bad = bytearray(stored.blobs["portrait"])
    bad[-40:-2] = b"\x00" * 38  # entropy data zeroed: facts and CRC were checked on the stored bytes
    refusing = CountingDecoder(refuse=frozenset(range(4)))
    device_runner._device_decoder, device_runner._device_decoder_made = refusing, True
    from workers import runner as runner_module

    job = device_runner._preview_to_device("portrait", stored.blobs["portrait"], runner.preprocess_config)
    assert isinstance(job[0], runner_module._PreviewJpeg) and job[1] == "used"
    unreadable = runner_module._PreviewJpeg("portrait", b"\xff\xd8\xff\xfe not a preview", job[0].width,
                                            job[0].height, 1, original=job[0].original)
    outcome, ms = device_runner._preview_on_cpu(unreadable, originals, runner.preprocess_config, None)
    assert originals.reads == ["portrait"] and "decode" in ms
    tensor, meta = outcome
    first = runner.prepare(["portrait"], originals)
    assert torch.equal(tensor, first.pixels[0]) and (meta.width, meta.height) == (700, 1000)


def test_without_a_device_decoder_previews_take_the_cpu_path(runner, random_config, encoder, monkeypatch):
    import sys

    from workers import device_decode
    from workers.model import EncoderHolder

    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # CUDA without nvImageCodec
    monkeypatch.setattr(device_decode, "_missing_logged", True)
    originals, stored = _stored_previews(runner)
    keys = list(originals.blobs)
    cpu = runner.prepare(keys, originals, previews=stored)
    holder = EncoderHolder(random_config)
    holder._encoder = encoder
    r = BatchRunner(random_config.replace(decode_threads=2), holder, jpeg_device="cuda")  # nothing reaches it
    try:
        assert r.device_decoder() is None
        fallback = r.prepare(keys, originals, previews=stored)
    finally:
        r.close()
    assert torch.equal(fallback.pixels, cpu.pixels) and fallback.previews.used == 4 and originals.reads == []


def test_a_small_preview_is_not_sent_to_the_device(runner, device_runner):
    """A preview smaller than the model's input that is not the whole original: the original is read."""
    rgb = picture(900, 1200, seed=6)
    small = preview_bytes(rgb, width=1200, height=900, format="jpeg", short_side=160)[0]
    cfg = runner.preprocess_config
    assert device_runner._preview_to_device("k", small, cfg) == (None, "too_small")
    # the whole original, smaller than the model's input: read from its preview all the same
    whole = preview_bytes(picture(150, 200, seed=7), width=200, height=150, format="jpeg")[0]
    job = device_runner._preview_to_device("k", whole, cfg)
    if preview_facts(whole).jpeg:
        assert job[1] == "used" and (job[0].width, job[0].height) == (200, 150)
    else:  # a tiny picture is stored lossless: read on the CPU (memory speed)
        assert job is None
