"""Bulk yields at the CPU: a worker that consumes only the bulk queue lowers its priority at start
(``BULK_WORKER_NICE``, default 19) so the kernel runs interactive work, the web and the vectors
worker first; every other worker keeps its priority; ``WORKER_NICE`` overrides for any worker."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embeddings.tasks import worker_niceness
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


def run_init(queues) -> int:
    """The process niceness after Celery's ``celeryd_init`` signal for a worker started with ``-Q queues``."""
    code = ("import os, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'project.settings'); django.setup();"
            "from celery.signals import celeryd_init; import embeddings.tasks;"
            f"celeryd_init.send(sender='w@h', instance=None, conf=None, options={{'queues': {queues!r}}});"
            "print(os.nice(0))")
    env = {k: v for k, v in os.environ.items() if k not in ("WORKER_NICE", "BULK_WORKER_NICE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_the_signal_really_lowers_a_bulk_workers_priority():
    base = os.nice(0)
    assert run_init([lanes.BULK]) == 19
    assert run_init([lanes.INTERACTIVE]) == base
    assert run_init([lanes.INTERACTIVE, lanes.BULK]) == base
