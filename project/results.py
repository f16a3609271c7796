"""Celery's Redis result backend, with one rule added: a result that someone waits for until a
deadline is kept no longer than that deadline (plus :data:`RESULT_MARGIN_S`), whoever reads it.

Celery keeps every stored result for ``result_expires`` (one setting for all tasks; there is no
per-task expiry). A search's or an upload's result carries query vectors and neighbours; the web
forgets it once read (``services.interactive.waiting``), but a request whose deadline passed never reads it.
So each message whose result is waited for names the time after which nobody will
(:data:`RESULT_DEADLINE_HEADER`, set by ``embeddings.dispatch``), and this backend writes that
result (success, failure or revocation) with ``SETEX`` to then, in the same single command Celery
sends. Messages without the header keep Celery's ``result_expires``.

A result is stored in one round trip to Redis (:data:`STORE_SCRIPT`): Celery's own store reads the
key first (a GET, so that a late duplicate never overwrites a SUCCESS) and then writes and publishes
it (a second round trip). The script does the same three steps inside Redis, atomically, so the
answer a waiting request reads leaves the worker one round trip sooner (docs/benchmarks-lanes.md).

Configured as ``CELERY_RESULT_BACKEND = "project.results:DeadlineRedisBackend+" + REDIS_URL``
(Celery's ``<class>+<url>`` form).
"""
from __future__ import annotations

import math
import threading
import time

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str
from kombu.utils.objects import cached_property

#: Message header: Unix time (s) after which nobody reads the task's result.
RESULT_DEADLINE_HEADER = "result_deadline"
#: Seconds a result outlives its deadline: the clocks of the web's and the worker's hosts may
#: differ by this much (NTP keeps them within milliseconds; 5 s is room for a host without it).
RESULT_MARGIN_S = 5


def result_deadline(request) -> float | None:
    """The :data:`RESULT_DEADLINE_HEADER` (Unix s) of a task's request context, or None.

    A worker's request has the message's custom headers as ``request.headers`` (and as attributes);
    the context Celery builds for the later tasks of a failed chain has the signature's options,
    whose ``headers`` are the same dict."""
    headers = getattr(request, "headers", None)
    value = headers.get(RESULT_DEADLINE_HEADER) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, RESULT_DEADLINE_HEADER, None)
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def result_ttl(deadline_ts: float, *, now: float, ceiling_s: int | None) -> int:
    """Whole seconds to keep a result whose readers stop at ``deadline_ts`` (Unix s): until the
    deadline plus :data:`RESULT_MARGIN_S`, at least 1 (Redis refuses 0), at most ``ceiling_s``
    (``result_expires``; None or 0: no ceiling)."""
    ttl = max(1, math.ceil(deadline_ts + RESULT_MARGIN_S - now))
    return min(ttl, ceiling_s) if ceiling_s else ttl


#: Store a result the way Celery's key-value backend does (``BaseKeyValueStoreBackend._store_result``
#: then ``RedisBackend._set``), in one call: leave a stored SUCCESS alone (a lost worker's late
#: duplicate must not overwrite it), else SET (SETEX when ARGV[2] > 0 s) and PUBLISH to the key's
#: channel, where a waiting ``AsyncResult.get`` listens. KEYS[1]: the result key; ARGV[1]: the encoded
#: meta (JSON); ARGV[2]: seconds to keep it, 0 = forever. Returns 1 when written, 0 when left alone.
STORE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' and meta['status'] == 'SUCCESS' then
    return 0
  end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SETEX', KEYS[1], ttl, ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
"""


class DeadlineRedisBackend(RedisBackend):
    """:class:`RedisBackend` that stores a result whose message carries
    :data:`RESULT_DEADLINE_HEADER` with an expiry of :func:`result_ttl` instead of ``result_expires``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the expiry chosen for the result this thread is storing (a threads pool stores from many)
        self._storing = threading.local()

    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        deadline = result_deadline(request)
        ttl = None if deadline is None else result_ttl(deadline, now=time.time(), ceiling_s=self.expires)
        if self.serializer != "json":  # the script reads the stored status as JSON: Celery's two round trips
            self._storing.ttl = ttl
            try:
                return super()._store_result(task_id, result, state, traceback, request, **kwargs)
            finally:
                self._storing.ttl = None
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        if ttl is None:
            ttl = self.failure_expires if state == states.FAILURE and self.failure_expires else self.expires
        elif state == states.FAILURE and self.failure_expires:
            ttl = min(ttl, self.failure_expires)
        key = self.get_key_for_task(task_id)
        self.ensure(self._store_once, (key, value, int(ttl or 0)))
        return result

    @cached_property
    def _store_script(self):
        """:data:`STORE_SCRIPT` on this backend's client (EVALSHA; redis-py loads the script where
        Redis does not hold it)."""
        return self.client.register_script(STORE_SCRIPT)

    def _store_once(self, key, value, ttl_s: int) -> int:
        return self._store_script(keys=[key], args=[value, ttl_s])

    def _set_with_state(self, key, value, state):
        ttl = getattr(self._storing, "ttl", None)
        if ttl is None:
            return super()._set_with_state(key, value, state)
        if state == states.FAILURE and self.failure_expires:
            ttl = min(ttl, self.failure_expires)
        return self.set(key, value, expires=ttl)
