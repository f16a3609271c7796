"""Utilisation sampler: machine CPU % (psutil) and GPU busy % and memory (NVML) once a second.

One :class:`Sampler` per process runs a daemon thread that keeps the last ``history`` samples.
The bulk pipeline asks it for the samples taken since a chunk (or a job) began and stores them
with the job; the benchmarks summarise them per run. No GPU, no driver or no ``nvidia-ml-py``:
the GPU fields are ``None`` and nothing fails.

CPU % is psutil's machine-wide figure (0..100 over all cores, the experiment's "CPU
utilisation"), measured over the interval since the previous sample. GPU % is NVML's
``utilization.gpu``: the share of the last sample period in which a kernel was running.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import statistics
import threading
import time
from typing import Iterable, Sequence

import psutil

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reading.

    Attributes:
        t: ``time.time()`` of the reading (s).
        cpu_percent: machine-wide CPU use over the previous interval (0..100, all cores).
        gpu_percent: NVML GPU utilisation (0..100), ``None`` without a GPU.
        gpu_memory_mib: GPU memory in use (MiB), ``None`` without a GPU.
    """

    t: float
    cpu_percent: float
    gpu_percent: float | None = None
    gpu_memory_mib: float | None = None

    def as_row(self) -> list:
        """``[t, cpu %, gpu % | None, gpu MiB | None]`` (JSON-friendly, rounded)."""
        r = lambda v, n: None if v is None else round(v, n)  # noqa: E731
        return [round(self.t, 3), round(self.cpu_percent, 1), r(self.gpu_percent, 1), r(self.gpu_memory_mib, 1)]

    @classmethod
    def from_row(cls, row: Sequence) -> "Sample":
        """Inverse of :meth:`as_row`."""
        return cls(float(row[0]), float(row[1]), row[2], row[3])


class Gpu:
    """NVML readings for one device; :attr:`available` is False where there is none."""

    def __init__(self, index: int = 0) -> None:
        self.available = False
        self.name: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self.available = True
        except Exception as e:  # noqa: BLE001 - no package, no driver, no device: no GPU readings
            log.debug("no NVML readings: %s", e)

    def read(self) -> tuple[float | None, float | None]:
        """``(utilisation %, memory used MiB)``, or ``(None, None)``."""
        if not self.available:
            return None, None
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
            return float(util), float(mem)
        except Exception:  # noqa: BLE001 - a reading that fails is a missing reading
            return None, None


class Sampler:
    """Samples once every ``interval_s`` on a daemon thread.

    Args:
        interval_s: seconds between samples.
        history: samples kept (older ones are dropped).
        gpu_index: NVML device index to read.
    """

    def __init__(self, interval_s: float = 1.0, history: int = 86_400, gpu_index: int = 0) -> None:
        self.interval_s = interval_s
        self._samples: collections.deque[Sample] = collections.deque(maxlen=history)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu_index = gpu_index
        self.gpu: Gpu | None = None
        self._listeners: list = []
        self._taken: dict[str, float] = {}

    def start(self) -> "Sampler":
        """Start the thread (idempotent). Returns ``self``."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._loop, name="utilisation", daemon=True)
                self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        """Stop the thread; returns every kept sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.samples()

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def on_sample(self, callback) -> None:
        """Call ``callback(sample)`` on the sampler thread after each sample (e.g. metrics gauges)."""
        self._listeners.append(callback)

    def take_new(self, key: str, since: float) -> list[Sample]:
        """Samples newer than ``since`` and than the last ``take_new`` for ``key``; marks them taken.

        The bulk worker calls it after each chunk with ``key`` = the job id and ``since`` = one
        interval before the chunk began, so a job gets every second in which its chunks ran, once.
        """
        with self._lock:
            after = max(since, self._taken.get(key, float("-inf")))
            new = [s for s in self._samples if s.t > after]
            if new:
                self._taken[key] = new[-1].t
                if len(self._taken) > 1000:  # forget the oldest jobs
                    self._taken.pop(next(iter(self._taken)))
            return new

    def samples(self, since: float | None = None) -> list[Sample]:
        """Kept samples with ``t > since`` (all when ``since`` is None), oldest first."""
        with self._lock:
            return [s for s in self._samples if since is None or s.t > since]

    def sample_now(self) -> Sample:
        """Take one sample now (CPU % over the time since the previous one) and keep it."""
        if self.gpu is None:
            self.gpu = Gpu(self._gpu_index)
        gpu_percent, gpu_mib = self.gpu.read()
        s = Sample(time.time(), psutil.cpu_percent(interval=None), gpu_percent, gpu_mib)
        with self._lock:
            self._samples.append(s)
        for callback in self._listeners:
            try:
                callback(s)
            except Exception:  # noqa: BLE001 - a listener must not stop the sampling
                log.exception("utilisation listener failed")
        return s

    def _loop(self) -> None:
        psutil.cpu_percent(interval=None)  # the first call only starts psutil's interval
        self.gpu = self.gpu or Gpu(self._gpu_index)
        while not self._stop.wait(self.interval_s):
            self.sample_now()


def summarise(samples: Iterable[Sample]) -> dict:
    """``{"samples": n, "cpu_percent": {min, avg, p95, max}, "gpu_percent": ..., "gpu_memory_mib": ...}``;
    a field without readings is ``None``."""
    samples = list(samples)
    out: dict = {"samples": len(samples)}
    for field in ("cpu_percent", "gpu_percent", "gpu_memory_mib"):
        vals = sorted(v for v in (getattr(s, field) for s in samples) if v is not None)
        out[field] = None if not vals else {
            "min": round(vals[0], 1),
            "avg": round(statistics.fmean(vals), 1),
            "p95": round(vals[min(len(vals) - 1, int(0.95 * len(vals)))], 1),
            "max": round(vals[-1], 1),
        }
    return out


#: Rows a job keeps at most (``merge_rows``). One row a second would grow a ten-hour job's JSON to
#: 36,000 rows (~1.4 MB), rewritten after every chunk and sent whole by every ``GET /api/jobs/{id}/``;
#: past this count adjacent rows merge into buckets twice as long instead, so any job stays under
#: ~50 KB. 1,200 rows keep one-second resolution for the first 20 minutes.
MAX_JOB_ROWS = 1_200


def _bucket(rows: Iterable[Sequence], interval_s: float) -> list[list]:
    """Rows merged into buckets of ``interval_s`` seconds (start aligned to multiples of it):
    CPU and GPU % averaged weighted by the samples each row holds, GPU memory the maximum, and the
    sample count as a fifth element."""
    sums: dict[int, list] = {}  # key → [cpu·n, n, gpu·n_gpu, n_gpu, max MiB]
    for row in rows:
        n = row[4] if len(row) > 4 else 1
        acc = sums.setdefault(int(row[0] // interval_s), [0.0, 0, 0.0, 0, None])
        acc[0] += row[1] * n
        acc[1] += n
        if row[2] is not None:
            acc[2] += row[2] * n
            acc[3] += n
        if row[3] is not None:
            acc[4] = row[3] if acc[4] is None else max(acc[4], row[3])
    return [[round(k * interval_s, 3), round(a[0] / a[1], 1), round(a[2] / a[3], 1) if a[3] else None, a[4], a[1]]
            for k, a in sorted(sums.items())]


def merge_rows(existing: Sequence[Sequence], new: Iterable[Sample], *, interval_s: float = 1.0,
               max_rows: int = MAX_JOB_ROWS) -> tuple[list[list], float]:
    """``existing`` rows (at ``interval_s``) plus ``new`` samples → ``(rows, interval_s)``, sorted.

    At one-second resolution there is one row per wall-clock second, ``[t, cpu %, gpu %, gpu MiB]``:
    several processes of one job sample the same machine, and the first reading of a second wins.
    Once there are more than ``max_rows`` rows, the interval doubles (as often as needed) and rows
    become buckets ``[start t, mean cpu %, mean gpu %, max gpu MiB, samples]`` (:func:`_bucket`);
    new samples then join the bucket of their time. The job's whole span is always covered.
    """
    if interval_s <= 1.0:
        by_second: dict[int, list] = {}
        for row in existing:
            by_second.setdefault(int(row[0]), list(row))
        for s in new:
            by_second.setdefault(int(s.t), s.as_row())
        rows = [by_second[k] for k in sorted(by_second)]
        interval_s = 1.0
    else:
        rows = _bucket([*existing, *(s.as_row() for s in new)], interval_s)
    while len(rows) > max_rows:
        interval_s *= 2
        rows = _bucket(rows, interval_s)
    return rows, interval_s


@functools.cache
def process_sampler() -> Sampler:
    """The process's running :class:`Sampler` (started on first use: never at import, never in a
    Celery parent before it forks)."""
    return Sampler().start()
