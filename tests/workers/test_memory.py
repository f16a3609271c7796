"""A bulk chunk's memory kept for the next chunk (``workers.memory``): each case runs in a child
process, since malloc's thresholds are the whole process's."""
from __future__ import annotations

import subprocess
import sys

import pytest

from workers import memory

pytestmark = pytest.mark.skipif(memory.mapped_bytes() is None, reason="glibc 2.33+ (mallinfo2) only")

#: Allocates, writes and frees a 100 MiB block twice after ``keep_batch_memory(LIMIT)``, then prints
#: what keep returned and malloc's mapped bytes while a third such block is held.
CHILD = """
import sys, torch
from workers import memory
kept = memory.keep_batch_memory(int(sys.argv[1]))
for _ in range(2):
    x = torch.empty(100 * 1024 * 1024, dtype=torch.uint8); x.fill_(1); del x
x = torch.empty(100 * 1024 * 1024, dtype=torch.uint8); x.fill_(1)
print(kept, memory.mapped_bytes())
"""


def child(limit_mb: int) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(limit_mb)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kept, mapped = out.stdout.split()
    return kept, int(mapped)


def test_a_block_below_the_limit_comes_from_the_heap_and_glibcs_default_maps_it():
    kept, mapped = child(1024)
    assert kept == "True" and mapped < 100 * 1024 * 1024  # the 100 MiB block is not mapped on its own
    kept, mapped = child(0)
    assert kept == "False" and mapped >= 100 * 1024 * 1024  # glibc's default: mapped, unmapped when freed
    kept, mapped = child(64)
    assert kept == "True" and mapped >= 100 * 1024 * 1024  # above the limit: mapped as before


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="limit_mb must be >= 0"):
        memory.keep_batch_memory(-1)
