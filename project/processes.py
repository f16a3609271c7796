"""The command line of every process of the service, built from ``project.lanes``.

One source for ``scripts/stack.py`` (which starts them for ``make demo`` and the end-to-end tests),
``Procfile`` (``honcho start``) and docker-compose.yml (``tests/test_processes.py`` checks both
match). Import-light: no Django, Celery or torch.

Why each worker is shaped as it is:
- interactive: ``threads`` pool so one process holds one model and one dynamic batcher, task
  threads hand it their images; concurrency ``INTERACTIVE_THREADS`` = two of the largest
  interactive batches, prefetch 1: while one batch is in the model, the next batch's tasks are
  fetched and decoded, so under load every pass is full. With one batch's worth of threads, every
  thread waited on the pass and the next batch was fetched and decoded only after it: passes of
  about four alternated, and at a 5 s deadline the lane served 17 % of admitted requests late,
  predicted for full passes (docs/benchmarks-load.md). Admission counts every started task's
  images, so the second batch is never invisible to it.
- bulk: ``prefork`` with ``BULK_PROCESSES`` children (default 2): the model loads in each child
  after fork (celery/celery#3402), and a child killed mid-chunk is noticed by the parent, which
  rejects the message so it is redelivered (``task_reject_on_worker_lost``). Two children overlap
  the stages: while one runs its chunk's forward pass the other loads, decodes and preprocesses the
  next chunk; each child gets half the cores (``PipelineConfig.threads``), so the two never
  oversubscribe them (docs/benchmarks-bulk.md has the measurements).
- vectors: ``solo``: exactly one process may own embedded Qdrant's folder.
- web: gunicorn ``gthread``, 2 processes × ``WEB_THREADS`` (32) threads. An interactive request
  holds its thread for as long as it waits (up to its deadline), so the threads bound how many
  admitted requests can wait at once: at 6 requests/s and a 5 s deadline about 30 do, and with 16
  threads the rest queued in front of Django, where admission cannot see them (measured,
  docs/benchmarks-load.md). A waiting thread holds no database connection
  (``embeddings.services.upload``), so the threads do not multiply PostgreSQL connections.
"""
from __future__ import annotations

import os
import sys

from project import lanes


def worker(queues: tuple[str, ...] | str, *, pool: str, concurrency: int, name: str) -> str:
    """``celery worker`` command line for ``queues`` (listed first = taken first)."""
    q = queues if isinstance(queues, str) else ",".join(queues)
    return (f"celery -A project worker -Q {q} -P {pool} -c {concurrency} -n {name}@%h "
            f"--prefetch-multiplier 1 --without-gossip --without-mingle -l INFO")


def commands(env: dict | None = None) -> dict[str, str]:
    """``{process name: command line}`` of the default deployment (one worker per queue)."""
    env = os.environ if env is None else env
    interactive_c = int(env.get("INTERACTIVE_THREADS", 2 * int(env.get("INTERACTIVE_MAX_BATCH_SIZE", "8"))))
    bulk_c = int(env.get("BULK_PROCESSES", "2"))  # the same variable sizes each child's threads
    web_port = env.get("WEB_PORT", "8000")
    web_threads = int(env.get("WEB_THREADS", "32"))
    web_bind = env.get("WEB_BIND", "127.0.0.1")
    return {
        "web": (f"gunicorn project.wsgi -b {web_bind}:{web_port} -k gthread --workers 2 --threads {web_threads} "
                f"--timeout 120 --keep-alive 75 --access-logfile -"),
        "worker-interactive": worker(lanes.INTERACTIVE, pool="threads", concurrency=interactive_c, name="interactive"),
        "worker-bulk": worker(lanes.BULK, pool="prefork", concurrency=bulk_c, name="bulk"),
        "worker-vectors": worker(lanes.VECTORS, pool="solo", concurrency=1, name="vectors"),
    }


def shared_worker_command(env: dict | None = None) -> str:
    """Deployment (b): one worker consuming both lanes, interactive listed (and so taken) first.

    ``threads`` pool with one thread per interactive batch slot plus two for bulk (one chunk
    computing, one on deck): ``embeddings.lane_control.bulk_yield.LaneGateCycle`` stops asking Redis for
    bulk messages while two are held and ``bulk_yield.bulk_turn`` lets one compute at a time, so
    interactive work always finds a free thread and never waits behind more than one bulk batch
    (docs/lanes.md).
    """
    env = os.environ if env is None else env
    c = int(env.get("INTERACTIVE_MAX_BATCH_SIZE", "8")) + 2
    return worker(lanes.EMBED_QUEUES, pool="threads", concurrency=c, name="shared")


def shared_commands(env: dict | None = None) -> dict[str, str]:
    """``{process name: command line}`` of deployment (b): web, one ``worker-shared`` for both
    embedding lanes, and the vectors worker."""
    cmds = commands(env)
    return {"web": cmds["web"], "worker-shared": shared_worker_command(env), "worker-vectors": cmds["worker-vectors"]}


def main() -> None:
    """``python -m project.processes``: print a Procfile."""
    for name, cmd in commands().items():
        sys.stdout.write(f"{name}: {cmd}\n")


if __name__ == "__main__":
    main()
