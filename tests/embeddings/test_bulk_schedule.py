"""The fair scheduler on the database (``embeddings.bulk_schedule`` through ``embeddings.dispatch``,
``BULK_SCHEDULER=fair``): unsent chunks wait as rows, the window holds ``BULK_SCHEDULER_WINDOW``
chunks, each finish hands its place to the chunk the lane's order chooses (2 SQL statements, 2 Redis
commands), claims never take one chunk twice, the reconciler keeps the database's chunks and
releases the lost ones, and ``fifo`` keeps the old behaviour."""
from __future__ import annotations

import datetime as dt
import hashlib
import io
import threading
import uuid

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from embeddings import bulk_schedule, dispatch, lane_control, metrics, tasks
from embeddings.models import (ApiKey, BulkChunk, ChunkState, Image, ImageStatus, Job, JobKind, JobPriority, JobStatus,
                               Lane)
from embeddings.services.access.keys import key_create
from embeddings.services.reconcile import reconcile

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fair(settings):
    settings.BULK_SCHEDULER = "fair"
    settings.BULK_SCHEDULER_WINDOW = 2
    lane_control.redis_client().delete(bulk_schedule.TAGS_KEY)
    bulk_schedule.lane_rate.per_slot = None
    return settings


@pytest.fixture
def sent(monkeypatch):
    """``embed_chunk`` messages captured instead of sent: ``[(job id, image ids, chunk id, priority)]``."""
    out: list[tuple] = []

    def capture(args=(), kwargs=None, **options):
        out.append((args[0], list(args[1]), (kwargs or {}).get("chunk_id"), options.get("priority")))

    monkeypatch.setattr(tasks.embed_chunk, "apply_async", capture)
    return out


def make_job(owner, n: int, *, chunk: int = 2, age_s: float = 0.0, **fields) -> tuple[Job, list[str]]:
    """A job of ``n`` queued synthetic rows (no bytes needed: nothing runs them here)."""
    job = Job.objects.create(owner=owner, model_id="m", chunk_size=chunk, total=n, **fields)
    rows = []
    for i in range(n):
        sha = hashlib.sha256(f"{job.id}-{i}".encode()).hexdigest()
        rows.append(Image(owner=owner, job=job, lane=Lane.BULK, sha256=sha, size_bytes=1, storage_key=f"blob/{sha}",
                          model_id="m", point_id=uuid.uuid4()))
    Image.objects.bulk_create(rows)
    if age_s:
        old = timezone.now() - dt.timedelta(seconds=age_s)
        Image.objects.filter(job=job).update(created_at=old)
        Job.objects.filter(id=job.id).update(created_at=old)
    return job, [str(r.id) for r in rows]


def finish(msg) -> int:
    """The end of the chunk of message ``msg``, as ``embed_chunk`` reports it."""
    job_id, ids, chunk_id, _ = msg
    return dispatch.bulk_chunk_done(job_id=job_id, chunk_id=chunk_id, images=len(ids), seconds=1.0, computed=len(ids))


def test_the_window_holds_two_chunks_and_a_small_job_of_another_owner_goes_next(fair, sent, user, other_user):
    big, big_ids = make_job(user, 8)
    small, small_ids = make_job(other_user, 2)
    assert dispatch.send_job_chunks(job=big, image_ids=big_ids) == 4
    assert dispatch.send_job_chunks(job=small, image_ids=small_ids) == 1
    assert [(m[0], m[1]) for m in sent] == [(str(big.id), big_ids[0:2]), (str(big.id), big_ids[2:4])]
    assert BulkChunk.objects.filter(state=ChunkState.PENDING).count() == 3  # the database holds the rest
    finish(sent[0])
    assert sent[2][0] == str(small.id)  # the small job's chunk, not the big job's third
    for i in range(1, 5):
        finish(sent[i])
    assert [m[0] for m in sent] == [str(big.id)] * 2 + [str(small.id)] + [str(big.id)] * 2
    assert [m[1] for m in sent if m[0] == str(big.id)] == [big_ids[i:i + 2] for i in range(0, 8, 2)]
    assert all(m[3] == 9 for m in sent)  # background priority on the bulk queue
    assert set(BulkChunk.objects.values_list("state", flat=True)) == {ChunkState.DONE}


def test_a_finish_costs_two_sql_statements_and_two_redis_commands(fair, sent, user):
    job, ids = make_job(user, 8)
    dispatch.send_job_chunks(job=job, image_ids=ids)
    client = lane_control.redis_client()

    def commands() -> int:
        return sum(v["calls"] for v in client.info("commandstats").values())

    before = commands()
    with CaptureQueriesContext(connection) as q:
        assert finish(sent[0]) == 1
    after = commands() - 1  # the INFO that read ``before``
    sql = [x["sql"].upper() for x in q.captured_queries]
    assert len(sql) == 2, sql  # the snapshot; one UPDATE marks the finished chunk done and claims the next
    assert sql[0].startswith("SELECT") and "COUNT(" not in sql[0]
    assert sql[1].startswith("UPDATE") and "RETURNING" in sql[1]
    assert after - before == 2  # HGETALL of the tags, HSET of the pick's
    states = dict(BulkChunk.objects.values_list("id", "state"))
    assert states[sent[0][2]] == ChunkState.DONE and states[sent[2][2]] == ChunkState.SENT


def test_a_chunk_is_claimed_once_and_a_finish_without_a_place_claims_nothing(fair, sent, user):
    job, ids = make_job(user, 6)
    bulk_schedule.chunks_add(job_id=job.id, chunks=[ids[0:2], ids[2:4]])
    a, _ = bulk_schedule.chunk_claim(job_id=str(job.id), own=None)
    b, _ = bulk_schedule.chunk_claim(job_id=str(job.id), own=None)
    none, _ = bulk_schedule.chunk_claim(job_id=str(job.id), own=None)
    assert (a.image_ids, b.image_ids, none) == (ids[0:2], ids[2:4], None)
    # a chunk delivered twice (a redelivery) hands its place on once: the second finish finds the window full
    BulkChunk.objects.filter(id__in=(a.chunk_id, b.chunk_id)).delete()
    job2, ids2 = make_job(user, 6)
    dispatch.send_job_chunks(job=job2, image_ids=ids2)
    assert len(sent) == 2
    assert finish(sent[0]) == 1 and len(sent) == 3
    assert finish(sent[0]) == 0 and len(sent) == 3
    assert BulkChunk.objects.filter(state=ChunkState.SENT).count() == 2


def test_urgent_and_deadline_jobs_go_first_and_migrations_count_as_one_owner(fair, sent, user, other_user, staff):
    bg, bg_ids = make_job(user, 6)
    dispatch.send_job_chunks(job=bg, image_ids=bg_ids)  # two in the window, one pending
    up, up_ids = make_job(other_user, 2, priority=JobPriority.URGENT)
    mig, mig_ids = make_job(staff, 2, kind=JobKind.MIGRATION)
    dispatch.send_job_chunks(job=mig, image_ids=mig_ids)
    dispatch.send_job_chunks(job=up, image_ids=up_ids)
    finish(sent[0])
    assert (sent[2][0], sent[2][3]) == (str(up.id), 6)  # urgent first, at urgent priority
    views = {v.job_id: v for v in bulk_schedule.lane_snapshot().views}
    assert views[str(mig.id)].owner == bulk_schedule.LIFECYCLE_OWNER
    assert views[str(mig.id)].weight == fair.BULK_LIFECYCLE_WEIGHT


def weighted_key(owner, weight: float | None) -> str:
    """The prefix of a new key of ``owner`` with bulk weight ``weight`` (None: the owner's)."""
    limits = {"bulk_weight": weight} if weight is not None else {}
    return key_create(owner=owner, name="bulk", scopes=["all"], limits=limits, by_staff=True).key.prefix


def test_a_key_of_bulk_weight_3_against_one_of_1_gets_three_chunks_in_four(fair, sent, user, other_user):
    fair.BULK_SCHEDULER_WINDOW = 1
    heavy = [make_job(user, 80, key_prefix=weighted_key(user, 3.0)) for _ in range(2)]  # two jobs: one share
    light, light_ids = make_job(other_user, 160, key_prefix=weighted_key(other_user, 1.0))
    for job, ids in heavy:
        dispatch.send_job_chunks(job=job, image_ids=ids)
    dispatch.send_job_chunks(job=light, image_ids=light_ids)
    views = bulk_schedule.lane_snapshot().views
    assert sorted((v.owner, v.weight) for v in views) == [("alice", 3.0), ("alice", 3.0), ("bob", 1.0)]
    while len(sent) < 81:
        finish(sent[-1])
    owners = ["bob" if m[0] == str(light.id) else "alice" for m in sent[1:81]]  # 80 picks of the scheduler
    assert (owners.count("alice"), owners.count("bob")) == (60, 20)
    for n in range(1, 81):
        # start-time fair queueing's bound (Goyal, Vin and Cheng 1996): while both owners have work, chunks
        # served over weight differ by at most one chunk over each weight, 1/3 + 1/1
        a, b = owners[:n].count("alice"), owners[:n].count("bob")
        assert abs(a / 3.0 - b / 1.0) <= 1 / 3 + 1 + 1e-9, (n, "".join(o[0] for o in owners[:n]))
    assert owners[:40] == ["bob", "alice", "alice", "alice"] * 10
    alice = [m[0] for m in sent[1:81] if m[0] != str(light.id)]
    assert alice.count(str(heavy[0][0].id)) == alice.count(str(heavy[1][0].id)) == 30  # its share, halved


def test_a_key_without_weight_uses_the_owners_and_an_owner_weighs_its_largest(fair, sent, user, other_user):
    fair.BULK_OWNER_WEIGHTS = {"alice": 2.0}
    plain, plain_ids = make_job(user, 4, key_prefix=weighted_key(user, None))
    session, session_ids = make_job(other_user, 4)  # no key: bob's weight, 1 by default
    for job, ids in ((plain, plain_ids), (session, session_ids)):
        dispatch.send_job_chunks(job=job, image_ids=ids)
    assert {v.owner: v.weight for v in bulk_schedule.lane_snapshot().views} == {"alice": 2.0, "bob": 1.0}
    low, low_ids = make_job(other_user, 4, key_prefix=weighted_key(other_user, 0.5))
    high, high_ids = make_job(user, 4, key_prefix=weighted_key(user, 5.0))
    for job, ids in ((low, low_ids), (high, high_ids)):
        dispatch.send_job_chunks(job=job, image_ids=ids)
    # every job of an owner carries the largest weight among its jobs: bob's 0.5 key does not lower his 1
    views = {v.job_id: v.weight for v in bulk_schedule.lane_snapshot().views}
    assert views == {str(plain.id): 5.0, str(high.id): 5.0, str(session.id): 1.0, str(low.id): 1.0}
    Job.objects.filter(id=session.id).update(status=JobStatus.CANCELLED)
    assert {v.job_id: v.weight for v in bulk_schedule.lane_snapshot().views}[str(low.id)] == 0.5
    ApiKey.objects.filter(prefix=high.key_prefix).update(bulk_weight=None)  # staff cleared it: alice's own again
    assert {v.job_id: v.weight for v in bulk_schedule.lane_snapshot().views}[str(high.id)] == 2.0


def test_paused_jobs_keep_their_chunks_in_the_database_until_resumed(fair, sent, user):
    from embeddings.services.catalogue import jobs as job_services

    job, ids = make_job(user, 4)
    with transaction.atomic():
        job_services.job_transition(job=job, to=JobStatus.PAUSED)
        transaction.on_commit(lambda: dispatch.send_job_chunks(job=job, image_ids=ids))
    assert not sent and BulkChunk.objects.filter(state=ChunkState.PENDING).count() == 2
    job_services.job_transition(job=Job.objects.get(id=job.id), to=JobStatus.QUEUED)
    assert [m[1] for m in sent] == [ids[0:2], ids[2:4]]


def test_the_reconciler_keeps_unsent_chunks_and_releases_sent_ones_no_message_names(fair, sent, user):
    job, ids = make_job(user, 8, age_s=600)
    dispatch.send_job_chunks(job=job, image_ids=ids)  # rows 1-2 sent, 3-4 pending
    assert len(sent) == 2
    sent.clear()
    young = reconcile(live_ids=lambda: set(), grace_s=60, max_attempts=5)
    # the sent chunks' messages are gone (no live id) but were sent just now: their images are sent
    # again as new chunks, their rows stay in the window until the grace has passed
    assert (young.redispatched, young.chunks_released) == (4, 0) and not sent
    assert set(bulk_schedule.held_image_ids()) == set(ids)  # the pending rows hold every image
    BulkChunk.objects.filter(state=ChunkState.SENT).update(sent_at=timezone.now() - dt.timedelta(seconds=120))
    old = reconcile(live_ids=lambda: set(), grace_s=60, max_attempts=5)
    assert (old.redispatched, old.chunks_released) == (0, 2)
    assert [m[1] for m in sent] == [ids[4:6], ids[6:8]]  # the window refilled, oldest pending first
    assert not BulkChunk.objects.filter(state=ChunkState.DONE).exists()  # finished rows deleted


def test_fifo_sends_every_chunk_at_once_without_rows(settings, sent, user):
    settings.BULK_SCHEDULER = "fifo"
    job, ids = make_job(user, 6)
    assert dispatch.send_job_chunks(job=job, image_ids=ids) == 3
    assert [(m[1], m[2]) for m in sent] == [(ids[0:2], None), (ids[2:4], None), (ids[4:6], None)]
    assert not BulkChunk.objects.exists()
    assert dispatch.bulk_pump() == 0


def test_per_owner_metrics_name_the_first_owners_and_call_the_rest_other(settings, monkeypatch):
    settings.BULK_METRICS_OWNERS = 2
    monkeypatch.setattr(metrics, "_named_owners", set())
    assert [metrics.bulk_owner_label(o) for o in ("a", "b", "c", "a")] == ["a", "b", "other", "a"]
    before = metrics.BULK_OWNER_IMAGES.labels(priority="background", owner="other")._value.get()
    metrics.count_bulk_chunk(priority="background", owner="zed", n=64)
    assert metrics.BULK_OWNER_IMAGES.labels(priority="background", owner="other")._value.get() == before + 64


@pytest.mark.parametrize("paused", [False, True], ids=["straight", "paused-then-resumed"])
def test_a_fair_job_runs_to_the_end_through_the_real_chunk_task(fair, service, user, paused):
    """Eager Celery runs each chunk inside its send: the finish inside a send only marks its row, and
    the outer fill goes on until the job is done (no recursion through the whole job)."""
    from embeddings.services.catalogue import jobs as job_services
    from embeddings.services.catalogue.sources import SourceFile
    from tests.embeddings.conftest import jpeg_bytes

    service.PIPELINE = service.PIPELINE.replace(batch_size=2)
    sources = [SourceFile(name=f"{i}.jpg", size=0, open=lambda i=i: io.BytesIO(jpeg_bytes(900 + i)))
               for i in range(7)]
    with transaction.atomic():
        job = job_services.job_create(owner=user, sources=sources)
        if paused:
            job_services.job_transition(job=job, to=JobStatus.PAUSED)
    if paused:
        assert Image.objects.filter(job=job, status=ImageStatus.QUEUED).count() == 7
        job_services.job_transition(job=Job.objects.get(id=job.id), to=JobStatus.QUEUED)
    job.refresh_from_db()
    assert job.status == JobStatus.DONE
    assert Image.objects.filter(job=job, status=ImageStatus.EMBEDDED).count() == 7
    assert set(BulkChunk.objects.filter(job=job).values_list("state", flat=True)) == {ChunkState.DONE}


def test_a_jobs_eta_position_and_risk_come_from_the_lanes_order(fair, sent, user, other_user):
    """Lane at 10 images/s (the last minute's chunks). a: 8 images, b: 2 due in 0.3 s. Fair halves
    would end b at 0.4 s, past its deadline; earliest deadline first ends it at 0.2 s: so b goes
    first, is not at risk, and a ends at 1.0 s."""
    from embeddings.models import BatchStat
    from embeddings.services.catalogue.jobs import job_progress

    a, a_ids = make_job(user, 8)
    dispatch.send_job_chunks(job=a, image_ids=a_ids)
    b, b_ids = make_job(other_user, 2, deadline=timezone.now() + dt.timedelta(seconds=0.3))
    dispatch.send_job_chunks(job=b, image_ids=b_ids)
    BatchStat.objects.create(job=a, lane=Lane.BULK, images=10)
    t0 = timezone.now()
    lane_a, lane_b = job_progress(Job.objects.get(id=a.id))["lane"], job_progress(Job.objects.get(id=b.id))
    assert (lane_b["lane"]["position"], lane_a["position"], lane_b["lane"]["jobs"]) == (0, 1, 2)
    assert (lane_b["lane"]["share"], lane_a["share"]) == (1.0, 0.0)
    assert not lane_b["at_risk"] and not lane_b["lane"]["infeasible"] and lane_b["eta"] == lane_b["lane"]["eta"]
    assert abs((lane_b["eta"] - t0).total_seconds() - 0.2) < 0.1
    assert abs((lane_a["eta"] - t0).total_seconds() - 1.0) < 0.1
    assert lane_a["rate_images_per_s"] == 10.0


def test_without_the_fair_scheduler_a_job_has_no_lane_block(settings, user):
    from embeddings.services.catalogue.jobs import job_progress

    settings.BULK_SCHEDULER = "fifo"
    job, _ = make_job(user, 2)
    assert job_progress(job)["lane"] is None


@pytest.mark.skipif(connection.vendor != "postgresql", reason="threads need a database server (SQLite in tests is "
                    "one in-memory connection); SQLite serialises writers anyway")
def test_workers_claiming_at_once_never_take_one_chunk_twice(fair, user):
    import concurrent.futures

    job, ids = make_job(user, 40)
    bulk_schedule.chunks_add(job_id=job.id, chunks=[ids[i:i + 2] for i in range(0, 40, 2)])
    barrier = threading.Barrier(8)

    def claims() -> list[int]:
        got = []
        barrier.wait()
        try:
            while (c := bulk_schedule.chunk_claim(job_id=str(job.id), own=None)[0]) is not None:
                got.append(c.chunk_id)
        finally:
            connection.close()  # this thread's own connection
        return got

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = [i for f in [pool.submit(claims) for _ in range(8)] for i in f.result()]
    assert len(got) == len(set(got)) == 20
    assert BulkChunk.objects.filter(state=ChunkState.SENT).count() == 20
