"""Per-process singletons of a worker: built lazily on first use, never at import.

The web process calls :func:`blob_store` (and, with a Qdrant server, :func:`vector_store`); the
embedding workers also build the model holder, the batch runner and the dynamic batcher. An
embedded store (edge, local) is opened only by the ``vectors`` worker (its folder admits one
process); a server by any process that does store work (``services.sink``). Each is cached for the life of the process, which is
what "load once per worker process, after fork" means for Celery's solo and threads pools.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

from django.conf import settings

from embeddings.storage import BlobStore

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
    from django.core.exceptions import ImproperlyConfigured
    from django.core.files.storage import FileSystemStorage
    from django.utils.module_loading import import_string

    config = settings.STORAGES.get("blobs")
    if config is None:
        raise ImproperlyConfigured('STORAGES has no "blobs" entry (project/settings.py builds it from STORAGE_URL)')
    backend = import_string(config["BACKEND"])
    options = dict(config.get("OPTIONS", {}))
    if issubclass(backend, FileSystemStorage):
        options.setdefault("location", str(settings.BLOB_ROOT))
    return BlobStore(backend(**options))


@functools.cache
def encoder_holder():
    """The process's lazily-loaded open_clip model (``workers.model.EncoderHolder``)."""
    from workers.model import EncoderHolder

    return EncoderHolder(settings.PIPELINE)


@functools.cache
def batch_runner():
    """The process's ``workers.runner.BatchRunner`` (decode thread pool + model)."""
    from workers.runner import BatchRunner

    return BatchRunner(settings.PIPELINE, encoder_holder())


@functools.cache
def dynamic_batcher():
    """The interactive lane's ``workers.batcher.DynamicBatcher`` over the process's model."""
    from workers.batcher import DynamicBatcher
    from workers.preprocess import normalize

    holder = encoder_holder()

    def run_batch(pixels):
        encoder = holder.get()
        return encoder.encode_images(normalize(pixels, encoder.preprocess_config))

    cfg = settings.PIPELINE
    return DynamicBatcher(
        run_batch,
        max_batch_size=cfg.interactive_max_batch_size,
        max_queue_delay_ms=cfg.interactive_max_queue_delay_ms,
    )


@functools.cache
def vector_store():
    """The collection of this embedding space on the ``VECTOR_STORE`` backend; opened, created or
    checked on first use. With the edge backend this also starts the process's background optimizer
    (``VECTOR_STORE_OPTIMIZE_IDLE_S`` > 0), which optimises only while the store is idle.

    Raises:
        workers.vector_store.CollectionMismatch: the existing collection has another size/distance.
        workers.vector_store.StoreError: the embedded folder is owned by another process.
    """
    from workers.model_config import embed_dim
    from workers.vector_store import open_store

    cfg = settings.PIPELINE
    store = open_store(settings.VECTOR_STORE, collection=cfg.collection_name, dim=embed_dim(cfg.model_name),
                       url=settings.QDRANT_URL or None, path=settings.QDRANT_PATH, fsync=settings.VECTOR_STORE_FSYNC)
    store.ensure_collection()
    old_folder = Path(settings.VAR_DIR) / "qdrant"
    if store.kind == "edge" and (old_folder / "meta.json").exists() and store.count() == 0:
        log.warning("the edge vector store is empty but %s holds a local-mode store: stop the vectors worker and run "
                    "`python manage.py store_migrate` to copy it (the source is kept)", old_folder)
    if store.kind == "edge" and settings.VECTOR_STORE_OPTIMIZE_IDLE_S > 0:
        from workers.vector_store.edge import BackgroundOptimizer

        BackgroundOptimizer(store, idle_s=settings.VECTOR_STORE_OPTIMIZE_IDLE_S,
                            min_points=settings.VECTOR_STORE_OPTIMIZE_MIN_POINTS).start()
    return store


@functools.cache
def model_id() -> str:
    """``settings.PIPELINE.model_id`` (hashes a checkpoint file once per process)."""
    return settings.PIPELINE.model_id
