"""Issue 9 (4): a deadline is a deadline, also in the broker.

Interactive messages carry an absolute expiry equal to their deadline (Celery reads a number as
seconds from now), search messages on the vectors queue expire with them, and every interactive
task refuses to run the model once its deadline has passed. The end-to-end half, with a worker that
was down while searches queued, is ``tests/e2e/test_stale_interactive.py``.
"""
from __future__ import annotations

import datetime as dt
import time
import uuid

import cv2
import numpy as np
import pytest
from celery.app.task import Context

from embeddings import runtime, tasks
from embeddings.models import Image, ImageStatus, Lane
from embeddings.errors import ApplicationError
from embeddings.services.interactive.search import search
from project import lanes
from project.celery import app

DEADLINE = 1_900_000_000.25  # 2030-03-17T17:46:40.25Z: any fixed Unix time


def jpeg_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (260, 200), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


def published_expires(options: dict) -> dt.datetime:
    """The ``expires`` header of the message Celery builds with ``options`` (what a worker reads)."""
    msg = app.amqp.as_task_v2("id-1", "embeddings.tasks.encode_text", args=("a dog", DEADLINE, "a/space/fp32"),
                              expires=options["expires"])
    return dt.datetime.fromisoformat(msg.headers["expires"])


def test_interactive_options_expire_at_the_deadline_as_an_aware_datetime():
    options = tasks.interactive_options(DEADLINE)
    assert (options["queue"], options["priority"]) == (lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE)
    expires = options["expires"]
    assert isinstance(expires, dt.datetime) and expires.utcoffset() == dt.timedelta(0)
    assert expires.timestamp() == DEADLINE
    assert published_expires(options) == dt.datetime(2030, 3, 17, 17, 46, 40, 250000, tzinfo=dt.timezone.utc)


def test_search_messages_on_the_vectors_queue_expire_with_their_deadline_and_writes_never_do():
    search_options = tasks.vectors_options(interactive=True, deadline_ts=DEADLINE)
    assert (search_options["queue"], search_options["priority"]) == (lanes.VECTORS, lanes.PRIORITY_INTERACTIVE)
    assert published_expires(search_options).timestamp() == DEADLINE
    assert "expires" not in tasks.vectors_options(interactive=True)  # an upload's write records its outcome
    assert "expires" not in tasks.vectors_options(interactive=False, priority="urgent")


def test_a_result_someone_waits_for_names_its_deadline_and_unread_results_are_not_stored():
    from project.results import RESULT_DEADLINE_HEADER

    for options in (tasks.interactive_options(DEADLINE), tasks.vectors_options(interactive=True, deadline_ts=DEADLINE)):
        assert options["headers"] == {RESULT_DEADLINE_HEADER: DEADLINE}  # kept that long at most (project.results)
    assert "headers" not in tasks.vectors_options(interactive=False)
    unread = {t.name for t in (tasks.embed_chunk, tasks.embed_interactive, tasks.index_chunk, tasks.job_read,
                               tasks.fetch_chunk, tasks.send_webhook_delivery, tasks.migration_fill, tasks.job_done,
                               tasks.reconcile, tasks.gate_embed, tasks.gate_check, tasks.cutoff_encode_texts,
                               tasks.cutoff_compute, tasks.duplicates_calibration_embed, tasks.duplicates_calibrate,
                               tasks.duplicates_scan_slice, tasks.duplicates_update, tasks.canary,
                               tasks.batch_validate, tasks.batch_part_fetch, tasks.batch_part, tasks.batch_finalize)}
    from project.celery import app

    assert {name for name, t in app.tasks.items() if name.startswith("embeddings.") and t.ignore_result} == unread
    # a chain's first step: its value rides in the next message, its failure is still stored for the last
    assert all(t.store_errors_even_if_ignored for t in (tasks.embed_interactive, tasks.embed_query, tasks.encode_text))


@pytest.fixture
def spy(service, monkeypatch):
    """Counts the real model's text and image forward passes (each still runs)."""
    encoder = runtime.encoder_holder().get()
    calls = {"texts": 0, "images": 0}
    real_texts, real_images = encoder.encode_texts, encoder.encode_images

    def texts(t):
        calls["texts"] += 1
        return real_texts(t)

    def images(px):
        calls["images"] += 1
        return real_images(px)

    monkeypatch.setattr(encoder, "encode_texts", texts)
    monkeypatch.setattr(encoder, "encode_images", images)
    return calls


@pytest.mark.django_db
def test_text_and_image_queries_refuse_the_model_after_their_deadline(spy):
    key, sha, _ = runtime.blob_store().put([jpeg_bytes(7)])
    space = runtime.model_id()
    late = time.time() - 0.5
    text = tasks.encode_text.apply(args=("a dog", late, space)).get()
    image = tasks.embed_query.apply(args=(key, sha, late, space)).get()
    for out in (text, image):
        assert out["reason"] == "expired" and "vector" not in out and out["detail"].startswith("deadline passed")
    assert spy == {"texts": 0, "images": 0}
    # The same tasks before their deadline do run the model.
    soon = time.time() + 30
    assert "vector" in tasks.encode_text.apply(args=("a dog", soon, space)).get()
    assert "vector" in tasks.embed_query.apply(args=(key, sha, soon, space)).get()
    assert spy == {"texts": 1, "images": 1}


@pytest.mark.django_db
def test_a_search_refused_by_its_task_answers_deadline_exceeded(spy, user):
    with pytest.raises(ApplicationError) as e:
        search(user=user, k=3, text="a dog", deadline_s=1e-9)  # passed before encode_text runs
    assert (e.value.code, e.value.status) == ("deadline_exceeded", 504)
    assert spy["texts"] == 0
    assert search(user=user, k=3, text="a dog") == [] and spy["texts"] == 1  # nothing stored: no hits


@pytest.mark.django_db
def test_an_upload_message_discarded_as_expired_marks_its_images_expired(service, user):
    ims = [Image.objects.create(owner=user, lane=Lane.INTERACTIVE, status=ImageStatus.QUEUED, sha256=f"{i:064x}",
                                size_bytes=1, storage_key=f"k{i}", model_id=runtime.model_id(), point_id=uuid.uuid4())
           for i in range(2)]
    ids = [str(im.id) for im in ims]
    request = Context(args=[ids, time.time() - 3.0], kwargs={}, id="t-1")
    tasks.expire_discarded_upload(sender=tasks.encode_text, request=request, expired=True)  # not an upload
    tasks.expire_discarded_upload(sender=tasks.embed_interactive, request=request, expired=False)  # revoked by hand
    assert set(Image.objects.values_list("status", flat=True)) == {ImageStatus.QUEUED}
    tasks.expire_discarded_upload(sender=tasks.embed_interactive, request=request, expired=True)
    got = {str(i): (s, r, d) for i, s, r, d in Image.objects.values_list("id", "status", "reason", "reason_detail")}
    assert {(s, r) for s, r, _ in got.values()} == {(ImageStatus.EXPIRED, "expired")} and set(got) == set(ids)
    assert all(d.startswith("deadline passed 3.") and d.endswith("before a worker took it") for *_, d in got.values())


CHAIN_PROBE = """
import os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "chain-probe")
import django
django.setup()
from project.celery import app
app.conf.broker_url, app.conf.result_backend = "memory://", "cache+memory://"  # kombu's in-memory transport
from celery.app.trace import build_tracer
from celery.signals import before_task_publish
from embeddings import runtime, tasks
from embeddings.services.queues import interactive

sent = []
before_task_publish.connect(lambda sender=None, **kw: sent.append(sender), weak=False)
space = runtime.configured_model_id()
search = dict(tasks.search_vector.s(None, 3, None, space).set(**tasks.vectors_options(interactive=True,
                                                                                     deadline_ts=time.time() + 600)))
real = interactive.text_embed
slow = {"s": 0.0}
interactive.text_embed = lambda **kw: (real(**kw), time.sleep(slow["s"]))[0]  # the real model, then a stall
for case, in_s, stall in (("live", 600, 0.0), ("refused", -1, 0.0), ("late", 1.0, 1.5)):
    sent.clear()
    slow["s"] = stall
    deadline = time.time() + in_s  # the model is loaded by the first case
    trace = build_tracer(tasks.encode_text.name, tasks.encode_text, eager=False, propagate=True, app=app)
    request = {"id": "t-" + case, "chain": [search], "delivery_info": {}}
    out = trace(request["id"], ("a dog", deadline, space), {}, request).retval
    print(case, sorted(out), ",".join(sent))
"""


def test_a_query_refused_or_finished_after_its_deadline_sends_no_search(tmp_path):
    """Through Celery's own task tracer and an in-memory broker: the next link of the chain is
    published only for a query that finished in time."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "CLIP_PRETRAINED": "random", "VAR_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHAIN_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "live ['vector'] embeddings.tasks.search_vector",
        "refused ['detail', 'reason'] ",
        "late ['vector'] ",
    ], out.stdout + out.stderr[-2000:]
