"""Copy every point of one store into another and check the copy (``manage.py store_migrate``).

The source is only read: nothing in it is ever deleted or rewritten, so a failed or interrupted
copy is simply run again (writes are idempotent per point id).
"""
from __future__ import annotations

import dataclasses
import random
import uuid

import numpy as np

from workers.vector_store import UPSERT_BATCH, VectorStore, usable_points


class CopyMismatch(RuntimeError):
    """The copy does not hold what the source holds (a missing point, or a vector/payload that differs)."""


@dataclasses.dataclass
class CopyReport:
    """What :func:`copy_store` did: points copied from the source, points in the target after the
    copy, sampled points compared (vector and payload), seconds taken, and the source's points left
    out because their vector is not finite or is all zeros (``unusable``: their ids)."""

    source_points: int
    target_points: int
    sampled: int
    seconds: float
    unusable: list[uuid.UUID] = dataclasses.field(default_factory=list)


def copy_store(source: VectorStore, target: VectorStore, *, sample: int = 1_000, seed: int = 0,
               batch: int = UPSERT_BATCH, progress=lambda copied: None) -> CopyReport:
    """Upsert every point of ``source`` into ``target``, then verify.

    Verification: every source id is in the target (by id, so a target that already held other
    points still passes), and for ``sample`` randomly chosen points the unit vector (``atol`` 1e-6)
    and the payload are equal. Unit vectors, because both stores are cosine: qdrant-client's local
    mode hands back the vector as given after a reload and normalised before one (seen with 1.20.0),
    the edge engine always normalised; the service only writes unit vectors anyway. A source point
    whose vector is not finite or is all zeros (written before ``workers.screen``: no search ever
    found it) is not copied (no store takes it) and is listed in the report's ``unusable``.

    Args:
        progress: called with the number of points copied so far after each batch.

    Raises:
        CopyMismatch: a point is missing from the target, or a sampled point differs.
    """
    import time

    t0 = time.perf_counter()
    ids: list[uuid.UUID] = []
    unusable: list[uuid.UUID] = []
    for points in source.scroll(batch=batch):
        points, left_out = usable_points(points)
        unusable.extend(p.id for p in left_out)
        target.upsert(points)
        ids.extend(p.id for p in points)
        progress(len(ids))
    for i in range(0, len(ids), batch):
        part = ids[i : i + batch]
        missing = set(part) - set(target.payloads(part))
        if missing:
            raise CopyMismatch(f"{len(missing)} points of the source are missing from the target, e.g. {min(missing)}")
    chosen = random.Random(seed).sample(ids, min(sample, len(ids)))
    for i in range(0, len(chosen), batch):
        part = chosen[i : i + batch]
        src_v, dst_v = source.vectors(part), target.vectors(part)
        src_p, dst_p = source.payloads(part), target.payloads(part)
        for pid in part:
            if not np.allclose(_unit(src_v[pid]), _unit(dst_v[pid]), atol=1e-6):
                raise CopyMismatch(f"point {pid}: the copied vector differs from the source's")
            if src_p[pid] != dst_p[pid]:
                raise CopyMismatch(f"point {pid}: the copied payload {dst_p[pid]!r} differs from {src_p[pid]!r}")
    return CopyReport(source_points=len(ids), target_points=target.count(), sampled=len(chosen),
                      seconds=time.perf_counter() - t0, unusable=unusable)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / max(float(np.linalg.norm(v)), 1e-12)
