"""Recovery in one process: the reconciler's decisions, the broker snapshot it reads (on a private
redis-server with real Celery messages), the vector-write task's retry with backoff on a store that
refuses connections, the start-up check on time limits, and the temporary files of dead requests.
A chunk write's own faults and a chunk's redelivery are the queues' tests
(``tests/embeddings/services/queues/``).
"""
from __future__ import annotations

import datetime as dt
import io
import uuid

import pytest
from django.utils import timezone

from embeddings import runtime, tasks
from embeddings.checks import check_time_limits, time_limit_errors
from embeddings.models import Image, ImageStatus, Job, JobStatus, Lane
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.queues import interactive, vectors
from embeddings.services.reconcile import (
    ATTEMPTS_EXHAUSTED,
    broker_snapshot,
    queue_keys,
    reconcile,
)
from embeddings.services.catalogue.sources import SourceFile
from project import lanes
from tests.embeddings.conftest import jpeg_bytes
from tests.embeddings.services.queues.test_vectors import embedded_chunk

pytestmark = pytest.mark.django_db(transaction=True)

GRACE = 30.0


def sources(n: int, seed: int = 0) -> list[SourceFile]:
    out = []
    for i in range(n):
        data = jpeg_bytes(seed + i, (64, 64))
        out.append(SourceFile(name=f"{seed + i}.jpg", size=len(data), open=lambda d=data: io.BytesIO(d)))
    return out


@pytest.fixture
def sent(sent_args):
    """Messages the code under test sends, captured instead of run: ``{task name: [args, ...]}``."""
    return sent_args


def make_job(user, n: int, *, age_s: float = 2 * GRACE, seed: int = 0, **fields) -> Job:
    job = job_services.job_create(owner=user, sources=sources(n, seed))
    Image.objects.filter(job=job).update(created_at=timezone.now() - dt.timedelta(seconds=age_s), **fields)
    Job.objects.filter(id=job.id).update(created_at=timezone.now() - dt.timedelta(seconds=age_s))
    return job


def run(live=frozenset(), second=None, **kw):
    calls = iter([set(live), set(live if second is None else second)])
    return reconcile(live_ids=lambda: next(calls), grace_s=GRACE, max_attempts=kw.pop("max_attempts", 5), **kw)


def ids_of(job) -> list[str]:
    return [str(i) for i in Image.objects.filter(job=job).order_by("created_at").values_list("id", flat=True)]


def test_lost_bulk_images_are_sent_again_in_chunks_of_the_job(service, user, sent):
    job = make_job(user, 5)
    Job.objects.filter(id=job.id).update(chunk_size=2)
    sent.clear()
    report = run()
    assert (report.lost, report.redispatched, report.chunks) == (5, 5, 3)
    chunks = sent["embeddings.tasks.embed_chunk"]
    assert [len(ids) for _, ids in chunks] == [2, 2, 1]
    assert sorted(i for _, ids in chunks for i in ids) == sorted(ids_of(job))
    assert {j for j, _ in chunks} == {str(job.id)}
    assert set(Image.objects.filter(job=job).values_list("attempts", flat=True)) == {1}  # counted


def test_live_and_young_images_are_left_alone(service, user, sent):
    old = make_job(user, 3, seed=10)
    young = make_job(user, 2, seed=20, age_s=1)
    sent.clear()
    report = run(live=ids_of(old))
    assert report.redispatched == 0 and "embeddings.tasks.embed_chunk" not in sent  # young: within the grace
    assert Image.objects.filter(job__in=(old, young), status=ImageStatus.QUEUED).count() == 5


def test_an_image_seen_in_the_second_snapshot_is_in_transit_not_lost(service, user, sent):
    job = make_job(user, 2)
    sent.clear()
    report = run(live=(), second=ids_of(job))
    assert report.redispatched == 0 and not sent


def test_images_delivered_too_often_fail_with_a_reason_instead_of_looping(service, user, sent):
    job = make_job(user, 3, attempts=5)
    sent.clear()
    report = run()
    assert (report.exhausted, report.redispatched) == (3, 0)
    assert set(Image.objects.filter(job=job).values_list("status", "reason")) == {("failed", ATTEMPTS_EXHAUSTED)}


def test_paused_jobs_wait_and_cancelled_jobs_cancel(service, user, sent):
    paused = make_job(user, 2, seed=10)
    cancelled = make_job(user, 2, seed=20)
    Job.objects.filter(id=paused.id).update(status=JobStatus.PAUSED)
    Job.objects.filter(id=cancelled.id).update(status=JobStatus.CANCELLED)
    sent.clear()
    run()
    assert not sent
    assert set(Image.objects.filter(job=paused).values_list("status", flat=True)) == {"queued"}
    assert set(Image.objects.filter(job=cancelled).values_list("status", "reason")) == {("cancelled", "cancelled")}


def test_interactive_images_past_their_deadline_expire_and_their_points_are_forgotten(service, user, sent):
    from embeddings.services.catalogue.images import images_create

    now = timezone.now()
    late, on_time = images_create(owner=user, sources=sources(2, 50), lane=Lane.INTERACTIVE,
                                  deadline=now - dt.timedelta(seconds=1))
    Image.objects.filter(id=on_time.id).update(deadline=now + dt.timedelta(seconds=60))
    report = run()
    assert report.expired == 2 - 1
    late.refresh_from_db()
    on_time.refresh_from_db()
    assert (late.status, late.reason) == ("expired", "expired") and "deadline passed" in late.reason_detail
    assert on_time.status == "queued"
    assert sent["embeddings.tasks.forget_point"] == [(str(late.point_id), late.sha256, late.model_id)]


def test_an_interactive_write_arriving_after_the_reconciler_expired_its_image_writes_nothing(service, user, sent):
    """The reconciler expired the image (its worker was lost past the deadline) while the index task
    still waited: the late task must not resurrect it nor leave a point no embedded row accounts for."""
    import time as time_

    from embeddings.services.catalogue.images import images_create

    late, on_time = images_create(owner=user, sources=sources(2, 60), lane=Lane.INTERACTIVE,
                                  deadline=timezone.now() + dt.timedelta(seconds=60))
    embedded = interactive.interactive_embed(image_ids=[str(late.id), str(on_time.id)], deadline_ts=time_.time() + 60)
    assert len(embedded["items"]) == 2
    Image.objects.filter(id=late.id).update(status=ImageStatus.EXPIRED, reason="expired")  # the reconciler's verdict
    out = vectors.interactive_index(embedded=embedded, owner_id=user.id, k=3, skipped_ids=[])
    late.refresh_from_db()
    on_time.refresh_from_db()
    assert (late.status, on_time.status) == (ImageStatus.EXPIRED, ImageStatus.EMBEDDED)
    store = runtime.vector_store()
    assert store.count() == 1 and set(store.vectors([late.point_id, on_time.point_id])) == {on_time.point_id}
    assert str(late.id) not in out and out[str(on_time.id)]["neighbours"] == []  # nothing else to find


def test_a_running_job_with_nothing_left_queued_is_finished(service, user, sent):
    job = make_job(user, 2)
    Image.objects.filter(job=job).update(status=ImageStatus.EMBEDDED)
    Job.objects.filter(id=job.id).update(status=JobStatus.RUNNING)
    assert run().jobs_refreshed == 1
    assert Job.objects.get(id=job.id).status == JobStatus.DONE


def test_a_catalogue_job_whose_read_was_lost_is_read_again(service, user, sent, monkeypatch):
    """Issue 41: a job still ``reading`` that no live message names (its ``job_read`` died with the
    fetch worker) is sent to be read again; one a live message names, or a young one, is not."""
    reads = []
    monkeypatch.setattr(tasks.job_read, "apply_async", lambda args=(), **kw: reads.append(args))
    old = Job.objects.create(owner=user, model_id="m", reading=True, source={"kind": "prefix", "rows_read": 128})
    live = Job.objects.create(owner=user, model_id="m", reading=True)
    young = Job.objects.create(owner=user, model_id="m", reading=True)
    Job.objects.filter(id__in=(old.id, live.id)).update(created_at=timezone.now() - dt.timedelta(seconds=2 * GRACE))
    report = run(live={str(live.id)})
    assert report.reads_resent == 1 and reads == [(str(old.id),)]
    assert Job.objects.get(id=young.id).reading


# --- the broker snapshot, on a private redis-server ---------------------------------------------



def test_broker_snapshot_reads_queues_and_unacked_deliveries_and_spots_orphans(settings, private_redis):
    from celery import Celery
    from kombu import Connection

    url, client = private_redis
    app = Celery(broker=url, set_as_current=False)
    app.conf.broker_transport_options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    waiting = [str(uuid.uuid4()) for _ in range(3)]
    held = [str(uuid.uuid4()) for _ in range(2)]
    app.send_task("embeddings.tasks.embed_chunk", args=("job", waiting), queue=lanes.BULK, priority=9)
    app.send_task("embeddings.tasks.embed_chunk", args=("job", held), queue=lanes.BULK, priority=9)
    app.send_task("embeddings.tasks.embed_interactive", args=([str(uuid.uuid4())], 0), queue=lanes.INTERACTIVE)
    app.close()
    assert sum(client.llen(k) for k in queue_keys((lanes.BULK,))) == 2
    # A worker takes the first bulk message and does not acknowledge it (it is running, or it died).
    conn = Connection(url, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    try:
        msg = conn.default_channel.basic_get(queue=lanes.BULK, no_ack=False)
        taken = set(msg.payload[0][1])  # protocol 2 body: [args, kwargs, embed]; args = (job, ids)
        rest = (set(waiting) | set(held)) - taken
        task_id = msg.headers["id"]
        young = broker_snapshot(client, grace_s=3600, holding=lambda ids: set())
        assert (young.queued, young.unacked) == (1, 1)
        assert taken | rest <= young.live_ids  # a young delivery is live whatever the workers say
        alive = broker_snapshot(client, grace_s=-1, holding=lambda ids: set(ids))
        assert taken <= alive.live_ids and not alive.orphans
        dead = broker_snapshot(client, grace_s=-1, holding=lambda ids: set())
        assert dead.orphans == {task_id}
        assert taken.isdisjoint(dead.live_ids) and rest <= dead.live_ids
        # A second snapshot reuses the orphans found by the first, without asking the workers again.
        again = broker_snapshot(client, grace_s=-1, orphans=dead.orphans, holding=lambda ids: 1 / 0)
        assert again.live_ids == dead.live_ids
    finally:
        conn.release()


# --- vector writes: retry with backoff, nothing embedded before its point exists --------------------

def test_vector_writes_retry_with_backoff_and_images_wait_visibly(service, user, sent, monkeypatch):
    import celery.app.autoretry as autoretry

    job, args = embedded_chunk(user, sent)
    store = runtime.vector_store()
    real_upsert, calls, seen = store.upsert, [], []

    def flaky_upsert(points):
        calls.append(len(points))
        seen.append(set(Image.objects.filter(job=job).values_list("status", "reason")))
        if len(calls) <= 3:
            raise ConnectionError("connection refused")
        return real_upsert(points)

    backoffs = []
    real_backoff = autoretry.get_exponential_backoff_interval
    monkeypatch.setattr(autoretry, "get_exponential_backoff_interval",
                        lambda **kw: backoffs.append(kw) or real_backoff(**kw))
    monkeypatch.setattr(store, "upsert", flaky_upsert)
    from project.celery import app

    app.conf.task_eager_propagates = False  # eager: each Retry is then re-applied at once
    try:
        result = tasks.index_chunk.apply(args=args, kwargs={"priority": "background"})
    finally:
        app.conf.task_eager_propagates = True
    assert result.successful(), result.traceback
    assert len(calls) == 4 and store.count() == 3
    assert [b["retries"] for b in backoffs] == [0, 1, 2]
    assert {(b["factor"], b["maximum"]) for b in backoffs} == {(2, 60)}  # 2, 4, 8, ... s, at most a minute
    assert seen[0] == {("queued", "waiting_for_store")}  # handed over: visible, not embedded
    assert all(s == {("queued", "waiting_for_store")} for s in seen[1:])  # never embedded before its point
    assert set(Image.objects.filter(job=job).values_list("status", "reason")) == {("embedded", "")}
    detail = {im.reason_detail for im in Image.objects.filter(job=job)}
    assert detail == {""}


# --- start-up check --------------------------------------------------------------------------------

def test_time_limit_must_stay_inside_the_visibility_timeout(settings):
    assert time_limit_errors() == [] and check_time_limits(None) == []
    settings.CELERY_BULK_TIME_LIMIT_S = settings.CELERY_VISIBILITY_TIMEOUT_S
    (err,) = check_time_limits(None)
    assert err.id == "embeddings.E001" and "must be shorter than CELERY_VISIBILITY_TIMEOUT_S" in err.msg
    settings.CELERY_BULK_TIME_LIMIT_S = 10
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "visibility_timeout": 5}
    assert any("broker's visibility_timeout (5)" in e for e in time_limit_errors())


def test_the_bulk_task_carries_the_configured_time_limit(settings):
    assert tasks.embed_chunk.time_limit == settings.CELERY_BULK_TIME_LIMIT_S < settings.CELERY_VISIBILITY_TIMEOUT_S
    assert tasks.embed_chunk.acks_late and tasks.embed_chunk.reject_on_worker_lost


def test_a_round_deletes_the_temporary_files_of_requests_whose_process_died(service, private_redis):
    """A query image whose web process was killed before its ``finally`` ran stays in ``tmp/``; the
    round deletes what is older than a request may keep one, never a request's that is running."""
    import os
    import time

    from embeddings.services.reconcile import reconcile_once

    url, client = private_redis
    service.CELERY_BROKER_URL = url
    store = runtime.blob_store()
    left, running = (store.put_temporary([f"query {i}".encode()])[0] for i in range(2))
    old = time.time() - (2 * max(service.INTERACTIVE_DEADLINE_S, service.VECTORS_CALL_TIMEOUT_S) + 31)
    os.utime(store.storage.path(left), (old, old))
    cut = os.path.join(store.storage.location, "tmp", ".upload-cut")  # a write cut short by the same kill
    open(cut, "wb").close()
    os.utime(cut, (old, old))
    report = reconcile_once(client=client, grace_s=GRACE)
    assert report.temporaries_deleted == 2 and report.acted
    assert (store.exists(left), store.exists(running)) == (False, True)
    assert sorted(os.listdir(os.path.join(store.storage.location, "tmp"))) == [running.removeprefix("tmp/")]
    assert reconcile_once(client=client, grace_s=GRACE).temporaries_deleted == 0
