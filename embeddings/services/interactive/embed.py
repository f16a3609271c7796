"""Embeddings on demand (``POST /api/embeddings/``, ``POST /v1/embeddings``): vectors of texts and
images on the interactive lane, in input order, stored only when asked.

The web never computes a vector: it stages each image as a temporary blob (decoded from base64 or
a data URL, fetched from an http(s) URL, or an uploaded file part), sends the texts and the blobs'
keys as one ``embed_inputs`` message (``queues.interactive.inputs_embed`` on the interactive worker: one
``prepare``, the dynamic batcher, one ``encode_texts``), waits until the deadline, and deletes the
blobs. With ``store`` the images go through the ordinary interactive upload instead
(``upload.images_upload``: they become the caller's images, with their ids) and the answer carries
the vectors written to the store; texts are never stored. Docs: docs/embeddings-api.md.
"""
from __future__ import annotations

import base64
import binascii
import concurrent.futures
import dataclasses
import re
import tempfile
import time

from django.conf import settings

from embeddings import dispatch, lane_control, runtime, spaces
from embeddings.errors import ApplicationError
from embeddings.models import EmbeddingSpace, ImageStatus, Lane, SpaceState
from embeddings.services.catalogue.images import quick_check
from embeddings.services.catalogue.sources import SourceFile, iter_blocks, safe_name
from embeddings.services.interactive.upload import images_upload
from embeddings.services.interactive.waiting import REASON_STATUS, wait_for
from embeddings.services.usage import meter as usage_meter
from workers.errors import ImageRejected, Reason
from workers.fetch import Fetcher

#: A text's characters read; the rest is cut before tokenising, as a text search does. The text
#: tower reads at most its context length (77 tokens for CLIP) anyway, so nothing it would read is lost.
MAX_TEXT_CHARS = 2000

#: Reason of an empty (or all-whitespace) text: refused, as a text search refuses one.
EMPTY_TEXT = Reason.EMPTY.value


@dataclasses.dataclass(frozen=True)
class EmbedInput:
    """One input: exactly one of ``text``, ``image`` (base64, or a ``data:image/...;base64,`` URL),
    ``image_url`` (http or https) or ``file`` (an uploaded part). ``external_id`` and ``metadata``
    (validated by the caller) go with an image that is stored."""

    text: str | None = None
    image: str | None = None
    image_url: str | None = None
    file: SourceFile | None = None
    external_id: str | None = None
    metadata: dict | None = None

    @property
    def kind(self) -> str:
        """``"text"`` or ``"image"``."""
        return "text" if self.text is not None else "image"


@dataclasses.dataclass(frozen=True)
class EmbedOutcome:
    """What an embeddings request answers.

    Attributes:
        status: 200; 202 (``store``: the deadline passed, the images continue); a 4xx when every
            input was refused (:func:`refusal_status`).
        items: one per input, in order: ``{"index", "kind"}`` plus ``"vector"`` (base64 of a
            ``(D,)`` little-endian float32, L2-normalised) and, for a text, ``"tokens"``; or
            ``"reason"``, ``"detail"``; with ``store`` an image's ``"image_id"`` and ``"status"``.
        space: the embedding space of the vectors.
        image_tokens: what one image counts in the usage (0 when no worker answered).
        deadline_s: the deadline applied (s).
        compute_s: the worker's time on the inputs not stored (s; 0 when it reported none): the
            metered compute of the texts and images answered (``usage.meter.answered``).
    """

    status: int
    items: list[dict]
    space: EmbeddingSpace
    image_tokens: int
    deadline_s: float
    compute_s: float = 0.0


#: A data URL: ``data:`` and a media type (RFC 2397), whatever the type: one of another type is
#: then refused as ``not_an_image`` rather than embedded as a text that happens to start so.
DATA_URL = re.compile(r"data:[\w.+-]+/[\w.+-]+[;,]", re.IGNORECASE)
#: An http(s) URL alone (no whitespace): a sentence that mentions a URL stays a text.
HTTP_URL = re.compile(r"https?://\S+", re.IGNORECASE)


def inputs_count_check(n: int) -> None:
    """Raises ApplicationError ``no_inputs`` (400) or ``too_many_inputs`` (400, naming the limit)."""
    if n == 0:
        raise ApplicationError("send one or more inputs", code="no_inputs")
    limit = settings.EMBEDDINGS_MAX_INPUTS
    if n > limit:
        raise ApplicationError(f"{n} inputs; a request takes at most EMBEDDINGS_MAX_INPUTS ({limit}); "
                               f"use POST /api/jobs/ for a catalogue", code="too_many_inputs",
                               extra={"limit": "EMBEDDINGS_MAX_INPUTS", "value": limit, "inputs": n})


def openai_inputs(value, modality: str) -> list[EmbedInput]:
    """OpenAI's ``input`` (a string or a list of strings) as inputs: by ``modality``, or (``auto``)
    a data URL → an image, an http(s) URL alone → an image to fetch, anything else → a text. The
    rule of ``POST /v1/embeddings`` and of a batch line's body (``services.batches``).

    Raises:
        ApplicationError: ``invalid_input`` (400, ``extra.param``; token arrays are not read),
            ``no_inputs``, ``too_many_inputs``.
    """
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list):
        raise ApplicationError("input must be a string or an array of strings", code="invalid_input",
                               extra={"param": "input"})
    inputs_count_check(len(strings))
    out = []
    for i, s in enumerate(strings):
        if not isinstance(s, str):
            raise ApplicationError(f"input[{i}] is not a string (token arrays are not read: send the text)",
                                   code="invalid_input", extra={"param": f"input[{i}]"})
        if modality == "text" or (modality == "auto" and not DATA_URL.match(s) and not HTTP_URL.fullmatch(s)):
            out.append(EmbedInput(text=s))
        elif HTTP_URL.fullmatch(s):
            out.append(EmbedInput(image_url=s))
        else:
            out.append(EmbedInput(image=s))
    return out


def space_view(space: EmbeddingSpace) -> dict:
    """``{"id", "model", "pretrained", "dimension", "precision"}`` of a space (``id``: its model id)."""
    return {"id": space.model_id, "model": space.model_name, "pretrained": space.pretrained,
            "dimension": space.dim, "precision": space.precision}


def space_for_model(name: str) -> EmbeddingSpace:
    """The embedding space a client names: a space's model id (``spaces.active().model_id``, or any
    space not dropped), or its architecture's name (``"ViT-B-32"``, any case): the active space if
    it has that architecture, else the newest space with it.

    Raises:
        ApplicationError: ``model_not_found`` (404, ``extra.models``: the ids that are known).
    """
    live = EmbeddingSpace.objects.exclude(state=SpaceState.DROPPED)
    space = live.filter(model_id=name).first()
    if space is None and name:
        active = spaces.active()
        if active.model_name.lower() == name.lower():
            space = active
        else:
            space = live.filter(model_name__iexact=name).order_by("-created_at").first()
    if space is None:
        known = sorted(live.values_list("model_id", flat=True))
        raise ApplicationError(f"no embedding space {name!r}; known: {', '.join(known)}", code="model_not_found",
                               status=404, extra={"models": known})
    return space


def refusal_status(reasons: list[str]) -> int:
    """The status of a request whose every input was refused: the reasons' status
    (``waiting.REASON_STATUS``: 400 bad bytes, 413 too large, 415 not an image, 422 no usable
    vector) when they all share one, else 400 (``fetch_*`` reasons too: the caller's URL, not this service, failed)."""
    statuses = {REASON_STATUS.get(r, 400) for r in reasons}
    return statuses.pop() if len(statuses) == 1 else 400


def decode_image_string(value: str) -> bytes:
    """The bytes of an image sent as text: base64 (standard alphabet; whitespace ignored, padding
    optional) or a data URL ``data:<type>;base64,<data>``.

    Raises:
        ImageRejected: ``invalid_base64`` (not base64, or a data URL that is not base64),
            ``not_an_image`` (a data URL of a type other than ``image/*``), ``too_large`` (more than
            ``max_image_bytes`` once decoded).
    """
    if value[:5].lower() == "data:":
        header, comma, value = value[5:].partition(",")
        if not comma:
            raise ImageRejected(Reason.INVALID_BASE64, "a data URL without ',' before its data")
        media, *params = [p.strip().lower() for p in header.split(";")]
        if "base64" not in params:
            raise ImageRejected(Reason.INVALID_BASE64, "a data URL whose data is not base64 (';base64,' missing)")
        if media and not media.startswith("image/"):
            raise ImageRejected(Reason.NOT_AN_IMAGE, f"a data URL of {media!r}, not an image/* type")
    compact = "".join(value.split())
    cap = settings.PIPELINE.max_image_bytes
    if len(compact) // 4 * 3 > cap:  # before decoding it
        raise ImageRejected(Reason.TOO_LARGE, f"about {len(compact) // 4 * 3} bytes once decoded > limit {cap} bytes")
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageRejected(Reason.INVALID_BASE64, f"not base64: {e}") from None


def _fetch_policy(deadline_ts: float):
    """The fetcher's policy (``FETCH_*``: address rules, size cap, retries) with every time limit
    shortened to what is left of the request's deadline: nobody waits for a fetch after it."""
    left = max(0.05, deadline_ts - time.time())
    policy = runtime.fetcher().policy
    return dataclasses.replace(
        policy, total_timeout_s=min(policy.total_timeout_s, left), connect_timeout_s=min(policy.connect_timeout_s, left),
        read_timeout_s=min(policy.read_timeout_s, left))


def _fetched(inp: EmbedInput) -> bool:
    """Whether an input is fetched: an ``image_url`` that is not a data URL (those are decoded)."""
    return inp.image_url is not None and inp.image_url[:5].lower() != "data:"


def _source(inp: EmbedInput, index: int, fetcher) -> SourceFile:
    """An image input as a file: an uploaded part as it is; decoded or fetched bytes spooled (in
    memory up to 1 MiB, then a temporary file).

    Raises:
        ImageRejected: :func:`decode_image_string`'s reasons, a ``fetch_*`` reason, or
            :func:`quick_check`'s (``empty``, ``too_large``, ``not_an_image``).
    """
    if inp.file is not None:
        src = inp.file
    else:
        text = inp.image if inp.image is not None else inp.image_url
        data = fetcher.fetch(inp.image_url).data if _fetched(inp) else decode_image_string(text)
        spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - read after this returns, freed with it
        spool.write(data)

        def _open(f=spool):
            f.seek(0)
            return f

        # a URL's last path segment names it, as a manifest row's does
        raw = inp.image_url.split("?", 1)[0].split("#", 1)[0].rsplit("/", 1)[-1] if _fetched(inp) else None
        src = SourceFile(name=safe_name(raw, fallback=f"input-{index}"), size=len(data), open=_open)
    f = src.open()
    head = f.read(64)
    f.seek(0)
    refused = quick_check(head, src.size)
    if refused is not None:
        raise refused
    if inp.file is not None:  # an uploaded part carries its own (the upload form's external_id / metadata parts)
        return src
    return dataclasses.replace(src, external_id=inp.external_id, metadata=inp.metadata)


def _sources(inputs: list[EmbedInput], deadline_ts: float) -> dict[int, SourceFile | ImageRejected]:
    """Every image input as a :class:`SourceFile` or its refusal, ``{input index: ...}``; URLs are
    fetched at once (``FETCH_THREADS`` at a time, under the fetcher's per-host bound)."""

    wanted = [i for i, inp in enumerate(inputs) if inp.kind == "image"]
    if not wanted:
        return {}
    out: dict[int, SourceFile | ImageRejected] = {}
    fetching = any(_fetched(inputs[i]) for i in wanted)
    fetcher = Fetcher(_fetch_policy(deadline_ts)) if fetching else None
    try:
        threads = max(1, min(settings.FETCH_THREADS, len(wanted))) if fetching else 1
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="embed-input") as pool:
            futures = {i: pool.submit(_source, inputs[i], i, fetcher) for i in wanted}
            for i, fut in futures.items():
                try:
                    out[i] = fut.result()
                except ImageRejected as e:
                    out[i] = e
    finally:
        if fetcher is not None:
            fetcher.close()
    return out


def _fetches_metered(*, user, inputs: list[EmbedInput], sources: dict[int, SourceFile | ImageRejected],
                     key_prefix: str, model_id: str) -> None:
    """Meter the image URLs of a request fetched whole (``fetch``: one unit and its bytes each),
    whatever becomes of them after."""
    got = [src.size for i, src in sources.items() if isinstance(src, SourceFile) and _fetched(inputs[i])]
    if got:
        usage_meter.fetched(owner_id=user.id, key_prefix=key_prefix, model_id=model_id, fetches=len(got),
                            nbytes=sum(got), lane=Lane.INTERACTIVE)


def _refusal(index: int, kind: str, reason: str, detail: str) -> dict:
    return {"index": index, "kind": kind, "reason": reason, "detail": detail}


def _texts(inputs: list[EmbedInput]) -> tuple[list[tuple[int, str]], dict[int, dict]]:
    """``([(input index, text cut to MAX_TEXT_CHARS)], {input index: refusal of an empty text})``."""
    texts, refused = [], {}
    for i, inp in enumerate(inputs):
        if inp.kind != "text":
            continue
        if not inp.text.strip():
            refused[i] = _refusal(i, "text", EMPTY_TEXT, "the text is empty")
        else:
            texts.append((i, inp.text[:MAX_TEXT_CHARS]))
    return texts, refused


def _answered(index: int, kind: str, got: dict) -> dict:
    """An item from a worker's entry (``queues.interactive.inputs_embed``)."""
    if "vector" not in got:
        return _refusal(index, kind, got.get("reason", "failed"), got.get("detail", ""))
    item = {"index": index, "kind": kind, "vector": got["vector"]}
    if "tokens" in got:
        item["tokens"] = got["tokens"]
    return item


def embeddings_create(*, user, inputs: list[EmbedInput], deadline_s: float, store: bool = False,
                      space: EmbeddingSpace | None = None, key_prefix: str = "") -> EmbedOutcome:
    """One vector per input, in input order, on the interactive lane within ``deadline_s``.

    A refused input fails alone with a reason code (``workers.errors.Reason``: ``invalid_base64``,
    ``not_an_image``, ``too_large``, ``fetch_*``, ... ; ``empty`` for an empty text). Images are
    admitted before anything is fetched or staged; with ``store`` they are fetched first, then
    uploaded (:func:`upload.images_upload`, which admits them).

    Args:
        inputs: 1..``EMBEDDINGS_MAX_INPUTS`` (the caller checks the count).
        store: images become the caller's images (ids, metadata); texts are never stored.
        space: the embedding space (default: the active one). Only the active space with ``store``.
        key_prefix: the request's API key: stored images carry it (metered when written); what is
            not stored is metered by the caller once it answers (:func:`embeddings_metered`).

    Raises:
        ApplicationError: ``overloaded`` (429, ``Retry-After``), ``deadline_exceeded`` (504: nothing
            stored; with ``store`` a 202 outcome instead), ``worker_error`` (503),
            ``invalid`` (400: ``store`` in a space that is not the active one).
    """
    active = spaces.active()
    space = space or active
    deadline_ts = time.time() + deadline_s
    if store:
        if space.model_id != active.model_id:
            raise ApplicationError("images are stored in the active space only", code="invalid",
                                   extra={"model": space.model_id, "active": active.model_id})
        return _create_stored(user=user, inputs=inputs, deadline_ts=deadline_ts, space=space, deadline_s=deadline_s,
                              key_prefix=key_prefix)
    texts, items = _texts(inputs)
    n_images = sum(1 for inp in inputs if inp.kind == "image")
    # the texts are one pass of the text tower: counted as one image's work
    admitted = lane_control.interactive_admit(deadline_s=deadline_s, images=max(1, n_images + bool(texts)))
    blobs = runtime.blob_store()
    staged: list[str] = []
    answer: dict | None = {"data": [], "image_tokens": 0}
    try:
        work: list[tuple[int, dict]] = [(i, {"text": t}) for i, t in texts]
        sources = _sources(inputs, deadline_ts)
        _fetches_metered(user=user, inputs=inputs, sources=sources, key_prefix=key_prefix, model_id=space.model_id)
        for i, src in sources.items():
            if isinstance(src, ImageRejected):
                items[i] = _refusal(i, "image", src.reason.value, src.detail)
                continue
            key, sha, _ = blobs.put_temporary(iter_blocks(src.open()))
            staged.append(key)
            work.append((i, {"key": key, "sha256": sha}))
        work.sort()
        if work:
            answer = wait_for(dispatch.send_embed_inputs(items=[w for _, w in work], deadline_ts=deadline_ts,
                                                         model_id=space.model_id), deadline_ts)
    finally:
        for key in staged:
            blobs.delete(key)
        lane_control.interactive_answered(admitted, images=len(staged) + bool(texts),
                                          status=504 if answer is None else 200)
    late = answer is None or any(got.get("reason") == Reason.EXPIRED.value for got in answer["data"])
    if late:
        raise ApplicationError(f"the embeddings did not finish within the deadline of {deadline_s:g} s",
                               code="deadline_exceeded", status=504, extra={"deadline_s": deadline_s})
    for (i, _), got in zip(work, answer["data"]):
        items[i] = _answered(i, inputs[i].kind, got)
    ordered = [items[i] for i in range(len(inputs))]
    return EmbedOutcome(status=_status(ordered), items=ordered, space=space,
                        image_tokens=answer["image_tokens"], deadline_s=deadline_s,
                        compute_s=answer.get("compute_ms", 0.0) / 1000)


def embeddings_metered(*, user, outcome: EmbedOutcome, key_prefix: str) -> None:
    """Meter an answered embeddings request (docs/usage.md): each text and each image answered with
    a vector it did not store (a stored image, with its ``image_id``, is metered when its vector is
    written), with the worker's ``compute_s``. Call it once the answer is decided, only for an
    answer that carries the vectors."""
    texts = sum(1 for it in outcome.items if "vector" in it and it["kind"] == "text")
    images = sum(1 for it in outcome.items if "vector" in it and it["kind"] == "image" and "image_id" not in it)
    usage_meter.answered(owner_id=user.id, key_prefix=key_prefix, model_id=outcome.space.model_id, texts=texts,
                         images=images, compute_s=outcome.compute_s)


def _status(items: list[dict]) -> int:
    refused = [it["reason"] for it in items if "reason" in it and "image_id" not in it]
    return refusal_status(refused) if items and len(refused) == len(items) else 200


def _create_stored(*, user, inputs: list[EmbedInput], deadline_ts: float, space: EmbeddingSpace,
                   deadline_s: float, key_prefix: str) -> EmbedOutcome:
    """``store``: the images as an interactive upload with their vectors, the texts beside it."""
    texts, items = _texts(inputs)
    sources: list[tuple[int, SourceFile]] = []
    read = _sources(inputs, deadline_ts)
    _fetches_metered(user=user, inputs=inputs, sources=read, key_prefix=key_prefix, model_id=space.model_id)
    for i, src in sorted(read.items()):
        if isinstance(src, ImageRejected):
            items[i] = _refusal(i, "image", src.reason.value, src.detail)
        else:
            sources.append((i, src))
    pending, admitted, answer = None, None, None
    if texts:  # sent first, so that they compute while the images are stored and embedded
        admitted = lane_control.interactive_admit(deadline_s=max(0.01, deadline_ts - time.time()), images=1)
        pending = dispatch.send_embed_inputs(items=[{"text": t} for _, t in texts], deadline_ts=deadline_ts,
                                             model_id=space.model_id)
    try:
        outcome = None
        if sources:
            outcome = images_upload(owner=user, sources=[s for _, s in sources],
                                    deadline_s=max(0.01, deadline_ts - time.time()), k=0, vectors=True,
                                    key_prefix=key_prefix)
        if pending is not None:
            answer = wait_for(pending, deadline_ts)
    finally:
        if pending is not None and answer is None:  # not read: the images' upload failed first
            dispatch.forget(pending)
        if admitted is not None:
            lane_control.interactive_answered(admitted, images=1 if pending is not None else 0,
                                              status=504 if answer is None else 200)
    late = outcome is not None and outcome.status == 202
    if texts and (answer is None or any(got.get("reason") == Reason.EXPIRED.value for got in answer["data"])):
        late = True
        answer = {"data": [{"reason": Reason.EXPIRED.value, "detail": "the deadline passed before its vector"}]
                  * len(texts), "image_tokens": 0}
    for (i, _), got in zip(texts, (answer or {"data": []})["data"]):
        items[i] = _answered(i, "text", got)
    for (i, _), view in zip(sources, outcome.images if outcome is not None else []):
        item = {"index": i, "kind": "image", "image_id": view["id"], "status": view["status"]}
        vector = outcome.vectors.get(view["id"])
        if vector is not None:
            item["vector"] = vector
        elif view["status"] in (ImageStatus.FAILED, ImageStatus.EXPIRED):
            item.update(reason=view["reason"], detail=view["detail"])
        elif not late:  # a copy of bytes whose original (another request's) is not embedded yet
            item.update(reason="not_embedded", detail="a copy of an image that is not embedded yet: "
                                                      f"its vector is at {view['url']} once it is")
        items[i] = item
    ordered = [items[i] for i in range(len(inputs))]
    if late:
        status = 202
    elif all("vector" not in it for it in ordered):
        status = refusal_status([it.get("reason", "") for it in ordered])
    else:
        status = 200
    image_tokens = answer.get("image_tokens", 0) if answer else 0
    return EmbedOutcome(status=status, items=ordered, space=space, image_tokens=image_tokens, deadline_s=deadline_s,
                        compute_s=(answer or {}).get("compute_ms", 0.0) / 1000)
