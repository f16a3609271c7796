"""Searches: the top-k images similar to a text, an uploaded image, or a stored image; or to
several positive and negative examples of those kinds (:func:`search_examples`). Every search may
ask for diverse results (``diversity``: the store's maximal marginal relevance).

A text or image query is embedded on the ``interactive`` queue and searched on the ``vectors``
queue (one chain sent through ``embeddings.dispatch``), or, with a Qdrant server (``embeddings.sink``:
direct), searched here; the web waits for the answer until the search's deadline
(``services.waiting``). A search by a stored image needs no model: its point is searched directly.
"""
from __future__ import annotations

import time

from django.conf import settings

from embeddings import dispatch, lane_control, runtime, sink, spaces
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus
from embeddings.selectors import jobs_visible_to
from embeddings.services.catalogue.images import quick_check
from embeddings.services.catalogue.sources import SourceFile, iter_blocks
from embeddings.services.waiting import REASON_STATUS, wait_for
from workers.errors import Reason
from workers.ids import point_id

#: Most examples (positive and negative together) in one multi-example search: each is scored
#: against every candidate point, so the query's cost grows with their number (docs/search.md).
MAX_EXAMPLES = 64

#: Largest MMR candidate pool a search may ask for: MMR compares each pick with the pool
#: (k × pool cosines), and the pool's vectors are read with it.
MAX_CANDIDATES = 1000

#: What :func:`wait_for` gives for a point search whose deadline passed: ``None`` is the task's
#: own answer for a point that is not in the store.
_TIMED_OUT = object()


def search(*, user, k: int, job_id: str | None = None, text: str | None = None,
           image: SourceFile | None = None, image_id: str | None = None, deadline_s: float | None = None,
           where: dict | None = None, with_vectors: bool = False, diversity: float = 0.0,
           candidates: int | None = None) -> list[dict]:
    """Top-``k`` images similar to a text, an uploaded image, or a stored image (by id), among
    those whose metadata passes ``where`` (the API's filter JSON, validated by the caller:
    ``workers.vector_store.filters.parse``), applied inside the vector query. ``with_vectors``:
    each result carries its stored vector in the active space (``"vector"``: base64 of
    little-endian float32), read by the search query itself. ``diversity`` in [0, 1] (checked by
    the caller) > 0: the store's MMR picks the k among the ``candidates`` nearest (None:
    ``workers.vector_store.default_candidates``); 0: the plain top-k.

    Only the caller's images are searched (all images for staff), enforced by a payload filter in
    the vector store's query. A ``job_id`` must name one of the caller's jobs (any job for staff):
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
            return wait_for(dispatch.send_query(embed=embed, args=args, deadline_ts=deadline_ts,
                                                search=(owner_filter, k, job_id), model_id=model_id, where=where,
                                                with_vectors=with_vectors, diversity=diversity,
                                                candidates=candidates),
                            deadline_ts)
        vector = wait_for(dispatch.send_query(embed=embed, args=args, deadline_ts=deadline_ts, search=None,
                                              model_id=model_id), deadline_ts)
        return None if vector is None else sink.store_call("search_vector", vector, owner_filter, k, job_id, model_id,
                                                           where, with_vectors, diversity, candidates)

    if text is not None:
        if not text.strip():
            raise ApplicationError("text must not be empty", code="invalid_query")
        admitted = lane_control.interactive_admit(deadline_s=deadline_ts - time.time())
        answer = query("encode_text", text[:2000])
        lane_control.interactive_answered(admitted, images=1, status=504 if answer is None else 200)
    elif image is not None:
        f = image.open()
        head = f.read(64)
        f.seek(0)
        refused = quick_check(head, image.size)
        if refused is not None:
            raise ApplicationError(str(refused), code=refused.reason.value, status=REASON_STATUS[refused.reason.value])
        admitted = lane_control.interactive_admit(deadline_s=deadline_ts - time.time())
        # a query image is not an Image: its own temporary key, gone when the search is answered
        store = runtime.blob_store()
        key, sha, _ = store.put_temporary(iter_blocks(f))
        try:
            answer = query("embed_query", key, sha)
            lane_control.interactive_answered(admitted, images=1, status=504 if answer is None else 200)
        finally:
            store.delete(key)
    else:
        pid = _stored_point(user, image_id, model_id)
        if sink.is_direct():  # a Qdrant server: asked here, an answer or an error, never a timeout
            results = sink.store_call("search_point", str(pid), owner_filter, k, job_id, model_id, where, with_vectors,
                                      diversity, candidates)
        else:
            results = wait_for(dispatch.send_search_point(point_id=str(pid), owner_id=owner_filter, k=k, job_id=job_id,
                                                          deadline_ts=deadline_ts, model_id=model_id, where=where,
                                                          with_vectors=with_vectors, diversity=diversity,
                                                          candidates=candidates),
                               deadline_ts, timed_out=_TIMED_OUT)
        if results is None:  # the store answered: no such point
            raise ApplicationError(f"image {image_id} has no vector in the store", code="vector_missing", status=409)
        answer = None if results is _TIMED_OUT else {"results": results}
    if answer is None or answer.get("reason") == Reason.EXPIRED.value:  # a task refused it: too late
        raise ApplicationError("the search did not finish in time", code="deadline_exceeded", status=504)
    if "reason" in answer:
        raise ApplicationError(f"{answer['reason']}: {answer.get('detail', '')}", code=answer["reason"],
                               status=REASON_STATUS.get(answer["reason"], 400))
    return answer["results"]


def _stored_point(user, image_id: str, model_id: str) -> str:
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


def search_examples(*, user, k: int, positive: list[dict], negative: list[dict], strategy: str,
                    job_id: str | None = None, deadline_s: float | None = None, where: dict | None = None,
                    with_vectors: bool = False, diversity: float = 0.0, candidates: int | None = None) -> list[dict]:
    """Top-``k`` images for positive and negative examples (the store's recommend query of
    ``strategy``, ``workers.vector_store.STRATEGIES``), with the caller, job and metadata filter of
    :func:`search`; ``diversity`` / ``candidates`` as there.

    Args:
        positive, negative: examples, each ``{"image_id": uuid}`` (one of the caller's embedded
            images: its stored vector, the image itself left out of the hits), ``{"text": str}`` or
            ``{"image": SourceFile}`` (an uploaded image, embedded for this search only and deleted
            when it is answered). Texts and images are embedded together in one interactive task.

    Raises:
        ApplicationError: ``positive_required`` (400: no positive example), ``too_many_examples``
            (400: more than :data:`MAX_EXAMPLES`), ``not_found`` (404: an example image or a job the
            caller may not see), ``not_embedded`` / ``vector_missing`` (409), a refused example image
            or text (its reason code and status, ``extra.example`` naming it), ``zero_embedding``
            (422: examples whose average vector is zero), ``overloaded`` (429), ``deadline_exceeded``
            (504), ``worker_error`` / ``vectors_unavailable`` (503).
    """
    if not positive:
        raise ApplicationError("a multi-example search needs at least one positive example",
                               code="positive_required", extra={"fields": ["positive"]})
    total = len(positive) + len(negative)
    if total > MAX_EXAMPLES:
        raise ApplicationError(f"{total} examples; at most MAX_EXAMPLES = {MAX_EXAMPLES} in one search",
                               code="too_many_examples", extra={"limit": "MAX_EXAMPLES", "value": MAX_EXAMPLES,
                                                                "count": total})
    if job_id is not None and not jobs_visible_to(user).filter(id=job_id).exists():
        raise ApplicationError("no such job", code="not_found", status=404)
    owner_filter = None if user.is_staff else user.id
    model_id = spaces.active().model_id
    deadline_ts = time.time() + (deadline_s or settings.VECTORS_CALL_TIMEOUT_S)
    labelled = [("positive", i, e) for i, e in enumerate(positive)] + [("negative", i, e) for i, e in enumerate(negative)]
    for side, i, e in labelled:  # every refusal that needs no worker, before any bytes are kept
        if "text" in e and not str(e["text"]).strip():
            raise ApplicationError("text must not be empty", code="invalid_query", extra={"example": f"{side}[{i}]"})
        if "image" in e:
            f = e["image"].open()
            head = f.read(64)
            f.seek(0)
            refused = quick_check(head, e["image"].size)
            if refused is not None:
                raise ApplicationError(f"{side}[{i}]: {refused}", code=refused.reason.value,
                                       status=REASON_STATUS[refused.reason.value], extra={"example": f"{side}[{i}]"})
    examples: dict[str, list[dict]] = {"positive": [], "negative": []}
    points = {}
    for side, i, e in labelled:
        if "image_id" in e:
            pid = points.setdefault(str(e["image_id"]), _stored_point(user, str(e["image_id"]), model_id))
            examples[side].append({"point_id": pid})
    store = runtime.blob_store()
    items: list[dict] = []
    sources: list[str] = []  # the example each input is, for a refusal's message
    staged: list[str] = []
    admitted = None
    answer = None
    try:
        for side, i, e in labelled:
            if "text" in e:
                items.append({"text": str(e["text"])[:2000]})
            elif "image" in e:
                key, sha, _ = store.put_temporary(iter_blocks(e["image"].open()))
                staged.append(key)
                items.append({"key": key, "sha256": sha})
            else:
                continue
            sources.append(f"{side}[{i}]")
            examples[side].append({"input": len(items) - 1})
        if items:
            admitted = lane_control.interactive_admit(deadline_s=deadline_ts - time.time(),
                                                      images=max(1, len(staged) + any("text" in it for it in items)))
        args = (owner_filter, k, job_id)
        if sink.is_direct():  # a Qdrant server: the embeddings waited for here, the query asked here
            embedded = {"data": []}
            if items:
                embedded = wait_for(dispatch.send_embed_inputs(items=items, deadline_ts=deadline_ts, model_id=model_id),
                                    deadline_ts)
            answer = None if embedded is None else sink.store_call(
                "search_examples", embedded, examples, *args, model_id, where, with_vectors, strategy, diversity,
                candidates)
        else:
            answer = wait_for(dispatch.send_examples_query(items=items, examples=examples, search=args,
                                                           model_id=model_id, deadline_ts=deadline_ts, where=where,
                                                           with_vectors=with_vectors, strategy=strategy,
                                                           diversity=diversity, candidates=candidates), deadline_ts)
    finally:
        for key in staged:
            store.delete(key)
        if admitted is not None:
            lane_control.interactive_answered(admitted, images=max(1, len(staged)),
                                              status=504 if answer is None else 200)
    if answer is None or answer.get("reason") == Reason.EXPIRED.value:
        raise ApplicationError("the search did not finish in time", code="deadline_exceeded", status=504)
    if answer.get("reason") == "vector_missing":
        raise ApplicationError(answer.get("detail", ""), code="vector_missing", status=409)
    if "reason" in answer:
        named = f"{answer['example']}: " if answer.get("example") else ""
        raise ApplicationError(f"{named}{answer['reason']}: {answer.get('detail', '')}", code=answer["reason"],
                               status=REASON_STATUS.get(answer["reason"], 400),
                               extra={"example": answer["example"]} if answer.get("example") else None)
    return answer["results"]
