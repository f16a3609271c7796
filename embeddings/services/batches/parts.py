"""A batch part on the bulk worker (``batch_part`` on the bulk queue): its input lines read from the
input file's byte range, each line's body checked as ``POST /v1/embeddings`` checks it, its images
decoded (base64, data URLs) or read as the fetch worker fetched them (http(s) URLs: ``batch_part_fetch``
on the fetch queue first, the catalogue fetcher's rules: address checks on every hop, size cap,
retries) and embedded by the bulk runner, its texts by the text tower; its finished lines written as
two blobs (successes, refusals) before the part is marked ``done``.

A line whose every input has a vector is an output line (``response.status_code`` 200, the body
``POST /v1/embeddings`` answers); any refused input makes the whole line an error line (400 or 404,
OpenAI's error body naming the input), as ``/v1/embeddings`` answers all or nothing.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
import uuid

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from embeddings import dispatch, lane_control, metrics, runtime
from embeddings.errors import ApplicationError
from embeddings.messages import encode_vector
from embeddings.models import Batch, BatchPart, BatchStatus, Lane, PartState, UsageKind
from embeddings.services.batches import batches as batch_services
from embeddings.services.batches import files as file_services
from embeddings.services.batches import lines as batch_lines
from embeddings.services.interactive import embed as embed_services
from embeddings.services.usage import meter as usage_meter
from embeddings.spaces import ModelNotConfigured
from workers import screen
from workers.errors import ImageRejected, Reason

log = logging.getLogger(__name__)

#: OpenAI's ``error.type`` by status, as ``/v1/embeddings`` answers.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}


def part_run(*, batch_id: str, index: int) -> dict:
    """Run one part of a batch and record its lines; then queue the batch's finalisation if it was
    the last. A part no longer queued (done by an earlier delivery, cancelled, expired) is left
    alone; one of a cancelling batch, or reached after the window ended, is settled unrun.

    Returns:
        ``{"state", "completed", "failed"}``.
    """
    # a running part is claimed again too (the broker redelivers a dead worker's message): of two
    # deliveries running one part, the first to finish records its lines, the other writes nothing
    claimed = BatchPart.objects.filter(batch_id=batch_id, index=index, state__in=batch_services.OPEN_PARTS).update(
        state=PartState.RUNNING, leased_at=timezone.now())
    if not claimed:
        return {"state": "skipped", "completed": 0, "failed": 0}
    part = BatchPart.objects.select_related("batch", "batch__job").get(batch_id=batch_id, index=index)
    batch = part.batch
    unrun = None
    if batch.status == BatchStatus.CANCELLING:
        unrun = PartState.CANCELLED
    elif timezone.now() >= batch.expires_at:
        unrun = PartState.EXPIRED
    if unrun is not None:
        BatchPart.objects.filter(id=part.id, state=PartState.RUNNING).update(state=unrun)
        batch_services.batch_finish_check(batch_id=batch_id)
        return {"state": unrun.value, "completed": 0, "failed": 0}
    outputs, errors, used = _run_lines(batch, part)
    store = runtime.blob_store()
    out_key, out_sha, _ = store.put(iter(outputs)) if outputs else ("", "", 0)
    err_key, err_sha, _ = store.put(iter(errors)) if errors else ("", "", 0)
    with transaction.atomic():
        done = BatchPart.objects.filter(id=part.id, state=PartState.RUNNING).update(
            state=PartState.DONE, completed=len(outputs), failed=len(errors), output_key=out_key,
            output_sha256=out_sha, error_key=err_key, error_sha256=err_sha)
        if done:  # metered with the one delivery that records the part (docs/usage.md)
            usage_meter.usage_add(dataclasses.replace(u, owner_id=batch.owner_id, key_prefix=batch.job.key_prefix)
                                  for u in used)
        batch_services.batch_finish_check(batch_id=batch_id)
    for key in batch_services.staged_keys(part):  # read: the fetched images are no longer needed
        file_services.blob_release(key)
    if not done:  # another delivery recorded the part, or the batch ended meanwhile: one set of lines only
        log.info("batch %s part %s finished after it was recorded or its batch ended; its lines are dropped",
                 batch_id, index)
        for key in (out_key, err_key):
            if key:
                file_services.blob_release(key)
    return {"state": PartState.DONE.value if done else "late", "completed": len(outputs), "failed": len(errors)}


def _fetched_inputs(lines) -> dict[str, object]:
    """``{"<line>.<input>": input}`` of the image URLs to fetch among a part's lines (lines whose
    body is refused are left to :func:`part_run`, which answers them)."""
    out, known = {}, {}
    for n, (_, line) in enumerate(lines):
        try:
            if not isinstance(line, dict) or not isinstance(line.get("body"), dict):
                continue
            _, _, inputs = _request(line["body"], known)
        except _LineError:
            continue
        for j, inp in enumerate(inputs):
            if inp.image_url is not None and inp.image_url[:5].lower() != "data:":
                out[f"{n}.{j}"] = inp
    return out


def part_fetch(*, batch_id: str, index: int) -> dict:
    """Fetch the image URLs of a queued part (the fetch worker: threads, no model) into the blob
    store, record them in ``BatchPart.staged``, and queue the part on the bulk queue, whose worker
    then reads them instead of fetching. A part no longer queued, or already fetched (a
    redelivery), is only queued on.

    Returns:
        ``{"fetched": n, "refused": n}``.
    """
    part = BatchPart.objects.select_related("batch", "batch__job").filter(batch_id=batch_id, index=index).first()
    if part is None:
        return {"fetched": 0, "refused": 0}
    batch = part.batch
    fetched = refused = nbytes = 0
    if part.state == PartState.PENDING and not part.staged and batch.status == BatchStatus.IN_PROGRESS:
        wanted = _fetched_inputs(_read(batch, part))
        staged: dict[str, dict] = {}
        store, fetcher = runtime.blob_store(), runtime.fetcher()
        with concurrent.futures.ThreadPoolExecutor(max(1, min(settings.FETCH_THREADS, len(wanted) or 1)),
                                                   thread_name_prefix="batch-fetch") as pool:
            futures = {k: pool.submit(fetcher.fetch, inp.image_url) for k, inp in wanted.items()}
            for k, fut in futures.items():
                try:
                    key, sha, size = store.put(iter([fut.result().data]))
                    staged[k] = {"key": key, "sha256": sha}
                    fetched += 1
                    nbytes += size
                except ImageRejected as e:
                    staged[k] = {"reason": e.reason.value, "detail": e.detail}
                    refused += 1
        with transaction.atomic():  # the part's fetches metered once: with the delivery that keeps them
            kept = BatchPart.objects.filter(id=part.id, state=PartState.PENDING).update(staged=staged,
                                                                                       leased_at=timezone.now())
            if kept:
                usage_meter.fetched(owner_id=batch.owner_id, key_prefix=batch.job.key_prefix,
                                    model_id=batch.job.model_id, fetches=fetched, nbytes=nbytes, lane=Lane.BULK)
        if not kept:  # cancelled or expired meanwhile: nothing will read them
            for v in staged.values():
                if "key" in v:
                    file_services.blob_release(v["key"])
    dispatch.send_batch_part(batch_id=batch_id, index=index, priority=batch.job.priority)
    return {"fetched": fetched, "refused": refused}


def _read(batch: Batch, part: BatchPart) -> list[tuple[str | None, dict | None]]:
    """The part's lines as ``(custom_id, line)`` (validated when the batch was made)."""
    out = []
    with runtime.blob_store().open(batch.input_key) as f:
        for _, _, raw in batch_lines.iter_lines(f, offset=part.offset, size=part.size):
            try:
                line = json.loads(raw)
            except ValueError:
                line = None
            out.append((line.get("custom_id") if isinstance(line, dict) else None, line))
    return out


class _LineError(Exception):
    """A line refused as ``/v1/embeddings`` would refuse its body: ``status``, ``code``, ``message``, ``param``."""

    def __init__(self, status: int, code: str, message: str, param: str | None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def response(self) -> dict:
        return {"status_code": self.status, "request_id": f"req_{uuid.uuid4().hex}",
                "body": {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status,
                                                                                    "invalid_request_error"),
                                   "param": self.param, "code": self.code}}}


def _request(body: dict, known: dict):
    """A line's body as ``(space, encoding_format, inputs)``, checked as ``POST /v1/embeddings``
    checks it. ``known``: the spaces looked up for this part so far, by the name asked (one lookup
    per name, not per line).

    Raises:
        _LineError: ``invalid_input``, ``no_inputs``, ``too_many_inputs``, ``model_not_found`` (404),
            ``invalid_dimensions``, ``invalid_encoding_format``.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _LineError(400, "invalid_input", "model is required (a string)", "model")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise _LineError(400, "invalid_encoding_format", "encoding_format: float or base64", "encoding_format")
    modality = body.get("modality", "auto")
    if modality not in ("auto", "text", "image"):
        raise _LineError(400, "invalid_input", "modality: auto, text or image", "modality")
    if "input" not in body:
        raise _LineError(400, "invalid_input", "input is required", "input")
    try:
        if model not in known:
            known[model] = embed_services.space_for_model(model)
        space = known[model]
        inputs = embed_services.openai_inputs(body["input"], modality)
    except ApplicationError as e:
        raise _LineError(e.status, e.code, e.message, e.extra.get("param", "model" if e.status == 404 else "input"))
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims != space.dim):
        raise _LineError(400, "invalid_dimensions", f"dimensions {str(dims)[:20]}: {space.model_id} has {space.dim} "
                                                    f"(vectors are not shortened)", "dimensions")
    return space, encoding, inputs


def _image_bytes(inp, fetcher, staged: dict | None) -> bytes:
    """An image input's bytes: decoded (base64, data URL), or for an http(s) URL what the fetch
    worker staged (``staged``: its entry in ``BatchPart.staged``) or, when nothing was, fetched here.

    Raises:
        ImageRejected: ``invalid_base64``, ``not_an_image``, ``too_large``, a ``fetch_*`` reason.
    """
    if inp.image_url is not None and inp.image_url[:5].lower() != "data:":
        if staged is not None and "key" in staged:
            try:
                return runtime.blob_store().read(staged["key"], staged["sha256"])
            except ImageRejected:  # released by another part that staged the same bytes: fetched again
                pass
        elif staged is not None:
            raise ImageRejected(Reason(staged["reason"]), staged["detail"])
        return fetcher.fetch(inp.image_url).data
    return embed_services.decode_image_string(inp.image if inp.image is not None else inp.image_url)


def _run_lines(batch: Batch, part: BatchPart) -> tuple[list[bytes], list[bytes], list[usage_meter.Usage]]:
    """Every line of the part run: ``(output lines, error lines, usage)``, JSON Lines bytes, in line
    order; ``usage``: the texts and images of the output lines per space (``image_bulk``, ``text``),
    each input with its space's compute time over the inputs it was given, owner and key left for
    the caller to fill in."""
    lines = _read(batch, part)
    requests: dict[int, tuple] = {}
    refused: dict[int, _LineError] = {}
    known: dict = {}
    for n, (_, line) in enumerate(lines):
        try:
            if not isinstance(line, dict) or not isinstance(line.get("body"), dict):
                raise _LineError(400, "invalid_line", "the line is not a request", None)
            requests[n] = _request(line["body"], known)
        except _LineError as e:
            refused[n] = e
    images = {(n, j): inp for n, (_, _, inputs) in requests.items() for j, inp in enumerate(inputs)
              if inp.kind == "image"}
    data: dict[tuple[int, int], bytes | ImageRejected] = {}
    fetcher = runtime.fetcher()
    threads = max(1, min(settings.FETCH_THREADS, len(images)))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="batch-input") as pool:
        futures = {k: pool.submit(_image_bytes, inp, fetcher, (part.staged or {}).get(f"{k[0]}.{k[1]}"))
                   for k, inp in images.items()}
        for k, fut in futures.items():
            try:
                data[k] = fut.result()
            except ImageRejected as e:
                data[k] = e
    vectors: dict[tuple[int, int], dict] = {}
    image_tokens: dict[str, int] = {}
    compute_s: dict[str, float] = {}  # per space: seconds per input it was given
    for model_id in {space.model_id for space, _, _ in requests.values()}:
        mine = [n for n, (space, _, _) in requests.items() if space.model_id == model_id]
        started = time.perf_counter()
        vectors.update(_embed_space(model_id, {n: requests[n][2] for n in mine}, data, image_tokens))
        compute_s[model_id] = (time.perf_counter() - started) / max(1, sum(len(requests[n][2]) for n in mine))
    outputs, errors = [], []
    answered: dict[tuple[str, str], int] = {}  # (space, kind) → inputs of output lines
    for n, (cid, _) in enumerate(lines):
        if n in refused:
            errors.append(batch_lines.result_line(cid, response=refused[n].response(), error=None))
            continue
        space, encoding, inputs = requests[n]
        got = [vectors[(n, j)] for j in range(len(inputs))]
        bad = [(j, g) for j, g in enumerate(got) if "vector" not in g]
        if bad:
            j, g = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            err = _LineError(400, g["reason"], f"input[{j}] ({inputs[j].kind}): {g['reason']}: {g['detail']}{more}",
                             f"input[{j}]")
            errors.append(batch_lines.result_line(cid, response=err.response(), error=None))
            continue
        tokens = sum(g.get("tokens", 0) if inp.kind == "text" else image_tokens.get(space.model_id, 0)
                     for g, inp in zip(got, inputs))
        for inp in inputs:
            answered[(space.model_id, inp.kind)] = answered.get((space.model_id, inp.kind), 0) + 1
        body = {"object": "list", "model": space.model_id,
                "data": [{"object": "embedding", "index": j,
                          "embedding": g["vector"] if encoding == "base64" else g["floats"]}
                         for j, g in enumerate(got)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        outputs.append(batch_lines.result_line(
            cid, response={"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}, error=None))
    kinds = {"text": UsageKind.TEXT, "image": UsageKind.IMAGE_BULK}
    # owner and key filled in by the caller; an error line's inputs (and their compute) are not billed
    used = [usage_meter.Usage(owner_id=0, kind=kinds[kind], units=n, model_id=model_id,
                              compute_s=compute_s.get(model_id, 0.0) * n) for (model_id, kind), n in answered.items()]
    return outputs, errors, used


def _answer(vector) -> dict:
    """``{"vector": base64, "floats": [...]}``, or the refusal of a vector that is not finite or is
    all zeros (``workers.screen``, counted on the bulk lane)."""
    reason = screen.fault(vector)
    if reason is not None:
        metrics.count_refused_embeddings(lane=Lane.BULK, reasons=[reason])
        return {"reason": reason.value, "detail": screen.detail(reason)}
    return {"vector": encode_vector(vector), "floats": [float(x) for x in vector]}


def _embed_space(model_id: str, lines: dict[int, list], data: dict, image_tokens: dict) -> dict:
    """Vectors of the inputs of ``lines`` (``{line: inputs}``) in space ``model_id``: images in one
    bulk run (the runner's decode and forward passes), texts in one text-tower call.
    Returns ``{(line, input): {"vector", "floats"[, "tokens"]} | {"reason", "detail"}}``."""
    out: dict[tuple[int, int], dict] = {}
    keys, texts = [], []
    for n, inputs in lines.items():
        for j, inp in enumerate(inputs):
            if inp.kind == "text":
                if not inp.text.strip():
                    out[(n, j)] = {"reason": Reason.EMPTY.value, "detail": "the text is empty"}
                else:
                    texts.append(((n, j), inp.text[:embed_services.MAX_TEXT_CHARS]))
            elif isinstance(data[(n, j)], ImageRejected):
                out[(n, j)] = {"reason": data[(n, j)].reason.value, "detail": data[(n, j)].detail}
            else:
                keys.append((n, j))
    try:
        holder = runtime.encoder_holder(model_id)
        runner = runtime.batch_runner(model_id) if keys else None
    except ModelNotConfigured as e:
        refusal = {"reason": Reason.MODEL_NOT_CONFIGURED.value, "detail": str(e)}
        return {**out, **{k: refusal for k in keys}, **{k: refusal for k, _ in texts}}
    encoder = holder.get()
    image_tokens[model_id] = encoder.image_tokens
    if keys:
        named = {f"{n}.{j}": (n, j) for n, j in keys}
        # as a background ingest chunk computes (services.queues.bulk): passes of
        # BULK_YIELD_MICRO_BATCH images, the next decoded while the model runs, each giving way
        # while the interactive lane is at capacity (a batch is bulk work, never ahead of a person)
        yields = settings.BULK_YIELD_MAX_S > 0
        with lane_control.bulk_computing(yields=yields) as activity:
            passes = {"micro_batch": settings.BULK_YIELD_MICRO_BATCH or None,
                      "before_pass": lane_control.ingest_yielder(activity=activity)} if yields else {}
            result = runner.run(list(named), lambda key: data[named[key]], **passes)
        for f in result.failed:
            out[named[f.key]] = {"reason": f.reason, "detail": f.detail}
        for meta, vector in zip(result.metas, result.vectors):
            out[named[meta.key]] = _answer(vector)
    if texts and not encoder.has_text:
        for k, _ in texts:
            out[k] = {"reason": Reason.TEXT_TOWER_MISSING.value, "detail": f"the space {model_id} has no text tower"}
    elif texts:
        strings = [t for _, t in texts]
        for (k, _), vector, n in zip(texts, encoder.encode_texts(strings), encoder.count_tokens(strings)):
            out[k] = _answer(vector)
            if "vector" in out[k]:
                out[k]["tokens"] = n
    return out
