"""Per-stage timings of one batch, in milliseconds.

Stages (the seed experiment's names, plus upsert):
- ``load``: reading the encoded bytes from storage, summed over the batch's images.
- ``decode``: bytes → RGB pixels, summed over images.
- ``decode_wait``: time images waited for a free decode thread, summed over images.
- ``preprocess``: resize/crop per image (summed) plus batch normalisation and the copy to device.
- ``embed``: the forward pass, wall time.
- ``upsert``: writing the batch's points to the vector store, wall time.
- ``total``: wall time of the whole batch, from the start of load to the end of embed (bulk: to
  the end of upsert when it is known).

Summed stages run on ``decode_threads`` threads in parallel, so ``total`` can be less than their
sum; it is never less than ``embed`` plus the wall time of the parallel phase.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

STAGES = ("load", "decode", "decode_wait", "preprocess", "embed", "upsert", "total")


@dataclasses.dataclass
class StageTimings:
    """Milliseconds per stage for one batch (see module docstring for what each one counts)."""

    load: float = 0.0
    decode: float = 0.0
    decode_wait: float = 0.0
    preprocess: float = 0.0
    embed: float = 0.0
    upsert: float = 0.0
    total: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """``{stage: ms}`` rounded to 0.01 ms."""
        return {k: round(v, 2) for k, v in dataclasses.asdict(self).items()}

    def add(self, stage_ms: dict[str, float]) -> None:
        """Add ``{stage: ms}`` to those stages."""
        for stage, ms in stage_ms.items():
            setattr(self, stage, getattr(self, stage) + ms)

    @contextlib.contextmanager
    def measure(self, stage: str):
        """Add the wall time of the ``with`` block to ``stage``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, stage, getattr(self, stage) + (time.perf_counter() - t0) * 1000)
