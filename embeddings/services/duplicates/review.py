"""What people do with duplicate groups: read them, keep one image and delete the rest, or say
"not duplicates" (remembered by bytes: the pairs never group again, in any space or re-scan).

Every function takes the caller and sees only their groups (staff: everyone's), a group of
another user being ``not_found`` (404) as everywhere.
"""
from __future__ import annotations

from django.db import transaction
from django.db.models import Count, Prefetch, QuerySet
from django.utils import timezone

from embeddings import spaces
from embeddings.errors import ApplicationError
from embeddings.models import (DuplicateGroup, DuplicateKind, DuplicateMember, DuplicateScan, GroupStatus, Image)
from embeddings.services.catalogue.images import images_delete
from embeddings.services.duplicates import groups as group_rows
from embeddings.services.duplicates import scan as scans


def groups_visible_to(user, *, model_id: str | None = None, kind: str | None = None,
                      status: str | None = GroupStatus.OPEN) -> QuerySet[DuplicateGroup]:
    """The caller's groups in space ``model_id`` (None: the active one), of ``kind`` and ``status``
    when given (default: open ones), largest first then newest; members (with their images) prefetched.
    A request that lists groups calls :func:`refresh` once first."""
    qs = DuplicateGroup.objects.filter(model_id=model_id or spaces.active().model_id)
    if not user.is_staff:
        qs = qs.filter(owner=user)
    if kind:
        qs = qs.filter(kind=kind)
    if status:
        qs = qs.filter(status=status)
    members = DuplicateMember.objects.select_related("image").order_by("-representative", "-score", "image__created_at")
    # an open group whose other images were deleted meanwhile is no longer a group
    return (qs.annotate(size=Count("members")).exclude(status=GroupStatus.OPEN, size__lt=2)
            .order_by("-size", "-created_at", "id")
            .prefetch_related(Prefetch("members", queryset=members)))


def refresh(user, model_id: str | None = None) -> None:
    """Regroup the caller's exact copies in space ``model_id`` (None: the active one) when due
    (``scan.refresh_exact``): once per request that lists groups."""
    scans.refresh_exact(scan_of(user, model_id))


def group_of(user, group_id) -> DuplicateGroup:
    """One of the caller's groups.

    Raises:
        ApplicationError: ``not_found`` (404): no such group, or another user's.
    """
    qs = DuplicateGroup.objects.filter(id=group_id)
    if not user.is_staff:
        qs = qs.filter(owner=user)
    group = qs.prefetch_related(Prefetch("members", queryset=DuplicateMember.objects.select_related("image")
                                         .order_by("-representative", "-score"))).first()
    if group is None:
        raise ApplicationError("no such duplicate group", code="not_found", status=404)
    return group


def scan_of(user, model_id: str | None = None) -> DuplicateScan | None:
    """The caller's scan in space ``model_id`` (None: the active one), or None before the first."""
    return DuplicateScan.objects.filter(owner=user, model_id=model_id or spaces.active().model_id).first()


def _open(group: DuplicateGroup) -> None:
    if group.status != GroupStatus.OPEN:
        raise ApplicationError(f"this group was already reviewed ({group.status})", code="already_reviewed",
                               status=409, extra={"status": group.status})


def keep_one(user, group_id, image_id) -> DuplicateGroup:
    """Keep ``image_id`` and delete the group's other images (their vectors, blobs and thumbnails go
    as with any delete); the group is ``resolved`` with ``kept`` set.

    Raises:
        ApplicationError: ``not_found`` (404: the group), ``not_a_member`` (409: the image is not in
            the group), ``already_reviewed`` (409: the group is not open).
    """
    with transaction.atomic():
        group = group_of(user, group_id)
        _open(group)
        ids = {str(m.image_id) for m in group.members.all()}
        if str(image_id) not in ids:
            raise ApplicationError("the image to keep is not a member of this group", code="not_a_member",
                                   status=409, extra={"fields": ["image_id"]})
        DuplicateGroup.objects.filter(id=group.id).update(status=GroupStatus.RESOLVED, kept_id=image_id,
                                                          reviewed_at=timezone.now())
        # the deleted images leave every other open group too (their member rows cascade)
        images_delete(images=Image.objects.filter(id__in=ids - {str(image_id)}, owner_id=group.owner_id))
    return group_of(user, group_id)


def not_duplicates(user, group_id) -> DuplicateGroup:
    """Mark a near group "not duplicates": every pair of its images' bytes is remembered for the
    owner, so no scan or update groups them again; the group is ``dismissed``.

    Raises:
        ApplicationError: ``not_found`` (404), ``already_reviewed`` (409), ``exact_copies`` (409: an
            exact group's images are the same bytes; keep one instead).
    """
    with transaction.atomic():
        group = group_of(user, group_id)
        _open(group)
        if group.kind == DuplicateKind.EXACT:
            raise ApplicationError("these images are the same bytes: keep one instead", code="exact_copies",
                                   status=409)
        group_rows.remember_not_duplicates(group.owner_id, [m.image.sha256 for m in group.members.all()])
        DuplicateGroup.objects.filter(id=group.id).update(status=GroupStatus.DISMISSED, reviewed_at=timezone.now())
    return group_of(user, group_id)
