"""The near-duplicate groups numpy finds over vectors at a threshold: every pair compared, then
``workers.duplicates.group``: the oracle the store-backed scans are checked against."""
from __future__ import annotations

import numpy as np

from workers import duplicates


def expected_groups(vectors: dict, threshold: float) -> list[set]:
    """Groups (member id sets, sorted) of ``vectors`` (id → ``(D,) float32`` unit vector) at ``threshold``."""
    keys = sorted(vectors, key=str)
    if not keys:
        return []
    x = np.stack([vectors[k] for k in keys])
    sims = x @ x.T
    edges = [(keys[i], keys[j], float(sims[i, j])) for i in range(len(keys)) for j in range(i + 1, len(keys))
             if sims[i, j] >= threshold]
    return sorted((set(m for m, _ in g.members) for g in duplicates.group(edges)),
                  key=lambda g: sorted(map(str, g)))
