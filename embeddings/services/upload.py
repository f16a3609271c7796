"""Web-side orchestration of work that someone waits for: interactive uploads and searches.

The web process never loads the model or opens an embedded vector store: it chains tasks (embed
on the ``interactive`` queue → index/search on the ``vectors`` queue, sent through
``embeddings.dispatch``) and waits for the last result until the request's deadline. With a Qdrant
server (``services.sink``: direct) the interactive worker writes its own points and the web
searches the server itself. What does not finish in time keeps running; the caller gets a status URL.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import time

from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeout
from django.conf import settings

from embeddings import dispatch, runtime
from embeddings.models import Image, ImageStatus, Lane
from embeddings.selectors import jobs_visible_to
from embeddings.lane_control import admission
from embeddings import sink
from embeddings import spaces
from embeddings.sink import RETRY_AFTER_S
from embeddings.errors import ApplicationError
from embeddings.services.catalogue.images import images_create, quick_check
from embeddings.services.catalogue.sources import SourceFile, iter_blocks
from workers.errors import Reason
from workers.ids import point_id

#: HTTP status for a single refused image, by reason code (issue: 400 / 413 / 415 per case).
REASON_STATUS = {
    Reason.EMPTY.value: 400,
    Reason.TRUNCATED.value: 400,
    Reason.CORRUPT.value: 400,
    Reason.TOO_LARGE.value: 413,
    Reason.TOO_MANY_PIXELS.value: 413,
    Reason.NOT_AN_IMAGE.value: 415,
    Reason.UNSUPPORTED_FORMAT.value: 415,
    Reason.DECODE_TIMEOUT.value: 400,
}


@dataclasses.dataclass(frozen=True)
class UploadOutcome:
    """``status``: 200 (all answered), 202 (deadline passed, work continues) or a 4xx when every
    image was refused; ``images``: one dict per uploaded file, in order."""

    status: int
    images: list[dict]


def deadline_for(requested_s: float | None) -> float:
    """Effective deadline (s): the default, or a shorter one the client asked for (never longer).

    Raises:
        ApplicationError: ``invalid_deadline`` when not positive.
    """
    default = settings.INTERACTIVE_DEADLINE_S
    if requested_s is None:
        return default
    if requested_s <= 0:
        raise ApplicationError("deadline must be a positive number of seconds", code="invalid_deadline")
    return min(float(requested_s), default)


def _release_database() -> None:
    """Close this thread's database connection before a long wait (outside a transaction): the
    web's threads outnumber what PostgreSQL should hold open (``WEB_THREADS``,
    ``project/processes.py``), and a waiting request needs no connection; the next query after the
    wait opens one again (a few ms)."""
    from django.db import connection

    if not connection.in_atomic_block:
        connection.close()


def _wait(result, deadline_ts: float):
    """The chain's result, or ``None`` when the deadline passes first. The thread's database
    connection is released for the wait (:func:`_release_database`).

    Raises:
        ApplicationError: ``worker_error`` (503, ``Retry-After``) if a task failed.
    """
    _release_database()
    try:
        return result.get(timeout=max(0.01, deadline_ts - time.time()), propagate=True)
    except CeleryTimeout:
        return None
    except TaskRevokedError as e:
        if "expired" in str(e):  # its message outlived the deadline in the broker: the deadline passed
            return None
        raise ApplicationError(f"the embedding service failed: {type(e).__name__}: {e}", code="worker_error",
                               status=503, headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    except Exception as e:  # a task raised: systemic, not the caller's fault
        raise ApplicationError(f"the embedding service failed: {type(e).__name__}: {e}", code="worker_error",
                               status=503, headers={"Retry-After": str(RETRY_AFTER_S)}) from e


def image_view(im: Image, neighbours: list | None = None) -> dict:
    """The API's representation of one image."""
    out = {
        "id": str(im.id), "status": im.status, "reason": im.reason or None, "detail": im.reason_detail or None,
        "sha256": im.sha256, "width": im.width, "height": im.height, "original_name": im.original_name,
        "job_id": str(im.job_id) if im.job_id else None, "url": f"/api/images/{im.id}/",
        # drawn by the worker that decoded it: there once the image is embedded (or shares those bytes)
        "thumbnail_url": (f"/api/images/{im.id}/thumbnail/"
                          if im.status in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED) else None),
    }
    if neighbours is not None:
        out["neighbours"] = neighbours
    return out


def images_upload(*, owner, sources: list[SourceFile], deadline_s: float, k: int) -> UploadOutcome:
    """Embed uploaded images on the interactive lane and return each one's top-``k`` neighbours.

    Waits until ``deadline_s`` has passed at most; after that answers 202 and the work continues.

    Raises:
        ApplicationError: ``overloaded`` (429, ``Retry-After``) when the lane's predicted wait is
            longer than ``deadline_s``: nothing is stored or queued (``services.admission``).
    """
    admitted = admission.interactive_admit(deadline_s=deadline_s, images=len(sources))
    started = time.time()
    deadline_ts = started + deadline_s
    deadline = dt.datetime.fromtimestamp(deadline_ts, tz=dt.timezone.utc)
    images = images_create(owner=owner, sources=sources, lane=Lane.INTERACTIVE, deadline=deadline)
    to_embed = [str(im.id) for im in images if im.status == ImageStatus.QUEUED]
    skipped = [str(im.id) for im in images if im.status == ImageStatus.SKIPPED]
    owner_filter = None if owner.is_staff else owner.id
    answers: dict | None = {}
    work = {"to_embed": to_embed, "skipped": skipped, "owner_id": owner_filter, "k": k, "deadline_ts": deadline_ts}
    if sink.is_direct() and to_embed:  # a Qdrant server: the interactive worker writes its own points
        answers = _wait(dispatch.send_upload_direct(**work), deadline_ts)
    elif sink.is_direct() and skipped:  # copies of stored bytes only: their neighbours, found here
        answers = sink.store_call("index_interactive", {}, owner_filter, k, skipped)
    elif to_embed or skipped:
        answers = _wait(dispatch.send_upload(**work), deadline_ts)
    # the whole admitted→answered time of this request: what the admission's wait model learns from
    admission.interactive_answered(admitted, images=len(to_embed), status=202 if answers is None else 200)
    fresh = {str(im.id): im for im in Image.objects.filter(id__in=[im.id for im in images])}
    views = [image_view(fresh[str(im.id)], (answers or {}).get(str(im.id), {}).get("neighbours")) for im in images]
    if answers is None:
        return UploadOutcome(status=202, images=views)
    refused = [v for v in views if v["status"] in (ImageStatus.FAILED, ImageStatus.EXPIRED)]
    if views and len(refused) == len(views) and len(views) == 1 and views[0]["reason"] in REASON_STATUS:
        return UploadOutcome(status=REASON_STATUS[views[0]["reason"]], images=views)
    return UploadOutcome(status=200, images=views)


def search(*, user, k: int, job_id: str | None = None, text: str | None = None,
           image: SourceFile | None = None, image_id: str | None = None, deadline_s: float | None = None) -> list[dict]:
    """Top-``k`` images similar to a text, an uploaded image, or a stored image (by id).

    Only the caller's images are searched (all images for staff), enforced by a payload filter in
    the vector store's query. A ``job_id`` must name one of the caller's jobs (any job for staff):
    points are shared per sha256, so a filter on another user's job would reveal which of the
    caller's images that job also holds.

    Raises:
        ApplicationError: ``invalid_query`` (400), ``not_found`` (404: an image or a job the caller
            may not see, or none), a refused query image (400/413/415 with its reason code),
            ``overloaded`` (429: a text or image query whose embedding would wait longer than the
            deadline), ``not_embedded`` (409: an image, or the original of a skipped copy, with no
            vector yet), ``vector_missing`` (409: its vector is not in the store), ``deadline_exceeded``
            (504), ``worker_error`` (503).
    """
    given = [x is not None for x in (text, image, image_id)]
    if sum(given) != 1:
        raise ApplicationError("give exactly one of text, image or image_id", code="invalid_query")
    if job_id is not None and not jobs_visible_to(user).filter(id=job_id).exists():  # before any query runs
        raise ApplicationError("no such job", code="not_found", status=404)
    owner_filter = None if user.is_staff else user.id
    # One space for the whole search (embedding and look-up), read once: the active one
    # (``spaces.active``, ≤ SPACE_CACHE_S old), so a promotion never mixes two models' vectors.
    model_id = spaces.active().model_id
    deadline_ts = time.time() + (deadline_s or settings.VECTORS_CALL_TIMEOUT_S)
    # Every message of a search expires at its deadline: after it nobody waits for the answer.
    def query(embed: str, *args) -> dict | None:
        """The embedding on the interactive lane, then the search: chained on the vectors queue,
        or here against a Qdrant server (the query vector comes back in the result)."""
        if not sink.is_direct():
            return _wait(dispatch.send_query(embed=embed, args=args, deadline_ts=deadline_ts,
                                             search=(owner_filter, k, job_id), model_id=model_id), deadline_ts)
        vector = _wait(dispatch.send_query(embed=embed, args=args, deadline_ts=deadline_ts, search=None,
                                           model_id=model_id), deadline_ts)
        return None if vector is None else sink.store_call("search_vector", vector, owner_filter, k, job_id, model_id)

    if text is not None:
        if not text.strip():
            raise ApplicationError("text must not be empty", code="invalid_query")
        admitted = admission.interactive_admit(deadline_s=deadline_ts - time.time())
        answer = query("encode_text", text[:2000])
        admission.interactive_answered(admitted, images=1, status=504 if answer is None else 200)
    elif image is not None:
        f = image.open()
        head = f.read(64)
        f.seek(0)
        refused = quick_check(head, image.size)
        if refused is not None:
            raise ApplicationError(str(refused), code=refused.reason.value, status=REASON_STATUS[refused.reason.value])
        admitted = admission.interactive_admit(deadline_s=deadline_ts - time.time())
        # a query image is not an Image: its own temporary key, gone when the search is answered
        store = runtime.blob_store()
        key, sha, _ = store.put_temporary(iter_blocks(f))
        try:
            answer = query("embed_query", key, sha)
            admission.interactive_answered(admitted, images=1, status=504 if answer is None else 200)
        finally:
            store.delete(key)
    else:
        im = Image.objects.filter(id=image_id, source__isnull=True).first()  # copies are not users' ids
        if im is None or (not user.is_staff and im.owner_id != user.id):
            raise ApplicationError("no such image", code="not_found", status=404)
        if im.status not in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED):  # a skipped duplicate shares the point
            raise ApplicationError(f"image {image_id} is {im.status}, not embedded", code="not_embedded", status=409)
        original = im.duplicate_of if im.status == ImageStatus.SKIPPED else im
        if original is None or original.status != ImageStatus.EMBEDDED:  # its original's vector is not written yet
            raise ApplicationError(f"image {image_id} is a copy of an image that is "
                                   f"{original.status if original else 'gone'}, not embedded yet",
                                   code="not_embedded", status=409)
        # the stored bytes' point in the active space: the row's own, or (a row from before a model
        # switch) the one its re-embedded copy wrote there, uuid5(active model, sha256)
        pid = point_id(im.sha256, model_id)
        if im.model_id != model_id and not Image.objects.filter(
                model_id=model_id, sha256=im.sha256, point_id=pid, status=ImageStatus.EMBEDDED).exists():
            raise ApplicationError(f"image {image_id} is not embedded in the active space {model_id} yet",
                                   code="not_embedded", status=409, extra={"model_id": model_id})
        if sink.is_direct():  # a Qdrant server: asked here, an answer or an error, never a timeout
            r = None
            results = sink.store_call("search_point", str(pid), owner_filter, k, job_id, model_id)
        else:
            r = dispatch.send_search_point(point_id=str(pid), owner_id=owner_filter, k=k, job_id=job_id,
                                           deadline_ts=deadline_ts, model_id=model_id)
            results = _wait(r, deadline_ts)
        if results is None and (r is None or r.ready()):  # the store answered: no such point
            raise ApplicationError(f"image {image_id} has no vector in the store", code="vector_missing", status=409)
        answer = None if results is None else {"results": results or []}
    if answer is None or answer.get("reason") == Reason.EXPIRED.value:  # a task refused it: too late
        raise ApplicationError("the search did not finish in time", code="deadline_exceeded", status=504)
    if "reason" in answer:
        raise ApplicationError(f"{answer['reason']}: {answer.get('detail', '')}", code=answer["reason"],
                               status=REASON_STATUS.get(answer["reason"], 400))
    return answer["results"]
