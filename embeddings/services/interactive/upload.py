"""Interactive uploads: the web side of work that someone waits for.

The web process never loads the model or opens an embedded vector store: it chains tasks (embed
on the ``interactive`` queue → index on the ``vectors`` queue, sent through ``embeddings.dispatch``)
and waits for the last result until the request's deadline (``interactive.waiting``). With a Qdrant
server (``embeddings.sink``: direct), or an embedded store the interactive worker owns
(``STORE_OWNER=interactive``), one task of the interactive worker embeds, writes and searches. What does not
finish in time keeps running; the caller gets a status URL. Searches: ``interactive.search``.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import time

from django.conf import settings
from kombu.exceptions import OperationalError

from embeddings import dispatch, lane_control, metrics, sink
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus, Lane
from embeddings.services.catalogue.images import images_create, images_mark_failed
from embeddings.services.catalogue.sources import SourceFile
from embeddings.services.interactive.waiting import REASON_STATUS, wait_for
from workers.errors import Reason


@dataclasses.dataclass(frozen=True)
class UploadOutcome:
    """``status``: 200 (all answered), 202 (deadline passed, work continues) or a 4xx when every
    image was refused; ``images``: one dict per uploaded file, in order; ``vectors``: (asked for)
    ``{image id: base64 of (D,) little-endian float32}`` of each image embedded or shared in time."""

    status: int
    images: list[dict]
    vectors: dict[str, str] = dataclasses.field(default_factory=dict)


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


def _not_sent(image_ids: list[str], why: str) -> None:
    """Record queued images whose work the broker refused as ``expired`` (reason ``expired``, the
    outcome the reconciler gives interactive images no message names once their deadline passed),
    now: no row of a refused request stays queued."""
    if not image_ids:
        return

    images_mark_failed([(i, Reason.EXPIRED.value, f"not queued: {why}") for i in image_ids])
    metrics.count_images(lane=Lane.INTERACTIVE, status="expired", n=len(image_ids))


def image_view(im: Image, neighbours: list | None = None) -> dict:
    """The API's representation of one image."""
    out = {
        "id": str(im.id), "status": im.status, "reason": im.reason or None, "detail": im.reason_detail or None,
        "sha256": im.sha256, "width": im.width, "height": im.height, "original_name": im.original_name,
        "job_id": str(im.job_id) if im.job_id else None, "url": f"/api/images/{im.id}/",
        # drawn by the worker that decoded it: there once the image is embedded (or shares those bytes)
        "thumbnail_url": (f"/api/images/{im.id}/thumbnail/"
                          if im.status in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED) else None),
        "external_id": im.external_id or None, "metadata": im.metadata or {},
    }
    if neighbours is not None:
        out["neighbours"] = neighbours
    return out


def images_upload(*, owner, sources: list[SourceFile], deadline_s: float, k: int,
                  vectors: bool = False, key_prefix: str = "") -> UploadOutcome:
    """Embed uploaded images on the interactive lane and return each one's top-``k`` neighbours
    (``vectors``: and each one's stored vector, :attr:`UploadOutcome.vectors`). ``key_prefix``: the
    request's API key, which the rows carry for metering (docs/usage.md).

    Waits until ``deadline_s`` has passed at most; after that answers 202 and the work continues.

    Raises:
        ApplicationError: ``overloaded`` (429, ``Retry-After``) when the lane's predicted wait is
            longer than ``deadline_s``: nothing is stored or queued (``embeddings.lane_control``).
            ``broker_full`` / ``broker_unavailable`` (503, ``Retry-After``) when the broker refuses
            the work (``sink.broker_refusal``): the images made for it are ``expired`` at once,
            as the reconciler would record them once their deadline passed, and nothing is queued.
    """
    t0 = time.perf_counter()
    admitted = lane_control.interactive_admit(deadline_s=deadline_s, images=len(sources))
    lane_control.hops.web_note(admission_ms=(time.perf_counter() - t0) * 1000)
    started = time.time()
    deadline_ts = started + deadline_s
    deadline = dt.datetime.fromtimestamp(deadline_ts, tz=dt.timezone.utc)
    t0 = time.perf_counter()
    images = images_create(owner=owner, sources=sources, lane=Lane.INTERACTIVE, deadline=deadline,
                           key_prefix=key_prefix)
    lane_control.hops.web_note(rows_ms=(time.perf_counter() - t0) * 1000)
    to_embed = [str(im.id) for im in images if im.status == ImageStatus.QUEUED]
    skipped = [str(im.id) for im in images if im.status == ImageStatus.SKIPPED]
    owner_filter = None if owner.is_staff else owner.id
    answers: dict | None = {}
    work = {"to_embed": to_embed, "skipped": skipped, "owner_id": owner_filter, "k": k, "deadline_ts": deadline_ts,
            "vectors": vectors}
    try:
        if (sink.is_direct() or sink.answers_in_one_task()) and to_embed:
            # a Qdrant server, or an embedded store the interactive worker owns: one task embeds, writes, searches
            t0 = time.perf_counter()
            sent = dispatch.send_upload_direct(**work)
            lane_control.hops.web_note(send_ms=(time.perf_counter() - t0) * 1000)
            answers = wait_for(sent, deadline_ts)
        elif sink.is_direct() and skipped:  # copies of stored bytes only: their neighbours, found here
            answers = sink.store_call("index_interactive", {}, owner_filter, k, skipped, vectors)
        elif to_embed or skipped:
            t0 = time.perf_counter()
            sent = dispatch.send_upload(**work)
            lane_control.hops.web_note(send_ms=(time.perf_counter() - t0) * 1000)
            answers = wait_for(sent, deadline_ts)
    except OperationalError as e:  # the message was not sent (kombu raises before anything is queued)
        refused = sink.broker_refusal(e)
        _not_sent(to_embed, refused.message)
        lane_control.interactive_answered(admitted, images=0, status=refused.status)
        raise refused from e
    # the whole admitted→answered time of this request: what the admission's wait model learns from
    lane_control.interactive_answered(admitted, images=len(to_embed), status=202 if answers is None else 200)
    fresh = {str(im.id): im for im in Image.objects.filter(id__in=[im.id for im in images])}
    views = [image_view(fresh[str(im.id)], (answers or {}).get(str(im.id), {}).get("neighbours")) for im in images]
    if answers is None:
        return UploadOutcome(status=202, images=views)
    found = {i: a["vector"] for i, a in answers.items() if "vector" in a}
    refused = [v for v in views if v["status"] in (ImageStatus.FAILED, ImageStatus.EXPIRED)]
    if views and len(refused) == len(views) and len(views) == 1 and views[0]["reason"] in REASON_STATUS:
        return UploadOutcome(status=REASON_STATUS[views[0]["reason"]], images=views, vectors=found)
    return UploadOutcome(status=200, images=views, vectors=found)
