"""Lane control's Redis: the broker's server (``REDIS_URL``), one client per process, and every key
lane control keeps there, with how much of each is kept and read.

Every key starts with this deployment's prefix (:data:`PREFIX`, ``"<DEPLOYMENT_NAME>:"``), as every
key kombu and the result backend write does (``project.lanes.key_prefix``): two deployments on one
Redis database never read each other's lanes, queues or results. :func:`key` names any other.

The web (:mod:`.admission`) and the workers (:mod:`.reports`, :mod:`.bulk_yield`) only meet here:
what one side writes under a key below, the other reads. ``benchmarks/load.py`` names the same keys
without importing Django.
"""
from __future__ import annotations

import functools
import logging

import redis
from django.conf import settings
from kombu.transport.redis import Channel

from project import lanes
from project.celery import app

log = logging.getLogger(__name__)

#: ``"<DEPLOYMENT_NAME>:"``: the start of every Redis key this deployment writes (settings.REDIS_KEY_PREFIX).
PREFIX = settings.REDIS_KEY_PREFIX


def key(name: str) -> str:
    """The Redis key ``name`` of this deployment: ``PREFIX + name`` (kombu's ``unacked``, a lock...)."""
    return PREFIX + name


# --- the interactive lane's workers ---------------------------------------------------------------

#: Hash ``{task id: "images started_unix_s"}`` of interactive tasks running now.
INFLIGHT_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:inflight"
#: Hash ``{batcher: "images started_unix_s expected_ms"}`` of the forward passes the interactive
#: workers' dynamic batchers run now (``reports.interactive_pass``); ``expected_ms`` 0: not known yet.
PASSES_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:passes"
#: Hash ``{worker hostname: JSON}`` written by every interactive worker: its measured capacity
#: (images/s), service figures and when it last reported (``reports.interactive_report``).
WORKERS_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:workers"
#: Capped list of JSON batch records (newest last), for benchmarks and diagnosis.
BATCHES_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:batches"
BATCHES_KEPT = 20_000

#: Capped list of JSON hop records of interactive requests, newest last, written only with
#: ``HOP_TRACE`` (``lane_control.hops``): one per web request and one per task it set off, joined by
#: the chain's root task id.
HOPS_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:hops"
HOPS_KEPT = 20_000

# --- what the web admitted, answered and refused --------------------------------------------------

#: Capped list of JSON records of answered interactive requests, newest last
#: (``admission.interactive_answered``).
ANSWERS_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:answers"
ANSWERS_KEPT = 5_000
#: Newest answers the web reads on each admission (the fit only uses those of
#: ``wait_model.FIT_WINDOW_S``).
ANSWERS_READ = 128
#: Hash ``{token: JSON}`` of admitted requests not answered yet (``admitted``, ``work_s``,
#: ``predicted_s``, ``deadline_s``, ``bulk_at_admission``): one that has waited longer than
#: predicted is a lower bound of its wait, known before its answer (``wait_model.fit_wait``'s
#: ``pending``), so a machine that slows is seen after the predicted wait, not after the whole one.
PENDING_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:pending"
#: Capped list of ``wait − work_s`` (s) of the last :data:`LONE_KEPT` requests answered 200 that had
#: nothing ahead of them (``ahead`` 0): the overhead every request pays, measured where nothing else
#: explains the wait; the fit's intercept is pulled to their mean (``wait_model._solve``).
LONE_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:lone"
LONE_KEPT = 16
#: Same as :data:`LONE_KEY` for lone requests that computed beside bulk passes
#: (``wait_model.beside_bulk``): the overhead of a lone request while the cores are shared.
LONE_BULK_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:lone-bulk"
#: Capped list of JSON records of the interactive lane's refusals, newest last: when (``t``, Unix
#: s), their deadline and their ``wait_ahead.FEATURES``, which ``wait_ahead.fit_wait_ahead`` labels
#: with the waits of the requests admitted around them. Sized for a minute of refusals at ~8/s.
REFUSALS_KEY = f"{PREFIX}lanes:{lanes.INTERACTIVE}:refusals"
REFUSALS_KEPT = 1_024
#: Newest answers read to label refusals: ``wait_ahead.FIT_WINDOW_S`` of them at up to ~17/s.
LABEL_ANSWERS_READ = 1_024

# --- the bulk lane ----------------------------------------------------------------------------------

#: Hash ``{bulk process: "since_unix_s"}`` (`` y`` appended when the chunk yields to the interactive
#: lane) of the bulk chunks computing now, written by ``bulk_yield.BulkActivity``: cleared while a
#: chunk waits for the interactive lane (parked) and when it ends. The web reads it on each
#: admission (``LaneLoad.beside_bulk``) to pick the wait fit learnt in the same regime.
BULK_ACTIVITY_KEY = f"{PREFIX}lanes:{lanes.BULK}:activity"
#: Capped list of ``"start end"`` (Unix s) of the bulk chunks' finished computing intervals, newest
#: last: an answer's wait is labelled with its overlap with them (``bulk_s``,
#: ``admission.interactive_answered``).
BULK_RUNS_KEY = f"{PREFIX}lanes:{lanes.BULK}:runs"
BULK_RUNS_KEPT = 256
#: Newest computing intervals read to label an answer (a minute of micro-batches and more).
BULK_RUNS_READ = 64
#: Prefix of the migration slots of one worker host: ``{prefix}{hostname}:{n}`` (``bulk_yield.migration_slot``).
MIGRATION_SLOT_KEY = f"{PREFIX}lanes:{lanes.BULK}:migration-slot:"

# --- readiness (embeddings.services.readiness) ------------------------------------------------------

#: Hash ``{"<lane>|<worker hostname>": "seen_unix_s"}``: each worker's main process says, every
#: few seconds, which lanes it consumes (``readiness.presence_start``); a lane with no fresh entry has
#: no worker.
PRESENCE_KEY = f"{PREFIX}health:workers"
#: Hash ``{"<lane>|<worker hostname>": JSON}``: each worker's latest canary answer (``ok``, ``at``,
#: ``seconds``, ``reason``), written by ``readiness.canary_answer``, read by ``/readyz``.
CANARY_KEY = f"{PREFIX}health:canary"
#: Prefix of ``{prefix}{lane}``: set (with an expiry of ``CANARY_INTERVAL_S``) when a canary is sent
#: to the lane, so every web process together sends one per interval whatever probes them.
CANARY_SENT_KEY = f"{PREFIX}health:canary-sent:"


@functools.cache
def _client(url: str):

    # Short timeouts: lane control must never be what makes a request slow.
    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, decode_responses=True)


def redis_client():
    """The process's Redis client for ``settings.REDIS_URL`` (the broker's server)."""
    return _client(settings.REDIS_URL)


def queue_keys(queue: str) -> list[str]:
    """Redis list names kombu uses for ``queue``, one per priority step, highest priority first.

    Mirrors ``kombu.transport.redis.Channel._q_for_pri`` with its ``global_keyprefix`` (:data:`PREFIX`):
    step 0 is the prefixed queue name, the others are ``f"{PREFIX}{queue}{Channel.sep}{step}"``.
    """

    steps = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("priority_steps", [0, 3, 6, 9])
    return [PREFIX + (queue if step == 0 else f"{queue}{Channel.sep}{step}") for step in steps]


def vectors_interactive_waiting(client=None) -> int:
    """Interactive messages (priority step 0: searches, interactive index writes) waiting in the
    ``vectors`` queue now; bulk index writes travel at steps 6/9, so they are never counted.

    Read by the vectors worker between slices of a bulk chunk's write (``queues.vectors.chunk_index``).
    Returns 0 when Redis cannot be read (the chunk then simply carries on) or under eager Celery.
    """

    if app.conf.task_always_eager:
        return 0
    try:
        return int((client or redis_client()).llen(queue_keys(lanes.VECTORS)[0]))
    except Exception as e:  # noqa: BLE001 - a probe: never what fails a write
        log.warning("cannot read the vectors queue's length: %s", e)
        return 0


def stale_after_s() -> float:
    """Age (s) past which an interactive entry (in flight, pending, a running pass) belongs to a
    process that died: a task ends within its deadline (the batcher drops it after) plus decode."""
    return 2 * settings.INTERACTIVE_DEADLINE_S + 30


def bulk_stale_after_s() -> float:
    """Age (s) past which a :data:`BULK_ACTIVITY_KEY` mark belongs to a killed process. A chunk
    refreshes its mark before each micro-batch, but one that computes in a single pass (an urgent
    job's whole chunk) may hold it for tens of seconds on a small CPU."""
    return max(stale_after_s(), 120.0)
