"""Per-key limits, enforced in Redis so every web process counts the same (docs/api-keys.md).

- requests per minute and interactive images per minute: a counter per key that starts its minute
  at the first request it counts and expires with it; one Lua script reads, compares and adds, so
  two web processes never admit more than the limit between them. A request that would take the
  counter over the limit is refused and adds nothing.
- bulk images per day: the same counter over the UTC day; a job is admitted while its images fit
  (a manifest's or prefix's images are not known at submission: it is admitted while the day's count
  is under the limit and is not counted later; docs/api-keys.md).
- concurrent bulk jobs: a sorted set per key of its unfinished jobs (and of submissions under way),
  checked against the database and added to under a short per-key Redis lock.

Only requests authenticated by an :class:`~embeddings.models.ApiKey` are limited. When Redis cannot
be reached the request is admitted with a warning: the broker is on the same server, so the service
is failing anyway, and refusing every caller would only hide why.
"""
from __future__ import annotations

import datetime as dt
import logging
import math
import time
import uuid
from dataclasses import dataclass

from embeddings.errors import ApplicationError
from embeddings.lane_control.keys import key as redis_key
from embeddings.lane_control.keys import redis_client
from embeddings.models import ApiKey, Job, JobStatus

log = logging.getLogger(__name__)

#: Counter window (ms) of the per-minute limits.
MINUTE_MS = 60_000
#: A submission's reservation of a bulk-job slot counts as a running job this long (s) at most:
#: a web process that died between reserving and making the job frees its slot after it.
RESERVATION_S = 600.0
#: The per-key lock around a bulk-job slot check is held at most this long (ms) and waited for at most
#: :data:`LOCK_WAIT_S`.
LOCK_MS = 5_000
LOCK_WAIT_S = 5.0
#: Retry-After (s) of a refusal for concurrent jobs: when one of the key's jobs ends is not known, so
#: this is a polling interval, and ``extra.running_jobs`` names them.
JOB_POLL_S = 30
#: A job's score in its key's set: far in the future, so that only reservations age out.
FOREVER_S = 100 * 365 * 86400.0

# KEYS[1]: the counter. ARGV: amount, limit, window (ms). Returns {admitted 0/1, count, ms to reset}.
_WINDOW_LUA = """
local n = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then ttl = tonumber(ARGV[3]) end
if c + n > limit then return {0, c, ttl} end
c = redis.call('INCRBY', KEYS[1], n)
if c == n then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return {1, c, ttl}
"""
_UNLOCK_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_scripts: dict = {}


def _script(client, source: str):
    found = _scripts.get((id(client), source))
    if found is None:
        found = _scripts[(id(client), source)] = client.register_script(source)
    return found


@dataclass(frozen=True)
class Window:
    """One counter's state after a check: its ``limit``, what is ``remaining`` and seconds to ``reset_s``."""

    limit: int
    remaining: int
    reset_s: float

    def headers(self, kind: str) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-{limit,remaining,reset}-<kind>`` (reset as ``"<seconds>s"``)."""
        return {f"x-ratelimit-limit-{kind}": str(self.limit), f"x-ratelimit-remaining-{kind}": str(self.remaining),
                f"x-ratelimit-reset-{kind}": f"{math.ceil(self.reset_s)}s"}


def _counter(name: str, key: ApiKey) -> str:
    return redis_key(f"access:{key.pk}:{name}")


def _take(counter: str, amount: int, limit: int, window_ms: int) -> tuple[bool, int, float] | None:
    """Add ``amount`` to ``counter`` if it stays within ``limit``: ``(admitted, count, seconds to
    reset)``; ``None`` when Redis cannot be reached (logged)."""
    try:
        admitted, count, ttl = _script(redis_client(), _WINDOW_LUA)(keys=[counter], args=[amount, limit, window_ms])
    except Exception as e:  # noqa: BLE001 - a limit never fails a request on its own
        log.warning("per-key limit not checked (Redis): %s", e)
        return None
    return bool(admitted), int(count), max(int(ttl), 0) / 1000


def _admit(key: ApiKey, counter: str, limit_name: str, what: str, kind: str, amount: int, window_ms: int, *,
           room: int | None = None) -> dict[str, str]:
    """:func:`_take` of ``amount`` under ``key``'s limit ``limit_name`` (``room``: the limit the
    counter is compared with, when not the limit itself): the ``x-ratelimit-*-<kind>`` headers, none
    when Redis cannot be reached.

    Raises:
        ApplicationError: 429 ``rate_limited`` (:func:`_refusal`, ``what`` names the limit).
    """
    limit = key.limit(limit_name)
    taken = _take(_counter(counter, key), amount, limit if room is None else room, window_ms)
    if taken is None:
        return {}
    admitted, count, reset_s = taken
    w = Window(limit, max(0, limit - count), reset_s)
    if not admitted:
        raise _refusal(what, limit_name, w, kind, amount)
    return w.headers(kind)


def _refusal(what: str, limit_name: str, w: Window, kind: str, amount: int) -> ApplicationError:
    retry = max(1, math.ceil(w.reset_s))
    return ApplicationError(
        f"this key's {what} limit ({w.limit}) is reached: retry after {retry} s", code="rate_limited", status=429,
        extra={"limit": limit_name, "value": w.limit, "remaining": w.remaining, "requested": amount,
               "retry_after_s": retry},
        headers={"Retry-After": str(retry), **w.headers(kind)})


def _too_big(what: str, limit_name: str, limit: int, amount: int) -> ApplicationError:
    return ApplicationError(f"{amount} {what} in one request: more than this key's limit ({limit}); a retry "
                            f"cannot help, send fewer", code="exceeds_key_limit", status=413,
                            extra={"limit": limit_name, "value": limit, "requested": amount})


def request_admit(*, key: ApiKey) -> dict[str, str]:
    """Count one request of ``key``: the ``x-ratelimit-*-requests`` headers of the answer.

    Raises:
        ApplicationError: 429 ``rate_limited`` with ``Retry-After`` (whole seconds to the window's reset).
    """
    return _admit(key, "requests", "requests_per_minute", "requests per minute", "requests", 1, MINUTE_MS)


def images_admit(*, key: ApiKey, images: int) -> dict[str, str]:
    """Count ``images`` interactive images of ``key``: the ``x-ratelimit-*-images`` headers.

    Raises:
        ApplicationError: 429 ``rate_limited`` (``Retry-After``); 413 ``exceeds_key_limit`` when
            ``images`` alone is over the limit.
    """
    limit = key.limit("images_per_minute")
    if images <= 0:
        return {}
    if images > limit:
        raise _too_big("images", "images_per_minute", limit, images)
    return _admit(key, "images", "images_per_minute", "interactive images per minute", "images", images,
                  MINUTE_MS)


def _day_left_ms(now: float) -> int:
    today = dt.datetime.fromtimestamp(now, dt.UTC).date()
    midnight = dt.datetime.combine(today + dt.timedelta(days=1), dt.time(), dt.UTC).timestamp()
    return max(1, int((midnight - now) * 1000))


def bulk_images_admit(*, key: ApiKey, images: int) -> dict[str, str]:
    """Count ``images`` bulk images of ``key`` against the UTC day's limit (``images`` 0: a job
    whose images are not known at submission, admitted while the day's count is under the limit):
    the ``x-ratelimit-*-bulk-images`` headers.

    Raises:
        ApplicationError: 429 ``rate_limited`` (``Retry-After``: to the next UTC midnight); 413
            ``exceeds_key_limit`` when ``images`` alone is over the day's limit.
    """
    limit = key.limit("bulk_images_per_day")
    if images > limit:
        raise _too_big("bulk images", "bulk_images_per_day", limit, images)
    now = time.time()
    day = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y%m%d")
    # an unknown count needs room for one image and takes none
    return _admit(key, f"bulk:{day}", "bulk_images_per_day", "bulk images per day", "bulk-images", images,
                  _day_left_ms(now), room=None if images else limit - 1)


_LIVE = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PAUSED)


class JobSlot:
    """A reservation of one of ``key``'s concurrent bulk jobs, made by :func:`job_slot_reserve`:
    :meth:`fill` with the job made, or :meth:`release` when none was made."""

    def __init__(self, key: ApiKey | None, member: str | None) -> None:
        self.key, self.member = key, member

    def fill(self, job_id) -> None:
        if self.key is None or self.member is None:
            return
        try:
            client = redis_client()
            jobs = _counter("jobs", self.key)
            client.zrem(jobs, self.member)
            client.zadd(jobs, {f"job:{job_id}": time.time() + FOREVER_S})
        except Exception as e:  # noqa: BLE001
            log.warning("bulk job %s not recorded for its key's limit (Redis): %s", job_id, e)

    def release(self) -> None:
        if self.key is None or self.member is None:
            return
        try:
            redis_client().zrem(_counter("jobs", self.key), self.member)
        except Exception as e:  # noqa: BLE001
            log.warning("bulk job reservation not released (Redis): %s", e)


def job_slot_reserve(*, key: ApiKey | None) -> JobSlot:
    """Reserve one of ``key``'s concurrent bulk jobs (``None``: not a key, nothing reserved).

    The key's set holds its jobs (``job:<uuid>``) and reservations (``slot:<uuid>``, live for
    :data:`RESERVATION_S`); under a per-key lock the finished jobs are dropped (read from the
    database) and the rest counted.

    Raises:
        ApplicationError: 429 ``rate_limited`` (``extra.running_jobs``: up to 10 of their ids,
            ``Retry-After`` :data:`JOB_POLL_S`).
    """
    if key is None:
        return JobSlot(None, None)
    limit = key.limit("concurrent_bulk_jobs")
    jobs, lock = _counter("jobs", key), _counter("jobs-lock", key)
    token = uuid.uuid4().hex
    try:
        client = redis_client()
        deadline = time.monotonic() + LOCK_WAIT_S
        while not client.set(lock, token, nx=True, px=LOCK_MS):
            if time.monotonic() > deadline:
                raise ApplicationError("this key's bulk submissions are busy: retry", code="rate_limited", status=429,
                                       extra={"limit": "concurrent_bulk_jobs", "value": limit, "retry_after_s": 1},
                                       headers={"Retry-After": "1"})
            time.sleep(0.01)
        try:
            now = time.time()
            client.zremrangebyscore(jobs, "-inf", f"({now - RESERVATION_S}")  # reservations only (FOREVER_S)
            members = [m if isinstance(m, str) else m.decode() for m in client.zrange(jobs, 0, -1)]
            job_ids = [m.removeprefix("job:") for m in members if m.startswith("job:")]
            live = {str(i) for i in Job.objects.filter(id__in=job_ids, status__in=_LIVE).values_list("id", flat=True)}
            done = [f"job:{i}" for i in job_ids if i not in live]
            if done:
                client.zrem(jobs, *done)
            running = len(live) + sum(m.startswith("slot:") for m in members)
            if running >= limit:
                raise ApplicationError(
                    f"this key has {running} unfinished bulk jobs, its limit ({limit}): retry when one ends",
                    code="rate_limited", status=429,
                    extra={"limit": "concurrent_bulk_jobs", "value": limit, "running_jobs": sorted(live)[:10],
                           "retry_after_s": JOB_POLL_S},
                    headers={"Retry-After": str(JOB_POLL_S)})
            member = f"slot:{token}"
            client.zadd(jobs, {member: now})
        finally:
            _script(client, _UNLOCK_LUA)(keys=[lock], args=[token])
    except ApplicationError:
        raise
    except Exception as e:  # noqa: BLE001
        log.warning("concurrent bulk jobs not checked (Redis): %s", e)
        return JobSlot(None, None)
    return JobSlot(key, member)
