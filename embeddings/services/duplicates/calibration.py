"""Calibrating an owner's near-duplicate threshold: a seeded sample of their images, copies of
each embedded with the space's model (bulk worker), and the threshold from the copies' cosines to
their originals and the sample's pairs (vectors worker; ``workers.duplicates.calibrate``,
docs/duplicates.md). Then the scan's first slice is sent (``scan.scan_slice``).
"""
from __future__ import annotations

import uuid

import numpy as np
from django.conf import settings
from django.utils import timezone

from embeddings import runtime
from embeddings.messages import decode_vector
from embeddings.models import DuplicateScan, ScanState
from embeddings.services.duplicates.steps import send_step
from embeddings.services.lifecycle.gate import embed_copies, sample_points
from workers import duplicates, screen
from workers.decode import decode_image
from workers.image_copies import CALIBRATION_COPIES, copy_of


def calibration_sample(owner_id: int, model_id: str, *, size: int | None = None, seed: int = 0) -> list[dict]:
    """A seeded sample of the owner's embedded images in the space, one per point, as the quality
    gate draws its own (``gate.sample_points``): ``[{"id", "storage_key", "sha256", "point_id"}]``,
    at most ``size`` (``DUPLICATES_CALIBRATION_SAMPLE``)."""

    size = settings.DUPLICATES_CALIBRATION_SAMPLE if size is None else size
    return sample_points(model_id, size=size, seed=seed, owner_id=owner_id)


def calibration_embed(*, model_id: str, picks: list[dict]) -> dict:
    """Embed :data:`~workers.image_copies.CALIBRATION_COPIES` of each pick with the space's model
    (bulk worker). Returns ``gate.embed_copies``' answer, each item's ``id`` being
    ``"<image id>#<copy index>"``, or ``{"error", "detail"}`` when the model cannot be loaded."""

    blobs = runtime.blob_store()
    copies = [{**p, "id": f"{p['id']}#{n}"} for p in picks for n in range(len(CALIBRATION_COPIES))]
    by_id = {c["id"]: c for c in copies}
    decoded: dict[str, np.ndarray] = {}

    def load(key: str) -> bytes:
        c = by_id[key]
        original = c["id"].split("#")[0]
        if original not in decoded:
            decoded.clear()  # copies of one image are asked for one after another: keep one decoded
            decoded[original] = decode_image(blobs.read(c["storage_key"], c["sha256"])).rgb
        kind, amount = CALIBRATION_COPIES[int(c["id"].split("#")[1])]
        return copy_of(decoded[original], kind, amount)

    return embed_copies(model_id, copies, load)


def calibrate(*, embedded: dict, scan_id: int, run: str) -> dict:
    """Turn the copies' embeddings into the scan's threshold (vectors worker), then send its first
    slice. A failed embedding (no model here) fails the scan with the error. Returns the calibration."""
    scan = DuplicateScan.objects.filter(pk=scan_id, run=run).first()
    if scan is None:
        return {}
    if "error" in embedded:  # no model in the worker that took it: the scan fails with the reason
        now = timezone.now()
        DuplicateScan.objects.filter(pk=scan.pk, run=run).update(
            state=ScanState.FAILED, error=f"{embedded['error']}: {embedded.get('detail', '')}"[:2000], finished_at=now,
            duration_s=round((now - scan.started_at).total_seconds(), 3))
        return {}
    store = runtime.vector_store(scan.model_id)
    items = embedded.get("items", [])
    originals = store.vectors([uuid.UUID(pid) for pid in {it["point_id"] for it in items}])
    positives = []
    for it in items:
        v, o = decode_vector(it["vector"]), originals.get(uuid.UUID(it["point_id"]))
        if o is not None and screen.usable(v):
            positives.append(float(np.dot(v, o)))
    queries = list(originals.items())
    nearest = store.neighbours(queries, k=1, threshold=-1.0, owner_id=scan.owner_id) if queries else []
    x = np.stack([v for _, v in queries]) if queries else np.zeros((0, 1), np.float32)
    pairs = (x @ x.T)[np.triu_indices(len(queries), k=1)].tolist()  # each sampled image with each other
    report = duplicates.calibrate(positives, pairs, neighbours=[hits[0].score for hits in nearest if hits],
                                  default=settings.DUPLICATES_DEFAULT_THRESHOLD)
    report.update(sample=len(originals), copies=len(items), failed=len(embedded.get("failed", [])))
    updated = DuplicateScan.objects.filter(pk=scan_id, run=run).update(
        threshold=report["threshold"], calibration=report, state=ScanState.SCANNING)
    if updated:  # the first slice of the scan
        send_step("duplicates_scan_slice", scan_id, run, None)
    return report
