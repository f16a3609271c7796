"""Per-process singletons of a worker: built lazily on first use, never at import.

The web process calls :func:`blob_store` (and, with a Qdrant server, :func:`vector_store`); the
embedding workers also build the model holder, the batch runner and the dynamic batcher. An
embedded store (edge, local) is opened only by the ``vectors`` worker (its folder admits one
process); a server by any process that does store work (``services.sink``). Each is cached for the life of the process, which is
what "load once per worker process, after fork" means for Celery's solo and threads pools.
"""
from __future__ import annotations

import functools
import ipaddress
import logging
import os
import shutil
import socket
import threading
import types
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.files.storage import FileSystemStorage
from django.utils.module_loading import import_string

from embeddings import lane_control, spaces, worker_health
from embeddings.models import EmbeddingSpace, SpaceState
from embeddings.objects import ObjectError, make_client, open_object
from embeddings.storage import BlobStore
from project.celery import app
from workers.errors import ImageRejected, Reason
from workers.fetch import Fetcher, FetchPolicy
from workers.model_config import embed_dim
from workers.vector_store import open_store
from workers.vector_store.edge import BackgroundOptimizer

log = logging.getLogger(__name__)


@functools.cache
def blob_store() -> BlobStore:
    """The content-addressed blob store over the storage ``settings.STORAGES["blobs"]``.

    Built here rather than taken from ``django.core.files.storage.storages`` so that a filesystem
    backend without a ``location`` option takes ``settings.BLOB_ROOT`` as it is now (tests point it
    at a temporary folder and clear this cache). The S3 backend (django-storages) imports boto3 only
    here, on first use: the web process stays torch-free and starts without it when it is unused.

    Raises:
        django.core.exceptions.ImproperlyConfigured: no ``blobs`` entry in ``STORAGES``.
    """

    config = settings.STORAGES.get("blobs")
    if config is None:
        raise ImproperlyConfigured('STORAGES has no "blobs" entry (project/settings.py builds it from STORAGE_URL)')
    backend = import_string(config["BACKEND"])
    options = dict(config.get("OPTIONS", {}))
    if issubclass(backend, FileSystemStorage):
        options.setdefault("location", str(settings.BLOB_ROOT))
    return BlobStore(backend(**options), objects=source_object)


@functools.cache
def source_client():
    """The boto3 S3 client of the catalogue buckets (``SOURCE_BUCKETS``), built on first use with
    the blob store's endpoint and credentials (``settings.SOURCE_S3``)."""

    return make_client(**settings.SOURCE_S3)


def source_object(bucket: str, key: str) -> bytes:
    """The bytes of object ``key`` of a catalogue bucket, at most ``max_image_bytes``.

    Raises:
        ImageRejected: ``source_missing`` (no such object), ``too_large``.
    """

    try:
        return open_object(source_client(), bucket, key, max_bytes=settings.PIPELINE.max_image_bytes)
    except ObjectError as e:
        reason = Reason.TOO_LARGE if e.code == "too_large" else Reason.SOURCE_MISSING
        raise ImageRejected(reason, f"s3://{bucket}/{key}: {e}") from e


@functools.cache
def fetcher():
    """This process's URL fetcher (``workers.fetch.Fetcher``) under the ``FETCH_*`` settings: one
    per process, so its per-host bound and pooled connections span every thread."""


    return Fetcher(FetchPolicy(
        connect_timeout_s=settings.FETCH_CONNECT_TIMEOUT_S, read_timeout_s=settings.FETCH_READ_TIMEOUT_S,
        total_timeout_s=settings.FETCH_TOTAL_TIMEOUT_S, max_bytes=settings.PIPELINE.max_image_bytes,
        max_redirects=settings.FETCH_MAX_REDIRECTS, retries=settings.FETCH_RETRIES, per_host=settings.FETCH_PER_HOST,
        allow_networks=tuple(ipaddress.ip_network(n, strict=False) for n in settings.FETCH_ALLOW_NETWORKS),
    ))


def webhook_poster():
    """This process's webhook sender (``workers.fetch.Fetcher``, :meth:`~workers.fetch.Fetcher.post`):
    the fetcher's address rules (``FETCH_ALLOW_NETWORKS``) and per-host bound, one attempt of at
    most ``WEBHOOK_TIMEOUT_S`` in all, no redirect, no retry (the delivery schedule retries). One
    per process and settings."""
    return _webhook_poster(settings.WEBHOOK_TIMEOUT_S, settings.FETCH_CONNECT_TIMEOUT_S, settings.FETCH_PER_HOST,
                           tuple(settings.FETCH_ALLOW_NETWORKS))


@functools.lru_cache(maxsize=4)
def _webhook_poster(timeout_s: float, connect_s: float, per_host: int, allow: tuple[str, ...]):


    return Fetcher(FetchPolicy(
        connect_timeout_s=min(connect_s, timeout_s), read_timeout_s=timeout_s, total_timeout_s=timeout_s,
        max_bytes=64 * 1024, max_redirects=0, retries=0, per_host=per_host,
        allow_networks=tuple(ipaddress.ip_network(n, strict=False) for n in allow),
        user_agent="clip-embeddings-webhooks/1.0",
    ))


class _PerModel:
    """A per-process cache of one object per embedding space (key: ``model_id``), built on first
    use under a lock (eight interactive task threads must not load a model twice). ``None`` means
    the process's configured model (``settings.PIPELINE``); callers doing work for a space pass its
    ``model_id`` (a chunk: its job's; an upload: its rows'; a query: the active space's).
    ``cache_clear()`` / ``cache_info().currsize`` as ``functools.cache`` (tests)."""

    def __init__(self, build, on_clear=None) -> None:
        self._build, self._on_clear = build, on_clear
        self._lock = threading.RLock()
        self._items: dict[str, object] = {}
        functools.update_wrapper(self, build)

    def __call__(self, model_id: str | None = None):
        key = model_id or configured_model_id()
        got = self._items.get(key)
        if got is None:
            with self._lock:
                got = self._items.get(key)
                if got is None:
                    got = self._items[key] = self._build(key)
        return got

    def held(self) -> dict[str, object]:
        """``{model_id: object}`` built so far in this process."""
        return dict(self._items)

    def forget(self, model_id: str):
        """Drop one space's object (returned, or None)."""
        with self._lock:
            return self._items.pop(model_id, None)

    def cache_info(self):
        return types.SimpleNamespace(currsize=len(self._items))

    def cache_clear(self) -> None:
        with self._lock:
            items, self._items = list(self._items.values()), {}
        if self._on_clear is not None:
            for item in items:
                self._on_clear(item)


def _config(model_id: str):

    return spaces.config_for_model_id(model_id)


def _encoder_holder(model_id: str):
    """The lazily-loaded open_clip model of space ``model_id`` (``workers.model.EncoderHolder``).

    Raises:
        embeddings.spaces.ModelNotConfigured: this process may not load that model.
    """
    from workers.model import EncoderHolder  # deferred: would load torch

    return EncoderHolder(_config(model_id))


#: ``encoder_holder(model_id=None)``: the process's model holder of one space (see :class:`_PerModel`).
encoder_holder = _PerModel(_encoder_holder)


def _batch_runner(model_id: str):
    """The ``workers.runner.BatchRunner`` (decode thread pool + model) of space ``model_id``."""
    from workers.runner import BatchRunner  # deferred: would load torch

    return BatchRunner(_config(model_id), encoder_holder(model_id))


#: ``batch_runner(model_id=None)``: one ``BatchRunner`` per space held by this process.
batch_runner = _PerModel(_batch_runner)


def _dynamic_batcher(model_id: str):
    """The interactive lane's ``workers.batcher.DynamicBatcher`` over space ``model_id``'s model."""
    from workers.batcher import DynamicBatcher  # deferred: would load torch
    from workers.preprocess import normalize  # deferred: would load torch

    holder = encoder_holder(model_id)

    def run_batch(pixels):
        # every pass is judged: a streak of failures makes the worker leave the pool (worker_health)
        try:
            encoder = holder.get()
            vectors = encoder.encode_images(normalize(pixels, encoder.preprocess_config))
        except Exception as e:
            worker_health.pass_failed(f"{type(e).__name__}: {e}")
            raise
        worker_health.judge_vectors(vectors)
        return vectors

    cfg = settings.PIPELINE
    return DynamicBatcher(
        run_batch,
        max_batch_size=cfg.interactive_max_batch_size,
        max_queue_delay_ms=cfg.interactive_max_queue_delay_ms,
        on_pass=_pass_hook(model_id),
        wait_for=settings.INTERACTIVE_BATCH_WAIT,
    )


def _pass_hook(model_id: str):
    """The dynamic batcher's ``on_pass``: admission counts a running pass as the time it has left
    (``lane_control.keys.PASSES_KEY``). None where admission sees nothing (admission off, eager Celery)."""

    if not settings.ADMISSION_CONTROL or app.conf.task_always_eager:
        return None
    name = f"{socket.gethostname()}:{os.getpid()}:{model_id}"
    return lambda images, at: lane_control.interactive_pass(name, images, at)


#: ``dynamic_batcher(model_id=None)``: one dynamic batcher (and model thread) per space.
dynamic_batcher = _PerModel(_dynamic_batcher, on_clear=lambda b: b.close())


def _vector_store(model_id: str):
    """The collection of embedding space ``model_id`` on the ``VECTOR_STORE`` backend; opened,
    created or checked on first use (edge: one shard folder per collection under QDRANT_PATH). With
    the edge backend this also starts the store's background optimizer
    (``VECTOR_STORE_OPTIMIZE_IDLE_S`` > 0), which optimises only while the store is idle.

    Every collection gets the payload indexes of the metadata fields ``METADATA_INDEXES`` declares
    (built when missing, also on an existing collection).

    The collection and size come from the space's row (any space, configured or not: the vectors
    worker loads no model), else from the configured model (a process before the first space row).

    Raises:
        workers.vector_store.CollectionMismatch: the existing collection has another size/distance.
        workers.vector_store.StoreError: the embedded folder is owned by another process.
    """

    collection = dim = None
    cfg = settings.PIPELINE
    if model_id != configured_model_id():

        row = EmbeddingSpace.objects.filter(model_id=model_id).values_list("collection", "dim").first()
        if row is not None:
            collection, dim = row
        else:
            cfg = _config(model_id)
    if collection is None:
        collection, dim = cfg.collection_name, embed_dim(cfg.model_name)

    store = open_store(settings.VECTOR_STORE, collection=collection, dim=dim,
                       url=settings.QDRANT_URL or None, path=settings.QDRANT_PATH, fsync=settings.VECTOR_STORE_FSYNC,
                       indexed_fields=spaces.declared_fields())
    store.ensure_collection()
    old_folder = Path(settings.VAR_DIR) / "qdrant"
    if store.kind == "edge" and (old_folder / "meta.json").exists() and store.count() == 0:
        log.warning("the edge vector store is empty but %s holds a local-mode store: stop the vectors worker and run "
                    "`python manage.py store_migrate` to copy it (the source is kept)", old_folder)
    if store.kind == "edge" and settings.VECTOR_STORE_OPTIMIZE_IDLE_S > 0:

        BackgroundOptimizer(store, idle_s=settings.VECTOR_STORE_OPTIMIZE_IDLE_S,
                            min_points=settings.VECTOR_STORE_OPTIMIZE_MIN_POINTS).start()
    return store


def _close_store(store) -> None:
    try:
        store.close()
    except Exception:  # noqa: BLE001 - closing twice, an engine already gone: nothing to release
        log.debug("closing %s failed", getattr(store, "collection", store), exc_info=True)


#: ``vector_store(model_id=None)``: one open collection per space (see :func:`_vector_store`).
vector_store = _PerModel(_vector_store, on_clear=_close_store)


def drop_collection(model_id: str, collection: str, dim: int) -> bool:
    """Delete space ``model_id``'s collection with every point in it (``drop``): an edge shard's
    folder is removed, a server collection deleted. Idempotent.

    Returns:
        True when something was deleted.
    """


    store = vector_store.forget(model_id)
    if store is None:
        store = open_store(settings.VECTOR_STORE, collection=collection, dim=dim, url=settings.QDRANT_URL or None,
                           path=settings.QDRANT_PATH, fsync=settings.VECTOR_STORE_FSYNC)
    if store.kind == "server":
        return bool(store.client.delete_collection(collection))
    _close_store(store)
    folder = getattr(store, "folder", None)
    if folder is not None and Path(folder).exists():
        shutil.rmtree(folder)
        return True
    if store.kind == "local" and store.client.collection_exists(collection):
        return bool(store.client.delete_collection(collection))
    return False


def model_id() -> str:
    """The active embedding space's ``model_id`` (``embeddings.spaces.active``, cached
    ≤ ``SPACE_CACHE_S``): the space new uploads and searches use."""

    return spaces.active().model_id


def _forget_active() -> None:

    spaces.forget_cache()


model_id.cache_clear = _forget_active  # type: ignore[attr-defined]


def configured_model_id() -> str:
    """``settings.PIPELINE.model_id``: the model this process was started with (hashes a checkpoint
    file once per process)."""
    return _configured_model_id(settings.PIPELINE)


@functools.cache
def _configured_model_id(cfg) -> str:
    return cfg.model_id


def warm_spaces() -> list[str]:
    """Load, in this process, the model of every space that may become (or is) the active one and
    that this process is configured for: the active space, each ``candidate`` and ``standby``. An
    interactive worker calls it at start and then every second (``worker_boot.warm_model``), so after a
    promotion or a rollback no waiting person pays for a model load.

    Returns:
        The model ids loaded by this call (already loaded ones are not counted).
    """

    configured = spaces.configured_configs()
    wanted = set(EmbeddingSpace.objects.filter(state__in=(SpaceState.ACTIVE, SpaceState.CANDIDATE, SpaceState.STANDBY))
                 .values_list("model_id", "state"))
    loaded = []
    for mid, state in sorted(wanted):
        if mid not in configured and state != SpaceState.ACTIVE:
            continue  # a worker never loads a model it is not configured for
        holder = encoder_holder(mid)
        if not holder.loaded:
            holder.get()
            loaded.append(mid)
        dynamic_batcher(mid)
    return loaded


def configured_model_warning() -> str | None:
    """A sentence when the configured model (CLIP_MODEL, CLIP_PRETRAINED, CLIP_PRECISION) is not
    the active space's: the active row decides (issue 13), and changing the variables is a
    migration (docs/operations.md "Changing the model"), not a switch. None when they agree or when
    no space exists yet (the first read creates it from the configuration)."""

    active = EmbeddingSpace.objects.filter(state=SpaceState.ACTIVE).values_list("model_id", flat=True).first()
    configured = configured_model_id()
    if active is None or active == configured:
        return None
    return (f"CLIP_MODEL names {configured} but the active space is {active}: searches and uploads keep using "
            f"{active}; to change the model, start a migration (manage.py model_migration start, docs/operations.md)")
