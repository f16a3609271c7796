"""Image services: create rows from sources (store bytes, dedupe, refuse obvious non-images), record
outcomes, delete. The database is the source of truth for every image's state."""
from __future__ import annotations

import datetime as dt
import hashlib
import logging
import uuid
from typing import Iterable, Sequence

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from embeddings import dispatch, runtime, sink, spaces
from embeddings.lookups import pg_array
from embeddings.models import (
    LIVE_ORIGINAL_STATUSES,
    Image,
    ImageStatus,
    Job,
    JobStatus,
    Lane,
)
from embeddings.services.catalogue import copies
from embeddings.services.catalogue.identity import claims_settle, payloads_refresh
from embeddings.services.catalogue.sources import SourceFile, iter_blocks
from embeddings.services.usage import meter as usage_meter
from embeddings.storage import file_key, preview_delete, thumbnail_delete
from workers.decode import sniff_format
from workers.errors import ImageRejected, Reason
from workers.ids import point_id

log = logging.getLogger(__name__)

#: Bytes read to sniff the format before storing (magic numbers sit in the first 32 bytes).
_SNIFF_BYTES = 64


def _store(source: SourceFile) -> tuple[str, str, int, bytes]:
    """Store (or hash in place) one source → ``(storage key, sha256, size, first bytes)``.

    A source larger than ``max_image_bytes`` is hashed but not stored (key ``""``): it is refused
    ``too_large`` anyway, and must not fill the disk first.

    Raises:
        ImageRejected: the source cannot be read (a damaged zip entry).
    """
    if source.in_place is None and source.size > settings.PIPELINE.max_image_bytes:
        h, size, f = hashlib.sha256(), 0, source.open()
        for block in iter_blocks(f):
            h.update(block)
            size += len(block)
        return "", h.hexdigest(), size, b""
    f = source.open()
    head = b""

    def blocks():
        nonlocal head
        for block in iter_blocks(f):
            if len(head) < _SNIFF_BYTES:
                head += block[: _SNIFF_BYTES - len(head)]
            yield block

    try:
        if source.in_place is not None:
            h, size = hashlib.sha256(), 0
            for block in blocks():
                h.update(block)
                size += len(block)
            return file_key(source.in_place), h.hexdigest(), size, head
        key, sha, size = runtime.blob_store().put(blocks())
        return key, sha, size, head
    finally:
        if source.in_place is not None:
            f.close()


def quick_check(head: bytes, size: int) -> ImageRejected | None:
    """Refusals that need no decoding: ``empty``, ``too_large``, ``not_an_image`` (by content)."""
    if size == 0:
        return ImageRejected(Reason.EMPTY, "the file has zero bytes")
    if size > settings.PIPELINE.max_image_bytes:
        return ImageRejected(Reason.TOO_LARGE, f"{size} bytes > limit {settings.PIPELINE.max_image_bytes} bytes")
    if sniff_format(head) is None:
        return ImageRejected(Reason.NOT_AN_IMAGE, "content matches no known image format")
    return None


def images_create(
    *,
    owner,
    sources: Iterable[SourceFile],
    lane: str,
    job: Job | None = None,
    deadline: dt.datetime | None = None,
    key_prefix: str = "",
) -> list[Image]:
    """Store each source and create its :class:`Image` row, in input order; ``key_prefix``: the
    API key of the request (``usage.keys.key_prefix_of``; a job's rows take the job's).

    - Obvious non-images (empty, too large, unknown magic bytes) are created ``failed`` with the
      reason and never queued.
    - Bytes this owner already has queued or embedded under the same model are created ``skipped``
      with ``duplicate_of`` (also within the same request), carrying the original's width, height
      and format (empty until the original is embedded: :func:`images_mark_embedded` fills them).
    - Everything else is ``queued``; the caller dispatches it after the transaction commits.

    The skipped duplicates are metered in the creating transaction (``usage.meter.duplicates_skipped``).

    The database decides who is the original (constraint ``image_one_original``), not a look-up:
    a row that loses a concurrent insert of the same bytes (another request, another process)
    becomes a ``skipped`` duplicate of the winner (:func:`_insert_originals`).
    """
    model_id = runtime.model_id()
    stored, unreadable = [], {}
    for src in sources:
        try:
            stored.append((src, *_store(src)))
        except ImageRejected as e:  # bad input is data: this file fails alone, with its reason
            sha = hashlib.sha256(f"unreadable:{src.name}".encode()).hexdigest()
            unreadable[len(stored)] = e
            stored.append((src, "", sha, src.size, b""))
    for attempt in range(3):
        try:
            rows, changed = _create_rows(owner=owner, job=job, lane=lane, deadline=deadline, model_id=model_id,
                                         stored=stored, unreadable=unreadable,
                                         key_prefix=key_prefix or (job.key_prefix if job is not None else ""))
            break
        except IntegrityError as e:
            # another request took one of these external ids between our look-up and our insert:
            # made again, the id is then a claim on that holder (identity.claims_settle)
            if "external_id" not in str(e) or attempt == 2:
                raise
    if changed:
        transaction.on_commit(lambda: payloads_refresh(changed, wait=False))
    return rows


def _create_rows(*, owner, job, lane, deadline, model_id, stored, unreadable,
                 key_prefix: str) -> tuple[list[Image], list[Image]]:
    """The rows of :func:`images_create` for its stored sources, decided and written in one
    transaction → ``(rows, holders of an external id whose metadata changed)``."""
    rows: list[Image] = []
    with transaction.atomic():
        # A deletion may have removed a blob we found already stored, before our rows name it:
        # under the bytes' lock (the one _forget deletes under) store it again where it is missing.
        lock_bytes(sha for _, key, sha, _, _ in stored if key.startswith("blob/"))
        for src, key, sha, _, _ in stored:
            if key.startswith("blob/") and not runtime.blob_store().exists(key):
                _store(src)
        # Locked until commit: a concurrent delete of an original waits, then sees these duplicates.
        existing = {
            im.sha256: im
            for im in Image.objects.select_for_update().filter(
                owner=owner, model_id=model_id, sha256__in={s[2] for s in stored},
                status__in=LIVE_ORIGINAL_STATUSES, duplicate_of__isnull=True,
            )
        }
        seen: dict[str, Image] = {}
        for n, (src, key, sha, size, head) in enumerate(stored):
            im = Image(
                owner=owner, job=job, lane=lane, sha256=sha, size_bytes=size, storage_key=key,
                original_name=src.name[:255], model_id=model_id, point_id=point_id(sha, model_id),
                deadline=deadline, claimed_external_id=src.external_id or "", metadata=src.metadata or {},
                key_prefix=key_prefix,
            )
            rejected = unreadable.get(n) or quick_check(head, size)
            original = seen.get(sha) or existing.get(sha)
            if rejected is not None:
                im.status, im.reason, im.reason_detail = ImageStatus.FAILED, rejected.reason.value, rejected.detail
            elif original is not None:
                make_duplicate(im, original)
            else:
                seen[sha] = im
            rows.append(im)
        changed = claims_settle(rows)  # the caller's ids: kept by the same bytes, replaced by others
        _insert_originals(list(seen.values()))
        for im in rows:  # in-request duplicates of a row that lost its insert follow it to the winner
            if im.status == ImageStatus.SKIPPED and im.duplicate_of.duplicate_of_id is not None:
                make_duplicate(im, im.duplicate_of.duplicate_of)
        Image.objects.bulk_create([im for im in rows if im.status != ImageStatus.QUEUED and im._state.adding],
                                  batch_size=500)
        dual_copies([im for im in rows if im.status == ImageStatus.QUEUED and im.duplicate_of_id is None])
        usage_meter.duplicates_skipped(rows)
    return rows, changed


def dual_copies(originals: list[Image]) -> None:
    """During a migration, and while a standby space exists (``spaces.dual_targets``): a copy of
    each new original in every such space, in the creating transaction, queued on the bulk lane
    at background priority after commit (``copies.dual_embed``): the interactive answer never
    waits for it, and a rollback or a promotion loses no upload."""
    if not originals:
        return

    for space in spaces.dual_targets():
        copies.dual_embed(space=space, originals=originals)


def lock_bytes(shas: Iterable[str]) -> None:
    """Serialise, per sha256, "rows come to name this blob" (:func:`images_create` committing) with
    "no row names this blob: delete it" (:func:`_forget`), so a blob is never deleted under an
    upload of the same bytes. PostgreSQL: transaction-level advisory locks, taken in sha order (no
    deadlock); SQLite: every write transaction is exclusive already (``BEGIN IMMEDIATE``)."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for sha in sorted(set(shas)):
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [int(sha[:15], 16)])  # 60 bits: a bigint


def make_duplicate(im: Image, original: Image) -> None:
    """Turn an unsaved row into a ``skipped`` duplicate of ``original`` with its facts."""
    im.status, im.duplicate_of, im.reason, im.reason_detail = ImageStatus.SKIPPED, original, "", ""
    im.width, im.height, im.format = original.width, original.height, original.format


def _insert_originals(candidates: list[Image]) -> None:
    """Insert rows meant to be originals; a row whose bytes already have an original (another
    request committed first) becomes a ``skipped`` duplicate of that winner instead.

    One ``INSERT`` for all when nothing conflicts; otherwise one savepoint per row. Rows go in
    sha256 order, so two requests sharing several files lock the index entries in the same order
    (no deadlock on PostgreSQL, where the second insert waits for the first transaction).
    """
    candidates = sorted(candidates, key=lambda im: im.sha256)
    try:
        with transaction.atomic():
            Image.objects.bulk_create(candidates, batch_size=500)
        return
    except IntegrityError:
        for im in candidates:
            im._state.adding = True
    for im in candidates:
        for _ in range(5):  # the winner may itself go (deleted) between our insert and our look-up
            try:
                with transaction.atomic():
                    im.save(force_insert=True)
                break
            except IntegrityError as e:
                if "external_id" in str(e):  # another request took the id: images_create makes the rows again
                    raise
                winner = Image.objects.select_for_update().filter(
                    owner_id=im.owner_id, model_id=im.model_id, sha256=im.sha256,
                    status__in=LIVE_ORIGINAL_STATUSES, duplicate_of__isnull=True,
                ).first()
                if winner is not None:
                    log.info("image %s: %s was inserted by another request first (image %s); skipped",
                             im.id, im.sha256[:12], winner.id)
                    make_duplicate(im, winner)
                    break
        else:
            raise IntegrityError(f"could not insert image {im.id}: its original kept changing")


def images_mark_failed(failures: Sequence[tuple[str, str, str]]) -> None:
    """Record ``(image id, reason code, detail)`` for images that will not be embedded.

    Images already embedded are left alone (a redelivered task must not undo a success). When an
    original leaves the queue this way its skipped duplicates follow (:func:`_original_gone`): the
    same bytes fail the same way; an expired or cancelled request takes its own duplicates along,
    and a copy uploaded separately takes the original's place. A user's row takes along its copies
    in other embedding spaces that are still queued (``source``: issue 13), so no space gets a point
    for an upload that ended without one.
    """
    for image_id, reason, detail in failures:
        status = {
            Reason.EXPIRED.value: ImageStatus.EXPIRED,
            Reason.CANCELLED.value: ImageStatus.CANCELLED,
        }.get(reason, ImageStatus.FAILED)
        with transaction.atomic():
            was = Image.objects.select_for_update().filter(id=image_id).exclude(status=ImageStatus.EMBEDDED).first()
            if was is None or not Image.objects.filter(id=image_id).exclude(status=ImageStatus.EMBEDDED).update(
                status=status, reason=reason, reason_detail=detail[:2000]
            ):
                continue
            if was.status == ImageStatus.QUEUED and was.duplicate_of_id is None:
                _original_gone(was, status=status, reason=reason, detail=detail)
            if was.source_id is None:  # its copies in other spaces not embedded yet share the outcome
                Image.objects.filter(source_id=image_id, status=ImageStatus.QUEUED).update(
                    status=status, reason=reason, reason_detail=f"its upload {image_id} became {status}: {detail}"[:2000])


def _same_request(original: Image) -> Q:
    """Rows created with ``original`` by one request: its job, or (interactive) its deadline."""
    if original.job_id is not None:
        return Q(job_id=original.job_id)
    return Q(job__isnull=True, deadline=original.deadline)


def _original_gone(original: Image, *, status: str, reason: str, detail: str) -> None:
    """A queued original became ``status`` (failed, expired, cancelled): settle its duplicates.

    - ``failed``: every duplicate fails with the same reason (same bytes, same decoder).
    - ``expired`` / ``cancelled``: duplicates from the same request (job, or interactive deadline)
      share the outcome; the oldest other duplicate becomes the original (:func:`_settle`).
    """
    dups = Image.objects.filter(duplicate_of=original, status=ImageStatus.SKIPPED)
    if status == ImageStatus.FAILED:
        dups.update(status=ImageStatus.FAILED, reason=reason,
                    reason_detail=f"same bytes as image {original.id}: {detail}"[:2000])
        return
    dups.filter(_same_request(original)).update(
        status=status, reason=reason, reason_detail=f"with image {original.id}, whose bytes it shares: {detail}"[:2000])
    _settle(owner_id=original.owner_id, model_id=original.model_id, sha256=original.sha256, gone=original)


def _settle(*, owner_id, model_id: str, sha256: str, gone: Image) -> Image | None:
    """After ``gone``, the original of these bytes, left (deleted, expired, cancelled), give the
    owner's remaining skipped copies an original again, so each stays searchable.

    The oldest skipped copy becomes the original: ``embedded`` with ``gone``'s facts when ``gone``
    was embedded (the point is the same: uuid5(model, sha256)), else ``queued`` again on the bulk
    lane (:func:`_requeue`). The other copies point at it. When another original exists already
    (a concurrent upload won), the copies point at that one.

    Returns:
        The original the copies now point at, or None when no copy is left.
    """
    group = Image.objects.filter(owner_id=owner_id, model_id=model_id, sha256=sha256)
    for _ in range(5):
        original = group.select_for_update().filter(status__in=LIVE_ORIGINAL_STATUSES,
                                                    duplicate_of__isnull=True).first()
        copies = group.filter(status=ImageStatus.SKIPPED)
        if original is not None:
            copies.exclude(duplicate_of=original).update(duplicate_of=original)
            return original
        heir = copies.select_for_update().order_by("created_at", "id").first()
        if heir is None:
            return None
        try:
            with transaction.atomic():
                if gone.status == ImageStatus.EMBEDDED:
                    Image.objects.filter(id=heir.id).update(
                        status=ImageStatus.EMBEDDED, duplicate_of=None, reason="", reason_detail="",
                        width=gone.width, height=gone.height, format=gone.format,
                        embedded_at=gone.embedded_at or timezone.now())
                else:
                    _requeue(heir)
        except IntegrityError:
            continue  # another upload of these bytes became the original meanwhile: point at it
        copies.exclude(id=heir.id).update(duplicate_of=heir)
        return heir
    raise IntegrityError(f"could not settle the copies of {sha256}: their original kept changing")


#: Name of the job that takes a skipped copy queued again when it has no job, or a cancelled one.
REQUEUED_JOB = "re-queued copies"


def _requeue(heir: Image) -> None:
    """Queue a skipped copy as the original on the bulk lane: in its own job (reopened when done),
    or, with no job or a cancelled one, in the owner's open :data:`REQUEUED_JOB` job (created when
    none is open); dispatched on commit."""

    job = heir.job
    if job is None or job.status == JobStatus.CANCELLED:
        job = (Job.objects.filter(owner_id=heir.owner_id, name=REQUEUED_JOB, model_id=heir.model_id,
                                  status__in=(JobStatus.QUEUED, JobStatus.RUNNING)).first()
               or Job.objects.create(owner_id=heir.owner_id, name=REQUEUED_JOB, model_id=heir.model_id,
                                     chunk_size=settings.PIPELINE.batch_size))
        Job.objects.filter(id=job.id).update(total=F("total") + 1)
    elif job.status == JobStatus.DONE:
        Job.objects.filter(id=job.id).update(status=JobStatus.RUNNING, finished_at=None)
    Image.objects.filter(id=heir.id).update(
        status=ImageStatus.QUEUED, duplicate_of=None, lane=Lane.BULK, job=job, deadline=None, attempts=0,
        reason="", reason_detail="")
    transaction.on_commit(lambda: dispatch.send_job_chunks(job=job, image_ids=[str(heir.id)]))


#: What metering counts a marked row by (``usage.meter.images_embedded``), read by the mark itself.
METERED = ("owner", "key_prefix", "model_id", "lane", "source")


def _metered(values) -> tuple:
    """A marked row's :data:`METERED` values as ``(owner_id, key_prefix, model_id, lane, is a copy)``."""
    owner_id, key_prefix, model_id, lane, source_id = values
    return owner_id, key_prefix, model_id, lane, source_id is not None


def _update_per_row(*, key: str, rows: dict[str, tuple], status: str, sets: dict[str, object] | None = None,
                    returning: bool = False) -> int | set[str]:
    """One ``UPDATE`` giving each row its own ``(width, height, format)``: ``SET width = CASE key
    WHEN id THEN value ... ELSE width END, ...`` over the rows whose ``key`` (``id`` or
    ``duplicate_of``) is in ``rows`` and whose status is ``status``; ``sets`` adds plain columns.
    ``returning``: the same statement also names the rows it changed, with what metering counts them
    by (``RETURNING id, ...`` of :data:`METERED`: PostgreSQL, SQLite ≥ 3.35).

    Written as SQL because the ORM's ``Case(When(...))`` resolves every branch as an expression,
    which costs more than the statements it saves (measured: 0.45 s of Python per 64-image chunk).
    Values go through the fields' own ``get_db_prep_value`` (UUIDs are
    hex text on SQLite, ``uuid`` on PostgreSQL), so it runs on both backends.

    Returns:
        The number of rows updated; with ``returning``, ``{id: (owner_id, key_prefix, model_id, lane,
        is a copy)}`` of each.
    """
    meta = Image._meta
    qn = connection.ops.quote_name
    key_field = meta.get_field(key)
    if connection.vendor == "postgresql":
        return _update_per_row_arrays(key_field=key_field, ids=[str(i) for i in rows], facts=list(rows.values()),
                                      status=status, sets=sets, returning=returning)
    ids = [key_field.get_db_prep_value(uuid.UUID(i), connection) for i in rows]
    assignments, params = [], []
    for name, value in (sets or {}).items():
        field = meta.get_field(name)
        assignments.append(f"{qn(field.column)} = %s")
        params.append(field.get_db_prep_value(value, connection))
    for n, name in enumerate(("width", "height", "format")):
        col = qn(meta.get_field(name).column)
        assignments.append(f"{col} = CASE {qn(key_field.column)} " + " ".join(["WHEN %s THEN %s"] * len(ids))
                           + f" ELSE {col} END")
        for i, facts in zip(ids, rows.values()):
            params += [i, facts[n]]
    sql = (f"UPDATE {qn(meta.db_table)} SET {', '.join(assignments)} WHERE {qn(key_field.column)} IN "
           f"({', '.join(['%s'] * len(ids))}) AND {qn(meta.get_field('status').column)} = %s")
    if returning:
        sql += " RETURNING " + ", ".join(qn(meta.get_field(f).column) for f in ("id", *METERED))
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, *ids, status])
        if returning:  # hex text on SQLite, uuid on PostgreSQL
            return {str(meta.pk.to_python(r[0])): _metered(r[1:]) for r in cursor.fetchall()}
        return cursor.rowcount


def _update_per_row_arrays(*, key_field, ids: list[str], facts: list[tuple], status: str,
                           sets: dict[str, object] | None, returning: bool) -> int | set[str]:
    """:func:`_update_per_row` on PostgreSQL: the rows' values as four array parameters joined in
    (``UPDATE ... FROM unnest(ids, widths, heights, formats)``), so the statement's text and its
    parameter count stay the same whatever the number of rows: each array goes as one array
    literal (:func:`pg_array`, the ids as UUID text) and the server matches rows by a join instead
    of walking a ``CASE`` per row."""
    meta = Image._meta
    qn = connection.ops.quote_name
    table = qn(meta.db_table)
    assignments, params = [], []
    for name, value in (sets or {}).items():
        field = meta.get_field(name)
        assignments.append(f"{qn(field.column)} = %s")
        params.append(field.get_db_prep_value(value, connection))
    for name in ("width", "height", "format"):
        col = qn(meta.get_field(name).column)
        assignments.append(f"{col} = v.{name}")
    widths, heights, formats = ([f[n] for f in facts] for n in range(3))
    sql = (f"UPDATE {table} SET {', '.join(assignments)} FROM unnest(%s::uuid[], %s::integer[], %s::integer[], "
           f"%s::text[]) AS v(key, width, height, format) WHERE {table}.{qn(key_field.column)} = v.key "
           f"AND {table}.{qn(meta.get_field('status').column)} = %s")
    if returning:  # the id as text: the caller's key, without a UUID made and printed per row
        sql += (f" RETURNING {table}.{qn(meta.pk.column)}::text, "
                + ", ".join(f"{table}.{qn(meta.get_field(f).column)}" for f in METERED))
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, pg_array(ids), pg_array(widths), pg_array(heights), pg_array(formats), status])
        if returning:
            return {r[0]: _metered(r[1:]) for r in cursor.fetchall()}
        return cursor.rowcount


def images_mark_embedded(items: Sequence[dict], *, compute_s_each: float = 0.0) -> set[str]:
    """Mark images embedded after their points are written, each only if it is still ``queued``:
    a job cancelled (or an interactive request expired) while its vectors were being written keeps
    its decision. Their skipped duplicates get the same width, height and format.
    ``items``: ``{"id", "width", "height", "format"}`` dicts.

    The images marked are metered in the same transaction (``usage.meter.images_embedded``, with
    ``compute_s_each`` worker seconds each): what this call marks is counted once, and a later
    delivery of the same work marks, and counts, nothing.

    Two statements per call whatever its length (issue 11), in one transaction: one ``UPDATE ...
    WHERE status = 'queued' RETURNING id`` of the rows with per-row values (:func:`_update_per_row`),
    whose answer is exactly the rows it changed (on
    PostgreSQL a concurrent writer's row is re-checked after its lock is released; SQLite's
    ``IMMEDIATE`` transactions hold the write lock from ``BEGIN``), then one UPDATE of their skipped
    copies. A database without ``RETURNING`` (SQLite < 3.35) reads the queued rows first, locking
    them (``FOR UPDATE``): three statements.

    Returns:
        The ids marked embedded now.
    """
    facts = {str(it["id"]): (it["width"], it["height"], it["format"]) for it in items}
    if not facts:
        return set()
    sets = {"status": ImageStatus.EMBEDDED.value, "reason": "", "reason_detail": "", "embedded_at": timezone.now()}
    with transaction.atomic():
        if connection.features.can_return_columns_from_insert:  # the same SQLite versions have UPDATE ... RETURNING
            live = _update_per_row(key="id", rows=facts, status=ImageStatus.QUEUED, sets=sets, returning=True)
        else:
            live = {str(i): _metered(rest) for i, *rest in Image.objects.select_for_update().filter(
                id__in=list(facts), status=ImageStatus.QUEUED).order_by().values_list("id", *(
                    f"{f}_id" if f in ("owner", "source") else f for f in METERED))}
            if live:
                _update_per_row(key="id", rows={i: facts[i] for i in live}, status=ImageStatus.QUEUED, sets=sets)
        if not live:
            return set()
        # their skipped copies carry their facts (they were created while it was queued)
        _update_per_row(key="duplicate_of", rows={i: facts[i] for i in live}, status=ImageStatus.SKIPPED)
        usage_meter.images_embedded(live.values(), compute_s_each=compute_s_each)
    return set(live)


def image_delete(*, image: Image) -> None:
    """Delete one image (``DELETE /api/images/{id}/``, the admin's delete): see :func:`image_deleted`.

    Raises:
        ApplicationError: 503 (``vectors_unavailable``, ...) when the vectors worker does not confirm
            the point's removal; the row is gone by then (its point is no longer found by anyone).
    """
    fresh = Image.objects.filter(id=image.id).first()  # its status now, not when the request read it
    if fresh is not None:
        fresh.delete()


def images_delete(*, images: QuerySet[Image]) -> int:
    """Delete many images (the admin's bulk delete) through the same path as one. Returns the count."""
    return images.delete()[1].get(Image._meta.label, 0)


#: Spaces whose copy rows this process is deleting with their collection (``migrations.space_drop``):
#: no per-row settlement, no forget message per point.
DROPPING: set[str] = set()


def image_deleted(*, image: Image, single: bool = True) -> None:
    """What follows the deletion of a row, however it went: ``image_delete``, the admin, or the
    cascade from deleting its job or owner (the ``post_delete`` receiver connected in ``embeddings.apps``).

    In the deleting transaction: when it was the original of its bytes, the owner's skipped copies
    get a new original (:func:`_settle`), so they stay searchable. After commit: its point is
    forgotten (deleted, or its payload recomputed while other rows hold those bytes), its blob
    deleted when no row names it any more, and its thumbnail and preview when no row has those bytes.

    Args:
        single: one row deleted on its own: the point is forgotten synchronously (``vectors_call``,
            a 503 when the vectors worker does not answer); otherwise (a cascade, a bulk delete) one
            message per point at bulk priority, so a large delete never holds up searches.
    """
    if image.model_id in DROPPING:  # a dropped space's copies: their points went with its collection
        return
    if image.duplicate_of_id is None and image.status in LIVE_ORIGINAL_STATUSES and image.sha256:
        _settle(owner_id=image.owner_id, model_id=image.model_id, sha256=image.sha256, gone=image)
    # a queued row's point may have been written a moment ago (its vectors were on their way)
    has_point = image.status in LIVE_ORIGINAL_STATUSES and image.point_id is not None  # not an unfetched row
    transaction.on_commit(lambda: _forget(image, has_point=has_point, single=single))


def _forget(image: Image, *, has_point: bool, single: bool) -> None:
    """After a deletion committed: forget its point, delete its blob when no row names it."""

    try:
        if has_point and single:
            sink.store_call("forget_point", str(image.point_id), image.sha256, image.model_id)
        elif has_point:
            sink.store_send("forget_point", str(image.point_id), image.sha256, image.model_id, interactive=False)
    finally:
        key, store = image.storage_key, runtime.blob_store()
        with transaction.atomic():
            lock_bytes([image.sha256] if image.sha256 else [])
            if key and not Image.objects.filter(storage_key=key).exists():
                store.delete(key)
            if image.sha256 and not Image.objects.filter(sha256=image.sha256).exists():  # one of each per bytes
                thumbnail_delete(store, image.sha256)
                preview_delete(store, image.sha256)


def images_cancelled(*, job: Job) -> int:
    """After ``job``'s queued images were cancelled (in the same transaction): its skipped duplicates
    of them are cancelled too; skipped copies in other requests get a new original (:func:`_settle`).

    Returns:
        The number of byte groups settled.
    """
    cancelled = Image.objects.filter(job=job, status=ImageStatus.CANCELLED, duplicate_of__isnull=True)
    Image.objects.filter(job=job, status=ImageStatus.SKIPPED, duplicate_of__in=cancelled).update(
        status=ImageStatus.CANCELLED, reason="cancelled", reason_detail="the job was cancelled")
    groups = (Image.objects.filter(status=ImageStatus.SKIPPED, duplicate_of__in=cancelled)
              .values_list("duplicate_of_id", flat=True).distinct())
    n = 0
    for gone in Image.objects.filter(id__in=list(groups)):
        _settle(owner_id=gone.owner_id, model_id=gone.model_id, sha256=gone.sha256, gone=gone)
        n += 1
    return n
