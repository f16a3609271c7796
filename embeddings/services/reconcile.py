"""Recovery: the database is the source of truth; the reconciler finds queued images that no message
will ever finish, and queues them again (bulk) or expires them (interactive, deadline passed).

An image is **live** while some message in the broker's Redis names it:

- waiting in a queue list of the ``bulk`` or ``vectors`` lane, at any priority step (kombu keeps
  one list per step: ``bulk``, ``bulk\\x06\\x166``, ... — ``Channel._q_for_pri``). Not the
  ``interactive`` lane: a waiting interactive message whose deadline has passed is refused unseen
  when it runs, so it keeps nothing alive;
- delivered and not yet acknowledged (kombu's ``unacked`` hash, with the delivery time in
  ``unacked_index``) by a worker that is alive. A delivery older than the grace period whose task
  no worker reports (``inspect query_task``: active, reserved or scheduled) is an **orphan**: its
  worker was killed (SIGKILL, OOM) and Redis would redeliver it only after the visibility timeout
  (an hour by default).

Every message the service sends names its images by id (``embed_chunk``, ``index_chunk``,
``embed_interactive``, ``index_interactive``), and each task publishes its successor before it is
acknowledged (late acks), so a queued image always has a live message, except when:

- Redis restarted and lost what it held in memory (no persistence configured);
- the publish after a commit failed (Redis was down at that moment);
- a task was acknowledged without finishing (hard time limit, an unexpected exception);
- the worker holding it died (the orphan case above).

Those images are **lost**: queued, older than the grace period, and not live in two broker snapshots
taken a moment apart (a message moving from a queue list to the unacked hash is briefly in neither).

What happens to a lost image:

- bulk, job running or queued: sent again in chunks of the job's chunk size (``dispatch.send_job_chunks``).
  Re-dispatch is idempotent: ``chunk_embed`` skips images no longer queued and point ids are
  deterministic, so a duplicate delivery rewrites the same point;
- bulk, with ``BULK_MAX_ATTEMPTS`` attempts already (deliveries that started it plus re-dispatches
  by the reconciler): failed with ``attempts_exhausted``, so neither a poison image nor a task that
  fails before it starts can loop forever;
- bulk, job paused: left alone (resuming is the user's decision; a lost chunk of a resumed job is
  found by the next round);
- interactive, deadline passed: ``expired`` with a reason; its point is forgotten (deleted, or its
  payload rewritten from the database) in case it was written before the worker died. Before the
  deadline nothing is done: the embed task refuses work after the deadline anyway.

A catalogue job still ``reading`` its manifest or prefix whose id no live message names (its
``job_read`` was lost with its worker) is read again: the read continues after the rows it made.

Under the fair scheduler (``BULK_SCHEDULER=fair``, ``embeddings.bulk_schedule``) the images of
unsent chunks are live (the database holds their chunks); a sent chunk no live message names after
the grace leaves the window (its images are lost ones, sent again as new chunks), and the round
refills the window.

Jobs left ``running`` with no queued image (a crash between the last write and the job refresh)
are refreshed to ``done``.

Each round also does the webhooks' periodic work (:func:`webhooks_round`): ``job.at_risk`` for
jobs that now miss their deadline, and every delivery attempt that is due (docs/webhooks.md); and
deletes the temporary files of requests whose process died before deleting them (:func:`temporaries_round`).

The reconciler runs as a loop in the ``vectors`` worker (:func:`reconciler_start`, started on
``worker_ready``) every ``RECONCILE_INTERVAL_S``, and on demand as ``manage.py reconcile``. A Redis
lock makes concurrent rounds impossible, so it is safe to run it in several places.
"""
from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable

import redis
from django.conf import settings
from django.db import close_old_connections
from django.db.models import F
from django.utils import timezone

from embeddings import bulk_schedule, dispatch, lane_control, runtime
from embeddings.models import Image, ImageStatus, Job, JobStatus, Lane
from embeddings.services.catalogue.images import images_mark_failed
from embeddings.services.batches.batches import batches_expire
from embeddings.services.catalogue.jobs import job_refresh, jobs_at_risk_notify
from embeddings.services.lifecycle import cutoff
from embeddings.services.webhooks import delivery as webhook_delivery
from project import lanes
from project.celery import app
from workers.errors import Reason

log = logging.getLogger(__name__)

#: Reason code of a bulk image delivered ``BULK_MAX_ATTEMPTS`` times without finishing.
ATTEMPTS_EXHAUSTED = Reason.ATTEMPTS_EXHAUSTED.value
#: Redis key of the lock that keeps reconciler rounds from overlapping (this deployment's own).
LOCK_KEY = lane_control.key("embeddings:reconcile:lock")

_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# kombu's Redis transport (kombu/transport/redis.py, Channel): names of its keys, under this
# deployment's global_keyprefix.
_UNACKED = lane_control.key("unacked")
_UNACKED_INDEX = lane_control.key("unacked_index")


@dataclasses.dataclass
class BrokerSnapshot:
    """Image ids named by live messages, and how the broker looked.

    ``live_ids``: ids named by messages waiting in a queue or held by a live worker; ``queued``:
    messages waiting in queue lists; ``unacked``: delivered, unacknowledged messages; ``orphans``:
    unacknowledged task ids no live worker holds (their worker died).
    """

    live_ids: set[str] = dataclasses.field(default_factory=set)
    queued: int = 0
    unacked: int = 0
    orphans: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class ReconcileReport:
    """What one round found and did: counts of images, except ``chunks`` (messages sent),
    ``jobs_refreshed``, ``live`` (distinct ids named by live messages: images, jobs, points) and
    ``orphaned_messages`` (deliveries whose worker died)."""

    lost: int = 0
    redispatched: int = 0
    chunks: int = 0
    expired: int = 0
    exhausted: int = 0
    jobs_refreshed: int = 0
    live: int = 0
    orphaned_messages: int = 0
    #: catalogue jobs still ``reading`` whose ``job_read`` no live message names: read again (each
    #: read continues after the rows already made)
    reads_resent: int = 0
    #: temporary files (``tmp/``) left by requests whose process died: deleted (:func:`temporaries_round`)
    temporaries_deleted: int = 0
    #: fair scheduler: sent chunks no live message names after the grace, released from the window
    chunks_released: int = 0

    @property
    def acted(self) -> bool:
        return bool(self.redispatched or self.expired or self.exhausted or self.jobs_refreshed or self.reads_resent
                    or self.temporaries_deleted or self.chunks_released)


def _message_ids(raw: bytes | str) -> tuple[str | None, set[str]]:
    """``(task id, image ids)`` named by one kombu message (JSON envelope, body often base64)."""
    try:
        msg = json.loads(raw)
        if isinstance(msg, list):  # unacked entries are [message, exchange, routing key]
            msg = msg[0]
        body = msg.get("body", "")
        if msg.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        task_id = (msg.get("headers") or {}).get("id")
    except (ValueError, TypeError, AttributeError, IndexError) as e:
        log.warning("reconcile: unreadable broker message ignored: %s", e)
        return None, set()
    data = body if isinstance(body, bytes) else str(body).encode()
    return task_id, {m.decode() for m in _UUID.findall(data)}


#: Queues whose waiting messages keep an image live. Not ``interactive``: a waiting interactive
#: message whose deadline has passed will be refused unseen when it runs, so it saves nothing.
LIVE_QUEUES = (lanes.BULK, lanes.VECTORS, lanes.FETCH)


def queue_keys(queues: Iterable[str] = LIVE_QUEUES) -> list[str]:
    """Redis list names of ``queues`` at every priority step (``lane_control.queue_keys`` of each)."""
    return [key for q in queues for key in lane_control.queue_keys(q)]


def workers_holding(task_ids: list[str], *, timeout: float = 1.0) -> set[str]:
    """Task ids among ``task_ids`` that a live worker holds (active, reserved or scheduled)."""
    if not task_ids:
        return set()

    replies = app.control.inspect(timeout=timeout).query_task(*task_ids) or {}
    return {tid for per_worker in replies.values() for tid in (per_worker or {})}


def broker_snapshot(client, *, grace_s: float, orphans: set[str] | None = None,
                    holding: Callable[[list[str]], set[str]] = workers_holding) -> BrokerSnapshot:
    """Read every queue list and the unacked hash once.

    Args:
        client: a ``redis.Redis`` on the broker's server.
        grace_s: unacknowledged deliveries younger than this are live whatever the workers say.
        orphans: task ids already found orphaned (a second snapshot reuses them instead of asking
            the workers again; older deliveries not in it are then counted live).
        holding: task ids → those a live worker holds (``inspect query_task``).
    """
    snap = BrokerSnapshot()
    for key in queue_keys():
        for raw in client.lrange(key, 0, -1):
            snap.live_ids |= _message_ids(raw)[1]
            snap.queued += 1
    entries = client.hgetall(_UNACKED)
    delivered = dict(client.zrange(_UNACKED_INDEX, 0, -1, withscores=True))
    now = time.time()
    parsed = {}
    for tag, raw in entries.items():
        task_id, ids = _message_ids(raw)
        parsed[tag] = (task_id, ids)
    old = {tag: v for tag, v in parsed.items() if v[0] and now - delivered.get(tag, now) > grace_s}
    if orphans is None:
        held = holding(sorted({tid for tid, _ in old.values()}))
        orphans = {tid for tid, _ in old.values() if tid not in held}
    snap.orphans = set(orphans)
    snap.unacked = len(parsed)
    for tag, (task_id, ids) in parsed.items():
        if not (tag in old and task_id in orphans):
            snap.live_ids |= ids
    return snap


def reconcile(*, live_ids: Callable[[], set[str]], grace_s: float, max_attempts: int,
              now: dt.datetime | None = None) -> ReconcileReport:
    """One round over the database, given a way to read the live image ids (called twice).

    Args:
        live_ids: returns the ids of images some live message names (a broker snapshot).
        grace_s: queued images created less than this ago are never treated as lost.
        max_attempts: deliveries after which a lost bulk image fails with ``attempts_exhausted``.
        now: the current time (tests).
    """

    now = now or timezone.now()
    # the fair scheduler's unsent chunks are the database's, not lost: read before the broker, so
    # a chunk claimed meanwhile is seen in the broker instead
    held = bulk_schedule.held_image_ids() if bulk_schedule.enabled() else set()
    broker = live_ids()
    first = broker | held
    bulk = list(Image.objects.filter(status=ImageStatus.QUEUED, lane=Lane.BULK,
                                     created_at__lt=now - dt.timedelta(seconds=grace_s))
                .values_list("id", "job_id", "attempts"))
    interactive = list(Image.objects.filter(status=ImageStatus.QUEUED, lane=Lane.INTERACTIVE, deadline__lt=now)
                       .values_list("id", "point_id", "sha256", "model_id"))
    candidates = {str(i) for i, _, _ in bulk} | {str(i) for i, *_ in interactive}
    candidates -= first
    if candidates:
        candidates -= live_ids()  # a message in transit between a queue list and the unacked hash
    lost_bulk = [(str(i), j, a) for i, j, a in bulk if str(i) in candidates]
    lost_interactive = [row for row in interactive if str(row[0]) in candidates]

    exhausted = [i for i, _, a in lost_bulk if a >= max_attempts]
    if exhausted:
        images_mark_failed([(i, ATTEMPTS_EXHAUSTED, f"delivered {max_attempts} times without finishing "
                                                    f"(its worker was killed or timed out each time)")
                            for i in exhausted])
    by_job: dict = {}
    for i, job_id, a in lost_bulk:
        if a < max_attempts:
            by_job.setdefault(job_id, []).append(i)
    redispatched = chunks = 0
    for job in Job.objects.filter(id__in=list(by_job)):
        ids = by_job[job.id]
        if job.status == JobStatus.PAUSED:
            continue
        if job.status == JobStatus.CANCELLED:
            images_mark_failed([(i, "cancelled", "the job was cancelled") for i in ids])
            continue
        # A re-dispatch counts as an attempt: a chunk whose task fails before it starts (and is
        # acknowledged) must end as attempts_exhausted, not be sent again every round forever.
        Image.objects.filter(id__in=ids).update(attempts=F("attempts") + 1)
        chunks += dispatch.send_job_chunks(job=job, image_ids=ids)
        redispatched += len(ids)

    if lost_interactive:
        images_mark_failed([(str(i), "expired", "its deadline passed and no worker holds it (worker or broker "
                                                "lost)") for i, *_ in lost_interactive])
        # The point may have been written just before the vectors worker died: forget it unless
        # another image with the same bytes is still on its way (its write sets the payload).
        busy = set(Image.objects.filter(status=ImageStatus.QUEUED, sha256__in={r[2] for r in lost_interactive})
                   .values_list("sha256", "model_id"))
        for _, pid, sha, model_id in lost_interactive:
            if (sha, model_id) not in busy:
                dispatch.send_forget_point(point_id=str(pid), sha256=sha, interactive=True, model_id=model_id)

    reads_resent = _resend_lost_reads(first=first, live_ids=live_ids, grace_s=grace_s, now=now)
    released = 0
    if bulk_schedule.enabled():  # sent chunks no message names leave the window; refill it
        released = bulk_schedule.chunks_release(live=broker, grace_s=grace_s, now=now)
        dispatch.bulk_pump()

    refreshed = 0
    active_jobs = Job.objects.filter(status__in=(JobStatus.QUEUED, JobStatus.RUNNING)).exclude(
        images__status=ImageStatus.QUEUED).filter(created_at__lt=now - dt.timedelta(seconds=grace_s))
    for job_id in active_jobs.values_list("id", flat=True).distinct():
        if job_refresh(job_id=job_id).status == JobStatus.DONE:
            refreshed += 1
    return ReconcileReport(lost=len(lost_bulk) + len(lost_interactive), redispatched=redispatched, chunks=chunks,
                           expired=len(lost_interactive), exhausted=len(exhausted), jobs_refreshed=refreshed,
                           live=len(first), reads_resent=reads_resent, chunks_released=released)


def _resend_lost_reads(*, first: set[str], live_ids: Callable[[], set[str]], grace_s: float,
                       now: dt.datetime) -> int:
    """Send again the read of each catalogue job still reading, older than ``grace_s``, that no live
    message names (``first``, then ``live_ids()`` again: one in transit between a queue list and the
    unacked hash); its fetch worker was killed or Redis restarted. It reads again after the rows it
    made. Chunk messages name the job too, so it waits for them. Returns how many were sent."""

    reading = {str(j): p for j, p in Job.objects.filter(reading=True, created_at__lt=now - dt.timedelta(
        seconds=grace_s)).exclude(status=JobStatus.CANCELLED).values_list("id", "priority")}
    stalled = set(reading) - first
    if stalled:
        stalled -= live_ids()
    for job_id in sorted(stalled):
        dispatch.send_job_read(job_id=job_id, priority=reading[job_id])
    return len(stalled)


def webhooks_round() -> tuple[int, int]:
    """The webhooks' share of a round (docs/webhooks.md): ``job.at_risk`` for jobs that now miss
    their deadline, then every delivery attempt that is due queued on the fetch queue. A failure is
    logged, never fails the round.

    Returns:
        ``(at-risk messages made, attempts queued)``.
    """

    try:
        return jobs_at_risk_notify(), webhook_delivery.deliveries_due_send()
    except Exception:
        log.exception("reconcile: the webhooks' round failed; the next round tries again")
        return 0, 0


def batches_round() -> int:
    """The OpenAI batches' share of a round (``batches.batches_expire``): parts whose message was lost
    queued again after ``PART_LEASE``, batches past their completion window expired, lost validations
    and finalisations queued again. A failure is logged, never fails the round. Returns the batches touched."""

    try:
        return batches_expire()
    except Exception:
        log.exception("reconcile: expiring batches failed; the next round tries again")
        return 0


def temporaries_round(*, grace_s: float, now: dt.datetime | None = None) -> int:
    """Delete the temporary files (query images, embeddings requests' images) of requests whose
    process died before deleting them: older than the longest a request may keep one (its deadline:
    ``VECTORS_CALL_TIMEOUT_S`` for a search, at most ``INTERACTIVE_DEADLINE_S`` otherwise), twice
    over plus 30 s, and than ``grace_s``. A failure is logged, never fails the round. Returns how
    many were deleted."""

    longest = max(settings.INTERACTIVE_DEADLINE_S, settings.VECTORS_CALL_TIMEOUT_S)
    age_s = max(grace_s, 2 * longest + 30)
    try:
        return runtime.blob_store().temporaries_delete(older_than=(now or timezone.now()) - dt.timedelta(seconds=age_s))
    except Exception:
        log.exception("reconcile: deleting old temporary files failed; the next round tries again")
        return 0


def redis_client():
    """A Redis client on the broker's server (``settings.CELERY_BROKER_URL``)."""

    return redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=5, socket_connect_timeout=5)


def reconcile_once(*, client=None, grace_s: float | None = None) -> ReconcileReport | None:
    """One locked round against the real broker; ``None`` when another round holds the lock.

    Raises:
        redis.exceptions.ConnectionError: the broker is unreachable (the next round tries again).
    """
    client = client or redis_client()
    grace = settings.RECONCILE_GRACE_S if grace_s is None else grace_s
    lock = client.lock(LOCK_KEY, timeout=max(60.0, 4 * settings.RECONCILE_INTERVAL_S), blocking=False)
    if not lock.acquire():
        return None
    try:
        orphans: set[str] | None = None

        def live() -> set[str]:
            nonlocal orphans
            snap = broker_snapshot(client, grace_s=grace, orphans=orphans)
            orphans = snap.orphans
            return snap.live_ids

        report = reconcile(live_ids=live, grace_s=grace, max_attempts=settings.BULK_MAX_ATTEMPTS)
        report = dataclasses.replace(report, orphaned_messages=len(orphans or ()),
                                     temporaries_deleted=temporaries_round(grace_s=grace))
        webhooks_round()
        batches_round()
    finally:
        try:
            lock.release()
        except Exception:
            pass
    if report.acted:
        log.warning("reconcile: %s", report)
    return report


def reconciler_start(*, interval_s: float, stop: threading.Event | None = None) -> threading.Thread:
    """Run :func:`reconcile_once` every ``interval_s`` in a daemon thread of this process.

    Errors (broker or database unreachable) are logged and the loop goes on.
    """
    stop = stop or threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            try:
                reconcile_once()

                cutoff.calibrate_if_due()
            except Exception:
                log.exception("reconcile round failed; retrying in %s s", interval_s)
            finally:
                close_old_connections()

    thread = threading.Thread(target=loop, name="reconciler", daemon=True)
    thread.start()
    log.info("reconciler started: every %s s, grace %s s", interval_s, settings.RECONCILE_GRACE_S)
    return thread
