"""Draining a worker before it stops: what a pod's ``preStop`` runs (``manage.py worker_drain``).

Kubernetes runs the ``preStop`` hook, then sends SIGTERM, and kills the container when its grace
period ends. :func:`worker_drain` makes the first step the useful one: the worker stops taking
messages (Celery's ``cancel_consumer`` remote control, for every queue it consumes) and the hook
waits, at most ``wait_s``, until it runs no task. SIGTERM then finds it idle and it exits at once;
a task still running after the wait is left to SIGTERM's soft shutdown (``WORKER_DRAIN_S`` more,
then handed back to its queue). Messages it never took stay in Redis for the other workers.

The threads and prefork pools answer remote control while their tasks run; the solo pool (the
vectors worker) only between tasks, which are short there (a write slice, a search).
"""
from __future__ import annotations

import time

from project.celery import app


def worker_drain(*, node: str, wait_s: float, poll_s: float = 0.5, timeout_s: float = 2.0) -> dict:
    """Stop worker ``node`` (``"bulk@<hostname>"``) consuming and wait until its tasks are done.

    Args:
        node: the Celery node name (``-n`` of its command line, ``%h`` expanded).
        wait_s: the longest to wait for its running tasks (s).
        poll_s: seconds between two looks at its running tasks.
        timeout_s: how long each remote-control call waits for the worker's reply.

    Returns:
        ``{"node", "queues": [cancelled queue names], "idle": bool, "waited_s": float, "active": n
        tasks still running (0 when idle)}``; ``queues`` empty and ``idle`` False when the worker did
        not answer (gone, or not started): there is nothing to drain then.
    """
    started = time.monotonic()
    inspect = app.control.inspect(destination=[node], timeout=timeout_s)
    answered = (inspect.active_queues() or {}).get(node)
    if answered is None:
        return {"node": node, "queues": [], "idle": False, "waited_s": 0.0, "active": 0}
    queues = [q["name"] for q in answered]
    for queue in queues:
        app.control.cancel_consumer(queue, destination=[node], reply=True, timeout=timeout_s)
    active = None
    while True:
        running = (inspect.active() or {}).get(node)
        active = len(running) if running is not None else active
        if active == 0 or time.monotonic() - started >= wait_s:
            break
        time.sleep(poll_s)
    return {"node": node, "queues": queues, "idle": active == 0, "waited_s": round(time.monotonic() - started, 2),
            "active": active or 0}
