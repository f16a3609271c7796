"""A worker's boot-up (``embeddings/worker_boot.py``).

Bulk yields at the CPU: a worker that consumes only the bulk queue lowers its priority at start
(``BULK_WORKER_NICE``, default 19; with ``BULK_WORKER_SCHED_IDLE`` also Linux's ``SCHED_IDLE`` policy)
so the kernel runs interactive work, the web and the vectors worker first; every other worker keeps
its priority; ``WORKER_NICE`` overrides the niceness for any worker. The ``celeryd_init`` handler is
connected by ``django.setup()`` alone (``EmbeddingsConfig.ready``), as in a worker.

At ``worker_ready``: a bulk worker warns about emulated bf16, an interactive worker with threads
loads its model or refuses to start, the vectors worker starts the reconciler."""
from __future__ import annotations

import os
import subprocess
import sys

from types import SimpleNamespace

import pytest

from embeddings import worker_boot
from embeddings.worker_boot import worker_idle_policy, worker_niceness
from project import lanes
from tests.conftest import ROOT


@pytest.mark.parametrize("queues,nice", [
    (lanes.BULK, 19), ([lanes.BULK], 19), (f" {lanes.BULK} ", 19),
    (lanes.INTERACTIVE, 0), (lanes.VECTORS, 0), (f"{lanes.INTERACTIVE},{lanes.BULK}", 0),  # deployment (b)
    ([lanes.INTERACTIVE, lanes.BULK], 0), (None, 0),
    (lanes.FETCH, 19), (f"{lanes.BULK},{lanes.FETCH}", 19), (f"{lanes.INTERACTIVE},{lanes.FETCH}", 0),  # issue 41
])
def test_only_a_bulk_only_worker_is_niced_by_default(settings, queues, nice):
    """Bulk work (embedding chunks, reading and fetching catalogues) never takes a core from the
    interactive lane: a worker of nothing else is niced."""
    settings.WORKER_NICE, settings.BULK_WORKER_NICE = 0, 19
    assert worker_niceness(queues) == nice


def test_worker_nice_wins_and_bulk_worker_nice_zero_turns_it_off(settings):
    settings.WORKER_NICE, settings.BULK_WORKER_NICE = 7, 19
    assert worker_niceness(lanes.INTERACTIVE) == worker_niceness(lanes.BULK) == 7
    settings.WORKER_NICE, settings.BULK_WORKER_NICE = 0, 0
    assert worker_niceness(lanes.BULK) == 0


@pytest.mark.parametrize("queues,idle", [
    (lanes.BULK, True), ([lanes.BULK], True), (lanes.INTERACTIVE, False), (lanes.VECTORS, False),
    (f"{lanes.INTERACTIVE},{lanes.BULK}", False), (None, False),
])
def test_only_a_bulk_only_worker_runs_under_sched_idle(settings, queues, idle):
    settings.BULK_WORKER_SCHED_IDLE = True
    assert worker_idle_policy(queues) is idle
    settings.BULK_WORKER_SCHED_IDLE = False
    assert worker_idle_policy(queues) is False


@pytest.mark.parametrize("owner,store,queues,refused", [
    ("vectors", "edge", lanes.VECTORS, False), ("vectors", "edge", lanes.INTERACTIVE, False),
    ("interactive", "edge", f"{lanes.INTERACTIVE},{lanes.VECTORS}", False),
    ("interactive", "edge", lanes.VECTORS, True),  # a vectors worker beside the owner
    ("interactive", "edge", lanes.INTERACTIVE, True),  # the owner without the vectors queue
    ("interactive", "local", lanes.VECTORS, True),
    ("interactive", "edge", lanes.BULK, False), ("interactive", "edge", lanes.FETCH, False),
    ("interactive", "server", lanes.VECTORS, False),  # no owner: every process opens a server
])
def test_a_worker_whose_queues_contradict_the_store_owner_refuses_to_start(settings, owner, store, queues, refused):
    """``STORE_OWNER=interactive``: the interactive worker consumes the vectors queue; a worker with
    one of the two queues alone stops before its pool starts (``EX_CONFIG``), with the reason logged."""
    from embeddings.checks import EX_CONFIG

    settings.STORE_OWNER, settings.VECTOR_STORE = owner, store
    assert (worker_boot.store_owner_refusal(queues) is not None) is refused
    if refused:
        with pytest.raises(SystemExit) as stopped:
            worker_boot.refuse_a_second_store_owner(options={"queues": queues})
        assert stopped.value.code == EX_CONFIG
    else:
        worker_boot.refuse_a_second_store_owner(options={"queues": queues})


def run_init(queues, **env_vars) -> tuple[int, list[int]]:
    """The process niceness and the scheduling policy of each of its threads after Celery's
    ``celeryd_init`` signal for a worker started with ``-Q queues`` (one thread started before it)."""
    code = ("import os, threading, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'project.settings');"
            "django.setup(); from celery.signals import celeryd_init;"
            "ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start();"
            f"celeryd_init.send(sender='w@h', instance=None, conf=None, options={{'queues': {queues!r}}});"
            "print(os.nice(0), *(os.sched_getscheduler(int(tid)) for tid in os.listdir('/proc/self/task')));"
            "ev.set()")
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_NICE", "BULK_WORKER_NICE", "BULK_WORKER_SCHED_IDLE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, **env_vars}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nice, *policies = map(int, out.stdout.split("\n")[-2].split())
    return nice, policies


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_signal_really_lowers_a_bulk_workers_priority():
    base = os.nice(0)
    nice, policies = run_init([lanes.BULK])  # the default: niceness only
    assert nice == 19 and len(policies) >= 2 and os.SCHED_IDLE not in policies
    nice, policies = run_init([lanes.BULK], BULK_WORKER_SCHED_IDLE="1")
    assert nice == 19 and len(policies) >= 2 and set(policies) == {os.SCHED_IDLE}  # every thread, not only the caller
    for queues in ([lanes.INTERACTIVE], [lanes.INTERACTIVE, lanes.BULK]):
        nice, policies = run_init(queues, BULK_WORKER_SCHED_IDLE="1")
        assert nice == base and os.SCHED_IDLE not in policies


@pytest.mark.parametrize("queues,kept", [
    ([lanes.BULK], True), ([lanes.INTERACTIVE, lanes.BULK], True), ([lanes.INTERACTIVE], False),
    ([lanes.VECTORS], False), ([lanes.FETCH], False),
])
def test_a_worker_that_consumes_the_bulk_queue_keeps_its_chunks_memory(settings, monkeypatch, queues, kept):
    """Its chunks' model inputs are hundreds of MB; the limit is the setting's (0: glibc's defaults)."""
    calls = []
    monkeypatch.setattr(worker_boot, "keep_batch_memory", calls.append)
    monkeypatch.setattr(worker_boot.os, "nice", lambda n: None)
    settings.BULK_BATCH_MEMORY_MB, settings.BULK_WORKER_SCHED_IDLE = 768, False
    worker_boot.lower_cpu_priority(options={"queues": queues})
    assert calls == ([768] if kept else [])


def worker(*queues, pool: str = "celery.concurrency.thread"):
    """A started worker as ``worker_ready`` sends it: the queues it consumes and its pool's module."""
    return SimpleNamespace(task_consumer=SimpleNamespace(queues=[SimpleNamespace(name=q) for q in queues]),
                           pool=type("TaskPool", (), {"__module__": pool})())


def test_a_bulk_worker_warns_at_start_when_its_bf16_is_emulated(settings, monkeypatch, caplog):
    """Issue 9 (6): the bulk worker's children load the model lazily, so its parent says it at start
    (from /proc/cpuinfo, without torch); an interactive worker says it when it loads the model."""
    from workers import config as config_module

    monkeypatch.setattr(config_module, "detect_hardware", lambda cuda=False: config_module.Hardware(
        cpu_model="AMD EPYC 7B13", cpu_flags=frozenset({"avx2"})))
    settings.PIPELINE = config_module.PipelineConfig(pretrained="random", precision="bf16")
    with caplog.at_level("WARNING", logger="embeddings.worker_boot"):
        worker_boot.warn_emulated_precision(worker(lanes.BULK))
        worker_boot.warn_emulated_precision(worker(lanes.VECTORS))
        worker_boot.warn_emulated_precision(worker(lanes.INTERACTIVE, lanes.BULK))  # its model load says it
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "CLIP_PRECISION=bf16" in caplog.records[0].getMessage() and "AMD EPYC 7B13" in caplog.text
    caplog.clear()
    settings.PIPELINE = settings.PIPELINE.replace(precision="fp32")
    worker_boot.warn_emulated_precision(worker(lanes.BULK))
    assert caplog.records == []


@pytest.fixture
def warmers(monkeypatch) -> list[int]:
    """Counts the space-warmer threads started (none runs: its loop never ends)."""
    started: list[int] = []
    monkeypatch.setattr(worker_boot, "_start_space_warmer", lambda: started.append(1))
    return started


def test_an_interactive_worker_with_threads_loads_its_model_at_start(service, warmers):
    from embeddings import runtime

    worker_boot.warm_model(worker(lanes.BULK))
    worker_boot.warm_model(worker(lanes.INTERACTIVE, pool="celery.concurrency.prefork"))  # children load lazily
    assert (runtime.dynamic_batcher.cache_info().currsize, warmers) == (0, [])
    worker_boot.warm_model(worker(lanes.INTERACTIVE, pool="celery.concurrency.solo"))
    assert runtime.dynamic_batcher.cache_info().currsize == 1 and warmers == [1]


def test_an_interactive_worker_that_cannot_load_its_model_refuses_to_start(service, warmers, monkeypatch):
    from embeddings import runtime
    from embeddings.checks import EX_CONFIG

    def missing(model_id):
        raise FileNotFoundError("/weights/ViT-B-32.pt")

    monkeypatch.setattr(runtime.batch_runner, "_build", missing)  # the checkpoint file is gone
    with pytest.raises(SystemExit) as e:
        worker_boot.warm_model(worker(lanes.INTERACTIVE))
    assert e.value.code == EX_CONFIG == 78 and warmers == []


def test_only_the_vectors_worker_starts_the_reconciler(settings, monkeypatch):
    from embeddings.services import reconcile

    started: list[float] = []
    monkeypatch.setattr(reconcile, "reconciler_start", lambda *, interval_s: started.append(interval_s))
    settings.RECONCILE_INTERVAL_S = 30.0
    for queues in ([lanes.INTERACTIVE], [lanes.BULK], [lanes.INTERACTIVE, lanes.BULK]):
        worker_boot.start_reconciler(worker(*queues))
    assert started == []
    worker_boot.start_reconciler(worker(lanes.VECTORS))
    assert started == [30.0]
    settings.RECONCILE_INTERVAL_S = 0  # off
    worker_boot.start_reconciler(worker(lanes.VECTORS))
    assert started == [30.0]


def test_only_the_vectors_worker_freezes_its_start_up_heap(monkeypatch):
    """The store's owner moves its start-up objects out of the collector's full passes (``gc.freeze``),
    which a bulk chunk's write would otherwise set off every few chunks; no other worker does."""
    import gc

    frozen: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    for queues in ([lanes.BULK], [lanes.INTERACTIVE], [lanes.FETCH]):
        worker_boot.freeze_start_up_heap(worker(*queues))
    assert frozen == []
    worker_boot.freeze_start_up_heap(worker(lanes.VECTORS, pool="celery.concurrency.solo"))
    assert frozen == [1]
