"""The vectors queue's worker side (the sole owner of the vector store): a bulk chunk's points
(:func:`chunk_index`) and an interactive request's (:func:`interactive_index`) written and their
images marked embedded, searches by vector, by stored point and by examples, a deleted row's point
forgotten, stored vectors read, a collection's points counted.
"""
from __future__ import annotations

import time
import uuid

import numpy as np
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from qdrant_client.http.exceptions import UnexpectedResponse

from embeddings import dispatch, lane_control, metrics, runtime, sink
from embeddings.deferred import after_answer
from embeddings.messages import decode_vector, encode_vector
from embeddings.models import (
    BatchStat,
    EmbeddingSpace,
    Image,
    ImageStatus,
    Lane,
    SpaceState,
)
from embeddings.selectors import hits_to_results
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import payloads as payload_reads
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.duplicates import scan as duplicate_scans
from embeddings.services.queues.store_writes import (
    STORE_ERRORS,
    StoreUnavailable,
    batch_stat,
    images_wait_for_store,
    items_space,
    payloads_settle,
    queued_payloads,
    write_live,
)
from workers import screen
from workers.errors import Reason
from workers.screen import UnusableVector
from workers.timing import StageTimings
from workers.vector_store import filters


def _write_queued(items: list[dict], read: tuple[set[str], dict[str, dict]] | None = None, *,
                  lane: str = Lane.BULK, compute_s_each: float = 0.0,
                  settle_after_answer: bool = False) -> tuple[list[dict], float]:
    """Write the points of the items whose images are still queued, then mark those embedded
    (:func:`_mark_written`, metering ``compute_s_each`` worker seconds for each image marked). An
    item whose vector is not usable is failed instead (``store_writes._unusable``, counted on ``lane``).

    Args:
        read: ``store_writes.queued_payloads`` of these items or of a larger batch holding them, read
            earlier by the caller (one read per chunk instead of one per slice); ``None``: read now.
        settle_after_answer: settle the payloads once the task has answered (:func:`_mark_written`).

    Returns:
        ``(items marked embedded now, upsert wall time in ms)``.
    """
    read = read if read is not None else queued_payloads(items)
    live, upsert_ms = write_live(items, read, lane=lane)
    marked = _mark_written(live, read[1], compute_s_each=compute_s_each, settle_after_answer=settle_after_answer)
    return marked, upsert_ms


def _mark_written(live: list[dict], payloads: dict[str, dict], *, compute_s_each: float = 0.0,
                  settle_after_answer: bool = False) -> list[dict]:
    """Mark the images of ``live`` (their points written with ``payloads``, by sha256) embedded, in
    one statement per kind (metered in its transaction, ``compute_s_each`` worker seconds each:
    ``images_mark_embedded``), then settle their points' payloads (``store_writes.payloads_settle``: a
    PATCH committed while they were queued found no embedded row to refresh, so the writer takes
    it); returns those marked now.

    An image decided meanwhile by another process is left alone: cancelled with its job, expired
    by the reconciler, or embedded by another delivery of the same work (its point is the same). If
    that happens between the write and the mark, the point is forgotten again (deleted, or its
    payload rewritten from the database when other rows share it), so Qdrant never holds a point
    that no embedded row accounts for.

    ``settle_after_answer`` (an interactive request: someone waits for its neighbours, which no
    payload changes): the settling and the near-duplicate groups run once the task has answered
    (``deferred.after_answer``: still before the message is acknowledged, so a worker that dies
    first leaves the redelivery to settle, as one dying between the mark and the settling does).
    The rule above holds unchanged: the read comes after the mark, only later."""
    if not live:
        return []
    marked = image_services.images_mark_embedded(live, compute_s_each=compute_s_each)
    for it in live:
        if it["id"] not in marked:
            point_forget(point_id=it["point_id"], sha256=it["sha256"], model_id=items_space([it]))
    done = [it for it in live if it["id"] in marked]

    def settle() -> None:
        if done:
            payloads_settle(model_id=items_space(done), points={it["sha256"]: it["point_id"] for it in done},
                            given={it["sha256"]: payloads[it["sha256"]] for it in done})
        duplicate_scans.images_written(done)  # owners with a finished near-duplicate scan group them next

    if settle_after_answer:
        after_answer(settle)
    else:
        settle()
    return done


def _settle_redelivered(items: list[dict], queued: set[str]) -> None:
    """Settle the payloads of ``items`` whose images are embedded already (a redelivered chunk whose
    first delivery died between the mark and its settling, or work another delivery finished): they
    are not written again, and a PATCH that landed before that mark would otherwise stay out of the
    payload for good. One query when every item is still queued (the usual case): none."""
    decided = [it["id"] for it in items if it["id"] not in queued]
    if not decided:
        return
    embedded = {str(i) for i in Image.objects.filter(id__in=decided, status=ImageStatus.EMBEDDED)
                .values_list("id", flat=True)}
    done = [it for it in items if it["id"] in embedded]
    if done:  # what the store holds is unknown: given nothing, each point is rewritten once
        payloads_settle(model_id=items_space(done), points={it["sha256"]: it["point_id"] for it in done}, given={})


def chunk_index(*, job_id: str, stat_id: int | None, items: list[dict], priority: str,
                upsert_ms: float = 0.0) -> dict:
    """Write a chunk's points slice by slice, then mark the part's images embedded at once (and only
    once) their points are written; refresh the job when the chunk is written. Which images are still
    queued, and their points' payloads, are read once for the whole part
    (``store_writes.queued_payloads``); an image no longer queued then is not written, and one
    decided between that read and the mark (the job was cancelled meanwhile) has its point taken
    back (:func:`_mark_written`). Per slice: one store call and one look at the queue; per part a
    constant handful of SQL statements, whatever its size (a re-embed chunk holds hundreds of
    images: docs/scaling.md). An image whose point is written stays queued (``waiting_for_store``)
    until the mark: a crash in between leaves it to the redelivery, which writes the same point
    again.

    Between slices (``VECTORS_WRITE_SLICE`` points) the vectors worker looks at its queue: when
    interactive work waits there, the chunk yields: the rest goes back to the ``vectors`` queue as
    a new ``index_chunk`` at the chunk's bulk ``priority`` (``"urgent"``/``"background"``), behind
    the interactive messages, and this task ends. One process owns the embedded store and runs one
    task at a time, so this is what keeps an interactive request from waiting behind a whole
    chunk's write (tens of ms for 64 points on a quiet store, most of a second under bulk load).
    Where the interactive worker owns the store (``STORE_OWNER=interactive``), its interactive
    threads waiting for their turn at the store also go first between two slices
    (``lane_control.store_turns``), and the chunk goes on after them.
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

    size = max(1, settings.VECTORS_WRITE_SLICE)
    written = 0
    read = queued_payloads(items)
    _settle_redelivered(items, read[0])
    unmarked: list[dict] = []  # points written, images not marked yet
    compute_s_each = _compute_each(stat_id)

    def mark() -> None:
        metrics.count_images(lane=Lane.BULK, status="embedded",
                             n=len(_mark_written(unmarked, read[1], compute_s_each=compute_s_each)))
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
            live, part_ms = _write_slice(part, read)
            unmarked += live
            upsert_ms += part_ms
        except STORE_ERRORS as e:
            mark()  # what is written is kept
            images_wait_for_store([it["id"] for it in items[written:]], f"vector store unreachable, retrying "
                                                                         f"with backoff: {type(e).__name__}: {e}")
            if written and not sink.is_direct():  # what is written stays written; the retry carries only the rest
                return send_rest()
            raise
        written += len(part)
        if written < len(items) and lane_control.owner_runs_threads():
            # the interactive worker owns the store: its interactive threads waiting for it go first
            lane_control.store_turn().let_interactive_through()
        if written < len(items) and not sink.is_direct() and lane_control.vectors_interactive_waiting():
            return send_rest()
    mark()
    if stat_id is not None:
        _finish_stat(stat_id, upsert_ms=upsert_ms)
    job_services.job_refresh(job_id=job_id)
    return {"written": written, "upsert_ms": round(upsert_ms, 2), "yielded": 0}


def _compute_each(stat_id: int | None) -> float:
    """Worker seconds per image of a bulk chunk, from its ``BatchStat`` (``total_ms`` before the
    write: the chunk's start to its embed's end, over the images it computed); 0 without one."""
    if stat_id is None:
        return 0.0
    row = BatchStat.objects.filter(id=stat_id).values_list("total_ms", "images").first()
    return row[0] / 1000 / row[1] if row and row[1] else 0.0


def _write_slice(part: list[dict], read: tuple[set[str], dict[str, dict]]) -> tuple[list[dict], float]:
    """One slice of a chunk's write (``write_live``): ``(items written, upsert ms)``. A server error
    of the store (5xx) raises :class:`StoreUnavailable`, retried like a lost connection; a client
    error (4xx) is a bug and raises as it came."""

    try:
        return write_live(part, read)
    except UnexpectedResponse as e:
        if (e.status_code or 0) < 500:
            raise
        raise StoreUnavailable(str(e)) from e


def _finish_stat(stat_id: int, *, upsert_ms: float) -> None:
    """Finish a written chunk's ``BatchStat`` row (if it still exists): its upsert time (ms), its end,
    and its total end to end: chunk start → embed end (total so far) → handed over → points written."""
    stat = BatchStat.objects.filter(id=stat_id).first()
    if stat is not None:
        now = timezone.now()
        total_ms = stat.total_ms + max(upsert_ms, (now - stat.created_at).total_seconds() * 1000)
        BatchStat.objects.filter(id=stat_id).update(upsert_ms=upsert_ms, finished_at=now, total_ms=total_ms)
        metrics.observe_stages(lane=Lane.BULK, stages_ms={"upsert": upsert_ms, "total": total_ms})


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
    t0 = time.perf_counter()
    items, failed = embedded.get("items", []), embedded.get("failed", [])
    # the request's worker time (prepare and forward passes) over its images, as metered (docs/usage.md)
    compute_s_each = (embedded.get("timings") or {}).get("total", 0.0) / 1000 / max(1, len(items) + len(failed))
    marked, upsert_ms = (_write_queued(items, lane=Lane.INTERACTIVE, compute_s_each=compute_s_each,
                                       settle_after_answer=True) if items else ([], 0.0))
    # written now, or by another delivery: asked of the database only for those not marked now
    embedded_now = {it["id"] for it in marked}
    if others := [it["id"] for it in items if it["id"] not in embedded_now]:
        embedded_now |= {str(i) for i in Image.objects.filter(id__in=others, status=ImageStatus.EMBEDDED)
                         .values_list("id", flat=True)}
    items = [it for it in items if it["id"] in embedded_now]
    image_services.images_mark_failed([tuple(f) for f in failed])
    if embedded.get("timings"):
        t = StageTimings(**{k2: v for k2, v in embedded["timings"].items() if k2 != "upsert"})
        t.upsert = upsert_ms
        n_images, n_failed = len(items) + len(failed), len(failed)
        # a statistics row nobody waits for: written once the answer is out, in one insert
        after_answer(lambda: batch_stat(job_id=None, lane=Lane.INTERACTIVE, images=n_images, failed=n_failed,
                                        timings=t, finished=True))
    # the request's space: its rows' (created in the space active when it arrived)
    model_id = (items[0].get("model_id") if items else None) or next(iter(
        Image.objects.filter(id__in=skipped_ids).values_list("model_id", flat=True)[:1]), None) or runtime.model_id()
    store = runtime.vector_store(model_id)
    t1 = time.perf_counter()
    lane_control.hops.note(write_ms=(t1 - t0) * 1000 - upsert_ms, upsert_ms=upsert_ms)
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
    lane_control.hops.note(search_ms=(time.perf_counter() - t1) * 1000, returned_at=time.time())
    return out


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
        embedded: ``interactive.inputs_embed``'s answer for the examples sent as texts or images
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

    if EmbeddingSpace.objects.filter(model_id=model_id, state=SpaceState.DROPPED).exists():
        return "dropped"
    store = runtime.vector_store(model_id)
    payload = payload_reads.point_payloads(model_id=model_id, shas=[sha256])[sha256]
    pid = uuid.UUID(point_id)
    with transaction.atomic():
        if not payload["owner_ids"]:
            store.delete([pid])
            return "deleted"
        store.set_payloads({pid: payload})
    # a change committed since the read above (a PATCH racing this refresh) is written now
    payloads_settle(model_id=model_id, points={sha256: point_id}, given={sha256: payload})
    return "kept"


def point_vectors(*, point_ids: list[str], model_id: str) -> dict:
    """The stored vectors of points ``point_ids`` (UUID strings) in space ``model_id``'s collection,
    in one read, packed for a task result: ``{"dim": D, "ids": [found ids, in the order asked],
    "vectors": base64 of the found vectors, (len(ids), D) little-endian float32, row-major}``. A
    point not in the store is left out of ``ids`` (and of ``vectors``)."""

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
