"""Overlap and thread settings: ``run_many`` prepares batch k+1 while batch k is in the model,
without reordering or dropping an image; stage timings stay honest; the thread plan never
oversubscribes the cores and is what the runner and the encoder actually use; the bulk worker's
process count comes from the same setting."""
from __future__ import annotations

import threading
import time

import cv2
import numpy as np
import pytest
import torch

from project import processes
from project.configuration import pipeline_config
from workers.config import PipelineConfig
from workers.errors import ImageRejected, Reason
from workers.model import EncoderHolder
from workers.runner import BatchRunner


def jpeg(seed: int, size=(180, 240)) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8), size[::-1], interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


def blobs_with_bad_ones(n: int) -> dict[str, bytes | None]:
    blobs: dict[str, bytes | None] = {f"img{i:03d}": jpeg(i) for i in range(n)}
    blobs["img005"] = b""  # empty
    blobs["img011"] = b"plain text, not an image"
    blobs["img017"] = None  # source missing
    return blobs


def loader_for(blobs, log=None):
    def load(key):
        if log is not None:
            log.append((key, time.perf_counter()))
        if blobs[key] is None:
            raise ImageRejected(Reason.SOURCE_MISSING, "gone")
        return blobs[key]

    return load


def test_run_many_keeps_every_image_in_order_and_matches_run(runner):
    blobs = blobs_with_bad_ones(22)
    keys = list(blobs)
    batches = [keys[i : i + 5] for i in range(0, len(keys), 5)]  # 5, 5, 5, 5, 2
    results = list(runner.run_many(batches, loader_for(blobs)))
    assert len(results) == len(batches)
    for batch, result in zip(batches, results):
        good = [k for k in batch if k not in ("img005", "img011", "img017")]
        assert [m.key for m in result.metas] == good  # same order, none dropped
        assert {f.key for f in result.failed} == set(batch) - set(good)
        assert result.vectors.shape == (len(good), 512)
        # each row is its own image's embedding: equal to embedding the batch alone
        alone = runner.run(batch, loader_for(blobs))
        np.testing.assert_allclose(result.vectors, alone.vectors, atol=1e-5)
    assert sum(len(r.metas) + len(r.failed) for r in results) == len(keys)
    assert list(runner.run_many([], loader_for(blobs))) == []


def test_next_batch_is_prepared_while_the_model_runs(runner):
    """Batch k+1's images are loaded before batch k's forward pass ends."""
    blobs = {f"k{i}": jpeg(100 + i) for i in range(12)}
    loads: list[tuple[str, float]] = []
    spans: list[tuple[float, float]] = []
    encoder = runner.encoder.get()
    original = encoder.encode_images

    def slow_encode(x):
        t0 = time.perf_counter()
        out = original(x)
        time.sleep(0.2)  # a forward pass long enough to be sure of the overlap on a busy machine
        spans.append((t0, time.perf_counter()))
        return out

    encoder.encode_images = slow_encode
    try:
        keys = list(blobs)
        results = list(runner.run_many([keys[0:4], keys[4:8], keys[8:12]], loader_for(blobs, loads)))
    finally:
        del encoder.encode_images
    assert [m.key for r in results for m in r.metas] == keys
    first_load = {k: t for k, t in loads}
    for k in (1, 2):
        batch_keys = keys[4 * k : 4 * k + 4]
        model_end_prev = spans[k - 1][1]
        assert min(first_load[key] for key in batch_keys) < model_end_prev, f"batch {k} waited for the model"


def test_stage_timings_stay_honest_when_overlapped(runner):
    blobs = {f"t{i}": jpeg(200 + i, (300, 400)) for i in range(9)}
    keys = list(blobs)
    started = time.perf_counter()
    results = list(runner.run_many([keys[0:3], keys[3:6], keys[6:9]], loader_for(blobs)))
    wall = (time.perf_counter() - started) * 1000
    for r in results:
        t = r.timings
        assert min(t.load, t.decode, t.preprocess, t.embed) > 0
        # in sequence within a batch: its parallel phase (≥ its summed work / threads), then the
        # normalise-and-copy and the forward pass; total is the batch's own wall time
        parallel = (t.load + t.decode) / runner.threads.decode
        assert t.total >= t.embed + parallel * 0.5
        assert t.total <= wall + 1
    # overlapped: the batches' own totals add up to more than the wall time of all three
    assert sum(r.timings.total for r in results) >= wall * 0.9


def test_micro_batches_inside_a_chunk_keep_order_and_timings(runner, random_config):
    """``micro_batch``: one chunk run as overlapped forward passes gives what one pass gives."""
    blobs = blobs_with_bad_ones(19)
    keys = list(blobs)
    whole = runner.run(keys, loader_for(blobs))
    micro = BatchRunner(random_config.replace(micro_batch=4, decode_threads=2), runner.encoder)
    try:
        split = micro.run(keys, loader_for(blobs))
    finally:
        micro.close()
    assert [m.key for m in split.metas] == [m.key for m in whole.metas]
    assert sorted(f.key for f in split.failed) == ["img005", "img011", "img017"]
    np.testing.assert_allclose(split.vectors, whole.vectors, atol=1e-4)
    t = split.timings
    # the passes run one after another on the model: the chunk's wall time covers all of them
    assert t.total >= t.embed > 0 and min(t.load, t.decode, t.preprocess) > 0


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_pass_budget_grows_the_passes_after_the_first_and_changes_no_vector(runner, random_config, overlapped):
    """``run(pass_ms=...)`` (a migration chunk, ``MIGRATION_PASS_MS``): after the first pass of
    ``micro_batch`` images, a pass holds what the budget fits at the last pass's time per image
    (decode and forward; overlapped: the pass before the last's, since the next pass is cut while the current one
    is being prepared); the real model here takes far more than a microsecond and far less than
    1,000 s an image."""
    if overlapped:
        runner = BatchRunner(random_config.replace(micro_batch=4, decode_threads=2), runner.encoder)
    blobs = blobs_with_bad_ones(19)
    keys = list(blobs)
    whole = runner.run(keys, loader_for(blobs))
    # [4, 15] (overlapped [4, 4, 11]); [4, 4, 4, 4, 3]
    for pass_ms, passes in ((1e6, 3 if overlapped else 2), (1e-3, 5)):
        looks = []
        split = runner.run(keys, loader_for(blobs), micro_batch=4, pass_ms=pass_ms,
                           before_pass=lambda: looks.append(1) or 0.0)
        assert len(looks) == passes + (1 if overlapped else 0)  # overlapped: one more look before the first
        assert [m.key for m in split.metas] == [m.key for m in whole.metas]
        assert sorted(f.key for f in split.failed) == ["img005", "img011", "img017"]
        np.testing.assert_allclose(split.vectors, whole.vectors, atol=1e-4)


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("processes_", [1, 2, 3, 4])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("micro_batch", [None, 16])
def test_automatic_threads_never_oversubscribe(cores, processes_, device, micro_batch):
    plan = PipelineConfig(device=device, bulk_processes=processes_, micro_batch=micro_batch).threads(cpu_count=cores)
    assert plan.decode >= 1 and plan.torch >= 1
    overlapped = micro_batch is not None and device == "cpu"
    per_process = plan.decode + plan.torch if overlapped else max(plan.decode, plan.torch)
    if processes_ * (2 if overlapped else 1) <= cores:
        assert processes_ * per_process <= cores and not plan.oversubscribed
    if device == "cuda":
        assert plan.torch == 1


def test_explicit_threads_win_and_are_flagged():
    plan = PipelineConfig(decode_threads=4, torch_threads=4, bulk_processes=2).threads(cpu_count=2)
    assert (plan.decode, plan.torch, plan.oversubscribed) == (4, 4, True)
    assert pipeline_config({"DECODE_THREADS": "3", "TORCH_THREADS": "1", "BULK_PROCESSES": "1"}).threads(
        cpu_count=4) == PipelineConfig(decode_threads=3, torch_threads=1, bulk_processes=1).threads(cpu_count=4)
    with pytest.raises(ValueError):
        PipelineConfig(decode_threads=0)
    with pytest.raises(ValueError):
        PipelineConfig(bulk_processes=0)


def test_thread_settings_are_applied(random_config, encoder):
    """The runner's pool has the planned decode threads; a forward pass runs on the planned torch
    threads, even in a process that holds encoders of other settings."""
    from workers.model import ClipEncoder

    cfg = random_config.replace(torch_threads=1, decode_threads=3)
    one = ClipEncoder(cfg)
    holder = EncoderHolder(cfg)
    holder._encoder = one
    r = BatchRunner(cfg, holder)
    try:
        assert r._pool._max_workers == 3 == r.threads.decode
        seen = []
        one.model.visual.register_forward_pre_hook(lambda *a: seen.append(torch.get_num_threads()))
        encoder.encode_images(torch.zeros(1, 3, 224, 224))  # the session's encoder: its own count
        one.encode_images(torch.zeros(1, 3, 224, 224))
        assert seen == [1]
    finally:
        r.close()
        torch.set_num_threads(encoder.torch_threads)
    assert cv2.getNumThreads() == 1  # OpenCV's own pool off: the decode pool is the parallelism


def test_bulk_worker_processes_follow_the_setting():
    assert " -P prefork -c 2 " in processes.commands({})["worker-bulk"]
    assert " -P prefork -c 3 " in processes.commands({"BULK_PROCESSES": "3"})["worker-bulk"]
    assert pipeline_config({"BULK_PROCESSES": "3"}).bulk_processes == 3


def test_concurrent_prepares_share_the_pool_without_mixing_images(runner):
    """Several callers (interactive task threads, a run_many helper) prepare at once: each gets
    exactly its own images back."""
    blobs = {f"c{i}": jpeg(300 + i) for i in range(16)}
    keys = list(blobs)
    groups = [keys[i::4] for i in range(4)]
    out: dict[int, list[str]] = {}

    def prepare(i):
        out[i] = [m.key for m in runner.prepare(groups[i], loader_for(blobs)).metas]

    threads = [threading.Thread(target=prepare, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(4)] == groups


@pytest.mark.parametrize("overlapped", [False, True])
def test_before_pass_holds_decoding_and_the_model_while_it_waits(runner, random_config, overlapped):
    """``run(micro_batch=..., before_pass=...)`` (a migration giving way to interactive work): the
    hook runs before every pass's preparation (sequential passes: a CPU model whose configuration
    plans no overlap), or before the first preparation and before every forward pass (overlapped:
    ``config.micro_batch`` set); while it blocks no image is loaded and no pass runs; what it waited
    is ``paused_ms``; the vectors are a single pass's."""
    if overlapped:
        runner = BatchRunner(random_config.replace(micro_batch=4, decode_threads=2), runner.encoder)
    assert runner.overlaps is overlapped
    blobs = blobs_with_bad_ones(10)
    keys = list(blobs)
    lock, loads, pauses = threading.Lock(), [], []
    load = loader_for(blobs)

    def loader(key):
        with lock:
            loads.append(time.perf_counter())
        return load(key)

    def before_pass() -> float:
        t0 = time.perf_counter()
        time.sleep(0.15)
        pauses.append((t0, time.perf_counter()))
        return (pauses[-1][1] - t0) * 1000

    whole = runner.run(keys, load)
    split = runner.run(keys, loader, micro_batch=4, before_pass=before_pass)
    # overlapped: before the first preparation, then before each of the 3 passes; else before each pass
    assert len(pauses) == (1 + 3 if overlapped else 3)
    assert not [t for t in loads for a, b in pauses if a < t < b]
    assert split.paused_ms == pytest.approx(sum(b - a for a, b in pauses) * 1000, rel=1e-6)
    assert split.timings.total >= split.paused_ms
    assert [m.key for m in split.metas] == [m.key for m in whole.metas]
    np.testing.assert_allclose(split.vectors, whole.vectors, atol=1e-4)
    # a chunk no larger than one pass: the hook runs once
    pauses.clear()
    one = runner.run(keys[:3], loader, micro_batch=4, before_pass=before_pass)
    assert len(pauses) == 1 and one.paused_ms > 100
