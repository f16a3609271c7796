"""``POST /api/search/`` by positive and negative examples, and diverse results, end to end in one
process (eager Celery, the embedded edge store, the random-weights model): exact ids and order
against numpy over the stored vectors, the caller's and the metadata filter inside the query, and
the bad inputs of issue 45 (an empty positive list, 1,000 examples, another user's image, a
diversity outside [0, 1], mixed query kinds)."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from embeddings import runtime, spaces
from embeddings.models import Image
from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gallery(service, api):
    """Eight embedded images of the caller (external ids e0..e7) → (ids, {id: stored vector})."""
    ids = []
    for i in range(8):
        r = api.post("/api/images/", {"files": [upload(f"{i}.jpg", jpeg_bytes(4500 + i))], "external_id": f"e{i}",
                                      "k": 0}, format="multipart")
        assert r.status_code == 200, r.json()
        ids.append(r.json()["images"][0]["id"])
    store = runtime.vector_store(spaces.active().model_id)
    rows = {str(im.id): uuid.UUID(str(im.point_id)) for im in Image.objects.filter(id__in=ids)}
    got = store.vectors(list(rows.values()))
    return ids, {i: got[rows[i]] for i in ids}


def _unit(v):
    return np.asarray(v, np.float64) / np.linalg.norm(v)


def _best_score(vec, pos, neg):
    s = lambda x: (x / (1 + abs(x)) + 1) / 2  # noqa: E731 - Qdrant's scaled_fast_sigmoid
    bp = max(float(_unit(vec) @ _unit(p)) for p in pos)
    bn = max((float(_unit(vec) @ _unit(n)) for n in neg), default=-2.0)
    return s(bp) if bp > bn else -s(bn)


def search(api, body, fmt="json"):
    return api.post("/api/search/", body, format=fmt)


def test_stored_examples_rank_as_best_score_and_are_left_out(gallery, api):
    ids, vec = gallery
    pos, neg = [ids[0], ids[1]], [ids[2]]
    r = search(api, {"positive": [{"image_id": i} for i in pos], "negative": [{"image_id": ids[2]}], "k": 10})
    assert r.status_code == 200, r.json()
    body = r.json()
    assert body["strategy"] == "best_score" and body["min_score"] is None
    want = sorted((i for i in ids if i not in pos + neg),
                  key=lambda i: -_best_score(vec[i], [vec[p] for p in pos], [vec[n] for n in neg]))
    assert [h["image_id"] for h in body["results"]] == want  # 5 hits: every other image, the examples left out
    for h in body["results"]:
        assert h["score"] == pytest.approx(_best_score(vec[h["image_id"]], [vec[p] for p in pos],
                                                       [vec[n] for n in neg]), abs=1e-4)


@pytest.mark.parametrize("strategy", ["sum_scores", "average_vector"])
def test_other_strategies(gallery, api, strategy):
    ids, vec = gallery
    P, N = [vec[ids[3]], vec[ids[4]]], [vec[ids[5]]]
    if strategy == "sum_scores":
        score = lambda i: sum(_unit(vec[i]) @ _unit(p) for p in P) - _unit(vec[i]) @ _unit(N[0])  # noqa: E731
    else:
        q = 2 * np.mean(P, axis=0) - N[0]
        score = lambda i: _unit(vec[i]) @ _unit(q)  # noqa: E731
    r = search(api, {"positive": [{"image_id": ids[3]}, {"image_id": ids[4]}], "negative": [{"image_id": ids[5]}],
                     "strategy": strategy, "k": 3})
    assert r.status_code == 200, r.json()
    rest = [i for i in ids if i not in ids[3:6]]
    assert [h["image_id"] for h in r.json()["results"]] == sorted(rest, key=lambda i: -score(i))[:3]


def test_text_and_uploaded_examples_mix_with_stored_ones_under_a_filter(gallery, api):
    """A text positive, an uploaded negative (multipart: the lists as JSON text, files beside them)
    and a stored positive; the metadata filter and the job go inside the query."""
    import json

    ids, vec = gallery
    keep = [f"e{i}" for i in (1, 2, 3, 4, 6)]
    body = {"positive": json.dumps([{"text": "a photo of a dog"}, {"image_id": ids[0]}]),
            "negative_image": [upload("n.jpg", jpeg_bytes(4507))],  # the same bytes as e7
            "filter": json.dumps({"field": "external_id", "in": keep}), "k": 10}
    r = search(api, body, fmt="multipart")
    assert r.status_code == 200, r.json()
    hits = [h["external_id"] for h in r.json()["results"]]
    assert sorted(hits) == sorted(keep)  # e0 is an example (left out); e5, e7 filtered out
    # the uploaded negative has e7's vector: every hit nearer e7 than to both positives scores < 0
    assert all(h["score"] > -1 and h["score"] < 1 for h in r.json()["results"])


def test_diversity_on_a_plain_search(gallery, api):
    ids, vec = gallery
    plain = search(api, {"image_id": ids[0], "k": 5}).json()["results"]
    same = search(api, {"image_id": ids[0], "k": 5, "diversity": 0}).json()["results"]
    assert [h["image_id"] for h in same] == [h["image_id"] for h in plain]
    r = search(api, {"image_id": ids[0], "k": 4, "diversity": 1, "candidates": 8})
    assert r.status_code == 200, r.json()
    hits = [h["image_id"] for h in r.json()["results"]]
    # MMR with diversity 1: the nearest (the image itself), then each time the one least like those picked
    picked = [ids[0]]
    while len(picked) < 4:
        left = [i for i in ids if i not in picked]
        picked.append(min(left, key=lambda i: max(_unit(vec[i]) @ _unit(vec[p]) for p in picked)))
    assert hits == picked
    # scores stay cosines to the query
    for h in r.json()["results"]:
        assert h["score"] == pytest.approx(float(_unit(vec[ids[0]]) @ _unit(vec[h["image_id"]])), abs=1e-4)


def test_diverse_examples_search(gallery, api):
    ids, vec = gallery
    r = search(api, {"positive": [{"image_id": ids[0]}, {"text": "a cat"}], "diversity": 0.5, "k": 3})
    assert r.status_code == 200, r.json()
    assert len(r.json()["results"]) == 3 and ids[0] not in {h["image_id"] for h in r.json()["results"]}


def test_other_users_images_neither_example_nor_hit(gallery, api, other_user):
    ids, _ = gallery
    bob = client_for(other_user)
    theirs = bob.post("/api/images/", {"files": [upload("b.jpg", jpeg_bytes(4600))], "k": 0},
                      format="multipart").json()["images"][0]["id"]
    r = search(api, {"positive": [{"image_id": ids[0]}, {"image_id": theirs}]})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = search(api, {"positive": [{"image_id": ids[0]}], "negative": [{"image_id": theirs}]})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = search(bob, {"positive": [{"text": "anything"}], "k": 10})
    assert [h["image_id"] for h in r.json()["results"]] == [theirs]


@pytest.mark.parametrize("body, code", [
    ({"positive": []}, "positive_required"),
    ({"negative": [{"text": "a cat"}]}, "positive_required"),
    ({"positive": [{"text": "a cat"}] * 1000}, "too_many_examples"),
    ({"positive": [{"text": "a"}] * 40, "negative": [{"text": "b"}] * 40}, "too_many_examples"),
    ({"positive": [{"text": "a cat"}], "diversity": 1.5}, "invalid"),
    ({"positive": [{"text": "a cat"}], "diversity": -0.1}, "invalid"),
    ({"text": "a cat", "diversity": 2}, "invalid"),
    ({"text": "a cat", "candidates": 0, "diversity": 0.5}, "invalid"),
    ({"text": "a cat", "candidates": 100_000, "diversity": 0.5}, "invalid"),
    ({"positive": [{"text": "a cat"}], "strategy": "median"}, "invalid"),
    ({"text": "a cat", "strategy": "best_score"}, "invalid_query"),
    ({"text": "a cat", "positive": [{"text": "a dog"}]}, "invalid_query"),
    ({"positive": {"text": "a cat"}}, "invalid_example"),
    ({"positive": [{"text": "a cat", "image_id": str(uuid.uuid4())}]}, "invalid_example"),
    ({"positive": [{"image_id": "not-a-uuid"}]}, "invalid_example"),
    ({"positive": [{"text": "   "}]}, "invalid_example"),
    ({"positive": ["a cat"]}, "invalid_example"),
])
def test_bad_input_is_a_clear_400(service, api, body, code):
    r = search(api, body)
    assert r.status_code == 400, r.json()
    assert r.json()["code"] == code


def test_unknown_example_id_is_404(service, api):
    r = search(api, {"positive": [{"image_id": str(uuid.uuid4())}]})
    assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_diversity_nan_in_a_form_is_refused(service, api):
    r = search(api, {"image": upload("q.jpg", jpeg_bytes(1)), "diversity": "nan"}, fmt="multipart")
    assert r.status_code == 400 and r.json()["code"] == "invalid"


def test_too_many_uploaded_examples_are_refused_before_any_is_kept(service, api):
    files = [upload(f"{i}.jpg", b"x") for i in range(65)]
    r = search(api, {"positive_image": files}, fmt="multipart")
    assert r.status_code == 400 and r.json()["code"] == "too_many_examples"


def test_texts_are_refused_in_a_space_without_a_text_tower(gallery, api, encoder, tmp_path):
    """A space whose checkpoint holds only the image tower: a text example (or a text search) is a
    422 ``text_tower_missing`` naming the example; images and stored ids still search."""
    import torch

    from workers.config import PipelineConfig
    from workers.model import ClipEncoder

    ids, _ = gallery
    path = tmp_path / "visual-only.pt"
    torch.save({f"visual.{k}": v for k, v in encoder.model.visual.state_dict().items()}, path)
    runtime.encoder_holder()._encoder = ClipEncoder(PipelineConfig(pretrained=str(path), torch_threads=2))
    r = search(api, {"positive": [{"image_id": ids[0]}], "negative": [{"text": "a red car"}]})
    assert r.status_code == 422, r.json()
    assert r.json()["code"] == "text_tower_missing" and r.json()["extra"]["example"] == "negative[0]"
    r = api.post("/api/search/", {"text": "a red car"}, format="json")
    assert r.status_code == 422 and r.json()["code"] == "text_tower_missing"
    r = search(api, {"positive": [{"image_id": ids[0]}], "negative": [{"image_id": ids[1]}], "k": 3})
    assert r.status_code == 200 and len(r.json()["results"]) == 3





def test_search_by_text_image_and_id(service, api):
    ids = [api.post("/api/images/", {"files": [upload(f"{i}.jpg", jpeg_bytes(300 + i))]}, format="multipart")
           .json()["images"][0]["id"] for i in range(4)]
    by_id = api.post("/api/search/", {"image_id": ids[2], "k": 4}, format="json").json()["results"]
    assert by_id[0]["image_id"] == ids[2] and by_id[0]["score"] >= 0.99 and len(by_id) == 4
    by_image = api.post("/api/search/", {"image": upload("q.jpg", jpeg_bytes(301)), "k": 2}, format="multipart")
    assert by_image.status_code == 200 and by_image.json()["results"][0]["image_id"] == ids[1]
    by_text = api.post("/api/search/", {"text": "a red bicycle", "k": 3}, format="json").json()["results"]
    assert len(by_text) == 3 and {r["image_id"] for r in by_text} <= set(ids)
    bad = api.post("/api/search/", {"text": "x", "image_id": ids[0]}, format="json")
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_query"
