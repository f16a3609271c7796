"""Calibrated cutoffs and ``min_score`` (issue 13): the nearest-rank percentile of unrelated pairs'
scores, computed in the workers from the stored vectors and the space's text tower, applied to
searches by default, off with ``min_score=0``; an empty answer says so."""
from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest

from embeddings import runtime
from embeddings.models import EmbeddingSpace, Image, ImageStatus, Lane
from embeddings.services.lifecycle import cutoff
from embeddings import spaces
from tests.embeddings.conftest import celery_publishing_to, jpeg_bytes, upload
from workers.ids import point_id
from workers.vector_store import Point


def unit(angle_deg: float, dim: int = 512) -> np.ndarray:
    v = np.zeros(dim, np.float32)
    v[0], v[1] = math.cos(math.radians(angle_deg)), math.sin(math.radians(angle_deg))
    return v


def test_percentile_is_the_nearest_rank_on_constructed_vectors():
    # five directions 30° apart: 4 pairs at 30°, 3 at 60°, 2 at 90°, 1 at 120°
    scores = cutoff.pair_scores(np.stack([unit(a) for a in (0, 30, 60, 90, 120)]))
    c30 = math.cos(math.radians(30))
    assert sorted(np.round(scores, 6)) == sorted(np.round([c30] * 4 + [0.5] * 3 + [0.0] * 2 + [-0.5], 6))
    assert cutoff.percentile_score(scores, 99) == pytest.approx(c30, abs=1e-6)  # rank ⌈9.9⌉ = 10
    assert cutoff.percentile_score(scores, 60) == pytest.approx(0.5, abs=1e-6)  # rank 6: the last 0.5
    assert cutoff.percentile_score(scores, 61) == pytest.approx(c30, abs=1e-6)  # rank 7
    assert cutoff.percentile_score(scores, 30) == pytest.approx(0.0, abs=1e-6)  # rank 3
    assert cutoff.percentile_score(scores, 0) == pytest.approx(-0.5, abs=1e-6)  # rank 1
    for p in (1, 25, 50, 75, 99):
        assert cutoff.percentile_score(scores, p) == pytest.approx(np.percentile(scores, p, method="inverted_cdf"))
    assert cutoff.percentile_score([], 99) is None
    with pytest.raises(ValueError):
        cutoff.percentile_score(scores, 101)
    # more pairs than allowed: a seeded sample of exactly max_pairs pairs of distinct rows
    many = np.stack([unit(a) for a in range(0, 180, 2)])  # 90 rows, 4,005 pairs
    sampled = cutoff.pair_scores(many, max_pairs=500, seed=1)
    assert len(sampled) == 500 and sampled.max() < 1 - 1e-6
    assert np.array_equal(sampled, cutoff.pair_scores(many, max_pairs=500, seed=1))


def _catalogue(owner, model_id: str, vectors: np.ndarray) -> None:
    """Embedded rows and their points with the given vectors (no model: the calibration reads the
    stored vectors only)."""
    store, points = runtime.vector_store(model_id), []
    for i, v in enumerate(vectors):
        sha = f"{i:064x}"
        pid = point_id(sha, model_id)
        Image.objects.create(owner=owner, lane=Lane.BULK, status=ImageStatus.EMBEDDED, sha256=sha, size_bytes=1,
                             storage_key=f"k{i}", model_id=model_id, point_id=pid)
        points.append(Point(id=pid, vector=v, payload={"sha256": sha, "owner_ids": [owner.id], "job_ids": []}))
    store.upsert(points)


@pytest.mark.django_db(transaction=True)
def test_calibration_takes_the_percentile_of_unrelated_pairs_in_the_store(service, user, encoder, monkeypatch):
    service.CUTOFF_MIN_POINTS, service.CUTOFF_PERCENTILE = 10, 90.0
    # four of the prompts (the text tower pads each to 77 tokens: all 63 take ~5 s on 2 cores)
    assert {"justice", "theorem", "tuesday", "qxvrtl"} <= set(cutoff.prompts()) and len(cutoff.prompts()) >= 60
    monkeypatch.setattr(cutoff, "prompts", lambda: ("justice", "theorem", "tuesday", "qxvrtl"))
    space = spaces.active(fresh=True)
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(12, 512)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    _catalogue(user, space.model_id, vectors)

    cutoff.calibrate_start(space)  # eager: prompts through the text tower, then the store's vectors
    space.refresh_from_db()
    image_scores = [float(vectors[i] @ vectors[j]) for i in range(12) for j in range(i + 1, 12)]  # all 66 pairs
    texts = encoder.encode_texts(list(cutoff.prompts()))
    text_scores = (texts @ vectors.T).ravel()
    assert space.cutoff_image == pytest.approx(sorted(image_scores)[math.ceil(0.9 * 66) - 1], abs=1e-5)
    assert space.cutoff_text == pytest.approx(sorted(text_scores)[math.ceil(0.9 * len(text_scores)) - 1], abs=1e-5)
    cal = space.calibration
    assert (cal["percentile"], cal["points"], cal["sampled"], cal["image_pairs"]) == (90.0, 12, 12, 66)
    assert (cal["prompts"], cal["text_pairs"]) == (len(cutoff.prompts()), len(cutoff.prompts()) * 12)
    assert cal["image"] == space.cutoff_image and "pending_since" not in cal and cal["at"]

    # grown by 25 % or 1,000 points: due again; a pending request is not asked twice
    assert not cutoff.calibration_due(space, 14) and cutoff.calibration_due(space, 15)
    space.calibration = {**cal, "points": 4000}
    assert not cutoff.calibration_due(space, 4999) and cutoff.calibration_due(space, 5000)
    space.calibration = {**cal, "pending_since": 1000.0}
    assert not cutoff.calibration_due(space, 15, now=1100.0) and cutoff.calibration_due(space, 15, now=1700.0)

    # too few points for a meaningful percentile: no cutoff, and not due until there are enough
    service.CUTOFF_MIN_POINTS = 100
    cutoff.calibrate_start(space)
    space.refresh_from_db()
    assert (space.cutoff_image, space.cutoff_text) == (None, None) and "CUTOFF_MIN_POINTS" in space.calibration["note"]
    assert not cutoff.calibration_due(space, 99) and cutoff.calibration_due(space, 100)


def _queued(client, queue: str) -> list[dict]:
    """The task messages waiting in ``queue`` (every priority list kombu keeps for it), decoded:
    ``{"task", "args"}`` each."""
    from embeddings.lane_control import queue_keys

    out = []
    for key in queue_keys(queue):
        for raw in client.lrange(key, 0, -1):
            msg = json.loads(raw)
            args, _kwargs, _embed = json.loads(base64.b64decode(msg["body"]))
            out.append({"task": msg["headers"]["task"], "args": args})
    return out


@pytest.mark.django_db(transaction=True)
def test_a_recalibration_reuses_the_prompts_text_vectors_and_leaves_the_bulk_cores_alone(service, private_redis,
                                                                                         monkeypatch):
    """The first calibration of a space runs its text tower on the bulk queue; once its prompts'
    vectors are kept in Redis, the next one is ``cutoff_compute`` alone on the vectors queue,
    carrying them. Other prompts (or another model) never read them; a Redis that does not answer
    means encoding again, never an error. Real Celery messages on a private Redis, not run."""
    from embeddings import lane_control
    from project import lanes

    url, client = private_redis
    service.REDIS_URL = url
    monkeypatch.setattr(cutoff, "prompts", lambda: ("justice", "theorem", "tuesday", "qxvrtl"))
    space = spaces.active(fresh=True)
    texts = cutoff.encode_prompts(model_id=space.model_id)  # the real text tower, 4 prompts
    assert len(texts["vectors"]) == 4
    assert not cutoff.remember_prompt_vectors(space.model_id, texts)  # eager (tests): Redis is not ours
    with celery_publishing_to(url):
        assert cutoff.cached_prompt_vectors(space.model_id) is None
        cutoff.calibrate_start(space)
        assert [m["task"] for m in _queued(client, lanes.BULK)] == ["embeddings.tasks.cutoff_encode_texts"]
        assert _queued(client, lanes.VECTORS) == []  # the chain's second step: sent when the first ends

        assert cutoff.remember_prompt_vectors(space.model_id, texts)
        assert 0 < client.ttl(cutoff._prompt_vectors_key(space.model_id)) <= cutoff.PROMPT_VECTORS_TTL_S
        assert cutoff.cached_prompt_vectors(space.model_id) == texts
        cutoff.calibrate_start(space)
        assert len(_queued(client, lanes.BULK)) == 1  # nothing more for the bulk worker
        (compute,) = _queued(client, lanes.VECTORS)
        assert compute == {"task": "embeddings.tasks.cutoff_compute", "args": [texts, space.model_id]}

        # an answer with an error is not kept; other prompts have other vectors
        assert not cutoff.remember_prompt_vectors(space.model_id, {"error": "weights_unavailable", "detail": "x"})
        monkeypatch.setattr(cutoff, "prompts", lambda: ("justice", "theorem", "tuesday", "zzz"))
        assert cutoff.cached_prompt_vectors(space.model_id) is None
        # Redis gone: no cache, no error
        monkeypatch.setattr(lane_control, "redis_client", lambda: lane_control.keys._client("redis://127.0.0.1:1/0"))
        assert cutoff.cached_prompt_vectors(space.model_id) is None
        assert not cutoff.remember_prompt_vectors(space.model_id, {"vectors": texts["vectors"]})


@pytest.mark.django_db(transaction=True)
def test_min_score_default_explicit_and_off_through_the_api(service, api):
    service.SPACE_CACHE_S = 0.0
    service.INTERACTIVE_DEADLINE_S = 30.0  # the point here is the cutoff, not the deadline of a busy machine
    ids = [api.post("/api/images/", {"files": [upload(f"{i}.jpg", jpeg_bytes(500 + i))]}, format="multipart")
           .json()["images"][0]["id"] for i in range(3)]
    space = spaces.active(fresh=True)

    def search(**body):
        r = api.post("/api/search/", {"k": 3, **body}, format="json")
        assert r.status_code == 200, r.json()
        return r.json()

    plain = search(image_id=ids[0])  # not calibrated yet: nothing cut
    assert (plain["min_score"], plain["min_score_source"], plain["model_id"]) == (None, "uncalibrated", space.model_id)
    assert len(plain["results"]) == 3 and "message" not in plain
    scores = [r["score"] for r in plain["results"]]
    assert scores[0] >= 0.99 and scores[1] < 0.99999

    EmbeddingSpace.objects.filter(pk=space.pk).update(cutoff_image=0.99999, cutoff_text=0.5)
    spaces.forget_cache()
    calibrated = search(image_id=ids[0])  # only the image itself scores above the image cutoff
    assert (calibrated["min_score"], calibrated["min_score_source"]) == (0.99999, "calibrated")
    assert [r["image_id"] for r in calibrated["results"]] == [ids[0]]
    explicit = search(image_id=ids[0], min_score=scores[1])  # ≥ min_score is kept
    assert explicit["min_score_source"] == "request" and len(explicit["results"]) == 2
    off = search(image_id=ids[0], min_score=0)
    assert (off["min_score"], off["min_score_source"], len(off["results"])) == (None, "request", 3)
    lowest = search(image_id=ids[0], min_score=-1)
    assert (lowest["min_score"], len(lowest["results"])) == (-1.0, 3)

    # a text query uses the text cutoff; nothing above it: 200, empty, and says why
    text_scores = [r["score"] for r in search(text="a red bicycle", min_score=0)["results"]]
    EmbeddingSpace.objects.filter(pk=space.pk).update(cutoff_text=max(text_scores) + 1e-3)
    none = search(text="a red bicycle")
    assert (none["results"], none["message"], none["min_score_source"]) == ([], "no match above the cutoff",
                                                                            "calibrated")
    assert none["min_score"] == pytest.approx(max(text_scores) + 1e-3)
    for bad in (1.5, -1.01, "x"):
        r = api.post("/api/search/", {"text": "a", "min_score": bad}, format="json")
        assert r.status_code == 400 and r.json()["code"] == "invalid", bad


@pytest.mark.django_db(transaction=True)
def test_the_search_page_says_no_match_above_the_cutoff(service, user, client):
    from rest_framework.test import APIClient
    from rest_framework.authtoken.models import Token

    service.SPACE_CACHE_S = 0.0
    service.INTERACTIVE_DEADLINE_S = 30.0
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(600))]}, format="multipart")
    space = spaces.active(fresh=True)
    client.force_login(user)
    assert 'class="card"' in client.get("/search/?q=anything").content.decode()
    EmbeddingSpace.objects.filter(pk=space.pk).update(cutoff_text=1.0)
    spaces.forget_cache()
    page = client.get("/search/?q=anything").content.decode()
    assert "No match above the cutoff." in page and 'class="card"' not in page and "1.000" in page
    assert "q=anything&amp;all=1" in page  # "show the closest anyway": the cutoff off
    assert 'class="card"' in client.get("/search/?q=anything&all=1").content.decode()
