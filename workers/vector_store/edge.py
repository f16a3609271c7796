"""The ``edge`` backend: Qdrant's own engine in-process (``qdrant-edge-py``, Apache-2.0).

One ``EdgeShard`` folder per collection under the store's root (``<root>/<collection>/``: ``wal/``,
``segments/``, ``edge_config.json``). The engine keeps points in segments with payload indexes
(``owner_ids`` integer, ``job_ids`` keyword: the filters every search uses; ``items[].owner`` and
the declared metadata fields ``items[].m.<field>``: the metadata filters, :mod:`.filters`) and,
once ``optimize()`` has run, HNSW graphs; every update goes to its write-ahead log first.

Durability (measured, docs/operations.md): ``EdgeShard.update`` returns after the WAL append, so a
point survives a ``kill -9`` of this process once ``upsert`` returns (the default, and a Qdrant
server's default too); with ``fsync`` ``upsert`` also calls ``flush()`` (WAL and segments to disk)
before returning, so an acknowledged point survives a power loss too, at 5 to 200 ms per write
on a shared disk. A second process opening the same folder is refused (WAL lock).

Optimisation (building HNSW, merging segments) is never on a request's path: :class:`BackgroundOptimizer`
runs it in the owner process only after the store has been idle a while. qdrant-edge 0.9.0 holds
Python's GIL inside ``optimize()`` (measured: a sleeping thread of the same process does not wake
until it returns), so a request that arrives during an optimisation waits for its end; the idle
rule and the 1-thread index build bound how often and how long that is (docs/benchmarks.md).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import qdrant_edge as qe

from workers import screen
from workers.vector_store import (DEFAULT_STRATEGY, UPSERT_BATCH, CollectionMismatch, Hit, Point, StoreError,
                                  VectorStore, average_vector, candidate_pool, check_diversity, check_examples,
                                  check_neighbours, mismatch, others, require_usable, usable_hits, usable_vectors)
from workers.vector_store.filters import Where, payload_indexes, to_edge

log = logging.getLogger(__name__)

#: Payload fields every search filters on, with the index type Qdrant uses for them.
PAYLOAD_INDEXES = {"owner_ids": qe.PayloadSchemaType.Integer, "job_ids": qe.PayloadSchemaType.Keyword}

#: Engine schema type and index parameters of each declarable type (``filters.INDEX_TYPES``) for a
#: field inside ``items[]``. ``nested="items"`` indexes every item as its own entry, so the nested
#: filter (owner AND metadata on one item) is answered from the indexes instead of reading each
#: candidate's payload (figures: ``benchmarks/store.py --filtered``, docs/benchmarks-ingest.md).
ITEM_INDEXES = {
    "keyword": (qe.PayloadSchemaType.Keyword, lambda: qe.KeywordIndexParams(nested="items")),
    "integer": (qe.PayloadSchemaType.Integer, lambda: qe.IntegerIndexParams(lookup=True, range=True, nested="items")),
    "float": (qe.PayloadSchemaType.Float, lambda: qe.FloatIndexParams(nested="items")),
    "bool": (qe.PayloadSchemaType.Bool, lambda: qe.BoolIndexParams(nested="items")),
    "datetime": (qe.PayloadSchemaType.Datetime, lambda: qe.DatetimeIndexParams(nested="items")),
}

#: HNSW parameters: Qdrant's defaults (m 16, ef_construct 100, full_scan_threshold 10,000 KB) with
#: the index build held to one thread, so an optimisation leaves the other core of a 2-core machine
#: to the embedding workers.
HNSW = dict(m=16, ef_construct=100, full_scan_threshold=10_000, max_indexing_threads=1)

#: A segment gets an HNSW graph only above this size (KB of vectors): 400,000 KB ≈ 200,000 points of
#: 512 float32. Below it search is exact (recall 1.0; the owner filter goes through the payload
#: index), optimisation only merges and vacuums, so it is short. On random unit 512-d vectors HNSW
#: with Qdrant's defaults gave recall@10 0.37 at 20,000 points and took 220 s to build on one core
#: (measured: docs/benchmarks.md, "The embedded vector store"). Qdrant's default is 10,000.
INDEXING_THRESHOLD_KB = 400_000


def _engine_error(e: Exception) -> Exception:
    """Map a qdrant-edge ``Exception`` (the engine raises the base class) onto this package's errors."""
    msg = str(e)
    if "dimension" in msg.lower():
        return ValueError(msg)
    return StoreError(msg)


class EdgeStore(VectorStore):
    """A cosine collection of ``dim``-dimensional points in an in-process Qdrant edge shard.

    Args:
        root: folder holding one shard folder per collection (created if needed).
        collection: collection name (the shard folder's name).
        dim: vector size D (512 for ViT-B-32).
        fsync: ``upsert`` flushes to disk before it returns (else the WAL append is the ack).
        indexed_fields: metadata field → index type (``filters.INDEX_TYPES``): a payload index on
            ``items[].m.<field>`` each, created by :meth:`ensure_collection` when missing.

    Raises:
        ValueError: a bad field name or index type in ``indexed_fields``.

    Attributes:
        last_used: ``time.monotonic()`` of the last call (the optimizer's idle clock).
        unoptimized: points written since the last :meth:`optimize`.
    """

    kind = "edge"

    def __init__(self, root: str | Path, collection: str, dim: int, *, fsync: bool = False,
                 indexed_fields: dict[str, str] | None = None) -> None:
        self.folder = Path(root) / collection
        #: payload index path -> (schema type, parameters or None for the plain index of that type)
        self.indexes = {**{path: (schema, None) for path, schema in PAYLOAD_INDEXES.items()},
                        **{path: ITEM_INDEXES[t] for path, t in payload_indexes(indexed_fields).items()}}
        self.collection = collection
        self.dim = dim
        self.fsync = fsync
        self.client: qe.EdgeShard | None = None
        self.last_used = time.monotonic()
        self.unoptimized = 0
        self.closed = False

    # --- lifecycle ---------------------------------------------------------------------------------

    def _config(self) -> qe.EdgeConfig:
        return qe.EdgeConfig(vectors=qe.EdgeVectorParams(size=self.dim, distance=qe.Distance.Cosine),
                             hnsw_config=qe.HnswIndexConfig(**HNSW),
                             optimizers=qe.EdgeOptimizersConfig(indexing_threshold=INDEXING_THRESHOLD_KB))

    def ensure_collection(self) -> None:
        """Open the shard (creating it when missing); check size and distance; create the payload
        indexes it lacks (``owner_ids``, ``job_ids``, ``items[].owner``, the declared metadata fields),
        and rebuild one whose declared type changed.

        Raises:
            CollectionMismatch: the shard exists with another size or distance (read from its
                ``edge_config.json`` before the engine opens it: nothing is rewritten).
            StoreError: the folder is owned by another process (WAL lock) or cannot be opened.
        """
        if self.client is not None:
            return
        config_file = self.folder / "edge_config.json"
        try:
            if config_file.exists():
                params = json.loads(config_file.read_text())["vectors"][""]
                if params["size"] != self.dim or params["distance"] != "Cosine":
                    raise mismatch(self.collection, params["size"], params["distance"], self.dim)
                self.client = qe.EdgeShard.load(str(self.folder))
            else:
                self.folder.parent.mkdir(parents=True, exist_ok=True)
                self.client = qe.EdgeShard.create(str(self.folder), self._config())
                log.info("created edge collection %s (size %d, cosine) in %s", self.collection, self.dim, self.folder)
        except CollectionMismatch:
            raise
        except Exception as e:
            hint = " (another process owns it: only the vectors worker may open it)" if "WouldBlock" in str(e) else ""
            raise StoreError(f"cannot open the edge vector store at {self.folder}{hint}: {e}") from e
        have = {path: (info.data_type, bool(info.params is not None and getattr(info.params, "nested", None)))
                for path, info in self.client.info().payload_schema.items()}
        for path, (schema, params) in self.indexes.items():
            wanted = (schema, params is not None)
            if have.get(path) == wanted:
                continue
            # On an empty shard this is instant; on a filled one it reads every point once.
            if path in have:
                log.info("index %s of %s changes from %s to %s", path, self.collection, have[path], wanted)
                self.client.update(qe.UpdateOperation.delete_field_index(path))
            self.client.update(qe.UpdateOperation.create_field_index(path, params() if params else schema))

    def close(self) -> None:
        """Flush and release the shard and its folder lock (idempotent)."""
        if self.client is not None and not self.closed:
            self.closed = True
            self.client.flush()
            self.client.close()

    def _shard(self) -> qe.EdgeShard:
        if self.client is None:
            self.ensure_collection()
        self.last_used = time.monotonic()
        return self.client

    # --- writes --------------------------------------------------------------------------------------

    def upsert(self, points: Sequence[Point]) -> None:
        """Write points (idempotent per id) in updates of at most :data:`UPSERT_BATCH`; returns once
        they are in the WAL, and with ``fsync`` flushed to disk.

        Raises:
            ValueError: a vector whose size is not ``dim``; ``UnusableVector``: one that is not
                finite or is all zeros (nothing of the call is written).
            StoreError: the engine failed (I/O, closed shard).
        """
        matrix = require_usable(points)  # the engine would keep it, and never find it again
        shard = self._shard()
        # the engine takes lists of floats: one tolist() of the stacked vectors, not one per point
        rows = (matrix.tolist() if matrix is not None
                else [np.asarray(p.vector, np.float32).tolist() for p in points])
        try:
            for i in range(0, len(points), UPSERT_BATCH):
                shard.update(qe.UpdateOperation.upsert_points([
                    qe.Point(str(p.id), v, p.payload)
                    for p, v in zip(points[i : i + UPSERT_BATCH], rows[i : i + UPSERT_BATCH])]))
            if self.fsync and points:
                shard.flush()
        except Exception as e:
            raise _engine_error(e) from e
        self.unoptimized += len(points)

    def delete(self, ids: Sequence[uuid.UUID]) -> None:
        """Remove points by id (absent ids are ignored)."""
        if ids:
            self._update(qe.UpdateOperation.delete_points([str(i) for i in ids]))

    def set_payloads(self, payloads: dict[uuid.UUID, dict]) -> None:
        """Replace the payload of existing points."""
        for pid, payload in payloads.items():
            self._update(qe.UpdateOperation.overwrite_payload([str(pid)], payload))

    def _update(self, op) -> None:
        shard = self._shard()
        try:
            shard.update(op)
            if self.fsync:
                shard.flush()
        except Exception as e:
            raise _engine_error(e) from e

    # --- reads ---------------------------------------------------------------------------------------

    def search(self, vector: np.ndarray, *, k: int, owner_id: int | None = None, job_id: str | None = None,
               exclude: Iterable[uuid.UUID] = (), where: Where | None = None,
               with_vectors: bool = False, diversity: float = 0.0, candidates: int | None = None) -> list[Hit]:
        """Top-``k`` points by cosine similarity to ``vector`` ``(D,) float32`` (see :class:`VectorStore`);
        ``diversity`` > 0: the engine's ``Mmr`` query over ``candidates`` nearest points.

        Exact (every matching point scored) while segments are below :data:`INDEXING_THRESHOLD_KB`;
        the filter goes through the payload indexes when it is selective.
        """
        screen.require_usable(vector, "query vector")  # the engine answers an empty list for NaN
        check_diversity(diversity, candidates)
        flt = to_edge(where, owner_id=owner_id, job_id=job_id, exclude=exclude)
        if k <= 0:
            return []
        v = np.asarray(vector, np.float32).tolist()
        # Qdrant's MMR weighs relevance by lambda = 1 - diversity (qdrant-client's models.Mmr does the same)
        query = qe.Mmr(v, 1.0 - diversity, candidate_pool(k, candidates)) if diversity > 0 else qe.Query.Nearest(v)
        return self._query(qe.QueryRequest(limit=k, query=query, filter=flt, with_payload=True,
                                           with_vector=with_vectors), with_vectors)

    def recommend(self, positive: Sequence[np.ndarray], negative: Sequence[np.ndarray] = (), *, k: int,
                  strategy: str = DEFAULT_STRATEGY, owner_id: int | None = None, job_id: str | None = None,
                  exclude: Iterable[uuid.UUID] = (), where: Where | None = None, with_vectors: bool = False,
                  diversity: float = 0.0, candidates: int | None = None) -> list[Hit]:
        """Top-``k`` points for several examples (see :meth:`VectorStore.recommend`): the engine's
        ``RecommendBestScore`` / ``RecommendSumScores`` query; ``average_vector`` is a ``Nearest``
        query on :func:`average_vector`, as a Qdrant server runs it. With ``diversity``, the
        recommend query is a prefetch of the candidate pool and the engine's ``Mmr`` re-ranks it."""
        check_examples(positive, negative, strategy, diversity, candidates)
        if strategy == "average_vector":
            return self.search(average_vector(positive, negative), k=k, owner_id=owner_id, job_id=job_id,
                               exclude=exclude, where=where, with_vectors=with_vectors, diversity=diversity,
                               candidates=candidates)
        flt = to_edge(where, owner_id=owner_id, job_id=job_id, exclude=exclude)
        if k <= 0:
            return []
        examples = qe.RecommendQuery([np.asarray(v, np.float32).tolist() for v in positive],
                                     [np.asarray(v, np.float32).tolist() for v in negative])
        query = (qe.Query.RecommendBestScore if strategy == "best_score" else qe.Query.RecommendSumScores)(examples)
        if diversity > 0:
            relevance = average_vector(positive, negative)  # usable: check_examples
            pool = candidate_pool(k, candidates)
            # the filter is the prefetch's alone: MMR re-ranks only the pool it drew, and the same
            # filter again on the outer stage cost about 0.15 ms of a 1 ms query under an owner filter
            request = qe.QueryRequest(limit=k, prefetches=[qe.Prefetch(pool, query=query, filter=flt)],
                                      query=qe.Mmr(relevance.tolist(), 1.0 - diversity, pool),
                                      with_payload=True, with_vector=with_vectors)
        else:
            request = qe.QueryRequest(limit=k, query=query, filter=flt, with_payload=True, with_vector=with_vectors)
        return self._query(request, with_vectors)

    def neighbours(self, queries: Sequence[tuple[uuid.UUID, np.ndarray]], *, k: int, threshold: float,
                   owner_id: int | None = None) -> list[list[Hit]]:
        """Near neighbours of each query point (see :meth:`VectorStore.neighbours`): one
        ``query_batch`` of ``Nearest`` queries with ``score_threshold`` under one shared filter (the
        owner), ``k + 1`` each with the query's own point dropped from its answer; exact while
        segments are below :data:`INDEXING_THRESHOLD_KB`. A per-query "not this point" condition
        answers the same but made each query 3 to 4 times slower at 100,000 points
        (docs/duplicates-benchmarks.md)."""
        check_neighbours(queries, threshold)
        if k <= 0 or not queries:
            return [[] for _ in queries]
        flt = to_edge(None, owner_id=owner_id)
        requests = [qe.QueryRequest(limit=k + 1, query=qe.Query.Nearest(np.asarray(v, np.float32).tolist()),
                                    filter=flt, score_threshold=threshold, with_payload=False, with_vector=False)
                    for _, v in queries]
        try:
            got = self._shard().query_batch(qe.QueryBatchRequest(requests))
        except Exception as e:
            raise _engine_error(e) from e
        self.last_used = time.monotonic()
        return [others(pid, usable_hits(Hit(id=_uuid(p.id), score=float(p.score), payload={}) for p in res), k)
                for (pid, _), res in zip(queries, got)]

    def page(self, *, limit: int, offset: uuid.UUID | None = None,
             owner_id: int | None = None) -> tuple[list[Point], uuid.UUID | None]:
        """One page of points in id order (see :meth:`VectorStore.page`)."""
        flt = to_edge(None, owner_id=owner_id) if owner_id is not None else None
        try:
            got, nxt = self._shard().scroll(qe.ScrollRequest(offset=None if offset is None else str(offset), limit=limit,
                                                             filter=flt, with_payload=True, with_vector=True))
        except Exception as e:
            raise _engine_error(e) from e
        return ([Point(_uuid(r.id), np.asarray(r.vector, np.float32), r.payload or {}) for r in got],
                None if nxt is None else _uuid(nxt))

    def _query(self, request: qe.QueryRequest, with_vectors: bool) -> list[Hit]:
        try:
            res = self._shard().query(request)
        except Exception as e:
            raise _engine_error(e) from e
        return usable_hits(Hit(id=_uuid(p.id), score=float(p.score), payload=p.payload or {},
                               vector=np.asarray(p.vector, np.float32) if with_vectors else None) for p in res)

    def _retrieve(self, ids: Sequence[uuid.UUID], *, vectors: bool) -> list:
        if not ids:
            return []
        try:
            return self._shard().retrieve([str(i) for i in ids], with_payload=not vectors, with_vector=vectors)
        except Exception as e:
            raise _engine_error(e) from e

    def vectors(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, np.ndarray]:
        """Stored vectors ``(D,) float32`` by point id; ids not present, and unusable vectors
        (``VectorStore.vectors``), are absent from the result."""
        got = self._retrieve(ids, vectors=True)
        return usable_vectors({_uuid(r.id): np.asarray(r.vector, np.float32) for r in got})

    def payloads(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, dict]:
        """Stored payloads by point id; ids not present are absent from the result."""
        return {_uuid(r.id): r.payload or {} for r in self._retrieve(ids, vectors=False)}

    def count(self) -> int:
        """Exact number of points."""
        return self._shard().count(qe.CountRequest(exact=True))

    def scroll(self, *, batch: int = UPSERT_BATCH) -> Iterable[list[Point]]:
        """Every stored point with its vector and payload, in batches of at most ``batch``."""
        offset = None
        while True:
            got, offset = self._shard().scroll(qe.ScrollRequest(offset=offset, limit=batch, with_payload=True,
                                                                with_vector=True))
            if got:
                yield [Point(_uuid(r.id), np.asarray(r.vector, np.float32), r.payload or {}) for r in got]
            if offset is None:
                return

    # --- maintenance ---------------------------------------------------------------------------------

    def optimize(self) -> tuple[bool, float]:
        """Run the engine's optimisers (HNSW build, merges, vacuum) to completion, then flush.

        Blocks the calling thread, and (GIL) the whole process, for its duration: seconds per 10,000
        new points on one core. Only :class:`BackgroundOptimizer` or a maintenance command calls it.

        Returns:
            ``(whether any segment changed, seconds taken)``.
        """
        shard = self._shard()
        t0 = time.perf_counter()
        pending, self.unoptimized = self.unoptimized, 0
        try:
            changed = shard.optimize()
            shard.flush()
        except Exception as e:
            self.unoptimized += pending
            raise _engine_error(e) from e
        self.last_used = time.monotonic()
        return changed, time.perf_counter() - t0


def _uuid(pid) -> uuid.UUID:
    return pid if isinstance(pid, uuid.UUID) else uuid.UUID(str(pid))


class BackgroundOptimizer(threading.Thread):
    """A daemon thread of the owner process that optimises an :class:`EdgeStore` when it is idle.

    It optimises only when at least ``min_points`` points were written since the last optimisation
    and no store call came for ``idle_s`` seconds (a bulk job writes every few hundred ms, searches
    come with traffic): never between two slices of a chunk, never on a request's path. It holds a
    weak reference, so it ends by itself when the store is closed or dropped.

    Args:
        store: the store to optimise.
        idle_s: seconds without any store call before an optimisation may start.
        min_points: points written since the last optimisation that make one worth it.
        poll_s: how often it looks (s).
    """

    def __init__(self, store: EdgeStore, *, idle_s: float, min_points: int = 1_000, poll_s: float = 1.0) -> None:
        super().__init__(name="edge-optimizer", daemon=True)
        self._store = weakref.ref(store)
        self.idle_s, self.min_points, self.poll_s = idle_s, min_points, poll_s
        self.stopped = threading.Event()
        self.runs: list[float] = []  # seconds each optimisation took

    def due(self, store: EdgeStore) -> bool:
        """Whether ``store`` should be optimised now."""
        return store.unoptimized >= self.min_points and time.monotonic() - store.last_used >= self.idle_s

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            store = self._store()
            if store is None or store.closed:
                return
            if not self.due(store):
                continue
            try:
                changed, seconds = store.optimize()
            except StoreError:
                log.exception("background optimisation of %s failed; stopping the optimizer", store.collection)
                return
            self.runs.append(seconds)
            log.info("optimised %s in %.1f s (changed: %s)", store.collection, seconds, changed)
            del store

    def stop(self) -> None:
        """Ask the thread to end (it finishes a running optimisation first)."""
        self.stopped.set()
