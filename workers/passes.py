"""How a chunk is cut into forward passes: fixed passes of ``first`` images, or passes that grow
while the measured time per image keeps a pass under a budget.

A pass is the unit another lane waits behind: a migration looks at the interactive lane before each
one (``lane_control.migration_yielder``), and a pass, once started, is decoded and run to its end.
On a CPU the forward pass of 4 images alone takes about 100 ms (ViT-S-32 fp32, one thread:
docs/benchmarks-migration.md), so passes stay at 4; on a GPU the same 4 images take well under a
millisecond, and 128 passes of 4 for a 512-image chunk keep the device waiting on each pass's
decode, stacking and look at the lane. With a budget, each pass after the first holds as many
images as the last pass's time per image (its preparation and forward pass: ``BatchResult``'s
``total``) fits in it, never fewer than ``first``.

Plain library: no Django, no Celery, no torch.
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence


class Passes:
    """The slices of ``keys``, in order, one per forward pass.

    Args:
        keys: the chunk's image keys.
        first: images in the first pass, and the fewest in any pass (>= 1).
        budget_ms: the most a later pass should take (ms), from the last pass's time per image
            (:meth:`record`); ``None`` or 0: every pass holds ``first`` images.

    Raises:
        ValueError: ``first`` < 1 or a negative ``budget_ms``.
    """

    def __init__(self, keys: Sequence[str], first: int, budget_ms: float | None = None) -> None:
        if first < 1:
            raise ValueError(f"first must be >= 1, not {first}")
        if budget_ms is not None and budget_ms < 0:
            raise ValueError(f"budget_ms must be >= 0 (0: fixed passes), not {budget_ms}")
        self.keys, self.first, self.budget_ms = keys, first, budget_ms or None
        self._ms_per_image: float | None = None
        self.sizes: list[int] = []  # each pass's images, as cut

    def record(self, images: int, ms: float) -> None:
        """A pass of ``images`` images took ``ms`` ms: what the next pass is cut by."""
        if images > 0:
            self._ms_per_image = max(0.0, ms) / images

    def _next_size(self, left: int) -> int:
        if self.budget_ms is None or self._ms_per_image is None:
            return min(self.first, left)
        fits = left if self._ms_per_image == 0 else math.floor(self.budget_ms / self._ms_per_image)
        return min(left, max(self.first, fits))

    def __iter__(self) -> Iterator[Sequence[str]]:
        start = 0
        while start < len(self.keys):
            size = self._next_size(len(self.keys) - start)
            self.sizes.append(size)
            yield self.keys[start : start + size]
            start += size
