"""``make run`` (``python -m scripts.stack``) stopped by a signal sent to the script alone.

Every process the stack starts runs in its own session, so SIGTERM or SIGHUP sent to the script
never reaches them: the script has to stop them itself, exactly as it does on Ctrl-C, or gunicorn,
the Celery workers and the private Redis are orphaned. Real processes: a private redis-server,
gunicorn, three Celery workers, the ViT-B-32 architecture with seeded random weights.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from scripts.stack import free_port
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]

READY_S = 120  # the stack starts in ~15 s here; generous for a loaded machine
STOP_S = 60  # Stack.stop waits at most 20 s per group of processes before SIGKILL


def alive(procs: list[psutil.Process]) -> list[str]:
    """``"pid name"`` of each process in ``procs`` that still runs (a zombie has exited)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
    return out


def end(procs: list[psutil.Process]) -> None:
    """Clean up after a failure: SIGKILL whatever is left."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_signal_stops_the_whole_stack(tmp_path, sig):
    # No Redis answers at REDIS_URL (a port nobody listens on), so the script starts its own.
    env = {**os.environ, "VAR_DIR": str(tmp_path), "CLIP_PRETRAINED": "random", "DATABASE_URL": "",
           "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "WEB_PORT": str(free_port()),
           "DJANGO_DEBUG": "0", "PYTHONUNBUFFERED": "1"}
    env.setdefault("DJANGO_SECRET_KEY", "test-stack-signals-" + "x" * 40)
    env.pop("METRICS_DIR", None)
    script = subprocess.Popen([sys.executable, "-m", "scripts.stack"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()
    urls: list[str] = []

    def read() -> None:
        for line in script.stdout:
            lines.append(line)
            m = re.search(r"web at (http://\S+?);", line)
            if m:
                urls.append(m.group(1))
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + READY_S
        while not ready.wait(0.5):
            assert script.poll() is None, f"scripts.stack exited with {script.returncode}:\n{''.join(lines)}"
            assert time.monotonic() < deadline, f"not ready after {READY_S} s:\n{''.join(lines)}"
        assert urllib.request.urlopen(urls[0] + "/healthz", timeout=10).status == 200
        assert "started a private Redis" in "".join(lines)

        descendants = psutil.Process(script.pid).children(recursive=True)
        names = [" ".join(p.cmdline()) for p in descendants]
        assert any("redis-server" in n for n in names), names
        assert any("gunicorn" in n for n in names), names
        for worker in ("interactive", "bulk", "vectors"):
            assert any(f"-n {worker}@" in n for n in names), (worker, names)

        script.send_signal(sig)
        try:
            rc = script.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"scripts.stack still runs {STOP_S} s after {signal.Signals(sig).name}:\n{''.join(lines)}")
        reader.join(5)
        assert rc == 0, "".join(lines)
        assert f"{signal.Signals(sig).name}: stopping" in "".join(lines)
        # Grandchildren (gunicorn's and the bulk worker's children) are reaped by their own parents
        # or, once orphaned, by init: give that a moment before calling one alive.
        until = time.monotonic() + 2
        while alive(descendants) and time.monotonic() < until:
            time.sleep(0.1)
        assert alive(descendants) == [], "left running after the script exited"
    finally:
        if script.poll() is None:
            descendants = descendants or psutil.Process(script.pid).children(recursive=True)
            script.kill()
            script.wait()
        end(descendants)
