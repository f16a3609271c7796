"""Screen stage: refuses embeddings that cannot be compared, between the model and the store.

A vector with a NaN or an infinity (fp16 overflow on a GPU, a broken checkpoint) or with no
direction (all zeros) has no cosine with anything: a Qdrant store keeps it and never returns it
(edge), returns it with a NaN score (local mode), or refuses the whole write (local mode, NaN).
So every vector the model gives is screened here before it goes anywhere, and a refused one fails
its image alone with a stable reason code (``workers.errors.Reason``); the rest of its batch goes
on. The stores screen again on their own boundary (``workers.vector_store``): a query vector is
refused there, and a stored vector that is not usable (written before this screen existed) is
never handed out.
"""
from __future__ import annotations

import numpy as np

from workers.errors import Reason

#: Below this L2 norm a vector counts as all zeros. The encoder's outputs are normalised
#: (``workers.model._normalise``, norm 1 in fp32); only an all-zero output, or one whose norm is under
#: the normaliser's 1e-12 clamp, comes out shorter than this.
ZERO_NORM = 1e-6

_DETAIL = {
    Reason.NON_FINITE_EMBEDDING: "the model's vector holds NaN or infinity (e.g. an fp16 overflow or a broken "
                                 "checkpoint): it cannot be compared, so it is not stored",
    Reason.ZERO_EMBEDDING: "the model's vector is all zeros: it has no direction to compare, so it is not stored",
}

#: The reason codes this stage gives.
REASONS = (Reason.NON_FINITE_EMBEDDING, Reason.ZERO_EMBEDDING)


def faults(vectors: np.ndarray) -> list[Reason | None]:
    """Why each row of ``vectors`` ``(N, D)`` cannot be used, ``None`` for a usable row.

    A row with any NaN or infinity: :attr:`Reason.NON_FINITE_EMBEDDING`; else a row whose L2 norm
    is below :data:`ZERO_NORM`: :attr:`Reason.ZERO_EMBEDDING`. ``N`` = 0 gives ``[]``.
    """
    if len(vectors) == 0:
        return []
    rows = np.asarray(vectors, dtype=np.float32).reshape(len(vectors), -1)
    finite = np.isfinite(rows).all(axis=1)
    norms = np.linalg.norm(np.where(np.isfinite(rows), rows, 0.0), axis=1)
    return [None if ok and n >= ZERO_NORM else Reason.NON_FINITE_EMBEDDING if not ok else Reason.ZERO_EMBEDDING
            for ok, n in zip(finite.tolist(), norms.tolist())]


def fault(vector: np.ndarray) -> Reason | None:
    """:func:`faults` of one vector ``(D,)``."""
    return faults(np.asarray(vector).reshape(1, -1))[0]


def usable(vector: np.ndarray) -> bool:
    """Whether one vector ``(D,)`` is finite and not all zeros."""
    return fault(vector) is None


def detail(reason: Reason | str) -> str:
    """The sentence shown with a refusal of this stage (``reason`` one of :data:`REASONS`)."""
    return _DETAIL[Reason(reason)]


class UnusableVector(ValueError):
    """A vector that is not finite or is all zeros where a usable one is needed (a query, a write).

    Attributes:
        reason: :attr:`Reason.NON_FINITE_EMBEDDING` or :attr:`Reason.ZERO_EMBEDDING`.
    """

    def __init__(self, reason: Reason, what: str = "vector") -> None:
        super().__init__(f"{what}: {reason.value}")
        self.reason = reason


def require_usable(vector: np.ndarray, what: str = "vector") -> None:
    """Raise :class:`UnusableVector` (a ``ValueError``) naming ``what`` unless ``vector`` is usable."""
    reason = fault(vector)
    if reason is not None:
        raise UnusableVector(reason, what)
