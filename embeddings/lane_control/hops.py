"""Where an interactive request's time goes, hop by hop: records for ``benchmarks.lanes``, written
only when ``HOP_TRACE`` is on (off in production: each record is one Redis write).

A request is traced by its chain's root task id (the first task it sends; Celery gives every task
of a chain that ``root_id``). Each side writes one JSON record to :data:`keys.HOPS_KEY`:

- the web (:class:`HopMiddleware`, :func:`waited`): ``{"side": "web", "id", "path", "start", "sent",
  "got", "end"}``, Unix s: the request entered Django, its work sent (the wait began), its answer
  read, the response rendered;
- every task of the chain (``task_prerun`` / ``task_success`` signals, connected below):
  ``{"side": "task", "id", "task", "start", "end", "notes", "timings"}``: ``start`` when the worker
  began running it, ``end`` after its result was stored and the next message of the chain sent,
  ``notes`` what the task itself marked (:func:`note`: ms of a stage, or Unix s of a moment),
  ``timings`` its result's ``timings`` (the interactive worker's stage ms), if any.

Clocks: the records compare ``time.time()`` of different processes, so a breakdown is exact on one
host and off by the hosts' clock difference (NTP: ms or less) across hosts.
"""
from __future__ import annotations

import json
import threading
import time

from celery.signals import task_prerun, task_success
from django.conf import settings

from embeddings.lane_control import background
from embeddings.lane_control.keys import HOPS_KEPT, HOPS_KEY


_current = threading.local()
_web = threading.local()


def enabled() -> bool:
    """Whether hop records are written (``settings.HOP_TRACE``)."""
    return bool(getattr(settings, "HOP_TRACE", False))


def root_id(result) -> str:
    """The root task id of a sent chain, from its last ``AsyncResult`` (``.parent`` up to the first)."""
    while getattr(result, "parent", None) is not None:
        result = result.parent
    return str(result.id)


#: The writer thread of hop records (``background.Writer``): apart from lane control's own, so a
#: benchmark's records never delay the bookkeeping they measure.
records = background.Writer("hop-records")


def _push(record: dict) -> None:
    """Hand ``record`` to this process's writer thread: a record is never written on the path it
    measures (the Redis round trip would be counted in the very latency it breaks down)."""
    raw = json.dumps(record)

    def write(pipe) -> None:
        pipe.rpush(HOPS_KEY, raw)
        pipe.ltrim(HOPS_KEY, -HOPS_KEPT, -1)

    records.put(write)


def flush(timeout_s: float = 5.0) -> None:
    """Wait until every record handed over so far is written, or tried (at most ``timeout_s``)."""
    records.flush(timeout_s)


def waited(result, *, sent: float, got: float) -> None:
    """Mark, in the web, that this request's work (``result``: the last ``AsyncResult`` of the chain
    it sent) was waited for from ``sent`` to ``got`` (Unix s); :class:`HopMiddleware` writes the
    record when the response is rendered. No-op unless enabled."""
    if enabled():
        _web.waits = [*getattr(_web, "waits", ()), (root_id(result), sent, got)]


def web_note(**ms: float) -> None:
    """Mark, in the web, stage durations (ms, summed when marked twice) of this request for its
    hop record (``notes``). No-op unless enabled."""
    if enabled():
        notes = getattr(_web, "notes", None)
        if notes is None:
            notes = _web.notes = {}
        for k, v in ms.items():
            notes[k] = notes.get(k, 0.0) + v


class HopMiddleware:
    """Django middleware (outermost, added by the settings when ``HOP_TRACE`` is on): writes
    ``{"side": "web", "id", "path", "start", "sent", "got", "end", "notes"}`` (Unix s; ``notes``:
    :func:`web_note`) for each wait of the request (:func:`waited`), ``start``/``end`` the
    request's time inside Django, rendering included."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        _web.waits, _web.notes = [], {}
        start = time.time()
        response = self.get_response(request)
        end = time.time()
        for trace, sent, got in _web.waits:
            _push({"side": "web", "id": trace, "path": request.path, "start": start, "sent": sent, "got": got,
                   "end": end, "notes": _web.notes})
        _web.waits, _web.notes = [], {}
        return response


def note(**values: float) -> None:
    """Mark, inside a running task, stage durations (ms, summed when marked twice) or moments (Unix
    s, names ending in ``_at``) for its hop record. No-op unless enabled, or outside a task."""
    notes = getattr(_current, "notes", None)
    if notes is None:
        return
    for k, v in values.items():
        notes[k] = v if k.endswith("_at") else notes.get(k, 0.0) + v


@task_prerun.connect(dispatch_uid="embeddings.lane_control.hops.task_started")
def task_started(task_id=None, task=None, **_) -> None:
    """Start a task's hop record (only interactive-priority work is traced: tasks with a root id
    that the web waits for; bulk work writes nothing)."""
    _current.notes = {} if enabled() else None
    _current.start = time.time()


@task_success.connect(dispatch_uid="embeddings.lane_control.hops.task_answered")
def task_answered(sender=None, result=None, **_) -> None:
    """Write a task's hop record once it has answered: its result stored and its chain's next
    message sent (``task_success``, before ``task_postrun`` and the work after the answer:
    ``embeddings.deferred``)."""
    notes = getattr(_current, "notes", None)
    _current.notes = None
    if notes is None or sender is None:
        return
    name = sender.name.rsplit(".", 1)[-1]
    if name not in TRACED:
        return
    request = sender.request
    timings = result.get("timings") if isinstance(result, dict) and isinstance(result.get("timings"), dict) else None
    _push({"side": "task", "id": str(request.root_id or request.id), "task": name, "start": _current.start,
           "end": time.time(), "notes": notes, "timings": timings})


#: Tasks an interactive request sets off (``embeddings.dispatch``): the only ones recorded.
TRACED = frozenset({"embed_interactive", "index_interactive", "embed_index_interactive", "encode_text",
                    "embed_query", "embed_search", "search_vector", "search_point", "embed_inputs", "search_examples"})
