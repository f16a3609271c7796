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
        from embeddings.models import Image  # deferred: registry not ready

        # Every deleted image row is settled by its service; connected here, not in models.py, so
        # the models never import a service (imports run one way: tests/test_import_direction.py).
        post_delete.connect(image_deleted, sender=Image, dispatch_uid="embeddings.image_deleted")
        # the OpenAI files, batches and batch parts likewise: their blobs released after the commit
        from embeddings.models import Batch, BatchFile, BatchPart  # deferred: registry not ready

        post_delete.connect(batch_file_deleted, sender=BatchFile, dispatch_uid="embeddings.batch_file_deleted")
        post_delete.connect(batch_deleted, sender=Batch, dispatch_uid="embeddings.batch_deleted")
        post_delete.connect(batch_part_deleted, sender=BatchPart, dispatch_uid="embeddings.batch_part_deleted")


def image_deleted(sender, instance, origin=None, **kwargs) -> None:
    """Every deleted row, however it goes (``image_delete``, the admin's bulk delete, the cascade
    from deleting its job or its owner), is settled by the one service: duplicates promoted, vector
    and blob forgotten after commit."""
    from embeddings.models import Image  # deferred: registry not ready
    from embeddings.services.catalogue.images import image_deleted as settle  # deferred: registry not ready

    # single: the row deleted on its own (not its copies in other spaces, which go in the background)
    settle(image=instance, single=isinstance(origin, Image) and origin.pk == instance.pk)


def batch_file_deleted(sender, instance, **kwargs) -> None:
    """A ``/v1/files`` file's row deleted, however it went (the API, the admin, its owner's
    deletion): its blob released after the commit (``services.batches.files``)."""
    from embeddings.services.batches.files import file_deleted  # deferred: registry not ready

    file_deleted(file=instance)


def batch_deleted(sender, instance, **kwargs) -> None:
    """A batch's row deleted (with its job or its owner): its input's blob released after the commit."""
    from embeddings.services.batches.files import batch_deleted as settle  # deferred: registry not ready

    settle(batch=instance)


def batch_part_deleted(sender, instance, **kwargs) -> None:
    """A batch part's row deleted (with its batch): its output, error and staged blobs released after the commit."""
    from embeddings.services.batches.files import part_deleted  # deferred: registry not ready

    part_deleted(part=instance)
