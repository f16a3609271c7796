"""This host's multiprocess metric files (prometheus-client, ``PROMETHEUS_MULTIPROC_DIR``): read
them for a scrape, after settling the files of processes that have died.

Every process writes ``<type>_<pid>.db`` (gauges ``gauge_<mode>_<pid>.db``) and nothing removes
them: a worker child SIGKILLed by the OOM killer runs no exit hook (Celery's
``worker_process_shutdown`` runs in the child), so its last gauge values would be served, frozen,
and its files would pile up with every replaced child. So before each read, :func:`settle_dead`
finds the pids of the folder that are no longer alive on this host and:

- gauges: removed. prometheus-client's own ``mark_process_dead`` removes the ``live*`` modes (the
  utilisation gauges are ``livemostrecent``: the latest sample of a process still running); a
  gauge of any other mode goes too, for a gauge is what a process measures now;
- counters, histograms, summaries: folded into one ``<type>_dead.db`` per type (the library's
  ``MultiProcessCollector.merge(accumulate=False)``, the form its files hold), then removed, so
  totals never go back when a process dies, as the library intends, and the folder holds one
  file per live process plus at most three.

A pid is alive while ``kill(pid, 0)`` finds it and it is not a zombie. A dead pid reused by a new
process keeps its files until that one dies too (never the reverse: a live process's file is
never touched). The rule needs one pid namespace per folder: one host, or one container
(docker-compose.yml gives each container its own ``METRICS_DIR``). Readers and the settling take
an exclusive ``flock`` on the folder, so a scrape never sees a file half-folded.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re

from prometheus_client import multiprocess
from prometheus_client.mmap_dict import MmapedDict, mmap_key

#: ``counter_123.db``, ``histogram_123.db``, ``gauge_livemostrecent_123.db``: type, gauge mode, pid.
_FILE = re.compile(r"^(counter|histogram|summary|gauge)_(?:([a-z]+)_)?(\d+)\.db$")
#: Types whose values outlive their process (added up); the dead processes' share goes in one file each.
KEPT_TYPES = ("counter", "histogram", "summary")
#: Lock file of the folder (not ``*.db``: the collector reads only those).
_LOCK = ".settle.lock"


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host and is not a zombie (killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]  # after "(comm)", which may hold spaces
    except (OSError, IndexError):
        return True  # no /proc (not Linux) or it just ended: the next scrape decides
    return state != b"Z"


def files_by_pid(path: str) -> dict[int, list[str]]:
    """``{pid: [files]}`` of the per-process files in folder ``path`` (the ``*_dead.db`` files have none)."""
    out: dict[int, list[str]] = {}
    for f in glob.glob(os.path.join(path, "*.db")):
        m = _FILE.match(os.path.basename(f))
        if m:
            out.setdefault(int(m.group(3)), []).append(f)
    return out


def settle_dead(path: str, *, alive=pid_alive) -> list[int]:
    """Settle the files of every dead process in folder ``path`` (see the module docstring).
    Call it holding :func:`folder_lock`.

    Args:
        alive: ``pid → bool`` (default :func:`pid_alive`).

    Returns:
        The pids settled, ascending.
    """
    dead = sorted(pid for pid in files_by_pid(path) if not alive(pid))
    if not dead:
        return []
    for pid in dead:
        multiprocess.mark_process_dead(pid, path)  # the library's own: the live* gauges
    left = files_by_pid(path)
    files = [f for pid in dead for f in left.get(pid, [])]
    for typ in KEPT_TYPES:
        of_type = [f for f in files if os.path.basename(f).startswith(f"{typ}_")]
        if of_type:
            _fold(path, typ, of_type)
    for f in files:  # the other gauges, and the kept files now folded
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)
    return dead


def _fold(path: str, typ: str, files: list[str]) -> None:
    """Add ``files`` (of type ``typ``) into ``<typ>_dead.db``: written whole beside it, then renamed
    over it, so a crash leaves the old sum or the new one."""
    target = os.path.join(path, f"{typ}_dead.db")
    sources = ([target] if os.path.exists(target) else []) + files
    merged = multiprocess.MultiProcessCollector.merge(sources, accumulate=False)
    tmp = os.path.join(path, f".{typ}_dead.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    out = MmapedDict(tmp)
    try:
        for metric in merged:
            for s in metric.samples:
                labels = sorted(s.labels)
                key = mmap_key(metric.name, s.name, labels, [s.labels[k] for k in labels], metric.documentation)
                out.write_value(key, s.value, 0.0)
    finally:
        out.close()
    os.replace(tmp, target)


@contextlib.contextmanager
def folder_lock(path: str):
    """An exclusive ``flock`` on folder ``path`` while the block runs (every reader of this module)."""
    with open(os.path.join(path, _LOCK), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class LiveProcessCollector(multiprocess.MultiProcessCollector):
    """prometheus-client's ``MultiProcessCollector`` that settles dead processes' files
    (:func:`settle_dead`) before each read, both under :func:`folder_lock`."""

    def collect(self):
        with folder_lock(self._path):
            settle_dead(self._path)
            return list(super().collect())
