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


def main() -> None:
    """Print the queue names, one per line, for shell scripts."""
    print("\n".join(ALL_QUEUES))


if __name__ == "__main__":
    main()
