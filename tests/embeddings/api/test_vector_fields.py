"""Vectors out of the API, in one process (eager Celery, a real embedded store, random ViT-B-32
weights): ``include=vector`` on images and searches, and ``GET /api/exports/vectors.{format}``."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embeddings import runtime, spaces
from embeddings.models import Image, ImageStatus, Lane
from tests.embeddings.conftest import client_for, jpeg_bytes, upload
from workers.ids import point_id

pytestmark = pytest.mark.django_db(transaction=True)


def store_vector(image_id: str) -> np.ndarray:
    """The store's own vector of an image's bytes in the active space (an original's, for a copy)."""
    im = Image.objects.get(id=image_id)
    model_id = spaces.active().model_id
    pid = point_id(im.sha256, model_id)
    return runtime.vector_store(model_id).vectors([pid])[pid]


def as_f32(v, fmt: str = "float") -> np.ndarray:
    return (np.asarray(v, np.float64).astype(np.float32) if fmt == "float"
            else np.frombuffer(base64.b64decode(v), "<f4").astype(np.float32))


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and a.tobytes() == b.tobytes()


@pytest.fixture
def catalogue(service, api, user):
    """A bulk job of 6 images of the caller's (one repeated: skipped) and one interactive upload;
    another user's 2 images. ``{"job", "ids", "dup", "upload", "theirs"}``."""
    files = [upload(f"{i}.jpg", jpeg_bytes(300 + i)) for i in range(5)] + [upload("again.jpg", jpeg_bytes(300))]
    r = api.post("/api/jobs/", {"files": files, "external_id": [f"sku-{i}" for i in range(6)],
                                "metadata": [json.dumps({"n": i, "label": f"ü{i}"}) for i in range(6)]},
                 format="multipart")
    assert r.status_code == 202, r.json()
    job = r.json()["id"]
    rows = list(Image.objects.filter(job_id=job).order_by("external_id"))
    assert [im.status for im in rows].count(ImageStatus.SKIPPED) == 1
    dup = next(im for im in rows if im.status == ImageStatus.SKIPPED)
    one = api.post("/api/images/", {"files": [upload("solo.jpg", jpeg_bytes(399))]}, format="multipart")
    assert one.status_code == 200
    other = client_for(Image.objects.model.owner.field.related_model.objects.create_user("carol", password="pw"))
    theirs = other.post("/api/jobs/", {"files": [upload(f"t{i}.jpg", jpeg_bytes(500 + i)) for i in range(2)]},
                        format="multipart").json()["id"]
    return {"job": job, "ids": [str(im.id) for im in rows], "dup": str(dup.id),
            "upload": one.json()["images"][0]["id"], "other": other,
            "theirs": [str(i) for i in Image.objects.filter(job_id=theirs).values_list("id", flat=True)]}


def test_image_include_vector_is_the_stored_vector_in_either_format(catalogue, api):
    image_id = catalogue["ids"][1]
    plain = api.get(f"/api/images/{image_id}/").json()
    assert "vector" not in plain and "vector_model_id" not in plain  # only when asked for
    r = api.get(f"/api/images/{image_id}/?include=vector")
    assert r.status_code == 200
    body = r.json()
    assert body["vector_model_id"] == spaces.active().model_id and len(body["vector"]) == 512
    assert bit_equal(as_f32(body["vector"]), store_vector(image_id))
    b64 = api.get(f"/api/images/{image_id}/?include=vector&vector_format=base64").json()["vector"]
    assert bit_equal(as_f32(b64, "base64"), store_vector(image_id))
    # a skipped duplicate answers its original's vector
    dup = api.get(f"/api/images/{catalogue['dup']}/?include=vector").json()
    assert dup["status"] == "skipped" and bit_equal(as_f32(dup["vector"]), store_vector(catalogue["dup"]))


def test_an_image_without_a_vector_answers_null_and_bad_parameters_400(catalogue, api, user):
    queued = Image.objects.create(owner=user, lane=Lane.BULK, status=ImageStatus.QUEUED, sha256="", size_bytes=0,
                                  storage_key="", model_id=spaces.active().model_id, origin="https://example.com/a")
    body = api.get(f"/api/images/{queued.id}/?include=vector").json()
    assert body["vector"] is None and body["vector_model_id"] == spaces.active().model_id
    for query in ("include=vectors", "include=vector&vector_format=hex"):
        r = api.get(f"/api/images/{catalogue['ids'][0]}/?{query}")
        assert r.status_code == 400 and r.json()["code"] == "invalid", query


def test_list_include_vector_reads_the_store_once_per_page(catalogue, api, monkeypatch):
    from embeddings import sink

    calls = []
    real = sink.store_call
    monkeypatch.setattr(sink, "store_call", lambda name, *a, **k: calls.append(name) or real(name, *a, **k))
    r = api.get("/api/images/?include=vector&vector_format=base64")
    assert r.status_code == 200
    results = r.json()["results"]
    assert len(results) == 7 and calls == ["point_vectors"]  # 6 of the job + the upload, one read
    for row in results:
        assert bit_equal(as_f32(row["vector"], "base64"), store_vector(row["id"]))
    assert not {row["id"] for row in results} & set(catalogue["theirs"])


def test_search_include_vector_comes_with_the_hits(catalogue, api):
    for body in ({"image_id": catalogue["ids"][2], "k": 4, "min_score": 0, "include": "vector"},
                 {"text": "a photo", "k": 3, "min_score": 0, "include": "vector", "vector_format": "base64"}):
        r = api.post("/api/search/", body, format="json")
        assert r.status_code == 200, r.json()
        hits = r.json()["results"]
        assert hits and r.json()["model_id"] == spaces.active().model_id
        fmt = body.get("vector_format", "float")
        for hit in hits:
            assert bit_equal(as_f32(hit["vector"], fmt), store_vector(hit["image_id"]))
    plain = api.post("/api/search/", {"image_id": catalogue["ids"][2], "k": 2, "min_score": 0}, format="json")
    assert all("vector" not in hit for hit in plain.json()["results"])


def _parquet(api, query: str = "") -> pa.Table:
    r = api.get(f"/api/exports/vectors.parquet{query}")
    assert r.status_code == 200 and r["Content-Type"] == "application/vnd.apache.parquet"
    assert json.loads(r["Embedding-Space"])["model_id"] == spaces.active().model_id
    return pq.read_table(io.BytesIO(b"".join(r.streaming_content)))


def test_export_parquet_equals_the_store_and_include_vector(catalogue, api):
    table = _parquet(api)
    mine = set(catalogue["ids"]) | {catalogue["upload"]}
    assert table.num_rows == 7 and set(table.column("id").to_pylist()) == mine
    rows = {r["id"]: r for r in table.to_pylist()}
    for image_id, row in rows.items():
        exported = np.asarray(row["vector"], np.float32)
        assert bit_equal(exported, store_vector(image_id))
        via_api = api.get(f"/api/images/{image_id}/?include=vector").json()["vector"]
        assert bit_equal(as_f32(via_api), exported)
    dup = rows[catalogue["dup"]]
    assert dup["external_id"] == "sku-5" and json.loads(dup["metadata"]) == {"n": 5, "label": "ü5"}
    assert json.loads(table.schema.metadata[b"embedding_space"])["pretrained"] == "random"


def test_export_job_filter_owner_isolation_and_staff(catalogue, api, staff):
    job = _parquet(api, f"?job={catalogue['job']}")
    assert set(job.column("id").to_pylist()) == set(catalogue["ids"])
    theirs = _parquet(catalogue["other"])
    assert set(theirs.column("id").to_pylist()) == set(catalogue["theirs"])
    everyone = _parquet(client_for(staff))
    assert everyone.num_rows == 9
    r = catalogue["other"].get(f"/api/exports/vectors.parquet?job={catalogue['job']}")  # not their job
    assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_export_jsonl_and_npz_through_the_view(catalogue, api):
    r = api.get("/api/exports/vectors.jsonl?vector_format=base64")
    assert r.status_code == 200 and r["Content-Type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in b"".join(r.streaming_content).decode().splitlines()]
    assert len(lines) == 7
    assert all(bit_equal(as_f32(row["vector"], "base64"), store_vector(row["id"])) for row in lines)
    r = api.get("/api/exports/vectors.npz", HTTP_ACCEPT="application/zip")
    assert r.status_code == 200 and r["Content-Disposition"] == 'attachment; filename="vectors.npz"'
    npz = np.load(io.BytesIO(b"".join(r.streaming_content)))
    ids = pq.read_table(pa.BufferReader(npz["ids.parquet"])).column("id").to_pylist()
    assert npz["vectors"].shape == (7, 512)
    assert all(bit_equal(npz["vectors"][i], store_vector(image_id)) for i, image_id in enumerate(ids))


def test_export_errors_answer_the_error_shape_before_any_byte(catalogue, api, monkeypatch):
    from embeddings import sink
    from embeddings.errors import ApplicationError

    r = api.get("/api/exports/vectors.csv")
    assert r.status_code == 400 and r.json()["code"] == "unsupported_export_format"
    r = api.get("/api/exports/vectors.parquet?job=not-a-uuid")
    assert r.status_code == 400 and r.json()["code"] == "invalid"
    r = api.get("/api/exports/vectors.parquet?job=00000000-0000-4000-8000-000000000000")
    assert r.status_code == 404 and r.json()["code"] == "not_found"

    def down(name, *args, **kwargs):
        raise ApplicationError("the vector store did not answer within 5 s", code="vectors_unavailable",
                               status=503, headers={"Retry-After": "5"})

    monkeypatch.setattr(sink, "store_call", down)
    r = api.get("/api/exports/vectors.parquet", HTTP_ACCEPT="application/vnd.apache.parquet")
    assert r.status_code == 503 and r.json()["code"] == "vectors_unavailable" and r["Retry-After"] == "5"
    r = api.get(f"/api/images/{catalogue['ids'][0]}/?include=vector")
    assert r.status_code == 503 and r.json()["code"] == "vectors_unavailable"
