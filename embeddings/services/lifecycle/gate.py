"""The quality gate of an embedding space (issue 13): may this model's collection be searched?

A probe takes a seeded sample of the space's embedded images (distinct sha256, all owners), makes a
*re-encoded copy* of each (:func:`reencode`: resized to 3/4 of each side, saved as JPEG quality 85),
embeds the copies with the space's model and checks that each copy's nearest point in the space's
collection is its original's point (top-1). A model that maps an image and a lightly degraded copy
of it to different places cannot serve "find this photo again", whatever else it does; a broken
checkpoint (collapsed or noise-driven image tower) fails it at once, while any working CLIP
(trained or seeded random weights, measured: docs/operations.md) finds every original.

Catalogues hold the same picture more than once (a photo saved again, resized, a burst): the copy
of such a picture may find its twin first under *any* model, by a coin flip of rounding. So when the
space has a reference (the space it was migrated from, or else the active one) the copies are also
embedded with the reference model, and a miss whose first hit the reference judges a twin of the
original (in the reference's collection that point is at least as close to the original as the
re-encoded copy is) is set aside as a ``twin``, not counted against the model: ``rate`` is hits over
the copies judged, ``raw_rate`` hits over the whole sample. A broken model's misses land on
unrelated images, which the reference does not excuse. Measured (docs/benchmarks-migration.md): a
catalogue of near-identical copies (each photo several times with a 32-pixel mark) gave raw rates
of 0.13-0.83 with healthy seeded models, every judged copy finding its original (rate 1.0).

The probe runs in the workers as one Celery chain, never a task waiting on another:
``gate_embed`` on the bulk queue at background priority (a worker holding the space's model,
``runtime.batch_runner(model_id)``) → ``gate_check`` on the vectors queue (the store's owner,
``runtime.vector_store(model_id)``), which writes ``space.gate_report``. :func:`gate_verdict` reads
it for ``promote`` (``embeddings.services.lifecycle.model_migrations``).
"""
from __future__ import annotations

import datetime as dt
import random
import time
import uuid

import cv2
from celery import chain
from django.conf import settings
from django.utils import timezone

from embeddings import dispatch, metrics, runtime, spaces
from embeddings.messages import decode_vector, encode_vector
from embeddings.models import (
    EmbeddingSpace,
    Image,
    ImageStatus,
    JobStatus,
    Lane,
    SpaceState,
    WebhookEvent,
)
from embeddings.services.lifecycle import cutoff
from embeddings.services.webhooks import events as webhook_events
from workers import screen
from workers.decode import decode_image
from workers.ids import point_id

#: Verdict codes (stable): no finished report (never run, still running, or lost), or a report
#: below the threshold (or a probe that could not embed: its ``error``).
GATE_MISSING = "gate_missing"
GATE_FAILED = "gate_failed"

#: Each side of the copy, relative to the stored image: 3/4 (56 % of the pixels), the size change of
#: a typical "saved again, smaller" copy; resized with OpenCV's INTER_AREA (anti-aliased downscale).
REENCODE_SCALE = 0.75
#: JPEG quality of the copy: 85, the issue's figure and a common default of photo tools (visible
#: block artefacts are rare above it, the file is ~4x smaller than quality 100).
REENCODE_JPEG_QUALITY = 85
#: Failures listed in a report (the counts cover all of them).
REPORT_MAX_FAILURES = 50


def _space(space_or_id) -> EmbeddingSpace:
    return space_or_id if isinstance(space_or_id, EmbeddingSpace) else EmbeddingSpace.objects.get(pk=space_or_id)


def reencode(data: bytes) -> bytes:
    """The probe's copy of an image: decoded upright (``workers.decode``, as the workers see it),
    resized to :data:`REENCODE_SCALE` of each side (at least 1 pixel), JPEG at
    :data:`REENCODE_JPEG_QUALITY` (no EXIF: the pixels are already upright).

    Raises:
        workers.errors.ImageRejected: the stored bytes do not decode (their reason code).
    """


    rgb = decode_image(data).rgb
    h, w = rgb.shape[:2]
    size = (max(1, round(w * REENCODE_SCALE)), max(1, round(h * REENCODE_SCALE)))
    small = cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(small, cv2.COLOR_RGB2BGR),
                           [cv2.IMWRITE_JPEG_QUALITY, REENCODE_JPEG_QUALITY])
    if not ok:  # pragma: no cover - OpenCV encodes any uint8 RGB array
        raise ValueError("OpenCV could not encode the copy as JPEG")
    return buf.tobytes()


def gate_sample(space: EmbeddingSpace, *, size: int, seed: int = 0) -> list[dict]:
    """A seeded sample of ``size`` distinct points of ``space`` (all owners): :func:`sample_points`."""
    return sample_points(space.model_id, size=size, seed=seed)


def sample_points(model_id: str, *, size: int, seed: int = 0, owner_id: int | None = None) -> list[dict]:
    """A seeded sample of ``size`` distinct points of space ``model_id`` (of one owner's rows when
    ``owner_id`` is given): one embedded row per sha256 (the oldest), drawn with
    ``random.Random(seed)`` from the rows ordered by sha256, so the same catalogue and seed give the
    same sample.

    Returns:
        ``[{"id", "storage_key", "sha256", "point_id"}]`` (strings), at most ``size``.
    """
    rows: dict[str, dict] = {}
    embedded = Image.objects.filter(model_id=model_id, status=ImageStatus.EMBEDDED)
    if owner_id is not None:
        embedded = embedded.filter(owner_id=owner_id)
    for i, key, sha, pid in (embedded.order_by("sha256", "created_at")
                             .values_list("id", "storage_key", "sha256", "point_id")):
        rows.setdefault(sha, {"id": str(i), "storage_key": key, "sha256": sha, "point_id": str(pid)})
    distinct = list(rows.values())
    return random.Random(seed).sample(distinct, min(max(0, size), len(distinct)))


def gate_start(space_or_id, *, sample: int | None = None, seed: int = 0, calibrate: bool = True) -> dict:
    """Start the quality gate of a space (an ``EmbeddingSpace`` or its pk): draw the sample, record a
    ``running`` report, send the chain ``gate_embed`` (bulk, background) → ``gate_check`` (vectors).
    With ``calibrate`` the space's cutoffs are recomputed first (``services.cutoff``), so a finished
    migration has both before anyone reads them. Runs inline with eager Celery (tests).

    Args:
        sample: images to probe (default ``settings.MIGRATION_GATE_SAMPLE``, 200).
        seed: the sample's seed (recorded).

    Returns:
        The space's ``gate_report`` as recorded when the chain was sent (``state`` ``running``), or
        the finished one when it ran inline.

    Raises:
        EmbeddingSpace.DoesNotExist: no such space.
    """


    space = _space(space_or_id)
    if calibrate:
        cutoff.calibrate_start(space)
    size = settings.MIGRATION_GATE_SAMPLE if sample is None else sample
    picks = gate_sample(space, size=size, seed=seed)
    reference = reference_of(space)
    run = uuid.uuid4().hex
    report = {"state": "running", "run": run, "model_id": space.model_id, "requested": size, "seed": seed,
              "sample": len(picks), "threshold": settings.MIGRATION_GATE_THRESHOLD,
              "reference": reference.model_id if reference else None, "started_at": timezone.now().isoformat(),
              "reencode": {"scale": REENCODE_SCALE, "jpeg_quality": REENCODE_JPEG_QUALITY}}
    EmbeddingSpace.objects.filter(pk=space.pk).update(gate_report=report)
    embed = dispatch.task("gate_embed", space.model_id, picks, reference.model_id if reference else None,
                          immutable=True, **dispatch.bulk_options("background"))
    check = dispatch.task("gate_check", space.model_id, run, **dispatch.vectors_options(interactive=False))
    chain(embed, check).apply_async()
    return EmbeddingSpace.objects.get(pk=space.pk).gate_report


def reference_of(space: EmbeddingSpace) -> EmbeddingSpace | None:
    """The space whose model ``space``'s gate compares with: the space it was migrated from (while
    not dropped), else the active space; ``None`` for the active space itself with no live source."""

    ref = space.source
    if ref is None or ref.state == SpaceState.DROPPED or ref.pk == space.pk:
        ref = spaces.active(fresh=True)
    return None if ref.pk == space.pk else ref


def embed_copies(model_id: str, picks: list[dict], load) -> dict:
    """``picks``' copies (``load(id)`` → bytes) through ``model_id``'s model in forward passes of
    ``BULK_BATCH_SIZE``: ``{"items": [{"id", "sha256", "point_id", "vector"}], "failed": [...]}``,
    or ``{"error", "detail"}`` when this process cannot load the model."""

    by_id = {p["id"]: p for p in picks}
    try:
        runner = runtime.batch_runner(model_id)
        runner.encoder.get()
    except Exception as e:  # noqa: BLE001 - ModelNotConfigured, WeightsUnavailable, a missing checkpoint
        return {"error": getattr(e, "code", None) or "weights_unavailable", "detail": f"{type(e).__name__}: {e}"}
    keys = list(by_id)
    size = max(1, settings.PIPELINE.batch_size)
    items, failed = [], []
    for result in runner.run_many([keys[i : i + size] for i in range(0, len(keys), size)], load):
        failed += [[f.key, f.reason, f.detail] for f in result.failed]
        metrics.count_refused_embeddings(lane=Lane.BULK, reasons=[f.reason for f in result.failed])
        items += [{"id": m.key, "sha256": by_id[m.key]["sha256"], "point_id": by_id[m.key]["point_id"],
                   "vector": encode_vector(v)} for m, v in zip(result.metas, result.vectors)]
    return {"items": items, "failed": failed}


def gate_embed(*, model_id: str, picks: list[dict], reference: str | None = None) -> dict:
    """Embed the re-encoded copies of ``picks`` (:func:`gate_sample` rows) with ``model_id``'s model
    and, when given, with the ``reference`` space's model (bulk worker). Each copy is made once.

    Returns:
        ``{"items": [{"id", "sha256", "point_id", "vector": base64}], "failed": [[id, reason, detail]],
        "reference": {"items", "failed"} | {"error", "detail"} | None, "embed_s": s}``, or
        ``{"error": code, "detail"}`` when this process cannot load ``model_id``'s model
        (``model_not_configured``, ``weights_unavailable``): the check then records the error.
    """

    by_id = {p["id"]: p for p in picks}
    blobs = runtime.blob_store()
    copies: dict[str, bytes] = {}
    t0 = time.perf_counter()

    def load(key: str) -> bytes:
        if key not in copies:
            p = by_id[key]
            copies[key] = reencode(blobs.read(p["storage_key"], p["sha256"]))
        return copies[key]

    out = embed_copies(model_id, picks, load)
    if "error" in out:
        return out
    out["reference"] = embed_copies(reference, picks, load) if reference else None
    out["embed_s"] = round(time.perf_counter() - t0, 3)
    return out


def gate_check(*, embedded: dict, model_id: str, run: str) -> dict:
    """Search each copy's top-1 in ``model_id``'s collection (all owners) and record the report in
    the space's ``gate_report`` (vectors worker). A report of another run (a newer ``gate_start``)
    is not overwritten.

    Report fields: ``state`` (``done`` / ``error``), ``model_id``, ``reference`` (its model id or
    None), ``sample`` (copies probed), ``twins`` (misses whose first hit the reference model judges a
    twin of the original: not judged; ``twin_examples``), ``judged`` (sample − twins), ``hits``
    (judged copies whose top-1 is their original), ``rate`` (hits / judged; None for an empty
    catalogue), ``raw_hits``/``raw_rate`` (over the whole sample), ``threshold``, ``passed``, ``failures`` (at most :data:`REPORT_MAX_FAILURES`: image id,
    sha256, the first hit's point and image id and score, the original's score; or, for a copy
    the model gave NaN, infinity or zeros for, which counts as a miss, image id, reason and
    detail), ``unreadable`` (images whose stored bytes did not decode), ``coverage`` and
    ``unusable_vectors`` (:func:`_coverage`: ``passed`` also needs ``coverage`` ≥ ``threshold``), ``started_at``/``finished_at`` (ISO), ``duration_s``,
    ``embed_s`` (the copies' embedding), ``search_ms`` (all searches), ``reencode``, ``seed``.

    Returns:
        The report.
    """
    space = EmbeddingSpace.objects.get(model_id=model_id)
    report = dict(space.gate_report or {})
    if report.get("run") != run:
        return report
    threshold = float(report.get("threshold", settings.MIGRATION_GATE_THRESHOLD))
    started = dt.datetime.fromisoformat(report["started_at"]) if report.get("started_at") else timezone.now()
    now = timezone.now()
    report.update(finished_at=now.isoformat(), duration_s=round((now - started).total_seconds(), 3))
    if "error" in embedded:
        report.update(state="error", passed=False, error=embedded["error"], detail=embedded.get("detail", ""))
    else:
        t0 = time.perf_counter()
        items = embedded.get("items", [])
        # a copy the model gave NaN, infinity or zeros for is a miss of the model, not an unreadable file
        refused = [f for f in embedded.get("failed", []) if f[1] in _UNUSABLE]
        unreadable = [f for f in embedded.get("failed", []) if f[1] not in _UNUSABLE]
        misses = _probe(model_id, items)
        ref, twins = embedded.get("reference"), set()
        if ref and "error" not in ref and misses:
            twins = _twins(report["reference"], misses, {it["id"]: it for it in ref["items"]})
        elif ref and "error" in ref:
            report["reference_error"] = f"{ref['error']}: {ref.get('detail', '')}"
        search_ms = (time.perf_counter() - t0) * 1000
        judged = [it for it in items if it["id"] not in twins]
        failures = [misses[it["id"]] for it in judged if it["id"] in misses]
        failures += [{"image_id": i, "reason": r, "detail": d, "first": None, "original_score": None}
                     for i, r, d in refused]
        n = len(judged) + len(refused)
        hits = n - len(failures)
        rate = hits / n if n else None
        probed = len(items) + len(refused)
        raw_hits = len(items) - len(misses)
        coverage, unusable = _coverage(model_id)
        report.update(state="done", sample=probed, judged=n, hits=hits, rate=None if rate is None else round(rate, 6),
                      raw_hits=raw_hits, raw_rate=round(raw_hits / probed, 6) if probed else None,
                      twins=len(twins), twin_examples=[misses[i] for i in sorted(twins)][:10],
                      passed=(rate is None or rate >= threshold) and (coverage is None or coverage >= threshold),
                      failures=failures[:REPORT_MAX_FAILURES], failed_count=len(failures), unreadable=unreadable,
                      coverage=coverage, unusable_vectors=unusable,
                      embed_s=embedded.get("embed_s"), search_ms=round(search_ms, 2))
        if rate is None and not unusable:
            report["note"] = "empty catalogue: nothing to probe"
    if EmbeddingSpace.objects.filter(model_id=model_id, gate_report__run=run).update(gate_report=report):
        _ready_emit(model_id)
    return report


#: Reason codes of images whose vector the model gave as NaN, infinity or zeros (``workers.screen``).
_UNUSABLE = tuple(r.value for r in screen.REASONS)


def _coverage(model_id: str) -> tuple[float | None, int]:
    """``(embedded rows / (embedded + refused for an unusable vector), refused)`` of the space
    (``None`` when it has neither): a model that gives no usable vector for part of the catalogue
    hides that part from every search, which the probe of its embedded images cannot see."""
    rows = Image.objects.filter(model_id=model_id)
    embedded = rows.filter(status=ImageStatus.EMBEDDED).count()
    unusable = rows.filter(status=ImageStatus.FAILED, reason__in=_UNUSABLE).count()
    total = embedded + unusable
    return (round(embedded / total, 6) if total else None), unusable


def _ready_emit(model_id: str) -> None:
    """Webhook ``migration.ready`` when the first gate run of a migration whose job is done has
    judged its candidate: the outcome is known, and ``data.gate.passed`` says whether ``promote``
    goes through without ``force``. Once per migration (its job): a gate run again by hand is
    already being watched by whoever ran it."""

    space = EmbeddingSpace.objects.select_related("job", "source").get(model_id=model_id)
    if space.state != SpaceState.CANDIDATE or space.job is None or space.job.status != JobStatus.DONE:
        return
    key = f"{WebhookEvent.MIGRATION_READY}:{space.pk}:{space.job_id}"
    webhook_events.event_emit(event=WebhookEvent.MIGRATION_READY, key=key, endpoints=webhook_events.staff_recipients(),
                              data=migration_event_data(space))


#: Cosine slack of the twin judgement: the same bytes embedded in forward passes of different sizes
#: differ by float rounding (first_vs_original 1e-7 below copy_vs_original for a copy that *is* the
#: twin's bytes, measured), which must not turn a twin into a failure of the model.
TWIN_TOLERANCE = 1e-5


def _twins(reference: str, misses: dict[str, dict], ref_items: dict[str, dict]) -> set[str]:
    """The misses whose first hit is a twin of the original by the ``reference`` model's judgement:
    in the reference's collection that hit's point is at least as close to the original's point as
    the re-encoded copy is (cosine, within :data:`TWIN_TOLERANCE`). Each such miss gets
    ``"reference": {"first_vs_original", "copy_vs_original"}`` and ``"twin": True``. A miss without
    the reference's vectors is no twin."""

    store = runtime.vector_store(reference)
    pids = {}
    for image_id, m in misses.items():
        if m["first"] and m["first"]["sha256"] and image_id in ref_items:
            pids[image_id] = (point_id(m["sha256"], reference), point_id(m["first"]["sha256"], reference))
    vectors = store.vectors([p for pair in pids.values() for p in pair])
    twins = set()
    for image_id, (orig, first) in pids.items():
        if orig not in vectors or first not in vectors:
            continue
        copy = decode_vector(ref_items[image_id]["vector"])
        first_vs, copy_vs = float(vectors[orig] @ vectors[first]), float(vectors[orig] @ copy)
        misses[image_id]["reference"] = {"first_vs_original": round(first_vs, 6), "copy_vs_original": round(copy_vs, 6)}
        if first_vs >= copy_vs - TWIN_TOLERANCE:
            misses[image_id]["twin"] = True
            twins.add(image_id)
    return twins


def _probe(model_id: str, items: list[dict]) -> dict[str, dict]:
    """Search each copy's top-1 in ``model_id``'s collection (all owners).

    Returns:
        ``{image id: failure}`` for the copies whose first hit is not their ``point_id``: image id,
        sha256, the first hit (point, sha256, image id, score) and the original's score.
    """

    store = runtime.vector_store(model_id)
    originals = store.vectors([uuid.UUID(it["point_id"]) for it in items])
    misses = {}
    for it in items:
        vector = decode_vector(it["vector"])
        top = store.search(vector, k=1)
        pid = uuid.UUID(it["point_id"])
        if top and top[0].id == pid:
            continue
        own = originals.get(pid)
        misses[it["id"]] = {
            "image_id": it["id"], "sha256": it["sha256"],
            "first": ({"point_id": str(top[0].id), "sha256": top[0].payload.get("sha256"),
                       "image_id": _row_of(model_id, top[0].payload.get("sha256")),
                       "score": round(float(top[0].score), 6)} if top else None),
            "original_score": None if own is None else round(float(vector @ own), 6),
        }
    return misses


def _row_of(model_id: str, sha256: str | None) -> str | None:
    """The id of ``model_id``'s oldest embedded row with ``sha256`` (a failure's first hit)."""
    if not sha256:
        return None
    got = (Image.objects.filter(model_id=model_id, sha256=sha256, status=ImageStatus.EMBEDDED)
           .order_by("created_at").values_list("id", flat=True).first())
    return None if got is None else str(got)


def gate_verdict(space: EmbeddingSpace, threshold: float | None = None) -> tuple[bool, str | None, str]:
    """May ``space`` be promoted, by its last gate report?

    Args:
        threshold: the lowest top-1 rate accepted (default ``settings.MIGRATION_GATE_THRESHOLD``,
            0.99: one miss in a 200-image sample passes, two do not).

    Returns:
        ``(True, None, detail)``, or ``(False, code, detail)`` with code :data:`GATE_MISSING` (no
        report, still running) or :data:`GATE_FAILED` (rate below ``threshold``; coverage below it:
        too many of the space's images got no usable vector; or the probe could not embed: its error).
    """
    threshold = settings.MIGRATION_GATE_THRESHOLD if threshold is None else float(threshold)
    report = space.gate_report or {}
    state = report.get("state")
    if state == "running":
        return False, GATE_MISSING, f"the quality gate of {space.model_id} is running since {report.get('started_at')}"
    if state == "error":
        return False, GATE_FAILED, f"the quality gate could not embed: {report.get('error')}: {report.get('detail', '')}"
    if state != "done":
        return False, GATE_MISSING, f"no quality gate report for {space.model_id}: run the gate first"
    rate, coverage = report.get("rate"), report.get("coverage")
    if coverage is not None and coverage < threshold:
        return False, GATE_FAILED, (f"{report.get('unusable_vectors')} images of {space.model_id} have no usable "
                                    f"vector (NaN, infinity or zeros): coverage {coverage:.4f}, threshold "
                                    f"{threshold:.4f}")
    if rate is None:
        return True, None, "empty catalogue: nothing to probe"
    detail = f"{report.get('hits')}/{report.get('sample')} re-encoded copies found their original first " \
             f"(rate {rate:.4f}, threshold {threshold:.4f})"
    if rate < threshold:
        return False, GATE_FAILED, detail
    return True, None, detail


def migration_event_data(space: EmbeddingSpace) -> dict:
    """A ``migration.*`` webhook's ``data``: the space (id, model, state, times), its job, the
    quality gate's verdict so far, and its URL."""
    report = space.gate_report or {}

    def iso(t):
        return t.isoformat() if t else None

    return {"migration_id": space.pk, "model_id": space.model_id, "state": space.state,
            "job_id": str(space.job_id) if space.job_id else None,
            "source_model_id": space.source.model_id if space.source_id else None,
            "gate": {k: report.get(k) for k in ("state", "passed", "rate", "threshold", "sample", "judged", "hits")},
            "created_at": iso(space.created_at), "promoted_at": iso(space.promoted_at),
            "url": f"/api/migrations/{space.pk}/"}
