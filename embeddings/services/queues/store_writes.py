"""What the queues share on the way to the vector store: a computed vector as a message item, its
batch's ``BatchStat`` row, the errors that mean the store cannot be written (retried, the images
waiting visibly), and writing the points of items whose images are still queued. Used by the bulk
queue (a chunk written in this process against a Qdrant server, or handed over) and the vectors
queue (``vectors.chunk_index``, ``vectors.interactive_index``).
"""
from __future__ import annotations

import os
import socket
import time
import uuid

import httpx
import numpy as np
from django.utils import timezone
from qdrant_client.http.exceptions import ResponseHandlingException

from embeddings import dispatch, metrics, runtime
from embeddings.messages import decode_vector, encode_vector
from embeddings.models import BatchStat, Image, ImageStatus, Lane
from embeddings.services.catalogue import images as image_services
from embeddings.services.catalogue import payloads as payload_reads
from workers import screen
from workers.timing import StageTimings
from workers.vector_store import Point

#: This worker process, as a ``BatchStat`` row names it: ``host:pid``.
_WORKER = f"{socket.gethostname()}:{os.getpid()}"

#: Reason shown on a queued image whose vector is computed and waits to be written: the vector
#: store (or the vectors worker that owns it) is busy, down, or unreachable. Not a failure.
WAITING_FOR_STORE = "waiting_for_store"


class StoreUnavailable(ConnectionError):
    """The vector store answered with a server error (5xx): retried like a lost connection."""


def _store_errors() -> tuple[type[BaseException], ...]:

    return (ConnectionError, TimeoutError, OSError, httpx.TransportError, ResponseHandlingException)


#: Systemic failures writing to the vector store: the write is retried with backoff, the images
#: wait (queued, reason ``waiting_for_store``), never marked embedded before their points exist.
STORE_ERRORS = _store_errors()


def images_wait_for_store(image_ids: list[str], detail: str) -> None:
    """Show images whose vectors wait to be written (still queued: nothing is embedded yet)."""
    Image.objects.filter(id__in=image_ids, status=ImageStatus.QUEUED).update(
        reason=WAITING_FOR_STORE, reason_detail=detail[:2000])


def vector_item(meta, vector, point_id: str, sha256: str, model_id: str) -> dict:
    """One computed vector on its way to the store: the image, its point, facts, and the embedding
    space (``model_id``) whose collection it goes to."""
    return {"id": meta.key, "point_id": point_id, "sha256": sha256, "width": meta.width, "height": meta.height,
            "format": meta.format, "vector": encode_vector(vector), "model_id": model_id}


def batch_stat(*, job_id, lane: str, images: int, failed: int, timings: StageTimings,
               finished: bool = False) -> BatchStat:
    """Create the ``BatchStat`` row of a computed batch (``job_id`` None: an interactive request's):
    its image and failure counts and its stage times (ms), this worker process named. ``finished``:
    the batch is written already, so the row also has its upsert time, a total with it, and
    ``finished_at`` now (one insert instead of an insert and an update)."""
    t = timings
    done = {"upsert_ms": t.upsert, "finished_at": timezone.now()} if finished else {}
    return BatchStat.objects.create(
        job_id=job_id, lane=lane, images=images, failed=failed, load_ms=t.load, decode_ms=t.decode,
        decode_wait_ms=t.decode_wait, preprocess_ms=t.preprocess, embed_ms=t.embed,
        total_ms=t.total + (t.upsert if finished else 0.0), worker=_WORKER, **done,
    )


def items_space(items: list[dict]) -> str:
    """The embedding space of a call's ``items`` (one space per call: a chunk's job, a request's
    rows): their ``model_id``, else the active space (items built without one: benchmarks)."""
    return items[0].get("model_id") or runtime.model_id()


def _write_points(items: list[dict], payloads: dict[str, dict] | None = None,
                  vectors: np.ndarray | None = None) -> float:
    """Upsert ``items`` with ``payloads`` (by sha256; ``None``: recomputed from the database, counting
    the items' rows) and ``vectors`` (``(len(items), D) float32``, the items' own decoded;
    ``None``: decoded here); returns the upsert wall time (ms)."""
    model_id = items_space(items)
    if payloads is None:
        payloads = payload_reads.point_payloads(
            model_id=model_id, shas=[it["sha256"] for it in items], including=[it["id"] for it in items],
            point_ids=[it["point_id"] for it in items],
        )
    if vectors is None:
        vectors = _decoded(items)
    points = [Point(id=uuid.UUID(it["point_id"]), vector=v, payload=payloads[it["sha256"]])
              for it, v in zip(items, vectors)]
    t0 = time.perf_counter()
    runtime.vector_store(model_id).upsert(points)
    return (time.perf_counter() - t0) * 1000


def queued_payloads(items: list[dict]) -> tuple[set[str], dict[str, dict]]:
    """One read before writing ``items``' points: the ids of those whose images are still queued,
    and the payload (by sha256) of every item's point, counting those rows
    (``payloads.point_payloads`` with ``queued``)."""
    if not items:
        return set(), {}
    queued: set[str] = set()
    payloads = payload_reads.point_payloads(
        model_id=items_space(items), shas=[it["sha256"] for it in items],
        including=[it["id"] for it in items], point_ids=[it["point_id"] for it in items], queued=queued)
    return queued, payloads


#: Most times :func:`payloads_settle` re-reads the database and rewrites payloads before it leaves the
#: rest to a queued ``forget_point`` (which settles in turn): a round repeats only when a change
#: committed during the round before it, a matter of milliseconds.
SETTLE_ROUNDS = 8


def payloads_settle(*, model_id: str, points: dict[str, str], given: dict[str, dict]) -> int:
    """Make the payloads of ``points`` in space ``model_id``'s collection agree with the database,
    after this process wrote them: read them again (``payloads.point_payloads``) and overwrite each
    one that differs from what the store was given, until a read finds what was written.

    The rule, and why it converges: a payload is a function of the database rows of its point
    (metadata, external ids, owners, jobs; a copy's from its user row), and every writer of a
    payload (a chunk or a request written and marked embedded, ``forget_point``) reads the rows
    again *after* its write. A change committed before that read is seen by it and written here; a
    change committed after it finds the rows embedded (a writer marks before it settles), so its
    own refresh (``identity.payloads_refresh``) starts after this write and lands after it. Either
    way the last write to a point carries the latest rows, whatever the interleaving: no version
    column is needed, the payload itself is compared.

    Args:
        points: ``{sha256: point id}`` of the points written (one point per bytes in a space).
        given: ``{sha256: payload}`` as written (``point_payloads``' shape).

    Returns:
        The number of payloads rewritten (0 when nothing changed meanwhile). A point whose rows
        are all gone is left to the deletion's own ``forget_point``; one missing from the store is
        not recreated here (its rows' deletion or its writer's redelivery deals with it).
    """
    store = runtime.vector_store(model_id)
    rewritten = 0
    given = dict(given)
    for _ in range(SETTLE_ROUNDS):
        now = payload_reads.point_payloads(model_id=model_id, shas=list(points), point_ids=list(points.values()))
        changed = {sha: p for sha, p in now.items() if p["owner_ids"] and p != given.get(sha)}
        if not changed:
            return rewritten
        present = store.payloads([uuid.UUID(points[sha]) for sha in changed])
        store.set_payloads({uuid.UUID(points[sha]): p for sha, p in changed.items()
                            if uuid.UUID(points[sha]) in present})
        rewritten += len(changed)
        given.update(changed)
    for sha in changed:  # still moving after every round: settled again by a queued forget_point
        dispatch.send_forget_point(point_id=points[sha], sha256=sha, interactive=False, model_id=model_id)
    return rewritten


def _decoded(items: list[dict]) -> np.ndarray:
    """The items' vectors, decoded once: ``(len(items), D) float32``."""
    return np.stack([decode_vector(it["vector"]) for it in items])


def _unusable(items: list[dict], *, lane: str) -> tuple[list[dict], np.ndarray]:
    """Fail the images of ``items`` whose vector is not finite or is all zeros (``workers.screen``;
    counted on ``lane``) and return the others with their decoded vectors (``(n, D) float32``, so
    the write does not decode them again). The workers screen every vector they compute; this is
    the last look before the store, for a vector that reached the queue another way (a worker of an
    earlier version), so that the store's own refusal never fails a whole write."""
    if not items:
        return [], np.empty((0, 0), np.float32)
    vectors = _decoded(items)
    reasons = screen.faults(vectors)
    bad = [(it["id"], r.value, screen.detail(r)) for it, r in zip(items, reasons) if r is not None]
    if not bad:
        return items, vectors
    image_services.images_mark_failed(bad)
    metrics.count_refused_embeddings(lane=lane, reasons=[r for _, r, _ in bad])
    keep = [n for n, r in enumerate(reasons) if r is None]
    return [items[n] for n in keep], vectors[keep]


def write_live(items: list[dict], read: tuple[set[str], dict[str, dict]] | None = None, *,
                lane: str = Lane.BULK) -> tuple[list[dict], float]:
    """Write the points of the items whose images are still queued and whose vectors are usable
    (the others failed: :func:`_unusable`), marking nothing. Returns ``(items written, upsert ms)``."""
    queued, payloads = read if read is not None else queued_payloads(items)
    live, vectors = _unusable([it for it in items if it["id"] in queued], lane=lane)
    if not live:
        return [], 0.0
    return live, _write_points(live, payloads, vectors)
