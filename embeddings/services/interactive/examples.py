"""Searches by several positive and negative examples (docs/search.md): stored images, texts and
uploaded images, scored together by the store's recommend query, with the caller, job and metadata
filter and the diversity of any search (``interactive.search``).

Texts and uploaded images are embedded together in one interactive task, chained with the query on
the vectors queue, or, with a Qdrant server (``embeddings.sink``: direct), the query is asked here;
the web waits for the answer until the search's deadline (``interactive.waiting``). A stored image
needs no model: its point is read by the query itself.
"""
from __future__ import annotations

import time

from embeddings import dispatch, lane_control, runtime, sink
from embeddings.errors import ApplicationError
from embeddings.services.catalogue.sources import iter_blocks
from embeddings.services.interactive.search import (
    SearchScope,
    quick_refusal,
    search_scope,
    stored_point,
)
from embeddings.services.interactive.waiting import REASON_STATUS, wait_for
from embeddings.services.usage import meter as usage_meter
from workers.errors import Reason

#: Most examples (positive and negative together) in one multi-example search: each is scored
#: against every candidate point, so the query's cost grows with their number (docs/search.md).
MAX_EXAMPLES = 64


def search_examples(*, user, k: int, positive: list[dict], negative: list[dict], strategy: str,
                    job_id: str | None = None, deadline_s: float | None = None, where: dict | None = None,
                    with_vectors: bool = False, diversity: float = 0.0, candidates: int | None = None,
                    key_prefix: str = "") -> list[dict]:
    """Top-``k`` images for positive and negative examples (the store's recommend query of
    ``strategy``, ``workers.vector_store.STRATEGIES``), with the caller, job and metadata filter of
    ``interactive.search.search``; ``diversity`` / ``candidates`` as there. An answered search is
    metered as one ``search`` (its example texts and images are part of it), to API key ``key_prefix``.

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
    scope = search_scope(user=user, k=k, job_id=job_id, deadline_s=deadline_s, where=where, with_vectors=with_vectors,
                         diversity=diversity, candidates=candidates)
    labelled = [("positive", i, e) for i, e in enumerate(positive)] + [("negative", i, e) for i, e in enumerate(negative)]
    _check_examples(labelled)  # every refusal that needs no worker, before any bytes are kept
    examples = _stored_examples(user, labelled, scope.model_id)
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
            admitted = lane_control.interactive_admit(deadline_s=scope.deadline_ts - time.time(),
                                                      images=max(1, len(staged) + any("text" in it for it in items)))
        answer = _examples_search(scope, items, examples, strategy)
    finally:
        for key in staged:
            store.delete(key)
        if admitted is not None:
            lane_control.interactive_answered(admitted, images=max(1, len(staged)),
                                              status=504 if answer is None else 200)
    results = _results_of(answer)
    usage_meter.answered(owner_id=user.id, key_prefix=key_prefix, model_id=scope.model_id, searches=1)
    return results


def _check_examples(labelled: list[tuple[str, int, dict]]) -> None:
    """Refuse an empty text or a refused image among ``(side, index, example)``.

    Raises:
        ApplicationError: ``invalid_query`` (400), or a refused image's reason code and status;
            ``extra.example`` names the example (``"positive[0]"``).
    """
    for side, i, e in labelled:
        if "text" in e and not str(e["text"]).strip():
            raise ApplicationError("text must not be empty", code="invalid_query", extra={"example": f"{side}[{i}]"})
        if "image" in e:
            refused = quick_refusal(e["image"].open(), e["image"].size)
            if refused is not None:
                raise ApplicationError(f"{side}[{i}]: {refused}", code=refused.reason.value,
                                       status=REASON_STATUS[refused.reason.value], extra={"example": f"{side}[{i}]"})


def _stored_examples(user, labelled: list[tuple[str, int, dict]], model_id: str) -> dict[str, list[dict]]:
    """``{"positive": [...], "negative": [...]}`` holding ``{"point_id": str}`` for each stored image
    example (``{"image_id": ...}``), in order; the other examples are added once embedded.

    Raises:
        ApplicationError: as ``interactive.search.stored_point``.
    """
    examples: dict[str, list[dict]] = {"positive": [], "negative": []}
    points = {}
    for side, _, e in labelled:
        if "image_id" in e:
            pid = points.setdefault(str(e["image_id"]), stored_point(user, str(e["image_id"]), model_id))
            examples[side].append({"point_id": pid})
    return examples


def _examples_search(scope: SearchScope, items: list[dict], examples: dict[str, list[dict]],
                     strategy: str) -> dict | None:
    """The examples' inputs (``items``: texts and staged images) embedded in one interactive task,
    then the store's recommend query: chained on the vectors queue, or, with a Qdrant server, the
    embeddings waited for here and the query asked here. None: the deadline passed."""
    s = scope
    args = (s.owner_filter, s.k, s.job_id)
    if sink.is_direct():  # a Qdrant server: the embeddings waited for here, the query asked here
        embedded = {"data": []}
        if items:
            embedded = wait_for(dispatch.send_embed_inputs(items=items, deadline_ts=s.deadline_ts,
                                                           model_id=s.model_id), s.deadline_ts)
        return None if embedded is None else sink.store_call(
            "search_examples", embedded, examples, *args, s.model_id, s.where, s.with_vectors, strategy, s.diversity,
            s.candidates)
    return wait_for(dispatch.send_examples_query(items=items, examples=examples, search=args, model_id=s.model_id,
                                                 deadline_ts=s.deadline_ts, where=s.where,
                                                 with_vectors=s.with_vectors, strategy=strategy,
                                                 diversity=s.diversity, candidates=s.candidates), s.deadline_ts)


def _results_of(answer: dict | None) -> list[dict]:
    """The hits of a search by examples, or the error its answer names.

    Raises:
        ApplicationError: ``deadline_exceeded`` (504: no answer in time, or a task refused it as
            expired), ``vector_missing`` (409), or the answer's reason (its status; ``extra.example``
            naming the example a refusal is about).
    """
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
