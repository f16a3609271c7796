"""Usage: one counter row per day, owner, API key, model and kind of work (docs/usage.md). Rows are
only ever incremented, in the transaction that commits the work they count
(``services.usage.meter``), so a redelivered message that commits nothing adds nothing."""
from __future__ import annotations

from django.conf import settings
from django.db import models


class UsageKind(models.TextChoices):
    """What one unit is (docs/usage.md, "What is metered").

    - ``image_interactive``: an image embedded on the interactive lane (an upload, ``POST
      /api/embeddings/``, ``POST /v1/embeddings``), counted once its vector is committed (stored)
      or answered (not stored);
    - ``image_bulk``: an image of a bulk job (an ingest, a catalogue, an OpenAI batch) whose vector
      is committed for the first time;
    - ``image_reembed``: a copy of an image embedded under another space (a migration, dual
      embedding), committed for the first time;
    - ``text``: a text embedded and answered;
    - ``search``: a search answered (by text, image, stored image or examples);
    - ``fetch``: an image URL or object read for a catalogue row or a request, ``bytes`` its size;
    - ``duplicate``: an image skipped as a copy of bytes the owner has already (no compute).
    """

    IMAGE_INTERACTIVE = "image_interactive"
    IMAGE_BULK = "image_bulk"
    IMAGE_REEMBED = "image_reembed"
    TEXT = "text"
    SEARCH = "search"
    FETCH = "fetch"
    DUPLICATE = "duplicate"


#: The kinds whose units are images embedded: the denominator of the cost per image.
IMAGE_KINDS = (UsageKind.IMAGE_INTERACTIVE, UsageKind.IMAGE_BULK, UsageKind.IMAGE_REEMBED)


class UsageRecord(models.Model):
    """One day's usage of one owner through one key, in one model, of one kind.

    Attributes:
        day: the UTC date the work was committed.
        key_prefix: the API key's public prefix (``ck_…``); ``""``: a session or a legacy token.
        model_id: the embedding space (``EmbeddingSpace.model_id``); ``""`` for a fetch of no space.
        units: images, texts, searches or fetches (:class:`UsageKind`).
        bytes: bytes fetched (``fetch``; 0 otherwise).
        compute_s: seconds a worker computed the units (decode, preprocess, forward passes),
            the basis of their cost (``USAGE_PRICE_PER_WORKER_HOUR``).
    """

    day = models.DateField()
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="usage")
    key_prefix = models.CharField(max_length=32, blank=True, default="")
    model_id = models.CharField(max_length=200, blank=True, default="")
    kind = models.CharField(max_length=24, choices=UsageKind.choices)
    units = models.PositiveBigIntegerField(default=0)
    bytes = models.PositiveBigIntegerField(default=0)
    compute_s = models.FloatField(default=0.0)

    class Meta:
        ordering = ("-day", "owner_id", "key_prefix", "model_id", "kind")
        constraints = [
            # the upsert's conflict target (services.usage.meter): one row per day, owner, key, model, kind
            models.UniqueConstraint(fields=["day", "owner", "key_prefix", "model_id", "kind"], name="usage_one_row"),
        ]
        indexes = [models.Index(fields=["owner", "day"])]

    def __str__(self) -> str:
        return f"{self.day} {self.owner_id} {self.key_prefix or '-'} {self.model_id} {self.kind}: {self.units}"
