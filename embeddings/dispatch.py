"""Sending work to the queues: the one module that knows which task runs on which queue, at which
priority, with which expiry. Services call it; it never imports ``embeddings.tasks``: it names
tasks (``embeddings.tasks.<name>``) and lets Celery look them up, so imports run one way
(tasks → services → dispatch) and a service never depends on the task module
(``tests/test_import_direction.py``). The option helpers (``*_options``) are the same ones the
tasks module re-exports.
"""
from __future__ import annotations

import datetime as dt
import logging

from celery import chain
from celery.canvas import Signature
from kombu.exceptions import OperationalError

from embeddings import bulk_schedule, metrics
from project import lanes
from project.celery import app
from project.results import RESULT_DEADLINE_HEADER

#: Module whose tasks this names (``embeddings/tasks.py``; registered by Celery's autodiscovery).
TASKS = "embeddings.tasks"


def bulk_options(priority: str) -> dict:
    """``apply_async`` options for a bulk chunk of a job with ``priority`` (urgent/background)."""
    p = lanes.PRIORITY_BULK_URGENT if priority == "urgent" else lanes.PRIORITY_BULK_BACKGROUND
    return {"queue": lanes.BULK, "priority": p}


def expires_at(deadline_ts: float) -> dt.datetime:
    """``apply_async(expires=...)`` for a deadline (Unix s): a timezone-aware UTC datetime.

    Celery reads a *number* as seconds from now (``expires=deadline_ts + 60`` meant about the year
    2082); only an aware datetime is an absolute time. A worker that receives a message after it
    discards it unrun (state ``REVOKED``, log ``Discarding revoked task``), and checks again just
    before it runs.
    """
    return dt.datetime.fromtimestamp(deadline_ts, tz=dt.timezone.utc)


def read_by(deadline_ts: float) -> dict:
    """``apply_async`` options for a task whose result someone waits for until ``deadline_ts``
    (Unix s): the result backend keeps its result no longer than that (``project.results``), read
    or not; the reader forgets it at once (``services.interactive.waiting``)."""
    return {"headers": {RESULT_DEADLINE_HEADER: deadline_ts}}


#: ``apply_async`` option for a task whose result nobody reads: an inner step of a chain hands its
#: value to the next step inside that step's message, so storing it too would only leave a key
#: (with the query vector) in Redis. Its failure is still stored (``store_errors_even_if_ignored``
#: on the task), so the chain's last result reports it.
UNREAD = {"ignore_result": True}


def interactive_options(deadline_ts: float) -> dict:
    """Options for interactive work: highest priority; the message expires at its deadline (Unix
    s), when the person who sent it has had their answer (``deadline_exceeded`` or ``202``), so a
    worker that comes back after an outage never computes stale work ahead of fresh. The task
    itself also refuses to compute once the deadline has passed (a message received just before
    it, then waiting for a thread or for the batcher). Its result is kept until the deadline at
    most (:func:`read_by`)."""
    return {"queue": lanes.INTERACTIVE, "priority": lanes.PRIORITY_INTERACTIVE, "expires": expires_at(deadline_ts),
            **read_by(deadline_ts)}


def vectors_options(*, interactive: bool, priority: str = "background", deadline_ts: float | None = None) -> dict:
    """Options for vector-store work; searches and interactive writes go before bulk writes.

    Args:
        deadline_ts: Unix s after which nobody waits for the result: the message then expires
            (searches), and so does its result (:func:`read_by`). Never for writes: an interactive
            upload's outcome is recorded whatever the time (its images end embedded or
            ``expired``), a bulk chunk has no deadline here.
    """
    if interactive:
        p = lanes.PRIORITY_INTERACTIVE
    else:
        p = lanes.PRIORITY_BULK_URGENT if priority == "urgent" else lanes.PRIORITY_BULK_BACKGROUND
    options = {"queue": lanes.VECTORS, "priority": p}
    if deadline_ts is not None:
        options.update(expires=expires_at(deadline_ts), **read_by(deadline_ts))
    return options


def task(name: str, *args, immutable: bool = False, **options) -> Signature:
    """The signature of task ``embeddings.tasks.<name>`` with ``args`` and message ``options``
    (queue, priority, expires), by name: Celery resolves it where it is sent or run (for chains)."""
    _registered(name)
    return app.signature(f"{TASKS}.{name}", args=args, immutable=immutable, options=options)


def send(name: str, args: tuple, kwargs: dict | None = None, **options):
    """Send one message to task ``embeddings.tasks.<name>``: through the task object where this
    process has it (a worker; eager runs), else by name (``send_task``: the web process). Both
    apply the same ``options``. Returns its ``AsyncResult``."""
    call = {"args": args, **options} if kwargs is None else {"args": args, "kwargs": kwargs, **options}
    registered = _registered(name)
    if registered is not None:
        return registered.apply_async(**call)
    return app.send_task(f"{TASKS}.{name}", **call)


def forget(result) -> None:
    """Delete a task's stored result and its chain's (``AsyncResult.forget``: the parents too) and
    stop listening for it: nothing a request waited for stays in Redis once it is read. A result
    not stored yet (the deadline passed first) is written later with its deadline's expiry
    (:func:`read_by`). Never raises: a broken connection leaves the keys to that expiry."""
    try:
        result.forget()
    except Exception as e:  # noqa: BLE001 - the answer is known; the keys expire by themselves
        logging.getLogger(__name__).warning("could not forget result %s: %s", getattr(result, "id", "?"), e)


def run_here(name: str, *args):
    """Run task ``embeddings.tasks.<name>(*args)`` in this process, now, and return its result:
    store work done by the caller itself when the store is a shared server (``services.sink``)."""
    registered = _registered(name, load=True)
    if registered is None:
        raise KeyError(f"no task {TASKS}.{name}")
    return registered(*args)


def _registered(name: str, *, load: bool = False):
    """The task object of ``embeddings.tasks.<name>`` if this process has loaded it, else None.
    Run eagerly (tests, scripts) or here (``load``) it must be: Celery's autodiscovery imports the
    task modules."""
    if (load or app.conf.task_always_eager) and f"{TASKS}.{name}" not in app.tasks:
        app.loader.import_default_modules()
    return app.tasks.get(f"{TASKS}.{name}")


# --- bulk lane -----------------------------------------------------------------------------------

def send_chunk(*, job_id: str, image_ids: list[str], priority: str):
    """Queue one bulk chunk (``embed_chunk``) of a job with ``priority``: on the bulk queue now
    (``BULK_SCHEDULER=fifo``), or as a pending chunk that the fair scheduler sends in its turn
    (``fair``: :func:`send_job_chunks`)."""
    if bulk_schedule.enabled():
        bulk_schedule.chunks_add(job_id=job_id, chunks=[image_ids])
        bulk_pump()
        return None
    return send("embed_chunk", (job_id, image_ids), **bulk_options(priority))


def send_job_chunks(*, job, image_ids: list[str]) -> int:
    """Queue ``image_ids`` of ``job`` (a ``Job``) in chunks of ``job.chunk_size`` at the job's
    priority: each sent now on the bulk queue (``BULK_SCHEDULER=fifo``), or stored as the job's
    pending chunks (one INSERT) and the window filled from the lane's order (``fair``:
    ``embeddings.bulk_schedule``). Returns the chunk count."""
    size = job.chunk_size
    chunks = [image_ids[i : i + size] for i in range(0, len(image_ids), size)]
    if bulk_schedule.enabled():
        if chunks:
            bulk_schedule.chunks_add(job_id=job.id, chunks=chunks)
            bulk_pump()
        return len(chunks)
    for chunk in chunks:
        send_chunk(job_id=str(job.id), image_ids=chunk, priority=job.priority)
    return len(chunks)


def _send_scheduled(chunk: bulk_schedule.Claimed):
    """Put a chunk the fair scheduler claimed on the bulk queue; its row id travels with it, so its
    finish hands its place in the window on (:func:`bulk_chunk_done`)."""
    return send("embed_chunk", (chunk.job_id, chunk.image_ids), {"chunk_id": chunk.chunk_id},
                **bulk_options(chunk.priority))


def bulk_pump(*, own: int | None = None, done: tuple[str, int] | None = None) -> int:
    """Fill the fair scheduler's window (``bulk_schedule.pump``): after a chunk finished (``own``:
    its row; ``done``: ``(job id, images)``), when chunks were added, when a job resumed, and in
    each reconciler round. Returns chunks sent; 0 under ``BULK_SCHEDULER=fifo``."""
    if not bulk_schedule.enabled():
        return 0
    return bulk_schedule.pump(send=_send_scheduled, own=own, done=done,
                              on_pick=lambda view, rule: metrics.count_bulk_pick(rule),
                              on_done=lambda view, n: metrics.count_bulk_chunk(
                                  priority="urgent" if view.urgent else "background", owner=view.owner, n=n))


def bulk_chunk_done(*, job_id: str, chunk_id: int | None, images: int, seconds: float, computed: int) -> int:
    """A bulk chunk of ``images`` ids finished (or failed, or was parked), ``computed`` of them run
    through the model in ``seconds``: under the fair scheduler the lane's rate learns from it, and
    the chunk's place in the window goes to the next chunk. A chunk sent without a row (``fifo``,
    or by hand) teaches the rate only. Returns chunks sent."""
    if not bulk_schedule.enabled():
        return 0
    bulk_schedule.lane_rate.add(images=computed, seconds=seconds)
    if chunk_id is None:
        return 0
    try:
        return bulk_pump(own=chunk_id, done=(job_id, images))
    except OperationalError as e:  # the chunk's own outcome stands; a claimed row is released after the grace
        logging.getLogger(__name__).warning("bulk chunk %s: the next chunk was not sent (%s); the reconciler refills "
                                            "the window", chunk_id, e)
        return 0


def fetch_options(priority: str) -> dict:
    """Options for catalogue-source work (reading a manifest or prefix, fetching a chunk's URLs and
    objects): the ``fetch`` queue, at the job's bulk priority."""
    return {**bulk_options(priority), "queue": lanes.FETCH}


def send_fetch_chunk(*, job_id: str, image_ids: list[str], priority: str):
    """Queue one chunk of unfetched rows (``fetch_chunk``) of a job on the fetch queue; once fetched,
    its rows go on as an ``embed_chunk`` of the same ids."""
    return send("fetch_chunk", (job_id, image_ids), **fetch_options(priority))


def send_job_read(*, job_id: str, priority: str, countdown: float | None = None):
    """Queue ``job_read``: read the job's manifest or prefix into rows, page by page, on the fetch
    queue (never inside the web request that made the job); ``countdown``: not before that many
    seconds (a read waiting for the model to catch up)."""
    options = fetch_options(priority) if countdown is None else {**fetch_options(priority), "countdown": countdown}
    return send("job_read", (job_id,), **options)


def send_job_done(*, job_id: str):
    """Queue ``job_done`` for a job that has just finished (the model lifecycle gates a finished
    migration job's space) on the vectors queue at background bulk priority."""
    return send("job_done", (job_id,), **vectors_options(interactive=False))


def send_canary(*, lane: str, sent_at: float, expires_s: float):
    """Queue a readiness canary (``canary``) on queue ``lane`` at priority 0 (kombu's highest step:
    ahead of any bulk chunk), expiring ``expires_s`` after ``sent_at`` (Unix s) so it never waits
    where no worker takes it; its result is written by the worker, not returned."""
    return send("canary", (lane, sent_at), queue=lane, priority=lanes.PRIORITY_INTERACTIVE,
                expires=expires_at(sent_at + expires_s), ignore_result=True)


def send_batch_validate(*, batch_id: str):
    """Queue ``batch_validate`` (check an OpenAI batch's input file and cut it into parts:
    ``services.batches``) on the fetch queue (reads a file, no model) at background bulk priority."""
    return send("batch_validate", (batch_id,), **fetch_options("background"), **UNREAD)


def send_batch_part(*, batch_id: str, index: int, priority: str):
    """Queue one part of a batch (``batch_part``) on the bulk queue at its job's ``priority``: a
    batch's lines run on the bulk lane only, never the interactive one."""
    return send("batch_part", (batch_id, index), **bulk_options(priority), **UNREAD)


def send_batch_part_fetch(*, batch_id: str, index: int, priority: str):
    """Queue ``batch_part_fetch`` (fetch the image URLs of a batch part, then queue the part on the
    bulk queue) on the fetch queue at the job's ``priority``, as a manifest job's ``fetch_chunk``."""
    return send("batch_part_fetch", (batch_id, index), **fetch_options(priority), **UNREAD)


def send_batch_finalize(*, batch_id: str):
    """Queue ``batch_finalize`` (join a batch's parts into its output and error files) on the fetch
    queue (blob reads and writes, no model) at background bulk priority."""
    return send("batch_finalize", (batch_id,), **fetch_options("background"), **UNREAD)


def send_webhook_delivery(*, delivery_id: int, attempt: int):
    """Queue attempt ``attempt`` of a webhook delivery (``send_webhook_delivery``) on the fetch queue
    (threads, network-bound, no model) at urgent bulk priority: a message someone waits for goes
    before catalogue fetching. Never with a countdown: later attempts are due times in the
    database, queued by the reconciler (``services.webhooks.delivery``)."""
    return send("send_webhook_delivery", (delivery_id, attempt), **fetch_options("urgent"))


def send_index_chunk(*, job_id: str, stat_id: int | None, items: list[dict], priority: str,
                     upsert_ms: float | None = None):
    """Queue a bulk chunk's points (``index_chunk``) for the vectors worker, the embedded store's
    owner, at the chunk's bulk ``priority``; ``upsert_ms``: write time already spent on the chunk
    by earlier parts (a continuation), omitted for a first part."""
    kwargs = {"priority": priority} if upsert_ms is None else {"priority": priority, "upsert_ms": upsert_ms}
    return send("index_chunk", (job_id, stat_id, items), kwargs,
                **vectors_options(interactive=False, priority=priority))


def send_forget_point(*, point_id: str, sha256: str, interactive: bool, model_id: str):
    """Queue ``forget_point`` (delete a point of space ``model_id``, or rewrite its payload) for the
    vectors worker: at interactive priority, or at background bulk priority (cascades, bulk deletes).
    Nobody reads its result: none is stored."""
    return send("forget_point", (point_id, sha256, model_id), **vectors_options(interactive=interactive), **UNREAD)


# --- interactive lane ----------------------------------------------------------------------------

def send_upload(*, to_embed: list[str], skipped: list[str], owner_id: int | None, k: int, deadline_ts: float,
                vectors: bool = False):
    """Queue an interactive upload: ``embed_interactive`` (interactive queue, expires at
    ``deadline_ts``) chained to ``index_interactive`` (vectors queue, interactive priority); only the
    latter when nothing is to be embedded (every image a copy of stored bytes). ``vectors``: the
    answer carries each image's stored vector too. Returns the last task's ``AsyncResult``: the
    only result stored (until ``deadline_ts`` at most), the embedding's goes inside the index's
    message."""
    more = (True,) if vectors else ()  # messages without it stay as they were
    if not to_embed:
        return task("index_interactive", {}, owner_id, k, skipped, *more, immutable=True,
                    **vectors_options(interactive=True), **read_by(deadline_ts)).apply_async()
    embed = task("embed_interactive", to_embed, deadline_ts, immutable=True, **interactive_options(deadline_ts),
                 **UNREAD)
    index = task("index_interactive", owner_id, k, skipped, *more, **vectors_options(interactive=True),
                 **read_by(deadline_ts))
    return chain(embed, index).apply_async()


def send_upload_direct(*, to_embed: list[str], skipped: list[str], owner_id: int | None, k: int, deadline_ts: float,
                       vectors: bool = False):
    """Queue an interactive upload whose worker writes its own points (a Qdrant server:
    ``embed_index_interactive`` on the interactive queue, expires at ``deadline_ts``). No vector
    crosses the broker unless asked for (``vectors``); the result is each image's neighbours.
    Returns its ``AsyncResult``."""
    more = (True,) if vectors else ()
    return task("embed_index_interactive", to_embed, deadline_ts, owner_id, k, skipped, *more,
                **interactive_options(deadline_ts)).apply_async()


def send_query(*, embed: str, args: tuple, deadline_ts: float, search: tuple | None, model_id: str,
               where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
               candidates: int | None = None):
    """Queue a query's embedding (``encode_text`` / ``embed_query`` with ``args`` then the
    deadline and the space ``model_id``, interactive queue) and, when ``search`` =
    ``(owner_id, k, job_id)`` is given, chain it to ``search_vector`` in the same space on the
    vectors queue, with the metadata filter ``where`` (its JSON) and ``with_vectors`` (each result
    with its stored vector); every message expires at ``deadline_ts``, and so does the one result
    stored, the last task's; ``diversity`` > 0: MMR over ``candidates``. Returns that ``AsyncResult``
    (the embedding alone, a ``{"vector"}`` answer, when ``search`` is None)."""
    options = interactive_options(deadline_ts)
    if search is None:
        return task(embed, *args, deadline_ts, model_id, immutable=True, **options).apply_async()
    sig = task(embed, *args, deadline_ts, model_id, immutable=True, **options, **UNREAD)
    return chain(sig, task("search_vector", *search, model_id, where, *_vectors_flag(with_vectors, diversity, candidates),
                           **vectors_options(interactive=True, deadline_ts=deadline_ts))).apply_async()


def send_embed_search(*, embed: str, args: tuple, deadline_ts: float, search: tuple, model_id: str,
                      where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
                      candidates: int | None = None):
    """Queue a query's embedding and its search as one ``embed_search`` task on the interactive
    queue (an embedded store the interactive worker owns, ``STORE_OWNER=interactive``): the same
    arguments and answer as :func:`send_query` with ``search``, one message and one process instead
    of a chain across two. Expires at ``deadline_ts``, and so does its result. Returns its ``AsyncResult``."""
    return task("embed_search", embed, list(args), deadline_ts, model_id, *search, where,
                *_vectors_flag(with_vectors, diversity, candidates), **interactive_options(deadline_ts)).apply_async()


def _vectors_flag(with_vectors: bool, diversity: float = 0.0, candidates: int | None = None) -> tuple:
    """The search tasks' trailing ``with_vectors`` (then ``diversity``, ``candidates``) arguments,
    sent only when set: a search message without them is one a vectors worker of the previous
    release still reads during a rolling deploy."""
    if diversity > 0:
        return (with_vectors, diversity, candidates)
    return (True,) if with_vectors else ()


def send_examples_query(*, items: list[dict], examples: dict, search: tuple, model_id: str, deadline_ts: float,
                        where: dict | None, with_vectors: bool, strategy: str, diversity: float,
                        candidates: int | None):
    """Queue a multi-example search: the examples given as texts or images (``items``, as
    :func:`send_embed_inputs`) embedded on the interactive queue, chained to ``search_examples``
    (``search`` = ``(owner_id, k, job_id)``, space ``model_id``) on the vectors queue; with no such
    example, ``search_examples`` alone. Every message expires at ``deadline_ts``. Returns the last
    task's ``AsyncResult``."""
    args = (examples, *search, model_id, where, with_vectors, strategy, diversity, candidates)
    options = vectors_options(interactive=True, deadline_ts=deadline_ts)
    if not items:
        return send("search_examples", ({"data": []}, *args), **options)
    sig = task("embed_inputs", items, deadline_ts, model_id, immutable=True, **interactive_options(deadline_ts),
               **UNREAD)
    return chain(sig, task("search_examples", *args, **options)).apply_async()


def send_embed_inputs(*, items: list[dict], deadline_ts: float, model_id: str):
    """Queue an embeddings request's inputs (``embed_inputs``: texts and temporary storage keys, in
    order) for space ``model_id`` on the interactive queue, expiring at ``deadline_ts``. Returns its
    ``AsyncResult`` (one entry per item)."""
    return send("embed_inputs", (items, deadline_ts, model_id), **interactive_options(deadline_ts))


def send_search_point(*, point_id: str, owner_id: int | None, k: int, job_id: str | None, deadline_ts: float,
                      model_id: str, where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
                      candidates: int | None = None):
    """Queue ``search_point`` (top-k by a stored point of space ``model_id``, metadata filter
    ``where``, ``with_vectors``, ``diversity`` over ``candidates``) on the vectors queue, expiring at
    ``deadline_ts``."""
    return send("search_point", (point_id, owner_id, k, job_id, model_id, where,
                                 *_vectors_flag(with_vectors, diversity, candidates)),
                 **vectors_options(interactive=True, deadline_ts=deadline_ts))


def send_duplicates_step(name: str, *args, bulk: bool) -> None:
    """Queue a step of a near-duplicate scan (``services.duplicates``), work nobody waits for: on
    the bulk queue at background priority (``bulk``: a step that needs the model, or any step when
    the store is a Qdrant server every bulk worker reaches), else on the vectors queue (the embedded
    store's owner) at background priority, behind every search. Its result is not stored."""
    options = bulk_options("background") if bulk else vectors_options(interactive=False)
    send(name, args, **options, **UNREAD)
