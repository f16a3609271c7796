"""``GET /api/usage/``: the caller's usage per key, model, day and kind, with its cost
(``services.usage.report``; docs/usage.md)."""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api.schema import errors
from embeddings.models import UsageKind
from embeddings.services.usage import report


class UsageRowSerializer(serializers.Serializer):
    """One group's usage: its group values (those of ``group_by`` only), then what it used."""

    key = serializers.CharField(required=False, allow_null=True,
                                help_text="group_by key: the API key's public prefix; null: a session or a legacy token")
    model = serializers.CharField(required=False, help_text="group_by model: the embedding space (model_id)")
    day = serializers.DateField(required=False, help_text="group_by day: the UTC day the work was committed")
    kind = serializers.ChoiceField(choices=UsageKind.choices, required=False, help_text="group_by kind")
    owner = serializers.IntegerField(required=False, help_text="group_by owner: the user's id")
    images_interactive = serializers.IntegerField(help_text="images embedded on the interactive lane")
    images_bulk = serializers.IntegerField(help_text="images of bulk jobs and batches embedded for the first time")
    images_reembed = serializers.IntegerField(help_text="copies embedded in another space (migrations, dual embedding)")
    texts = serializers.IntegerField(help_text="texts embedded and answered")
    searches = serializers.IntegerField(help_text="searches answered")
    fetches = serializers.IntegerField(help_text="image URLs and objects fetched")
    duplicates = serializers.IntegerField(help_text="images skipped as copies of bytes the owner had (no compute)")
    images = serializers.IntegerField(help_text="images_interactive + images_bulk + images_reembed")
    bytes = serializers.IntegerField(help_text="bytes fetched")
    compute_s = serializers.FloatField(help_text="worker seconds that computed these units")
    cost = serializers.FloatField(help_text="compute_s / 3600 × price_per_worker_hour")
    cost_per_image = serializers.FloatField(allow_null=True, help_text="the image kinds' cost over images; null "
                                            "without images")


class UsageReportSerializer(serializers.Serializer):
    """``GET /api/usage/``."""

    start = serializers.DateField()
    end = serializers.DateField()
    owner = serializers.IntegerField(allow_null=True, help_text="whose usage: a user's id; null: everyone's (staff)")
    group_by = serializers.ListField(child=serializers.ChoiceField(choices=list(report.GROUPS)))
    price_per_worker_hour = serializers.FloatField(help_text="USAGE_PRICE_PER_WORKER_HOUR")
    data = UsageRowSerializer(many=True, help_text="one row per group that used anything, ordered by its group "
                              "values")
    total = UsageRowSerializer(help_text="the whole range, every group")


DATE_PARAMETER = {"type": "string", "format": "date"}


class UsageView(APIView):
    """``GET /api/usage/``: the caller's usage (staff: anyone's, or everyone's)."""

    required_scope = "usage"

    @extend_schema(
        operation_id="usage", responses={200: UsageReportSerializer, **errors(400, 403, 404)},
        parameters=[
            OpenApiParameter("start", DATE_PARAMETER, description="first UTC day (YYYY-MM-DD); default: 30 days "
                             "before end"),
            OpenApiParameter("end", DATE_PARAMETER, description="last UTC day, counted (YYYY-MM-DD); default: today"),
            OpenApiParameter("group_by", {"type": "array", "items": {"type": "string", "enum": list(report.GROUPS)}},
                             style="form", explode=False,
                             description="what each row is per, comma-separated, in this order; none: one total "
                                         "row (400 `invalid_group_by` for another name)"),
            OpenApiParameter("owner", {"type": "string", "pattern": r"^([0-9]{1,18}|all)$"},
                             description="**Staff only**: a user's id, or `all` (403 `forbidden` for other "
                                         "users unless it is their own id; 404 `not_found` for no such user)"),
        ],
        description="Usage metered per API key, owner, model, kind and UTC day (docs/usage.md): images embedded "
                    "(interactive, bulk, re-embeds), texts, searches, fetches and their bytes, duplicates skipped, "
                    "worker compute seconds and their cost at `USAGE_PRICE_PER_WORKER_HOUR`. A range longer than "
                    "`USAGE_MAX_RANGE_DAYS` days is 400 `usage_range_too_long`, an end before its start 400 "
                    "`usage_range_inverted`, a date that is not YYYY-MM-DD 400 `invalid_date`.")
    def get(self, request):
        query = report.usage_query(user=request.user, start=request.query_params.get("start"),
                                   end=request.query_params.get("end"), group_by=request.query_params.get("group_by"),
                                   owner=request.query_params.get("owner"))
        return Response(report.usage_report(query))
