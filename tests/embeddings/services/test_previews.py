"""Previews in the service (docs/previews.md): drawn beside the thumbnail by the worker that decodes
an original (uploads and bulk chunks), read instead of the original by a model migration's
re-embed, the original read when a preview is missing, unreadable or too small for the model,
deleted with the last row of their bytes, and drawn for older images by ``manage.py previews``.

Eager Celery; ViT-B-32 (active) and ViT-S-32 (the migration's target), both with seeded random
weights (the fixtures of ``test_model_migrations``).
"""
from __future__ import annotations

import io
import logging

import cv2
import numpy as np
import pytest
from django.core.management import call_command

from embeddings import metrics, runtime
from embeddings.models import Image, ImageStatus
from embeddings.storage import BlobStore, preview_exists, preview_key, preview_read, thumbnail_exists
from tests.embeddings.conftest import client_for, jpeg_bytes, upload
from tests.embeddings.services.lifecycle.test_model_migrations import S, small_encoder, two_models  # noqa: F401
from workers.preview import preview_read as decode_preview

pytestmark = pytest.mark.django_db(transaction=True)


def png_bytes(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), size[::-1], interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".png", img)[1].tobytes()


def post(api, files: dict[str, bytes]) -> list[dict]:
    r = api.post("/api/images/", {"files": [upload(n, d) for n, d in files.items()], "k": 0}, format="multipart")
    assert r.status_code == 200, r.json()
    return r.json()["images"]


def preview_of(sha: str):
    return decode_preview(preview_read(runtime.blob_store(), sha))


@pytest.fixture
def reads(monkeypatch):
    """The keys of originals read from the blob store, and each re-embed chunk's preview tally."""
    seen = {"originals": [], "tallies": [], "previews": []}
    read, count, read_preview = BlobStore.read, metrics.count_preview_reads, preview_read

    def counting_read(self, key, sha256):
        seen["originals"].append(key)
        return read(self, key, sha256)

    def counting_preview(store, sha256):
        seen["previews"].append(sha256)
        return read_preview(store, sha256)

    monkeypatch.setattr(BlobStore, "read", counting_read)
    monkeypatch.setattr(metrics, "count_preview_reads", lambda tally: (seen["tallies"].append(tally.as_dict()),
                                                                        count(tally)))
    monkeypatch.setattr("embeddings.storage.preview_read", counting_preview)
    return seen


def migrate(staff) -> None:
    r = client_for(staff).post("/api/migrations/", {"model": "ViT-S-32", "pretrained": "random"}, format="json")
    assert r.status_code == 202, r.content


def test_a_first_embedding_draws_its_preview_beside_its_thumbnail(service, api):
    a, big = post(api, {"a.png": png_bytes(1, (480, 640)), "big.jpg": jpeg_bytes(2, size=(900, 1200))})
    r = api.post("/api/jobs/", {"files": [upload("c.png", png_bytes(3, (600, 800)))]}, format="multipart")
    assert r.status_code == 202 and api.get(f"/api/jobs/{r.json()['id']}/").json()["embedded"] == 1
    c = Image.objects.get(original_name="c.png")
    store = runtime.blob_store()
    for sha in (a["sha256"], big["sha256"], c.sha256):
        path = store.root / "preview" / sha[:2] / sha
        assert path.is_file() and preview_key(sha) == f"preview/{sha[:2]}/{sha}" and thumbnail_exists(store, sha)
    shapes = {n: preview_of(s).rgb.shape for n, s in (("a", a["sha256"]), ("big", big["sha256"]), ("c", c.sha256))}
    # PNGs: short side exactly 384; the 1200 × 900 JPEG was decoded at 1/4 for the 224 px model
    # (300 × 225) and its preview drawn from those pixels, not decoded again
    assert shapes == {"a": (384, 512, 3), "big": (225, 300, 3), "c": (384, 512, 3)}
    p = preview_of(big["sha256"])
    assert (p.width, p.height, p.format, p.full) == (1200, 900, "jpeg", False)


def test_a_migration_re_embeds_from_previews_without_reading_an_original(two_models, service, api, staff,  # noqa: F811
                                                                         reads, monkeypatch, settings):
    from workers.runner import BatchRunner

    images = post(api, {"a.png": png_bytes(1, (480, 640)), "b.jpg": jpeg_bytes(2, size=(900, 1200)),
                        "small.png": png_bytes(3, (100, 150))})
    reads["originals"].clear()
    runs, run = [], BatchRunner.run
    monkeypatch.setattr(BatchRunner, "run", lambda self, *a, **kw: runs.append(kw) or run(self, *a, **kw))
    settings.MIGRATION_MICRO_BATCH, settings.MIGRATION_PASS_MS = 2, 250.0
    migrate(staff)
    # the chunk's passes: MIGRATION_MICRO_BATCH images first, then as many as MIGRATION_PASS_MS fits
    assert [(kw["micro_batch"], kw["pass_ms"]) for kw in runs if "pass_ms" in kw] == [(2, 250.0)]  # not each pass
    assert reads["originals"] == [] and reads["tallies"] == [{"used": 3, "missing": 0, "unreadable": 0,
                                                              "too_small": 0}]
    copies = {c.source_id: c for c in Image.objects.filter(model_id=S)}
    assert len(copies) == 3 and all(c.status == ImageStatus.EMBEDDED for c in copies.values())
    for im in Image.objects.filter(id__in=[i["id"] for i in images]):  # the original's facts, from the preview
        assert (copies[im.id].width, copies[im.id].height, copies[im.id].format) == (im.width, im.height, im.format)
    assert {(c.width, c.height) for c in copies.values()} == {(640, 480), (1200, 900), (150, 100)}
    # the re-embedded vectors match those computed from the originals by the same model
    store, runner = runtime.blob_store(), runtime.batch_runner(S)
    keys = {str(c.id): (c.storage_key, c.sha256) for c in copies.values()}
    direct = BatchRunner.run(runner, list(keys), lambda k: store.read(*keys[k]))
    stored = runtime.vector_store(S).vectors([c.point_id for c in copies.values()])
    by_id = {str(c.id): c.point_id for c in copies.values()}
    assert min(float(v @ stored[by_id[m.key]]) for m, v in zip(direct.metas, direct.vectors)) >= 0.99


def test_a_missing_or_unreadable_preview_falls_back_to_the_original(two_models, service, api, staff,  # noqa: F811
                                                                   reads, caplog):
    _, b, c = post(api, {"a.png": png_bytes(1, (480, 640)), "b.png": png_bytes(2, (500, 700)),
                         "c.png": png_bytes(3, (300, 400))})
    store = runtime.blob_store()
    (store.root / preview_key(b["sha256"])).unlink()
    path = store.root / preview_key(c["sha256"])
    path.write_bytes(path.read_bytes()[:-100])  # cut short
    reads["originals"].clear()
    with caplog.at_level(logging.INFO):
        migrate(staff)
    assert sorted(reads["originals"]) == sorted(Image.objects.get(id=i["id"]).storage_key for i in (b, c))
    assert reads["tallies"] == [{"used": 1, "missing": 1, "unreadable": 1, "too_small": 0}]
    assert "1 previews missing and 1 unreadable: their originals were read" in caplog.text
    unreadable = f"preview of {Image.objects.get(model_id=S, source_id=c['id']).id} unreadable"
    assert [r.levelname for r in caplog.records if r.getMessage().startswith(unreadable)] == ["WARNING"]
    assert Image.objects.filter(model_id=S, status=ImageStatus.EMBEDDED).count() == 3
    # the originals' decode drew both again: readable, the size a first embedding draws
    assert preview_of(b["sha256"]).rgb.shape == (384, 538, 3) and preview_of(c["sha256"]).full


def test_a_model_whose_input_exceeds_the_preview_reads_the_original(two_models, service, api, staff,  # noqa: F811
                                                                   reads):
    images = post(api, {"a.png": png_bytes(1, (480, 640)), "b.png": png_bytes(2, (500, 700))})
    service.PIPELINE = service.PIPELINE.replace(preview_side=160)  # below ViT-S-32's 224 px input
    runtime.batch_runner.cache_clear()
    reads["originals"].clear()
    reads["previews"].clear()
    migrate(staff)
    assert len(reads["originals"]) == 2 and reads["previews"] == []  # not even looked at
    assert reads["tallies"] == [{"used": 0, "missing": 0, "unreadable": 0, "too_small": 2}]
    assert Image.objects.filter(model_id=S, status=ImageStatus.EMBEDDED).count() == len(images)


def test_the_preview_goes_with_the_last_row_of_its_bytes(service, api, other_user):
    a = post(api, {"a.png": png_bytes(1, (480, 640))})[0]
    twin = post(client_for(other_user), {"twin.png": png_bytes(1, (480, 640))})[0]
    b = post(api, {"b.png": png_bytes(2, (480, 640))})[0]
    store = runtime.blob_store()
    assert a["sha256"] == twin["sha256"] and preview_exists(store, a["sha256"])
    assert api.delete(f"/api/images/{a['id']}/").status_code == 204
    assert preview_exists(store, a["sha256"])  # the other user's row still has those bytes
    assert client_for(other_user).delete(f"/api/images/{twin['id']}/").status_code == 204
    assert not preview_exists(store, a["sha256"]) and not thumbnail_exists(store, a["sha256"])
    assert preview_exists(store, b["sha256"])


def test_manage_py_previews_draws_the_missing_ones(service, api):
    images = post(api, {"a.png": png_bytes(1, (480, 640)), "big.jpg": jpeg_bytes(2, size=(900, 1200)),
                        "c.png": png_bytes(3, (300, 400)), "gone.png": png_bytes(4, (300, 400))})
    shas = {i["original_name"]: i["sha256"] for i in images}
    store = runtime.blob_store()
    for name in ("big.jpg", "c.png", "gone.png"):  # as if embedded before previews existed
        (store.root / preview_key(shas[name])).unlink()
    store.delete(Image.objects.get(original_name="gone.png").storage_key)  # and this original is lost

    def run(**options) -> str:
        out, err = io.StringIO(), io.StringIO()
        call_command("previews", stdout=out, stderr=err, **options)
        return out.getvalue().strip() + (" | " + err.getvalue().strip() if err.getvalue() else "")

    assert run(limit=1, batch=1).startswith("1 previews drawn, ")  # in sha256 order: what comes first varies
    assert len(list((store.root / "preview").rglob("*"))) - len(list((store.root / "preview").glob("*"))) == 2
    out = run(batch=2)
    assert out.startswith("1 previews drawn, 2 already there, 1 without a readable original, 0 too long for a preview")
    assert "source_missing" in out
    assert run().startswith("0 previews drawn, 3 already there, 1 without a readable original")
    # drawn from a decode at the preview's own side: the big JPEG now 384 px, not the worker's 225
    assert preview_of(shas["big.jpg"]).rgb.shape == (384, 512, 3) and preview_of(shas["c.png"]).full
    assert not preview_exists(store, shas["gone.png"])
