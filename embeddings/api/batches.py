"""OpenAI's Batch API: ``/v1/files`` and ``/v1/batches`` (docs/batch-api.md). The views validate,
call one service of ``services.batches`` and serialise in OpenAI's shapes; every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (``embeddings.openai_exception_handler``)."""
from __future__ import annotations

from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api.access import bulk_job
from embeddings.api.embeddings import openai_errors, openai_exception_handler
from embeddings.api.parsers import AnyAccept
from embeddings.api.parsers import DrfMultiPartParser as MultiPartParser
from embeddings.api.parsers import JSONParser
from embeddings.api.request_body import check_parts, parsed
from embeddings.errors import ApplicationError
from embeddings.models import Batch, BatchFile, BatchStatus, FilePurpose
from embeddings.services.batches import batches as batch_services
from embeddings.services.batches import files as file_services
from embeddings.services.usage.keys import key_prefix_of

#: ``limit`` of the lists: OpenAI's default and bound.
LIST_DEFAULT, LIST_MAX = 20, 100


# --- shapes ---------------------------------------------------------------------------------------

class FileUploadSerializer(serializers.Serializer):
    """``POST /v1/files`` (multipart): the file and its purpose."""

    file = serializers.FileField(help_text="JSON Lines: one /v1/embeddings request per line; at most "
                                           "BATCH_MAX_FILE_BYTES (200 MB) and BATCH_MAX_LINES (50,000) lines")
    purpose = serializers.ChoiceField(choices=("batch",), help_text="batch (the only purpose read here)")


class FileObjectSerializer(serializers.Serializer):
    """OpenAI's file object."""

    id = serializers.CharField(help_text="file-…")
    object = serializers.ChoiceField(choices=("file",))
    bytes = serializers.IntegerField()
    created_at = serializers.IntegerField(help_text="Unix s")
    filename = serializers.CharField()
    purpose = serializers.ChoiceField(choices=FilePurpose.values)
    status = serializers.ChoiceField(choices=("processed",))
    status_details = serializers.CharField(allow_null=True)
    expires_at = serializers.IntegerField(allow_null=True)


class FileListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=("list",))
    data = FileObjectSerializer(many=True)
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


class FileDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=("file",))
    deleted = serializers.BooleanField()


@extend_schema_field({"type": "object", "nullable": True, "maxProperties": 16,
                      "additionalProperties": {"type": "string", "maxLength": 512},
                      "description": "at most 16 pairs of strings, keys of at most 64 characters (OpenAPI 3.0 "
                                     "cannot say so of key names: a longer one is a 400 invalid_metadata)"})
class MetadataField(serializers.Field):
    """OpenAI's ``metadata`` (schema only: the service checks it, ``batches.metadata_check``)."""

    def to_representation(self, value):
        return value

    def to_internal_value(self, data):
        return data


class BatchRequestSerializer(serializers.Serializer):
    """``POST /v1/batches`` (schema: the view reads the body itself and the service checks it)."""

    input_file_id = serializers.CharField(max_length=64, help_text="a file of yours with purpose batch")
    endpoint = serializers.ChoiceField(choices=("/v1/embeddings",), help_text="the only endpoint run here")
    completion_window = serializers.ChoiceField(
        choices=("24h",), help_text="24h, OpenAI's window; any <n>s/m/h between BATCH_WINDOW_MIN_S and "
                                    "BATCH_WINDOW_MAX_S is accepted too (e.g. 90m)")
    metadata = MetadataField(required=False)


class BatchErrorSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="invalid_json_line, invalid_line, missing_custom_id, duplicate_custom_id, "
                                           "invalid_method, mismatched_endpoint, invalid_body, mismatched_model, ...")
    message = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    line = serializers.IntegerField(allow_null=True, help_text="1-based line of the input file (null: the file)")


class BatchErrorsSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=("list",))
    data = BatchErrorSerializer(many=True)


class RequestCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()


class BatchObjectSerializer(serializers.Serializer):
    """OpenAI's batch object."""

    id = serializers.CharField(help_text="batch_…")
    object = serializers.ChoiceField(choices=("batch",))
    endpoint = serializers.CharField()
    errors = BatchErrorsSerializer(allow_null=True)
    input_file_id = serializers.CharField()
    completion_window = serializers.CharField()
    status = serializers.ChoiceField(choices=BatchStatus.values)
    output_file_id = serializers.CharField(allow_null=True)
    error_file_id = serializers.CharField(allow_null=True)
    created_at = serializers.IntegerField(help_text="Unix s, as every time here")
    in_progress_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField()
    finalizing_at = serializers.IntegerField(allow_null=True)
    completed_at = serializers.IntegerField(allow_null=True)
    failed_at = serializers.IntegerField(allow_null=True)
    expired_at = serializers.IntegerField(allow_null=True)
    cancelling_at = serializers.IntegerField(allow_null=True)
    cancelled_at = serializers.IntegerField(allow_null=True)
    request_counts = RequestCountsSerializer()
    metadata = serializers.DictField(child=serializers.CharField(), allow_null=True)


class BatchListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=("list",))
    data = BatchObjectSerializer(many=True)
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


# --- helpers --------------------------------------------------------------------------------------

def _unix(t) -> int | None:
    return int(t.timestamp()) if t is not None else None


def file_view(f: BatchFile) -> dict:
    """OpenAI's file object of a file."""
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": _unix(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


def batch_view(b: Batch) -> dict:
    """OpenAI's batch object of a batch (``request_counts``: the lines finished so far)."""
    # a cancelled batch never shows finalizing (its finalizing_at marks the claim of its files only)
    finalizing = b.finalizing_at if b.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED) else None
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint,
        "errors": {"object": "list", "data": b.errors} if b.errors else None,
        "input_file_id": b.input_file_name, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "created_at": _unix(b.created_at), "in_progress_at": _unix(b.in_progress_at), "expires_at": _unix(b.expires_at),
        "finalizing_at": _unix(finalizing), "completed_at": _unix(b.completed_at), "failed_at": _unix(b.failed_at),
        "expired_at": _unix(b.expired_at), "cancelling_at": _unix(b.cancelling_at),
        "cancelled_at": _unix(b.cancelled_at), "request_counts": batch_services.request_counts(b),
        "metadata": b.metadata,
    }


def _page(items: list, has_more: bool, view) -> dict:
    data = [view(x) for x in items]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _limit(request, default: int = LIST_DEFAULT, bound: int = LIST_MAX) -> int:
    """``?limit=`` as an integer in 1..bound.

    Raises:
        ApplicationError: ``invalid_limit`` (400, ``param`` limit).
    """
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    try:
        value = int(raw) if len(raw) < 12 else 0
    except ValueError:
        value = 0
    if not 1 <= value <= bound:
        raise ApplicationError(f"limit: an integer from 1 to {bound}", code="invalid_limit", extra={"param": "limit"})
    return value


class OpenAIView(APIView):
    """A ``/v1`` view: OpenAI's error shape for every error."""

    def get_exception_handler(self):
        return openai_exception_handler


# --- /v1/files ------------------------------------------------------------------------------------

def list_params(default: int, bound: int) -> list[OpenApiParameter]:
    """A list's ``after`` and ``limit`` (1..``bound``, default ``default``) for the schema."""
    return [OpenApiParameter("after", str, description="the id of the last item of the previous page (one of "
                                                       "yours: else 404 not_found)"),
            OpenApiParameter("limit", {"type": "integer", "minimum": 1, "maximum": bound},
                             description=f"1..{bound}, default {default}")]


class FileListView(OpenAIView):
    """``POST /v1/files`` (upload a batch input), ``GET /v1/files`` (yours, newest first)."""

    required_scope = {"GET": "jobs:read", "POST": "jobs:write"}

    parser_classes = (MultiPartParser,)

    @extend_schema(operation_id="openai_files_create", request={"multipart/form-data": FileUploadSerializer},
                   description="Upload a batch input file (JSON Lines, purpose batch). Its lines are checked when a "
                               "batch reads it.",
                   responses={200: FileObjectSerializer, **openai_errors(400, 401, 413, 415)})
    def post(self, request):
        # refused before Django spools a body far over the limit to disk (a part's headers: < 64 KiB)
        file_services.file_size_check(int(request.META.get("CONTENT_LENGTH") or 0) - (1 << 16))
        data, files = parsed(request)
        check_parts(data, files, file_fields=("file",))
        uploads = files.getlist("file")
        if len(uploads) != 1:
            raise ApplicationError("send one file in the field 'file'", code="invalid_input", extra={"param": "file"})
        purpose = data.get("purpose") if hasattr(data, "get") else None
        if not isinstance(purpose, str):
            raise ApplicationError("purpose is required: batch", code="invalid_purpose", extra={"param": "purpose"})
        upload = uploads[0]
        f = file_services.file_upload(owner=request.user, filename=upload.name, size=upload.size, stream=upload,
                                      purpose=purpose)
        return Response(file_view(f))

    @extend_schema(operation_id="openai_files_list",
                   parameters=[*list_params(file_services.LIST_MAX, file_services.LIST_MAX),
                               OpenApiParameter("purpose", str, enum=FilePurpose.values),
                               OpenApiParameter("order", str, enum=["asc", "desc"])],
                   responses={200: FileListSerializer, **openai_errors(400, 401, 404)})
    def get(self, request):
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApplicationError("order: asc or desc", code="invalid_order", extra={"param": "order"})
        purpose = request.query_params.get("purpose")
        if purpose is not None and purpose not in FilePurpose.values:
            raise ApplicationError(f"purpose: one of {', '.join(FilePurpose.values)}", code="invalid_purpose",
                                   extra={"param": "purpose"})
        items, more = file_services.files_list(owner=request.user, purpose=purpose,
                                               after=request.query_params.get("after"),
                                               limit=_limit(request, file_services.LIST_MAX, file_services.LIST_MAX),
                                               order=order)
        return Response(_page(items, more, file_view))


class FileDetailView(OpenAIView):
    """``GET``, ``DELETE /v1/files/{file_id}``."""

    required_scope = {"GET": "jobs:read", "DELETE": "jobs:write"}

    @extend_schema(operation_id="openai_files_retrieve", responses={200: FileObjectSerializer,
                                                                    **openai_errors(401, 404)})
    def get(self, request, file_id: str):
        return Response(file_view(file_services.file_get(owner=request.user, file_id=file_id)))

    @extend_schema(operation_id="openai_files_delete", responses={200: FileDeletedSerializer,
                                                                  **openai_errors(401, 404)})
    def delete(self, request, file_id: str):
        f = file_services.file_get(owner=request.user, file_id=file_id)
        deleted = f.id  # a deleted row's pk is None
        file_services.file_delete(file=f)
        return Response({"id": deleted, "object": "file", "deleted": True})


class FileContentView(OpenAIView):
    """``GET /v1/files/{file_id}/content``: the file's bytes, streamed, whatever ``Accept`` says
    (OpenAI's client sends ``application/binary``)."""

    required_scope = "jobs:read"

    content_negotiation_class = AnyAccept

    @extend_schema(operation_id="openai_files_content",
                   responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **openai_errors(401, 404)})
    def get(self, request, file_id: str):
        f = file_services.file_get(owner=request.user, file_id=file_id)
        try:
            stream = file_services.file_open(f)
        except Exception as e:  # noqa: BLE001 - the row outlived its blob: a 404 naming it, never a 500
            raise ApplicationError(f"{f.id}: its content is gone", code="not_found", status=404,
                                   extra={"param": "file_id"}) from e
        return FileResponse(stream, content_type="application/octet-stream", as_attachment=True, filename=f.filename)


# --- /v1/batches ----------------------------------------------------------------------------------

class BatchListView(OpenAIView):
    """``POST /v1/batches`` (run a file's lines as a bulk job), ``GET /v1/batches`` (yours, newest first)."""

    required_scope = {"GET": "jobs:read", "POST": "jobs:write"}

    parser_classes = (JSONParser,)

    @extend_schema(operation_id="openai_batches_create", request=BatchRequestSerializer,
                   description="Run an input file's /v1/embeddings requests as a bulk job on the bulk lane, within "
                               "the completion window (the job's deadline).",
                   responses={200: BatchObjectSerializer, **openai_errors(400, 401, 404, 413, 415)})
    def post(self, request):
        data, _ = parsed(request)
        if not isinstance(data, dict):
            raise ApplicationError("the body must be a JSON object", code="invalid_input", extra={"param": None})
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(data.get(name), str):
                raise ApplicationError(f"{name} is required (a string)", code="invalid_input", extra={"param": name})
        # a line may be a text or an image: admitted under the day's bulk limit, a slot of the key's jobs
        with bulk_job(request, 0) as made:
            b = batch_services.batch_create(owner=request.user, input_file_id=data["input_file_id"],
                                            endpoint=data["endpoint"], completion_window=data["completion_window"],
                                            metadata=data.get("metadata"), key_prefix=key_prefix_of(request))
            made(b.job_id)
        return Response(batch_view(b))

    @extend_schema(operation_id="openai_batches_list", parameters=list_params(LIST_DEFAULT, LIST_MAX),
                   responses={200: BatchListSerializer, **openai_errors(400, 401, 404)})
    def get(self, request):
        items, more = batch_services.batches_list(owner=request.user, after=request.query_params.get("after"),
                                                  limit=_limit(request))
        return Response(_page(items, more, batch_view))


class BatchDetailView(OpenAIView):
    """``GET /v1/batches/{batch_id}``."""

    required_scope = "jobs:read"

    @extend_schema(operation_id="openai_batches_retrieve", responses={200: BatchObjectSerializer,
                                                                      **openai_errors(401, 404)})
    def get(self, request, batch_id: str):
        return Response(batch_view(batch_services.batch_get(owner=request.user, batch_id=batch_id)))


class BatchCancelView(OpenAIView):
    """``POST /v1/batches/{batch_id}/cancel``: queued lines never run (``batch_cancelled``), running
    ones finish and are kept."""

    required_scope = "jobs:write"

    @extend_schema(operation_id="openai_batches_cancel", request=None,
                   responses={200: BatchObjectSerializer, **openai_errors(401, 404, 409)})
    def post(self, request, batch_id: str):
        b = batch_services.batch_get(owner=request.user, batch_id=batch_id)
        return Response(batch_view(batch_services.batch_cancel(batch=b)))
