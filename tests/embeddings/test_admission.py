"""Admission control on the interactive lane (embeddings/lane_control/admission.py, its pure wait model
in wait_model.py), deadlines, and migrations yielding to the lane (bulk_yield.py).

Real values throughout: the service time comes from the real ViT-B-32 (random weights) run through
the real dynamic batcher; the backlog is real Celery messages published to a private redis-server
at the lane's priorities and counted back from kombu's per-priority lists. The wait model's pure
functions (drain rate, fit, decision) take injected clocks and records.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shutil
import subprocess
import time

import cv2
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings import runtime, tasks  # noqa: F401 - registers the tasks the eager chains run by name
from embeddings.models import Image, ImageStatus, Job
from embeddings.lane_control import admission
from embeddings.lane_control import bulk_yield
from queueing import wait_ahead
from queueing import wait_model
from project import lanes
from scripts.stack import free_port, redis_answers
from tests.embeddings.conftest import celery_publishing_to

pytestmark = pytest.mark.django_db(transaction=True)


def jpeg_bytes(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (260, 200), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A private, empty redis-server for this module (never the machine's shared one)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    p = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(tmp_path_factory.mktemp("redis"))], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if redis_answers(url):
            break
        time.sleep(0.05)
    yield url
    p.terminate()
    p.wait(timeout=10)


@pytest.fixture
def lane_redis(redis_url, settings):
    """``settings.REDIS_URL`` → the private Redis, emptied; a Celery app that publishes to it with the
    project's transport options (priority steps, queue order)."""
    from celery import Celery

    settings.REDIS_URL = redis_url
    client = admission.redis_client()
    client.flushdb()
    admission._wait_ahead_cache = {}  # a web process's learnt 429s belong to its Redis
    admission._wait_ahead_records = (-math.inf, ([], [], []))
    app = Celery("admission-test", broker=redis_url, set_as_current=False)
    app.conf.broker_transport_options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    yield client, app
    app.close()
    client.flushdb()
    admission._wait_ahead_cache = {}
    admission._wait_ahead_records = (-math.inf, ([], [], []))


@pytest.fixture(scope="module")
def measured(encoder):
    """Batch records of the real model behind the real dynamic batcher: 3 lone requests, then 4
    concurrent ones (merged into one pass)."""
    from workers.batcher import DynamicBatcher
    from workers.preprocess import normalize

    b = DynamicBatcher(lambda px: encoder.encode_images(normalize(px, encoder.preprocess_config)),
                       max_batch_size=8, max_queue_delay_ms=50)
    px = torch_pixels(encoder)
    for _ in range(3):
        b.embed(px[:1])
    futs = [b.submit(px[i : i + 1]) for i in range(4)]
    for f in futs:
        f.result(timeout=60)
    b.close()
    return list(b.records)


def torch_pixels(encoder):
    import torch

    h, w = encoder.preprocess_config.size
    return torch.randint(0, 255, (4, 3, h, w), dtype=torch.uint8)


def publish(app, queue: str, priority: int, n: int = 1) -> None:
    for _ in range(n):
        app.send_task("embeddings.tasks.embed_interactive", args=([], 0.0), queue=queue, priority=priority)


# --- the prediction (pure: injected clocks and records) --------------------------------------------

def test_window_stats_from_the_real_model(measured):
    stats = admission.window_stats(measured)
    assert stats["batches"] == len([r for r in measured if r.size]) >= 2
    assert stats["ms_per_image"] == pytest.approx(sum(r.service_ms for r in measured) / sum(r.size for r in measured))
    assert stats["images_per_request"] == pytest.approx(1.0)  # every request here had one image
    assert max(r.size for r in measured) > 1  # the concurrent requests shared a pass
    assert stats["ms_per_image"] > 0


def test_drain_rate_is_images_over_the_union_of_busy_time():
    now = 1000.0
    tasks = [
        (now - 30, now - 29, 50),  # ended before the window: ignored
        (now - 9, now - 8, 4),  # busy 1 s
        (now - 8.5, now - 7, 4),  # overlaps the first: busy until now − 7 (2 s in all)
        (now - 5, now - 4.5, 2),  # busy 0.5 s more; idle gaps do not count
        (now - 12, now - 9.5, 3),  # started before the window: only its 0.5 s inside counts
    ]
    assert wait_model.drain_rate(tasks, now=now) == pytest.approx((4 + 4 + 2 + 3) / (2 + 0.5 + 0.5))
    assert wait_model.drain_rate(tasks[:1], now=now) is None  # nothing finished in the window
    assert wait_model.drain_rate([(now - 1, now - 0.99, 1)], now=now) is None  # under 50 ms busy: no figure
    # A machine that slows: the same worker drains 10 images/s, then 5 images/s for the last 10 s.
    history = [(now - 40 + i, now - 39 + i, 10) for i in range(30)] + [(now - 10 + i, now - 9 + i, 5) for i in range(10)]
    assert wait_model.drain_rate(history, now=now) == pytest.approx(5.0)


def answers_from(model, *, start: float, end: float, every: float = 0.1, seed: int = 0) -> list[dict]:
    """Answer records as the web writes them, one every ``every`` s, ``wait = model(t, work)`` ± 20 ms."""
    import random

    rng, out, t = random.Random(seed), [], start
    while t < end:
        work = rng.uniform(0.2, 1.8)
        wait = model(t, work) + rng.gauss(0, 0.02)
        out.append({"admitted": t - wait, "answered": t, "work_s": work, "status": 200, "images": 1})
        t += every
    return out


def test_fit_recovers_overhead_and_scale_and_ignores_old_answers():
    answers = answers_from(lambda t, w: 0.3 + 1.5 * w, start=0, end=30)
    fit = wait_model.fit_wait(answers, now=30)
    # the newest answers weigh most (~9 fresh answers in all) and the scale is pulled towards 1 a little
    assert fit.overhead_s == pytest.approx(0.3, abs=0.04) and fit.scale == pytest.approx(1.5, abs=0.04)
    assert 0 < fit.margin_s < 0.06  # the 95th percentile of ±20 ms noise
    assert fit.samples == 300
    assert wait_model.fit_wait(answers, now=100) == wait_model.WaitFit()  # all older than the window: the prior
    assert fit.age_s == pytest.approx(0.1, abs=1e-6)  # the newest answer, at 29.9 s
    # One answer: its wait is all overhead at scale 1 (the ridge pull to the workers' own figure).
    one = wait_model.fit_wait([{"admitted": 9.0, "answered": 10.0, "work_s": 0.5, "status": 200}], now=10)
    assert (one.overhead_s, one.scale, one.margin_s, one.samples, one.age_s) == (pytest.approx(0.5), pytest.approx(1.0), 0.0, 1, 0.0)


def test_fit_follows_a_machine_that_slows_within_seconds():
    """At t = 30 s something steals the cores: the same work takes twice as long. The prediction plus
    margin (what admission compares with the deadline) reaches the new truth within 3 s."""
    answers = answers_from(lambda t, w: 0.3 + (1.0 if t < 30 else 2.0) * w, start=0, end=40)
    truth = 0.3 + 2.0 * 1.5
    bound = lambda now: (f := wait_model.fit_wait([a for a in answers if a["answered"] <= now], now=now)).predict(1.5) + f.margin_s
    assert bound(29.95) == pytest.approx(0.3 + 1.5, abs=0.1)  # before: right, small margin
    assert bound(31) > 0.3 + 1.5 + 0.8  # one second later the margin has already grown by ~1 s
    assert bound(33) >= truth * 0.97
    late = wait_model.fit_wait(answers, now=40)
    # ten seconds (100 answers) later the fit itself has followed: the old answers weigh nothing
    assert late.scale == pytest.approx(2.0, abs=0.1) and late.predict(1.5) + late.margin_s >= truth * 0.97


def observations(model, n: int, *, start: float, every: float = 0.01, seed: int = 0) -> list[dict]:
    """``n`` answers ``every`` s apart (no time passes to speak of: only their count matters), work
    uniform in 0.2–1.8 s, ``wait = model(work)`` × (1 ± 2 %)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        t, work = start + i * every, rng.uniform(0.2, 1.8)
        wait = model(work) * (1 + rng.uniform(-0.02, 0.02))
        out.append({"admitted": t - wait, "answered": t, "work_s": work, "status": 200, "images": 1})
    return out


def as_admitted(answers: list[dict]) -> list[dict]:
    """The same answers with the ``predicted_s`` the web would have recorded: each one predicted by
    the fit of the answers before it (as if admitted just after the previous answer)."""
    out = []
    for a in answers:
        out.append({**a, "predicted_s": wait_model.fit_wait(out, now=a["answered"]).predict(a["work_s"])})
    return out


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_the_prediction_follows_a_service_time_that_doubles(factor):
    """The whole service time doubles (a second process takes the cores; or halves: it stops): the
    answers say so one by one, with no time passing. Within 4 answers the prediction plus margin
    (what admission compares with the deadline) covers a doubled wait; within 64 the prediction is
    the new wait ± 10 % and the scale the new one ± 15 %, and within 160 the errors made during the
    change have left the margin; a speed-up never widens the margin (it is one-sided). Observation
    counts, not seconds: under load that is a few seconds (64 answers: 8–10 s at this 2-core
    machine's 6–8 answers/s), whatever the answer rate.

    The price of the 16-answer half-lives (``FIT_HALF_LIFE_ANSWERS``, ``MARGIN_HALF_LIFE_ANSWERS``;
    with 6 and 8 the prediction was within 10 % after 24 answers and the margin clear after 64): a
    step change is followed more slowly, in exchange for a fit that under a cycling overload still
    knows the last peak and a margin that one bad prediction does not set alone
    (docs/benchmarks-load.md, "Half-lives and the margin")."""
    before = lambda w: 0.2 + 1.0 * w
    after = lambda w: factor * before(w)
    answers = as_admitted(observations(before, 60, start=0.0) + observations(after, 160, start=0.6, seed=1))
    fit = lambda k: wait_model.fit_wait(answers[:60 + k], now=0.6 + 0.01 * k)
    work = 1.0
    assert fit(0).predict(work) == pytest.approx(before(work), rel=0.03) and fit(0).margin_s < 0.05
    if factor > 1:  # slower: admission must stop over-admitting at once
        assert fit(4).predict(work) + fit(4).margin_s >= 0.95 * after(work)
    assert fit(64).predict(work) == pytest.approx(after(work), rel=0.10)
    assert fit(64).scale == pytest.approx(factor, rel=0.15)
    assert fit(160).margin_s < 0.1 * after(work)  # the errors made during the change fade from the margin
    if factor < 1:  # faster: every answer is early, and early answers never widen the margin
        assert max(fit(k).margin_s for k in (4, 16, 64)) <= fit(0).margin_s


def test_a_request_still_waiting_past_its_prediction_counts_before_its_answer():
    """The machine slows at t = 60.6: the requests admitted then are not answered yet, but each one
    that has waited longer than predicted is a lower bound of its wait. Admission sees them at once
    (prediction + margin up), not a whole (longer) wait later. One within its prediction says
    nothing; one past its deadline is left out (answered 202 soon, or it failed and never will be)."""
    answers = as_admitted(observations(lambda w: 0.2 + w, 60, start=0.0))
    now = 61.5
    base = wait_model.fit_wait(answers, now=now)
    late = [{"admitted": now - 1.5, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0},
            {"admitted": now - 1.4, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0}]
    seen = wait_model.fit_wait(answers, now=now, pending=late)
    assert seen.samples == base.samples + 2
    assert seen.predict(0.5) + seen.margin_s >= 1.4 > base.predict(0.5) + base.margin_s
    on_time = [{"admitted": now - 0.3, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0}]
    expired = [{"admitted": now - 3.5, "work_s": 0.5, "predicted_s": 0.7, "deadline_s": 2.0}]
    assert wait_model.fit_wait(answers, now=now, pending=on_time + expired) == base


def test_work_is_counted_in_forward_passes_at_the_measured_batch_times():
    """A worker measured 300 ms for one image and 550 ms for eight: a backlog of eight drains in one
    pass of eight, not eight of one; sizes between are interpolated, sizes below the smallest cost
    that size's pass, above the largest proportionally more (both err long)."""
    curve = {1: 300.0, 8: 550.0}
    assert wait_model.batch_ms(curve, 4) == pytest.approx(300 + 250 * 3 / 7)
    assert wait_model.batch_ms({4: 400.0}, 1) == 400.0 and wait_model.batch_ms({4: 400.0}, 6) == 600.0
    assert wait_model.drain_s(curve, 8, 8) == pytest.approx(0.55)
    assert wait_model.drain_s(curve, 17, 8) == pytest.approx(2 * 0.55 + 0.3)
    assert wait_model.drain_s(curve, 0, 8) == 0.0
    load = wait_model.LaneLoad(queued_messages=7, inflight_images=0, capacity_ips=1000 / 300, workers=1,
                               curves=((curve, 8),))
    assert load.work_s(1) == pytest.approx(0.55)  # the drain rate alone would say 8 × 0.3 s
    assert dataclasses.replace(load, curves=()).work_s(1) == pytest.approx(8 * 0.3)
    # two workers, one twice as fast at full batches: the images are shared by rate, the waits agree
    two = dataclasses.replace(load, queued_messages=23, workers=2, curves=((curve, 8), ({1: 150.0, 8: 275.0}, 8)))
    assert two.work_s(1) == pytest.approx(wait_model.drain_s(curve, 8, 8), rel=1e-6)


def test_a_running_pass_counts_as_the_time_it_has_left():
    """Eight images in flight, all in one pass of eight (550 ms expected) started 450 ms ago: a
    request arriving now waits the 0.1 s that pass has left and then its own pass of one (0.3 s),
    not a whole second pass of eight first. Two images in flight but outside the running pass
    (decoding, waiting for the model) join the next pass with it."""
    curve = {1: 300.0, 8: 550.0}
    now = 1000.0
    passes, stale = wait_model.running_passes({"w:1:m": f"8 {now - 0.45:.3f} 550.0"}, now=now, stale_s=60)
    assert passes == (pytest.approx((8, 0.1)),) and stale == []
    load = wait_model.LaneLoad(queued_messages=0, inflight_images=8, capacity_ips=1000 / 300, workers=1,
                               curves=((curve, 8),), passes=passes)
    assert load.work_s(1) == pytest.approx(0.1 + 0.3)
    assert load.work_s(0) == pytest.approx(0.1)  # the work ahead of it: the rest of that pass
    assert dataclasses.replace(load, passes=()).work_s(1) == pytest.approx(0.55 + 0.3)  # counted whole
    outside = dataclasses.replace(load, inflight_images=10)
    assert outside.work_s(1) == pytest.approx(0.1 + wait_model.batch_ms(curve, 3) / 1000)
    # without per-batch-size times: the rest at the drain rate, after the running pass
    assert dataclasses.replace(outside, curves=()).work_s(1) == pytest.approx(0.1 + 3 * 0.3)
    # a pass that overran its expected time is about to end: 0 s left, its images still not ahead
    late, _ = wait_model.running_passes({"w:1:m": f"8 {now - 0.9:.3f} 550.0"}, now=now, stale_s=60)
    assert late == ((8, 0.0),) and dataclasses.replace(load, passes=late).work_s(1) == pytest.approx(0.3)
    # an expected time not measured yet (0) says nothing: the images count whole, as before
    unknown, _ = wait_model.running_passes({"w:1:m": f"8 {now - 0.1:.3f} 0.0"}, now=now, stale_s=60)
    assert unknown == ()
    # a dead worker's pass, or a garbled entry, is stale: ignored and returned for deletion
    gone, stale = wait_model.running_passes({"dead": f"8 {now - 120:.3f} 550.0", "bad": "x"}, now=now, stale_s=60)
    assert gone == () and sorted(stale) == ["bad", "dead"]


def test_the_images_that_arrive_before_a_requests_pass_starts_join_it():
    """A pass costs 100 ms + 200 ms an image (the AVX2 EPYC's shape: batching barely helps). A pass
    of one runs with 0.5 s left and two requests wait for the next: a request arriving now joins
    them, and so do the 4 images/s admitted behind it until that pass starts (0.5 s: two more), a
    pass of five (1.1 s), not three (0.7 s). The joiners fill the last pass only up to the largest
    batch; full passes ahead delay the last one's start, so more join it; an empty lane (nothing
    running) starts its pass at once: nobody joins."""
    curve = {1: 300.0, 8: 1700.0}
    load = wait_model.LaneLoad(queued_messages=0, inflight_images=3, capacity_ips=1000 / 300, workers=1,
                               curves=((curve, 8),), passes=((1, 0.5),), arrivals_ips=4.0)
    assert load.work_s(1) == pytest.approx(0.5 + wait_model.batch_ms(curve, 5) / 1000)
    alone = dataclasses.replace(load, arrivals_ips=0.0)
    assert alone.work_s(1) == pytest.approx(0.5 + wait_model.batch_ms(curve, 3) / 1000)
    assert dataclasses.replace(load, arrivals_ips=40.0).work_s(1) == pytest.approx(0.5 + 1.7)  # at most a full pass
    assert wait_model.drain_s(curve, 9, 8, arrivals_ips=2.0, start_s=0.5) == pytest.approx(
        1.7 + wait_model.batch_ms(curve, 1 + 2.0 * (0.5 + 1.7)) / 1000)
    assert wait_model.drain_s(curve, 8, 8, arrivals_ips=2.0, start_s=0.5) == pytest.approx(1.7)  # no partial pass
    empty = dataclasses.replace(load, inflight_images=0, passes=())
    assert empty.work_s(1) == pytest.approx(0.3)
    # lane_load: the requests admitted in the last 2 s (answered or pending) × images per request, per second
    now = 1000.0
    entry = json.dumps({"capacity_ips": 2.0, "images_per_request": 2.0, "updated": now - 1})
    answered = [json.dumps({"admitted": now - a, "answered": now - a + 0.8, "work_s": 0.7, "predicted_s": 0.8,
                            "status": 200, "images": 2, "ahead": 1}) for a in (3.0, 1.5, 1.0)]
    pending = [json.dumps({"admitted": now - 0.2, "work_s": 0.7, "predicted_s": 0.7, "deadline_s": 1.0})]
    assert wait_model.lane_load(queued_messages=0, inflight_images=0, workers={"w": entry}, answers=answered,
                                pending=pending, now=now).arrivals_ips == pytest.approx(3 * 2.0 / 2.0)


def test_the_batcher_reports_each_pass_to_admission(lane_redis, encoder, tracker):
    """The real dynamic batcher's hook writes the running pass (images, start, expected ms at this
    worker's curve) while the model computes, and clears it after; admission reads it in its round
    trip. A hook that raises never stops the model thread."""
    from workers.batcher import DynamicBatcher
    from workers.preprocess import normalize

    client, _ = lane_redis
    seen: list[tuple[int, str | None, int]] = []
    tracker.curve = {1: 250.0, 4: 400.0}

    def run_batch(px):
        seen.append((len(px), client.hget(admission.PASSES_KEY, "me"), len(admission.interactive_load().passes)))
        return encoder.encode_images(normalize(px, encoder.preprocess_config))

    b = DynamicBatcher(run_batch, max_batch_size=4, max_queue_delay_ms=100,
                       on_pass=lambda n, at: admission.interactive_pass("me", n, at))
    px = torch_pixels(encoder)
    before = time.time()
    futs = [b.submit(px[i : i + 1]) for i in range(3)]
    vectors = [f.result(timeout=60) for f in futs]
    assert [v.shape for v in vectors] == [(1, encoder.embed_dim)] * 3
    (size, raw, read), = seen
    images, started, expected = raw.split()
    assert (size, int(images), float(expected), read) == (3, 3, pytest.approx(wait_model.batch_ms(tracker.curve, 3), abs=0.1), 1)
    assert before <= float(started) <= time.time()
    # cleared when the pass ended: the model thread hands out the vectors first, then clears it
    stop = time.monotonic() + 5
    while client.hexists(admission.PASSES_KEY, "me") and time.monotonic() < stop:
        time.sleep(0.01)
    assert not client.hexists(admission.PASSES_KEY, "me")
    b.close()

    def broken(n, at):
        raise RuntimeError("metrics down")

    b = DynamicBatcher(lambda px: encoder.encode_images(normalize(px, encoder.preprocess_config)),
                       max_batch_size=4, max_queue_delay_ms=1, on_pass=broken)
    assert b.embed(px[:1]).shape == (1, encoder.embed_dim)
    b.close()


def test_a_workers_batch_times_follow_a_forward_pass_that_doubles():
    """Per batch size, an EWMA of the forward pass (weight 0.3): the machine slows to twice the time;
    within 7 passes of a size its figure is over 90 % of the way there, and other sizes keep theirs."""
    from workers.batcher import BatchRecord

    rec = lambda size, ms: BatchRecord(size=size, requests=size, queue_delay_ms=1.0, service_ms=ms, expired=0)
    curve = wait_model.update_batch_curve({}, [rec(1, 300.0), rec(8, 550.0), rec(0, 0.0)])
    assert curve == {1: 300.0, 8: 550.0}  # an empty batch (all expired) measures nothing
    for k in range(1, 8):
        curve = wait_model.update_batch_curve(curve, [rec(8, 1100.0)])
        if k == 3:
            assert curve[8] > 550 + 0.6 * 550
    assert curve[8] > 550 + 0.9 * 550 and curve[1] == 300.0


def test_retry_after_is_the_wait_ahead_rounded_up_to_whole_seconds():
    """RFC 9110 delay-seconds: an integer ≥ 1 s, never below the predicted wait of the work ahead
    (to the millisecond: 1.0004 s is 1 s), so a client that waits it never retries too early."""
    assert [wait_model.retry_after(w) for w in (0.0, 0.3, 1.0, 1.0004, 1.001, 1.5, 4.2, 12.0)] == \
        [1, 1, 1, 1, 2, 2, 5, 12]


def test_a_margin_learnt_in_a_bad_moment_fades_when_no_new_answer_comes():
    """Answers with a wide spread (some waited 1 s longer than predicted), then nothing: the margin
    shrinks with the evidence's weight, so admission cannot refuse everything forever."""
    answers = answers_from(lambda t, w: 0.3 + w + (1.0 if round(t * 2) % 5 == 0 else 0.0), start=0, end=5, every=0.5)
    fresh, old = wait_model.fit_wait(answers, now=5), wait_model.fit_wait(answers, now=20)
    assert fresh.margin_s > 0.6  # every fifth answer 1 s late: the 95th percentile sees them
    assert old.margin_s < 0.5 * fresh.margin_s  # fifteen seconds of silence later
    assert wait_model.fit_wait(answers, now=5 + wait_model.FIT_WINDOW_S + 0.1) == wait_model.WaitFit()


def test_a_202_counts_as_a_longer_wait():
    base = {"admitted": 8.0, "answered": 10.0, "work_s": 1.0}
    ok = wait_model.fit_wait([{**base, "status": 200}], now=10)
    late = wait_model.fit_wait([{**base, "status": 202}], now=10)
    assert ok.predict(1.0) == pytest.approx(2.0) and late.predict(1.0) == pytest.approx(2.0 * wait_model.CENSORED_FACTOR)


def test_decide_refuses_exactly_when_the_predicted_wait_plus_margin_exceeds_the_deadline():
    decide = functools.partial(wait_model.decide, min_margin_share=0.0)  # the learnt margin alone
    fit = wait_model.WaitFit(overhead_s=0.2, scale=1.25, margin_s=0.1, samples=50)
    capacity, deadline = 8.0, 2.0
    # largest backlog B with 0.2 + 1.25 (B + 1) / 8 + 0.1 <= 2  →  B + 1 <= 10.88
    fits = wait_model.LaneLoad(queued_messages=9, inflight_images=0, capacity_ips=capacity, fit=fit)
    ok = decide(fits, deadline_s=deadline)
    assert ok.admitted and ok.predicted_wait_s == pytest.approx(0.2 + 1.25 * 10 / 8) and ok.work_s == pytest.approx(10 / 8)
    over = wait_model.LaneLoad(queued_messages=9, inflight_images=1, capacity_ips=capacity, fit=fit)
    refused = decide(over, deadline_s=deadline)
    assert not refused.admitted and refused.predicted_wait_s == pytest.approx(0.2 + 1.25 * 11 / 8)
    # the admission edge, the longest predicted wait admitted: 2 − 0.1 = 1.9 s (the work ahead,
    # 0.2 + 1.25 × 10 / 8 = 1.76 s, goes in the body), plus its margin (0.1 s), rounded up
    assert refused.wait_ahead_s == pytest.approx(1.9) and refused.wait_ahead_from == "edge"
    assert refused.work_ahead_wait_s == pytest.approx(1.7625) and refused.retry_margin_s == pytest.approx(0.1)
    assert refused.retry_after_s == 2
    # Requests of several images weigh more, queued and arriving; unknown capacity admits.
    assert not decide(dataclasses.replace(fits, images_per_request=2.0), deadline_s=deadline).admitted
    assert not decide(fits, deadline_s=deadline, images=2).admitted
    assert decide(wait_model.LaneLoad(10_000, 0, None), deadline_s=deadline).admitted
    # Retry-After is never 0, and follows a long backlog.
    assert decide(dataclasses.replace(fits, queued_messages=1, fit=wait_model.WaitFit(margin_s=5)),
                  deadline_s=0.2).retry_after_s == 1  # 0.125 s + a margin capped at 0.4 × 0.2 s
    # An empty lane admits whatever the margin, unless the request alone is predicted to miss.
    empty = dataclasses.replace(fits, queued_messages=0, fit=wait_model.WaitFit(margin_s=5))
    assert decide(empty, deadline_s=deadline).admitted
    fresh = wait_model.WaitFit(margin_s=5, age_s=1.0)
    assert not decide(dataclasses.replace(empty, capacity_ips=0.4, fit=fresh), deadline_s=deadline).admitted
    # ... and once the newest answer is stale, it admits a probe whatever the prediction: only an
    # answer can tell the model that the machine got faster again (the prior has no answer: a probe).
    stale = dataclasses.replace(fresh, age_s=wait_model.PROBE_AFTER_S + 0.1)
    assert decide(dataclasses.replace(empty, capacity_ips=0.4, fit=stale), deadline_s=deadline).admitted
    assert not decide(dataclasses.replace(fits, capacity_ips=0.4, fit=stale), deadline_s=deadline).admitted
    # A backlog far beyond the edge (a lane filled by longer deadlines): no request of this deadline
    # is admitted until it has drained to the edge, predicted wait − edge; Retry-After follows it.
    deep = decide(dataclasses.replace(fits, queued_messages=79), deadline_s=deadline)  # 0.2 + 1.25 × 80 / 8 = 12.7 s
    assert deep.wait_ahead_from == "drain" and deep.wait_ahead_s == pytest.approx(12.7 - 1.9)
    assert deep.retry_after_s == 11  # ⌈10.8 + 0.1⌉
    assert decide(dataclasses.replace(fits, queued_messages=70), deadline_s=deadline).retry_after_s == 10  # 9.39 + 0.1 s
    # A pass of two images nearly done (0.02 s left) with a 0.3 s margin: little work is ahead, but
    # the next request admitted waits its own pass; wait_ahead_s is never less than that. At a 0.6 s
    # deadline the edge is 0.6 − 0.24 (the margin's cap, 0.4 × the deadline) = 0.36 s, above it; at
    # 0.5 s it is 0.3 s, below: the floor.
    lone = wait_model.LaneLoad(queued_messages=0, inflight_images=2, capacity_ips=1 / 0.3, workers=1,
                               curves=(({1: 300.0, 8: 550.0}, 8),), passes=((2, 0.02),),
                               fit=wait_model.WaitFit(overhead_s=0.05, scale=1.0, margin_s=0.3, samples=50))
    d = decide(lone, deadline_s=0.6)
    assert not d.admitted and d.predicted_wait_s == pytest.approx(0.05 + 0.02 + 0.3)
    assert d.wait_ahead_s == pytest.approx(0.36) and d.wait_ahead_from == "edge"
    d = decide(lone, deadline_s=0.5)
    assert d.wait_ahead_s == pytest.approx(0.05 + 0.3) and d.wait_ahead_from == "alone"  # not the work ahead, 0.07 s
    assert decide(dataclasses.replace(lone, passes=((2, 0.25),)), deadline_s=0.5).wait_ahead_s \
        == pytest.approx(0.05 + 0.3)  # more left, still under a lone pass: the floor
    backlog = decide(dataclasses.replace(lone, queued_messages=8, inflight_images=8, passes=((8, 0.5),)),
                     deadline_s=0.6)  # predicted 0.05 + 0.5 left + a pass of eight 0.55 + its own 0.3 = 1.4 s
    assert backlog.wait_ahead_from == "drain" and backlog.wait_ahead_s == pytest.approx(1.4 - 0.36)
    assert backlog.work_ahead_wait_s == pytest.approx(0.05 + 0.5 + 0.55)


def test_a_shallow_lane_admits_whatever_the_margin_when_the_wait_alone_fits():
    """``SHALLOW_REQUESTS`` (1): with at most one request's images ahead, the margin (learnt in a
    bad moment: 0.3 s) is not applied; the predicted wait alone still is. Two requests ahead: the
    margin is. A lane of two-image requests counts requests, not images."""
    assert wait_model.SHALLOW_REQUESTS == 1
    fit = wait_model.WaitFit(overhead_s=0.05, scale=1.0, margin_s=0.3, samples=50)
    lane = lambda inflight, per_request=1.0: wait_model.LaneLoad(
        queued_messages=0, inflight_images=inflight, capacity_ips=1 / 0.3, workers=1, images_per_request=per_request,
        curves=(({1: 300.0, 2: 350.0, 8: 550.0}, 8),), passes=((inflight, 0.1),) if inflight else (), fit=fit)
    one = wait_model.decide(lane(1), deadline_s=0.6)  # 0.05 + 0.1 left + 0.3 own pass = 0.45 s; + 0.3 > 0.6
    assert one.admitted and one.predicted_wait_s == pytest.approx(0.45) and one.ahead_images == 1
    assert not wait_model.decide(lane(1), deadline_s=0.4).admitted  # the wait alone misses: refused
    two = wait_model.decide(lane(2), deadline_s=0.6)  # the same wait, two requests ahead: the margin applies
    assert not two.admitted and two.predicted_wait_s == pytest.approx(0.45) and two.margin_s == pytest.approx(0.24)
    assert wait_model.decide(lane(2, per_request=2.0), deadline_s=0.6).admitted  # one request of two images ahead


def test_the_margin_is_never_less_than_a_share_of_the_predicted_wait():
    """ADMISSION_MIN_MARGIN_SHARE: a learnt margin of 0.1 s is raised to 0.2 × the predicted wait.
    At a 5 s deadline the largest admitted wait is then 5 / 1.2 = 4.17 s, not 4.9 s; at 0.4 s the
    floor (0.08 s) is below the learnt margin and changes nothing."""
    fit = wait_model.WaitFit(overhead_s=0.0, scale=1.0, margin_s=0.1, samples=50)
    assert wait_model.margin_s(fit, 4.0, min_share=0.2) == pytest.approx(0.8)
    assert wait_model.margin_s(fit, 0.4, min_share=0.2) == pytest.approx(0.1)
    lane = lambda backlog: wait_model.LaneLoad(queued_messages=backlog, inflight_images=0, capacity_ips=2.0, fit=fit)
    # predicted wait = (backlog + 1) / 2 s: 3.5 s admits either way (3.5 + 0.7 <= 5); 4.5 s only
    # with the learnt margin alone (4.5 + 0.1 <= 5 < 4.5 + 0.9)
    assert wait_model.decide(lane(6), deadline_s=5.0, min_margin_share=0.2).admitted
    assert not wait_model.decide(lane(8), deadline_s=5.0, min_margin_share=0.2).admitted
    assert wait_model.decide(lane(8), deadline_s=5.0, min_margin_share=0.0).admitted
    assert settings.ADMISSION_MIN_MARGIN_SHARE == 0.2 and not wait_model.decide(lane(8), deadline_s=5.0).admitted


def test_the_margin_is_never_more_than_a_share_of_the_deadline():
    """ADMISSION_MAX_MARGIN_SHARE (0.4): a burst of late answers at the start of an overload taught a
    margin of 0.9 s at a 1 s deadline; capped at 0.4 s, a request predicted 0.55 s is admitted (it
    would have been refused for anything but an empty lane), one predicted 0.65 s is not."""
    fit = wait_model.WaitFit(overhead_s=0.0, scale=1.0, margin_s=0.9, samples=50)
    assert wait_model.margin_s(fit, 0.5, min_share=0.2, max_s=0.4) == pytest.approx(0.4)
    assert wait_model.margin_s(fit, 0.5, min_share=0.2) == pytest.approx(0.9)
    lane = lambda backlog: wait_model.LaneLoad(queued_messages=backlog, inflight_images=0, capacity_ips=20.0, fit=fit)
    assert settings.ADMISSION_MAX_MARGIN_SHARE == 0.4
    assert wait_model.decide(lane(10), deadline_s=1.0).admitted  # 11 / 20 = 0.55 s
    refused = wait_model.decide(lane(12), deadline_s=1.0)  # 0.65 s
    assert not refused.admitted and refused.margin_s == pytest.approx(0.4)


def test_an_overhead_prior_keeps_bunched_answers_from_moving_the_intercept():
    """Under a steady overload every answer has about the same work ahead (0.48-0.52 s): the data
    fix ``overhead + scale × 0.5`` and little else. Here the machine is 1.4 × slower than the
    workers' figure, with 0.05 s of overhead. Without a prior the ridge keeps the scale near 1 and
    the overhead absorbs the rest (0.25 s); a lone request (0.15 s of work) is then predicted
    0.40 s where it waits 0.26 s. Pulled to the overhead lone requests measured (0.05 s), the
    scale takes it and the lone request is predicted within 10 %; the loaded one stays right."""
    truth = lambda w: 0.05 + 1.4 * w
    rows = [(0.48 + 0.04 * (i % 5) / 4, truth(0.48 + 0.04 * (i % 5) / 4), 1.0) for i in range(20)]
    a, c = wait_model._solve(rows)
    assert a + c * 0.15 > 1.4 * truth(0.15)
    a, c = wait_model._solve(rows, overhead_prior_s=0.05)
    assert a + c * 0.15 == pytest.approx(truth(0.15), rel=0.10)
    assert a + c * 0.5 == pytest.approx(truth(0.5), rel=0.02)


def test_a_202_enters_the_margin_with_its_wait_not_the_censored_factor():
    """A 202 waited at least its deadline: the fit takes CENSORED_FACTOR × that (it waited longer),
    but the margin takes the wait itself, since a squared 1.25 × error set the margin alone."""
    now = 100.0
    answers = [{"admitted": now - 5 + 0.2 * i, "answered": now - 5 + 0.2 * i + 0.6, "work_s": 0.5,
                "predicted_s": 0.6, "status": 200} for i in range(20)]
    answers.append({"admitted": now - 1.0, "answered": now, "work_s": 0.5, "predicted_s": 0.75, "status": 202})
    fit = wait_model.fit_wait(answers, now=now)
    recent = sorted(answers, key=lambda r: r["answered"])
    n = len(recent)
    weights = [0.5 ** ((now - r["answered"]) / wait_model.MARGIN_HALF_LIFE_S) * 0.5 ** ((n - 1 - i) / wait_model.MARGIN_HALF_LIFE_ANSWERS)
               for i, r in enumerate(recent)]
    errors = [(r["answered"] - r["admitted"]) - r["predicted_s"] for r in recent]  # the 202's: 1.0 - 0.75
    total = sum(0.5 ** ((now - r["answered"]) / wait_model.MARGIN_HALF_LIFE_S) for r in recent)
    expected = wait_model._upper_bound(errors, weights, 0.99) * total / (total + wait_model.MARGIN_PRIOR_WEIGHT)
    assert fit.margin_s == pytest.approx(expected, rel=1e-6)
    assert fit.predict(0.5) > 0.6  # and the fit still heard that it waited longer


def test_capacity_is_summed_over_live_workers():
    now = 500.0
    entry = lambda cap, age: json.dumps({"capacity_ips": cap, "images_per_request": 1.0, "updated": now - age})
    load = wait_model.lane_load(queued_messages=0, inflight_images=0, answers=[], now=now,
                                workers={"a": entry(6.0, 1), "b": entry(4.0, 14), "dead": entry(9.0, 16)})
    assert (load.capacity_ips, load.workers) == (10.0, 2)
    assert wait_model.lane_load(queued_messages=0, inflight_images=0, answers=[], now=now,
                                workers={"dead": entry(9.0, 16)}).capacity_ips is None


# --- what Redis holds -----------------------------------------------------------------------------

def test_backlog_is_counted_across_kombus_priority_lists(lane_redis):
    client, app = lane_redis
    for priority in (0, 3, 6, 9):
        publish(app, lanes.INTERACTIVE, priority, n=2)
    publish(app, lanes.BULK, 9, n=5)  # another lane: not interactive backlog
    keys = admission.queue_keys(lanes.INTERACTIVE)
    assert keys[0] == lanes.INTERACTIVE and all(k.startswith(lanes.INTERACTIVE + "\x06\x16") for k in keys[1:])
    assert {k for k in client.keys(lanes.INTERACTIVE + "*")} == set(keys)  # what kombu really wrote
    load = admission.interactive_load()
    assert (load.queued_messages, load.inflight_images, load.capacity_ips) == (8, 0, None)


def test_vectors_worker_sees_only_interactive_messages_waiting_on_its_queue(lane_redis):
    """What a bulk chunk's write looks at between slices: step-0 messages of the ``vectors`` queue
    (searches, interactive writes), never bulk writes at 6/9 nor other lanes."""
    client, app = lane_redis
    assert admission.vectors_interactive_waiting() == 0
    for queue, priority, n in ((lanes.VECTORS, 9, 4), (lanes.VECTORS, 6, 2), (lanes.INTERACTIVE, 0, 3),
                               (lanes.VECTORS, 0, 2)):
        for _ in range(n):
            app.send_task("embeddings.tasks.index_chunk", args=("job", None, []), queue=queue, priority=priority)
    assert admission.vectors_interactive_waiting() == 2
    assert admission.vectors_interactive_waiting(client) == client.llen(lanes.VECTORS) == 2


@pytest.fixture
def tracker():
    """A fresh per-process tracker (finished tasks, last entry) for this test."""
    admission._tracker.cache_clear()
    yield admission._tracker()
    admission._tracker().heartbeat_stop.set()
    admission._tracker.cache_clear()


def test_worker_reports_batches_its_capacity_and_in_flight_work(lane_redis, measured, tracker):
    client, _ = lane_redis
    assert admission.interactive_report(measured, worker="w1") == len(measured)
    assert admission.interactive_report(measured, worker="w1") == 0  # nothing new: nothing sent twice
    stats = admission.window_stats(measured)
    load = admission.interactive_load()
    # no finished task yet: the forward pass alone gives the first figure
    assert load.capacity_ips == pytest.approx(1000 / stats["ms_per_image"], rel=1e-3) and load.workers == 1
    assert load.images_per_request == pytest.approx(stats["images_per_request"], rel=1e-3)
    entry = json.loads(client.hget(admission.WORKERS_KEY, "w1"))
    assert entry["max_batch"] == admission._max_batch()
    assert {int(k): v for k, v in entry["batch_ms"].items()} == pytest.approx(wait_model.update_batch_curve({}, measured), abs=0.01)
    assert load.curves and load.work_s(1) == pytest.approx(wait_model.drain_s(wait_model.update_batch_curve({}, measured), 1, entry["max_batch"]), rel=1e-3)
    records = admission.batch_records()
    assert [r["size"] for r in records] == [r.size for r in measured]
    assert {"t", "size", "requests", "queue_delay_ms", "service_ms", "expired"} <= set(records[0])
    with admission.interactive_in_flight("task-a", 5), admission.interactive_in_flight("task-b", 2):
        assert admission.interactive_load().inflight_images == 7
        time.sleep(0.1)
    assert admission.interactive_load().inflight_images == 0
    # the two tasks finished: 7 images in ~0.1 s of busy time is the worker's drain rate now
    assert [n for *_, n in tracker.tasks] == [2, 5]
    admission.interactive_report(measured, worker="w1")
    rate = admission.interactive_load().capacity_ips
    assert rate == pytest.approx(wait_model.drain_rate(tracker.tasks, now=time.time()), rel=0.05)
    assert 7 / 0.5 < rate <= 7 / 0.1
    # A task whose worker died long ago no longer counts, and is cleaned away.
    client.hset(admission.INFLIGHT_KEY, "dead-task", f"16 {time.time() - 3600:.3f}")
    assert admission.interactive_load().inflight_images == 0
    assert not client.hexists(admission.INFLIGHT_KEY, "dead-task")


def test_two_workers_admit_twice_the_load_of_one_at_the_same_predicted_wait(lane_redis, measured, tracker):
    """Issue 11, item 5: each worker reports its own capacity under its own name (they used to
    overwrite one figure); the web sums the live ones. Two workers each draining 8 images/s: the
    backlog admitted doubles, at the same predicted wait, and a worker that stops reporting stops counting."""
    client, app = lane_redis
    now = time.time()
    tracker.finished(now - 2.0, now - 1.0, 8)  # this process drained 8 images in 1 s busy: 8 images/s

    def admitted_backlog() -> tuple[int, float]:
        """Publish one request at a time until admission refuses; the backlog and the last admitted wait."""
        client.delete(*admission.queue_keys(lanes.INTERACTIVE))
        n, last = 0, None
        while True:
            decision = wait_model.decide(admission.interactive_load(), deadline_s=2.0)
            if not decision.admitted:
                return n, last
            last = decision.predicted_wait_s
            publish(app, lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE)
            n += 1

    admission.interactive_report(measured, worker="celery@one")
    one = admitted_backlog()
    admission.interactive_report(measured, worker="celery@two")  # a second worker, same measured figure
    load = admission.interactive_load()
    assert (load.capacity_ips, load.workers) == (pytest.approx(16.0), 2)
    two = admitted_backlog()
    # admitted while the forward passes of (backlog + its own image), shared between the workers, fit in 2 s
    assert one[0] >= 1 and two[0] in (2 * one[0], 2 * one[0] + 1)  # twice the images (± the split of an odd one)
    assert max(one[1], two[1]) <= 2.0 and two[1] == pytest.approx(one[1], rel=0.15)  # about the same wait
    # worker two's heartbeat stops: after WORKER_TTL_S its capacity no longer counts
    entry = json.loads(client.hget(admission.WORKERS_KEY, "celery@two"))
    client.hset(admission.WORKERS_KEY, "celery@two",
                json.dumps({**entry, "updated": time.time() - wait_model.WORKER_TTL_S - 1}))
    assert admitted_backlog()[0] == one[0]


def test_the_heartbeat_keeps_an_idle_worker_counted(lane_redis, measured, tracker, monkeypatch):
    client, _ = lane_redis
    monkeypatch.setattr(admission, "HEARTBEAT_S", 0.05)
    admission.interactive_report(measured, worker="celery@idle", heartbeat=True)
    first = json.loads(client.hget(admission.WORKERS_KEY, "celery@idle"))["updated"]
    time.sleep(0.3)
    later = json.loads(client.hget(admission.WORKERS_KEY, "celery@idle"))
    assert later["updated"] > first
    assert later["capacity_ips"] == pytest.approx(1000 / admission.window_stats(measured)["ms_per_image"], rel=1e-3)


def test_answers_feed_the_fit_in_the_same_round_trip(lane_redis, measured, tracker):
    client, _ = lane_redis
    admission.interactive_report(measured, worker="w")
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
    client.hset(admission.PENDING_KEY, "tok", json.dumps({"admitted": time.time() - 1.5, "work_s": 0.5,
                                                          "predicted_s": 0.6, "deadline_s": 2.0}))
    assert admission.interactive_load().fit.samples == 5
    admission.interactive_answered(wait_model.Decision(True, 0.6, work_s=0.5, admitted_at=time.time() - 1.6,
                                                       token="tok"), images=1, status=200)
    assert not client.hexists(admission.PENDING_KEY, "tok") and len(admission.answer_records()) == 5



@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), max_size=6),
       st.lists(st.integers(0, 40), max_size=2), st.integers(0, 40), st.integers(0, 40))
def test_the_bulk_overlap_of_a_wait_is_the_union_of_the_computing_intervals_within_it(runs, computing, a, b):
    """``bulk_overlap_s`` against counting, on a 0.1 s grid, the instants of ``[start, end]``
    covered by a finished interval or by a chunk computing since ``since`` (until ``end``)."""
    start, end = min(a, b) / 10, max(a, b) / 10
    intervals = [(s / 10, (s + d) / 10) for s, d in runs]
    covered = sum(any(lo <= (t + 0.5) / 10 < hi for lo, hi in [*intervals, *((c / 10, end) for c in computing)])
                  for t in range(min(a, b), max(a, b)))
    assert wait_model.bulk_overlap_s(intervals, [c / 10 for c in computing], start=start, end=end) == pytest.approx(
        covered / 10, abs=1e-9)


def test_the_wait_is_fitted_apart_beside_bulk_work():
    """Answers that waited beside a computing bulk chunk (``bulk_s`` ≥ a quarter of their wait) and
    the others each have their own fit: here the lane pays 0.1 s over its work alone and 0.9 s
    beside bulk work, and ``lane_load`` fits the regime it is told the machine is in now. A record
    without ``bulk_s`` (written before it existed) is not beside bulk; a chunk's 1 s-old marks in
    the activity hash are live, a 200 s-old one is a dead process's."""
    now = 1000.0
    entry = json.dumps({"capacity_ips": 4.0, "images_per_request": 1.0, "updated": now - 1})
    answers = []
    for i in range(24):
        work = 0.3 + 0.05 * (i % 6)
        bulk = i % 2 == 1
        wait = work + (0.9 if bulk else 0.1)
        record = {"admitted": now - 20 + i * 0.5, "answered": now - 20 + i * 0.5 + wait, "work_s": work,
                  "predicted_s": wait, "status": 200, "images": 1, "ahead": 2}
        if bulk:
            record["bulk_s"] = round(0.3 * wait, 4)
        elif i % 4 == 0:
            record["bulk_s"] = round(0.2 * wait, 4)  # met a micro-batch's tail: not beside it
        answers.append(record)
    assert [wait_model.beside_bulk(r) for r in answers[:4]] == [False, True, False, True]
    raw = [json.dumps(r) for r in answers]
    quiet = wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry}, answers=raw, now=now)
    beside = wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry}, answers=raw, now=now,
                                  beside_bulk_now=True)
    assert (quiet.beside_bulk, beside.beside_bulk) == (False, True)
    assert quiet.fit.samples == beside.fit.samples == 12
    assert quiet.fit.predict(0.5) == pytest.approx(0.6, abs=0.02)
    assert beside.fit.predict(0.5) == pytest.approx(1.4, abs=0.02)
    mixed = wait_model.fit_wait(answers, now=now)  # one fit across both: wrong for either
    assert 0.8 < mixed.predict(0.5) < 1.2
    # no answer of the regime yet: the prior, the workers' own figure
    assert wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry}, answers=raw[::2],
                                now=now, beside_bulk_now=True).fit == wait_model.WaitFit()
    assert wait_model.parse_bulk_activity({"a": f"{now - 1}", "b": f"{now - 200}", "c": "?"}, now=now, stale_s=120) == (
        [now - 1], ["b", "c"], False)
    # every live chunk yields to the lane (" y"): a refusal parks them (bulk_yield.BulkActivity)
    assert wait_model.parse_bulk_activity({"a": f"{now - 1} y", "b": f"{now - 200}", "c": f"{now - 2} y"}, now=now,
                                          stale_s=120) == ([now - 1, now - 2], ["b"], True)
    assert wait_model.parse_bulk_activity({"a": f"{now - 1} y", "c": f"{now - 2}"}, now=now, stale_s=120)[2] is False
    assert wait_model.parse_bulk_activity({}, now=now, stale_s=120) == ([], [], False)


def test_a_request_admitted_beside_bulk_passes_that_parked_teaches_neither_fit():
    """The switch out of the bulk regime: requests admitted while bulk chunks computed
    (``bulk_at_admission``) that waited mostly after the chunks parked (``bulk_s`` under a quarter of
    their wait) are left out of both fits, and one still waiting is a lower bound of its admission
    regime's waits only. Here the quiet lane pays 0.1 s over its work; the switch's requests waited
    1.5 s over theirs (predicted by the bulk fit, answered in the quiet lane), and the quiet fit is
    the fit of the quiet answers alone, as if they had never been. A record admitted in the quiet
    lane that met a micro-batch's tail still teaches the quiet fit, and one that waited mostly
    beside bulk passes teaches the bulk fit, whatever the regime it was admitted in."""
    now = 1000.0
    entry = json.dumps({"capacity_ips": 4.0, "images_per_request": 1.0, "updated": now - 1})
    quiet, switch, bulk = [], [], []
    for i in range(12):
        work = 0.3 + 0.05 * (i % 6)
        admitted = now - 20 + i * 0.5
        quiet.append({"admitted": admitted, "answered": admitted + work + 0.1, "work_s": work, "predicted_s": work + 0.1,
                      "status": 200, "images": 1, "ahead": 2, "bulk_at_admission": False,
                      **({"bulk_s": round(0.2 * (work + 0.1), 4)} if i % 4 == 0 else {})})
        bulk.append({"admitted": admitted, "answered": admitted + work + 0.9, "work_s": work, "predicted_s": work + 0.9,
                     "status": 200, "images": 1, "ahead": 2, "bulk_at_admission": i % 3 != 0,
                     "bulk_s": round(0.5 * (work + 0.9), 4)})
    for i in range(6):
        work, admitted = 0.5, now - 6 + i * 0.4
        switch.append({"admitted": admitted, "answered": admitted + work + 1.5, "work_s": work, "predicted_s": work + 0.9,
                       "status": 200, "images": 1, "ahead": 8, "bulk_at_admission": True,
                       "bulk_s": round(0.1 * (work + 1.5), 4)})
    assert [wait_model.fit_regime(r) for r in (quiet[0], quiet[1], switch[0], bulk[0], bulk[1])] == [
        False, False, None, True, True]
    assert wait_model.fit_regime({"admitted": 0.0, "answered": 1.0, "bulk_s": 0.1}) is False  # written before the field
    waiting = {"admitted": now - 2.0, "work_s": 0.5, "predicted_s": 1.4, "deadline_s": 5.0}  # waited past its prediction
    pending = [json.dumps({**waiting, "bulk_at_admission": True})]

    def load(records, *, beside_bulk_now=False, pending=()):
        return wait_model.lane_load(queued_messages=3, inflight_images=0, workers={"w": entry},
                                    answers=[json.dumps(r) for r in records], now=now, pending=pending,
                                    beside_bulk_now=beside_bulk_now)

    alone = load(quiet).fit
    assert alone.predict(0.5) == pytest.approx(0.6, abs=0.02)
    assert load(quiet + bulk + switch, pending=pending).fit == alone
    # the same records, were the switch's taught as the quiet lane's (the rule before 2026-12-04)
    assert load(quiet + bulk + [{**r, "bulk_at_admission": False} for r in switch],
                pending=[json.dumps(waiting)]).fit.predict(0.5) > alone.predict(0.5) + 0.5
    beside = load(quiet + bulk + switch, beside_bulk_now=True, pending=pending).fit
    assert beside.samples == len(bulk) + 1  # and the one still waiting, admitted beside bulk passes
    assert load(bulk, beside_bulk_now=True).fit.predict(0.5) == pytest.approx(1.4, abs=0.02)


def test_the_regime_at_admission_goes_with_the_pending_request_and_its_answer(service, lane_redis, measured, tracker):
    """``interactive_admit`` records whether bulk chunks computed at admission in the pending entry
    and the decision; the answer carries it (``bulk_at_admission``). A request admitted beside a
    chunk that parked at once and answered in the quiet lane is no lone overhead of either regime."""
    client, _ = lane_redis
    admission.interactive_report(measured, worker="w")
    activity = bulk_yield.BulkActivity()
    activity.start()
    with celery_publishing_to(service.REDIS_URL):
        decision = admission.interactive_admit(deadline_s=5.0)
    activity.stop()
    assert decision.admitted and decision.admitted_beside_bulk is True and decision.ahead_images == 0
    (raw,) = client.hvals(admission.PENDING_KEY)
    assert json.loads(raw)["bulk_at_admission"] is True
    admission.interactive_answered(decision, images=1, status=200, answered_at=time.time() + 5.0)
    (record,) = admission.answer_records()
    assert record["bulk_at_admission"] is True and record["bulk_s"] < 0.25 * 5.0
    assert wait_model.fit_regime(record) is None
    assert client.llen(admission.LONE_KEY) == client.llen(admission.LONE_BULK_KEY) == 0
    assert client.hlen(admission.PENDING_KEY) == 0
    with celery_publishing_to(service.REDIS_URL):
        quiet = admission.interactive_admit(deadline_s=5.0)
    assert quiet.admitted_beside_bulk is False
    (raw,) = client.hvals(admission.PENDING_KEY)
    assert json.loads(raw)["bulk_at_admission"] is False


def test_a_bulk_chunks_computing_labels_the_answers_and_picks_the_fit(lane_redis, measured, tracker):
    """While a chunk computes (``BulkActivity``), the web's load says ``beside_bulk`` and uses the
    lone overheads measured beside bulk work; an answer is recorded with the seconds of its wait
    during which a chunk computed (``bulk_s``, from the finished intervals and the one running), and
    a lone one goes to the list of its regime. Stopping records the interval and clears the mark."""
    client, _ = lane_redis
    admission.interactive_report(measured, worker="w")
    assert admission.interactive_load().beside_bulk is False
    activity = bulk_yield.BulkActivity()
    activity.start()
    started = float(client.hget(admission.BULK_ACTIVITY_KEY, activity.field))
    activity.start()  # already computing: the same mark
    assert float(client.hget(admission.BULK_ACTIVITY_KEY, activity.field)) == started
    assert admission.interactive_load().beside_bulk is True
    now = time.time()
    lone = wait_model.Decision(True, 0.2, work_s=0.2, admitted_at=started - 0.5, ahead_images=0)
    admission.interactive_answered(lone, images=1, status=200, answered_at=started + 0.5)
    (record,) = admission.answer_records()
    assert record["bulk_s"] == pytest.approx(0.5, abs=1e-3)  # from the mark to its answer
    assert client.lrange(admission.LONE_KEY, 0, -1) == [] and client.llen(admission.LONE_BULK_KEY) == 1
    client.rpush(admission.LONE_KEY, "0.05")
    assert admission.interactive_load().lone_overhead_s == pytest.approx(0.8)  # beside bulk: its own list
    assert admission.interactive_load().quiet is None  # a chunk that does not yield: no anticipation
    activity.stop()
    activity.stop()  # not computing: nothing more recorded
    assert not client.hexists(admission.BULK_ACTIVITY_KEY, activity.field)
    (run,) = client.lrange(admission.BULK_RUNS_KEY, 0, -1)
    lo, hi = map(float, run.split())
    assert lo == pytest.approx(started, abs=1e-3) and started <= hi <= time.time()
    load = admission.interactive_load()
    assert load.beside_bulk is False and load.lone_overhead_s == pytest.approx(0.05)
    # a request admitted before the interval and answered after it: the interval's length
    later = wait_model.Decision(True, 0.2, work_s=0.2, admitted_at=lo - 1.0, ahead_images=3)
    admission.interactive_answered(later, images=1, status=200, answered_at=max(now, hi) + 1.0)
    assert admission.answer_records()[-1]["bulk_s"] == pytest.approx(hi - lo, abs=1e-3)
    # a dead process's mark (older than the stale bound) is not computing, and is removed
    client.hset(admission.BULK_ACTIVITY_KEY, "dead", f"{time.time() - admission._bulk_stale_after_s() - 5:.4f}")
    assert admission.interactive_load().beside_bulk is False and not client.hexists(admission.BULK_ACTIVITY_KEY, "dead")
    # a chunk that yields to the lane (a background ingest's) marks it: the load carries the quiet regime's
    yielding = bulk_yield.BulkActivity(yields=True)
    yielding.start()
    assert client.hget(admission.BULK_ACTIVITY_KEY, yielding.field).endswith(" y")
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
    admission.interactive_report(measured, worker="w")
    now = time.time()
    for i, (ahead, work, wait, status) in enumerate([(0, 0.15, 0.21, 200), (0, 0.15, 0.19, 200), (3, 0.5, 0.8, 200),
                                                      (0, 0.15, 1.2, 202), (6, 0.7, 1.0, 200)]):
        decision = wait_model.Decision(True, work, work_s=work, admitted_at=now - 3 + i * 0.5, ahead_images=ahead)
        admission.interactive_answered(decision, images=1, status=status, answered_at=now - 3 + i * 0.5 + wait)
    assert [float(x) for x in client.lrange(admission.LONE_KEY, 0, -1)] == pytest.approx([0.06, 0.04], abs=1e-4)
    load = admission.interactive_load()
    records = admission.answer_records()
    pulled = wait_model.fit_wait(records, now=time.time(), overhead_prior_s=0.05)
    assert load.fit.overhead_s == pytest.approx(pulled.overhead_s, abs=1e-3)
    assert load.fit.scale == pytest.approx(pulled.scale, abs=1e-3)
    assert load.fit.overhead_s != pytest.approx(wait_model.fit_wait(records, now=time.time()).overhead_s, abs=1e-3)
    for _ in range(admission.LONE_KEPT + 4):  # capped
        admission.interactive_answered(wait_model.Decision(True, 0.1, work_s=0.1, admitted_at=time.time() - 0.2,
                                                           ahead_images=0), images=1, status=200)
    assert client.llen(admission.LONE_KEY) == admission.LONE_KEPT

# --- the API --------------------------------------------------------------------------------------


def test_the_admission_edge_is_the_longest_predicted_wait_admitted():
    """``admission_edge_s``: the largest ``w`` with ``w + margin_s(w) ≤ deadline``, whichever of the
    learnt margin, the floor (a share of ``w``) or the cap (a share of the deadline) binds there."""
    edge = functools.partial(wait_model.admission_edge_s, min_share=0.2, max_s=0.8)  # a 2 s deadline's cap
    learnt = lambda m: wait_model.WaitFit(margin_s=m)  # noqa: E731
    assert edge(learnt(0.5), 2.0) == pytest.approx(1.5)  # the learnt margin: 1.5 + 0.5 = 2
    assert edge(learnt(0.1), 2.0) == pytest.approx(2.0 / 1.2)  # the floor: 1.667 + 0.2 × 1.667 = 2
    assert edge(learnt(1.5), 2.0) == pytest.approx(1.2)  # the cap: 1.2 + 0.8 = 2
    assert edge(learnt(0.1), 2.0, min_share=0.0) == pytest.approx(1.9)
    assert wait_model.admission_edge_s(learnt(5.0), 2.0, min_share=0.0) == 0.0  # no cap, nothing fits


@given(margin=st.floats(0, 10), deadline=st.floats(0.05, 60), share=st.floats(0, 1), cap=st.floats(0, 1))
def test_the_admission_edge_is_where_decide_stops_admitting(margin, deadline, share, cap):
    """Property: at the edge the predicted wait plus its margin is the deadline (or under it where
    it is 0), and a wait a millisecond longer does not fit; ``decide``'s own rule."""
    fit = wait_model.WaitFit(margin_s=margin)
    mg = functools.partial(wait_model.margin_s, fit, min_share=share, max_s=cap * deadline)
    e = wait_model.admission_edge_s(fit, deadline, min_share=share, max_s=cap * deadline)
    assert 0 <= e <= deadline and e + mg(e) <= deadline + 1e-9
    assert e + 1e-3 + mg(e + 1e-3) > deadline


def test_a_refusal_says_the_wait_at_the_admission_edge():
    """Under overload the next request admitted is the first whose predicted wait plus its margin
    fits again: a lane at the edge of a 1 s deadline (a pass of one running, 0.3 s left, one request
    queued) refuses a request predicted 0.95 s (+ a 0.2 s margin). The work ahead waits 0.05 + 0.3
    + 0.45 = 0.8 s; ``wait_ahead_s`` is the edge, 1 − 0.2 = 0.8 s, whatever the requests admitted in
    the last seconds were promised (before 2026-12-03: their mean, which lagged when admission
    stopped). With a margin of 0.4 s (the cap) the edge is 0.6 s. At a 0.6 s deadline the edge is
    0.4 s, and the lane needs 0.95 − 0.4 = 0.55 s to drain to it: that, longer (and longer than a
    lone request's 0.5 s, the floor: ``test_decide_refuses_exactly_…``)."""
    fit = wait_model.WaitFit(overhead_s=0.05, scale=1.0, margin_s=0.2, samples=50)
    lane = wait_model.LaneLoad(queued_messages=1, inflight_images=1, capacity_ips=1 / 0.45, workers=1,
                               curves=(({1: 450.0, 2: 600.0}, 8),), passes=((1, 0.3),), fit=fit)
    d = wait_model.decide(lane, deadline_s=1.0)  # 0.05 + 0.3 + a pass of two (0.6) = 0.95 s, + 0.2 > 1
    assert not d.admitted and d.predicted_wait_s == pytest.approx(0.95)
    assert d.wait_ahead_s == pytest.approx(0.8) and d.wait_ahead_from == "edge"
    assert d.work_ahead_wait_s == pytest.approx(0.8) and d.retry_after_s == 1  # ⌈0.8 + its margin 0.2⌉
    assert wait_model.decide(dataclasses.replace(lane, recent_admitted_s=(0.2,)), deadline_s=1.0) == d
    wider = wait_model.decide(dataclasses.replace(lane, fit=dataclasses.replace(fit, margin_s=0.6)), deadline_s=1.0)
    assert wider.wait_ahead_s == pytest.approx(0.6) and wider.wait_ahead_from == "edge"
    short = wait_model.decide(lane, deadline_s=0.6)
    assert short.wait_ahead_s == pytest.approx(0.55) and short.wait_ahead_from == "drain"
    # lane_load still keeps what the requests admitted in the last 2 s were promised (their count is
    # the arrivals that join the last, partial pass): from the answers and the pending, oldest first
    now = 1000.0
    entry = json.dumps({"capacity_ips": 2.0, "images_per_request": 1.0, "updated": now - 1})
    answered = [json.dumps({"admitted": now - a, "answered": now - a + 0.8, "work_s": 0.7, "predicted_s": p,
                            "status": 200, "images": 1, "ahead": 1}) for a, p in ((3.0, 9.9), (1.9, 0.8), (1.2, 0.9))]
    pending = [json.dumps({"admitted": now - 0.4, "work_s": 0.7, "predicted_s": 0.7, "deadline_s": 1.0}),
               json.dumps({"admitted": now - 0.1, "work_s": 0.7, "predicted_s": None, "deadline_s": 1.0})]
    load = wait_model.lane_load(queued_messages=0, inflight_images=0, workers={"w": entry}, answers=answered,
                                pending=pending, now=now)
    assert load.recent_admitted_s == (0.8, 0.9, 0.7)  # 3 s ago is out; an unpredicted admission is left out


def test_a_refusal_beside_bulk_work_that_yields_says_what_the_quiet_lane_will_wait():
    """Beside bulk chunks that yield to the lane (``LaneLoad.quiet``), a refusal parks them within
    a micro-batch and admission reopens in the quiet regime with the backlog of that moment: the
    429 says what the quiet fit predicts for it (``parks``), not the bulk regime's edge. A 5 s lane,
    16 images in flight: beside bulk work (overhead 0.3 s, scale 1.9, margin at its 2 s cap) the
    request is predicted 0.3 + 1.9 × 2.0 = 4.1 s and refused, and the edge is 3.0 s; the quiet fit
    (0.3 s, 0.85, margin 0.3 s) predicts 0.3 + 0.85 × 2.0 = 2.0 s, under its edge (5 / 1.2). Behind
    a deeper backlog the quiet edge, and the drain to it where longer; with chunks that do not yield
    (an urgent job's), or no quiet answer yet, the bulk regime's edge as before."""
    bulk = wait_model.WaitFit(overhead_s=0.3, scale=1.9, margin_s=2.5, samples=30)
    quiet_fit = wait_model.WaitFit(overhead_s=0.3, scale=0.85, margin_s=0.3, samples=200)
    lane = wait_model.LaneLoad(queued_messages=0, inflight_images=15, capacity_ips=8.0, workers=1, fit=bulk,
                               beside_bulk=True)
    assert lane.work_s() == pytest.approx(2.0)
    plain = wait_model.decide(lane, deadline_s=5.0)
    assert not plain.admitted and plain.predicted_wait_s == pytest.approx(4.1)
    assert (plain.wait_ahead_s, plain.wait_ahead_from) == (pytest.approx(3.0), "edge")
    parked = dataclasses.replace(lane, quiet=dataclasses.replace(lane, fit=quiet_fit, beside_bulk=False))
    d = wait_model.decide(parked, deadline_s=5.0)
    assert not d.admitted and d.predicted_wait_s == plain.predicted_wait_s and d.margin_s == plain.margin_s
    assert (d.wait_ahead_s, d.wait_ahead_from) == (pytest.approx(2.0), "parks")
    assert d.retry_after_s == 4  # ⌈2.0 + the bulk regime's margin on it (its 0.4 × 5 s cap)⌉: never early
    deep = dataclasses.replace(parked, inflight_images=39, quiet=dataclasses.replace(parked.quiet, inflight_images=39))
    d = wait_model.decide(deep, deadline_s=5.0)  # quiet: 0.3 + 0.85 × 5 = 4.55 s, past its edge 4.17 s
    assert (d.wait_ahead_s, d.wait_ahead_from) == (pytest.approx(5 / 1.2), "edge")
    deeper = dataclasses.replace(deep, inflight_images=95, quiet=dataclasses.replace(deep.quiet, inflight_images=95))
    d = wait_model.decide(deeper, deadline_s=5.0)  # quiet: 0.3 + 0.85 × 12 = 10.5 s: 6.33 s to drain to the edge
    assert (d.wait_ahead_s, d.wait_ahead_from) == (pytest.approx(10.5 - 5 / 1.2), "drain")
    unknown = dataclasses.replace(parked, quiet=dataclasses.replace(parked.quiet, fit=wait_model.WaitFit()))
    assert wait_model.decide(unknown, deadline_s=5.0) == plain
    # lane_load builds the quiet regime's load only beside chunks that all yield
    now = 1000.0
    entry = json.dumps({"capacity_ips": 8.0, "images_per_request": 1.0, "updated": now - 1})
    answers = [json.dumps({"admitted": now - 10 + i * 0.2, "answered": now - 9 + i * 0.2, "work_s": 0.8,
                           "predicted_s": 1.0, "status": 200, "images": 1, "ahead": 4, "bulk_at_admission": False})
               for i in range(20)]
    args = dict(queued_messages=0, inflight_images=15, workers={"w": entry}, answers=answers, now=now,
                lone=["0.6"], lone_quiet=["0.1"])
    assert wait_model.lane_load(**args, beside_bulk_now=True).quiet is None
    assert wait_model.lane_load(**args, bulk_yields=True).quiet is None  # nothing computes: one regime
    load = wait_model.lane_load(**args, beside_bulk_now=True, bulk_yields=True)
    assert load.fit == wait_model.WaitFit() and load.lone_overhead_s == pytest.approx(0.6)  # no bulk answer yet
    assert load.quiet.beside_bulk is False and load.quiet.quiet is None
    assert load.quiet.fit == wait_model.lane_load(**{**args, "lone": ["0.1"]}).fit and load.quiet.fit.samples == 20
    assert load.quiet.lone_overhead_s == pytest.approx(0.1)
    assert (load.quiet.inflight_images, load.quiet.capacity_ips) == (15, 8.0)


def test_an_empty_lane_is_predicted_from_what_lone_requests_waited():
    """After a 5 s phase whose waits did not follow their work, the fit said overhead 1.33 s and
    scale 0.25 (its floor): 1.47 s for a lone 0.55 s pass, refused at a 1 s deadline while lone
    requests waited 0.5-0.64 s. An empty lane is bounded by ``work_s`` + the lone requests' mean
    overhead (0.1 s): 0.65 s, admitted. A lane with a pass running keeps the fit; with no lone
    evidence, the fit alone (refused: the newest answer is fresh, so no probe)."""
    fit = wait_model.WaitFit(overhead_s=1.33, scale=0.25, margin_s=0.0, samples=40, age_s=1.0)
    empty = wait_model.LaneLoad(queued_messages=0, inflight_images=0, capacity_ips=1 / 0.55, workers=1,
                                curves=(({1: 550.0, 2: 700.0}, 8),), fit=fit, lone_overhead_s=0.1)
    d = wait_model.decide(empty, deadline_s=1.0)
    assert d.admitted and d.predicted_wait_s == pytest.approx(0.65)
    busy = dataclasses.replace(empty, inflight_images=1, passes=((1, 0.2),))
    assert busy.predicted_wait_s() == pytest.approx(1.33 + 0.25 * (0.2 + 0.55))
    unknown = dataclasses.replace(empty, lone_overhead_s=None)
    assert unknown.predicted_wait_s() == pytest.approx(1.33 + 0.25 * 0.55)
    assert not wait_model.decide(unknown, deadline_s=1.0).admitted
    # a fit below the lone figure is kept: the bound only ever lowers an empty lane's prediction
    assert dataclasses.replace(empty, fit=wait_model.WaitFit(overhead_s=0.02, samples=40, age_s=1.0)).predicted_wait_s() \
        == pytest.approx(0.57)
    # lane_load: the lone list's mean (≥ 0)
    entry = json.dumps({"capacity_ips": 2.0, "images_per_request": 1.0, "updated": 99.0})
    load = wait_model.lane_load(queued_messages=0, inflight_images=0, workers={"w": entry}, answers=[], now=100.0,
                                lone=["0.05", "0.15"])
    assert load.lone_overhead_s == pytest.approx(0.1)

@pytest.fixture
def overloaded(service, lane_redis, measured, tracker):
    """A real, non-eager setting: a worker's measured capacity in Redis and more queued interactive
    work than drains within the deadline. No worker consumes the private Redis."""
    _, publisher = lane_redis
    admission.interactive_report(measured, worker="celery@test")
    capacity = admission.interactive_load().capacity_ips
    curve, max_batch = wait_model.update_batch_curve({}, measured), admission._max_batch()
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
    assert int(r["Retry-After"]) == body["extra"]["retry_after_s"] == math.ceil(body["extra"]["wait_ahead_s"] + ra_margin)
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
    client.rpush(admission.REFUSALS_KEY, *map(json.dumps, sorted(refusals + longer, key=lambda r: r["t"])))
    client.rpush(admission.ANSWERS_KEY, *map(json.dumps, sorted(answers + other, key=lambda a: a["answered"])))
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
    recorded = [json.loads(x) for x in client.lrange(admission.REFUSALS_KEY, 0, -1)]
    assert len(recorded) == 49 and recorded[-1]["t"] >= now and recorded[-1]["wait_ahead_s"] == pytest.approx(first, abs=1e-3)
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
    recorded = [json.loads(x) for x in client.lrange(admission.REFUSALS_KEY, 0, -1)]
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


def test_migration_chunks_take_one_host_slot_at_a_time(lane_redis, settings):
    """Two bulk processes with migration chunks: the second computes only once the first is done;
    a slot whose holder died expires; 0 slots, or no Redis, limit nothing."""
    import threading

    client, _ = lane_redis
    order: list[str] = []
    first_in = threading.Event()
    release_first = threading.Event()

    def first():
        with bulk_yield.migration_slot(1, hold_s=30):
            order.append("first in")
            first_in.set()
            release_first.wait(10)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(10)
    waiter = threading.Thread(target=lambda: _second(order))
    waiter.start()
    time.sleep(0.5)
    assert order == ["first in"]  # the second chunk waits for the slot
    release_first.set()
    t.join(10)
    waiter.join(10)
    assert order == ["first in", "first out", "second in"]
    assert not client.keys(bulk_yield.MIGRATION_SLOT_KEY + "*")  # both slots handed back

    # a holder killed mid-chunk: its slot expires after hold_s
    client.set(f"{bulk_yield.MIGRATION_SLOT_KEY}{__import__('socket').gethostname()}:0", "dead", px=300)
    with bulk_yield.migration_slot(1, hold_s=30) as waited_ms:
        assert waited_ms >= 100
    with bulk_yield.migration_slot(0) as waited_ms:
        assert waited_ms == 0.0
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens: computing goes on without a slot
    with bulk_yield.migration_slot(1, hold_s=30) as waited_ms:
        assert waited_ms >= 0


def _second(order: list[str]) -> None:
    with bulk_yield.migration_slot(1, hold_s=30):
        order.append("second in")


def test_a_migration_waits_while_the_interactive_lane_has_work(lane_redis, settings):
    """migration_yield blocks while a request is admitted and unanswered, a task runs or a message
    waits, returns as soon as the lane is idle, gives up after its bound, and ignores stale entries;
    asked for the lane at capacity (``refused_within_s``), busy only after a recent refusal."""
    import threading

    client, app = lane_redis
    assert bulk_yield.interactive_busy(client) is False
    assert bulk_yield.migration_yield(2.0) < 100  # idle lane: one look

    # an admitted request not answered yet: the migration waits until its answer
    client.hset(admission.PENDING_KEY, "tok", json.dumps({"admitted": time.time(), "work_s": 0.3,
                                                          "predicted_s": 0.5, "deadline_s": 2.0}))
    assert bulk_yield.interactive_busy(client) is True
    threading.Timer(0.4, lambda: client.hdel(admission.PENDING_KEY, "tok")).start()
    waited = bulk_yield.migration_yield(5.0)
    assert 350 <= waited < 2000

    # a task a worker runs, then a queued message: busy; the bound lets one micro-batch through
    client.hset(admission.INFLIGHT_KEY, "task-1", f"1 {time.time():.3f}")
    assert bulk_yield.interactive_busy(client) is True
    assert 300 <= bulk_yield.migration_yield(0.3) < 1500
    client.delete(admission.INFLIGHT_KEY)
    app.send_task("embeddings.tasks.embed_interactive", queue="interactive")
    assert bulk_yield.interactive_busy(client) is True
    for k in admission.queue_keys("interactive"):
        client.delete(k)

    # entries of a dead web process or worker (older than the stale bound) do not hold a migration
    old = time.time() - admission._stale_after_s() - 5
    client.hset(admission.PENDING_KEY, "dead", json.dumps({"admitted": old, "work_s": 0.3,
                                                           "predicted_s": 0.5, "deadline_s": 2.0}))
    client.hset(admission.INFLIGHT_KEY, "dead-task", f"1 {old:.3f}")
    assert bulk_yield.interactive_busy(client) is False
    client.delete(admission.PENDING_KEY, admission.INFLIGHT_KEY)

    # refused_within_s: busy only while admission refused a request that recently (at capacity)
    client.hset(admission.INFLIGHT_KEY, "task-2", f"1 {time.time():.3f}")
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is False  # never refused
    client.rpush(admission.REFUSALS_KEY, json.dumps({"t": time.time() - 20, "deadline_s": 2.0}))
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is False  # 20 s ago
    assert bulk_yield.interactive_busy(client, refused_within_s=30) is True
    client.rpush(admission.REFUSALS_KEY, json.dumps({"t": time.time(), "deadline_s": 2.0}))
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is True
    client.delete(admission.INFLIGHT_KEY)
    assert bulk_yield.interactive_busy(client, refused_within_s=10) is False  # refusing, but idle now
    client.delete(admission.REFUSALS_KEY)

    assert bulk_yield.migration_yield(0) == 0.0  # MIGRATION_YIELD_MAX_S=0: never waits
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # Redis gone: computing goes on
    assert bulk_yield.migration_yield(2.0) < 1000


class _FakeClock:
    """``time`` for :mod:`bulk_yield` with a clock that only ``sleep`` moves; the sleeps it was asked for."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(round(s, 6))
        self.now += s


@pytest.mark.parametrize("busy_for_s, max_pause_s, sleeps, waited_ms", [
    # the looks back off 20, 40, 80, 160 ms, then every 200 ms; the lane idles at 1.0 s, seen at 1.1 s
    (1.0, 60.0, [0.02, 0.04, 0.08, 0.16, 0.2, 0.2, 0.2, 0.2], 1100.0),
    # the bound cuts the last sleep short: exactly max_pause_s
    (10.0, 0.5, [0.02, 0.04, 0.08, 0.16, 0.2], 500.0),
    (0.0, 60.0, [], 0.0),  # idle: one look, no sleep
])
def test_a_waiting_bulk_pass_looks_less_often_the_longer_it_waits(monkeypatch, busy_for_s, max_pause_s, sleeps,
                                                                  waited_ms):
    """yield_to_interactive's looks at the lane back off from YIELD_POLL_S to YIELD_POLL_MAX_S: a bulk
    job waiting out a 60 s overload makes ~5 Redis round trips a second, not 50."""
    clock = _FakeClock()
    looks = []
    monkeypatch.setattr(bulk_yield, "time", clock)
    monkeypatch.setattr(bulk_yield, "redis_client", lambda: None)
    monkeypatch.setattr(bulk_yield, "interactive_busy",
                        lambda client, refused_within_s: looks.append(clock.now) or clock.now < busy_for_s)
    assert bulk_yield.yield_to_interactive(max_pause_s, refused_within_s=10) == pytest.approx(waited_ms)
    assert clock.sleeps == pytest.approx(sleeps)
    assert len(looks) == len(sleeps) + 1
    assert (bulk_yield.YIELD_POLL_S, bulk_yield.YIELD_POLL_MAX_S) == (0.02, 0.2)


@pytest.mark.parametrize("priority, max_pause_s, deadline_in_s, refused, passes, waits", [
    ("background", 5.0, None, True, [2, 2, 1], True),  # at capacity: passes of 2, the first after the answer
    ("background", 5.0, None, False, [2, 2, 1], False),  # busy but nothing refused: room left, it computes
    ("background", 5.0, -60, True, [5], False),  # its deadline has passed: at risk, it does not wait
    ("urgent", 5.0, None, True, [5], False),  # an urgent job's deadline comes first: one pass, no wait
    ("background", 0.0, None, True, [5], False),  # BULK_YIELD_MAX_S 0 (off): one pass, no wait
])
def test_a_background_ingest_chunk_computes_in_the_interactive_lanes_idle_time(
        lane_redis, service, user, monkeypatch, priority, max_pause_s, deadline_in_s, refused, passes, waits):
    """With ``BULK_YIELD_MAX_S`` > 0 a background ingest job's chunk (5 images) runs as forward
    passes of ``BULK_YIELD_MICRO_BATCH`` (2) images, and while a request is admitted and unanswered
    (its answer comes 0.4 s later) and admission refused one a moment ago, neither decodes nor
    computes; with no refusal within ``BULK_YIELD_REFUSED_S`` it computes at once, and so does an
    urgent job's chunk, a job at risk of missing its deadline, or the setting at 0. Every image ends
    embedded either way."""
    import datetime as dt
    import io
    import threading

    from django.db import transaction
    from django.utils import timezone

    from embeddings.models import JobStatus
    from embeddings.services.catalogue import jobs as job_services
    from embeddings.services.catalogue.sources import SourceFile

    client, _ = lane_redis
    service.BULK_YIELD_MAX_S, service.BULK_YIELD_MICRO_BATCH, service.BULK_YIELD_REFUSED_S = max_pause_s, 2, 10.0
    service.PIPELINE = service.PIPELINE.replace(batch_size=5)
    encoder = runtime.encoder_holder().get()
    calls: list[int] = []
    real = encoder.encode_images
    monkeypatch.setattr(encoder, "encode_images", lambda px: calls.append(len(px)) or real(px))
    files = [SourceFile(name=f"{i}.jpg", size=len(d), open=lambda d=d: io.BytesIO(d))
             for i, d in enumerate(jpeg_bytes(70 + i) for i in range(5))]
    deadline = None if deadline_in_s is None else timezone.now() + dt.timedelta(seconds=deadline_in_s)
    with transaction.atomic():  # paused before its chunk is sent: parked, sent below by hand
        job = job_services.job_create(owner=user, sources=files, name="catalogue", priority=priority,
                                      deadline=deadline)
        job_services.job_transition(job=job, to=JobStatus.PAUSED)
    Image.objects.filter(job=job).update(reason="")  # as if still queued, never parked
    job_services.job_transition(job=job, to=JobStatus.QUEUED)
    ids = [str(i) for i in Image.objects.filter(job=job).order_by("created_at").values_list("id", flat=True)]

    if refused:
        client.rpush(admission.REFUSALS_KEY, json.dumps({"t": time.time(), "deadline_s": 2.0}))
    client.hset(admission.PENDING_KEY, "tok", json.dumps({"admitted": time.time(), "work_s": 0.3,
                                                          "predicted_s": 0.5, "deadline_s": 2.0}))
    answer = threading.Timer(0.4, lambda: client.hdel(admission.PENDING_KEY, "tok"))
    answer.start()
    out = tasks.embed_chunk.apply(args=(str(job.id), ids)).get()
    answer.join(5)
    assert calls == passes
    # the chunk told the web when it computed: one interval, or two around its wait when it waited
    runs = [tuple(map(float, r.split())) for r in client.lrange(admission.BULK_RUNS_KEY, 0, -1)]
    assert client.hlen(admission.BULK_ACTIVITY_KEY) == 0 and len(runs) == (2 if waits else 1)
    if waits:
        assert 350 <= out["paused_ms"] < 5000
        assert runs[1][0] - runs[0][1] == pytest.approx(out["paused_ms"] / 1000, abs=0.1)
    else:  # no before_pass at all, or one look at the lane per pass
        assert out["paused_ms"] == 0.0 if passes == [5] else out["paused_ms"] < 300
    job.refresh_from_db()
    assert out["embedded"] == 5 and job.status == JobStatus.DONE
    assert Image.objects.filter(job=job, status=ImageStatus.EMBEDDED).count() == 5


def test_the_load_replay_predicts_a_steady_lane_and_counts_what_the_margin_misses():
    """``benchmarks.load_replay.replay`` on the web's records of a lane whose wait is exactly
    0.2 s + its work: every request after the first few is predicted within ±30 %, none waits past
    predicted + margin. Make one in ten 1 s late: those are outside ±30 %, and the first of them
    are short of predicted + margin, but not all: the margin learns the lateness from them."""
    from benchmarks.load_replay import replay

    def records(late_every: int = 0) -> list[dict]:
        out = []
        for i in range(100):
            work = 0.3 + 0.01 * (i % 40)
            wait = 0.2 + work + (1.0 if late_every and i % late_every == late_every - 1 else 0.0)
            out.append({"admitted": i * 0.2, "answered": i * 0.2 + wait, "work_s": work, "status": 200,
                        "predicted_s": 0.2 + work})
        return out

    steady = replay(records(), half_life_answers=16, half_life_s=10)
    assert steady["requests"] >= 90 and steady["within_30pct"] == 1.0 and steady["short"] == 0.0
    assert abs(steady["error_s"][1]) < 0.01
    late = replay(records(late_every=10), half_life_answers=16, half_life_s=10)
    assert late["requests"] == steady["requests"]
    # the late ones are 1 s over a wait of ~0.7 s: outside ±30 %; short until the margin has seen them
    assert late["within_30pct"] <= 0.91 and 0.01 <= late["short"] < 0.09
    assert replay(records()[:4], half_life_answers=16, half_life_s=10)["error_s"] is None  # too few


def test_the_load_benchmark_waits_for_the_first_calibrations_text_vectors(lane_redis):
    """``benchmarks.load.first_calibration`` watches the key under which the cutoff calibration keeps
    its prompts' text vectors (``cutoff.PROMPT_VECTORS_KEY``): not there, it gives up after its
    timeout (``None``); there, it answers at once."""
    import fnmatch

    from benchmarks import load
    from embeddings.services.lifecycle import cutoff

    client, _ = lane_redis
    key = cutoff.PROMPT_VECTORS_KEY.format(model_id="ViT-B-32/random", prompts_sha256="ab" * 32)
    assert fnmatch.fnmatchcase(key, load.PROMPT_VECTORS_PATTERN)
    assert load.first_calibration(settings.REDIS_URL, timeout_s=1.5, quiet_s=0) is None
    client.set(key, "{}")
    assert load.first_calibration(settings.REDIS_URL, timeout_s=1.5, quiet_s=0) == 0.0


def test_the_load_benchmarks_depth_sampler_reads_the_lanes_as_admission_does(lane_redis):
    """``benchmarks.load.QueueSampler`` (which imports no Django) names the same Redis keys as
    admission and counts every priority list: 3 + 2 interactive messages at two priorities, one
    interactive message on the vectors queue, 2 tasks in flight, 1 pending request, 1 running pass,
    1 bulk chunk computing."""
    from benchmarks import load
    from benchmarks.load import QueueSampler

    client, app = lane_redis
    assert (load.ANSWERS_KEY, load.BATCHES_KEY, load.REFUSALS_KEY) == (
        admission.ANSWERS_KEY, admission.BATCHES_KEY, admission.REFUSALS_KEY)
    assert load.WAIT_AHEAD_WINDOW_S == wait_ahead.FIT_WINDOW_S
    assert QueueSampler.lists(lanes.INTERACTIVE) == admission.queue_keys(lanes.INTERACTIVE)
    assert QueueSampler.lists(lanes.VECTORS)[0] == admission.queue_keys(lanes.VECTORS)[0] == "vectors"
    assert QueueSampler.KEYS == {"inflight": admission.INFLIGHT_KEY, "pending": admission.PENDING_KEY,
                                 "passes": admission.PASSES_KEY, "bulk": admission.BULK_ACTIVITY_KEY}
    publish(app, lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE, n=3)
    publish(app, lanes.INTERACTIVE, lanes.PRIORITY_BULK_BACKGROUND, n=2)
    publish(app, lanes.VECTORS, lanes.PRIORITY_INTERACTIVE)
    client.hset(admission.INFLIGHT_KEY, mapping={"a": "1 1.0", "b": "1 1.0"})
    client.hset(admission.PENDING_KEY, "t", "{}")
    client.hset(admission.PASSES_KEY, "w", "1 1.0 300.0")
    client.hset(admission.BULK_ACTIVITY_KEY, "h:1:2", "1.0")
    sampler = QueueSampler(settings.REDIS_URL, every=0.01)
    sampler.start()
    deadline = time.time() + 10
    while len(sampler.samples) < 2 and time.time() < deadline:
        time.sleep(0.01)
    sampler.stop.set()
    sampler.join()
    last = sampler.samples[-1]
    assert {k: last[k] for k in ("queued", "inflight", "vectors", "pending", "passes", "bulk")} == {
        "queued": 5, "inflight": 2, "vectors": 1, "pending": 1, "passes": 1, "bulk": 1}
    client.rpush(admission.BATCHES_KEY, json.dumps({"t": 5.0, "size": 2}), json.dumps({"t": 9.0, "size": 3}))
    assert load.records_since(settings.REDIS_URL, load.BATCHES_KEY, "t", 6.0) == [{"t": 9.0, "size": 3}]
    # what a phase's first 429s learn from: the last minute's refusals and answers before it, none after
    client.rpush(admission.REFUSALS_KEY, *(json.dumps({"t": t, "wait_ahead_s": 1.0}) for t in (30.0, 50.0, 99.0, 100.0)))
    client.rpush(admission.ANSWERS_KEY, *(json.dumps({"admitted": t, "answered": t + 1}) for t in (39.0, 41.0, 99.5, 101.0)))
    before = load.records_before(settings.REDIS_URL, 100.0)
    assert [r["t"] for r in before["refusals"]] == [50.0, 99.0]
    assert [r["admitted"] for r in before["web_records"]] == [41.0, 99.5]
