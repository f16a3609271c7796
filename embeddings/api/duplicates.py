"""``/api/duplicates/``: the caller's duplicate groups in the active space, exact and near, with
their members and scores; a group reviewed (keep one, or "not duplicates"); the near-duplicate scan
and its calibrated threshold (issue 45, docs/duplicates.md). The caller's groups only (staff:
everyone's)."""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api.form_input import FormSerializer
from embeddings.api.pagination import NewestFirst
from embeddings.api.parsers import JSONParser
from embeddings.api.schema import errors
from embeddings.errors import ApplicationError
from embeddings.models import DuplicateGroup, DuplicateKind, DuplicateMember, DuplicateScan, GroupStatus
from embeddings.services.duplicates import review
from embeddings.services.duplicates import scan as scans


class DuplicateMemberSerializer(serializers.ModelSerializer):
    """One image of a group and its cosine to the group's representative."""

    image_id = serializers.UUIDField(source="image.id", read_only=True)
    external_id = serializers.CharField(source="image.external_id", read_only=True)
    original_name = serializers.CharField(source="image.original_name", read_only=True)
    sha256 = serializers.CharField(source="image.sha256", read_only=True)
    width = serializers.IntegerField(source="image.width", read_only=True, allow_null=True)
    height = serializers.IntegerField(source="image.height", read_only=True, allow_null=True)
    thumbnail_url = serializers.SerializerMethodField()

    class Meta:
        model = DuplicateMember
        fields = ("image_id", "external_id", "original_name", "sha256", "width", "height", "score", "representative",
                  "thumbnail_url")
        read_only_fields = fields
        extra_kwargs = {"score": {"help_text": "cosine to the group's representative (1.0 for it, and for exact copies)"},
                        "representative": {"help_text": "the image the others were measured against (the oldest "
                                                        "upload for exact copies)"}}

    def get_thumbnail_url(self, member: DuplicateMember) -> str:
        return f"/api/images/{member.image_id}/thumbnail/"


class DuplicateGroupSerializer(serializers.ModelSerializer):
    """A group of the caller's images that are copies of each other."""

    members = DuplicateMemberSerializer(many=True, read_only=True)
    size = serializers.SerializerMethodField()
    kept = serializers.UUIDField(source="kept_id", read_only=True, allow_null=True,
                                 help_text="the image kept when the group was resolved")

    class Meta:
        model = DuplicateGroup
        fields = ("id", "kind", "status", "model_id", "threshold", "size", "members", "kept", "created_at",
                  "reviewed_at")
        read_only_fields = fields
        extra_kwargs = {"kind": {"help_text": "exact: the same bytes uploaded again; near: different bytes whose "
                                              "cosine to the representative is at least `threshold`"},
                        "status": {"help_text": "open; resolved (one kept, the rest deleted); dismissed (not "
                                                "duplicates: its pairs never group again)"},
                        "threshold": {"help_text": "the scan's cosine threshold when the group was formed (1.0 for "
                                                   "exact copies)"}}

    def get_size(self, group: DuplicateGroup) -> int:
        return len(group.members.all())


class DuplicateScanSerializer(serializers.ModelSerializer):
    """The caller's near-duplicate scan in the active space: its threshold, how it was calibrated,
    progress and timings."""

    class Meta:
        model = DuplicateScan
        fields = ("model_id", "state", "threshold", "calibration", "scanned", "edges", "groups", "error", "started_at",
                  "finished_at", "duration_s", "query_s")
        read_only_fields = fields
        extra_kwargs = {
            "threshold": {"help_text": "cosine at or above which two images are near-duplicates; null while calibrating"},
            "calibration": {"help_text": "{source: calibrated | default | given, threshold, separable, positives, "
                                         "pairs and neighbours (n, min, q05, q50, q95, max), recall_copies, "
                                         "pairs_above, neighbours_above, sample, copies, failed}: docs/duplicates.md"},
            "scanned": {"help_text": "points whose neighbours were asked for"},
            "edges": {"help_text": "pairs above the threshold found"},
            "groups": {"help_text": "near groups formed by the last finished scan"},
            "duration_s": {"help_text": "s, from start to groups"},
            "query_s": {"help_text": "s inside the store's neighbour queries"}}


@extend_schema_field({"type": "number", "format": "double", "minimum": 0, "exclusiveMinimum": True, "maximum": 1,
                      "nullable": True})
class CosineThresholdField(serializers.FloatField):
    """A cosine threshold in (0, 1] (0 would group every pair of non-opposite images)."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if value <= 0.0:
            raise serializers.ValidationError("must be greater than 0")
        return value


class ScanStartSerializer(FormSerializer):
    """``POST /api/duplicates/scan/``."""

    threshold = CosineThresholdField(required=False, allow_null=True, max_value=1.0,
                                     help_text="a cosine in (0, 1] to group at; absent or null: calibrated from "
                                               "copies of your own images (docs/duplicates.md)")


class KeepSerializer(FormSerializer):
    """``POST /api/duplicates/{id}/keep/``."""

    image_id = serializers.UUIDField(help_text="the member to keep; every other member is deleted")


def _choice(request, name: str, values, default=None):
    value = request.query_params.get(name, default)
    if value is not None and value not in values:
        raise ApplicationError(f"{name} must be one of {', '.join(values)}", code="invalid", extra={"fields": [name]})
    return value


class DuplicateListView(GenericAPIView):
    """``GET /api/duplicates/``: the caller's duplicate groups."""

    required_scope = "duplicates"

    pagination_class = NewestFirst
    serializer_class = DuplicateGroupSerializer

    @extend_schema(operation_id="duplicates_list", responses={200: DuplicateGroupSerializer(many=True),
                                                              **errors(400, 404)},
                   parameters=[OpenApiParameter("kind", str, enum=DuplicateKind.values),
                               OpenApiParameter("status", str, enum=GroupStatus.values,
                                                description="default: open")],
                   description="The caller's duplicate groups in the active space (staff: everyone's), newest "
                               "first, a page at a time, each with its members and their cosine to the group's "
                               "representative. Exact copies (the same bytes) and near-duplicates (`kind`) are "
                               "apart. Groups come from the scan (`POST /api/duplicates/scan/`) and, after it, "
                               "from every image embedded.")
    def get(self, request):
        kind = _choice(request, "kind", DuplicateKind.values)
        state = _choice(request, "status", GroupStatus.values, GroupStatus.OPEN)
        review.refresh(request.user)
        page = self.paginate_queryset(review.groups_visible_to(request.user, kind=kind, status=state))
        return self.get_paginated_response(DuplicateGroupSerializer(page, many=True).data)


class DuplicateDetailView(APIView):
    """``GET /api/duplicates/{id}/``."""

    required_scope = "duplicates"

    @extend_schema(operation_id="duplicates_retrieve", responses={200: DuplicateGroupSerializer, **errors(404)})
    def get(self, request, group_id):
        return Response(DuplicateGroupSerializer(review.group_of(request.user, group_id)).data)


class DuplicateKeepView(APIView):
    """``POST /api/duplicates/{id}/keep/``: keep one image, delete the rest."""

    required_scope = "duplicates"

    parser_classes = (JSONParser, FormParser)

    @extend_schema(operation_id="duplicates_keep", request=KeepSerializer,
                   responses={200: DuplicateGroupSerializer, **errors(400, 404, 409, 503)},
                   description="Keep `image_id` and delete the group's other images (with their vectors, as "
                               "`DELETE /api/images/{id}/`); the group becomes `resolved`. 409 `not_a_member` (not in the group, "
                               "or no longer), "
                               "409 `already_reviewed`.")
    def post(self, request, group_id):
        s = KeepSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        group = review.keep_one(request.user, group_id, s.validated_data["image_id"])
        return Response(DuplicateGroupSerializer(group).data)


class DuplicateDismissView(APIView):
    """``POST /api/duplicates/{id}/not-duplicates/``."""

    required_scope = "duplicates"

    @extend_schema(operation_id="duplicates_not_duplicates", request=None,
                   responses={200: DuplicateGroupSerializer, **errors(404, 409)},
                   description="These images are not duplicates: the group becomes `dismissed` and every pair of "
                               "its pictures is remembered (by their bytes), so no scan groups them again, in any "
                               "space. 409 `exact_copies` for an exact group, `already_reviewed`.")
    def post(self, request, group_id):
        return Response(DuplicateGroupSerializer(review.not_duplicates(request.user, group_id)).data)


class DuplicateScanView(APIView):
    """``GET`` / ``POST /api/duplicates/scan/`` (a JSON body: a form cannot say ``null``)."""

    required_scope = "duplicates"

    parser_classes = (JSONParser,)

    @extend_schema(operation_id="duplicates_scan_retrieve", responses={200: DuplicateScanSerializer, **errors(404)},
                   description="The caller's scan in the active space; 404 `not_found` before the first.")
    def get(self, request):
        scan = review.scan_of(request.user)
        if scan is None:
            raise ApplicationError("no duplicate scan yet: POST /api/duplicates/scan/", code="not_found", status=404)
        return Response(DuplicateScanSerializer(scan).data)

    @extend_schema(operation_id="duplicates_scan_start", request=ScanStartSerializer,
                   responses={202: DuplicateScanSerializer, **errors(400, 503)},
                   description="Start (or restart) the near-duplicate scan of your images in the active space, as "
                               "background work: the threshold is calibrated from copies of a sample of your images "
                               "(unless given), every point's neighbours above it are asked of the store, and the "
                               "groups replace your open ones. Poll `GET /api/duplicates/scan/`.")
    def post(self, request):
        s = ScanStartSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        threshold = s.validated_data.get("threshold")
        scan = scans.scan_start(owner=request.user, threshold=threshold)
        return Response(DuplicateScanSerializer(scan).data, status=status.HTTP_202_ACCEPTED)
