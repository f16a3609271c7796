from django.apps import AppConfig


class EmbeddingsConfig(AppConfig):
    """Registers the app; nothing here imports torch."""

    name = "embeddings"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Start-up checks: a Django system check and a Celery worker_init guard (embeddings/checks.py).
        from embeddings import checks  # noqa: F401
