"""The near-duplicate scan of one owner's images in one space: calibrate, scan in slices, group;
then incremental updates as images arrive.

The chain, all of it background work nobody waits for:

1. :func:`scan_start` (web): resets the owner's :class:`DuplicateScan` with a new ``run``; without a
   given threshold it samples ``DUPLICATES_CALIBRATION_SAMPLE`` of the owner's embedded images and
   sends ``duplicates_calibration_embed`` (bulk queue, background: a worker holding the space's
   model) → ``duplicates_calibrate`` (vectors queue).
2. ``calibration.calibrate`` (vectors): positives are cosines of each sampled image's point to its
   copies (``workers.image_copies.CALIBRATION_COPIES``), pairs the sampled points' cosines to each
   other; ``workers.duplicates.calibrate`` turns them into the threshold (each sampled point's
   nearest other point of the owner is reported beside it).
3. :func:`scan_slice` (vectors, background priority): one page of ``DUPLICATES_SCAN_SLICE`` of
   the owner's points, their neighbours above the threshold by the store's batched queries
   (``workers.duplicates.edges_of``) saved as :class:`DuplicateEdge` rows; the next slice is a new
   message behind any interactive search, so the vectors worker is never held for the whole scan.
4. :func:`scan_finish` (vectors): groups from the edges (``workers.duplicates.group``) replace the
   owner's open near groups, exact copies are regrouped from the database, the edges are deleted.

Once a scan is ``done``, :func:`images_written` (called when points are marked embedded) sends
:func:`scan_update` for the new points: their neighbours, and the open groups they touch,
regrouped at the scan's threshold.

A slice or finish of a superseded run (another ``scan_start`` meanwhile) finds another ``run`` on
the row and stops.
"""
from __future__ import annotations

import time
import uuid

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from embeddings import runtime, spaces
from embeddings.errors import ApplicationError
from embeddings.models import (DuplicateEdge, DuplicateKind, DuplicateMember, DuplicateScan, GroupStatus, Image,
                               ScanState)
from embeddings.services.duplicates import calibration
from embeddings.services.duplicates import groups as group_rows
from embeddings.services.duplicates.steps import send_step
from workers import duplicates, screen

#: Seconds a process trusts its answer to "does any finished scan exist in this space?" (read per
#: written chunk; a scan finished meanwhile starts its incremental updates this much later).
_SCANS_CACHE_S = 5.0
#: Seconds between two regroupings of an owner's exact copies at read time (:func:`refresh_exact`).
EXACT_REFRESH_S = 10.0
_scans_seen: dict[str, tuple[float, bool]] = {}


def scan_start(*, owner, threshold: float | None = None) -> DuplicateScan:
    """Start (or restart) the owner's near-duplicate scan in the active space.

    Args:
        threshold: a cosine in (0, 1] to group at; None: calibrate it from the owner's images.

    Returns:
        The scan row as it is after the first step was sent (``done`` when eager Celery ran it all).

    Raises:
        ApplicationError: ``invalid`` (400) for a threshold outside (0, 1].
    """
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ApplicationError(f"threshold must be in (0, 1], got {threshold}", code="invalid",
                               extra={"fields": ["threshold"]})
    model_id = spaces.active().model_id
    run = uuid.uuid4().hex
    with transaction.atomic():
        scan, _ = DuplicateScan.objects.select_for_update().get_or_create(owner=owner, model_id=model_id)
        DuplicateEdge.objects.filter(scan=scan).delete()
        fields = dict(run=run, scanned=0, edges=0, groups=0, error="", finished_at=None, duration_s=None, query_s=0.0,
                      started_at=timezone.now())
        if threshold is None:
            fields.update(state=ScanState.CALIBRATING, threshold=None, calibration={})
        else:
            fields.update(state=ScanState.SCANNING, threshold=float(threshold), calibration={"source": "given"})
        DuplicateScan.objects.filter(pk=scan.pk).update(**fields)
    if threshold is None:
        picks = calibration.calibration_sample(owner.id, model_id)
        send_step("duplicates_calibration_embed", scan.pk, run, model_id, picks, model=True)
    else:
        send_step("duplicates_scan_slice", scan.pk, run, None)
    return DuplicateScan.objects.get(pk=scan.pk)


def scan_slice(*, scan_id: int, run: str, offset: str | None) -> dict:
    """One slice of a scan (vectors worker): the neighbours of ``DUPLICATES_SCAN_SLICE`` of the
    owner's points from ``offset`` (a point id; None: the first), saved as edges; then the next
    slice, or :func:`scan_finish`. Returns ``{"points", "edges"}`` of this slice."""
    scan = DuplicateScan.objects.filter(pk=scan_id, run=run).first()
    if scan is None or scan.state != ScanState.SCANNING:
        return {"points": 0, "edges": 0}
    store = runtime.vector_store(scan.model_id)
    points, nxt = store.page(limit=max(1, settings.DUPLICATES_SCAN_SLICE),
                             offset=uuid.UUID(offset) if offset else None, owner_id=scan.owner_id)
    queries = [(p.id, p.vector) for p in points if screen.usable(p.vector)]
    t0 = time.perf_counter()
    edges = duplicates.edges_of(store, queries, threshold=scan.threshold, owner_id=scan.owner_id)
    query_s = time.perf_counter() - t0
    DuplicateEdge.objects.bulk_create([DuplicateEdge(scan_id=scan_id, a=a, b=b, score=s) for a, b, s in edges],
                                      batch_size=1000)
    DuplicateScan.objects.filter(pk=scan_id, run=run).update(scanned=F("scanned") + len(points),
                                                             edges=F("edges") + len(edges),
                                                             query_s=F("query_s") + query_s)
    if nxt is not None:
        send_step("duplicates_scan_slice", scan_id, run, str(nxt))
    else:
        scan_finish(scan_id=scan_id, run=run)
    return {"points": len(points), "edges": len(edges)}


def scan_finish(*, scan_id: int, run: str) -> dict:
    """Build the scan's groups from its edges and replace the owner's open groups (vectors worker).
    Returns :func:`groups.replace`'s counts for ``near`` and ``exact``."""
    scan = DuplicateScan.objects.filter(pk=scan_id, run=run).first()
    if scan is None:
        return {}
    edges = list(DuplicateEdge.objects.filter(scan_id=scan_id).values_list("a", "b", "score"))
    found = _regroup(scan, edges)
    out = {"near": group_rows.replace(scan.owner_id, scan.model_id, DuplicateKind.NEAR, found, threshold=scan.threshold),
           "exact": group_rows.replace(scan.owner_id, scan.model_id, DuplicateKind.EXACT,
                                       group_rows.exact_rows(scan.owner_id), threshold=1.0)}
    DuplicateEdge.objects.filter(scan_id=scan_id).delete()
    now = timezone.now()
    DuplicateScan.objects.filter(pk=scan_id, run=run).update(
        state=ScanState.DONE, finished_at=now, duration_s=round((now - scan.started_at).total_seconds(), 3),
        groups=len(found), exact_checked_at=now)
    _scans_seen.pop(scan.model_id, None)
    return out


def refresh_exact(scan: DuplicateScan | None) -> None:
    """Regroup the owner's exact copies from the database when the last regrouping is older than
    :data:`EXACT_REFRESH_S` (called when groups are read). Another upload of the same bytes is
    skipped without a point write, by several paths (an upload, a catalogue's fetch, a job's
    read), so exact groups follow the rows here instead of a hook in each."""
    if scan is None or scan.state != ScanState.DONE:
        return
    now = timezone.now()
    if scan.exact_checked_at and (now - scan.exact_checked_at).total_seconds() < EXACT_REFRESH_S:
        return
    if DuplicateScan.objects.filter(pk=scan.pk, exact_checked_at=scan.exact_checked_at).update(exact_checked_at=now):
        group_rows.replace(scan.owner_id, scan.model_id, DuplicateKind.EXACT, group_rows.exact_rows(scan.owner_id),
                           threshold=1.0)


def _regroup(scan: DuplicateScan, edges: list) -> list[list[dict]]:
    """Member rows of the groups of ``edges`` (each found at the scan's threshold), the owner's
    "not duplicates" pairs kept apart."""
    found = duplicates.group(edges, dismissed=group_rows.dismissed_points(scan.owner_id, scan.model_id))
    return group_rows.near_rows(scan.owner_id, scan.model_id, found)


def images_written(items: list[dict]) -> None:
    """Points just marked embedded (``services.queues``' items: ``id``, ``point_id``, ``model_id``): for
    each owner with a finished scan in their space, send :func:`scan_update` for them. Costs one
    query per space every :data:`_SCANS_CACHE_S` while no scan exists there."""
    if not items:
        return
    model_id = items[0].get("model_id") or runtime.model_id()
    now = time.monotonic()
    seen = _scans_seen.get(model_id)
    if seen is None or now - seen[0] > _SCANS_CACHE_S:
        seen = (now, DuplicateScan.objects.filter(model_id=model_id, state=ScanState.DONE).exists())
        _scans_seen[model_id] = seen
    if not seen[1]:
        return
    owners = dict(Image.objects.filter(id__in=[it["id"] for it in items]).values_list("id", "owner_id"))
    scans = dict(DuplicateScan.objects.filter(model_id=model_id, state=ScanState.DONE,
                                              owner_id__in=set(owners.values())).values_list("owner_id", "pk"))
    by_scan: dict[int, list[str]] = {}
    for it in items:
        owner = owners.get(uuid.UUID(str(it["id"])))
        if owner in scans:
            by_scan.setdefault(scans[owner], []).append(str(it["point_id"]))
    for scan_id, pids in by_scan.items():
        send_step("duplicates_update", scan_id, sorted(set(pids)))


def scan_update(*, scan_id: int, point_ids: list[str]) -> dict:
    """Group new points into a finished scan (vectors worker): their neighbours above its threshold
    (the store's batched queries), then the new points, their neighbours and every member of the
    open near groups those touch regrouped together on their cosines to each other
    (``workers.duplicates.links_within``); only those groups are replaced. Exact groups follow the
    rows when groups are read (:func:`refresh_exact`), whichever path made the copy.

    Returns:
        ``{"edges", "regrouped" (points), "near": counts}``.
    """
    scan = DuplicateScan.objects.filter(pk=scan_id, state=ScanState.DONE).first()
    if scan is None or not point_ids:
        return {}
    store = runtime.vector_store(scan.model_id)
    found = store.vectors([uuid.UUID(p) for p in point_ids])
    edges = duplicates.edges_of(store, list(found.items()), threshold=scan.threshold, owner_id=scan.owner_id)
    linked = {p for a, b, _ in edges for p in (a, b)}
    members = list(DuplicateMember.objects.filter(group__owner_id=scan.owner_id, group__model_id=scan.model_id,
                                                  group__kind=DuplicateKind.NEAR, group__status=GroupStatus.OPEN)
                   .filter(group__in=DuplicateMember.objects.filter(point_id__in=list(linked)).values("group_id"))
                   .values_list("group_id", "point_id", "image_id"))
    # the new points, their neighbours and the members of the groups they touch, regrouped together
    # on their cosines to each other (tens of points)
    nodes = linked | {pid for _, pid, _ in members if pid}
    vectors = {**found, **store.vectors(sorted(nodes - set(found), key=str))}
    rows = _regroup(scan, duplicates.links_within({p: v for p, v in vectors.items() if p in nodes}, scan.threshold))
    touching = {image_id for _, _, image_id in members} | {r["image_id"] for g in rows for r in g}
    near = group_rows.replace(scan.owner_id, scan.model_id, DuplicateKind.NEAR, rows, threshold=scan.threshold,
                              touching=touching)
    return {"edges": len(edges), "regrouped": len(nodes), "near": near}
