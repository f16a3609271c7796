"""Admission, the web side of the interactive lane (embeddings/lane_control/admission.py): what it
reads from Redis, what it records of each answer and refusal, and the 429 through the API.

Real values throughout (``conftest``): the real model's batch records reported by the worker side,
real Celery messages on a private redis-server; the wait model itself is tested alone in
tests/queueing/.
"""
from __future__ import annotations

import json
import math
import re
import time

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings import runtime, tasks  # noqa: F401 - registers the tasks the eager chains run by name
from embeddings.errors import ApplicationError
from embeddings.lane_control import admission, background, bulk_yield, keys, reports
from embeddings.models import Image, ImageStatus, Job
from project import lanes
from queueing import wait_ahead, wait_model
from tests.embeddings.conftest import celery_publishing_to
from tests.embeddings.lane_control.conftest import jpeg_bytes, publish

pytestmark = pytest.mark.django_db(transaction=True)


# --- what Redis holds -----------------------------------------------------------------------------

def test_backlog_is_counted_across_kombus_priority_lists(lane_redis):
    client, app = lane_redis
    for priority in (0, 3, 6, 9):
        publish(app, lanes.INTERACTIVE, priority, n=2)
    publish(app, lanes.BULK, 9, n=5)  # another lane: not interactive backlog
    lists = keys.queue_keys(lanes.INTERACTIVE)
    named = "clip:" + lanes.INTERACTIVE  # under the deployment's prefix, as kombu's global_keyprefix
    assert lists[0] == named and all(k.startswith(named + "\x06\x16") for k in lists[1:])
    assert {k for k in client.keys(named + "*")} == set(lists)  # what kombu really wrote
    load = admission.interactive_load()
    assert (load.queued_messages, load.inflight_images, load.capacity_ips) == (8, 0, None)


def test_two_workers_admit_twice_the_load_of_one_at_the_same_predicted_wait(lane_redis, measured, tracker):
    """Each worker reports its own capacity under its own name; the web sums the live ones. Two
    workers each draining 8 images/s: the backlog admitted doubles, at the same predicted wait, and
    a worker that stops reporting stops counting."""
    client, app = lane_redis
    now = time.time()
    tracker.finished(now - 2.0, now - 1.0, 8)  # this process drained 8 images in 1 s busy: 8 images/s

    def admitted_backlog() -> tuple[int, float]:
        """Publish one request at a time until admission refuses; the backlog and the last admitted wait."""
        client.delete(*keys.queue_keys(lanes.INTERACTIVE))
        n, last = 0, None
        while True:
            decision = wait_model.decide(admission.interactive_load(), deadline_s=2.0)
            if not decision.admitted:
                return n, last
            last = decision.predicted_wait_s
            publish(app, lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE)
            n += 1

    reports.interactive_report(measured, worker="celery@one")
    one = admitted_backlog()
    reports.interactive_report(measured, worker="celery@two")  # a second worker, same measured figure
    load = admission.interactive_load()
    assert (load.capacity_ips, load.workers) == (pytest.approx(16.0), 2)
    two = admitted_backlog()
    # admitted while the forward passes of (backlog + its own image), shared between the workers, fit in 2 s
    assert one[0] >= 1 and two[0] in (2 * one[0], 2 * one[0] + 1)  # twice the images (± the split of an odd one)
    assert max(one[1], two[1]) <= 2.0 and two[1] == pytest.approx(one[1], rel=0.15)  # about the same wait
    # worker two's heartbeat stops: after WORKER_TTL_S its capacity no longer counts
    entry = json.loads(client.hget(keys.WORKERS_KEY, "celery@two"))
    client.hset(keys.WORKERS_KEY, "celery@two",
                json.dumps({**entry, "updated": time.time() - wait_model.WORKER_TTL_S - 1}))
    assert admitted_backlog()[0] == one[0]


def test_answers_feed_the_fit_in_the_same_round_trip(lane_redis, measured, tracker):
    client, _ = lane_redis
    reports.interactive_report(measured, worker="w")
    now = time.time()
    for i, (work, wait, status) in enumerate([(0.5, 0.9, 200), (1.0, 1.6, 200), (1.5, 2.1, 202), (0.8, 1.2, 200)]):
        decision = wait_model.Decision(True, work, work_s=work, admitted_at=now - 3 + i * 0.5)
        admission.interactive_answered(decision, images=1, status=status, answered_at=now - 3 + i * 0.5 + wait)
    admission.interactive_answered(wait_model.Decision(True, None), images=1, status=200)  # admission off: not recorded
    records = admission.answer_records()
    assert [(r["work_s"], r["status"]) for r in records] == [(0.5, 200), (1.0, 200), (1.5, 202), (0.8, 200)]
    assert records[2]["answered"] - records[2]["admitted"] == pytest.approx(2.1, abs=1e-3)
    load = admission.interactive_load()
    expected = wait_model.fit_wait(records, now=time.time())
    assert load.fit.samples == 4
    assert load.fit.overhead_s == pytest.approx(expected.overhead_s, abs=1e-3)
    assert load.fit.scale == pytest.approx(expected.scale, abs=1e-3)
    assert load.fit.scale > 1.0  # the answers waited longer than the workers' figure said
    # An admitted request not answered yet is pending (read in the same round trip): once it has
    # waited longer than predicted it counts; its answer removes it.
    client.hset(keys.PENDING_KEY, "tok", json.dumps({"admitted": time.time() - 1.5, "work_s": 0.5,
                                                          "predicted_s": 0.6, "deadline_s": 2.0}))
    assert admission.interactive_load().fit.samples == 5
    admission.interactive_answered(wait_model.Decision(True, 0.6, work_s=0.5, admitted_at=time.time() - 1.6,
                                                       token="tok"), images=1, status=200)
    assert not client.hexists(keys.PENDING_KEY, "tok") and len(admission.answer_records()) == 5


def test_in_a_web_request_the_answer_is_recorded_once_the_response_is_sent_with_the_time_it_was_given(lane_redis):
    """Inside a request the record waits for Django's ``request_finished``; its ``answered`` is the
    time of the call, not of the write."""
    from django.core.signals import request_finished, request_started

    client, _ = lane_redis
    client.hset(keys.PENDING_KEY, "tok", json.dumps({"admitted": time.time() - 1.0, "work_s": 0.5}))
    request_started.send(sender=None, environ={})
    given = time.time()
    admission.interactive_answered(wait_model.Decision(True, 0.6, work_s=0.5, admitted_at=given - 1.0, token="tok"),
                                   images=1, status=200)
    assert admission.answer_records() == [] and client.hexists(keys.PENDING_KEY, "tok")
    time.sleep(0.05)
    request_finished.send(sender=None)
    (record,) = admission.answer_records()
    assert round(given, 4) <= record["answered"] < given + 0.05 and not client.hexists(keys.PENDING_KEY, "tok")


def test_the_regime_at_admission_goes_with_the_pending_request_and_its_answer(service, lane_redis, measured, tracker):
    """``interactive_admit`` records whether bulk chunks computed at admission in the pending entry
    and the decision; the answer carries it (``bulk_at_admission``). A request admitted beside a
    chunk that parked at once and answered in the quiet lane is no lone overhead of either regime."""
    client, _ = lane_redis
    reports.interactive_report(measured, worker="w")
    activity = bulk_yield.BulkActivity()
    activity.start()
    with celery_publishing_to(service.REDIS_URL):
        decision = admission.interactive_admit(deadline_s=5.0)
    activity.stop()
    assert decision.admitted and decision.admitted_beside_bulk is True and decision.ahead_images == 0
    assert background.flush()  # the pending record leaves from the writer thread
    (raw,) = client.hvals(keys.PENDING_KEY)
    assert json.loads(raw)["bulk_at_admission"] is True
    admission.interactive_answered(decision, images=1, status=200, answered_at=time.time() + 5.0)
    (record,) = admission.answer_records()
    assert record["bulk_at_admission"] is True and record["bulk_s"] < 0.25 * 5.0
    assert wait_model.fit_regime(record) is None
    assert client.llen(keys.LONE_KEY) == client.llen(keys.LONE_BULK_KEY) == 0
    assert client.hlen(keys.PENDING_KEY) == 0
    with celery_publishing_to(service.REDIS_URL):
        quiet = admission.interactive_admit(deadline_s=5.0)
    assert quiet.admitted_beside_bulk is False
    assert background.flush()
    (raw,) = client.hvals(keys.PENDING_KEY)
    assert json.loads(raw)["bulk_at_admission"] is False


def test_a_bulk_chunks_computing_labels_the_answers_and_picks_the_fit(lane_redis, measured, tracker):
    """While a chunk computes (``BulkActivity``), the web's load says ``beside_bulk`` and uses the
    lone overheads measured beside bulk work; an answer is recorded with the seconds of its wait
    during which a chunk computed (``bulk_s``, from the finished intervals and the one running), and
    a lone one goes to the list of its regime. Stopping records the interval and clears the mark."""
    client, _ = lane_redis
    reports.interactive_report(measured, worker="w")
    assert admission.interactive_load().beside_bulk is False
    activity = bulk_yield.BulkActivity()
    activity.start()
    started = float(client.hget(keys.BULK_ACTIVITY_KEY, activity.field))
    activity.start()  # already computing: the same mark
    assert float(client.hget(keys.BULK_ACTIVITY_KEY, activity.field)) == started
    assert admission.interactive_load().beside_bulk is True
    now = time.time()
    lone = wait_model.Decision(True, 0.2, work_s=0.2, admitted_at=started - 0.5, ahead_images=0)
    admission.interactive_answered(lone, images=1, status=200, answered_at=started + 0.5)
    (record,) = admission.answer_records()
    assert record["bulk_s"] == pytest.approx(0.5, abs=1e-3)  # from the mark to its answer
    assert client.lrange(keys.LONE_KEY, 0, -1) == [] and client.llen(keys.LONE_BULK_KEY) == 1
    client.rpush(keys.LONE_KEY, "0.05")
    assert admission.interactive_load().lone_overhead_s == pytest.approx(0.8)  # beside bulk: its own list
    assert admission.interactive_load().quiet is None  # a chunk that does not yield: no anticipation
    activity.stop()
    activity.stop()  # not computing: nothing more recorded
    assert not client.hexists(keys.BULK_ACTIVITY_KEY, activity.field)
    (run,) = client.lrange(keys.BULK_RUNS_KEY, 0, -1)
    lo, hi = map(float, run.split())
    assert lo == pytest.approx(started, abs=1e-3) and started <= hi <= time.time()
    load = admission.interactive_load()
    assert load.beside_bulk is False and load.lone_overhead_s == pytest.approx(0.05)
    # a request admitted before the interval and answered after it: the interval's length
    later = wait_model.Decision(True, 0.2, work_s=0.2, admitted_at=lo - 1.0, ahead_images=3)
    admission.interactive_answered(later, images=1, status=200, answered_at=max(now, hi) + 1.0)
    assert admission.answer_records()[-1]["bulk_s"] == pytest.approx(hi - lo, abs=1e-3)
    # a dead process's mark (older than the stale bound) is not computing, and is removed
    client.hset(keys.BULK_ACTIVITY_KEY, "dead", f"{time.time() - keys.bulk_stale_after_s() - 5:.4f}")
    assert admission.interactive_load().beside_bulk is False and not client.hexists(keys.BULK_ACTIVITY_KEY, "dead")
    # a chunk that yields to the lane (a background ingest's) marks it: the load carries the quiet regime's
    yielding = bulk_yield.BulkActivity(yields=True)
    yielding.start()
    assert client.hget(keys.BULK_ACTIVITY_KEY, yielding.field).endswith(" y")
    load = admission.interactive_load()
    assert load.beside_bulk is True and load.quiet is not None and load.quiet.beside_bulk is False
    assert load.quiet.lone_overhead_s == pytest.approx(0.05)  # the quiet lane's lone list
    yielding.stop()


def test_lone_answers_measure_the_overhead_the_fit_is_pulled_to(lane_redis, measured, tracker):
    """A request answered 200 with nothing ahead of it (``ahead`` 0) measures the overhead every
    request pays (its wait minus its work); the last LONE_KEPT of them are kept, and the web's fit
    pulls its intercept to their mean, in the same round trip. A 202, or a request with work ahead,
    says nothing about it."""
    client, _ = lane_redis
    reports.interactive_report(measured, worker="w")
    now = time.time()
    for i, (ahead, work, wait, status) in enumerate([(0, 0.15, 0.21, 200), (0, 0.15, 0.19, 200), (3, 0.5, 0.8, 200),
                                                      (0, 0.15, 1.2, 202), (6, 0.7, 1.0, 200)]):
        decision = wait_model.Decision(True, work, work_s=work, admitted_at=now - 3 + i * 0.5, ahead_images=ahead)
        admission.interactive_answered(decision, images=1, status=status, answered_at=now - 3 + i * 0.5 + wait)
    assert [float(x) for x in client.lrange(keys.LONE_KEY, 0, -1)] == pytest.approx([0.06, 0.04], abs=1e-4)
    load = admission.interactive_load()
    records = admission.answer_records()
    pulled = wait_model.fit_wait(records, now=time.time(), overhead_prior_s=0.05)
    assert load.fit.overhead_s == pytest.approx(pulled.overhead_s, abs=1e-3)
    assert load.fit.scale == pytest.approx(pulled.scale, abs=1e-3)
    assert load.fit.overhead_s != pytest.approx(wait_model.fit_wait(records, now=time.time()).overhead_s, abs=1e-3)
    for _ in range(keys.LONE_KEPT + 4):  # capped
        admission.interactive_answered(wait_model.Decision(True, 0.1, work_s=0.1, admitted_at=time.time() - 0.2,
                                                           ahead_images=0), images=1, status=200)
    assert client.llen(keys.LONE_KEY) == keys.LONE_KEPT


def test_the_margin_policy_defaults_to_queueings():
    """The ``ADMISSION_*`` settings admission passes to the wait model default to queueing's own
    policy (``wait_model.MARGIN_QUANTILE``, ``MIN_MARGIN_SHARE``, ``MAX_MARGIN_SHARE``): the load
    replay, which runs without Django, replays what the web decides."""
    assert (settings.ADMISSION_MARGIN_QUANTILE, settings.ADMISSION_MIN_MARGIN_SHARE,
            settings.ADMISSION_MAX_MARGIN_SHARE) == (wait_model.MARGIN_QUANTILE, wait_model.MIN_MARGIN_SHARE,
                                                     wait_model.MAX_MARGIN_SHARE) == (0.99, 0.2, 0.4)


# --- the API --------------------------------------------------------------------------------------

@pytest.fixture
def overloaded(service, lane_redis, measured, tracker):
    """A real, non-eager setting: a worker's measured capacity in Redis and more queued interactive
    work than drains within the deadline. No worker consumes the private Redis."""
    _, publisher = lane_redis
    reports.interactive_report(measured, worker="celery@test")
    capacity = admission.interactive_load().capacity_ips
    curve, max_batch = wait_model.update_batch_curve({}, measured), reports._max_batch()
    full_batch_ips = 1000 * max_batch / wait_model.batch_ms(curve, max_batch)
    longest = max(service.INTERACTIVE_DEADLINE_S, service.VECTORS_CALL_TIMEOUT_S)  # uploads, searches
    backlog = math.ceil(2 * longest * max(capacity, full_batch_ips))  # ≥ 2 of the longest deadlines of work
    publish(publisher, lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE, n=backlog)
    with celery_publishing_to(service.REDIS_URL):
        # the predicted wait of a one-image request (no answers yet: scale 1): the backlog's and its
        # own forward passes at the measured per-batch-size times, full batches first; the work
        # ahead of it, without its own image; and what a 429 first says: the backlog needs
        # (wait − the admission edge) to drain to what the deadline admits, longer than the edge
        wait, deadline = wait_model.drain_s(curve, backlog + 1, max_batch), service.INTERACTIVE_DEADLINE_S
        edge = wait_model.admission_edge_s(admission.interactive_load().fit, deadline,
                                           min_share=service.ADMISSION_MIN_MARGIN_SHARE,
                                           max_s=service.ADMISSION_MAX_MARGIN_SHARE * deadline)
        assert wait - edge > edge
        yield {"wait": wait, "ahead": wait_model.drain_s(curve, backlog, max_batch), "first": wait - edge}


def test_a_request_that_misses_its_deadline_even_alone_is_a_413_without_retry_after(service, lane_redis, measured,
                                                                                    tracker):
    """No retry could help a request whose own images need longer than its deadline, whatever is
    queued ahead of it (here one message: an empty lane admits anything and lets the deadline judge)."""
    _, publisher = lane_redis
    reports.interactive_report(measured, worker="celery@test")
    publish(publisher, lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE, n=1)
    curve, max_batch = wait_model.update_batch_curve({}, measured), reports._max_batch()
    images, deadline = 256, 0.5
    assert wait_model.drain_s(curve, images, max_batch) > deadline  # its own passes alone
    with celery_publishing_to(service.REDIS_URL), pytest.raises(ApplicationError) as refused:
        admission.interactive_admit(deadline_s=deadline, images=images)
    e = refused.value
    assert (e.status, e.code, e.headers) == (413, "request_exceeds_deadline", {})
    assert e.extra["images"] == images and e.extra["alone_s"] > deadline
    with celery_publishing_to(service.REDIS_URL):
        assert admission.interactive_admit(deadline_s=5.0, images=1).admitted  # one image fits


def test_upload_answers_429_with_retry_after_and_stores_nothing(overloaded, api, service):
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("a.jpg", jpeg_bytes(1), content_type="image/jpeg")]},
                 format="multipart")
    assert r.status_code == 429, r.content
    body = r.json()
    assert set(body) == {"message", "code", "extra"} and body["code"] == "overloaded"
    wait = body["extra"]["predicted_wait_s"]
    assert wait == pytest.approx(overloaded["wait"], rel=0.01) and wait > service.INTERACTIVE_DEADLINE_S
    # the time the backlog needs to drain to the admission edge; the backlog's wait (without its
    # own image) beside it
    assert body["extra"]["wait_ahead_s"] == pytest.approx(overloaded["first"], abs=0.01)
    assert body["extra"]["wait_ahead_from"] == "drain"
    assert body["extra"]["work_ahead_wait_s"] == pytest.approx(overloaded["ahead"], abs=0.01)
    # Retry-After: that wait plus its margin (its upper bound, as admission bounds a wait), rounded up
    ra_margin = body["extra"]["retry_margin_s"]
    assert ra_margin == pytest.approx(min(max(body["extra"]["learnt_margin_s"], 0.2 * body["extra"]["wait_ahead_s"]),
                                          0.4 * body["extra"]["deadline_s"]), abs=0.002)
    assert int(r["Retry-After"]) == body["extra"]["retry_after_s"] == math.ceil(
        body["extra"]["wait_ahead_s"] + ra_margin)
    assert body["extra"]["workers"] == 1 and body["extra"]["scale"] == 1.0
    # the margin applied: the learnt one, at least ADMISSION_MIN_MARGIN_SHARE of the predicted wait;
    # the message names it, since it is what tips a predicted wait under the deadline into a 429
    extra = body["extra"]
    assert extra["margin_s"] == pytest.approx(min(max(extra["learnt_margin_s"], 0.2 * wait), 0.4 * extra["deadline_s"]),
                                              abs=0.002)
    # (the message shows 2 decimals of the unrounded figures, extra 3 decimals: compare the numbers)
    said = re.search(r"predicted wait ([0-9.]+) s plus a margin of ([0-9.]+) s", body["message"])
    assert said and float(said[1]) == pytest.approx(wait, abs=0.006)
    assert float(said[2]) == pytest.approx(extra["margin_s"], abs=0.006)
    assert Image.objects.count() == 0  # refused before anything was stored or queued
    assert admission.answer_records() == []  # nor recorded as an answer
    # A text query on the same lane is refused too; a longer deadline is never granted.
    r = api.post("/api/search/", {"text": "a cat", "k": 3}, format="json")
    assert r.status_code == 429 and r.json()["code"] == "overloaded" and "Retry-After" in r


def test_a_429_says_the_wait_learnt_from_earlier_refusals(overloaded, api, lane_redis, service, monkeypatch):
    """Earlier refusals of the same lane state and deadline in Redis, each with a request admitted
    0.1 s after it that waited a quarter longer than the refusal said: the next 429 says more than
    its first estimate, learnt from them (the pure fit on the same records), with a Retry-After
    made from that; and it is recorded itself, with its deadline, to be labelled once the requests
    around it are answered. Refusals at a deadline 2.5 times longer, 1 s after each of those, whose
    admitted requests waited half what they said, are not learnt from (they would pull it down)."""
    client, _ = lane_redis
    # a window long enough for both deadlines' labels of these ~25 s waits, all weighing alike
    monkeypatch.setattr(wait_ahead, "FIT_WINDOW_S", 150.0)
    monkeypatch.setattr(wait_ahead, "HALF_LIFE_S", 1e6)
    first, deadline = overloaded["first"], service.INTERACTIVE_DEADLINE_S
    state = {"wait_ahead_s": round(first, 4), "inflight_images": 0.0, "running_pass_left_s": 0.0,
             "running_pass_images": 0.0, "queued_messages": float(admission.interactive_load().queued_messages)}
    now = time.time()
    # 2 s apart, the other deadline's 1 s after: each refusal's ±0.5 s window holds its own answer alone
    refusals = [{"t": round(now - 130 + 2 * i, 4), "deadline_s": deadline, **state} for i in range(24)]
    longer = [{**r, "t": r["t"] + 1.0, "deadline_s": 2.5 * deadline} for r in refusals]

    # work_s / predicted_s None: answers the wait model's fit and recent admissions do not use
    def answered(rs, factor):
        return [{"admitted": r["t"] + 0.1, "answered": r["t"] + 0.1 + factor * first, "images": 1, "status": 200,
                 "work_s": None, "predicted_s": None, "ahead": None} for r in rs
                if r["t"] + 0.1 + factor * first < now - 1]
    answers, other = answered(refusals, 1.25), answered(longer, 0.5)
    assert len(answers) >= wait_ahead.MIN_LABELLED and len(other) >= wait_ahead.MIN_LABELLED
    client.rpush(keys.REFUSALS_KEY, *map(json.dumps, sorted(refusals + longer, key=lambda r: r["t"])))
    client.rpush(keys.ANSWERS_KEY, *map(json.dumps, sorted(answers + other, key=lambda a: a["answered"])))
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("a.jpg", jpeg_bytes(1), content_type="image/jpeg")]},
                 format="multipart")
    assert r.status_code == 429, r.content
    extra, later = r.json()["extra"], time.time()
    fit = wait_ahead.fit_wait_ahead(refusals, answers, pending_admitted=[], now=later)
    banded = wait_ahead.fit_wait_ahead(refusals + longer, answers + other, pending_admitted=[], now=later,
                                       deadline_s=deadline)
    mixed = wait_ahead.fit_wait_ahead(refusals + longer, answers + other, pending_admitted=[], now=later)
    assert banded.coef == pytest.approx(fit.coef, abs=1e-9) and banded.samples == fit.samples
    assert extra["wait_ahead_samples"] == fit.samples == len(answers)
    assert mixed.samples == len(answers) + len(other)
    assert extra["first_wait_ahead_s"] == pytest.approx(first, abs=0.01)
    assert extra["wait_ahead_s"] == pytest.approx(fit.predict(state), abs=0.01)
    assert 1.2 * first < extra["wait_ahead_s"] <= 1.25 * first  # near what they waited, pulled to the first
    assert mixed.predict(state) < first  # what learning from every deadline would have said
    assert int(r["Retry-After"]) == extra["retry_after_s"] == math.ceil(extra["wait_ahead_s"] + extra["retry_margin_s"])
    assert "learnt from" in r.json()["message"]
    recorded = [json.loads(x) for x in client.lrange(keys.REFUSALS_KEY, 0, -1)]
    assert len(recorded) == 49 and recorded[-1]["t"] >= now
    assert recorded[-1]["wait_ahead_s"] == pytest.approx(first, abs=1e-3)
    assert recorded[-1]["deadline_s"] == deadline


def test_refusals_of_several_deadline_bands_read_the_records_once_a_second(overloaded, api, lane_redis, service):
    """Two 429s in a row at deadlines of two bands: each band has its own fit, and both are made from
    one read of the refusals, answers and pending requests (``LRANGE`` counted by Redis itself:
    three per admission's own load read (answers, lone overheads of both regimes), two for the
    records, once)."""
    client, _ = lane_redis
    deadlines = (service.INTERACTIVE_DEADLINE_S, service.INTERACTIVE_DEADLINE_S / 2.5)
    assert wait_ahead.deadline_band(deadlines[0]) != wait_ahead.deadline_band(deadlines[1])
    client.config_resetstat()
    for i, deadline in enumerate(deadlines):
        r = api.post("/api/images/", {"files": [SimpleUploadedFile("a.jpg", jpeg_bytes(i), content_type="image/jpeg")],
                                      "deadline": deadline}, format="multipart")
        assert r.status_code == 429, r.content
        assert r.json()["extra"]["deadline_s"] == pytest.approx(deadline, abs=1e-3)
    assert client.info("commandstats")["cmdstat_lrange"]["calls"] == 2 * 3 + 2
    assert set(admission._wait_ahead_cache) == {wait_ahead.deadline_band(d) for d in deadlines}
    recorded = [json.loads(x) for x in client.lrange(keys.REFUSALS_KEY, 0, -1)]
    assert [x["deadline_s"] for x in recorded] == [pytest.approx(d, abs=1e-3) for d in deadlines]


def test_bulk_is_never_refused(overloaded, api):
    r = api.post("/api/jobs/", {"files": [SimpleUploadedFile("b.jpg", jpeg_bytes(2), content_type="image/jpeg")]},
                 format="multipart")
    assert r.status_code == 202
    assert Job.objects.get(id=r.json()["id"]).total == 1


def test_admission_can_be_switched_off(overloaded, service):
    service.ADMISSION_CONTROL = False
    assert admission.interactive_admit(deadline_s=0.5).admitted


# --- deadlines ------------------------------------------------------------------------------------

def test_an_expired_request_is_never_computed_through_the_task_path(service, api, monkeypatch):
    """The whole chain (upload → embed_interactive → index_interactive) with a deadline that has
    passed before the embed task runs: the model is never called and the image ends ``expired``."""
    encoder = runtime.encoder_holder().get()
    calls = []
    real = encoder.encode_images
    monkeypatch.setattr(encoder, "encode_images", lambda px: calls.append(len(px)) or real(px))
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("late.jpg", jpeg_bytes(3), content_type="image/jpeg")],
                                  "deadline": 0.000001}, format="multipart")
    assert r.status_code == 200, r.content
    im = r.json()["images"][0]
    assert (im["status"], im["reason"]) == (ImageStatus.EXPIRED, "expired")
    assert calls == []
    assert Image.objects.get(id=im["id"]).status == ImageStatus.EXPIRED
    assert runtime.vector_store().count() == 0
    # The same path with a live deadline does compute (the spy is on the real call path).
    r = api.post("/api/images/", {"files": [SimpleUploadedFile("ok.jpg", jpeg_bytes(4), content_type="image/jpeg")]},
                 format="multipart")
    assert r.json()["images"][0]["status"] == ImageStatus.EMBEDDED and calls == [1]

