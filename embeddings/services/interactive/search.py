"""Searches: the top-k images similar to a text, an uploaded image, or a stored image (several
positive and negative examples of those kinds: ``interactive.examples``). Every search may ask for
diverse results (``diversity``: the store's maximal marginal relevance).

A text or image query is embedded on the ``interactive`` queue and searched on the ``vectors``
queue (one chain sent through ``embeddings.dispatch``), or, with a Qdrant server (``embeddings.sink``:
direct), searched here; the web waits for the answer until the search's deadline
(``interactive.waiting``). A search by a stored image needs no model: its point is searched directly.
"""
from __future__ import annotations

import dataclasses
import time
from typing import BinaryIO

from django.conf import settings

from embeddings import dispatch, lane_control, runtime, sink, spaces
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus
from embeddings.selectors import jobs_visible_to
from embeddings.services.catalogue.images import quick_check
from embeddings.services.catalogue.sources import SourceFile, iter_blocks
from embeddings.services.interactive.waiting import REASON_STATUS, wait_for
from embeddings.services.usage import meter as usage_meter
from workers.errors import ImageRejected, Reason
from workers.ids import point_id

#: Largest MMR candidate pool a search may ask for: MMR compares each pick with the pool
#: (k × pool cosines), and the pool's vectors are read with it.
MAX_CANDIDATES = 1000

#: What :func:`wait_for` gives for a point search whose deadline passed: ``None`` is the task's
#: own answer for a point that is not in the store.
_TIMED_OUT = object()


def search(*, user, k: int, job_id: str | None = None, text: str | None = None,
           image: SourceFile | None = None, image_id: str | None = None, deadline_s: float | None = None,
           where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
           candidates: int | None = None, key_prefix: str = "") -> list[dict]:
    """Top-``k`` images similar to a text, an uploaded image, or a stored image (by id), among
    those whose metadata passes ``where`` (the API's filter JSON, validated by the caller:
    ``workers.vector_store.filters.parse``), applied inside the vector query. ``with_vectors``:
    each result carries its stored vector in the active space (``"vector"``: base64 of
    little-endian float32), read by the search query itself. ``diversity`` in [0, 1] (checked by
    the caller) > 0: the store's MMR picks the k among the ``candidates`` nearest (None:
    ``workers.vector_store.default_candidates``); 0: the plain top-k.

    Only the caller's images are searched (all images for staff), enforced by a payload filter in
    the vector store's query. An answered search is metered (``search``, to ``user`` and API key
    ``key_prefix``; docs/usage.md); a refused one is not. A ``job_id`` must name one of the caller's jobs (any job for staff):
    points are shared per sha256, so a filter on another user's job would reveal which of the
    caller's images that job also holds.

    Raises:
        ApplicationError: ``invalid_query`` (400), ``not_found`` (404: an image or a job the caller
            may not see, or none), a refused query image (400/413/415 with its reason code), a
            query whose vector the model gave as NaN, infinity or zeros (422 ``non_finite_embedding``,
            ``zero_embedding``), ``overloaded`` (429: a text or image query whose embedding would
            wait longer than the deadline), ``not_embedded`` (409: an image, or the original of a skipped copy, with no
            vector yet), ``vector_missing`` (409: its vector is not in the store), ``deadline_exceeded``
            (504), ``worker_error`` (503).
    """
    given = [x is not None for x in (text, image, image_id)]
    if sum(given) != 1:
        raise ApplicationError("give exactly one of text, image or image_id", code="invalid_query")
    scope = search_scope(user=user, k=k, job_id=job_id, deadline_s=deadline_s, where=where, with_vectors=with_vectors,
                         diversity=diversity, candidates=candidates)
    if text is not None:
        if not text.strip():
            raise ApplicationError("text must not be empty", code="invalid_query")
        t0 = time.perf_counter()
        admitted = lane_control.interactive_admit(deadline_s=scope.deadline_ts - time.time())
        lane_control.hops.web_note(admission_ms=(time.perf_counter() - t0) * 1000)
        answer = _embedded_search(scope, "encode_text", text[:2000])
        lane_control.interactive_answered(admitted, images=1, status=504 if answer is None else 200)
    elif image is not None:
        f = image.open()
        refused = quick_refusal(f, image.size)
        if refused is not None:
            raise ApplicationError(str(refused), code=refused.reason.value, status=REASON_STATUS[refused.reason.value])
        admitted = lane_control.interactive_admit(deadline_s=scope.deadline_ts - time.time())
        # a query image is not an Image: its own temporary key, gone when the search is answered
        store = runtime.blob_store()
        key, sha, _ = store.put_temporary(iter_blocks(f))
        try:
            answer = _embedded_search(scope, "embed_query", key, sha)
            lane_control.interactive_answered(admitted, images=1, status=504 if answer is None else 200)
        finally:
            store.delete(key)
    else:
        answer = _point_search(scope, stored_point(user, image_id, scope.model_id), image_id)
    if answer is None or answer.get("reason") == Reason.EXPIRED.value:  # a task refused it: too late
        raise ApplicationError("the search did not finish in time", code="deadline_exceeded", status=504)
    if "reason" in answer:
        raise ApplicationError(f"{answer['reason']}: {answer.get('detail', '')}", code=answer["reason"],
                               status=REASON_STATUS.get(answer["reason"], 400))
    usage_meter.answered(owner_id=user.id, key_prefix=key_prefix, model_id=scope.model_id, searches=1)
    return answer["results"]


@dataclasses.dataclass(frozen=True)
class SearchScope:
    """What every query of one search shares: whose images (``owner_filter``: the caller's user id,
    None for staff: everyone's), ``k``, the ``job_id`` filter, the one space searched
    (``model_id``), the metadata filter ``where``, ``with_vectors``, ``diversity`` and
    ``candidates`` (MMR), and ``deadline_ts`` (Unix s): every message of the search expires then,
    since after it nobody waits for the answer."""

    owner_filter: int | None
    k: int
    job_id: str | None
    model_id: str
    where: dict | None
    with_vectors: bool
    diversity: float
    candidates: int | None
    deadline_ts: float


def search_scope(*, user, k: int, job_id: str | None, deadline_s: float | None, where: dict | None,
                 with_vectors: bool, diversity: float, candidates: int | None) -> SearchScope:
    """The scope of one search by ``user`` (a search by examples too), its deadline counted from now.

    Raises:
        ApplicationError: ``not_found`` (404): ``job_id`` names no job the caller may see (checked
            before any query runs).
    """
    if job_id is not None and not jobs_visible_to(user).filter(id=job_id).exists():  # before any query runs
        raise ApplicationError("no such job", code="not_found", status=404)
    owner_filter = None if user.is_staff else user.id
    # One space for the whole search (embedding and look-up), read once: the active one
    # (``spaces.active``, ≤ SPACE_CACHE_S old), so a promotion never mixes two models' vectors.
    model_id = spaces.active().model_id
    return SearchScope(owner_filter=owner_filter, k=k, job_id=job_id, model_id=model_id, where=where,
                       with_vectors=with_vectors, diversity=diversity, candidates=candidates,
                       deadline_ts=time.time() + (deadline_s or settings.VECTORS_CALL_TIMEOUT_S))


def quick_refusal(f: BinaryIO, size: int) -> ImageRejected | None:
    """Why a query image (open file ``f`` of ``size`` bytes) is refused before any of its bytes
    are kept (its first 64 bytes and its size: ``catalogue.images.quick_check``), or None. ``f`` is
    left at its start."""
    head = f.read(64)
    f.seek(0)
    return quick_check(head, size)


def _embedded_search(scope: SearchScope, embed: str, *args) -> dict | None:
    """A text or image query: its embedding on the interactive lane (task ``embed`` of ``args``),
    then the search, chained on the vectors queue, or asked here of a Qdrant server (the query
    vector comes back in the result), or both in one task of the interactive worker where it owns
    the embedded store. None: the deadline passed."""
    s = scope
    if sink.answers_in_one_task():  # the interactive worker owns the store: embedded and searched by one task
        return wait_for(dispatch.send_embed_search(embed=embed, args=args, deadline_ts=s.deadline_ts,
                                                   search=(s.owner_filter, s.k, s.job_id), model_id=s.model_id,
                                                   where=s.where, with_vectors=s.with_vectors, diversity=s.diversity,
                                                   candidates=s.candidates),
                        s.deadline_ts)
    if not sink.is_direct():
        return wait_for(dispatch.send_query(embed=embed, args=args, deadline_ts=s.deadline_ts,
                                            search=(s.owner_filter, s.k, s.job_id), model_id=s.model_id, where=s.where,
                                            with_vectors=s.with_vectors, diversity=s.diversity,
                                            candidates=s.candidates),
                        s.deadline_ts)
    vector = wait_for(dispatch.send_query(embed=embed, args=args, deadline_ts=s.deadline_ts, search=None,
                                          model_id=s.model_id), s.deadline_ts)
    return None if vector is None else sink.store_call("search_vector", vector, s.owner_filter, s.k, s.job_id,
                                                       s.model_id, s.where, s.with_vectors, s.diversity, s.candidates)


def _point_search(scope: SearchScope, pid: str, image_id: str) -> dict | None:
    """A search by stored image ``image_id`` (its point ``pid``): no model; the store searches the
    point itself. None: the deadline passed.

    Raises:
        ApplicationError: ``vector_missing`` (409): the store has no such point.
    """
    s = scope
    if sink.is_direct():  # a Qdrant server: asked here, an answer or an error, never a timeout
        results = sink.store_call("search_point", str(pid), s.owner_filter, s.k, s.job_id, s.model_id, s.where,
                                  s.with_vectors, s.diversity, s.candidates)
    else:
        results = wait_for(dispatch.send_search_point(point_id=str(pid), owner_id=s.owner_filter, k=s.k,
                                                      job_id=s.job_id, deadline_ts=s.deadline_ts, model_id=s.model_id,
                                                      where=s.where, with_vectors=s.with_vectors,
                                                      diversity=s.diversity, candidates=s.candidates),
                           s.deadline_ts, timed_out=_TIMED_OUT)
    if results is None:  # the store answered: no such point
        raise ApplicationError(f"image {image_id} has no vector in the store", code="vector_missing", status=409)
    return None if results is _TIMED_OUT else {"results": results}


def stored_point(user, image_id: str, model_id: str) -> str:
    """The point in space ``model_id`` of the caller's image ``image_id``: the row's own, or (a row
    from before a model switch) the one its re-embedded copy wrote there, uuid5(active model, sha256).

    Raises:
        ApplicationError: ``not_found`` (404: no such image, a migration copy's id, or another
            user's image for a non-staff caller), ``not_embedded`` (409: no vector yet, or not in
            the space ``model_id`` yet).
    """
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
    pid = point_id(im.sha256, model_id)
    if im.model_id != model_id and not Image.objects.filter(
            model_id=model_id, sha256=im.sha256, point_id=pid, status=ImageStatus.EMBEDDED).exists():
        raise ApplicationError(f"image {image_id} is not embedded in the active space {model_id} yet",
                               code="not_embedded", status=409, extra={"model_id": model_id})
    return str(pid)
