"""API keys: who calls, with which scopes and under which limits (docs/api-keys.md).

The vocabulary of scopes lives here beside the model that stores them, so the API, the site, the
admin and the services read one list.
"""
from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

#: Every scope, with what it lets a key do. ``admin`` is staff-only: a staff user's powers (every
#: owner's objects, /api/stats/, model migrations, server folders) reach a key only through it.
SCOPES = {
    "images:read": "list and read images, their vectors and thumbnails",
    "images:write": "upload, change and delete images",
    "search": "search by text, image, example or vector",
    "embeddings": "compute vectors (POST /api/embeddings/, POST /v1/embeddings)",
    "jobs:read": "list and read bulk jobs and OpenAI batches (and their files)",
    "jobs:write": "submit, pause, resume and cancel bulk jobs; upload batch files and submit batches",
    "exports": "export vectors in bulk",
    "webhooks": "manage webhook endpoints and their deliveries",
    "duplicates": "scan for and review duplicate groups",
    "keys": "create, list and revoke the owner's API keys",
    "usage": "read the owner's usage and its cost (GET /api/usage/)",
    "admin": "staff only: staff powers (every owner's objects, stats, model migrations)",
}
ADMIN_SCOPE = "admin"
#: Every scope but ``admin``: what a session, a DRF token and a key with preset ``all`` hold.
USER_SCOPES = tuple(s for s in SCOPES if s != ADMIN_SCOPE)
#: Named sets a key may be made with instead of listing scopes.
PRESETS = {
    "read-only": ("images:read", "jobs:read", "search", "embeddings", "usage"),
    "ingest-only": ("images:write", "jobs:read", "jobs:write"),
    "all": USER_SCOPES,
}
#: The limits staff may set per key: field name → the setting that holds its default.
LIMIT_SETTINGS = {
    "requests_per_minute": "API_KEY_REQUESTS_PER_MINUTE",
    "images_per_minute": "API_KEY_IMAGES_PER_MINUTE",
    "bulk_images_per_day": "API_KEY_BULK_IMAGES_PER_DAY",
    "concurrent_bulk_jobs": "API_KEY_CONCURRENT_BULK_JOBS",
}
#: The bounds of a key's ``bulk_weight`` (a weight in the bulk lane's fair shares; 1 is an owner's
#: default): a hundredth to a hundred times the default share.
BULK_WEIGHT_MIN, BULK_WEIGHT_MAX = 0.01, 100.0


def _scopes_known(value) -> None:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValidationError("a list of scope names")
    unknown = sorted(set(value) - set(SCOPES))
    if unknown:
        raise ValidationError(f"unknown scopes: {', '.join(unknown)} (scopes: {', '.join(SCOPES)})")


def _limit_field(help_text: str) -> models.PositiveIntegerField:
    return models.PositiveIntegerField(null=True, blank=True,
                                       validators=[MinValueValidator(1), MaxValueValidator(2 ** 31 - 1)],
                                       help_text=help_text + "; empty: the setting's default")


class ApiKey(models.Model):
    """One API key of a user: ``Authorization: Bearer <secret>`` (or ``Token <secret>``).

    Only ``secret_hash`` (SHA-256 hex of the secret, 64 characters) is stored; the secret (``ck_`` +
    the 8-character ``prefix`` + ``_`` + 43 URL-safe characters, 256 random bits) is shown once when
    made. ``prefix`` names the key in lists and logs. A key with ``revoked_at`` set, or past
    ``expires_at``, authenticates nothing. Limits left empty take their defaults from settings
    (:data:`LIMIT_SETTINGS`); ``bulk_weight`` left empty is the owner's weight in the bulk lane
    (``embeddings.bulk_schedule.job_weight``); ``last_used_at`` is written at most once a minute.
    """

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list, validators=[_scopes_known])
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)
    requests_per_minute = _limit_field("API requests per minute")
    images_per_minute = _limit_field("interactive images per minute (uploads and embeddings)")
    bulk_images_per_day = _limit_field("bulk images submitted per day (jobs and batches)")
    concurrent_bulk_jobs = _limit_field("bulk jobs and batches running at once")
    bulk_weight = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(BULK_WEIGHT_MIN), MaxValueValidator(BULK_WEIGHT_MAX)],
        help_text=f"the weight of this key's bulk jobs in the bulk lane's fair shares ({BULK_WEIGHT_MIN:g} to "
                  f"{BULK_WEIGHT_MAX:g}); empty: the owner's weight (BULK_OWNER_WEIGHTS)")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix} ({self.name})"

    def state(self, now=None) -> str:
        """``active``, ``revoked`` or ``expired`` at ``now`` (default: the present)."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= (now or timezone.now()):
            return "expired"
        return "active"

    def limit(self, name: str) -> int:
        """The key's limit ``name`` (a key of :data:`LIMIT_SETTINGS`), else the setting's default."""
        value = getattr(self, name)
        return value if value is not None else getattr(settings, LIMIT_SETTINGS[name])
