"""Lane control: what may enter the interactive lane and when, and how bulk work gives way to it.

The one door the rest of the app calls (``from embeddings import lane_control``). Inside, one
Redis client and its key names (:mod:`.keys`), which the web side (:mod:`.admission`: admit or
refuse with 429), the workers' side (:mod:`.reports`: what admission predicts from) and bulk work
(:mod:`.bulk_yield`: turns, migration slots, yielding, the lane gate) share; none of those three
imports another; admission's and the reports' bookkeeping writes leave from one writer thread per process
(:mod:`.background`). Where the interactive worker owns an embedded store, its threads take turns
at it (:mod:`.store_turns`). The arithmetic they feed is ``queueing`` (no Django, no Redis).
"""
from embeddings.lane_control import hops  # noqa: F401 - connects the hop records' task signals
from embeddings.lane_control.admission import answer_records, interactive_admit, interactive_answered, interactive_load
from embeddings.lane_control.bulk_yield import (
    LaneGateCycle,
    bulk_computing,
    bulk_turn,
    ingest_yielder,
    interactive_busy,
    migration_slot,
    migration_yield,
    migration_yielder,
)
from embeddings.lane_control.keys import (
    CANARY_KEY,
    CANARY_SENT_KEY,
    PRESENCE_KEY,
    key,
    queue_keys,
    redis_client,
    vectors_interactive_waiting,
)
from embeddings.lane_control.reports import batch_records, interactive_in_flight, interactive_pass, interactive_report
from embeddings.lane_control.store_turns import interactive_turn, owner_runs_threads, store_turn

__all__ = [
    # the web: admission
    "interactive_admit",
    "interactive_answered",
    "interactive_load",
    "answer_records",
    # the interactive workers: reports
    "interactive_in_flight",
    "interactive_pass",
    "interactive_report",
    "batch_records",
    # bulk work
    "bulk_turn",
    "bulk_computing",
    "migration_slot",
    "migration_yield",
    "migration_yielder",
    "ingest_yielder",
    "interactive_busy",
    "LaneGateCycle",
    # the store
    "redis_client",
    "key",
    "queue_keys",
    "vectors_interactive_waiting",
    # the store's turns where the interactive worker owns it (STORE_OWNER=interactive)
    "store_turn",
    "interactive_turn",
    "owner_runs_threads",
    # readiness (embeddings.services.readiness): workers' presence and canary answers
    "PRESENCE_KEY",
    "CANARY_KEY",
    "CANARY_SENT_KEY",
]
