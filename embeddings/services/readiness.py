"""Readiness: whether this deployment can do its work now, lane by lane (``GET /readyz``).

``/healthz`` says the web process answers; ``/readyz`` says the service works: the database and
Redis answer, the vector store answers, and each lane has a worker whose model works. A model that
loads and then produces nothing (a wedged GPU, a poisoned batch) keeps its process alive; only
running it shows that. So each lane's workers answer **canaries**:

- The web sends one canary task to each lane at most every ``CANARY_INTERVAL_S`` (one per interval
  for every web process together: :data:`~embeddings.lane_control.lane_control.CANARY_SENT_KEY`), while
  something asks ``/readyz``; at priority 0, expiring after an interval, so it never waits behind
  bulk chunks nor piles up where no worker takes it.
- The worker that takes it (:func:`canary_answer`) embeds a tiny picture and a text with its lane's
  own path (the interactive lane through its dynamic batcher, the bulk lane through its batch runner),
  checks each vector is finite and of unit length and that it took at most ``CANARY_TIMEOUT_S``, and
  records the outcome under its name (:data:`~embeddings.lane_control.lane_control.CANARY_KEY`). The vectors
  lane answers with a call to the store (its count), the fetch lane by answering (no model).
- Each worker's main process says which lanes it consumes every :data:`PRESENCE_EVERY_S`
  (:func:`presence_start`), so ``/readyz`` tells "no worker" from "no working worker".

A lane is **working** while one of its workers' latest answers is a success within
``CANARY_MAX_AGE_S``. A lane of ``READY_LANES`` that is not working fails readiness; a lane left out
(the bulk lane, scaled to zero while idle) fails it only when it has workers and all their recent
answers are failures. A lane with no worker is sent no canary unless it is required, so a canary
never wakes an autoscaled lane.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time

import cv2
import numpy as np
from django.conf import settings
from django.db import connection

from embeddings import dispatch, lane_control, runtime, worker_health
from project import lanes
from project.celery import app
from workers import screen

log = logging.getLogger(__name__)

#: Seconds between a worker's presence reports; an entry older than :data:`PRESENCE_STALE` of them is gone.
PRESENCE_EVERY_S = 5.0
PRESENCE_STALE = 3
#: What a canary embeds: a text, and a 64 × 64 picture (a colour gradient, PNG-encoded) built at first use.
CANARY_TEXT = "a photo of a dog"
CANARY_SIDE = 64
#: A vector's L2 norm may be this far from 1 (fp16 towers round the normalised output).
UNIT_TOLERANCE = 1e-2
#: The lanes whose canary runs the model.
MODEL_LANES = (lanes.INTERACTIVE, lanes.BULK)

#: Stable codes of a failed check, in ``/readyz``'s ``failed`` list.
DATABASE_UNAVAILABLE = "database_unavailable"
REDIS_UNAVAILABLE = "redis_unavailable"
STORE_UNAVAILABLE = "store_unavailable"
LANE_NO_WORKER = "lane_no_worker"
LANE_CANARY_FAILED = "lane_canary_failed"
LANE_CANARY_STALE = "lane_canary_stale"


# --- the worker's side ------------------------------------------------------------------------------

def canary_picture() -> bytes:
    """PNG bytes of the canary's picture: a ``CANARY_SIDE``² gradient in three colours."""
    ramp = np.linspace(0, 255, CANARY_SIDE, dtype=np.float32)
    pixels = np.stack([np.add.outer(ramp, ramp) / 2, np.tile(ramp, (CANARY_SIDE, 1)),
                       np.tile(ramp[::-1, None], (1, CANARY_SIDE))], axis=-1).astype(np.uint8)
    ok, png = cv2.imencode(".png", pixels)
    if not ok:
        raise RuntimeError("OpenCV could not encode the canary's picture")
    return png.tobytes()


def vector_fault(vector) -> str | None:
    """Why a canary's vector ``(D,)`` is wrong (not finite, zero, or not of unit length), or ``None``."""
    reason = screen.fault(vector)
    if reason is not None:
        return reason.value
    norm = float(np.linalg.norm(np.asarray(vector, dtype=np.float64)))
    if abs(norm - 1.0) > UNIT_TOLERANCE:
        return f"vector_not_unit (norm {norm:.4f})"
    return None


def _embed_canary(lane: str) -> None:
    """Embed the canary picture and text on ``lane``'s own path in this process.

    Raises:
        RuntimeError: a vector is wrong, or the picture did not reach the model (the message says why).
    """
    model_id = runtime.model_id()
    runner = runtime.batch_runner(model_id)
    picture = canary_picture()
    prepared = runner.prepare(["canary"], lambda key: picture)
    if prepared.failed:
        raise RuntimeError(f"canary picture refused before the model: {prepared.failed[0].reason}")
    if lane == lanes.INTERACTIVE:
        vectors = runtime.dynamic_batcher(model_id).embed(prepared.pixels,
                                                          deadline=time.time() + settings.CANARY_TIMEOUT_S)
    else:
        # the interactive lane's passes are judged by its batcher (embeddings.runtime); the others here
        result = _judged(lambda: runner.embed(prepared))
        if result.failed:
            worker_health.pass_failed(f"canary picture's vector refused: {result.failed[0].reason}")
            raise RuntimeError(f"canary picture's vector refused: {result.failed[0].reason}")
        worker_health.pass_succeeded()
        vectors = result.vectors
    encoder = runtime.encoder_holder(model_id).get()
    texts = np.empty((0, 1))
    if encoder.has_text:
        texts = _judged(lambda: encoder.encode_texts([CANARY_TEXT]))
        worker_health.judge_vectors(texts)
    for what, v in (("picture", vectors[0]), *(("text", t) for t in texts)):
        if (fault := vector_fault(v)) is not None:
            raise RuntimeError(f"canary {what}: {fault}")


def _judged(compute):
    """``compute()``, its exception counted as a failed pass (``worker_health``) and raised again."""
    try:
        return compute()
    except Exception as e:
        worker_health.pass_failed(f"canary: {type(e).__name__}: {e}")
        raise


def canary_answer(*, lane: str, worker: str, sent_at: float) -> dict:
    """Answer a canary sent to ``lane`` at ``sent_at`` (Unix s) in this worker (``worker``: its
    Celery hostname) and record the outcome for ``/readyz``.

    Returns:
        ``{"ok": bool, "at": Unix s, "seconds": time it took, "reason": why it failed ("" when ok),
        "sent_at": sent_at}``. Never raises: a failure is the answer. Each pass of the model it runs
        counts in ``embeddings.worker_health`` (the picture's and the text's: two per canary).
    """
    started = time.monotonic()
    reason = ""
    try:
        if lane in MODEL_LANES:
            _embed_canary(lane)
        elif lane == lanes.VECTORS:
            runtime.vector_store(runtime.model_id()).count()
    except Exception as e:  # noqa: BLE001 - the failure is the canary's answer
        reason = f"{type(e).__name__}: {e}"[:500]
    seconds = time.monotonic() - started
    if not reason and seconds > settings.CANARY_TIMEOUT_S:
        reason = f"took {seconds:.1f} s, over CANARY_TIMEOUT_S ({settings.CANARY_TIMEOUT_S:g} s)"
    answer = {"ok": not reason, "at": time.time(), "seconds": round(seconds, 3), "reason": reason, "sent_at": sent_at}
    try:
        lane_control.redis_client().hset(lane_control.CANARY_KEY, f"{lane}|{worker}", json.dumps(answer))
    except Exception as e:  # noqa: BLE001 - Redis down: /readyz sees that itself
        log.warning("canary answer of %s on %s not recorded: %s", worker, lane, e)
    return answer


def presence_start(*, queues: set[str], worker: str) -> threading.Thread:
    """Start a daemon thread that records, every :data:`PRESENCE_EVERY_S`, that ``worker`` consumes
    ``queues`` (its lanes). Returns the thread."""
    fields = [f"{q}|{worker}" for q in sorted(queues) if q in lanes.ALL_QUEUES]

    def loop() -> None:
        while True:
            try:
                now = str(time.time())
                lane_control.redis_client().hset(lane_control.PRESENCE_KEY, mapping=dict.fromkeys(fields, now))
            except Exception as e:  # noqa: BLE001 - Redis away: say so, try again
                log.warning("presence of %s not recorded: %s", worker, e)
            time.sleep(PRESENCE_EVERY_S)

    thread = threading.Thread(target=loop, name="presence", daemon=True)
    thread.start()
    return thread


def presence_end(*, queues: set[str], worker: str) -> None:
    """Remove ``worker``'s presence (it stops): its lanes stop counting it at once."""
    fields = [f"{q}|{worker}" for q in queues]
    if fields:
        try:
            lane_control.redis_client().hdel(lane_control.PRESENCE_KEY, *fields)
        except Exception as e:  # noqa: BLE001 - the entry goes stale by itself
            log.warning("presence of %s not removed: %s", worker, e)


# --- the web's side ----------------------------------------------------------------------------------

def canary_send(*, lane_names, now: float) -> list[str]:
    """Send a canary to each of ``lane_names`` that was sent none within ``CANARY_INTERVAL_S``
    (by any web process). Not under eager Celery (tests): it would run the model in the caller.

    Returns:
        The lanes sent one now.
    """
    if app.conf.task_always_eager:
        return []
    client, sent = lane_control.redis_client(), []
    interval = max(1, math.ceil(settings.CANARY_INTERVAL_S))
    for lane in lane_names:
        if client.set(lane_control.CANARY_SENT_KEY + lane, str(now), nx=True, ex=interval):
            dispatch.send_canary(lane=lane, sent_at=now, expires_s=interval)
            sent.append(lane)
    return sent


def _by_lane(raw: dict, parse) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {lane: {} for lane in lanes.ALL_QUEUES}
    for field, value in raw.items():
        lane, _, worker = field.partition("|")
        if lane in out:
            try:
                out[lane][worker] = parse(value)
            except (ValueError, TypeError):
                continue
    return out


def lane_states(*, now: float) -> dict[str, dict]:
    """Each lane's state from Redis: ``{lane: {"ok", "required", "workers", "last_ok_s", "detail",
    "code"}}`` (``code`` the failure's, ``None`` when the lane passes; ``last_ok_s``: seconds since
    its last successful canary, ``None``: none within ``CANARY_MAX_AGE_S``).

    Raises:
        redis.RedisError: Redis cannot be read.
    """
    client = lane_control.redis_client()
    presence = _by_lane(client.hgetall(lane_control.PRESENCE_KEY), float)
    answers = _by_lane(client.hgetall(lane_control.CANARY_KEY), json.loads)
    fresh_presence = PRESENCE_EVERY_S * PRESENCE_STALE
    max_age = settings.CANARY_MAX_AGE_S
    stale = [f"{lane}|{w}" for lane, ws in presence.items() for w, t in ws.items() if now - t > fresh_presence]
    if stale:
        client.hdel(lane_control.PRESENCE_KEY, *stale)
    states = {}
    for lane in lanes.ALL_QUEUES:
        workers = sorted(w for w, t in presence[lane].items() if now - t <= fresh_presence)
        recent = {w: a for w, a in answers[lane].items() if now - a.get("at", 0) <= max_age}
        ok_at = [a["at"] for a in recent.values() if a.get("ok")]
        failures = [a for a in recent.values() if not a.get("ok")]
        required = lane in settings.READY_LANES
        state = {"required": required, "workers": len(workers),
                 "last_ok_s": round(now - max(ok_at), 1) if ok_at else None, "code": None, "detail": ""}
        if ok_at:
            state["detail"] = f"a worker answered a canary {state['last_ok_s']:g} s ago"
        elif failures:
            last = max(failures, key=lambda a: a.get("at", 0))
            state["code"] = LANE_CANARY_FAILED
            state["detail"] = f"no worker of the lane works: its last canary failed: {last.get('reason')}"
        elif required and not workers:
            state["code"] = LANE_NO_WORKER
            state["detail"] = "no worker consumes the lane"
        elif required:
            state["code"] = LANE_CANARY_STALE
            state["detail"] = (f"{len(workers)} worker(s) consume the lane, none answered a canary within "
                               f"{max_age:g} s (CANARY_MAX_AGE_S)")
        else:
            state["detail"] = "not required (READY_LANES), no worker" if not workers else "no canary answered yet"
        if state["code"] == LANE_CANARY_FAILED and not required and not workers:
            state["code"] = None  # answers of workers gone since: the lane is idle, not broken
        state["ok"] = state["code"] is None
        states[lane] = state
    return states


def _store_check(states: dict | None) -> tuple[bool, str]:
    """The vector store: a Qdrant server answers the web itself (it searches it directly); the
    embedded store answers through its one owner, the vectors lane, whose canary calls it."""
    if settings.VECTOR_STORE == "server":
        try:
            runtime.vector_store(runtime.model_id()).count()
            return True, f"the Qdrant server at {settings.QDRANT_URL} answers"
        except Exception as e:  # noqa: BLE001 - the failure is the check's answer
            return False, f"the Qdrant server at {settings.QDRANT_URL} does not answer: {type(e).__name__}: {e}"[:500]
    if states is None:
        return False, "the embedded store answers through the vectors lane, and Redis cannot be read"
    vectors = states[lanes.VECTORS]
    if vectors["last_ok_s"] is not None:
        owner = "interactive" if lane_control.owner_runs_threads() else "vectors"
        return True, f"the {owner} worker called the {settings.VECTOR_STORE} store {vectors['last_ok_s']:g} s ago"
    return False, f"the {settings.VECTOR_STORE} store answers through the vectors lane: {vectors['detail']}"


def readiness(*, now: float | None = None) -> tuple[bool, dict]:
    """Every check of ``/readyz``, and the canaries due (:func:`canary_send`).

    Returns:
        ``(ready, body)``; body ``{"ready": bool, "checks": {"database", "redis", "store": {"ok",
        "detail"}, "lanes": {lane: state (see :func:`lane_states`)}}, "failed": [{"check",
        "code", "detail"}, ...]}``, a check name being ``database``, ``redis``, ``store`` or
        ``lane:<name>``. Never raises: an unreachable dependency is a failed check.
    """
    now = time.time() if now is None else now
    checks: dict = {}
    failed: list[dict] = []

    def check(name: str, ok: bool, detail: str, code: str) -> None:
        checks[name] = {"ok": ok, "detail": detail}
        if not ok:
            failed.append({"check": name, "code": code, "detail": detail})

    try:
        connection.ensure_connection()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        check("database", True, "answers", DATABASE_UNAVAILABLE)
    except Exception as e:  # noqa: BLE001 - the failure is the check's answer
        check("database", False, f"{type(e).__name__}: {e}"[:500], DATABASE_UNAVAILABLE)
    states = None
    try:
        lane_control.redis_client().ping()
        states = lane_states(now=now)
        check("redis", True, "answers", REDIS_UNAVAILABLE)
    except Exception as e:  # noqa: BLE001 - the failure is the check's answer
        check("redis", False, f"{type(e).__name__}: {e}"[:500], REDIS_UNAVAILABLE)
    ok, detail = _store_check(states)
    check("store", ok, detail, STORE_UNAVAILABLE)
    checks["lanes"] = states or {}
    for lane, state in (states or {}).items():
        if not state["ok"]:
            failed.append({"check": f"lane:{lane}", "code": state["code"], "detail": state["detail"]})
    if states is not None:
        due = [lane for lane, s in states.items() if s["required"] or s["workers"]]
        try:
            canary_send(lane_names=due, now=now)
        except Exception as e:  # noqa: BLE001 - the next probe sends them
            log.warning("canaries not sent: %s", e)
    return not failed, {"ready": not failed, "checks": checks, "failed": failed}
