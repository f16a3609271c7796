"""Vectors the model gives as NaN, infinity or zeros (an fp16 overflow, a broken checkpoint) on every
path that makes vectors: each such image or text is refused with its reason code before the store,
counted in ``clip_embeddings_refused_total{lane,reason}``, never stored, and the rest of its request,
chunk or migration goes on; a query with such a vector answers an error, not an empty list; a point
with a NaN vector already in the store (written before the screen existed) breaks nothing.

The real ViT-B-32 (and ViT-S-32 for the migration) with seeded random weights, its forward pass
wrapped (``tests.workers.test_screen.poison``) so that chosen inputs come out broken: an all-white
picture gives +inf (what an fp16 overflow gives), an all-black one zeros, one text NaN. Eager Celery, an
embedded store, the web's own ``/metrics``.
"""
from __future__ import annotations

import base64
import io
import json

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest
import qdrant_edge as qe

from embeddings import runtime, spaces
from embeddings.models import EmbeddingSpace, Image, ImageStatus
from embeddings.services.lifecycle import gate
from embeddings.services.lifecycle import model_migrations as migrations
from tests.embeddings.conftest import client_for, jpeg_bytes, upload
from tests.embeddings.api.test_embeddings import bearer
from tests.embeddings.test_metrics import sample
from tests.workers.test_screen import NAN_TEXT, poison

pytestmark = pytest.mark.django_db(transaction=True)

REFUSED = "clip_embeddings_refused_total"
S = "ViT-S-32/random-seed0/fp32"


def solid(value: int, side: int = 64) -> bytes:
    """A JPEG of one grey level: 255 (white: +inf from the wrapped model) or 0 (black: zeros)."""
    return cv2.imencode(".jpg", np.full((side, side, 3), value, np.uint8))[1].tobytes()


@pytest.fixture
def poisoned(service, encoder, monkeypatch):
    poison(encoder, monkeypatch)
    return service


class Refusals:
    """``clip_embeddings_refused_total`` as the web's ``/metrics`` serves it, counted from now."""

    def __init__(self, client) -> None:
        self.client = client
        self.before = self._scrape()

    def _scrape(self) -> str:
        return self.client.get("/metrics").content.decode()

    def added(self) -> dict[tuple[str, str], float]:
        """``{(lane, reason): added}`` for both lanes and both reasons."""
        after = self._scrape()
        return {(lane, reason): sample(after, REFUSED, lane=lane, reason=reason)
                - sample(self.before, REFUSED, lane=lane, reason=reason)
                for lane in ("bulk", "interactive") for reason in ("non_finite_embedding", "zero_embedding")}


def counts(bulk=(0, 0), interactive=(0, 0)) -> dict[tuple[str, str], float]:
    """The expected :meth:`Refusals.added`: ``(non_finite, zero)`` per lane."""
    return {("bulk", "non_finite_embedding"): bulk[0], ("bulk", "zero_embedding"): bulk[1],
            ("interactive", "non_finite_embedding"): interactive[0], ("interactive", "zero_embedding"): interactive[1]}


def points(model_id: str | None = None) -> int:
    return runtime.vector_store(model_id or spaces.active().model_id).count()


def found_by_text(api, text: str = "a photo") -> set[str]:
    r = api.post("/api/search/", {"text": text, "k": 50, "min_score": -1}, format="json")
    assert r.status_code == 200, r.json()
    return {h["image_id"] for h in r.json()["results"]}


def test_a_bulk_job_fails_unusable_vectors_alone_and_stores_and_finds_the_rest(poisoned, api, client):
    refusals, before = Refusals(client), points()
    files = [upload(f"{i}.jpg", jpeg_bytes(700 + i)) for i in range(3)]
    files += [upload("white.jpg", solid(255)), upload("white-big.jpg", solid(255, 80)), upload("black.jpg", solid(0))]
    r = api.post("/api/jobs/", {"files": files}, format="multipart")
    assert r.status_code == 202, r.json()
    job = r.json()["id"]
    rows = {im.original_name: (im.status, im.reason) for im in Image.objects.filter(job_id=job)}
    assert rows == {"0.jpg": ("embedded", ""), "1.jpg": ("embedded", ""), "2.jpg": ("embedded", ""),
                    "white.jpg": ("failed", "non_finite_embedding"),
                    "white-big.jpg": ("failed", "non_finite_embedding"), "black.jpg": ("failed", "zero_embedding")}
    progress = api.get(f"/api/jobs/{job}/").json()
    assert (progress["status"], progress["embedded"], progress["failed"], progress["total"]) == ("done", 3, 3, 6)
    assert points() == before + 3
    assert refusals.added() == counts(bulk=(2, 1))
    good = {str(i) for i in Image.objects.filter(job_id=job, status=ImageStatus.EMBEDDED).values_list("id", flat=True)}
    assert found_by_text(api) == good


def test_an_upload_fails_unusable_vectors_alone_and_a_lone_one_answers_422(poisoned, api, client):
    refusals, before = Refusals(client), points()
    r = api.post("/api/images/", {"files": [upload("ok.jpg", jpeg_bytes(720)), upload("white.jpg", solid(255)),
                                            upload("black.jpg", solid(0))]}, format="multipart")
    assert r.status_code == 200, r.json()
    images = r.json()["images"]
    assert [(im["status"], im["reason"]) for im in images] == [
        ("embedded", None), ("failed", "non_finite_embedding"), ("failed", "zero_embedding")]
    assert images[1]["neighbours"] == [] and images[2]["neighbours"] == []
    lone = api.post("/api/images/", {"files": [upload("white-big.jpg", solid(255, 80))]}, format="multipart")
    assert lone.status_code == 422, lone.json()
    assert [(im["status"], im["reason"]) for im in lone.json()["images"]] == [("failed", "non_finite_embedding")]
    assert points() == before + 1
    assert refusals.added() == counts(interactive=(2, 1))
    assert found_by_text(api) == {images[0]["id"]}


def test_a_query_whose_vector_is_unusable_answers_422_not_an_empty_list(poisoned, api, client):
    api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(730 + i)) for i in range(2)]}, format="multipart")
    refusals, before = Refusals(client), points()
    for body, reason in (({"text": NAN_TEXT, "min_score": -1}, "non_finite_embedding"),
                         ({"image": upload("white.jpg", solid(255))}, "non_finite_embedding"),
                         ({"image": upload("black.jpg", solid(0))}, "zero_embedding")):
        fmt = "json" if "text" in body else "multipart"
        r = api.post("/api/search/", {**body, "k": 5}, format=fmt)
        assert r.status_code == 422, r.json()
        assert set(r.json()) == {"message", "code", "extra"} and r.json()["code"] == reason
    assert refusals.added() == counts(interactive=(2, 1))
    assert points() == before and len(found_by_text(api)) == 2  # nothing stored; the others still found


def test_embeddings_requests_refuse_each_unusable_input_in_their_own_shapes(poisoned, api, user, client):
    refusals = Refusals(client)
    white = base64.b64encode(solid(255)).decode()
    black = base64.b64encode(solid(0)).decode()
    ok = base64.b64encode(jpeg_bytes(740)).decode()
    r = api.post("/api/embeddings/", {"inputs": [{"text": "a cat"}, {"text": NAN_TEXT}, {"image": ok},
                                                 {"image": white}, {"image": black}]}, format="json")
    assert r.status_code == 200, r.json()
    data = r.json()["data"]
    assert ["embedding" in d for d in data] == [True, False, True, False, False]
    assert [d.get("reason") for d in data] == [None, "non_finite_embedding", None, "non_finite_embedding",
                                               "zero_embedding"]
    assert "tokens" in data[0] and "tokens" not in data[1]
    every = api.post("/api/embeddings/", {"inputs": [{"text": NAN_TEXT}, {"image": white}]}, format="json")
    assert every.status_code == 422 and [d["reason"] for d in every.json()["data"]] == ["non_finite_embedding"] * 2
    openai = bearer(user).post("/v1/embeddings", {"model": "ViT-B-32", "input": ["a cat", f"data:image/jpeg;base64,{black}"]},
                         format="json")
    assert openai.status_code == 400, openai.json()
    assert (openai.json()["error"]["code"], openai.json()["error"]["param"]) == ("zero_embedding", "input[1]")
    assert refusals.added() == counts(interactive=(4, 2))
    assert Image.objects.count() == 0


def _nan_point(image_id: str) -> None:
    """Overwrite an embedded image's point with a NaN vector through the engine itself, as a write
    from before the screen left it (the store's own ``upsert`` refuses it now)."""
    im = Image.objects.get(id=image_id)
    store = runtime.vector_store(im.model_id)
    payload = store.payloads([im.point_id])[im.point_id]
    store.client.update(qe.UpdateOperation.upsert_points([qe.Point(str(im.point_id), [float("nan")] * store.dim,
                                                                   payload)]))


def _no_nan(constant: str):
    raise AssertionError(f"{constant} in a JSON answer")


def test_a_nan_point_already_in_the_store_breaks_no_search_and_no_export(service, api):
    r = api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(750 + i)) for i in range(3)]},
                 format="multipart")
    ids = sorted(str(i) for i in Image.objects.filter(job_id=r.json()["id"]).values_list("id", flat=True))
    broken, kept = ids[0], set(ids[1:])
    _nan_point(broken)
    assert points() == 3  # still there, as the issue found it

    assert found_by_text(api) == kept
    hits = api.post("/api/search/", {"image_id": ids[1], "k": 10, "min_score": -1, "include": "vector"}, format="json")
    assert hits.status_code == 200 and {h["image_id"] for h in hits.json()["results"]} == kept
    by_broken = api.post("/api/search/", {"image_id": broken, "k": 5}, format="json")
    assert by_broken.status_code == 409 and by_broken.json()["code"] == "vector_missing"
    detail = api.get(f"/api/images/{broken}/?include=vector")
    assert detail.status_code == 200 and detail.json()["vector"] is None
    assert api.get(f"/api/images/{ids[1]}/?include=vector").json()["vector"] is not None

    jsonl = api.get("/api/exports/vectors.jsonl")
    assert jsonl.status_code == 200
    lines = [json.loads(line, parse_constant=_no_nan) for line in b"".join(jsonl.streaming_content).splitlines()]
    assert {row["id"] for row in lines} == kept
    parquet = api.get("/api/exports/vectors.parquet")
    table = pq.read_table(io.BytesIO(b"".join(parquet.streaming_content)))
    assert set(table.column("id").to_pylist()) == kept
    assert np.isfinite(np.asarray(table.column("vector").to_pylist(), np.float32)).all()


@pytest.fixture(scope="module")
def small_encoder(random_config):
    """ViT-S-32 with seeded random weights (the migration's model), loaded once for the module."""
    from workers.model import ClipEncoder

    return ClipEncoder(random_config.replace(model_name="ViT-S-32"))


def test_a_migration_to_a_model_with_unusable_vectors_fails_them_alone_and_its_gate(service, settings, api, staff,
                                                                                 client, small_encoder, monkeypatch):
    settings.CLIP_MODELS = ["ViT-S-32:random"]
    settings.SPACE_CACHE_S = 0.0
    spaces.forget_cache()
    runtime.encoder_holder(S)._encoder = small_encoder
    poison(small_encoder, monkeypatch)  # the active ViT-B-32 is healthy: the catalogue embeds whole
    # the gate is run below, once the job is done: inline (eager) it would run inside the last
    # chunk's bulk turn, which a worker never does
    done = []
    monkeypatch.setattr(migrations, "migration_job_done", lambda job: done.append(job.id))
    files = [upload(f"{i}.jpg", jpeg_bytes(760 + i)) for i in range(3)]
    files += [upload("white.jpg", solid(255)), upload("black.jpg", solid(0))]
    assert api.post("/api/jobs/", {"files": files}, format="multipart").status_code == 202
    active = spaces.active().model_id
    assert points(active) == 5
    refusals = Refusals(client)

    admin = client_for(staff)
    r = admin.post("/api/migrations/", {"model": "ViT-S-32", "pretrained": "random"}, format="json")
    assert r.status_code == 202, r.json()
    copies = {Image.objects.get(id=c.source_id).original_name: (c.status, c.reason)
              for c in Image.objects.filter(model_id=S, source__isnull=False)}
    assert copies == {"0.jpg": ("embedded", ""), "1.jpg": ("embedded", ""), "2.jpg": ("embedded", ""),
                      "white.jpg": ("failed", "non_finite_embedding"), "black.jpg": ("failed", "zero_embedding")}
    assert (points(S), points(active)) == (3, 5)
    space = EmbeddingSpace.objects.get(model_id=S)
    assert done == [space.job_id]
    gate.gate_start(space.id)
    assert refusals.added() == counts(bulk=(1, 1))  # the gate's copies of the 3 embedded ones are all usable

    report = EmbeddingSpace.objects.get(model_id=S).gate_report
    assert (report["state"], report["coverage"], report["unusable_vectors"], report["passed"]) == ("done", 0.6, 2,
                                                                                                  False)
    url = r.json()["url"]
    refused = admin.post(f"{url}promote/", {"force": False}, format="json")
    assert refused.status_code == 409 and refused.json()["code"] == "gate_failed", refused.json()
    assert "no usable vector" in refused.json()["message"]
    assert spaces.active(fresh=True).model_id == active
