"""The official ``openai`` client against the running stack's ``POST /v1/embeddings`` (real web,
Redis, workers, random-weights ViT-B-32): texts and images (data URLs), float and base64, the
same vectors as ``POST /api/embeddings/`` and as a stored image's, and bad input raised as
openai's typed errors. Images are distinct pixels (``pixels_jpeg``) this module alone sends: the
stack is shared with other modules."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.origin_server import pixels_jpeg

openai = pytest.importorskip("openai")

#: Seeds of this module's images (other modules use small ones).
SEEDS = (4201, 4202, 4203)


def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def as_array(embedding) -> np.ndarray:
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)


@pytest.fixture(scope="module")
def model(api) -> str:
    r = api.post("/api/embeddings/", json={"inputs": [{"text": "warm-up"}]})
    assert r.status_code == 200, r.text
    return r.json()["space"]["id"]


def test_texts_and_images_through_the_client_equal_the_apis_vectors(client, api, model):
    image = data_url(pixels_jpeg(SEEDS[0]))
    inputs = ["a photo of a cat", image, "a photo of a dog"]
    decoded = client.embeddings.create(model=model, input=inputs)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model=model, input=inputs, encoding_format="float")
    packed = client.embeddings.create(model=model, input=inputs, encoding_format="base64")
    ours = api.post("/api/embeddings/", json={"inputs": [{"text": inputs[0]}, {"image": image}, {"text": inputs[2]}]})
    assert ours.status_code == 200, ours.text
    assert decoded.model == model and [d.index for d in decoded.data] == [0, 1, 2]
    assert decoded.usage.prompt_tokens == decoded.usage.total_tokens > 50
    for i, mine in enumerate(ours.json()["data"]):
        expected = as_array(mine["embedding"])
        for answer in (decoded, floats, packed):
            got = as_array(answer.data[i].embedding)
            assert got.shape == expected.shape == (512,)
            assert float(got @ expected) == pytest.approx(1.0, abs=1e-6)
        assert abs(np.linalg.norm(expected) - 1) < 1e-5
    # float and base64 answers carry the same float32 values
    assert all(np.array_equal(as_array(f.embedding), as_array(p.embedding)) for f, p in zip(floats.data, packed.data))


def test_an_image_through_the_client_equals_the_stored_images_vector(client, api, model):
    data = pixels_jpeg(SEEDS[1])
    up = api.post("/api/images/", files=[("files", ("x.jpg", data, "image/jpeg"))], data={"k": 0})
    assert up.status_code == 200, up.text
    image = up.json()["images"][0]
    assert image["status"] == "embedded"
    stored = api.get(f"/api/images/{image['id']}/", params={"include": "vector"})
    assert stored.status_code == 200, stored.text
    got = client.embeddings.create(model=model, input=[data_url(data)]).data[0].embedding
    assert float(as_array(got) @ as_array(stored.json()["vector"])) == pytest.approx(1.0, abs=1e-6)
    # and the vector store=true answers for other bytes is the one the client gets for them
    other = pixels_jpeg(SEEDS[2])
    kept = api.post("/api/embeddings/", json={"store": True, "inputs": [{"image": data_url(other)}]})
    assert kept.status_code == 200, kept.text
    (item,) = kept.json()["data"]
    assert item["status"] == "embedded" and item["image_id"]
    got = client.embeddings.create(model=model, input=data_url(other)).data[0].embedding
    assert float(as_array(got) @ as_array(item["embedding"])) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kwargs,error,code", [
    ({"input": []}, "BadRequestError", "no_inputs"),
    ({"input": ["a"] * 10_000}, "BadRequestError", "too_many_inputs"),
    ({"input": ["a cat", "data:text/plain;base64,aGVsbG8="]}, "BadRequestError", "not_an_image"),
    ({"input": ["data:image/jpeg;base64,@@not base64@@"]}, "BadRequestError", "invalid_base64"),
    ({"input": ["a cat"], "model": "no-such-model"}, "NotFoundError", "model_not_found"),
    ({"input": ["a cat"], "dimensions": 128}, "BadRequestError", "invalid_dimensions"),
])
def test_bad_input_raises_openais_typed_errors(client, model, kwargs, error, code):
    with pytest.raises(getattr(openai, error)) as raised:
        client.embeddings.create(**{"model": model, **kwargs})
    body = raised.value.body  # the client's parsed "error" object
    assert body["code"] == code and body["message"] and "type" in body and "param" in body


def test_a_wrong_token_is_an_authentication_error(stack, model):
    with openai.OpenAI(base_url=stack.web_url + "/v1", api_key="not-a-token", max_retries=0) as c, \
            pytest.raises(openai.AuthenticationError):
        c.embeddings.create(model=model, input="a cat")
