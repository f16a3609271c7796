"""``GET /api/stats/`` (staff): images per status, the active embedding space's collection, every
space, and stage timings per lane."""
from __future__ import annotations

from django.db.models import Count
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings import sink, spaces
from embeddings.api.schema import RETRY_AFTER, errors
from embeddings.errors import ApplicationError
from embeddings.metrics import lane_summaries
from embeddings.models import EmbeddingSpace, Image


class StatsSerializer(serializers.Serializer):
    """``GET /api/stats/`` (staff); the store adds its own facts next to ``points``."""

    images = serializers.DictField(child=serializers.IntegerField(), help_text="images per status")
    distinct_embedded = serializers.IntegerField()
    collection = serializers.CharField(help_text="the active embedding space's vector store collection")
    points = serializers.IntegerField(help_text="points in the collection")
    model_id = serializers.CharField(help_text="the active embedding space")
    spaces = serializers.ListField(child=serializers.DictField(), help_text="every embedding space: model_id, state, "
                                   "collection, embedded_rows (its rows, migration copies included)")
    lanes = serializers.DictField(help_text="per lane: stage min / avg / max / p95 over its last batches")


class StatsView(APIView):
    """``GET /api/stats/`` (staff): images per status in the database, points in the collection, and
    stage timings per lane."""

    required_scope = "admin"

    @extend_schema(operation_id="stats", responses={200: StatsSerializer, **errors(403, 503)},
                   parameters=[RETRY_AFTER], description="**Staff only** (403 `forbidden` for other users).",
                   extensions={"x-staff-only": True})
    def get(self, request):


        if not request.user.is_staff:
            raise ApplicationError("staff only", code="forbidden", status=403)

        users = Image.objects.filter(source__isnull=True)  # the users' rows, not migration copies (issue 13)
        counts = {r["status"]: r["n"] for r in users.values("status").annotate(n=Count("id"))}
        distinct = users.filter(status="embedded").values("sha256").distinct().count()
        active = spaces.active()
        store = sink.store_call("collection_stats", active.model_id)
        embedded = dict(Image.objects.filter(status="embedded").values("model_id").annotate(n=Count("id"))
                        .values_list("model_id", "n"))
        per_space = [{"model_id": sp.model_id, "state": sp.state, "collection": sp.collection,
                      "embedded_rows": embedded.get(sp.model_id, 0)} for sp in EmbeddingSpace.objects.all()]

        return Response({"images": counts, "distinct_embedded": distinct, **store, "model_id": active.model_id,
                         "spaces": per_space,
                         "lanes": lane_summaries()})  # stage min/avg/max/p95 over each lane's last batches
