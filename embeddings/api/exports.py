"""``GET /api/exports/vectors.{format}``: the caller's stored vectors (staff: everyone's), or one
job's, streamed as Parquet, JSON Lines or a NumPy ``.npz`` (``services.exports``; docs/exports.md)."""
from __future__ import annotations

import json

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.views import APIView

from embeddings.api.form_input import FormSerializer
from embeddings.api.parsers import AnyAccept
from embeddings.api.schema import RETRY_AFTER, errors
from embeddings.api.vector_fields import VECTOR_FORMAT_HELP
from embeddings.services.exports import formats as export_formats
from embeddings.services.exports import rows as export_rows


class VectorExportQuerySerializer(FormSerializer):
    """Query parameters of ``GET /api/exports/vectors.{format}``."""

    job = serializers.UUIDField(required=False, help_text="only this job's images (one of yours; any job for staff)")
    space = serializers.CharField(required=False, max_length=200,
                                  help_text="the embedding space's model_id (default: the active one)")
    vector_format = serializers.ChoiceField(choices=["float", "base64"], default="float",
                                            help_text="JSON Lines only: " + VECTOR_FORMAT_HELP)


class VectorExportView(APIView):
    """``GET /api/exports/vectors.{format}``: ``parquet``, ``jsonl`` or ``npz``."""

    required_scope = "exports"

    content_negotiation_class = AnyAccept

    @extend_schema(
        operation_id="vectors_export",
        parameters=[OpenApiParameter("fmt", str, OpenApiParameter.PATH, enum=sorted(export_formats.FORMATS),
                                     description="parquet, jsonl (JSON Lines) or npz (a zip numpy.load opens: "
                                                 "vectors.npy, ids.parquet, space.json)"),
                    VectorExportQuerySerializer, RETRY_AFTER],
        description="Your stored vectors (staff: everyone's), or one job's: every embedded image and skipped "
                    "duplicate with a vector in the embedding space, in id order, streamed. Parquet: id, "
                    "external_id, sha256, model_id, metadata (JSON text), vector (fixed-size list of D float32); "
                    "the space (model, weights, precision, preprocessing) in its key-value metadata "
                    "`embedding_space`. Every format: the space in the `Embedding-Space` header (JSON). "
                    "A 503 comes before the first byte; a failure later cuts the stream (the file is then "
                    "incomplete: no Parquet footer, no zip directory). docs/exports.md.",
        responses={(200, "application/vnd.apache.parquet"): OpenApiResponse(OpenApiTypes.BINARY),
                   (200, "application/x-ndjson"): OpenApiResponse(OpenApiTypes.STR),
                   (200, "application/zip"): OpenApiResponse(OpenApiTypes.BINARY),
                   **errors(400, 404, 503)})
    def get(self, request, fmt):
        q = VectorExportQuerySerializer(data=request.query_params)
        q.is_valid(raise_exception=True)
        v = q.validated_data
        export = export_rows.export_start(user=request.user, job_id=str(v["job"]) if v.get("job") else None,
                                          model_id=v.get("space"))
        chunks = export_formats.export_stream(export, fmt, vector_format=v["vector_format"])
        media_type, filename = export_formats.FORMATS[fmt]
        response = StreamingHttpResponse(chunks, content_type=media_type)
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
        response["Embedding-Space"] = json.dumps(export.space_info(), separators=(",", ":"), ensure_ascii=True)
        response["Cache-Control"] = "no-store"
        return response
