"""``/api/images/``: 1..N images embedded on the interactive lane with each one's neighbours, the
caller's images a page at a time (optionally with their stored vectors), and one image read, changed
(external_id, metadata) or deleted."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
)
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings import spaces
from embeddings.api.access import images_taken
from embeddings.api.catalogue_fields import ExternalIdField, with_identities
from embeddings.api.errors import ErrorSerializer
from embeddings.api.form_input import FormSerializer
from embeddings.api.json_input import JSONField
from embeddings.api.pagination import NewestFirst
from embeddings.api.parsers import DrfMultiPartParser as MultiPartParser
from embeddings.api.parsers import JSONParser
from embeddings.api.request_body import check_parts, parsed, uploaded_files
from embeddings.api.schema import ERROR_STATUS, RETRY_AFTER, errors
from embeddings.api.search import NeighbourSerializer
from embeddings.api.vector_fields import (
    VECTOR_PARAMETERS,
    ImageVectorField,
    VectorModelIdField,
    VectorQuerySerializer,
    VectorView,
)
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus
from embeddings.selectors import images_visible_to
from embeddings.services.catalogue.identity import image_update
from embeddings.services.catalogue.images import image_delete
from embeddings.services.catalogue.metadata import normal_external_id
from embeddings.services.catalogue.sources import from_uploads
from embeddings.services.interactive import upload as request_services
from embeddings.services.usage.keys import key_prefix_of
from embeddings.services.vectors import image_vectors


class UploadQuerySerializer(FormSerializer):
    """Fields of ``POST /api/images/`` besides the files."""

    k = serializers.IntegerField(min_value=0, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    deadline = serializers.FloatField(required=False, help_text="seconds; may shorten the default, not lengthen it")


class ImageSerializer(serializers.ModelSerializer):
    """Read-only image representation."""

    thumbnail_url = serializers.SerializerMethodField(
        help_text="JPEG thumbnail (256 px on the long side) once the image is embedded; null before")
    duplicate_of = serializers.SerializerMethodField(
        help_text="a skipped upload: the id of the caller's image with the same bytes, whose vector it shares")

    pending_external_id = serializers.SerializerMethodField(
        help_text="an external_id another of your images holds, which this one takes once its bytes are "
                  "fetched (the same bytes leave it where it is); null when none")
    vector = ImageVectorField()
    vector_model_id = VectorModelIdField()

    class Meta:
        model = Image
        fields = ("id", "status", "reason", "reason_detail", "sha256", "size_bytes", "width", "height", "format",
                  "original_name", "lane", "job", "duplicate_of", "created_at", "embedded_at", "thumbnail_url",
                  "external_id", "pending_external_id", "metadata", "origin", "row", "vector", "vector_model_id")
        read_only_fields = fields
        extra_kwargs = {"external_id": {"help_text": "your id for this image (unique among your images); \"\" when none"},
                        "metadata": {"help_text": "your attributes: a JSON object (string, number, boolean, date values)"},
                        "origin": {"help_text": "the URL or s3:// object its bytes were fetched from; \"\" for uploads"},
                        "row": {"help_text": "the manifest row (1-based, header not counted) that made it"}}

    def get_pending_external_id(self, im: Image) -> str | None:
        """The id this row claims (``Image.claimed_external_id``), None when none."""
        return im.claimed_external_id or None

    def get_duplicate_of(self, im: Image) -> uuid.UUID | None:
        """The user's row of the original: a skipped upload made after a model switch can share the
        point of a re-embedded copy (``Image.source``), whose id users never see."""
        if im.duplicate_of_id is None:
            return None
        original = im.duplicate_of
        return original.source_id or original.id

    def get_thumbnail_url(self, im: Image) -> str | None:
        """``/api/images/{id}/thumbnail/`` for an embedded (or skipped duplicate) image, else None."""
        return f"/api/images/{im.id}/thumbnail/" if im.status in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED) else None


class ImagePatchSerializer(serializers.Serializer):
    """``PATCH /api/images/{id}/``: the caller's id and metadata, changed without re-embedding."""

    external_id = ExternalIdField(required=False, allow_blank=True, allow_null=True, max_length=256,
                                  help_text="your id; \"\" or null removes it")
    metadata = JSONField(required=False, allow_null=True,
                         help_text="a JSON Merge Patch (RFC 7396) of the stored metadata object: the keys given "
                                   "change, a null value removes its key, nested objects merge, lists and other "
                                   "values replace, keys not given stay; null removes every key")


class ImageUploadSerializer(UploadQuerySerializer):
    """``POST /api/images/`` (multipart): 1..``INTERACTIVE_MAX_FILES`` image files in ``files``."""

    files = serializers.ListField(
        child=serializers.FileField(), min_length=1, max_length=settings.INTERACTIVE_MAX_FILES,
        help_text=f"image files, one part each (at most INTERACTIVE_MAX_FILES = {settings.INTERACTIVE_MAX_FILES})")
    # not positive: 400 invalid_deadline (services.requests.deadline_for); longer than the default: the default
    deadline = serializers.FloatField(required=False, min_value=0.001,
                                      help_text="seconds; may shorten the default, not lengthen it")
    external_id = ExternalIdField(max_length=256, allow_blank=True, required=False,
                                  help_text="your id of the file, unique among your images; one part per file, "
                                            "in order, for several (\"\": that file has none); not starting "
                                            "with { or [")
    metadata = serializers.DictField(required=False,
                                     help_text="a JSON object for every file (its JSON text); repeat the part once "
                                               "per file, in order, to give each its own")


class UploadedImageSerializer(serializers.Serializer):
    """One entry of an upload's answer (``services.requests.image_view``)."""

    id = serializers.UUIDField()
    status = serializers.ChoiceField(choices=ImageStatus.choices)
    reason = serializers.CharField(allow_null=True, help_text="reason code when refused (workers/errors.py)")
    detail = serializers.CharField(allow_null=True)
    sha256 = serializers.CharField()
    width = serializers.IntegerField(allow_null=True)
    height = serializers.IntegerField(allow_null=True)
    original_name = serializers.CharField(allow_blank=True)
    raw_name = serializers.CharField(required=False, help_text="the file name as sent, when it was replaced")
    job_id = serializers.UUIDField(allow_null=True)
    url = serializers.CharField(help_text="GET it for the status")
    thumbnail_url = serializers.CharField(allow_null=True)
    neighbours = NeighbourSerializer(many=True, required=False,
                                     help_text="top-k among the caller's images; absent when not embedded in time")


class UploadResponseSerializer(serializers.Serializer):
    """``POST /api/images/``: one entry per file part, in order."""

    images = UploadedImageSerializer(many=True)
    deadline_s = serializers.FloatField(help_text="the deadline applied, seconds")


def _vector_view(request, images) -> VectorView | None:
    """``include=vector`` of an image request (query parameters): the vectors of ``images`` in the
    active space, one store call for all of them; None when not asked for.

    Raises:
        ApplicationError: ``invalid`` (400: an unknown include or vector_format); the store is
            unavailable (503).
    """

    q = VectorQuerySerializer(data=request.query_params)
    q.is_valid(raise_exception=True)
    if "vector" not in q.validated_data.get("include", set()):
        return None
    model_id = spaces.active().model_id
    return VectorView(model_id=model_id, vector_format=q.validated_data["vector_format"],
                      vectors=image_vectors(images, model_id=model_id))


#: A single refused file answers the upload's own shape with its reason's status; a request refused
#: as a whole answers the error shape (README "API").
UPLOAD_REFUSAL = PolymorphicProxySerializer(
    component_name="UploadRefusal", serializers=[UploadResponseSerializer, ErrorSerializer],
    resource_type_field_name=None)


def _upload_refusal(status_code: int) -> OpenApiResponse:
    return OpenApiResponse(UPLOAD_REFUSAL, description=f"the only file refused ({status_code} by its reason, in "
                                                       f"the upload's shape), or: {ERROR_STATUS[status_code]}")


class ImageUploadView(GenericAPIView):
    """``POST /api/images/``: 1..N images on the interactive lane; ``GET``: the caller's images."""

    required_scope = {"GET": "images:read", "POST": "images:write"}

    parser_classes = (MultiPartParser, FormParser)
    pagination_class = NewestFirst
    serializer_class = ImageSerializer

    @extend_schema(
        operation_id="images_upload", request={"multipart/form-data": ImageUploadSerializer},
        parameters=[RETRY_AFTER],
        description="Embed 1..INTERACTIVE_MAX_FILES images and answer each one's neighbours within the deadline. "
                    "When the only file is refused the status follows its reason (400/413/415/422) in the same shape; "
                    "a request refused as a whole answers the error shape.",
        responses={200: UploadResponseSerializer,
                   202: OpenApiResponse(UploadResponseSerializer,
                                        description="the deadline passed: the work continues, poll each image's url"),
                   400: _upload_refusal(400), 413: _upload_refusal(413), 415: _upload_refusal(415),
                   422: _upload_refusal(422), **errors(429, 503)})
    def post(self, request):
        data, files = parsed(request)
        check_parts(data, files, file_fields=("files", "file", "image"))
        uploads = uploaded_files(files, "files", "file", "image")
        if not uploads:
            raise ApplicationError("send one or more image files in the 'files' field", code="no_files")
        if len(uploads) > settings.INTERACTIVE_MAX_FILES:
            raise ApplicationError(
                f"{len(uploads)} files; an interactive request takes at most INTERACTIVE_MAX_FILES "
                f"({settings.INTERACTIVE_MAX_FILES}); use POST /api/jobs/ for more",
                code="too_many_files",
                extra={"limit": "INTERACTIVE_MAX_FILES", "value": settings.INTERACTIVE_MAX_FILES, "files": len(uploads)},
            )
        q = UploadQuerySerializer(data=data)
        q.is_valid(raise_exception=True)
        deadline_s = request_services.deadline_for(q.validated_data.get("deadline"))
        sources = with_identities(data, from_uploads(uploads))
        images_taken(request, len(sources))
        outcome = request_services.images_upload(
            owner=request.user, sources=sources, deadline_s=deadline_s, k=q.validated_data["k"],
            key_prefix=key_prefix_of(request),
        )
        # images_upload answers one entry per source, in order: a replaced name is shown as sent
        images = [im if src.raw_name is None else {**im, "raw_name": src.raw_name}
                  for im, src in zip(outcome.images, sources)]
        return Response({"images": images, "deadline_s": deadline_s}, status=outcome.status)

    @extend_schema(operation_id="images_list", responses={200: ImageSerializer(many=True), **errors(400, 404, 503)},
                   parameters=[OpenApiParameter("external_id", str, OpenApiParameter.QUERY,
                                                description="only the image with this id of yours"),
                               *VECTOR_PARAMETERS, RETRY_AFTER],
                   description="The caller's images (staff: all), newest first, a page at a time; with "
                               "include=vector each with its stored vector (one store read per page).")
    def get(self, request):
        images = images_visible_to(request.user).select_related("duplicate_of")
        if "external_id" in request.query_params:
            wanted = request.query_params["external_id"]
            # ids are stored in NFC (normal_external_id): either spelling of one finds it; the
            # spelling as given as well, for a row stored before ids were normalised
            spellings = {wanted, normal_external_id(wanted)} - {""}
            # no image holds "" (no id) or an id with NUL (PostgreSQL cannot even compare one)
            images = (images.filter(external_id__in=spellings) if spellings and "\x00" not in wanted
                      else images.none())
        page = self.paginate_queryset(images)
        vectors = _vector_view(request, page)
        return self.get_paginated_response(ImageSerializer(page, many=True, context={"vectors": vectors}).data)


class ImageDetailView(APIView):
    """``GET`` / ``PATCH`` / ``DELETE /api/images/{id}/`` (delete removes the vector too)."""

    required_scope = {"GET": "images:read", "PATCH": "images:write", "DELETE": "images:write"}

    parser_classes = (JSONParser,)

    @extend_schema(operation_id="images_partial_update", request=ImagePatchSerializer,
                   responses={200: ImageSerializer, **errors(400, 404, 409, 415, 503)}, parameters=[RETRY_AFTER],
                   description="Change your external_id and/or metadata (merged into the stored object: JSON Merge "
                               "Patch, RFC 7396) without re-embedding; the vector's payload follows before the "
                               "answer, so the next search filters by it.")
    def patch(self, request, image_id):

        im = get_object_or_404(images_visible_to(request.user), id=image_id)
        s = ImagePatchSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        unknown = sorted(set(request.data) - set(s.fields)) if isinstance(request.data, dict) else []
        if unknown:
            raise ApplicationError(f"fields that cannot be changed: {', '.join(unknown)}", code="invalid",
                                   extra={"fields": unknown})
        im = image_update(image=im, fields={k: request.data[k] for k in s.validated_data})
        return Response(ImageSerializer(im).data)

    @extend_schema(operation_id="images_retrieve", responses={200: ImageSerializer, **errors(400, 404, 503)},
                   parameters=[*VECTOR_PARAMETERS, RETRY_AFTER])
    def get(self, request, image_id):
        im = get_object_or_404(images_visible_to(request.user), id=image_id)
        return Response(ImageSerializer(im, context={"vectors": _vector_view(request, [im])}).data)

    @extend_schema(operation_id="images_destroy", responses={204: None, **errors(404, 503)}, parameters=[RETRY_AFTER])
    def delete(self, request, image_id):
        im = get_object_or_404(images_visible_to(request.user), id=image_id)
        image_delete(image=im)
        return Response(status=status.HTTP_204_NO_CONTENT)
