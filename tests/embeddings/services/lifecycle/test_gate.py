"""The quality gate (issue 13): re-encoded copies (3/4 size, JPEG 85) of a seeded sample must find
their original first. A healthy model (the real ViT-S-32 architecture, seeded random weights) passes
on real photos; a deliberately broken checkpoint, loaded through the file-path loader, is refused.

Real photos from ../shared when present; otherwise generated pictures, so the test never skips its
point. ViT-S-32 (about half ViT-B-32's cost) keeps the two catalogues inside the time budget.
"""
from __future__ import annotations

import io
import os

import cv2
import numpy as np
import pytest

from embeddings import runtime
from embeddings.models import EmbeddingSpace, ImageStatus
from embeddings.services.lifecycle import gate
from embeddings import spaces
from embeddings.services.catalogue.jobs import job_create
from embeddings.services.catalogue.sources import SourceFile
from tests.conftest import photo_paths
from workers.ids import sha256_hex

pytestmark = pytest.mark.django_db(transaction=True)

#: Photos in each catalogue (every third of the 84, sorted by the manifest).
CATALOGUE = 28


def _generated(n: int) -> list[tuple[str, bytes]]:
    """``n`` seeded 320×240 JPEG pictures (smooth colour fields with a few shapes): the fallback
    catalogue when ../shared is missing."""
    out = []
    for i in range(n):
        rng = np.random.default_rng(1000 + i)
        img = cv2.resize(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8), (320, 240), interpolation=cv2.INTER_CUBIC)
        for _ in range(4):
            c = tuple(int(x) for x in rng.integers(0, 255, 3))
            cv2.circle(img, (int(rng.integers(0, 320)), int(rng.integers(0, 240))), int(rng.integers(10, 60)), c, -1)
        out.append((f"gen-{i:02d}.jpg", cv2.imencode(".jpg", img)[1].tobytes()))
    return out


def catalogue() -> list[tuple[str, bytes]]:
    photos = photo_paths()[::3][:CATALOGUE]
    return [(p.name, p.read_bytes()) for p in photos] if photos else _generated(CATALOGUE)


@pytest.fixture
def stack(settings, tmp_path, user):
    """The app on temp folders with eager Celery; ``start(cfg)`` makes ``cfg`` the configured (and
    active) model and ingests the catalogue as a bulk job, returning the space."""
    from project.celery import app

    settings.VAR_DIR = tmp_path
    settings.BLOB_ROOT = tmp_path / "blobs"
    settings.QDRANT_PATH = str(tmp_path / "qdrant")
    settings.QDRANT_URL = ""
    settings.SPACE_CACHE_S = 0.0
    settings.CLIP_MODELS = []

    def clear():
        for f in (runtime.dynamic_batcher, runtime.vector_store, runtime.batch_runner, runtime.encoder_holder,
                  runtime.blob_store):
            f.cache_clear()
        spaces.forget_cache()

    def start(cfg) -> EmbeddingSpace:
        settings.PIPELINE = cfg
        clear()
        space = spaces.active(fresh=True)
        assert space.model_id == cfg.model_id
        files = catalogue()
        job = job_create(owner=user, sources=[SourceFile(name=n, size=len(b), open=lambda b=b: io.BytesIO(b))
                                              for n, b in files], name="catalogue")
        job.refresh_from_db()
        assert (job.status, job.images.filter(status=ImageStatus.EMBEDDED).count()) == ("done", len(files))
        return space

    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    yield start
    app.conf.task_always_eager = False
    clear()


def vit_s32(pretrained: str = "random"):
    from workers.config import PipelineConfig

    return PipelineConfig(model_name="ViT-S-32", pretrained=pretrained, seed=0, torch_threads=os.cpu_count())


@pytest.mark.model  # a real ViT-S-32 through the module's own `stack` (tests/conftest.py's rule misses it)
def test_a_healthy_model_passes_the_gate(stack, user, monkeypatch):
    space = stack(vit_s32())
    report = gate.gate_start(space, calibrate=False)
    n = len(catalogue())
    assert report["state"] == "done" and report["model_id"] == space.model_id
    assert (report["requested"], report["sample"], report["hits"], report["rate"]) == (200, n, n, 1.0)
    assert report["passed"] and report["failures"] == [] and report["threshold"] == 0.99
    assert report["reencode"] == {"scale": 0.75, "jpeg_quality": 85} and report["duration_s"] >= 0
    space.refresh_from_db()
    assert space.gate_report == report
    ok, code, detail = gate.gate_verdict(space)
    assert (ok, code) == (True, None) and f"{n}/{n}" in detail
    # a smaller seeded sample is a subset, and the same seed draws the same one
    assert gate.gate_sample(space, size=5, seed=3) == gate.gate_sample(space, size=5, seed=3)
    assert len(gate.gate_sample(space, size=5, seed=3)) == 5

    # A twin in the catalogue: the very copy the probe makes of the first photo, uploaded as an image
    # of its own. That photo's copy now finds the twin first under any model; the reference model
    # (here the same one) sees the twin as close to the original as the copy (the same bytes): set
    # aside as a twin, not a failure of the model being judged.
    name, data = catalogue()[0]
    twin = gate.reencode(data)
    job_create(owner=user, sources=[SourceFile(name="twin.jpg", size=len(twin), open=lambda: io.BytesIO(twin))])
    monkeypatch.setattr(gate, "reference_of", lambda s: s)
    report = gate.gate_start(space, calibrate=False)
    assert (report["sample"], report["reference"]) == (n + 1, space.model_id)
    first = next(i for i in gate.gate_sample(space, size=200) if i["sha256"] == sha256_hex(data))
    twin_of_first = next(t for t in report["twin_examples"] if t["image_id"] == first["id"])
    assert twin_of_first["first"]["sha256"] == sha256_hex(twin) and twin_of_first["twin"]
    assert twin_of_first["reference"]["first_vs_original"] == pytest.approx(
        twin_of_first["reference"]["copy_vs_original"], abs=1e-5)  # the twin is the copy's own bytes
    assert report["raw_hits"] <= n and report["twins"] >= 1 and report["judged"] == n + 1 - report["twins"]
    assert report["hits"] == report["judged"] - report["failed_count"] and report["rate"] > report["raw_rate"]


@pytest.mark.model  # a real ViT-S-32 through the module's own `stack` (tests/conftest.py's rule misses it)
def test_a_scrambled_checkpoint_is_refused(stack, tmp_path):
    """The patch embedding of a seeded ViT-S-32 scrambled into a pixel checkerboard: the image tower
    then sees only the finest detail, which resizing and JPEG rewrite, so copies land elsewhere.
    (Shuffling every weight tensor instead gives just another random model: it passes.)"""
    import open_clip
    import torch

    torch.manual_seed(0)
    state = open_clip.create_model("ViT-S-32", pretrained=None).state_dict()
    w = state["visual.conv1.weight"]
    yy, xx = torch.meshgrid(torch.arange(w.shape[2]), torch.arange(w.shape[3]), indexing="ij")
    checker = ((yy + xx) % 2 * 2 - 1).float()
    signs = torch.randn(w.shape[0], w.shape[1], 1, 1, generator=torch.Generator().manual_seed(1))
    state["visual.conv1.weight"] = signs * checker * w.std() * 4
    path = tmp_path / "vit-s-32-scrambled.pt"
    torch.save(state, path)
    del state

    space = stack(vit_s32(str(path)))
    report = gate.gate_start(space, calibrate=False)
    n = len(catalogue())
    assert report["state"] == "done" and report["sample"] == n
    assert report["hits"] + report["failed_count"] == n and report["rate"] < 0.8 and not report["passed"]
    first = report["failures"][0]
    assert first["first"]["score"] >= first["original_score"]  # something else scored higher than the original
    assert first["first"]["image_id"] != first["image_id"]
    space.refresh_from_db()
    ok, code, detail = gate.gate_verdict(space)
    assert (ok, code) == (False, gate.GATE_FAILED) and "threshold 0.9900" in detail


def test_verdict_codes(db, settings):
    settings.MIGRATION_GATE_THRESHOLD = 0.99
    space = EmbeddingSpace.objects.create(model_id="ViT-S-32/random-seed0/fp32", model_name="ViT-S-32",
                                          pretrained="random", precision="fp32", collection="c", dim=512)
    assert gate.gate_verdict(space)[:2] == (False, gate.GATE_MISSING)
    space.gate_report = {"state": "running", "started_at": "2026-12-01T04:00:00+00:00"}
    assert gate.gate_verdict(space)[:2] == (False, gate.GATE_MISSING)
    space.gate_report = {"state": "done", "sample": 200, "hits": 198, "rate": 0.99}
    assert gate.gate_verdict(space)[:2] == (True, None)  # one miss in 100 is the threshold itself
    space.gate_report = {"state": "done", "sample": 200, "hits": 197, "rate": 0.985}
    assert gate.gate_verdict(space)[:2] == (False, gate.GATE_FAILED)
    assert gate.gate_verdict(space, threshold=0.98)[:2] == (True, None)
    space.gate_report = {"state": "done", "sample": 0, "hits": 0, "rate": None}
    assert gate.gate_verdict(space)[:2] == (True, None)  # an empty catalogue: nothing to probe
    space.gate_report = {"state": "error", "error": "model_not_configured", "detail": "x"}
    assert gate.gate_verdict(space)[:2] == (False, gate.GATE_FAILED)


def test_reencode_is_three_quarters_of_each_side_at_jpeg_85():
    img = np.zeros((240, 322, 3), np.uint8)
    img[:, :161] = (200, 30, 30)
    copy = gate.reencode(cv2.imencode(".png", img)[1].tobytes())
    assert copy[:3] == b"\xff\xd8\xff"  # JPEG
    back = cv2.imdecode(np.frombuffer(copy, np.uint8), cv2.IMREAD_COLOR)
    assert back.shape == (180, 242, 3)  # round(240 * 0.75), round(322 * 0.75)
    # colours survive (both arrays BGR, as OpenCV reads and writes files)
    assert np.abs(back[90, 40].astype(int) - (200, 30, 30)).max() <= 4 and back[90, 200].max() <= 4
