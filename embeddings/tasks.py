"""Celery tasks: thin adapters. JSON primitives in (ids, storage keys, base64 vectors), one call to a
service or to its queue's worker side (``services.queues``: ``bulk``, ``interactive``, ``vectors``),
retry policy on the decorator. Which queue each runs on is decided by the ``*_options`` helpers of
``embeddings.dispatch`` (re-exported here), from ``project.lanes``; services send work through that
module and never import this one. Every argument is one that dispatch sends; a default (or
``None``) is there only where it means something, said in its docstring. Besides the tasks, one
signal handler about their messages: :func:`expire_discarded_upload`. A worker's boot-up (niceness,
model warm-up, reconciler) is ``embeddings.worker_boot``.

- ``interactive`` queue (interactive worker, threads pool + dynamic batcher): ``embed_interactive``,
  ``embed_query``, ``encode_text``, ``embed_inputs``; ``embed_index_interactive`` with a Qdrant server.
- ``bulk`` queue (bulk worker, one chunk at a time): ``embed_chunk``, ``batch_part``, ``migration_fill``,
  ``gate_embed``, ``cutoff_encode_texts``.
- ``vectors`` queue (the vector store's owner): ``index_*``, ``search_*``, ``point_vectors``, ``forget_point``,
  ``collection_stats``, ``drop_collection``, ``job_done``, ``gate_check``, ``cutoff_compute``.
- ``fetch`` queue (the fetch worker, threads, no model): ``job_read``, ``fetch_chunk``,
  ``send_webhook_delivery``, ``batch_validate``, ``batch_part_fetch``, ``batch_finalize``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

from celery import shared_task
from celery.signals import task_revoked
from django.conf import settings

from embeddings import dispatch, lane_control, metrics, runtime
from embeddings.deferred import after_answer

# the message options live with the sending (``embeddings.dispatch``); re-exported for callers here
from embeddings.dispatch import (  # noqa: F401
    bulk_options,
    expires_at,
    interactive_options,
    vectors_options,
)
from embeddings.models import Job
from embeddings.services import readiness
from embeddings.services import reconcile as reconcile_services
from embeddings.services.batches import finalize as batch_finalizing
from embeddings.services.batches import parts as batch_parts
from embeddings.services.batches import validation as batch_validation
from embeddings.services.catalogue import fetching, reading
from embeddings.services.catalogue.images import images_mark_failed
from embeddings.services.duplicates import calibration, scan
from embeddings.services.duplicates.steps import send_step
from embeddings.services.lifecycle import cutoff, gate, model_migrations
from embeddings.services.lifecycle.model_migrations import migration_fill as fill
from embeddings.services.queues import bulk as bulk_queue
from embeddings.services.queues import interactive as interactive_queue
from embeddings.services.queues import vectors as vectors_queue
from embeddings.services.queues.store_writes import STORE_ERRORS
from embeddings.services.webhooks import delivery as webhook_delivery
from project import lanes
from workers.errors import Reason

log = logging.getLogger(__name__)

#: Systemic failures talking to the vector store: retried with exponential backoff (never a bad
#: image, which is recorded, not retried): connection errors, timeouts, Qdrant 5xx.
_STORE_ERRORS = STORE_ERRORS


# ignore_result on every task whose result nobody reads: storing it would leave a key in Redis for
# CELERY_RESULT_EXPIRES (its outcome is in the database; the lane tests read a chunk's turn from
# its task-succeeded event). store_errors_even_if_ignored on the tasks that open a chain someone
# waits for: their value travels inside the next message (dispatch.UNREAD), their failure must
# still reach the chain's last result, which the web reads.
@shared_task(acks_late=True, reject_on_worker_lost=True, time_limit=settings.CELERY_BULK_TIME_LIMIT_S,
             ignore_result=True)
def embed_chunk(job_id: str, image_ids: list[str], chunk_id: int | None = None) -> dict:
    """Embed one bulk chunk (≤ ``BULK_BATCH_SIZE`` image ids), one chunk at a time per process (a
    worker serving both lanes holds a second one on deck: ``lane_control.bulk_turn``). The result adds
    ``started``/``ended`` (Unix s: its turn to compute) and ``waited_ms`` (on deck before it).
    ``chunk_id``: its row under the fair scheduler (``BULK_SCHEDULER=fair``), whose place in the
    window passes to the next chunk when this one ends, computed or failed (``dispatch.bulk_chunk_done``);
    None for a chunk sent without one."""
    turn, out = None, {}
    try:
        with lane_control.bulk_turn() as turn:
            out = bulk_queue.chunk_embed(job_id=job_id, image_ids=image_ids)
    finally:
        seconds = ((turn.ended or time.time()) - turn.started) if turn is not None else 0.0
        dispatch.bulk_chunk_done(job_id=job_id, chunk_id=chunk_id, images=len(image_ids), seconds=seconds,
                                 computed=out.get("embedded", 0) + out.get("failed", 0))
    return {**out, "started": turn.started, "ended": turn.ended, "waited_ms": round(turn.waited_ms, 3)}


@shared_task(acks_late=True, reject_on_worker_lost=True, time_limit=settings.CELERY_BULK_TIME_LIMIT_S,
             ignore_result=True)
def batch_part(batch_id: str, index: int) -> dict:
    """Run one part of an OpenAI batch (``services.batches.parts``) in this process's bulk turn, as
    a job's chunk."""
    with lane_control.bulk_turn():
        return batch_parts.part_run(batch_id=batch_id, index=index)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def batch_part_fetch(batch_id: str, index: int) -> dict:
    """Fetch the image URLs of one part of an OpenAI batch, then queue the part on the bulk queue
    (``services.batches.parts``)."""
    return batch_parts.part_fetch(batch_id=batch_id, index=index)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def batch_validate(batch_id: str) -> dict:
    """Check a batch's input file and queue its parts (``services.batches.validation``)."""
    return batch_validation.batch_validate(batch_id=batch_id)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def batch_finalize(batch_id: str) -> dict:
    """Write a batch's output and error files and end it (``services.batches.finalize``)."""
    return batch_finalizing.batch_finalize(batch_id=batch_id)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def job_read(job_id: str) -> dict:
    """Read a catalogue job's manifest or prefix into rows, slice by slice, each slice's rows sent
    to ``fetch_chunk`` (``services.catalogue.reading.job_read``; a redelivery continues after the
    rows already made)."""

    return reading.job_read(job_id=job_id)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def fetch_chunk(job_id: str, image_ids: list[str]) -> dict:
    """Fetch one chunk of a catalogue job's URLs and objects, then send its originals on as an
    ``embed_chunk`` (``services.catalogue.fetching.chunk_fetch``)."""

    return fetching.chunk_fetch(job_id=job_id, image_ids=image_ids)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def send_webhook_delivery(delivery_id: int, attempt: int) -> dict:
    """Make one attempt of a webhook delivery (``services.webhook_delivery.delivery_attempt``: a
    message for an attempt already made does nothing)."""

    return webhook_delivery.delivery_attempt(delivery_id=delivery_id, attempt=attempt)


def _in_flight(task, images: int):
    """Count an interactive task's images as in flight for admission control (not when eager)."""
    if task.request.is_eager:
        return contextlib.nullcontext()
    return lane_control.interactive_in_flight(task.request.id, images)


@shared_task(bind=True, ignore_result=True, store_errors_even_if_ignored=True)
def embed_interactive(self, image_ids: list[str], deadline_ts: float) -> dict:
    """Embed an interactive request's images (deadline as Unix time, s); then report the dynamic
    batcher's batches (service time for admission control, batch sizes and queue delays)."""
    return _embed_interactive(self, image_ids, deadline_ts)


@shared_task(bind=True)
def embed_index_interactive(self, image_ids: list[str], deadline_ts: float, owner_id: int | None, k: int,
                            skipped_ids: list[str], vectors: bool = False) -> dict:
    """With a Qdrant server (``services.sink``: direct), or an embedded store this worker owns
    (``STORE_OWNER=interactive``: its turn at the store, ``lane_control.store_turns``): embed an
    interactive request's images, then write their points and find their neighbours here
    (:func:`index_interactive` in this process): no vector crosses Redis, no vectors worker on the
    path. Same result as that chain's."""
    embedded = _embed_interactive(self, image_ids, deadline_ts)
    t = embedded.get("timings") or {}
    lane_control.hops.note(embedded_at=time.time(), embed_ms=t.get("embed", 0.0),
                           prep_ms=sum(t.get(k, 0.0) for k in ("load", "decode", "decode_wait", "preprocess")))
    with lane_control.interactive_turn():
        return index_interactive(embedded, owner_id, k, skipped_ids, vectors)


def _embed_interactive(task, image_ids: list[str], deadline_ts: float) -> dict:
    with _in_flight(task, len(image_ids)):
        out = interactive_queue.interactive_embed(image_ids=image_ids, deadline_ts=deadline_ts)
    lane_control.hops.note(returned_at=time.time())
    if not task.request.is_eager:
        worker = task.request.hostname or ""
        # heartbeat: this worker's capacity keeps counting while it idles, and stops when it dies;
        # sent once the answer is out (the chain's next message), off the request's path
        after_answer(lambda: lane_control.interactive_report(runtime.dynamic_batcher().records, worker=worker,
                                                             heartbeat=True))
    return out


def _end_if_expired(task, out: dict, deadline_ts: float) -> dict:
    """A query refused because its deadline passed, or finished after it, ends its chain here:
    the search that would follow is for nobody (its message would be sent already expired, which
    Celery also warns about at length)."""
    refused = out.get("reason") == Reason.EXPIRED.value
    if refused:
        log.info("%s[%s] not computed: %s", task.name, task.request.id, out.get("detail", "deadline passed"))
    elif time.time() > deadline_ts:
        log.info("%s[%s] finished %.3f s after its deadline: its search is not sent", task.name, task.request.id,
                 time.time() - deadline_ts)
    else:
        return out
    if not task.request.is_eager:  # eager chains run their links themselves
        task.request.chain = None
    return out


@shared_task(bind=True, store_errors_even_if_ignored=True)
def embed_query(self, storage_key: str, sha256: str, deadline_ts: float, model_id: str) -> dict:
    """Embed a query image with space ``model_id``'s model → ``{"vector": base64}`` or ``{"reason",
    "detail"}``; reason ``expired`` without running the model once ``deadline_ts`` (Unix s) has passed."""
    with _in_flight(self, 1):
        return _end_if_expired(self, interactive_queue.query_embed(storage_key=storage_key, sha256=sha256,
                                                                   deadline_ts=deadline_ts, model_id=model_id),
                               deadline_ts)


@shared_task(bind=True, store_errors_even_if_ignored=True)
def encode_text(self, text: str, deadline_ts: float, model_id: str) -> dict:
    """Embed a text query with space ``model_id``'s model → ``{"vector": base64}``; ``{"reason":
    "expired", "detail"}`` without running the model once ``deadline_ts`` (Unix s) has passed."""
    with _in_flight(self, 1):
        return _end_if_expired(self, interactive_queue.text_embed(text=text, deadline_ts=deadline_ts,
                                                                  model_id=model_id), deadline_ts)


#: The query embeddings ``embed_search`` may run first, by task name: the service function of
#: ``services.queues.interactive`` each task runs, and the names of its positional arguments.
_QUERY_EMBEDS = {"encode_text": ("text_embed", ("text",)), "embed_query": ("query_embed", ("storage_key", "sha256"))}


@shared_task(bind=True, store_errors_even_if_ignored=True)
def embed_search(self, embed: str, args: list, deadline_ts: float, model_id: str, owner_id: int | None, k: int,
                 job_id: str | None, where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
                 candidates: int | None = None) -> dict:
    """A query's embedding and its search in one task, where this worker owns the embedded store
    (``STORE_OWNER=interactive``): ``embed`` (``encode_text`` / ``embed_query``) with ``args``,
    then :func:`search_vector` with the rest, here, in its turn at the store. The answer of that
    chain: ``{"results": [...]}``, or the embedding's refusal (``{"reason", "detail"}``; ``expired``
    also when the embedding finished after ``deadline_ts``, Unix s: nobody waits any more)."""
    if embed not in _QUERY_EMBEDS:
        raise ValueError(f"embed must be one of {sorted(_QUERY_EMBEDS)}, not {embed!r}")
    function, names = _QUERY_EMBEDS[embed]
    with _in_flight(self, 1):
        query = getattr(interactive_queue, function)(**dict(zip(names, args)), deadline_ts=deadline_ts,
                                                     model_id=model_id)
    if "reason" in query:
        return query
    if time.time() > deadline_ts:
        return {"reason": Reason.EXPIRED.value, "detail": "embedded after the query's deadline: not searched"}
    lane_control.hops.note(embedded_at=time.time())
    with lane_control.interactive_turn():
        out = vectors_queue.vector_search(query=query, owner_id=owner_id, k=k, job_id=job_id, model_id=model_id,
                                          where=where, with_vectors=with_vectors, diversity=diversity,
                                          candidates=candidates)
    lane_control.hops.note(returned_at=time.time())
    return out


@shared_task(bind=True, store_errors_even_if_ignored=True)  # opens a multi-example search's chain
def embed_inputs(self, items: list[dict], deadline_ts: float, model_id: str) -> dict:
    """Embed an embeddings request's texts and images (temporary storage keys) with space
    ``model_id``'s model, in input order (``interactive.inputs_embed``); every item ``expired`` without
    running the model once ``deadline_ts`` (Unix s) has passed."""
    with _in_flight(self, max(1, sum(1 for it in items if "key" in it))):
        return interactive_queue.inputs_embed(items=items, deadline_ts=deadline_ts, model_id=model_id)


@task_revoked.connect
def expire_discarded_upload(sender=None, request=None, expired=False, **kwargs) -> None:
    """An ``embed_interactive`` message discarded unrun because it expired in the broker (the worker
    was down or busy past its deadline): its images are ``expired`` at once, as the task would
    have recorded them, instead of waiting for the reconciler to find them."""
    if not expired or getattr(sender, "name", None) not in (embed_interactive.name, embed_index_interactive.name) \
            or request is None:
        return
    args, kwargs = list(request.args or ()), dict(request.kwargs or {})
    image_ids = list(kwargs.get("image_ids", args[0] if args else ()))
    deadline_ts = kwargs.get("deadline_ts", args[1] if len(args) > 1 else None)
    if not image_ids:
        return

    late = f"{time.time() - float(deadline_ts):.1f} s " if deadline_ts is not None else ""
    images_mark_failed([(i, Reason.EXPIRED.value, f"deadline passed {late}before a worker took it") for i in image_ids])
    metrics.count_images(lane=lanes.INTERACTIVE, status="expired", n=len(image_ids))


# ignore_result: nobody reads a chunk's result (its outcome is in the database), so neither the
# worker (GET, SETEX, PUBLISH per task) nor its sender (SUBSCRIBE) talks to the result backend.
@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=None, ignore_result=True)
def index_chunk(job_id: str, stat_id: int | None, items: list[dict], priority: str, upsert_ms: float = 0.0) -> dict:
    """Write a bulk chunk's points and mark its images embedded, yielding to interactive work
    between slices (``vectors.chunk_index``). ``upsert_ms``: write time (ms) spent on the chunk by
    earlier parts; a first part's message leaves it out (``dispatch.send_index_chunk``)."""
    return vectors_queue.chunk_index(job_id=job_id, stat_id=stat_id, items=items, priority=priority,
                                     upsert_ms=upsert_ms)


@shared_task
def index_interactive(embedded: dict, owner_id: int | None, k: int, skipped_ids: list[str],
                      vectors: bool = False) -> dict:
    """Write an interactive request's points; return each image's neighbours (``vectors``: and its
    stored vector)."""
    out = vectors_queue.interactive_index(embedded=embedded, owner_id=owner_id, k=k, skipped_ids=skipped_ids,
                                          vectors=vectors)

    metrics.count_images(lane=lanes.INTERACTIVE, status="embedded", n=len(embedded.get("items", [])))
    failed = embedded.get("failed", [])
    expired = sum(1 for f in failed if f[1] == "expired")
    metrics.count_images(lane=lanes.INTERACTIVE, status="expired", n=expired)
    metrics.count_images(lane=lanes.INTERACTIVE, status="failed", n=len(failed) - expired)
    return out


@shared_task
def search_vector(query: dict, owner_id: int | None, k: int, job_id: str | None, model_id: str,
                  where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
                  candidates: int | None = None) -> dict:
    """Top-k by a query ``{"vector": base64}`` in space ``model_id``, restricted to ``owner_id``
    (None: all owners), ``job_id`` (None: any job) and the metadata filter ``where`` (its JSON; None:
    none) → ``{"results": [...]}`` (refusals pass through); ``with_vectors``: each result with its
    stored ``"vector"`` (base64); ``diversity`` > 0: MMR over ``candidates`` (None: the default pool)."""
    return vectors_queue.vector_search(query=query, owner_id=owner_id, k=k, job_id=job_id, model_id=model_id,
                                       where=where, with_vectors=with_vectors, diversity=diversity,
                                       candidates=candidates)


@shared_task
def search_point(point_id: str, owner_id: int | None, k: int, job_id: str | None, model_id: str,
                 where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
                 candidates: int | None = None) -> list[dict] | None:
    """Top-k by a stored point's vector in space ``model_id``, metadata filter ``where`` (its JSON;
    None: none); None when the point does not exist; ``with_vectors``, ``diversity``, ``candidates``
    as ``search_vector``."""
    return vectors_queue.point_search(point_id=point_id, owner_id=owner_id, k=k, job_id=job_id, model_id=model_id,
                                      where=where, with_vectors=with_vectors, diversity=diversity,
                                      candidates=candidates)


@shared_task
def search_examples(embedded: dict, examples: dict, owner_id: int | None, k: int, job_id: str | None, model_id: str,
                    where: dict | None, with_vectors: bool, strategy: str, diversity: float,
                    candidates: int | None) -> dict:
    """Top-k for positive and negative examples in space ``model_id`` (``vectors.examples_search``):
    ``embedded`` is ``embed_inputs``' answer for the examples given as texts or images (the chain's
    first link), ``examples`` says which side each input and stored point is on → ``{"results"}`` or
    the first refusal."""
    return vectors_queue.examples_search(embedded=embedded, examples=examples, owner_id=owner_id, k=k,
                                         job_id=job_id, model_id=model_id, where=where, with_vectors=with_vectors,
                                         strategy=strategy, diversity=diversity, candidates=candidates)


@shared_task
def point_vectors(point_ids: list[str], model_id: str) -> dict:
    """The stored vectors of ``point_ids`` in space ``model_id``, in one read → ``{"dim", "ids",
    "vectors": base64}`` (``vectors.point_vectors``; missing points left out)."""
    return vectors_queue.point_vectors(point_ids=point_ids, model_id=model_id)


@shared_task
def forget_point(point_id: str, sha256: str, model_id: str) -> str:
    """Delete a point of space ``model_id`` (or its deleted row's share of it)."""
    return vectors_queue.point_forget(point_id=point_id, sha256=sha256, model_id=model_id)


@shared_task
def drop_collection(model_id: str, collection: str, dim: int) -> bool:
    """Delete a dropped space's collection with its points (``model_migrations.space_drop``)."""

    return runtime.drop_collection(model_id, collection, dim)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def migration_fill(space_id: int) -> int:
    """Create and queue a migration's copy rows, a batch at a time (``model_migrations.migration_fill``)."""

    return fill(space_id=space_id)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def job_done(job_id: str) -> None:
    """A job has just finished: a finished migration job's space gets its quality gate
    (``services.lifecycle.model_migrations.migration_job_done``)."""

    job = Job.objects.filter(id=job_id).first()
    if job is not None:
        model_migrations.migration_job_done(job)


@shared_task
def collection_stats(model_id: str) -> dict:
    """Space ``model_id``'s collection name and exact point count."""
    return vectors_queue.point_count(model_id=model_id)


@shared_task(ignore_result=True)
def reconcile() -> dict | None:
    """One reconciler round (``embeddings/services/reconcile.py``); ``None`` if a round is running."""

    report = reconcile_services.reconcile_once()
    return None if report is None else dataclasses.asdict(report)


# --- quality gate and cutoff (embeddings/services/lifecycle/gate.py, cutoff.py) -------------------

@shared_task(acks_late=True, reject_on_worker_lost=True, time_limit=settings.CELERY_BULK_TIME_LIMIT_S,
             ignore_result=True)
def gate_embed(model_id: str, picks: list[dict], reference: str | None) -> dict:
    """Embed the quality gate's re-encoded copies with space ``model_id``'s model and the
    ``reference`` space's (None: no reference space) (bulk queue, one bulk turn: it computes like a chunk)."""

    with lane_control.bulk_turn():
        return gate.gate_embed(model_id=model_id, picks=picks, reference=reference)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=5, ignore_result=True)
def gate_check(embedded: dict, model_id: str, run: str) -> dict:
    """Search each copy's top-1 in space ``model_id``'s collection and record the gate report."""

    return gate.gate_check(embedded=embedded, model_id=model_id, run=run)


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def cutoff_encode_texts(model_id: str) -> dict:
    """The calibration prompts through space ``model_id``'s text tower (bulk queue)."""

    return cutoff.encode_prompts(model_id=model_id)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=5, ignore_result=True)
def cutoff_compute(texts: dict, model_id: str) -> dict:
    """Compute and store space ``model_id``'s cutoffs from its stored vectors (vectors queue)."""

    return cutoff.calibrate(model_id=model_id, texts=texts)


# --- near-duplicate groups (embeddings/services/duplicates/) ---------------------------------------

@shared_task(acks_late=True, reject_on_worker_lost=True, time_limit=settings.CELERY_BULK_TIME_LIMIT_S,
             ignore_result=True)
def duplicates_calibration_embed(scan_id: int, run: str, model_id: str, picks: list[dict]) -> None:
    """Embed the calibration copies of an owner's sampled images (bulk queue, one bulk turn), then
    send ``duplicates_calibrate`` with them to the store's owner."""

    with lane_control.bulk_turn():
        embedded = calibration.calibration_embed(model_id=model_id, picks=picks)
    send_step("duplicates_calibrate", embedded, scan_id, run)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=5, ignore_result=True)
def duplicates_calibrate(embedded: dict, scan_id: int, run: str) -> dict:
    """The scan's threshold from its copies' embeddings; then its first slice (vectors queue)."""

    return calibration.calibrate(embedded=embedded, scan_id=scan_id, run=run)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=5, ignore_result=True)
def duplicates_scan_slice(scan_id: int, run: str, offset: str | None) -> dict:
    """One slice of an owner's near-duplicate scan (vectors queue, background priority)."""

    return scan.scan_slice(scan_id=scan_id, run=run, offset=offset)


@shared_task(autoretry_for=_STORE_ERRORS, retry_backoff=2, retry_backoff_max=60, max_retries=5, ignore_result=True)
def duplicates_update(scan_id: int, point_ids: list[str]) -> dict:
    """Group points just written into a finished scan (vectors queue, background priority)."""

    return scan.scan_update(scan_id=scan_id, point_ids=point_ids)


@shared_task(bind=True, ignore_result=True)
def canary(self, lane: str, sent_at: float) -> dict:
    """Answer ``/readyz``'s canary on ``lane`` (sent at ``sent_at``, Unix s): embed a tiny picture and
    a text on the lane's own path (a store call on the vectors lane) and record the outcome under
    this worker's name (``services.readiness.canary_answer``)."""
    return readiness.canary_answer(lane=lane, worker=self.request.hostname or "", sent_at=sent_at)
