"""Keeping a batch's memory between batches (glibc's ``malloc``): a model input is one block per
batch, and glibc serves a block above its mmap threshold (at most 32 MiB by default, adjusted up
to the largest block freed) with a fresh ``mmap`` and returns it with ``munmap`` when freed, so
every batch pays a page fault per 4 KiB page it writes: a 512-image chunk's float32 input
(``(512, 3, 224, 224)``, 308 MB) costs about 75,000 faults, which took longer than the
normalisation itself (``benchmarks/batch_memory.py``; docs/scaling.md).

:func:`keep_batch_memory` raises both the mmap threshold and the trim threshold, so such blocks
come from the heap and stay there once freed, for the next batch to reuse: a process keeps at most
that much freed memory (its peak is a batch's anyway). A block allocated by a thread other than
the main one comes from that thread's arena and may still be mapped on its own.

Plain library: no Django, no Celery, no torch.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

#: ``mallopt`` parameter numbers (glibc's ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33+), every field a ``size_t`` in bytes or a count."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc():
    """The C library, or ``None`` where it is not glibc (musl, macOS): no ``mallopt`` to call. Looked
    up once per process (``find_library`` runs ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_batch_memory(limit_mb: int) -> bool:
    """Serve blocks up to ``limit_mb`` MiB from the heap and keep up to that much freed memory in
    this process (and the children it forks afterwards) instead of mapping and unmapping each one.

    Args:
        limit_mb: both thresholds, in MiB; 0 leaves glibc's defaults.

    Returns:
        True when both thresholds were set; False when ``limit_mb`` is 0, the C library is not glibc,
        or glibc refused a value (logged).

    Raises:
        ValueError: a negative ``limit_mb``.
    """
    if limit_mb < 0:
        raise ValueError(f"limit_mb must be >= 0 (0: glibc's defaults), not {limit_mb}")
    if not limit_mb:
        return False
    libc = _libc()
    if libc is None:
        log.warning("not glibc: batch memory is left to the C library's own policy")
        return False
    limit = ctypes.c_int(min(limit_mb * 1024 * 1024, 2**31 - 1))  # mallopt takes an int
    done = libc.mallopt(M_MMAP_THRESHOLD, limit) == 1
    done = libc.mallopt(M_TRIM_THRESHOLD, limit) == 1 and done
    if not done:
        log.warning("glibc refused a malloc threshold of %d MiB: batch memory is mapped per batch", limit_mb)
    return done


def mapped_bytes() -> int | None:
    """Bytes this process's ``malloc`` holds in blocks mapped on their own (``mallinfo2().hblkhd``),
    or ``None`` without glibc 2.33+."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().hblkhd)
