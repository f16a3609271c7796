"""The load benchmark's memory check (``benchmarks.load``): it judges the anonymous resident set
(heap, stacks), where a leak lives, and not the pages of mapped files, which grow with the data an
embedded vector store keeps in mmapped segments and logs (docs/benchmarks-load.md, "Memory")."""
from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
import threading

from benchmarks.load import (  # noqa: I001
    Sampler, memory_above_high_water, memory_checks, memory_since, memory_trend, phase_memory, tree_memory_mb,
    tree_threads,
)

MIB = 2**20


def test_tree_memory_counts_written_heap_as_anonymous_and_a_mapped_file_as_resident_only(tmp_path):
    pid = os.getpid()
    rss0, anon0 = tree_memory_mb(pid)
    assert 0 < anon0 < rss0

    # A private anonymous map, one byte written in every page: new resident anonymous memory. (A plain
    # ``bytes`` object is not: malloc may hand back heap pages that an earlier test freed and that
    # are still resident, so neither figure moves; CI saw exactly that.)
    heap = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, len(heap), mmap.PAGESIZE):
        heap[i] = 1
    rss1, anon1 = tree_memory_mb(pid)
    assert anon1 - anon0 >= 60 and rss1 - rss0 >= 60

    path = tmp_path / "segment"
    path.write_bytes(b"\x02" * (64 * MIB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as segment:
        touched = sum(segment[i] for i in range(0, len(segment), mmap.PAGESIZE))  # every page read once
        rss2, anon2 = tree_memory_mb(pid)
    assert touched == 2 * (64 * MIB // mmap.PAGESIZE)
    assert rss2 - rss1 >= 60  # the mapped file's pages are resident...
    assert anon2 - anon1 < 8  # ...but not anonymous: the check does not read them as growth
    heap.close()


def test_the_summary_reports_whole_and_anonymous_growth_per_process():
    """Twenty samples, one a second: the whole RSS climbs 1 MiB a sample (a store's mapped data),
    the anonymous part stays at 100 MiB but for one step to 104 MiB in the second half."""
    sampler = Sampler({"vectors": 1})
    sampler.samples = [{"t": float(i), "vectors": 200.0 + i, "vectors:anon": 100.0 + (4.0 if i >= 15 else 0.0)}
                       for i in range(20)]
    m = sampler.summary()["vectors"]
    # tenths of two samples: first {200, 201}, middle {209, 210}, last {218, 219}
    assert (m["start_mb"], m["end_mb"], m["max_mb"]) == (200.0, 219.0, 219.0)
    assert (m["growth_mb"], m["second_half_growth_mb"]) == (18.0, 9.0)
    assert (m["anon_start_mb"], m["anon_end_mb"]) == (100.0, 104.0)
    assert (m["anon_growth_mb"], m["anon_second_half_growth_mb"]) == (4.0, 4.0)


def test_tree_threads_counts_the_threads_of_a_process_and_its_children():
    """What the warm-up reports of the web (gunicorn's master and its workers' threads): three more
    threads here, and a child process with its one."""
    pid = os.getpid()
    before = tree_threads(pid)
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(3)]
    for t in threads:
        t.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert tree_threads(pid) == before + 3 + 1
    finally:
        stop.set()
        child.kill()
        child.wait()
        for t in threads:
            t.join()
    assert tree_threads(pid) == before
    assert tree_threads(2**22 + 1) == 0  # no such process


def _samples(anon_of, seconds: int, *, start: float = 1000.0) -> list[dict]:
    """One sample a second from ``start`` (Unix s): each process's anonymous MiB by ``anon_of(i)``."""
    return [{"t": float(i), "unix": start + i, **{f"{n}:anon": v for n, v in anon_of(i).items()}}
            for i in range(seconds)]


def test_phase_memory_reads_each_phase_window_alone():
    """Two 20 s phases back to back. The interactive worker sits at 1,220 MiB in the first and at
    1,270 in the second (a working set that follows the phase); the vectors worker leaks 1 MiB a
    second in the second phase only."""
    samples = _samples(lambda i: {"worker-interactive": 1220.0 if i < 20 else 1270.0,
                                  "worker-vectors": 300.0 + max(0, i - 20)}, 40)
    first = phase_memory(samples, 1000.0, 1019.0, ["worker-interactive", "worker-vectors"])
    second = phase_memory(samples, 1020.0, 1039.0, ["worker-interactive", "worker-vectors"])
    assert first == {"worker-interactive": {"plateau_mb": 1220.0, "growth_mb": 0.0},
                     "worker-vectors": {"plateau_mb": 300.0, "growth_mb": 0.0}}
    # second phase, vectors 300..319: second half 310..319 → 314.5; last quarter {315..319} → 317,
    # second quarter {305..309} → 307
    assert second == {"worker-interactive": {"plateau_mb": 1270.0, "growth_mb": 0.0},
                      "worker-vectors": {"plateau_mb": 314.5, "growth_mb": 10.0}}
    assert phase_memory(samples, 2000.0, 2010.0, ["worker-vectors"]) == {}


def test_the_verdict_reads_the_trend_of_the_last_round_from_its_second_phase():
    """Without three phases' figures (the trend is then judged, and otherwise reported). Two rounds of three 60 s phases, one sample a second. The interactive worker climbs to its
    high-water mark through the first round (1,220 → 1,260 MiB) and holds it; the bulk worker loads
    its model in the second round's first phase (+1,000 MiB) and then saw-tooths ±60 MiB around
    2,700 with each chunk: neither grows. A web that adds 0.1 MiB a second from then on grows 12 MiB
    over the 120 s read; 0.2 MiB a second, 24 MiB: judged growth."""
    def sample(i: int, leak: float) -> dict:
        bulk = 1500.0 if i < 180 else (2000.0 if i < 200 else 2700.0 + (60.0 if i % 2 else -60.0))
        return {"worker-interactive": min(1260.0, 1220.0 + i / 4), "worker-bulk": bulk,
                "web": 200.0 + leak * max(0, i - 240)}

    phases = [{"round": i // 180, "window": [1000.0 + i, 1000.0 + i + 59]} for i in range(0, 360, 60)]
    result = {"phases": phases, "rounds": [{"samples": []},
                                           {"memory_mb": dict.fromkeys(("web", "worker-interactive", "worker-bulk"))}]}
    assert memory_since(result) == 1240.0  # the second round's second phase
    for leak, grows in ((0.1, False), (0.2, True)):
        samples = _samples(lambda i, leak=leak: sample(i, leak), 360)
        result["rounds"][1]["samples"] = samples
        trend = memory_trend(samples, 1240.0, ["web", "worker-interactive", "worker-bulk"])
        assert trend["worker-interactive"] == 0.0
        assert abs(trend["worker-bulk"]) < 4.0  # the saw-tooth averages out
        assert trend["web"] == round(leak * 119, 1)  # 120 samples, 119 s apart at the ends
        assert list(memory_checks(result, max_growth_mb=16).values()) == [not grows]
        assert result["memory_trend_mb"] == trend

    one_phase = {"phases": [{"round": 0, "window": [1000.0, 1060.0]}], "rounds": [{"samples": []}]}
    assert memory_since(one_phase) == 1030.0  # a single phase: its second half
    assert math.isnan(memory_trend([], 0.0, ["web"])["web"])  # too few samples: no verdict but a failing one


def _phases(plateaus: dict[str, list[float]]) -> list[dict]:
    n = len(next(iter(plateaus.values())))
    return [{"memory_mb": {name: {"plateau_mb": v[i], "growth_mb": 0.0}
                           for name, v in plateaus.items() if v[i] is not None}} for i in range(n)]


def test_the_verdict_reads_the_last_phase_against_the_high_water_mark_of_every_phase_but_the_one_before():
    """z2 of 2026-12-04 (two rounds of 1 s, 2 s, 5 s; MiB): the bulk worker's chunks left it at
    2,557, 2,535, 2,556 and the interactive worker's working set followed the deadline; neither
    leaked. A web leaking 8 MiB a phase stands 16 above the phase two before the last."""
    z2 = {"web": [222.8, 230.6, 237.0, 250.0, 256.3, 265.3],
          "worker-interactive": [1228.8, 1255.4, 1249.0, 1235.2, 1249.4, 1261.2],
          "worker-bulk": [1472.3, 1472.3, 1472.3, 2557.5, 2534.6, 2555.8]}
    assert memory_above_high_water(_phases(z2)) == {"web": 15.3, "worker-interactive": 5.8, "worker-bulk": -1.7}
    leaking = {"web": [200.0 + 8 * i for i in range(6)]}
    assert memory_above_high_water(_phases(leaking)) == {"web": 16.0}
    # a process absent from the earlier phases is not judged; fewer than three phases: no figure
    assert memory_above_high_water(_phases({"web": [1.0, 1.0, 1.0], "new": [None, None, 5.0]})) == {"web": 0.0}
    assert memory_above_high_water(_phases({"web": [1.0, 9.0]})) is None


def test_with_three_phases_or_more_the_verdict_is_the_high_water_mark_and_the_trend_is_reported():
    phases = [{"round": 0, "window": [1000.0 + 60 * i, 1059.0 + 60 * i],
               "memory_mb": {"web": {"plateau_mb": p, "growth_mb": 0.0}}} for i, p in enumerate((200.0, 230.0, 215.0))]
    samples = _samples(lambda i: {"web": 200.0 + i / 6}, 180)  # a trend of +10 MiB a minute
    result = {"phases": phases, "rounds": [{"samples": samples, "memory_mb": {"web": None}}]}
    (name, ok), = memory_checks(result, max_growth_mb=16).items()
    assert ok and "high-water" in name and result["memory_above_high_water_mb"] == {"web": 15.0}
    assert result["memory_trend_mb"]["web"] > 16  # reported, not judged
    phases[2]["memory_mb"]["web"]["plateau_mb"] = 216.0
    assert list(memory_checks(result, max_growth_mb=16).values()) == [False]
