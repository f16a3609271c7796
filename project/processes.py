"""The command line of every process of the service, built from ``project.lanes``.

One source for ``scripts/stack.py`` (which starts them for ``make demo`` and the end-to-end tests),
``Procfile`` (``honcho start``) and docker-compose.yml (``tests/test_processes.py`` checks both
match). Import-light: no Django, Celery or torch. The variables that size the command lines
(``INTERACTIVE_THREADS``, ``BULK_PROCESSES``, ``WEB_*``) are declared in ``project/configuration.py``.

Why each worker is shaped as it is:
- interactive: ``threads`` pool so one process holds one model and one dynamic batcher, task
  threads hand it their images; concurrency ``INTERACTIVE_THREADS`` = two of the largest
  interactive batches, prefetch 1: while one batch is in the model, the next batch's tasks are
  fetched and decoded, so under load every pass is full. With one batch's worth of threads, every
  thread waits on the pass and the next batch is fetched and decoded only after it: passes run half
  full while admission predicts full ones, and admitted requests answer late
  (docs/benchmarks-load.md). Admission counts every started task's images, so the second batch is
  never invisible to it.
- bulk: ``prefork`` with ``BULK_PROCESSES`` children (default 2): the model loads in each child
  after fork (celery/celery#3402), and a child killed mid-chunk is noticed by the parent, which
  rejects the message so it is redelivered (``task_reject_on_worker_lost``). Two children overlap
  the stages: while one runs its chunk's forward pass the other loads, decodes and preprocesses the
  next chunk; each child gets half the cores (``PipelineConfig.threads``), so the two never
  oversubscribe them (docs/benchmarks-bulk.md has the measurements).
- vectors: ``solo``: exactly one process may own embedded Qdrant's folder.
- ``STORE_OWNER=interactive`` (an embedded store): no vectors worker; the interactive worker owns
  the folder and consumes the vectors queue after its own, with :data:`VECTORS_HELD` more threads:
  an upload or a query is embedded, written and searched in one task of one process (one broker hop
  and one process fewer on its path), while bulk writes and the store's other work take turns with
  it (``embeddings.lane_control.store_turns``).
- web: gunicorn ``gthread``, 2 processes × ``WEB_THREADS`` (32) threads. An interactive request
  holds its thread for as long as it waits (up to its deadline), so the threads bound how many
  admitted requests can wait at once: at 6 requests/s and a 5 s deadline about 30 do (rate ×
  deadline), and with fewer threads the rest queue in front of Django, where admission cannot see
  them (docs/benchmarks-load.md). A waiting thread holds no database connection
  (``embeddings.services.interactive.waiting``), so the threads do not multiply PostgreSQL connections.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

from project import configuration, lanes

#: Bytes of the request line (method, URL, protocol) gunicorn reads: its largest value
#: (gunicorn/http/message.py ``MAX_REQUEST_LINE``), above its default 4094 because the site's search form
#: puts the search in the URL; ``embeddings.site.fields.search_maxlengths`` sizes the form to fit.
REQUEST_LINE_BYTES = 8190


#: Vectors-queue messages the interactive worker holds at most when it owns the store: one being
#: written, one on deck (``embeddings.lane_control.bulk_yield.LaneGateCycle``); each gets a thread of
#: its own beside the ``INTERACTIVE_THREADS``, so interactive tasks always find theirs free.
VECTORS_HELD = 2


def worker(queues: tuple[str, ...] | str, *, pool: str, concurrency: int, name: str) -> str:
    """``celery worker`` command line for ``queues`` (listed first = taken first)."""
    q = queues if isinstance(queues, str) else ",".join(queues)
    return (f"celery -A project worker -Q {q} -P {pool} -c {concurrency} -n {name}@%h "
            f"--prefetch-multiplier 1 --without-gossip --without-mingle -l INFO")


def commands(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{process name: command line}`` of the default deployment (one worker per queue), sized from
    ``env`` (default: the environment) through ``project.configuration``."""
    v = configuration.read(env, ("INTERACTIVE_THREADS", "BULK_PROCESSES", "WEB_PORT", "WEB_THREADS", "WEB_BIND",
                                 "FETCH_WORKER_THREADS", "STORE_OWNER", "VECTOR_STORE"))
    cmds = {
        "web": (f"gunicorn project.wsgi -b {v['WEB_BIND']}:{v['WEB_PORT']} -k gthread --workers 2 "
                f"--threads {v['WEB_THREADS']} --timeout 120 --keep-alive 75 --limit-request-line {REQUEST_LINE_BYTES} "
                f"--access-logfile -"),
        "worker-interactive": worker(lanes.INTERACTIVE, pool="threads", concurrency=v["INTERACTIVE_THREADS"],
                                     name="interactive"),
        # BULK_PROCESSES also sizes each child's threads (PipelineConfig.threads)
        "worker-bulk": worker(lanes.BULK, pool="prefork", concurrency=v["BULK_PROCESSES"], name="bulk"),
        "worker-vectors": worker(lanes.VECTORS, pool="solo", concurrency=1, name="vectors"),
        # network-bound (manifests, prefixes, URLs), no model: threads, each handling one chunk
        "worker-fetch": worker(lanes.FETCH, pool="threads", concurrency=v["FETCH_WORKER_THREADS"], name="fetch"),
    }
    if interactive_owns_store(v):
        del cmds["worker-vectors"]
        cmds["worker-interactive"] = worker((lanes.INTERACTIVE, lanes.VECTORS), pool="threads",
                                            concurrency=v["INTERACTIVE_THREADS"] + VECTORS_HELD, name="interactive")
    return cmds


def interactive_owns_store(values: Mapping[str, object]) -> bool:
    """True when ``STORE_OWNER`` is ``interactive`` and the store is embedded (``values``: from
    ``configuration.read``): the interactive worker consumes the vectors queue, no vectors worker runs."""
    return values["STORE_OWNER"] == "interactive" and values["VECTOR_STORE"] != "server"


def shared_worker_command(env: Mapping[str, str] | None = None) -> str:
    """Deployment (b): one worker consuming both lanes, interactive listed (and so taken) first.

    ``threads`` pool with one thread per interactive batch slot plus two for bulk (one chunk
    computing, one on deck): ``embeddings.lane_control.bulk_yield.LaneGateCycle`` stops asking Redis for
    bulk messages while two are held and ``bulk_yield.bulk_turn`` lets one compute at a time, so
    interactive work always finds a free thread and never waits behind more than one bulk batch
    (docs/lanes.md).
    """
    v = configuration.read(env, ("INTERACTIVE_MAX_BATCH_SIZE", "STORE_OWNER", "VECTOR_STORE"))
    if interactive_owns_store(v):
        raise ValueError("STORE_OWNER=interactive is for deployment (a), one worker per lane: the shared worker "
                         "leaves the store to the vectors worker")
    c = v["INTERACTIVE_MAX_BATCH_SIZE"] + 2
    return worker(lanes.EMBED_QUEUES, pool="threads", concurrency=c, name="shared")


def shared_commands(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{process name: command line}`` of deployment (b): web, one ``worker-shared`` for both
    embedding lanes, the vectors worker and the fetch worker."""
    cmds = commands(env)
    return {"web": cmds["web"], "worker-shared": shared_worker_command(env), "worker-vectors": cmds["worker-vectors"],
            "worker-fetch": cmds["worker-fetch"]}


def main() -> None:
    """``python -m project.processes``: print a Procfile."""
    for name, cmd in commands().items():
        sys.stdout.write(f"{name}: {cmd}\n")


if __name__ == "__main__":
    main()
