"""Sending the next step of a near-duplicate scan: the one place that decides where it runs."""
from __future__ import annotations

from embeddings import dispatch, sink


def send_step(name: str, *args, model: bool = False) -> None:
    """Queue task ``name`` (``dispatch.send_duplicates_step``): on the bulk queue when it needs the
    space's model (``model``) or when the store is a Qdrant server (every bulk worker reaches it),
    else on the vectors queue, the embedded store's owner."""
    dispatch.send_duplicates_step(name, *args, bulk=model or sink.is_direct())
