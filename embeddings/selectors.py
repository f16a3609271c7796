"""Selectors read (HackSoftware Django-Styleguide): queries shared by views, tasks and admin."""
from __future__ import annotations

import statistics
from typing import Sequence

from django.db.models import QuerySet

from embeddings.messages import encode_vector
from embeddings.models import Image, ImageStatus, Job, JobKind
from workers.timing import STAGES
from workers.vector_store import filters


def images_visible_to(user) -> QuerySet[Image]:
    """Images ``user`` may see: their own, or all for staff; never the rows that re-embed an upload
    in another embedding space (``source`` set: issue 13), which staff see through the migration
    job and the admin."""
    qs = Image.objects.filter(source__isnull=True)
    return qs if user.is_staff else qs.filter(owner=user)


def jobs_visible_to(user) -> QuerySet[Job]:
    """Jobs ``user`` may see: their own, or all for staff. Migration jobs (re-embedding for another
    model, and the dual-embedding jobs of new uploads) are staff-only. A batch's job is read and
    driven through ``/v1/batches`` only (its lines are not images: ``/api/jobs/`` would show it
    empty, and its actions would bypass the batch's own state machine)."""
    qs = Job.objects.exclude(kind=JobKind.BATCH)
    return qs if user.is_staff else qs.filter(owner=user).exclude(kind=JobKind.MIGRATION)


def hits_to_results(hits: Sequence, *, owner_id: int | None, model_id: str, where=None,
                    job_id: str | None = None) -> list[dict]:
    """Qdrant hits → ``[{"image_id", "score", "sha256", "original_name", "job_id", "thumbnail_url",
    "external_id", "metadata"}]``, best first; plus ``"vector"`` (base64 of little-endian float32)
    when the hits carry their vectors (a search ``with_vectors``).

    A hit maps to the embedded image row with its sha256 that the owner may see (any owner when
    ``owner_id`` is None): the *user's* row (``source`` null), in whichever embedding space it was
    uploaded, never a copy made by a migration (issue 13), so the ids a user holds never change
    across a model switch. A point whose rows were all deleted meanwhile is left out.

    With a metadata filter ``where`` (``workers.vector_store.filters``) the row is the one whose
    payload item passed it (with the owner and the job): a point shared by several images stands
    for the one the filter chose.

    Args:
        model_id: the space searched (the hits' collection); the rows may be of any space.
    """
    if where is not None:
        chosen = {}
        for h in hits:
            items = filters.matching_items(h.payload, where, owner_id=owner_id, job_id=job_id)
            if items:
                chosen[h.id] = items[0]["image"]
        by_id = {str(im.id): im for im in Image.objects.filter(id__in=list(chosen.values()), source__isnull=True,
                                                                  status=ImageStatus.EMBEDDED)}
        picked = [(h, by_id.get(chosen.get(h.id))) for h in hits]
    else:
        shas = [h.payload.get("sha256") for h in hits]
        rows = Image.objects.filter(source__isnull=True, sha256__in=shas, status=ImageStatus.EMBEDDED)
        if owner_id is not None:
            rows = rows.filter(owner_id=owner_id)
        by_sha: dict[str, Image] = {}
        for im in rows.order_by("created_at"):
            by_sha.setdefault(im.sha256, im)
        picked = [(h, by_sha.get(h.payload.get("sha256"))) for h in hits]
    out = []
    for h, im in picked:
        if im is not None:
            out.append({
                "image_id": str(im.id), "score": round(h.score, 6), "sha256": im.sha256,
                "original_name": im.original_name, "job_id": str(im.job_id) if im.job_id else None,
                "thumbnail_url": f"/api/images/{im.id}/thumbnail/",
                "external_id": im.external_id or None, "metadata": im.metadata or {},
                **({} if getattr(h, "vector", None) is None else {"vector": encode_vector(h.vector)}),
            })
    return out


def stage_summary(batches) -> dict[str, dict[str, float]]:
    """min / avg / max / p95 (ms) per stage over ``BatchStat`` rows, plus per-image averages."""
    rows = list(batches.values(*(f"{s}_ms" for s in STAGES), "images"))
    out: dict[str, dict[str, float]] = {}
    for stage in STAGES:
        vals = sorted(r[f"{stage}_ms"] for r in rows if r[f"{stage}_ms"] is not None)
        if not vals:
            continue
        images = sum(r["images"] for r in rows if r[f"{stage}_ms"] is not None) or 1
        out[stage] = {
            "min": round(vals[0], 2),
            "avg": round(statistics.fmean(vals), 2),
            "max": round(vals[-1], 2),
            "p95": round(vals[min(len(vals) - 1, int(0.95 * len(vals)))], 2),
            "per_image_avg": round(sum(vals) / images, 3),
        }
    return out
