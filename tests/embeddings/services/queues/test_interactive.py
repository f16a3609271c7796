"""``embeddings/services/queues/interactive.py``: an interactive request's images embedded (or
refused past their deadline) and, through the vectors queue, written and answered; text and image
queries refused in their own words.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from embeddings import runtime
from embeddings.messages import decode_vector
from embeddings.models import BatchStat, Image, ImageStatus, Lane
from embeddings.services.queues import interactive, vectors
from tests.embeddings.services.queues.conftest import BROKEN_JPEG, DIM, interactive_rows, photos, source, statuses

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_interactive_request_past_its_deadline_is_not_computed(service, user):
    ids = interactive_rows(user, photos(2, 50))
    out = interactive.interactive_embed(image_ids=ids, deadline_ts=time.time() - 1)
    assert out == {"items": [], "failed": [[i, "expired", "deadline passed before the model ran"] for i in ids],
                   "timings": {}}


def test_an_interactive_request_is_embedded_written_and_answered_with_neighbours(service, user):
    ids = interactive_rows(user, [*photos(2, 60), source("broken.jpg", BROKEN_JPEG)])
    embedded = interactive.interactive_embed(image_ids=ids, deadline_ts=time.time() + 30)
    assert [it["id"] for it in embedded["items"]] == ids[:2]
    assert {it["model_id"] for it in embedded["items"]} == {runtime.model_id()}
    assert [f[0] for f in embedded["failed"]] == [ids[2]] and embedded["failed"][0][1] in ("corrupt", "truncated")
    assert {"decode", "preprocess", "embed", "total"} <= set(embedded["timings"])

    out = vectors.interactive_index(embedded=embedded, owner_id=user.id, k=5, skipped_ids=[])
    assert set(out) == set(ids)
    assert [n["image_id"] for n in out[ids[0]]["neighbours"]] == [ids[1]]  # never itself
    assert [n["image_id"] for n in out[ids[1]]["neighbours"]] == [ids[0]]
    assert out[ids[2]] == {"reason": embedded["failed"][0][1], "detail": embedded["failed"][0][2], "neighbours": []}
    assert [statuses(ids)[i][0] for i in ids] == [ImageStatus.EMBEDDED, ImageStatus.EMBEDDED, ImageStatus.FAILED]
    stat = BatchStat.objects.get(lane=Lane.INTERACTIVE)
    assert (stat.job_id, stat.images, stat.failed) == (None, 3, 1) and stat.finished_at is not None

    # a copy of stored bytes: no model run, its neighbours from the stored vector (not itself)
    copy, = interactive_rows(user, [photos(1, 60)[0]])
    assert Image.objects.get(id=copy).status == ImageStatus.SKIPPED
    answered = vectors.interactive_index(embedded={}, owner_id=user.id, k=5, skipped_ids=[copy])
    assert [n["image_id"] for n in answered[copy]["neighbours"]] == [ids[1]]
    assert vectors.interactive_index(embedded={}, owner_id=user.id, k=0, skipped_ids=[copy]) == {
        copy: {"neighbours": []}}


@pytest.mark.parametrize("wait_for", ["announced", "window"])
def test_a_lone_interactive_request_waits_the_window_only_where_told_to(service, user, wait_for):
    """The interactive worker's batcher waits for company only while other requests are announced
    (``INTERACTIVE_BATCH_WAIT=announced``, the default): a lone request on an idle lane goes to the
    model at once, even with a window of 3 s; ``window`` sits the window out."""
    service.INTERACTIVE_BATCH_WAIT = wait_for
    service.PIPELINE = service.PIPELINE.replace(interactive_max_queue_delay_ms=3000.0)
    runtime.dynamic_batcher.cache_clear()
    ids = interactive_rows(user, photos(1, 75))
    out = interactive.interactive_embed(image_ids=ids, deadline_ts=time.time() + 60)
    batcher = runtime.dynamic_batcher()
    record = batcher.records[-1]
    assert [it["id"] for it in out["items"]] == ids and (record.size, record.requests) == (1, 1)
    assert batcher.wait_for == wait_for
    assert (record.queue_delay_ms < 1500) == (wait_for == "announced")  # at once, or the whole 3 s


def test_an_interactive_request_draws_its_previews_and_thumbnails_after_its_answer(service, user):
    """Inside a task, the preview and thumbnail of each decoded image are drawn once the task has
    answered (``deferred.after_answer``), not while the person waits; outside a task at once."""
    from embeddings import deferred
    from embeddings.storage import preview_exists, thumbnail_exists

    ids = interactive_rows(user, photos(2, 70))
    shas = dict(Image.objects.filter(id__in=ids).values_list("id", "sha256"))
    store = runtime.blob_store()
    drawn = lambda: [(preview_exists(store, shas[i]), thumbnail_exists(store, shas[i])) for i in shas]  # noqa: E731
    deferred.task_started()  # as Celery's task_prerun does
    try:
        embedded = interactive.interactive_embed(image_ids=ids, deadline_ts=time.time() + 30)
        assert len(embedded["items"]) == 2
        assert drawn() == [(False, False)] * 2  # the answer is not out yet
    finally:
        deferred.task_ended()  # task_postrun: after the result and the chain's next message
    assert drawn() == [(True, True)] * 2


def test_queries_refuse_a_passed_deadline_an_unknown_space_and_bytes_that_are_no_image(service):
    space = runtime.model_id()
    text = interactive.text_embed(text="a dog", deadline_ts=time.time() + 30, model_id=space)
    vector = decode_vector(text["vector"])
    assert vector.shape == (DIM,) and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    late = interactive.text_embed(text="a dog", deadline_ts=time.time() - 2, model_id=space)
    assert late["reason"] == "expired" and late["detail"].startswith("deadline passed 2.")
    unknown = interactive.text_embed(text="a dog", deadline_ts=time.time() + 30, model_id="ViT-L-14/openai/fp32")
    assert unknown["reason"] == "model_not_configured" and "vector" not in unknown
    key, sha, _ = runtime.blob_store().put([b"%PDF-1.7 not an image"])
    refused = interactive.query_embed(storage_key=key, sha256=sha, deadline_ts=time.time() + 30, model_id=space)
    assert refused["reason"] == "not_an_image" and "vector" not in refused
