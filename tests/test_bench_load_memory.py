"""The load benchmark's memory check (``benchmarks.load``): it judges the anonymous resident set
(heap, stacks), where a leak lives, and not the pages of mapped files, which grow with the data an
embedded vector store keeps in mmapped segments and logs (docs/benchmarks-load.md, "Memory")."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading

from benchmarks.load import Sampler, tree_memory_mb, tree_threads

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
