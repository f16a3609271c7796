"""``POST /api/embeddings/`` and ``POST /v1/embeddings`` in one process (eager Celery, embedded
Qdrant, the random-weights ViT-B-32), with real vectors: unit length, equal for equal bytes, equal
to the stored image's point, in input order; per-input reasons; limits; 429; URL inputs from the
local origin server."""
from __future__ import annotations

import base64
import uuid

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings import runtime, spaces
from embeddings.models import Image, ImageStatus
from tests.embeddings.conftest import client_for
from tests.embeddings.lane_control.conftest import (  # noqa: F401
    lane_redis,
    measured,
    redis_url,
    tracker,
)
from tests.embeddings.lane_control.test_admission import overloaded  # noqa: F401 - a backlog beyond the deadline
from tests.origin_server import pixels_jpeg

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/embeddings/"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media: str = "image/jpeg") -> str:
    return f"data:{media};base64,{b64(data)}"


def vec(item: dict) -> np.ndarray:
    e = item["embedding"]
    return np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str) else np.asarray(e, dtype=np.float32)


def post(api, body: dict, **kw):
    return api.post(URL, body, format="json", **kw)


def stored_vector(image_id: str) -> np.ndarray:
    im = Image.objects.get(id=image_id)
    got = runtime.vector_store(im.model_id).vectors([im.point_id])
    return np.asarray(got[im.point_id], dtype=np.float32)


def test_texts_and_images_answer_unit_vectors_in_input_order(service, api):
    a, b = pixels_jpeg(1), pixels_jpeg(2)
    r = post(api, {"inputs": [{"text": "a cat"}, {"image": b64(a)}, {"text": "a dog"}, {"image": data_url(b)},
                              {"image": data_url(a)}]})
    assert r.status_code == 200, r.json()
    body = r.json()
    data = body["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3, 4]
    assert [d["kind"] for d in data] == ["text", "image", "text", "image", "image"]
    space = spaces.active()
    assert body["space"] == {"id": space.model_id, "model": space.model_name, "pretrained": space.pretrained,
                             "dimension": space.dim, "precision": space.precision}
    vectors = [vec(d) for d in data]
    for v in vectors:
        assert v.shape == (space.dim,) and abs(np.linalg.norm(v) - 1) < 1e-5
    assert float(vectors[1] @ vectors[4]) == pytest.approx(1.0, abs=1e-6)  # same bytes, base64 or data URL
    assert float(vectors[1] @ vectors[3]) < 0.9999  # other pixels
    assert float(vectors[0] @ vectors[2]) < 0.9999
    assert data[0]["tokens"] == 4  # start, "a", "cat", end
    assert Image.objects.count() == 0  # nothing stored without store


def test_float_and_base64_answer_the_same_numbers(service, api):
    inputs = [{"image": b64(pixels_jpeg(3))}, {"text": "a red shoe"}]
    floats = post(api, {"inputs": inputs}).json()["data"]
    packed = post(api, {"inputs": inputs, "encoding_format": "base64"})
    assert packed.status_code == 200 and packed.json()["encoding_format"] == "base64"
    for f, p in zip(floats, packed.json()["data"]):
        assert isinstance(f["embedding"], list) and isinstance(p["embedding"], str)
        assert np.array_equal(vec(f), vec(p))  # the same float32 values, bit for bit


def test_an_uploaded_images_stored_vector_is_the_vector_of_its_bytes(service, api):
    data = pixels_jpeg(4)
    up = api.post("/api/images/", {"files": [SimpleUploadedFile("x.jpg", data, content_type="image/jpeg")], "k": 0},
                  format="multipart").json()["images"][0]
    assert up["status"] == "embedded"
    (item,) = post(api, {"inputs": [{"image": b64(data)}]}).json()["data"]
    assert float(vec(item) @ stored_vector(up["id"])) == pytest.approx(1.0, abs=1e-6)


def test_multipart_files_come_first_then_the_inputs_array(service, api):
    import json

    a, b = pixels_jpeg(5), pixels_jpeg(6)
    r = api.post(URL, {"files": [SimpleUploadedFile("a.jpg", a, content_type="image/jpeg")],
                       "inputs": json.dumps([{"text": "a boat"}, {"image": b64(b)}, {"image": b64(a)}])},
                 format="multipart")
    assert r.status_code == 200, r.json()
    data = r.json()["data"]
    assert [d["kind"] for d in data] == ["image", "text", "image", "image"]
    assert float(vec(data[0]) @ vec(data[3])) == pytest.approx(1.0, abs=1e-6)


def test_store_makes_the_images_yours_with_their_stored_vectors(service, api, user):
    a, b = pixels_jpeg(7), pixels_jpeg(8)
    r = post(api, {"store": True, "inputs": [
        {"image": b64(a), "external_id": "SKU-7", "metadata": {"colour": "red"}}, {"text": "never stored"},
        {"image": data_url(b)}, {"image": b64(b"not an image at all")}]})
    assert r.status_code == 200, r.json()
    first, text, second, bad = r.json()["data"]
    assert first["status"] == second["status"] == "embedded" and "image_id" not in text
    for item in (first, second):
        assert float(vec(item) @ stored_vector(item["image_id"])) == pytest.approx(1.0, abs=1e-6)
    im = Image.objects.get(id=first["image_id"])
    assert (im.owner_id, im.external_id, im.metadata) == (user.id, "SKU-7", {"colour": "red"})
    assert bad["reason"] == "not_an_image" and "image_id" not in bad  # refused before anything is stored
    assert Image.objects.count() == 2  # the two images; the text is not stored
    # the same bytes again: a copy of the image stored, its vector the same
    again = post(api, {"store": True, "inputs": [{"image": b64(a)}]}).json()["data"][0]
    assert again["status"] == "skipped" and np.array_equal(vec(again), vec(first))


def test_multipart_store_keeps_each_files_external_id_and_metadata(service, api, user):
    files = [SimpleUploadedFile(f"p{n}.jpg", pixels_jpeg(n), "image/jpeg") for n in (31, 32)]
    r = api.post("/api/embeddings/", {"files": files, "store": "true", "external_id": ["MP-A", "MP-B"],
                                      "metadata": ['{"k": 1}', '{"k": 2}']}, format="multipart")
    assert r.status_code == 200, r.json()
    stored = [Image.objects.get(id=item["image_id"]) for item in r.json()["data"]]
    assert [(im.owner_id, im.external_id, im.metadata) for im in stored] == [
        (user.id, "MP-A", {"k": 1}), (user.id, "MP-B", {"k": 2})]


def test_a_refused_input_fails_alone_with_its_reason(service, api):
    r = post(api, {"inputs": [
        {"image": "@@@ not base64 @@@"}, {"image": data_url(b"hello", "text/plain")},
        {"image": b64(b"%PDF-1.4 not an image")}, {"text": "   "}, {"image": b64(pixels_jpeg(9))},
        {"image": "data:image/png,rawbytes"}, {"image": ""}]})
    assert r.status_code == 200, r.json()
    data = r.json()["data"]
    assert [d.get("reason") for d in data] == ["invalid_base64", "not_an_image", "not_an_image", "empty", None,
                                               "invalid_base64", "empty"]
    assert all("embedding" not in d and d["detail"] for d in data if "reason" in d)
    assert "embedding" in data[4]


@pytest.mark.parametrize("inputs,status,reason", [
    ([{"image": b64(b"%PDF-1.4")}], 415, "not_an_image"),
    ([{"image": "!!"}, {"text": ""}], 400, None),
    ([{"image": "!!"}], 400, "invalid_base64"),
])
def test_when_every_input_is_refused_the_status_follows_the_reasons(service, api, inputs, status, reason):
    r = post(api, {"inputs": inputs})
    assert r.status_code == status
    assert all("reason" in d for d in r.json()["data"])
    if reason:
        assert r.json()["data"][0]["reason"] == reason


def test_limits_and_malformed_requests(service, api, settings):
    r = post(api, {"inputs": []})
    assert r.status_code == 400 and r.json()["code"] == "no_inputs"
    r = post(api, {"inputs": [{"text": str(i)} for i in range(10_000)]})
    assert r.status_code == 400 and r.json()["code"] == "too_many_inputs"
    assert r.json()["extra"] == {"limit": "EMBEDDINGS_MAX_INPUTS", "value": 256, "inputs": 10_000}
    settings.EMBEDDINGS_MAX_INPUTS = 2
    r = post(api, {"inputs": [{"text": "a"}] * 3})
    assert r.status_code == 400 and r.json()["extra"]["value"] == 2
    for bad in ([{"text": "a", "image": "b"}], [{"texts": "a"}], ["a"], [{"text": 3}]):
        r = post(api, {"inputs": bad})
        assert r.status_code == 400 and r.json()["code"] == "invalid_input" and r.json()["extra"]["index"] == 0
    r = post(api, {"inputs": [{"image": b64(pixels_jpeg(1)), "external_id": "x"}]})  # kept only with store
    assert r.status_code == 400 and r.json()["code"] == "invalid_input"
    r = post(api, {"inputs": [{"text": "a"}], "encoding_format": "float16"})
    assert r.status_code == 400 and r.json()["code"] == "invalid"


def test_a_long_text_is_read_as_its_first_2000_characters(service, api):
    long = "a photo of a cat " * 500
    a, b = post(api, {"inputs": [{"text": long}, {"text": long[:2000]}]}).json()["data"]
    assert np.array_equal(vec(a), vec(b)) and a["tokens"] == b["tokens"] == 77  # CLIP's context length


def test_the_deadline_passed_answers_504_and_keeps_nothing(service, api, monkeypatch):
    import time

    from embeddings.services.interactive import embed

    send = embed.dispatch.send_embed_inputs
    monkeypatch.setattr(embed.dispatch, "send_embed_inputs", lambda **kw: (time.sleep(0.1), send(**kw))[1])
    r = post(api, {"inputs": [{"image": b64(pixels_jpeg(10))}], "deadline": 0.05})
    assert r.status_code == 504 and r.json()["code"] == "deadline_exceeded"
    assert not list(service.BLOB_ROOT.glob("tmp/*"))  # the staged image is gone


def test_an_overloaded_lane_answers_429_with_retry_after(overloaded, api):  # noqa: F811
    r = post(api, {"inputs": [{"text": "a cat"}, {"image": b64(pixels_jpeg(11))}]})
    assert r.status_code == 429 and r.json()["code"] == "overloaded" and int(r["Retry-After"]) >= 1
    r = api.post("/v1/embeddings", {"model": "ViT-B-32", "input": "a cat"}, format="json")
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and "Retry-After" in r


# --- URLs -----------------------------------------------------------------------------------------

@pytest.fixture
def fetching(service, origin):
    """The service allowed to fetch from the test server on 127.0.0.1 (refused by default)."""
    service.FETCH_ALLOW_NETWORKS = ["127.0.0.1/32"]
    service.FETCH_RETRIES = 0
    runtime.fetcher.cache_clear()
    yield service
    runtime.fetcher.cache_clear()


def test_url_inputs_are_fetched_under_the_fetch_rules(fetching, api, origin):
    r = post(api, {"inputs": [
        {"image_url": f"{origin.url}/pixels/12.jpg"}, {"image": b64(pixels_jpeg(12))},
        {"image_url": "http://169.254.169.254/latest/meta-data/"}, {"image_url": f"{origin.url}/status/404"},
        {"image_url": "ftp://example.com/a.jpg"}, {"image_url": data_url(pixels_jpeg(12))}]})
    assert r.status_code == 200, r.json()
    fetched, sent, metadata, missing, ftp, inline = r.json()["data"]
    assert float(vec(fetched) @ vec(sent)) == pytest.approx(1.0, abs=1e-6)
    assert np.array_equal(vec(inline), vec(sent))
    assert metadata["reason"] == "fetch_refused_address" and "169.254.169.254" in metadata["detail"]
    assert missing["reason"] == "fetch_status" and "404" in missing["detail"]
    assert ftp["reason"] == "fetch_invalid_url"


def test_loopback_is_refused_without_the_allowance(service, api, origin):
    runtime.fetcher.cache_clear()
    r = post(api, {"inputs": [{"image_url": f"{origin.url}/pixels/1.jpg"}]})
    assert r.status_code == 400 and r.json()["data"][0]["reason"] == "fetch_refused_address"


def test_store_with_a_url_stores_the_fetched_bytes(fetching, api, origin):
    r = post(api, {"store": True, "inputs": [{"image_url": f"{origin.url}/pixels/13.jpg", "external_id": "u-13"}]})
    assert r.status_code == 200, r.json()
    (item,) = r.json()["data"]
    im = Image.objects.get(id=item["image_id"])
    assert im.status == ImageStatus.EMBEDDED and im.external_id == "u-13"
    assert float(vec(item) @ stored_vector(item["image_id"])) == pytest.approx(1.0, abs=1e-6)


# --- OpenAI's endpoint ----------------------------------------------------------------------------

def bearer(user):
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.get_or_create(user=user)[0].key}")
    return c


def openai(client, body: dict):
    return client.post("/v1/embeddings", body, format="json")


def test_openai_endpoint_answers_openais_shape_with_the_same_vectors(service, api, user):
    client = bearer(user)
    space = spaces.active()
    image = data_url(pixels_jpeg(14))
    for model in (space.model_id, space.model_name, space.model_name.lower()):
        r = openai(client, {"model": model, "input": ["a cat", image]})
        assert r.status_code == 200, r.json()
        body = r.json()
        assert body["object"] == "list" and body["model"] == space.model_id
        assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    ours = post(api, {"inputs": [{"text": "a cat"}, {"image": image}]}).json()["data"]
    for d, o in zip(body["data"], ours):
        assert np.array_equal(np.asarray(d["embedding"], dtype=np.float32), vec(o))
    assert body["usage"] == {"prompt_tokens": 4 + 50, "total_tokens": 4 + 50}  # "a cat": 4; an image: 7 × 7 + 1
    packed = openai(client, {"model": space.model_id, "input": "a cat", "encoding_format": "base64"}).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4"), vec(ours[0]))
    forced = openai(client, {"model": space.model_id, "input": image, "modality": "text"}).json()
    assert forced["usage"]["prompt_tokens"] == 77  # read as a (long) text


def test_bearer_tokens_work_everywhere_and_errors_keep_each_endpoints_shape(service, user, client):
    assert bearer(user).get("/api/images/").status_code == 200
    r = client.post("/v1/embeddings", {"model": "x", "input": "a"}, content_type="application/json")
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    bad = bearer(user)
    bad.credentials(HTTP_AUTHORIZATION="Bearer nope")
    assert bad.get("/api/images/").status_code == 401


@pytest.mark.parametrize("body,status,code,param", [
    ({"model": "no-such-model", "input": "a"}, 404, "model_not_found", "model"),
    ({"input": "a"}, 400, "invalid", "model"),
    ({"model": "ViT-B-32"}, 400, "invalid_input", "input"),
    ({"model": "ViT-B-32", "input": []}, 400, "no_inputs", None),
    ({"model": "ViT-B-32", "input": ["a"] * 10_000}, 400, "too_many_inputs", None),
    ({"model": "ViT-B-32", "input": [[1, 2, 3]]}, 400, "invalid_input", "input[0]"),
    ({"model": "ViT-B-32", "input": "a", "dimensions": 256}, 400, "invalid_dimensions", "dimensions"),
    ({"model": "ViT-B-32", "input": ["a", "data:text/plain;base64,aGVsbG8="]}, 400, "not_an_image", "input[1]"),
    ({"model": "ViT-B-32", "input": ["data:image/png;base64,@@@"]}, 400, "invalid_base64", "input[0]"),
    ({"model": "ViT-B-32", "input": ""}, 400, "empty", "input[0]"),
    ({"model": "ViT-B-32", "input": "a", "encoding_format": "int8"}, 400, "invalid", "encoding_format"),
])
def test_openai_errors_are_openais_shape(service, user, body, status, code, param):
    r = openai(bearer(user), body)
    assert r.status_code == status, r.json()
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["code"], error["param"]) == (code, param)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_dimensions_equal_to_the_spaces_are_accepted(service, user):
    r = openai(bearer(user), {"model": "ViT-B-32", "input": "a", "dimensions": spaces.active().dim, "user": "u-1"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == spaces.active().dim


def test_an_unknown_id_is_not_a_space_even_when_it_looks_like_one(service, user):
    r = openai(bearer(user), {"model": f"ViT-B-32/{uuid.uuid4().hex}/fp32", "input": "a"})
    assert r.status_code == 404 and spaces.active().model_id in r.json()["error"]["message"]


def test_client_for_token_keyword_still_works(service, user):
    assert client_for(user).get("/api/images/").status_code == 200


def test_a_space_without_a_text_tower_refuses_texts_and_embeds_images(service, api, encoder, tmp_path):
    """A checkpoint of the image tower alone: each text input is refused with
    ``text_tower_missing`` (a 422 when every input is a text), images are embedded as before."""
    import torch

    from workers.config import PipelineConfig
    from workers.model import ClipEncoder

    path = tmp_path / "visual-only.pt"
    torch.save({f"visual.{k}": v for k, v in encoder.model.visual.state_dict().items()}, path)
    runtime.encoder_holder()._encoder = ClipEncoder(PipelineConfig(pretrained=str(path), torch_threads=2))
    r = post(api, {"inputs": [{"text": "a cat"}, {"image": b64(pixels_jpeg(1))}]})
    assert r.status_code == 200, r.json()
    text, image = r.json()["data"]
    assert text["reason"] == "text_tower_missing" and "vector" not in text
    assert vec(image).shape == (512,)
    r = post(api, {"inputs": [{"text": "a cat"}, {"text": "a dog"}]})
    assert r.status_code == 422, r.json()
