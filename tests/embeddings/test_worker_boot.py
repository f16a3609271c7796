"""Bulk yields at the CPU: a worker that consumes only the bulk queue lowers its priority at start
(``BULK_WORKER_NICE``, default 19; with ``BULK_WORKER_SCHED_IDLE`` also Linux's ``SCHED_IDLE`` policy)
so the kernel runs interactive work, the web and the vectors worker first; every other worker keeps
its priority; ``WORKER_NICE`` overrides the niceness for any worker."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embeddings.tasks import worker_idle_policy, worker_niceness
from project import lanes
from tests.conftest import ROOT


@pytest.mark.parametrize("queues,nice", [
    (lanes.BULK, 19), ([lanes.BULK], 19), (f" {lanes.BULK} ", 19),
    (lanes.INTERACTIVE, 0), (lanes.VECTORS, 0), (f"{lanes.INTERACTIVE},{lanes.BULK}", 0),  # deployment (b)
    ([lanes.INTERACTIVE, lanes.BULK], 0), (None, 0),
])
def test_only_a_bulk_only_worker_is_niced_by_default(settings, queues, nice):
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


def run_init(queues, **env_vars) -> tuple[int, list[int]]:
    """The process niceness and the scheduling policy of each of its threads after Celery's
    ``celeryd_init`` signal for a worker started with ``-Q queues`` (one thread started before it)."""
    code = ("import os, threading, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'project.settings');"
            "django.setup(); from celery.signals import celeryd_init; import embeddings.tasks;"
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
