from django.apps import AppConfig
from django.db.models.signals import post_delete


class EmbeddingsConfig(AppConfig):
    """Registers the app; nothing here imports torch."""

    name = "embeddings"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Start-up checks: a Django system check and a Celery worker_init guard (embeddings/checks.py).
        from embeddings import checks  # noqa: F401  deferred: registry not ready
        # A worker's boot-up (niceness, SCHED_IDLE, model warm-up, reconciler): Celery signal handlers
        # connected in every process, received only by workers (embeddings/worker_boot.py; no torch).
        from embeddings import worker_boot  # noqa: F401  deferred: registry not ready

        # Every deleted image row is settled by its service; connected here, not in models.py, so
        # the models never import a service (imports run one way: tests/test_import_direction.py).
        post_delete.connect(image_deleted, sender="embeddings.Image", dispatch_uid="embeddings.image_deleted")
        # the OpenAI files, batches and batch parts likewise: their blobs released after the commit
        for model in ("embeddings.BatchFile", "embeddings.Batch", "embeddings.BatchPart"):
            post_delete.connect(batch_row_deleted, sender=model, dispatch_uid=f"{model}.deleted")


def image_deleted(sender, instance, origin=None, **kwargs) -> None:
    """Every deleted row, however it goes (``image_delete``, the admin's bulk delete, the cascade
    from deleting its job or its owner), is settled by the one service: duplicates promoted, vector
    and blob forgotten after commit."""
    from embeddings.services.catalogue.images import image_deleted as settle  # deferred: registry not ready

    # single: the row deleted on its own (not its copies in other spaces, which go in the background)
    settle(image=instance, single=isinstance(origin, sender) and origin.pk == instance.pk)


def batch_row_deleted(sender, instance, **kwargs) -> None:
    """A ``/v1/files`` file, a batch or a batch part deleted, however it went (the API, the admin, the
    cascade from its job or its owner): its blobs released after the commit (``services.batches.files``)."""
    from embeddings.services.batches.files import row_deleted  # deferred: registry not ready

    row_deleted(instance)
