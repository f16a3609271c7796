from django.apps import AppConfig


class EmbeddingsConfig(AppConfig):
    """Registers the app; nothing here imports torch."""

    name = "embeddings"
    default_auto_field = "django.db.models.BigAutoField"
