"""Input validation for the API (views validate, call one service, serialise the result)."""
from __future__ import annotations

from django.conf import settings
from rest_framework import serializers

from embeddings.models import Image, ImageStatus, Job, JobPriority


class UploadQuerySerializer(serializers.Serializer):
    """Fields of ``POST /api/images/`` besides the files."""

    k = serializers.IntegerField(min_value=0, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    deadline = serializers.FloatField(required=False, help_text="seconds; may shorten the default, not lengthen it")


class JobCreateSerializer(serializers.Serializer):
    """Fields of ``POST /api/jobs/`` besides the files / zip."""

    name = serializers.CharField(required=False, allow_blank=True, max_length=200, default="")
    priority = serializers.ChoiceField(choices=JobPriority.choices, default=JobPriority.BACKGROUND)
    deadline = serializers.DateTimeField(required=False, allow_null=True, default=None)
    folder = serializers.CharField(required=False, help_text="server-side folder (staff only)")


class SearchSerializer(serializers.Serializer):
    """``POST /api/search/``: exactly one of ``text``, ``image`` (file) or ``image_id``."""

    text = serializers.CharField(required=False, max_length=2000)
    image = serializers.FileField(required=False)
    image_id = serializers.UUIDField(required=False)
    k = serializers.IntegerField(min_value=1, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    job_id = serializers.UUIDField(required=False)


class ImageSerializer(serializers.ModelSerializer):
    """Read-only image representation."""

    thumbnail_url = serializers.SerializerMethodField(
        help_text="WebP thumbnail (256 px on the long side) once the image is embedded; null before")

    class Meta:
        model = Image
        fields = ("id", "status", "reason", "reason_detail", "sha256", "size_bytes", "width", "height", "format",
                  "original_name", "lane", "job", "duplicate_of", "created_at", "embedded_at", "thumbnail_url")
        read_only_fields = fields

    def get_thumbnail_url(self, im: Image) -> str | None:
        """``/api/images/{id}/thumbnail/`` for an embedded (or skipped duplicate) image, else None."""
        return f"/api/images/{im.id}/thumbnail/" if im.status in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED) else None


class JobSerializer(serializers.ModelSerializer):
    """Read-only job representation (progress is added by the view)."""

    class Meta:
        model = Job
        fields = ("id", "name", "status", "priority", "deadline", "model_id", "chunk_size", "total",
                  "created_at", "started_at", "finished_at")
        read_only_fields = fields
