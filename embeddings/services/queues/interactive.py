"""The interactive queue's worker side: an upload's images (:func:`interactive_embed`, written by
the vectors queue's ``interactive_index``), a query image (:func:`query_embed`), a text query
(:func:`text_embed`) and the inputs of an embeddings request (:func:`inputs_embed`), each through
the process's dynamic batcher and refused unread once its deadline has passed.
"""
from __future__ import annotations

import time

from embeddings import lane_control, metrics, runtime
from embeddings.messages import encode_vector
from embeddings.models import Image, ImageStatus, Lane
from embeddings.deferred import after_answer
from embeddings.services.queues.blobs import LateThumbnails, originals_loader
from embeddings.services.queues.store_writes import vector_item
from embeddings.spaces import ModelNotConfigured
from workers import screen
from workers.errors import Reason


def interactive_embed(*, image_ids: list[str], deadline_ts: float) -> dict:
    """Embed an interactive request's images through the process's dynamic batcher.

    A request whose deadline has passed before it reaches the model is not computed: its images
    come back as ``expired``. An image whose vector is not finite or is all zeros comes back failed
    (``non_finite_embedding``, ``zero_embedding``: ``workers.screen``), counted.

    Returns:
        ``{"items": [...], "failed": [[id, reason, detail], ...], "timings": {stage: ms}}``.
    """
    from workers.batcher import Expired  # deferred: would load torch
    from workers.runner import screened  # deferred: would load torch

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
    batcher = runtime.dynamic_batcher(model_id)
    late = LateThumbnails({k: v[1] for k, v in rows.items()})
    with batcher.coming() as announced:  # a batch forming meanwhile waits for these images
        prepared = runner.prepare(ordered, originals_loader({k: v[:2] for k, v in rows.items()}), late)
        after_answer(late.draw)  # previews and thumbnails once the answer is out
        failed = [[f.key, f.reason, f.detail] for f in prepared.failed]
        timings = prepared.timings
        items = []
        if prepared.metas:
            try:
                with timings.measure("embed"):
                    vectors = batcher.embed(prepared.pixels, deadline=deadline_ts, announced=announced)
            except Expired:
                return {"items": [], "failed": failed + expired([m.key for m in prepared.metas]), "timings": {}}
            _note_batch(batcher)
            metas, vectors, refused = screened(prepared.metas, vectors)  # NaN, infinity or zeros fail alone
            failed += [[f.key, f.reason, f.detail] for f in refused]
            metrics.count_refused_embeddings(lane=Lane.INTERACTIVE, reasons=[f.reason for f in refused])
            items = [vector_item(m, v, rows[m.key][2], rows[m.key][1], model_id) for m, v in zip(metas, vectors)]
    timings.total = (time.perf_counter() - prepared.started) * 1000
    return {"items": items, "failed": failed, "timings": timings.as_dict()}


def _note_batch(batcher) -> None:
    """Mark, for the hop records (``lane_control.hops``), the queue delay and forward pass (ms) of
    the batcher's newest batch: this request's when requests do not overlap (an idle lane)."""
    if lane_control.hops.enabled() and batcher.records:
        last = batcher.records[-1]
        lane_control.hops.note(queue_delay_ms=last.queue_delay_ms, forward_ms=last.service_ms)


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
    from workers.batcher import Expired  # deferred: would load torch

    if (refused := _query_expired(deadline_ts)) is not None:
        return refused
    try:
        runner = runtime.batch_runner(model_id)
    except ModelNotConfigured as e:
        return {"reason": Reason.MODEL_NOT_CONFIGURED.value, "detail": str(e)}
    batcher = runtime.dynamic_batcher(model_id)
    with batcher.coming() as announced:  # a batch forming meanwhile waits for this image
        prepared = runner.prepare([storage_key], lambda key: runtime.blob_store().read(key, sha256))
        if prepared.failed:
            return {"reason": prepared.failed[0].reason, "detail": prepared.failed[0].detail}
        try:
            vectors = batcher.embed(prepared.pixels, deadline=deadline_ts, announced=announced)
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
    t0 = time.perf_counter()
    vector = encoder.encode_texts([text])[0]
    lane_control.hops.note(forward_ms=(time.perf_counter() - t0) * 1000)
    return _query_vector(vector)


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
        ``compute_ms``: this worker's time on the request (decode, preprocess, forward passes), for
        metering (docs/usage.md); absent when nothing was computed.
    """
    from workers.batcher import Expired  # deferred: would load torch
    from workers.runner import screened  # deferred: would load torch

    def every(refusal: dict) -> dict:
        return {"data": [refusal] * len(items), "image_tokens": 0}

    if (refused := _query_expired(deadline_ts)) is not None:
        return every(refused)
    started = time.perf_counter()
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
        batcher = runtime.dynamic_batcher(model_id)
        with batcher.coming() as announced:  # a batch forming meanwhile waits for these images
            prepared = runner.prepare(list(images), lambda key: store.read(*images[key]))
            for f in prepared.failed:
                out[int(f.key)] = {"reason": f.reason, "detail": f.detail}
            if prepared.metas:
                try:
                    vectors = batcher.embed(prepared.pixels, deadline=deadline_ts, announced=announced)
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
    return {"data": out, "image_tokens": encoder.image_tokens,
            "compute_ms": round((time.perf_counter() - started) * 1000, 3)}
