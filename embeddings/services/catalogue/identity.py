"""The caller's ids and attributes on images (issue 41): ``external_id`` (a SKU) and ``metadata``.

An ``external_id`` names one of the owner's images (the users' rows; the database holds it:
``image_one_external_id``). A row that arrives with an id some other row holds *claims* it
(``claimed_external_id``) and settles the claim once its bytes are known (:func:`claims_settle`:
at once for an upload, after the fetch for a URL or an object), so a URL that cannot be fetched
never takes the id from the image that has it:

- the same bytes (the new row is a skipped duplicate): the holder keeps the id and its vector and
  takes the new row's metadata;
- other bytes, or a holder that never embedded: the holder is deleted (its vector with it, through
  ``images.image_deleted``) and the new row takes the id.

Metadata lives in the database and in the payload of the point (``payloads.point_payloads``: one item
per image the point stands for); :func:`image_update` changes either without re-embedding (metadata
as a JSON Merge Patch of the stored object) and has the points' payloads recomputed.
"""
from __future__ import annotations

from typing import Iterable

from django.conf import settings
from django.db import IntegrityError, transaction

from embeddings import dispatch, sink, spaces
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus
from embeddings.services.catalogue.metadata import (
    MetadataError,
    check_declared,
    merge_patch,
    validate_external_id,
    validate_metadata,
)


def claims_settle(rows: Iterable[Image]) -> list[Image]:
    """Settle the external-id claims of ``rows`` (in memory, saved or not), inside the caller's
    transaction: each row with a ``claimed_external_id`` and known bytes (``sha256`` set) ends
    holding the id or, as a skipped duplicate of the holder's bytes, leaving it to the holder.
    A row that failed keeps its claim unsettled (the holder is untouched). Holders to replace are
    deleted here (a queryset delete: their points are forgotten after commit, in the background).

    Returns:
        The holders whose metadata changed (their points' payloads must be recomputed after commit).
    """
    changed = []
    for row in rows:
        claim = row.claimed_external_id
        if not claim or not row.sha256 or row.status == ImageStatus.FAILED:
            continue
        holder = (Image.objects.select_for_update().filter(owner_id=row.owner_id, external_id=claim,
                                                            source__isnull=True).exclude(id=row.id).first())
        if holder is not None and holder.sha256 == row.sha256 and row.status == ImageStatus.SKIPPED:
            if holder.metadata != row.metadata:
                Image.objects.filter(id=holder.id).update(metadata=row.metadata)
                holder.metadata = row.metadata
                changed.append(holder)
            row.reason_detail = f"same bytes as image {holder.id}, which keeps external_id {claim!r}"
        else:
            if holder is not None:
                Image.objects.filter(id=holder.id).delete()
            row.external_id = claim
        row.claimed_external_id = ""
    return changed


def points_of(images: Iterable[Image]) -> list[tuple[str, str, str]]:
    """``(point id, sha256, model_id)`` of every point whose payload names ``images``: each embedded
    one's own point and its embedded copies' in other embedding spaces."""
    ids = [im.id for im in images if im.status == ImageStatus.EMBEDDED]
    if not ids:
        return []
    rows = Image.objects.filter(status=ImageStatus.EMBEDDED, point_id__isnull=False).filter(
        id__in=ids).values_list("point_id", "sha256", "model_id")
    copies = Image.objects.filter(status=ImageStatus.EMBEDDED, source_id__in=ids).values_list(
        "point_id", "sha256", "model_id")
    return sorted({(str(p), s, m) for p, s, m in [*rows, *copies]})


def payloads_refresh(images: Iterable[Image], *, wait: bool) -> None:
    """Have the payloads of ``images``' points recomputed from the database (``forget_point``
    recomputes a point's payload, or deletes it when no row holds it any more).

    Args:
        wait: run it now and wait (a caller's PATCH, whose next search must see it: 503 when the
            vectors worker does not answer), else queue it at background priority.

    Raises:
        ApplicationError: (``wait``) 503 when the store does not answer. The database holds the
            change by then, so the refreshes not done are queued first (``forget_point`` at
            background priority, no deadline): the payloads follow once the vectors worker is
            back, whether or not the caller sends the PATCH again.
    """

    points = points_of(images)
    for n, (pid, sha, model_id) in enumerate(points):
        if not wait:
            sink.store_send("forget_point", pid, sha, model_id, interactive=False)
            continue
        try:
            sink.store_call("forget_point", pid, sha, model_id)
        except ApplicationError:
            for left in points[n:]:
                try:
                    dispatch.send_forget_point(point_id=left[0], sha256=left[1], interactive=False, model_id=left[2])
                except Exception:  # noqa: BLE001 - the broker is down too: the caller's 503 says so
                    break
            raise


def image_update(*, image: Image, fields: dict) -> Image:
    """``PATCH /api/images/{id}/``: change ``external_id`` and/or ``metadata`` of a user's image
    without re-embedding; the payloads of its points follow before this returns.

    Args:
        fields: ``external_id`` (``""`` or ``None`` removes it) and/or ``metadata``: a JSON Merge
            Patch (RFC 7396, :func:`metadata.merge_patch`) of the stored object: given keys change,
            a ``None`` value removes its key, nested objects merge, keys not given stay;
            ``metadata`` ``None`` removes every key. The merged object is checked whole
            (``validate_metadata``, ``check_declared``), read and written in one transaction with
            the row locked, so two PATCHes of different keys both stay.

    Raises:
        ApplicationError: ``external_id_invalid`` / ``metadata_invalid`` / ``metadata_too_large`` /
            ``metadata_too_deep`` (400); ``not_found`` (404) when the row was deleted meanwhile;
            ``external_id_taken`` (409) when another of the owner's images holds the id;
            ``vectors_unavailable`` (503) when the payload cannot be written.
    """

    try:
        with transaction.atomic():
            updates = _updates(image, fields)
            if updates:
                Image.objects.filter(id=image.id).update(**updates)
    except IntegrityError as e:
        holder = Image.objects.filter(owner_id=image.owner_id, external_id=fields.get("external_id"),
                                      source__isnull=True).values_list("id", flat=True).first()
        raise ApplicationError(f"external_id {fields.get('external_id')!r} names another of your images",
                               code="external_id_taken", status=409,
                               extra={"image_id": str(holder) if holder else None}) from e
    if not updates:
        return image
    try:
        image.refresh_from_db()
    except Image.DoesNotExist:  # deleted since the request found it: nothing was changed
        raise ApplicationError("no such image", code="not_found", status=404) from None
    payloads_refresh([image], wait=True)
    return image


def _updates(image: Image, fields: dict) -> dict:
    """The columns a PATCH changes, checked; the row's metadata read locked (inside the caller's
    transaction) and merged with the patch. Raises ``ApplicationError`` as :func:`image_update`."""
    updates = {}
    try:
        if "external_id" in fields:
            value = fields["external_id"]
            updates["external_id"] = "" if value in (None, "") else validate_external_id(value)
        if "metadata" in fields:
            stored = Image.objects.select_for_update().filter(id=image.id).values_list("metadata", flat=True).first()
            merged = merge_patch(stored or {}, fields["metadata"]) if fields["metadata"] is not None else {}
            updates["metadata"] = check_declared(
                validate_metadata(merged, max_bytes=settings.METADATA_MAX_BYTES), spaces.declared_fields())
    except MetadataError as e:
        raise ApplicationError(e.message, code=e.code, extra={"field": "external_id" if "external_id" in e.code
                                                              else "metadata"}) from e
    return updates
