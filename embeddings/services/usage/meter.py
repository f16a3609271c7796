"""Metering: usage counter rows incremented in the transaction that commits the work they count.

The rule (docs/usage.md, "Exactly once"): a unit is counted by the statement that makes its work
final, inside that statement's transaction. An image is counted by the ``UPDATE … WHERE status =
'queued'`` that marks it embedded (``catalogue.images.images_mark_embedded``): a redelivered chunk,
a retried write or a second delivery of the same work finds its images embedded already, marks
nothing, and so counts nothing; a crash before the commit takes the count back with the mark. A
fetch is counted where its row gets its bytes (``catalogue.fetching.rows_resolve``, under the same
``WHERE sha256 = ''`` guard), a duplicate where its row is decided skipped. What is not stored (a
text, an image of ``/v1/embeddings``, a search) is counted when its answer is made, once per request,
written once the response is sent.

Each increment is one ``INSERT … ON CONFLICT (day, owner, key, model, kind) DO UPDATE SET units =
units + excluded.units …`` per call (SQLite ≥ 3.24 and PostgreSQL alike), so concurrent writers
never lose an increment and never need a read first. Prometheus counters (``metrics.count_usage``)
follow once the transaction commits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from django.db import connection, transaction
from django.utils import timezone

from embeddings import metrics
from embeddings.deferred import after_response
from embeddings.models import Image, Job, Lane, UsageKind, UsageRecord
from project import lanes

#: The lane each kind runs on, for the Prometheus labels.
KIND_LANES = {
    UsageKind.IMAGE_INTERACTIVE: lanes.INTERACTIVE, UsageKind.TEXT: lanes.INTERACTIVE,
    UsageKind.SEARCH: lanes.INTERACTIVE, UsageKind.DUPLICATE: lanes.INTERACTIVE,
    UsageKind.IMAGE_BULK: lanes.BULK, UsageKind.IMAGE_REEMBED: lanes.BULK, UsageKind.FETCH: lanes.FETCH,
}


@dataclasses.dataclass(frozen=True)
class Usage:
    """An increment of one counter row: ``units`` of ``kind`` by ``owner_id`` through ``key_prefix``
    (``""``: a session or a legacy token) in space ``model_id``, with their ``bytes`` fetched and
    ``compute_s`` (worker seconds). ``lane`` overrides the kind's lane in the Prometheus labels
    (a duplicate or a fetch of a bulk job)."""

    owner_id: int
    kind: str
    units: int = 0
    key_prefix: str = ""
    model_id: str = ""
    bytes: int = 0
    compute_s: float = 0.0
    lane: str = ""


def usage_add(entries: Iterable[Usage]) -> int:
    """Add ``entries`` to today's (UTC) counter rows, in the caller's transaction if one is open:
    entries of one row are summed first, then one upsert statement for all rows.

    Returns:
        The number of counter rows touched.
    """
    sums: dict[tuple, list] = {}
    lane_of: dict[tuple, str] = {}
    for u in entries:
        if not (u.units or u.bytes or u.compute_s):
            continue
        key = (u.owner_id, u.key_prefix[:32], u.model_id, str(u.kind))
        row = sums.setdefault(key, [0, 0, 0.0])
        row[0] += u.units
        row[1] += u.bytes
        row[2] += u.compute_s
        lane_of[key] = u.lane or KIND_LANES.get(u.kind, "")
    if not sums:
        return 0
    day = connection.ops.adapt_datefield_value(timezone.now().date())  # UTC: USE_TZ
    table = connection.ops.quote_name(UsageRecord._meta.db_table)
    values, params = [], []
    for (owner_id, key_prefix, model_id, kind), (units, nbytes, compute_s) in sorted(sums.items()):
        values.append("(%s, %s, %s, %s, %s, %s, %s, %s)")
        params += [day, owner_id, key_prefix, model_id, kind, units, nbytes, compute_s]
    sql = (f"INSERT INTO {table} (day, owner_id, key_prefix, model_id, kind, units, bytes, compute_s) "
           f"VALUES {', '.join(values)} "
           f"ON CONFLICT (day, owner_id, key_prefix, model_id, kind) DO UPDATE SET "
           f"units = {table}.units + excluded.units, bytes = {table}.bytes + excluded.bytes, "
           f"compute_s = {table}.compute_s + excluded.compute_s")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
    committed = [(kind, lane_of[(o, k, model_id, kind)], model_id, *sums[(o, k, model_id, kind)])
                 for (o, k, model_id, kind) in sums]

    def count() -> None:
        for kind, lane, model_id, units, nbytes, compute_s in committed:
            metrics.count_usage(kind=kind, lane=lane, model=model_id, units=units, compute_s=compute_s, nbytes=nbytes)

    transaction.on_commit(count)
    return len(sums)


def images_embedded(marked: Iterable[tuple], *, compute_s_each: float = 0.0) -> None:
    """Count images just marked embedded, in the transaction that marked them (only there: the mark
    is what makes the count exactly once). Each is an ``image_reembed`` when it is a copy in another
    space, else ``image_interactive`` or ``image_bulk`` by its lane, for the key its row carries
    (a job's rows carry the job's, a copy its source row's: the key that brought the image in).

    Args:
        marked: ``(owner_id, key_prefix, model_id, lane, is a copy)`` of each row the mark's
            ``UPDATE`` changed, as it returned them (``catalogue.images.images_mark_embedded``).
        compute_s_each: worker seconds per image of the work that computed them (its batch's or
            chunk's compute time over its images).
    """
    usage_add(Usage(owner_id=owner_id, units=1, key_prefix=key or "", model_id=model_id, compute_s=compute_s_each,
                    kind=UsageKind.IMAGE_REEMBED if copy else
                    UsageKind.IMAGE_INTERACTIVE if lane == Lane.INTERACTIVE else UsageKind.IMAGE_BULK)
              for owner_id, key, model_id, lane, copy in marked)


def duplicates_skipped(rows: Iterable[Image], *, key_prefix: str = "") -> None:
    """Count rows just decided ``skipped`` (copies of bytes their owner has already), in the
    transaction that decided them: no compute, one unit each, under their lane."""
    usage_add(Usage(owner_id=im.owner_id, kind=UsageKind.DUPLICATE, units=1,
                    key_prefix=im.key_prefix or key_prefix, model_id=im.model_id, lane=im.lane)
              for im in rows if im.status == "skipped")


def rows_fetched(rows: list[Image]) -> None:
    """Count catalogue rows that just got their bytes (``catalogue.fetching.rows_resolve``, in its
    transaction, which takes only rows still without bytes: a redelivered fetch counts nothing
    twice): one ``fetch`` each with its size, and a ``duplicate`` for each decided ``skipped``; a
    row's key is its job's."""
    if not rows:
        return
    keys = dict(Job.objects.filter(id__in={r.job_id for r in rows if r.job_id}).values_list("id", "key_prefix"))
    entries = []
    for r in rows:
        key = r.key_prefix or keys.get(r.job_id, "")
        entries.append(Usage(owner_id=r.owner_id, kind=UsageKind.FETCH, units=1, key_prefix=key, model_id=r.model_id,
                             bytes=r.size_bytes or 0))
        if r.status == "skipped":
            entries.append(Usage(owner_id=r.owner_id, kind=UsageKind.DUPLICATE, units=1, key_prefix=key,
                                 model_id=r.model_id, lane=lanes.FETCH))
    usage_add(entries)


def answered(*, owner_id: int, key_prefix: str, model_id: str, texts: int = 0, images: int = 0, searches: int = 0,
             compute_s: float = 0.0) -> None:
    """Count the work of one answered request that stores nothing: ``texts`` and ``images``
    embedded, ``searches`` answered, in space ``model_id``; ``compute_s`` (worker seconds, when the
    worker reported them) goes with the texts and images, shared by count. In a web request the
    row is written once the response is sent (``deferred.after_response``): nobody waits for it."""
    embedded = texts + images
    share = compute_s / embedded if embedded else 0.0
    entries = [
        Usage(owner_id=owner_id, kind=UsageKind.TEXT, units=texts, key_prefix=key_prefix, model_id=model_id,
              compute_s=share * texts),
        Usage(owner_id=owner_id, kind=UsageKind.IMAGE_INTERACTIVE, units=images, key_prefix=key_prefix,
              model_id=model_id, compute_s=share * images),
        Usage(owner_id=owner_id, kind=UsageKind.SEARCH, units=searches, key_prefix=key_prefix, model_id=model_id,
              compute_s=0.0 if embedded else compute_s),
    ]
    after_response(lambda: usage_add(entries))


def fetched(*, owner_id: int, key_prefix: str, model_id: str, fetches: int, nbytes: int, lane: str = "") -> None:
    """Count ``fetches`` image URLs or objects read, ``nbytes`` in all, for work in space ``model_id``."""
    usage_add([Usage(owner_id=owner_id, kind=UsageKind.FETCH, units=fetches, key_prefix=key_prefix,
                     model_id=model_id, bytes=nbytes, lane=lane)])
