"""``manage.py worker_drain`` (a pod's preStop) against a worker that does not answer: nothing to
drain, and it says so at once. Draining a real worker mid-chunk is in tests/e2e/test_drain.py."""
from __future__ import annotations

import json
import time

from django.core.management import call_command

from embeddings.services.drain import worker_drain


def test_a_worker_that_does_not_answer_has_nothing_to_drain():
    started = time.monotonic()
    report = worker_drain(node="bulk@no-such-host", wait_s=30, timeout_s=0.5)
    assert report == {"node": "bulk@no-such-host", "queues": [], "idle": False, "waited_s": 0.0, "active": 0}
    assert time.monotonic() - started < 10  # one unanswered inspect, not the whole wait


def test_the_command_names_this_hosts_worker(capsys, monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "pod-7")
    call_command("worker_drain", "--name", "fetch", "--wait", "1")
    assert json.loads(capsys.readouterr().out)["node"] == "fetch@pod-7"
