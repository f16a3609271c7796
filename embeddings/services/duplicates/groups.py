"""The groups as rows: which of an owner's images a point stands for, the "not duplicates" pairs
in a space's point ids, exact copies from the database, and replacing a scan's open groups.

A near group is built on points (``workers.duplicates``); each point becomes the owner's oldest
embedded image of those bytes (its other uploads of the same bytes are an *exact* group of their
own, kept apart). An image embedded in an earlier space is found through the copy a migration
made of it (``Image.source``).
"""
from __future__ import annotations

import uuid
from typing import Iterable

from django.db import transaction
from django.db.models import Count

from embeddings.models import (DuplicateGroup, DuplicateMember, GroupStatus, Image, ImageStatus,
                               NotDuplicate)
from workers import duplicates
from workers.ids import point_id


def images_of_points(owner_id: int, model_id: str, point_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, dict]:
    """The owner's image each point of space ``model_id`` stands for: ``{point id: {"image_id",
    "sha256"}}`` (the oldest embedded user row with that point, or the user row a migration copy
    with that point was made from); points with no such image (another owner's, deleted) are absent."""
    pids = list(point_ids)
    out: dict[uuid.UUID, dict] = {}
    for step in range(0, len(pids), 1000):  # SQLite's bound-parameter limit
        rows = (Image.objects.filter(owner_id=owner_id, point_id__in=pids[step:step + 1000], status=ImageStatus.EMBEDDED)
                .order_by("created_at").values_list("point_id", "id", "source_id", "sha256"))
        for pid, image_id, source_id, sha in rows:
            out.setdefault(pid, {"image_id": source_id or image_id, "sha256": sha})
    return out


def dismissed_points(owner_id: int, model_id: str) -> set[frozenset]:
    """The owner's "not duplicates" pairs as pairs of space ``model_id``'s point ids
    (``workers.duplicates.pair``)."""
    return {duplicates.pair(point_id(a, model_id), point_id(b, model_id))
            for a, b in NotDuplicate.objects.filter(owner_id=owner_id).values_list("sha_a", "sha_b")}


def remember_not_duplicates(owner_id: int, shas: Iterable[str]) -> None:
    """Record every pair of ``shas`` as "not duplicates" for the owner (pairs already there kept)."""
    distinct = sorted(set(s for s in shas if s))
    NotDuplicate.objects.bulk_create([NotDuplicate(owner_id=owner_id, sha_a=a, sha_b=b)
                                      for i, a in enumerate(distinct) for b in distinct[i + 1:]],
                                     ignore_conflicts=True)


def near_rows(owner_id: int, model_id: str, groups: list[duplicates.Group]) -> list[list[dict]]:
    """Member rows of point groups: ``[[{"image_id", "point_id", "score", "representative"}]]``,
    points without an image of the owner dropped, groups left with fewer than two dropped."""
    images = images_of_points(owner_id, model_id, [pid for g in groups for pid, _ in g.members])
    out = []
    for g in groups:
        rows = [{"image_id": images[pid]["image_id"], "point_id": pid, "score": round(score, 6),
                 "representative": pid == g.representative}
                for pid, score in g.members if pid in images]
        if len(rows) > 1:
            out.append(rows)
    return out


def exact_rows(owner_id: int) -> list[list[dict]]:
    """The owner's exact copies: user rows (not migration copies) sharing bytes, embedded or skipped
    as another upload of them, ``[[{"image_id", "point_id", "score": 1.0, "representative"}]]``,
    the oldest upload the representative."""
    rows = Image.objects.filter(owner_id=owner_id, source__isnull=True,
                                status__in=(ImageStatus.EMBEDDED, ImageStatus.SKIPPED)).exclude(sha256="")
    repeated = rows.values("sha256").annotate(n=Count("id")).filter(n__gt=1).values_list("sha256", flat=True)
    by_sha: dict[str, list] = {}
    for image_id, sha, pid in rows.filter(sha256__in=repeated).order_by("created_at").values_list("id", "sha256",
                                                                                                  "point_id"):
        by_sha.setdefault(sha, []).append({"image_id": image_id, "point_id": pid, "score": 1.0,
                                           "representative": not by_sha.get(sha)})
    return [by_sha[s] for s in sorted(by_sha)]


def replace(owner_id: int, model_id: str, kind: str, found: list[list[dict]], *, threshold: float,
            touching: set | None = None) -> dict:
    """Make the owner's open groups of ``kind`` in the space those of ``found`` (member rows, as
    :func:`near_rows` / :func:`exact_rows`): an open group with the same members is kept as it is
    (its id stays), other open groups are deleted, new ones created. Reviewed groups (resolved,
    dismissed) are never touched. ``touching``: only open groups with a member image in it are
    candidates for deletion (an incremental update leaves the rest alone). ``threshold``: the
    groups' (1.0 for exact copies).

    Returns:
        ``{"kept", "created", "deleted"}`` counts.
    """
    wanted = {frozenset(r["image_id"] for r in rows): rows for rows in found}
    with transaction.atomic():
        open_groups = DuplicateGroup.objects.filter(owner_id=owner_id, model_id=model_id, kind=kind,
                                                    status=GroupStatus.OPEN)
        if touching is not None:
            open_groups = open_groups.filter(members__image_id__in=list(touching)).distinct()
        current: dict[uuid.UUID, set] = {}
        for gid, image_id in DuplicateMember.objects.filter(group__in=open_groups).values_list("group_id", "image_id"):
            current.setdefault(gid, set()).add(image_id)
        by_members = {frozenset(m): gid for gid, m in current.items()}
        stale = [gid for m, gid in by_members.items() if m not in wanted]
        DuplicateGroup.objects.filter(id__in=stale).delete()
        new = {key: DuplicateGroup(owner_id=owner_id, model_id=model_id, kind=kind, threshold=threshold)
               for key in wanted if key not in by_members}  # ids are made here (uuid4): one INSERT for all
        DuplicateGroup.objects.bulk_create(new.values(), batch_size=1000)
        DuplicateMember.objects.bulk_create(
            [DuplicateMember(group=g, image_id=r["image_id"], point_id=r["point_id"], score=r["score"],
                             representative=r["representative"]) for key, g in new.items() for r in wanted[key]],
            batch_size=1000)
    return {"kept": len(wanted) - len(new), "created": len(new), "deleted": len(stale)}
