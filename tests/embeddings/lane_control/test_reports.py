"""Reports, the worker side of the interactive lane (embeddings/lane_control/reports.py): each
worker's entry (capacity, per-batch-size times), its tasks in flight, its running passes and its
batch records, as the web then reads them.

Real values (``conftest``): the real model's batch records behind the real dynamic batcher, a
private redis-server.
"""
from __future__ import annotations

import json
import time

import pytest

from embeddings.lane_control import admission, background, keys, reports
from queueing import wait_model
from tests.embeddings.lane_control.conftest import torch_pixels

pytestmark = pytest.mark.django_db(transaction=True)


def test_window_stats_from_the_real_model(measured):
    stats = reports.window_stats(measured)
    assert stats["batches"] == len([r for r in measured if r.size]) >= 2
    assert stats["ms_per_image"] == pytest.approx(sum(r.service_ms for r in measured) / sum(r.size for r in measured))
    assert stats["images_per_request"] == pytest.approx(1.0)  # every request here had one image
    assert max(r.size for r in measured) > 1  # the concurrent requests shared a pass
    assert stats["ms_per_image"] > 0


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
        assert background.flush()  # the pass's record left from the writer thread, within the pass
        seen.append((len(px), client.hget(keys.PASSES_KEY, "me"), len(admission.interactive_load().passes)))
        return encoder.encode_images(normalize(px, encoder.preprocess_config))

    b = DynamicBatcher(run_batch, max_batch_size=4, max_queue_delay_ms=100,
                       on_pass=lambda n, at: reports.interactive_pass("me", n, at))
    px = torch_pixels(encoder)
    before = time.time()
    futs = [b.submit(px[i : i + 1]) for i in range(3)]
    vectors = [f.result(timeout=60) for f in futs]
    assert [v.shape for v in vectors] == [(1, encoder.embed_dim)] * 3
    (size, raw, read), = seen
    images, started, expected = raw.split()
    assert (size, int(images), float(expected), read) == (
        3, 3, pytest.approx(wait_model.batch_ms(tracker.curve, 3), abs=0.1), 1)
    assert before <= float(started) <= time.time()
    # cleared when the pass ended: the model thread hands out the vectors first, then clears it
    stop = time.monotonic() + 5
    while client.hexists(keys.PASSES_KEY, "me") and time.monotonic() < stop:
        time.sleep(0.01)
    assert not client.hexists(keys.PASSES_KEY, "me")
    b.close()

    def broken(n, at):
        raise RuntimeError("metrics down")

    b = DynamicBatcher(lambda px: encoder.encode_images(normalize(px, encoder.preprocess_config)),
                       max_batch_size=4, max_queue_delay_ms=1, on_pass=broken)
    assert b.embed(px[:1]).shape == (1, encoder.embed_dim)
    b.close()


def test_worker_reports_batches_its_capacity_and_in_flight_work(lane_redis, measured, tracker):
    client, _ = lane_redis
    assert reports.interactive_report(measured, worker="w1") == len(measured)
    assert reports.interactive_report(measured, worker="w1") == 0  # nothing new: nothing sent twice
    stats = reports.window_stats(measured)
    load = admission.interactive_load()
    # no finished task yet: the forward pass alone gives the first figure
    assert load.capacity_ips == pytest.approx(1000 / stats["ms_per_image"], rel=1e-3) and load.workers == 1
    assert load.images_per_request == pytest.approx(stats["images_per_request"], rel=1e-3)
    entry = json.loads(client.hget(keys.WORKERS_KEY, "w1"))
    assert entry["max_batch"] == reports._max_batch()
    curve = wait_model.update_batch_curve({}, measured)
    assert {int(k): v for k, v in entry["batch_ms"].items()} == pytest.approx(curve, abs=0.01)
    assert load.curves and load.work_s(1) == pytest.approx(wait_model.drain_s(curve, 1, entry["max_batch"]), rel=1e-3)
    records = reports.batch_records()
    assert [r["size"] for r in records] == [r.size for r in measured]
    assert {"t", "size", "requests", "queue_delay_ms", "service_ms", "expired"} <= set(records[0])
    with reports.interactive_in_flight("task-a", 5), reports.interactive_in_flight("task-b", 2):
        assert background.flush() and admission.interactive_load().inflight_images == 7
        time.sleep(0.1)
    assert background.flush() and admission.interactive_load().inflight_images == 0
    # the two tasks finished: 7 images in ~0.1 s of busy time is the worker's drain rate now
    assert [n for *_, n in tracker.tasks] == [2, 5]
    reports.interactive_report(measured, worker="w1")
    rate = admission.interactive_load().capacity_ips
    assert rate == pytest.approx(wait_model.drain_rate(tracker.tasks, now=time.time()), rel=0.05)
    assert 7 / 0.5 < rate <= 7 / 0.1
    # A task whose worker died long ago no longer counts, and is cleaned away.
    client.hset(keys.INFLIGHT_KEY, "dead-task", f"16 {time.time() - 3600:.3f}")
    assert admission.interactive_load().inflight_images == 0
    assert not client.hexists(keys.INFLIGHT_KEY, "dead-task")


def test_the_heartbeat_keeps_an_idle_worker_counted(lane_redis, measured, tracker, monkeypatch):
    client, _ = lane_redis
    monkeypatch.setattr(reports, "HEARTBEAT_S", 0.05)
    reports.interactive_report(measured, worker="celery@idle", heartbeat=True)
    first = json.loads(client.hget(keys.WORKERS_KEY, "celery@idle"))["updated"]
    time.sleep(0.3)
    later = json.loads(client.hget(keys.WORKERS_KEY, "celery@idle"))
    assert later["updated"] > first
    assert later["capacity_ips"] == pytest.approx(1000 / reports.window_stats(measured)["ms_per_image"], rel=1e-3)



def test_a_workers_entry_is_its_drain_rate_else_its_last_figure_else_its_forward_pass():
    """``worker_entry`` (pure): the capacity is the drain rate of the tasks it finished (8 images in
    1 s busy: 8 images/s); with none in the window, the previous entry's figure (an idle worker
    keeps its last measurement); with neither, the forward pass alone (1000 / 125 ms = 8 images/s).
    Its per-batch-size times go out with its largest batch, both or neither."""
    now = 1000.0
    stats = {"ms_per_image": 125.0, "images_per_request": 1.5, "batch_ms": 250.0, "batch_size": 2.0,
             "queue_delay_ms": 3.0, "batches": 4}
    assert reports.worker_entry(stats, [(now - 2.5, now - 1.5, 4), (now - 1.5, now - 0.5, 6)], now=now) == {
        "capacity_ips": 5.0, "ms_per_image": 125.0, "images_per_request": 1.5, "batch_size": 2.0, "updated": 1000.0}
    previous = {"capacity_ips": 6.25, "ms_per_image": 160.0, "images_per_request": 1.0, "batch_size": 1.0,
                "updated": now - 30}
    old = [(now - 20, now - 19, 8)]  # ended before the 10 s window
    assert reports.worker_entry(None, old, now=now, previous=previous) == {**previous, "updated": 1000.0}
    assert reports.worker_entry(stats, old, now=now)["capacity_ips"] == 8.0
    assert reports.worker_entry(None, [], now=now) is None  # nothing measured yet
    curve = {8: 550.0, 1: 300.0}
    entry = reports.worker_entry(stats, [], now=now, curve=curve, max_batch=8)
    assert entry["batch_ms"] == {"1": 300.0, "8": 550.0} and entry["max_batch"] == 8
    assert "batch_ms" not in reports.worker_entry(stats, [], now=now, curve=curve)  # no largest batch: neither
    assert "max_batch" not in reports.worker_entry(stats, [], now=now, curve={}, max_batch=8)


def test_the_largest_batch_is_the_pipelines(settings):
    """``_max_batch``: what the worker's dynamic batcher is built with, ``settings.PIPELINE``'s
    ``interactive_max_batch_size``; no environment read of its own."""
    settings.PIPELINE = settings.PIPELINE.replace(interactive_max_batch_size=5)
    assert reports._max_batch() == 5
    settings.PIPELINE = settings.PIPELINE.replace(interactive_max_batch_size=3)
    assert reports._max_batch() == 3


def test_a_worker_reports_nothing_and_raises_nothing_when_redis_is_gone(settings, measured, tracker):
    """Reports are bookkeeping: with Redis unreachable the task runs, the pass runs, nothing raises,
    and no batch record counts as sent (the next report sends them)."""
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens
    with reports.interactive_in_flight("task-a", 2):
        pass
    assert [n for *_, n in tracker.tasks] == [2]  # drained by this process all the same
    reports.interactive_pass("me", 3, time.time())
    reports.interactive_pass("me", 0, time.time())
    assert reports.interactive_report(measured, worker="w1") == 0
    assert tracker.last_record is None
