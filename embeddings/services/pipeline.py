"""Worker-side services: what the Celery tasks call. Embedding workers run ``*_embed`` and
``query_embed``/``text_embed``; the vectors worker (sole owner of the vector store) runs ``*_index``,
searches and deletions. Each returns JSON primitives, ready to be a task result.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid

import numpy as np
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from embeddings import metrics, runtime
from embeddings.messages import decode_vector, encode_vector
from embeddings.models import BatchStat, Image, ImageStatus, Job, JobKind, JobPriority, JobStatus, Lane
from embeddings.selectors import hits_to_results
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.duplicates import scan as duplicate_scans
from embeddings.spaces import ModelNotConfigured
from workers import screen
from workers.errors import Reason
from workers.timing import StageTimings
from workers.vector_store import Point, filters

log = logging.getLogger(__name__)

_WORKER = f"{socket.gethostname()}:{os.getpid()}"

#: Reason shown on a queued image whose vector is computed and waits to be written: the vector
#: store (or the vectors worker that owns it) is busy, down, or unreachable. Not a failure.
WAITING_FOR_STORE = "waiting_for_store"


class StoreUnavailable(ConnectionError):
    """The vector store answered with a server error (5xx): retried like a lost connection."""


def _store_errors() -> tuple[type[BaseException], ...]:
    import httpx
    from qdrant_client.http.exceptions import ResponseHandlingException

    return (ConnectionError, TimeoutError, OSError, httpx.TransportError, ResponseHandlingException)


#: Systemic failures writing to the vector store: the write is retried with backoff, the images
#: wait (queued, reason ``waiting_for_store``), never marked embedded before their points exist.
STORE_ERRORS = _store_errors()


def _images_wait_for_store(image_ids: list[str], detail: str) -> None:
    """Show images whose vectors wait to be written (still queued: nothing is embedded yet)."""
    Image.objects.filter(id__in=image_ids, status=ImageStatus.QUEUED).update(
        reason=WAITING_FOR_STORE, reason_detail=detail[:2000])


def _loader(rows: dict[str, tuple[str, str]]):
    store = runtime.blob_store()
    return lambda image_id: store.read(*rows[image_id])


def _thumbnailer(shas: dict[str, str]):
    """The runner's decode hook (``workers.runner.OnDecoded``): draws the preview (``workers.preview``;
    none when ``PREVIEW_SIDE`` is 0) and the thumbnail of each image (key = image id, ``shas`` maps it
    to its sha256) once each, into the blob store, from the pixels the worker has just decoded; the
    thumbnail from the preview's pixels, which are fewer. An existing one is not drawn again; a
    picture too long for a preview gets none (its re-embeds read the original)."""
    from embeddings.storage import preview_exists, preview_put, thumbnail_exists, thumbnail_put
    from workers.preview import PreviewTooLong, preview_bytes
    from workers.thumbnail import thumbnail_bytes

    store = runtime.blob_store()
    side = settings.PIPELINE.preview_side

    def on_decoded(image_id: str, rgb, meta) -> None:
        sha = shas.get(image_id)
        if not sha:
            return
        pixels = rgb
        if side and not preview_exists(store, sha):
            try:
                data, pixels = preview_bytes(rgb, width=meta.width, height=meta.height, format=meta.format,
                                             short_side=side)
                preview_put(store, sha, data)
            except PreviewTooLong as e:
                log.info("no preview of %s: %s", image_id, e)
        if not thumbnail_exists(store, sha):
            thumbnail_put(store, sha, thumbnail_bytes(pixels))

    return on_decoded


class _Previews:
    """The previews of a chunk's images in the blob store (``workers.preview.PreviewStore``; key =
    image id, ``shas`` maps it to its sha256)."""

    def __init__(self, shas: dict[str, str]) -> None:
        self.store, self.shas = runtime.blob_store(), shas

    def read(self, key: str) -> bytes:
        from embeddings.storage import preview_read

        return preview_read(self.store, self.shas[key])

    def discard(self, key: str) -> None:
        from embeddings.storage import preview_delete

        preview_delete(self.store, self.shas[key])


def _count_previews(tally, *, job_id: str) -> None:
    """Count a re-embed chunk's preview reads (``clip_preview_reads_total``) and log its fallbacks
    (each unreadable one was logged as a warning by the runner; a missing one is expected for an
    image embedded before previews existed, or a dual-embedding copy whose upload is not decoded yet)."""
    metrics.count_preview_reads(tally)
    if tally.fallbacks:
        log.info("chunk of job %s: %d previews missing and %d unreadable: their originals were read "
                 "(manage.py previews draws missing ones)", job_id, tally.missing, tally.unreadable)


def _item(meta, vector, point_id: str, sha256: str, model_id: str) -> dict:
    """One computed vector on its way to the store: the image, its point, facts, and the embedding
    space (``model_id``) whose collection it goes to."""
    return {"id": meta.key, "point_id": point_id, "sha256": sha256, "width": meta.width, "height": meta.height,
            "format": meta.format, "vector": encode_vector(vector), "model_id": model_id}


def _stat(*, job_id, lane: str, images: int, failed: int, timings: StageTimings) -> BatchStat:
    t = timings
    return BatchStat.objects.create(
        job_id=job_id, lane=lane, images=images, failed=failed, load_ms=t.load, decode_ms=t.decode,
        decode_wait_ms=t.decode_wait, preprocess_ms=t.preprocess, embed_ms=t.embed, total_ms=t.total, worker=_WORKER,
    )


# --- bulk lane -----------------------------------------------------------------------------------

def chunk_embed(*, job_id: str, image_ids: list[str]) -> dict:
    """Embed one chunk of a bulk job and write its vectors: itself against a Qdrant server
    (``services.sink``: :func:`chunk_index` in this process), else through the vectors worker.

    Images no longer queued (already embedded by an earlier delivery, cancelled) are left alone, so a
    redelivered chunk redoes only what is missing. Bad images fail alone with their reason. A
    migration chunk (a re-embed) reads each image's preview where the model's input fits in it, the
    original otherwise (``workers.preview``, docs/previews.md). A chunk of a paused job is parked
    instead of run (``job_chunk_park``): resuming the job queues it again.

    Returns:
        ``{"embedded": n, "failed": n, "skipped": n, "stat_id": id | None}`` (``embedded`` counts
        vectors handed over; they are marked embedded once written), plus ``"parked": n`` when parked
        and ``"paused_ms"`` when it computed (a migration chunk, or a background one while the
        interactive lane was at capacity: time given to the interactive lane); a migration chunk
        also ``"previews"``: ``workers.preview.PreviewTally`` as a dict (what it read).
    """
    from embeddings import dispatch
    from embeddings import lane_control
    from embeddings import sink

    job = Job.objects.filter(id=job_id).first()
    if job is None:
        return {"embedded": 0, "failed": 0, "skipped": len(image_ids), "stat_id": None}
    if job.status == JobStatus.CANCELLED:
        image_services.images_mark_failed([(i, Reason.CANCELLED.value, "the job was cancelled") for i in image_ids])
        return {"embedded": 0, "failed": 0, "skipped": len(image_ids), "stat_id": None}
    if job.status == JobStatus.PAUSED and job_services.job_chunk_park(job_id=job_id, image_ids=image_ids):
        return {"embedded": 0, "failed": 0, "skipped": 0, "parked": len(image_ids), "stat_id": None}
    rows, exhausted = {}, set()  # one read gives the chunk's queued rows and their attempts
    for i, key, sha, pid, attempts in Image.objects.filter(id__in=image_ids, status=ImageStatus.QUEUED).values_list(
        "id", "storage_key", "sha256", "point_id", "attempts"
    ):
        rows[str(i)] = (key, sha, str(pid))
        if attempts >= settings.BULK_MAX_ATTEMPTS:
            exhausted.add(i)
    unfetched = [i for i, (_, sha, _) in rows.items() if not sha]
    if unfetched:  # a catalogue row without its bytes yet (a resumed job): the fetch worker first
        dispatch.send_fetch_chunk(job_id=job_id, image_ids=unfetched, priority=job.priority)
        rows = {i: v for i, v in rows.items() if v[1]}
    if not rows:
        if not unfetched:
            job_services.job_refresh(job_id=job_id)
        return {"embedded": 0, "failed": 0, "skipped": len(image_ids) - len(unfetched), "stat_id": None}
    job_services.job_mark_started(job_id=job_id, status=job.status)
    try:  # the chunk's model is its job's (a migration job: the space it fills)
        runner = runtime.batch_runner(job.model_id)
    except ModelNotConfigured as e:
        image_services.images_mark_failed([(i, Reason.MODEL_NOT_CONFIGURED.value, str(e)) for i in rows])
        job_services.job_refresh(job_id=job_id)
        return {"embedded": 0, "failed": len(rows), "skipped": len(image_ids) - len(rows), "stat_id": None}
    if exhausted:  # a poison chunk (its worker dies every time) must not be redelivered forever
        detail = f"delivered {settings.BULK_MAX_ATTEMPTS} times without finishing"
        image_services.images_mark_failed([(str(i), Reason.ATTEMPTS_EXHAUSTED.value, detail) for i in exhausted])
        rows = {k: v for k, v in rows.items() if uuid.UUID(k) not in exhausted}
        if not rows:
            job_services.job_refresh(job_id=job_id)
            return {"embedded": 0, "failed": len(exhausted), "skipped": len(image_ids) - len(exhausted),
                    "stat_id": None}
    Image.objects.filter(id__in=list(rows)).update(attempts=F("attempts") + 1)
    ordered = [i for i in image_ids if i in rows]
    sampler = metrics.worker_sampler()  # CPU/GPU utilisation once a second while chunks run
    slot = contextlib.nullcontext(0.0)
    migration = job.kind == JobKind.MIGRATION
    # a re-embed (migration, dual embedding): these bytes were decoded before, their preview is read
    # when the model fits in it (docs/previews.md); a first embedding draws it instead
    previews = _Previews({k: v[1] for k, v in rows.items()}) if migration else None
    if migration:  # background priority: one chunk computing per host
        slot = lane_control.migration_slot()  # (MIGRATION_BULK_SLOTS), small passes in the interactive lane's idle time
    # waits while the interactive lane is at capacity: a migration, or a background job on time
    ingest_yields = (not migration and job.priority == JobPriority.BACKGROUND and settings.BULK_YIELD_MAX_S > 0
                     and not job_services.job_deadline_at_risk(job))
    # the interactive lane's wait model is told while the chunk computes, and whether it yields
    # (lane_control.bulk_yield.BulkActivity)
    with slot, lane_control.bulk_computing(yields=migration or ingest_yields) as activity:
        passes = {}
        if migration:
            passes = {"micro_batch": settings.MIGRATION_MICRO_BATCH or None,
                      "before_pass": lane_control.migration_yielder(activity=activity)}
        elif ingest_yields:
            passes = {"micro_batch": settings.BULK_YIELD_MICRO_BATCH or None,
                      "before_pass": lane_control.ingest_yielder(activity=activity)}
        chunk_started = time.time()
        result = runner.run(ordered, _loader({k: v[:2] for k, v in rows.items()}),
                            _thumbnailer({k: v[1] for k, v in rows.items()}), previews=previews, **passes)
    if previews is not None:
        _count_previews(result.previews, job_id=job_id)
    if result.paused_ms:
        log.info("chunk of job %s: %d images, paused %.0f ms for interactive work", job_id,
                 len(ordered), result.paused_ms)
    image_services.images_mark_failed([(f.key, f.reason, f.detail) for f in result.failed])
    metrics.count_refused_embeddings(lane=Lane.BULK, reasons=[f.reason for f in result.failed])
    stat = _stat(job_id=job_id, lane=Lane.BULK, images=len(ordered), failed=len(result.failed), timings=result.timings)
    metrics.count_images(lane=Lane.BULK, status="failed", n=len(result.failed))
    metrics.count_images(lane=Lane.BULK, status="skipped", n=len(image_ids) - len(ordered))
    metrics.job_record_utilisation(job_id=job_id, since=chunk_started - sampler.interval_s, config=settings.PIPELINE)
    items = [_item(m, v, rows[m.key][2], rows[m.key][1], job.model_id) for m, v in zip(result.metas, result.vectors)]
    if items and sink.is_direct():  # a Qdrant server: this worker writes its own points, no vector crosses Redis
        chunk_index(job_id=job_id, stat_id=stat.id, items=items, priority=job.priority)
    elif items:
        dispatch.send_index_chunk(job_id=job_id, stat_id=stat.id, items=items, priority=job.priority)
        _images_wait_for_store([it["id"] for it in items],
                               "vector computed; waiting for the vectors worker to write it")
    else:
        BatchStat.objects.filter(id=stat.id).update(finished_at=timezone.now())
        job_services.job_refresh(job_id=job_id)
    out = {"embedded": len(items), "failed": len(result.failed), "skipped": len(image_ids) - len(ordered),
           "stat_id": stat.id, "paused_ms": round(result.paused_ms, 1)}
    if previews is not None:
        out["previews"] = result.previews.as_dict()
    return out


def _space(items: list[dict]) -> str:
    """The embedding space of a call's ``items`` (one space per call: a chunk's job, a request's
    rows): their ``model_id``, else the active space (items built without one: benchmarks)."""
    return items[0].get("model_id") or runtime.model_id()


def _write_points(items: list[dict], payloads: dict[str, dict] | None = None) -> float:
    """Upsert ``items`` with ``payloads`` (by sha256; ``None``: recomputed from the database, counting
    the items' rows); returns the upsert wall time (ms)."""
    model_id = _space(items)
    if payloads is None:
        payloads = image_services.point_payloads(
            model_id=model_id, shas=[it["sha256"] for it in items], including=[it["id"] for it in items],
            point_ids=[it["point_id"] for it in items],
        )
    points = [Point(id=uuid.UUID(it["point_id"]), vector=decode_vector(it["vector"]), payload=payloads[it["sha256"]])
              for it in items]
    t0 = time.perf_counter()
    runtime.vector_store(model_id).upsert(points)
    return (time.perf_counter() - t0) * 1000


def _queued_payloads(items: list[dict]) -> tuple[set[str], dict[str, dict]]:
    """One read before writing ``items``' points: the ids of those whose images are still queued,
    and the payload (by sha256) of every item's point, counting those rows
    (``images.point_payloads`` with ``queued``)."""
    if not items:
        return set(), {}
    queued: set[str] = set()
    payloads = image_services.point_payloads(
        model_id=_space(items), shas=[it["sha256"] for it in items],
        including=[it["id"] for it in items], point_ids=[it["point_id"] for it in items], queued=queued)
    return queued, payloads


def _unusable(items: list[dict], *, lane: str) -> list[dict]:
    """Fail the images of ``items`` whose vector is not finite or is all zeros (``workers.screen``;
    counted on ``lane``) and return the others. The workers screen every vector they compute; this
    is the last look before the store, for a vector that reached the queue another way (a worker
    of an earlier version), so that the store's own refusal never fails a whole write."""
    reasons = screen.faults(np.stack([decode_vector(it["vector"]) for it in items])) if items else []
    bad = [(it["id"], r.value, screen.detail(r)) for it, r in zip(items, reasons) if r is not None]
    if not bad:
        return items
    image_services.images_mark_failed(bad)
    metrics.count_refused_embeddings(lane=lane, reasons=[r for _, r, _ in bad])
    return [it for it, r in zip(items, reasons) if r is None]


def _write_queued(items: list[dict], read: tuple[set[str], dict[str, dict]] | None = None, *,
                  lane: str = Lane.BULK) -> tuple[list[dict], float]:
    """Write the points of the items whose images are still queued, then mark those embedded
    (:func:`_mark_written`). An item whose vector is not usable is failed instead
    (:func:`_unusable`, counted on ``lane``).

    Args:
        read: :func:`_queued_payloads` of these items or of a larger batch holding them, read
            earlier by the caller (one read per chunk instead of one per slice); ``None``: read now.

    Returns:
        ``(items marked embedded now, upsert wall time in ms)``.
    """
    live, upsert_ms = _write_live(items, read, lane=lane)
    return _mark_written(live), upsert_ms


def _write_live(items: list[dict], read: tuple[set[str], dict[str, dict]] | None = None, *,
                lane: str = Lane.BULK) -> tuple[list[dict], float]:
    """Write the points of the items whose images are still queued and whose vectors are usable
    (the others failed: :func:`_unusable`), marking nothing. Returns ``(items written, upsert ms)``."""
    queued, payloads = read if read is not None else _queued_payloads(items)
    live = _unusable([it for it in items if it["id"] in queued], lane=lane)
    if not live:
        return [], 0.0
    return live, _write_points(live, payloads)


def _mark_written(live: list[dict]) -> list[dict]:
    """Mark the images of ``live`` (their points written) embedded, in one statement per kind; returns
    those marked now.

    An image decided meanwhile by another process is left alone: cancelled with its job, expired
    by the reconciler, or embedded by another delivery of the same work (its point is the same). If
    that happens between the write and the mark, the point is forgotten again (deleted, or its
    payload rewritten from the database when other rows share it), so Qdrant never holds a point
    that no embedded row accounts for."""
    if not live:
        return []
    marked = image_services.images_mark_embedded(live)
    for it in live:
        if it["id"] not in marked:
            point_forget(point_id=it["point_id"], sha256=it["sha256"], model_id=_space([it]))
    done = [it for it in live if it["id"] in marked]
    duplicate_scans.images_written(done)  # owners with a finished near-duplicate scan group them next
    return done


def chunk_index(*, job_id: str, stat_id: int | None, items: list[dict], priority: str,
                upsert_ms: float = 0.0) -> dict:
    """Write a chunk's points slice by slice, then mark the part's images embedded at once (and only
    once) their points are written; refresh the job when the chunk is written. Which images are still
    queued, and their points' payloads, are read once for the whole part (:func:`_queued_payloads`);
    an image no longer queued then is not written, and one decided between that read and the mark
    (the job was cancelled meanwhile) has its point taken back (:func:`_mark_written`). Per slice:
    one store call and one look at the queue; per part a constant handful of SQL statements,
    whatever its size (a re-embed chunk holds hundreds of images: docs/scaling.md). An image whose
    point is written stays queued (``waiting_for_store``) until the mark: a crash in between leaves
    it to the redelivery, which writes the same point again.

    Between slices (``VECTORS_WRITE_SLICE`` points) the vectors worker looks at its queue: when
    interactive work waits there, the chunk yields: the rest goes back to the ``vectors`` queue as
    a new ``index_chunk`` at the chunk's bulk ``priority`` (``"urgent"``/``"background"``), behind
    the interactive messages, and this task ends. One process owns the embedded store and runs one
    task at a time, so this is what keeps an interactive request from waiting behind a whole
    chunk's write (tens of ms for 64 points on a quiet store, most of a second under bulk load).
    Writes are idempotent (deterministic point ids), so a redelivery after a crash rewrites the
    same points.

    Args:
        priority: the chunk's job priority (``"urgent"``/``"background"``), kept by a continuation.
        upsert_ms: upsert time already spent on this chunk by earlier parts (ms; 0 for a first
            part), for its BatchStat.

    Returns:
        ``{"written": n, "upsert_ms": ms, "yielded": n}``: items this part dealt with (written, or
        skipped as decided meanwhile), and items handed to the continuation (0 when finished).

    Raises:
        One of :data:`STORE_ERRORS` when the store cannot be written (the task retries with backoff);
        the images stay queued, their reason ``waiting_for_store`` and detail naming the error.
    """
    from qdrant_client.http.exceptions import UnexpectedResponse

    from embeddings import dispatch
    from embeddings import lane_control
    from embeddings import sink

    size = max(1, settings.VECTORS_WRITE_SLICE)
    written = 0
    read = _queued_payloads(items)
    unmarked: list[dict] = []  # points written, images not marked yet

    def mark() -> None:
        metrics.count_images(lane=Lane.BULK, status="embedded", n=len(_mark_written(unmarked)))
        unmarked.clear()

    def send_rest() -> dict:
        """Mark what is written, queue the unwritten rest as a new ``index_chunk`` at the chunk's
        priority; this part's result."""
        mark()
        dispatch.send_index_chunk(job_id=job_id, stat_id=stat_id, items=items[written:], priority=priority,
                                  upsert_ms=upsert_ms)
        return {"written": written, "upsert_ms": round(upsert_ms, 2), "yielded": len(items) - written}

    while written < len(items):
        part = items[written : written + size]
        try:
            try:
                live, part_ms = _write_live(part, read)
                unmarked += live
                upsert_ms += part_ms
            except UnexpectedResponse as e:
                if (e.status_code or 0) < 500:
                    raise
                raise StoreUnavailable(str(e)) from e
        except STORE_ERRORS as e:
            mark()  # what is written is kept
            _images_wait_for_store([it["id"] for it in items[written:]], f"vector store unreachable, retrying "
                                                                         f"with backoff: {type(e).__name__}: {e}")
            if written and not sink.is_direct():  # what is written stays written; the retry carries only the rest
                return send_rest()
            raise
        written += len(part)
        if written < len(items) and not sink.is_direct() and lane_control.vectors_interactive_waiting():
            return send_rest()
    mark()
    if stat_id is not None:
        stat = BatchStat.objects.filter(id=stat_id).first()
        if stat is not None:
            now = timezone.now()
            # end to end: chunk start → embed end (total so far) → handed over → points written
            total_ms = stat.total_ms + max(upsert_ms, (now - stat.created_at).total_seconds() * 1000)
            BatchStat.objects.filter(id=stat_id).update(upsert_ms=upsert_ms, finished_at=now, total_ms=total_ms)
            metrics.observe_stages(lane=Lane.BULK, stages_ms={"upsert": upsert_ms, "total": total_ms})
    job_services.job_refresh(job_id=job_id)
    return {"written": written, "upsert_ms": round(upsert_ms, 2), "yielded": 0}


# --- interactive lane ----------------------------------------------------------------------------

def interactive_embed(*, image_ids: list[str], deadline_ts: float) -> dict:
    """Embed an interactive request's images through the process's dynamic batcher.

    A request whose deadline has passed before it reaches the model is not computed: its images
    come back as ``expired``. An image whose vector is not finite or is all zeros comes back failed
    (``non_finite_embedding``, ``zero_embedding``: ``workers.screen``), counted.

    Returns:
        ``{"items": [...], "failed": [[id, reason, detail], ...], "timings": {stage: ms}}``.
    """
    from workers.batcher import Expired
    from workers.runner import screened

    rows, models = {}, set()
    for i, key, sha, pid, mid in Image.objects.filter(id__in=image_ids, status=ImageStatus.QUEUED).values_list(
            "id", "storage_key", "sha256", "point_id", "model_id"):
        rows[str(i)] = (key, sha, str(pid))
        models.add(mid)
    model_id = models.pop() if len(models) == 1 else runtime.model_id()  # one request: one space
    ordered = [i for i in image_ids if i in rows]
    expired = lambda ids: [[i, Reason.EXPIRED.value, "deadline passed before the model ran"] for i in ids]  # noqa: E731
    if time.time() > deadline_ts:
        return {"items": [], "failed": expired(ordered), "timings": {}}
    runner = runtime.batch_runner(model_id)
    prepared = runner.prepare(ordered, _loader({k: v[:2] for k, v in rows.items()}),
                              _thumbnailer({k: v[1] for k, v in rows.items()}))
    failed = [[f.key, f.reason, f.detail] for f in prepared.failed]
    timings = prepared.timings
    items = []
    if prepared.metas:
        try:
            with timings.measure("embed"):
                vectors = runtime.dynamic_batcher(model_id).embed(prepared.pixels, deadline=deadline_ts)
        except Expired:
            return {"items": [], "failed": failed + expired([m.key for m in prepared.metas]), "timings": {}}
        metas, vectors, refused = screened(prepared.metas, vectors)  # NaN, infinity or zeros fail alone
        failed += [[f.key, f.reason, f.detail] for f in refused]
        metrics.count_refused_embeddings(lane=Lane.INTERACTIVE, reasons=[f.reason for f in refused])
        items = [_item(m, v, rows[m.key][2], rows[m.key][1], model_id) for m, v in zip(metas, vectors)]
    timings.total = (time.perf_counter() - prepared.started) * 1000
    return {"items": items, "failed": failed, "timings": timings.as_dict()}


def interactive_index(*, embedded: dict, owner_id: int | None, k: int, skipped_ids: list[str],
                      vectors: bool = False) -> dict:
    """Write an interactive request's points, record outcomes, and find each image's neighbours.

    Only images still queued are written (:func:`_write_queued`): one the reconciler expired after
    its deadline, while this task waited, stays expired and gets no point. ``k`` = 0: no search.
    ``vectors``: each written or shared image's entry also carries its stored vector (``"vector"``,
    base64 of little-endian float32; ``POST /api/embeddings/`` with ``store``).

    Returns:
        ``{image_id: {"status", "reason", "detail", "neighbours": [...]}}`` for every image.
    """
    items, failed = embedded.get("items", []), embedded.get("failed", [])
    upsert_ms = _write_queued(items, lane=Lane.INTERACTIVE)[1] if items else 0.0
    embedded_now = {str(i) for i in Image.objects.filter(id__in=[it["id"] for it in items],
                                                          status=ImageStatus.EMBEDDED).values_list("id", flat=True)}
    items = [it for it in items if it["id"] in embedded_now]  # written now, or by another delivery
    image_services.images_mark_failed([tuple(f) for f in failed])
    if embedded.get("timings"):
        t = StageTimings(**{k2: v for k2, v in embedded["timings"].items() if k2 != "upsert"})
        t.upsert = upsert_ms
        stat = _stat(job_id=None, lane=Lane.INTERACTIVE, images=len(items) + len(failed), failed=len(failed), timings=t)
        BatchStat.objects.filter(id=stat.id).update(upsert_ms=upsert_ms, total_ms=t.total + upsert_ms,
                                                    finished_at=timezone.now())
    # the request's space: its rows' (created in the space active when it arrived)
    model_id = (items[0].get("model_id") if items else None) or next(iter(
        Image.objects.filter(id__in=skipped_ids).values_list("model_id", flat=True)[:1]), None) or runtime.model_id()
    store = runtime.vector_store(model_id)
    out: dict[str, dict] = {}
    queries = {it["id"]: (uuid.UUID(it["point_id"]), decode_vector(it["vector"])) for it in items}
    skipped = Image.objects.filter(id__in=skipped_ids).values_list("id", "point_id")
    stored = store.vectors([pid for _, pid in skipped])
    for image_id, pid in skipped:
        if pid in stored:
            queries[str(image_id)] = (pid, stored[pid])
    for image_id, (pid, vector) in queries.items():
        if k == 0:  # embed only: no neighbours asked for (the store refuses a limit of 0)
            out[image_id] = {"neighbours": []}
        else:
            hits = store.search(vector, k=k, owner_id=owner_id, exclude=[pid])
            out[image_id] = {"neighbours": hits_to_results(hits, owner_id=owner_id, model_id=model_id)}
        if vectors:
            out[image_id]["vector"] = encode_vector(vector)
    for image_id, reason, detail in failed:
        out[image_id] = {"reason": reason, "detail": detail, "neighbours": []}
    return out


# --- queries -------------------------------------------------------------------------------------

def _query_expired(deadline_ts: float) -> dict | None:
    """The refusal of a query whose deadline (Unix s) has passed, else ``None``."""
    late = time.time() - deadline_ts
    if late <= 0:
        return None
    return {"reason": Reason.EXPIRED.value, "detail": f"deadline passed {late:.3f} s before the model ran"}


def query_embed(*, storage_key: str, sha256: str, deadline_ts: float, model_id: str) -> dict:
    """Embed a query image (not stored as an Image) through the process's dynamic batcher, shared
    with interactive uploads. A query whose deadline (Unix s) has passed before decoding, or before
    the batcher hands it to the model, is not computed: nobody waits for it any more.

    ``model_id``: the space searched (the web sends the active one).

    Returns:
        ``{"vector": base64}``, or ``{"reason", "detail"}`` when the image cannot be decoded, the
        deadline passed (reason ``expired``), this worker may not load that model
        (``model_not_configured``), or the model's vector is not finite or is all zeros
        (``non_finite_embedding``, ``zero_embedding``; counted).
    """
    from workers.batcher import Expired

    if (refused := _query_expired(deadline_ts)) is not None:
        return refused
    try:
        runner = runtime.batch_runner(model_id)
    except ModelNotConfigured as e:
        return {"reason": Reason.MODEL_NOT_CONFIGURED.value, "detail": str(e)}
    prepared = runner.prepare([storage_key], lambda key: runtime.blob_store().read(key, sha256))
    if prepared.failed:
        return {"reason": prepared.failed[0].reason, "detail": prepared.failed[0].detail}
    try:
        vectors = runtime.dynamic_batcher(model_id).embed(prepared.pixels, deadline=deadline_ts)
    except Expired:
        return _query_expired(deadline_ts) or {"reason": Reason.EXPIRED.value, "detail": "deadline passed"}
    return _query_vector(vectors[0])


def _query_vector(vector) -> dict:
    """A query's answer: ``{"vector": base64}``, or the refusal of a vector that is not finite or is
    all zeros (``workers.screen``), counted in the interactive lane (where queries run)."""
    reason = screen.fault(vector)
    if reason is None:
        return {"vector": encode_vector(vector)}
    metrics.count_refused_embeddings(lane=Lane.INTERACTIVE, reasons=[reason])
    return {"reason": reason.value, "detail": screen.detail(reason)}


def text_embed(*, text: str, deadline_ts: float, model_id: str) -> dict:
    """Embed a text query with space ``model_id``'s text tower → ``{"vector": base64}``;
    ``{"reason": "expired", "detail"}`` without running the model when its deadline (Unix s) has
    passed; ``model_not_configured`` when this worker may not load it; ``non_finite_embedding`` /
    ``zero_embedding`` when the vector cannot be compared (:func:`_query_vector`)."""
    if (refused := _query_expired(deadline_ts)) is not None:
        return refused
    try:
        holder = runtime.encoder_holder(model_id)
    except ModelNotConfigured as e:
        return {"reason": Reason.MODEL_NOT_CONFIGURED.value, "detail": str(e)}
    encoder = holder.get()
    if not encoder.has_text:
        return _no_text_tower(model_id)
    return _query_vector(encoder.encode_texts([text])[0])


def _no_text_tower(model_id: str) -> dict:
    """The refusal of a text in space ``model_id`` whose checkpoint holds only the image tower."""
    return {"reason": Reason.TEXT_TOWER_MISSING.value,
            "detail": f"the space {model_id} has no text tower (its checkpoint holds only the image tower): "
                      f"search it by image or by stored image"}


def inputs_embed(*, items: list[dict], deadline_ts: float, model_id: str) -> dict:
    """Embed the inputs of one embeddings request (``services.embed``) with space ``model_id``'s
    model: every image in one ``prepare`` and through the process's dynamic batcher (shared with
    uploads and queries), every text in one ``encode_texts`` call. Images are temporary blobs the
    web wrote and deletes; nothing is stored here.

    Args:
        items: in input order, ``{"text": str}`` or ``{"key": temporary storage key, "sha256": hex}``.
        deadline_ts: Unix s; once it has passed before decoding, before the batcher hands the
            images to the model, or before the texts, nothing more is computed.

    Returns:
        ``{"data": [...], "image_tokens": n}``, ``data`` one entry per item, in order:
        ``{"vector": base64 of (D,) little-endian float32, L2-normalised}`` (a text's also carries
        ``"tokens"``: :meth:`workers.model.ClipEncoder.count_tokens`), or ``{"reason", "detail"}``:
        a refused image's reason code, ``expired`` for every item once the deadline passed,
        ``model_not_configured`` for every item when this worker may not load that model,
        ``non_finite_embedding`` / ``zero_embedding`` for an input whose vector cannot be compared
        (``workers.screen``; counted in the interactive lane).
        ``image_tokens``: what one image counts in the usage (``ClipEncoder.image_tokens``).
    """
    from workers.batcher import Expired
    from workers.runner import screened

    def every(refusal: dict) -> dict:
        return {"data": [refusal] * len(items), "image_tokens": 0}

    if (refused := _query_expired(deadline_ts)) is not None:
        return every(refused)
    images = {str(i): (it["key"], it["sha256"]) for i, it in enumerate(items) if "key" in it}
    texts = [(i, it["text"]) for i, it in enumerate(items) if "text" in it]
    try:
        holder = runtime.encoder_holder(model_id)
        runner = runtime.batch_runner(model_id) if images else None
    except ModelNotConfigured as e:
        return every({"reason": Reason.MODEL_NOT_CONFIGURED.value, "detail": str(e)})
    out: list[dict | None] = [None] * len(items)
    if images:
        store = runtime.blob_store()
        prepared = runner.prepare(list(images), lambda key: store.read(*images[key]))
        for f in prepared.failed:
            out[int(f.key)] = {"reason": f.reason, "detail": f.detail}
        if prepared.metas:
            try:
                vectors = runtime.dynamic_batcher(model_id).embed(prepared.pixels, deadline=deadline_ts)
            except Expired:
                return every(_query_expired(deadline_ts) or {"reason": Reason.EXPIRED.value,
                                                             "detail": "deadline passed"})
            metas, vectors, refused = screened(prepared.metas, vectors)
            for f in refused:
                out[int(f.key)] = {"reason": f.reason, "detail": f.detail}
            metrics.count_refused_embeddings(lane=Lane.INTERACTIVE, reasons=[f.reason for f in refused])
            for meta, vector in zip(metas, vectors):
                out[int(meta.key)] = {"vector": encode_vector(vector)}
    encoder = holder.get()
    if texts and not encoder.has_text:
        for i, _ in texts:
            out[i] = _no_text_tower(model_id)
        texts = []
    if texts:
        if (refused := _query_expired(deadline_ts)) is not None:  # the images took the time: nobody waits
            return every(refused)
        strings = [t for _, t in texts]
        for (i, _), vector, n in zip(texts, encoder.encode_texts(strings), encoder.count_tokens(strings)):
            out[i] = _query_vector(vector)
            if "vector" in out[i]:
                out[i]["tokens"] = n
    return {"data": out, "image_tokens": encoder.image_tokens}


def vector_search(*, query: dict, owner_id: int | None, k: int, job_id: str | None, model_id: str,
                  where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
                  candidates: int | None = None) -> dict:
    """Top-k images for a query ``{"vector": base64}`` in space ``model_id``'s collection,
    restricted to ``owner_id`` (None: all), ``job_id`` (None: any job) and the metadata filter
    ``where`` (the API's JSON, ``workers.vector_store.filters``; applied inside the vector query,
    so k results come back whenever k images match). A refused query image (``{"reason",
    "detail"}``) is passed through unchanged, and a query vector that is not finite or is all
    zeros is refused (``non_finite_embedding``, ``zero_embedding``: ``workers.screen``; the
    embedding workers refuse it first and count it). ``with_vectors``: each result carries its
    stored vector (``"vector"``: base64 of little-endian float32), read by the search itself.
    ``diversity`` (in [0, 1], checked by the caller) > 0: the store's MMR re-ranks the
    ``candidates`` nearest (``VectorStore.search``).

    Returns:
        ``{"results": [...]}`` or the refusal.
    """
    if "vector" not in query:
        return query
    vector = decode_vector(query["vector"])
    if (reason := screen.fault(vector)) is not None:  # the store refuses it: refused here in the same words
        return {"reason": reason.value, "detail": screen.detail(reason)}
    flt = filters.parse(where) if where is not None else None
    hits = runtime.vector_store(model_id).search(vector, k=k, owner_id=owner_id, job_id=job_id,
                                                 where=flt, with_vectors=with_vectors, diversity=diversity,
                                                 candidates=candidates)
    return {"results": hits_to_results(hits, owner_id=owner_id, model_id=model_id, where=flt, job_id=job_id)}


def point_search(*, point_id: str, owner_id: int | None, k: int, job_id: str | None,
                 model_id: str, where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
                 candidates: int | None = None) -> list[dict] | None:
    """Top-k images similar to a stored point (itself included, when it passes the filter) of space
    ``model_id``, restricted to ``owner_id`` (None: all), ``job_id`` (None: any job) and the
    metadata filter ``where`` (JSON); ``None`` if the point is missing, or its stored vector is not
    finite or is all zeros (written before ``workers.screen``: the store leaves it out).
    ``with_vectors``, ``diversity``, ``candidates``: as :func:`vector_search`."""
    store = runtime.vector_store(model_id)
    got = store.vectors([uuid.UUID(point_id)])
    if not got:
        return None
    flt = filters.parse(where) if where is not None else None
    hits = store.search(next(iter(got.values())), k=k, owner_id=owner_id, job_id=job_id, where=flt,
                        with_vectors=with_vectors, diversity=diversity, candidates=candidates)
    return hits_to_results(hits, owner_id=owner_id, model_id=model_id, where=flt, job_id=job_id)


def examples_search(*, embedded: dict, examples: dict, owner_id: int | None, k: int, job_id: str | None,
                    model_id: str, where: dict | None = None, with_vectors: bool = False,
                    strategy: str = "best_score", diversity: float = 0.0, candidates: int | None = None) -> dict:
    """Top-k images for several positive and negative examples in space ``model_id``'s collection
    (``VectorStore.recommend``: the engine's recommend query of ``strategy``), restricted as
    :func:`vector_search`.

    Args:
        embedded: ``pipeline.inputs_embed``'s answer for the examples sent as texts or images
            (``{"data": [{"vector"} | {"reason", "detail"}, ...]}``; ``{"data": []}`` when none).
        examples: ``{"positive": [...], "negative": [...]}``, each entry ``{"input": i}`` (entry
            ``i`` of ``embedded["data"]``) or ``{"point_id": uuid}`` (a stored image's point: its
            vector read here, and the point left out of the hits, as a Qdrant server does with
            example ids).

    Returns:
        ``{"results": [...]}``, or ``{"reason", "detail", "example"}``: the first refused input's
        refusal (``example`` naming it, e.g. ``negative[0]``)
        (``expired``, a refused image's code, ``non_finite_embedding``...), ``vector_missing`` (a
        stored example's point is not in the store), ``zero_embedding`` (examples whose average
        vector, the query of ``average_vector`` or MMR's relevance, is all zeros).
    """
    from workers.screen import UnusableVector

    data = embedded.get("data", [])
    names = {e["input"]: f"{side}[{i}]" for side in ("positive", "negative")
             for i, e in enumerate(examples.get(side, [])) if "input" in e}
    for n, got in enumerate(data):
        if "vector" not in got:
            return {"reason": got.get("reason", Reason.EXPIRED.value), "detail": got.get("detail", ""),
                    "example": names.get(n)}
    store = runtime.vector_store(model_id)
    wanted = {e["point_id"] for side in ("positive", "negative") for e in examples.get(side, []) if "point_id" in e}
    stored = store.vectors([uuid.UUID(p) for p in sorted(wanted)])
    missing = sorted(p for p in wanted if uuid.UUID(p) not in stored)
    if missing:
        return {"reason": "vector_missing", "detail": f"example point {missing[0]} has no vector in the store",
                "point_id": missing[0]}

    def vectors(side: str) -> list:
        return [stored[uuid.UUID(e["point_id"])] if "point_id" in e else decode_vector(data[e["input"]]["vector"])
                for e in examples.get(side, [])]

    flt = filters.parse(where) if where is not None else None
    try:
        hits = store.recommend(vectors("positive"), vectors("negative"), k=k, strategy=strategy, owner_id=owner_id,
                               job_id=job_id, exclude=[uuid.UUID(p) for p in sorted(wanted)], where=flt,
                               with_vectors=with_vectors, diversity=diversity, candidates=candidates)
    except UnusableVector as e:
        return {"reason": Reason.ZERO_EMBEDDING.value, "detail": f"the examples cancel out: {e}"}
    return {"results": hits_to_results(hits, owner_id=owner_id, model_id=model_id, where=flt, job_id=job_id)}


def point_forget(*, point_id: str, sha256: str, model_id: str) -> str:
    """After an image row is deleted: delete its point in space ``model_id``'s collection (the row's
    space), or rewrite its payload if other rows share it. A dropped space's points went with its
    collection: nothing to do.

    Returns ``"deleted"``, ``"kept"`` or ``"dropped"``.
    """
    from embeddings.models import EmbeddingSpace, SpaceState

    if EmbeddingSpace.objects.filter(model_id=model_id, state=SpaceState.DROPPED).exists():
        return "dropped"
    store = runtime.vector_store(model_id)
    payload = image_services.point_payloads(model_id=model_id, shas=[sha256])[sha256]
    pid = uuid.UUID(point_id)
    with transaction.atomic():
        if payload["owner_ids"]:
            store.set_payloads({pid: payload})
            return "kept"
        store.delete([pid])
        return "deleted"


def point_vectors(*, point_ids: list[str], model_id: str) -> dict:
    """The stored vectors of points ``point_ids`` (UUID strings) in space ``model_id``'s collection,
    in one read, packed for a task result: ``{"dim": D, "ids": [found ids, in the order asked],
    "vectors": base64 of the found vectors, (len(ids), D) little-endian float32, row-major}``. A
    point not in the store is left out of ``ids`` (and of ``vectors``)."""
    import numpy as np

    store = runtime.vector_store(model_id)
    wanted = [uuid.UUID(p) for p in point_ids]
    got = store.vectors(wanted)
    found = [(p, u) for p, u in zip(point_ids, wanted) if u in got]
    matrix = np.stack([got[u] for _, u in found]) if found else np.empty((0, store.dim), np.float32)
    return {"dim": store.dim, "ids": [p for p, _ in found], "vectors": encode_vector(matrix.reshape(-1))}


def point_count(*, model_id: str) -> dict:
    """``{"collection": name, "points": exact count}`` of space ``model_id``."""
    store = runtime.vector_store(model_id)
    return {"collection": store.collection, "points": store.count()}
