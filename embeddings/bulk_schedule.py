"""The bulk lane's scheduler on the engines we run (``BULK_SCHEDULER=fair``; docs/lanes.md, "The bulk
lane's order"): the database holds every job's unsent chunks (``BulkChunk`` rows), at most
``BULK_SCHEDULER_WINDOW`` chunks are in the broker or computing at once, and each time one leaves the
window the next is chosen by ``queueing.bulk_order`` from a snapshot of the lane and sent.

- :func:`chunks_add`: a job's new chunks become ``pending`` rows (one INSERT);
- :func:`pump`: snapshot (one SELECT), then for each free place in the window one pick and one
  claim (one UPDATE … RETURNING, which also marks the finishing chunk ``done``: a finished chunk
  hands its place on in the same statement), then the send; on PostgreSQL the claim takes the
  job's first pending row ``FOR UPDATE SKIP LOCKED``, so workers finishing at once never claim the
  same chunk; SQLite serialises writers;
- the fairness tags (``queueing.bulk_order``) live in one Redis hash: read once per pump, written
  once per pick. They are soft state: lost with Redis, fairness starts again from equal footing;
- the reconciler (``services.reconcile``) is the backstop: images in pending rows count as live,
  a ``sent`` row none of whose images any live message names after the grace is released
  (:func:`chunks_release`), finished rows are deleted, and it pumps.

This module sends nothing itself: :func:`pump` takes the ``send`` of ``embeddings.dispatch``, which
calls it, so imports run one way (dispatch → bulk_schedule → models).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import threading
import time
import uuid
from typing import Callable

from django.conf import settings
from django.db import connection
from django.db.models import Case, IntegerField, OuterRef, Q, Subquery, Sum, Value, When
from django.utils import timezone

from embeddings import lane_control
from embeddings.models import ApiKey, BulkChunk, ChunkState, JobKind, JobPriority, JobStatus
from queueing import bulk_order
from queueing.bulk_order import JobView

log = logging.getLogger(__name__)

#: Redis hash of the fairness tags (``queueing.bulk_order``: ``v``, ``o:<owner>``, ...), this deployment's.
TAGS_KEY = lane_control.key("embeddings:bulk:tags")
#: The owner the model lifecycle's re-embeds (migration jobs) count as.
LIFECYCLE_OWNER = "lifecycle"
#: Job statuses whose chunks may be sent.
ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)


def enabled() -> bool:
    """Whether the lane runs the fair scheduler (``BULK_SCHEDULER=fair``) instead of first come, first served."""
    return settings.BULK_SCHEDULER == "fair"


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A chunk claimed for sending: its row, job, image ids and the job's priority."""

    chunk_id: int
    job_id: str
    image_ids: list[str]
    priority: str


@dataclasses.dataclass
class LaneSnapshot:
    """The lane as one SELECT saw it.

    Attributes:
        views: a :class:`queueing.bulk_order.JobView` per active job with a pending or sent chunk.
        priority: ``{job id: urgent|background}``.
        in_flight: chunks ``sent`` (every job's): the window's occupancy.
        own_sent: the finishing chunk (``own``) was still ``sent``: its place in the window passes on.
    """

    views: list[JobView]
    priority: dict[str, str]
    in_flight: int
    own_sent: bool


def owner_key(*, username: str, kind: str) -> str:
    """Who a job counts against: its owner's name, or the lifecycle for a migration's re-embeds."""
    return LIFECYCLE_OWNER if kind == JobKind.MIGRATION else username


def owner_weight(owner: str) -> float:
    """``BULK_LIFECYCLE_WEIGHT`` for the lifecycle, ``BULK_OWNER_WEIGHTS`` (default 1) for a user."""
    if owner == LIFECYCLE_OWNER:
        return settings.BULK_LIFECYCLE_WEIGHT
    return settings.BULK_OWNER_WEIGHTS.get(owner, 1.0)


def job_weight(*, owner: str, key_weight: float | None) -> float:
    """One job's weight in the lane: the ``bulk_weight`` staff set on the API key that submitted it
    (``ApiKey.bulk_weight``, 0.01 to 100), else its owner's (:func:`owner_weight`). Migrations'
    re-embeds are the lifecycle's whatever key started them."""
    if owner == LIFECYCLE_OWNER or key_weight is None:
        return owner_weight(owner)
    return key_weight


def owners_weigh(views: list[JobView]) -> list[JobView]:
    """The lane's fair shares are per owner (``queueing.bulk_order``: one weight per owner, its jobs
    sharing its share equally), so each owner weighs the largest :func:`job_weight` among its jobs
    in the lane, and every job of that owner carries it. More keys or more jobs never raise an
    owner past the largest weight staff gave it: a team's share is bought by staff, not by keys.

    Args:
        views: the lane's jobs, each with its own :func:`job_weight` as ``weight``.

    Returns:
        The same views in the same order, each ``weight`` its owner's.
    """
    top: dict[str, float] = {}
    for v in views:
        top[v.owner] = max(top.get(v.owner, 0.0), v.weight)
    return [v if v.weight == top[v.owner] else dataclasses.replace(v, weight=top[v.owner]) for v in views]


def chunks_add(*, job_id, chunks: list[list[str]]) -> int:
    """Store a job's new chunks (lists of image ids) as pending rows, in order, one INSERT. Returns
    how many."""
    rows = [BulkChunk(job_id=job_id, image_ids=[str(i) for i in c], images=len(c)) for c in chunks if c]
    BulkChunk.objects.bulk_create(rows)
    return len(rows)


def _sent_count(**q):
    # SUM over a CASE, not COUNT: the bulk path's statements are checked for per-job COUNTs
    return Sum(Case(When(Q(**q), then=Value(1)), default=Value(0), output_field=IntegerField()))


def lane_snapshot(*, own: int | None = None) -> LaneSnapshot:
    """One SELECT over the pending and sent rows, grouped by job (its cost grows with the unsent
    chunks, not with the images done). The submitting key's ``bulk_weight`` is read in the same
    statement (a subquery on ``ApiKey.prefix`` = ``Job.key_prefix``, a unique index); weights are
    :func:`job_weight` then :func:`owners_weigh`."""
    key_weight = Subquery(ApiKey.objects.filter(prefix=OuterRef("job__key_prefix")).order_by()
                          .values("bulk_weight")[:1])
    rows = (BulkChunk.objects.filter(state__in=(ChunkState.PENDING, ChunkState.SENT)).order_by()
            .annotate(key_weight=key_weight)
            .values("job_id", "job__owner__username", "job__kind", "job__priority", "job__deadline",
                    "job__created_at", "job__chunk_size", "job__status", "job__key_prefix", "key_weight")
            .annotate(pending=Sum(Case(When(state=ChunkState.PENDING, then="images"), default=Value(0),
                                       output_field=IntegerField())),
                      in_flight=Sum(Case(When(state=ChunkState.SENT, then="images"), default=Value(0),
                                         output_field=IntegerField())),
                      sent=_sent_count(state=ChunkState.SENT),
                      own=_sent_count(state=ChunkState.SENT, id=own if own is not None else -1)))
    views, priority, in_flight, own_sent = [], {}, 0, False
    for r in rows:
        in_flight += r["sent"] or 0
        own_sent = own_sent or bool(r["own"])
        if r["job__status"] not in ACTIVE:
            continue
        owner = owner_key(username=r["job__owner__username"], kind=r["job__kind"])
        job_id = str(r["job_id"])
        priority[job_id] = r["job__priority"]
        views.append(JobView(job_id=job_id, owner=owner, weight=job_weight(owner=owner, key_weight=r["key_weight"]),
                             urgent=r["job__priority"] == JobPriority.URGENT,
                             deadline=r["job__deadline"].timestamp() if r["job__deadline"] else None,
                             created=r["job__created_at"].timestamp(), pending=r["pending"] or 0,
                             in_flight=r["in_flight"] or 0, next_chunk=r["job__chunk_size"]))
    return LaneSnapshot(views=owners_weigh(views), priority=priority, in_flight=in_flight, own_sent=own_sent)


def chunk_claim(*, job_id: str, own: int | None) -> tuple[Claimed | None, bool]:
    """Claim ``job_id``'s first pending chunk (→ ``sent``) and, in the same statement, mark the
    finishing chunk ``own`` ``done``. Returns ``(the claimed chunk or None when another process
    took the job's last one, whether own was marked)``."""
    t = connection.ops.quote_name(BulkChunk._meta.db_table)
    lock = " FOR UPDATE SKIP LOCKED" if connection.vendor == "postgresql" else ""
    job = BulkChunk._meta.get_field("job").target_field.get_db_prep_value(uuid.UUID(str(job_id)), connection)
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    first = f"(SELECT id FROM {t} WHERE job_id = %s AND state = %s ORDER BY id LIMIT 1{lock})"
    if own is None:
        sql = f"UPDATE {t} SET state = %s, sent_at = %s WHERE id = {first} RETURNING id, image_ids, state"
        params = [ChunkState.SENT.value, now, job, ChunkState.PENDING.value]
    else:
        sql = (f"UPDATE {t} SET state = CASE WHEN id = %s THEN %s ELSE %s END, "
               f"sent_at = CASE WHEN id = %s THEN sent_at ELSE %s END "
               f"WHERE (id = %s AND state = %s) OR id = {first} RETURNING id, image_ids, state")
        params = [own, ChunkState.DONE.value, ChunkState.SENT.value, own, now, own, ChunkState.SENT.value, job,
                  ChunkState.PENDING.value]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        returned = cursor.fetchall()
    claimed, marked = None, False
    for chunk_id, ids, state in returned:
        if chunk_id == own:
            marked = True
            continue
        ids = json.loads(ids) if isinstance(ids, (str, bytes)) else ids
        claimed = Claimed(chunk_id=int(chunk_id), job_id=str(job_id), image_ids=list(ids), priority="")
    return claimed, marked


def _finish(own: int) -> None:
    """Mark the finishing chunk ``done`` when nothing is claimed in its place."""
    BulkChunk.objects.filter(id=own, state=ChunkState.SENT).update(state=ChunkState.DONE)


class _LaneRate:
    """This process's estimate of the lane's images/s: an exponentially weighted mean of its own
    chunks' images/s (one bulk process), times the processes the window serves
    (``BULK_SCHEDULER_WINDOW`` / 2: one computing, one on deck each). None before a chunk finished here."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha, self.per_slot = alpha, None
        self.lock = threading.Lock()

    def add(self, *, images: int, seconds: float) -> None:
        if images <= 0 or seconds <= 0:
            return
        r = images / seconds
        with self.lock:
            self.per_slot = r if self.per_slot is None else (1 - self.alpha) * self.per_slot + self.alpha * r

    def lane(self) -> float | None:
        if self.per_slot is None:
            return None
        return self.per_slot * max(1, settings.BULK_SCHEDULER_WINDOW // 2)


#: Per process: the lane's rate as this process has seen it.
lane_rate = _LaneRate()
_pumping = threading.local()


def tags_read(client=None) -> dict[str, float]:
    """The stored fairness tags (one HGETALL); ``{}`` when Redis cannot be read (fairness restarts, work goes on)."""
    try:
        raw = (client or lane_control.redis_client()).hgetall(TAGS_KEY)
    except Exception as e:  # noqa: BLE001 - soft state: a pick without history is still a pick
        log.warning("bulk scheduler: fairness tags unreadable (%s); picking without them", e)
        return {}
    return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}


def _tags_write(tags: dict[str, float], client=None) -> None:
    try:
        (client or lane_control.redis_client()).hset(TAGS_KEY, mapping={k: repr(v) for k, v in tags.items()})
    except Exception as e:  # noqa: BLE001 - soft state
        log.warning("bulk scheduler: fairness tags not stored (%s)", e)


def pump(*, send: Callable[[Claimed], object], own: int | None = None, rate: float | None = None,
         on_pick: Callable[[JobView, str], None] | None = None,
         on_done: Callable[[JobView, int], None] | None = None, done: tuple[str, int] | None = None) -> int:
    """Fill the window: chunk ``own`` (its row id; None when nothing finished) has left it; send
    as many chunks as the window has room for, each chosen by ``queueing.bulk_order.choose``.

    Args:
        send: puts a claimed chunk on the broker (``dispatch``); a failure propagates after the
            claim (the reconciler releases the row once its grace has passed).
        own: the finishing chunk's row: its place passes to the next chunk in the same statement.
        rate: the lane's images/s (default: this process's estimate; None leaves deadlines to fair shares).
        on_pick: told of each pick (the job's view, the rule): metrics.
        on_done, done: ``done`` = ``(job id, images)`` of the finishing chunk, told to ``on_done``
            with its job's view (metrics per owner without another query).

    Returns:
        Chunks sent. A pump inside a send (eager Celery runs the chunk in the send) only marks its
        chunk done; the outer pump looks again.
    """
    if getattr(_pumping, "active", False):
        if own is not None:
            _finish(own)
        _pumping.again = True
        return 0
    _pumping.active = True
    try:
        sent = 0
        while True:
            _pumping.again = False
            sent += _pump_once(send=send, own=own, rate=rate if rate is not None else lane_rate.lane(),
                               on_pick=on_pick, on_done=on_done, done=done)
            own = done = None
            if not _pumping.again:
                return sent
    finally:
        _pumping.active = False


def _pump_once(*, send, own: int | None, rate: float | None, on_pick, on_done, done) -> int:
    """One snapshot, then picks and claims while the window has room (:func:`pump`). Returns chunks sent."""
    snap = lane_snapshot(own=own)
    if done is not None and on_done is not None:
        view = next((v for v in snap.views if v.job_id == done[0]), None)
        if view is not None:
            on_done(view, done[1])
    own = own if snap.own_sent else None
    free = settings.BULK_SCHEDULER_WINDOW - snap.in_flight + (1 if own is not None else 0)
    views = {v.job_id: v for v in snap.views}
    log.debug("bulk scheduler: %d in flight, %d free, own %s, pending %s", snap.in_flight, free, own,
              {k[:8]: (v.pending, v.in_flight) for k, v in views.items()})
    n = 0
    tags: dict[str, float] | None = None
    while free > 0 and any(v.pending > 0 for v in views.values()):
        if tags is None:
            tags = tags_read()
        in_flight = sum(v.in_flight for v in views.values())
        pick = bulk_order.choose(list(views.values()), now=time.time(), rate=rate, tags=tags,
                                 slack_s=in_flight / rate if rate else 0.0)
        if pick is None:
            break
        if pick.infeasible:
            # said at debug level: it holds at every pick until the job ends (the API's lane block shows it)
            log.debug("bulk scheduler: deadline of job(s) %s cannot be met any more: fair share",
                      ", ".join(pick.infeasible))
        claimed, marked = chunk_claim(job_id=pick.job_id, own=own)
        if marked:
            own = None
        view = views[pick.job_id]
        if claimed is None:  # another process took its last chunk meanwhile
            views[pick.job_id] = dataclasses.replace(view, pending=0)
            continue
        tags.update(pick.tags)
        _tags_write(pick.tags)
        images = len(claimed.image_ids)
        views[pick.job_id] = dataclasses.replace(view, pending=max(0, view.pending - images),
                                                 in_flight=view.in_flight + images)
        if on_pick is not None:
            on_pick(view, pick.rule)
        send(dataclasses.replace(claimed, priority=snap.priority[pick.job_id]))
        log.debug("bulk scheduler: sent chunk %s of job %s (%s)", claimed.chunk_id, pick.job_id, pick.rule)
        free -= 1
        n += 1
    if own is not None:
        _finish(own)
    return n


def held_image_ids() -> set[str]:
    """Ids of the images in pending rows: the database holds their chunks, so no message is missing
    for them (the reconciler counts them live)."""
    out: set[str] = set()
    for ids in BulkChunk.objects.filter(state=ChunkState.PENDING).values_list("image_ids", flat=True):
        out.update(str(i) for i in ids)
    return out


def chunks_release(*, live: set[str], grace_s: float, now) -> int:
    """The reconciler's round over the rows: a ``sent`` row older than ``grace_s`` none of whose
    images a live message names (Redis lost it, its worker died, its finish was never recorded)
    leaves the window (``done``); its images, still queued, are the reconciler's lost images, sent
    again as new rows. Then finished rows, and every row of a finished or cancelled job, are
    deleted, and tags of jobs and owners gone from the lane are dropped. Returns rows released."""
    stale = []
    for chunk_id, ids in BulkChunk.objects.filter(state=ChunkState.SENT,
                                                  sent_at__lt=now - dt.timedelta(seconds=grace_s)).values_list(
            "id", "image_ids"):
        if not live.intersection(str(i) for i in ids):
            stale.append(chunk_id)
    if stale:
        BulkChunk.objects.filter(id__in=stale, state=ChunkState.SENT).update(state=ChunkState.DONE)
    BulkChunk.objects.filter(Q(state=ChunkState.DONE) | Q(job__status__in=(JobStatus.DONE, JobStatus.CANCELLED))).delete()
    try:
        client = lane_control.redis_client()
        tags = tags_read(client)
        gone = bulk_order.tags_prune(tags, lane_snapshot().views) if tags else []
        if gone:
            client.hdel(TAGS_KEY, *gone)
    except Exception as e:  # noqa: BLE001 - soft state
        log.warning("bulk scheduler: tags not pruned (%s)", e)
    return len(stale)


def lane_outlook(*, rate: float | None, now: float | None = None) -> tuple[dict[str, bulk_order.Outlook], list[JobView]]:
    """Every active job's outlook in the lane (``queueing.bulk_order.outlook``) and the views it
    was computed from: one SELECT."""
    views = lane_snapshot().views
    return bulk_order.outlook(views, now=time.time() if now is None else now, rate=rate), views
