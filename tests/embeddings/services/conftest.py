"""Fixtures the service tests share (the queues' and the reconciler's)."""
from __future__ import annotations

import pytest

from embeddings import tasks


@pytest.fixture
def sent_args(monkeypatch):
    """Bulk messages and point deletions captured instead of run: ``{task name: [args, ...]}``."""
    out: dict[str, list] = {}
    for task in (tasks.embed_chunk, tasks.index_chunk, tasks.forget_point):
        monkeypatch.setattr(task, "apply_async", lambda args=(), task=task, **kw: out.setdefault(task.name, []).append(args))
    return out
