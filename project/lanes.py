"""Queue names and lane priorities: the one place the settings, the scripts and docker-compose use.

Import-light on purpose (no Django, no Celery, no torch): ``scripts/`` read it with
``python -m project.lanes``, and ``tests/test_lanes.py`` checks docker-compose.yml against it.

Priorities follow kombu's Redis transport, where **0 is the highest** priority (the opposite of
RabbitMQ) and values are bucketed into the default ``priority_steps`` ``[0, 3, 6, 9]``
(../shared/NOTES.md, kombu ``transport/redis.py``). Interactive work is always step 0; bulk work is
step 6 (urgent) or 9 (background), so a worker consuming several queues never takes a bulk message
while an interactive one waits.
"""
from __future__ import annotations

import re

#: Interactive embedding: someone is waiting. Small prefetch, short expiry.
INTERACTIVE = "interactive"
#: Bulk embedding: chunks of image ids, nobody waiting.
BULK = "bulk"
#: The single owner of the vector store (embedded Qdrant allows one process): upserts, searches.
VECTORS = "vectors"
#: Catalogue sources (issue 41): reading manifests and prefixes into rows, fetching image URLs and
#: objects. Network-bound, no model: its own threads worker, so a slow host never holds a model.
FETCH = "fetch"

EMBED_QUEUES = (INTERACTIVE, BULK)
ALL_QUEUES = (INTERACTIVE, BULK, VECTORS, FETCH)

PRIORITY_INTERACTIVE = 0
PRIORITY_BULK_URGENT = 6
PRIORITY_BULK_BACKGROUND = 9


#: What a deployment name may be (``DEPLOYMENT_NAME``): it becomes the start of Redis keys.
DEPLOYMENT_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def key_prefix(deployment: str) -> str:
    """``"<deployment>:"``: the start of every Redis key the deployment named ``deployment`` writes.

    Kombu's Redis transport puts it before each key of the broker (queue lists ``<prefix><queue>``
    and their priority lists, ``unacked``, bindings, the event and remote-control channels:
    ``global_keyprefix``), Celery's result backend before each result, lane control before its
    own keys (``embeddings.lane_control.keys``). Queue names stay ``interactive``, ``bulk``, ...:
    two deployments on one Redis database consume the same names under different keys, so neither
    ever sees the other's messages.

    Raises:
        ValueError: ``deployment`` is not :data:`DEPLOYMENT_NAME_PATTERN` (empty, a ``:``, a space...).
    """
    if not DEPLOYMENT_NAME_PATTERN.fullmatch(deployment or ""):
        raise ValueError(f"DEPLOYMENT_NAME must be 1 to 63 letters, digits, '.', '_' or '-' (starting with a letter "
                         f"or digit), not {deployment!r}")
    return f"{deployment}:"


def transport_options(deployment: str) -> dict[str, str]:
    """The Redis transport options (broker and result backend) that put a Celery app on
    ``deployment``'s keys: what every process of it, and every test or benchmark client that sends
    to it or reads its events, configures."""
    return {"global_keyprefix": key_prefix(deployment)}


def main() -> None:
    """Print the queue names, one per line, for shell scripts."""
    print("\n".join(ALL_QUEUES))


if __name__ == "__main__":
    main()
