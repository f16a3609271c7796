"""``/api/migrations/``: changing the model without downtime (issue 13, docs/operations.md
"Changing the model"). Staff only. A migration is shown as its embedding space (``EmbeddingSpace``)
with its job's progress; ``promote`` / ``rollback`` / ``gate`` act on it, ``DELETE`` drops it."""
from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api.form_input import FormSerializer, StrictBooleanField
from embeddings.api.jobs import JobProgressSerializer, JobSerializer
from embeddings.api.parsers import JSONParser
from embeddings.api.schema import RETRY_AFTER, errors
from embeddings.models import EmbeddingSpace, SpaceState
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.lifecycle import gate
from embeddings.services.lifecycle import model_migrations as migrations
from embeddings.errors import ApplicationError

STAFF_ONLY = "**Staff only** (403 `forbidden` for other users)."


class MigrationCreateSerializer(FormSerializer):
    """``POST /api/migrations/``: the model to re-embed the catalogue with. It must be one the
    workers are configured for (CLIP_MODEL or CLIP_MODELS), else 400 ``model_not_configured``."""

    model = serializers.CharField(max_length=100, help_text="open_clip architecture, e.g. ViT-S-32")
    pretrained = serializers.CharField(max_length=1024, default="random",
                                       help_text="open_clip tag, checkpoint file path, or random (seeded)")
    precision = serializers.ChoiceField(choices=["fp32", "bf16", "fp16"], required=False,
                                        help_text="default: CLIP_PRECISION")
    seed = serializers.IntegerField(required=False, min_value=0, help_text="random weights' seed; default CLIP_SEED")


class PromoteSerializer(FormSerializer):
    """The body of ``POST /api/migrations/{id}/{promote|rollback|gate}/`` (only ``promote`` uses it)."""

    force = StrictBooleanField(default=False, help_text="promote although the quality gate refuses "
                                                             "(recorded in gate_report.forced); never past an "
                                                             "unfinished migration. gate and rollback check it "
                                                             "and ignore it")


class SpaceSerializer(serializers.ModelSerializer):
    """An embedding space: one model's collection and its role."""

    source = serializers.SlugRelatedField(slug_field="model_id", read_only=True, allow_null=True,
                                          help_text="the space the migration re-embeds from; null for the "
                                                    "space a deployment started with (no migration filled it)")
    url = serializers.SerializerMethodField()

    class Meta:
        model = EmbeddingSpace
        fields = ("id", "model_id", "model_name", "pretrained", "seed", "precision", "collection", "dim", "state",
                  "created_at", "promoted_at", "demoted_at", "dropped_at", "source", "gate_report", "cutoff_image",
                  "cutoff_text", "calibration", "url")
        read_only_fields = fields

    def get_url(self, space: EmbeddingSpace) -> str:
        return f"/api/migrations/{space.id}/"


class MigrationSerializer(SpaceSerializer):
    """A space with its migration job's progress (``GET /api/jobs/{id}/``'s shape; null for a space
    no migration filled: the one a deployment started with)."""

    job = JobProgressSerializer(allow_null=True, read_only=True)

    class Meta(SpaceSerializer.Meta):
        fields = SpaceSerializer.Meta.fields + ("job",)
        read_only_fields = fields


def migration_view(space: EmbeddingSpace) -> dict:
    """The API's representation of a migration: the space and its job's progress."""
    data = dict(SpaceSerializer(space).data)
    job = space.job
    data["job"] = None if job is None else {**JobSerializer(job).data, **job_services.job_progress(job)}
    return data


def _staff(request) -> None:
    if not request.user.is_staff:
        raise ApplicationError("staff only", code="forbidden", status=403)


class MigrationListView(APIView):
    """``GET /api/migrations/``: every embedding space; ``POST``: start a migration."""

    required_scope = "admin"

    parser_classes = (JSONParser, FormParser)

    @extend_schema(operation_id="migrations_list", responses={200: SpaceSerializer(many=True), **errors(403)},
                   description=STAFF_ONLY + " Every embedding space, oldest first, with its state.",
                   extensions={"x-staff-only": True})
    def get(self, request):
        _staff(request)
        return Response(SpaceSerializer(EmbeddingSpace.objects.select_related("source"), many=True).data)

    @extend_schema(operation_id="migrations_create", request=MigrationCreateSerializer,
                   responses={202: MigrationSerializer, **errors(400, 403, 409)}, extensions={"x-staff-only": True},
                   description=STAFF_ONLY + " Re-embed every live image with another model on the bulk lane "
                                            "(background priority); new uploads are embedded with both models "
                                            "meanwhile. Follow `url`; then promote it.")
    def post(self, request):
        _staff(request)
        s = MigrationCreateSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        space = migrations.migration_start(owner=request.user, model_name=v["model"], pretrained=v["pretrained"],
                                           precision=v.get("precision"), seed=v.get("seed"))
        return Response(migration_view(space), status=status.HTTP_202_ACCEPTED)


class MigrationDetailView(APIView):
    """``GET /api/migrations/{id}/``: the space, its job's progress, gate report and cutoffs;
    ``DELETE``: drop it (its collection and copies; 409 for the active space)."""

    required_scope = "admin"

    @extend_schema(operation_id="migrations_retrieve", responses={200: MigrationSerializer, **errors(403)},
                   description=STAFF_ONLY, extensions={"x-staff-only": True})
    def get(self, request, space_id):
        _staff(request)
        return Response(migration_view(get_object_or_404(EmbeddingSpace, id=space_id)))

    @extend_schema(operation_id="migrations_destroy", responses={200: MigrationSerializer, **errors(403, 409, 503)},
                   parameters=[RETRY_AFTER], extensions={"x-staff-only": True},
                   description=STAFF_ONLY + " Drop a space that is not active: its collection and its copy rows "
                                            "are deleted; the row stays, state `dropped` (409 `space_active`).")
    def delete(self, request, space_id):
        _staff(request)
        space = migrations.space_drop(get_object_or_404(EmbeddingSpace, id=space_id))
        return Response(migration_view(space))


class MigrationActionView(APIView):
    """``POST /api/migrations/{id}/{promote|rollback|gate}/``."""

    required_scope = "admin"

    parser_classes = (JSONParser, FormParser)
    actions = ("gate", "promote", "rollback")

    @extend_schema(operation_id="migrations_action", request=PromoteSerializer,
                   responses={200: MigrationSerializer, 202: MigrationSerializer, **errors(400, 403, 409)},
                   parameters=[OpenApiParameter("action", str, OpenApiParameter.PATH, enum=list(actions))],
                   extensions={"x-staff-only": True},
                   description=STAFF_ONLY + " `promote`: make this space the active one (409 "
                                            "`migration_incomplete`, `gate_failed`, `gate_missing` unless "
                                            "`force`); `rollback` (on the active space): promote the standby "
                                            "that was active before it (no gate; 409 `no_standby`, "
                                            "`not_active`); `gate`: run the quality gate again (202).")
    def post(self, request, space_id, action):
        _staff(request)
        space = get_object_or_404(EmbeddingSpace, id=space_id)
        if action not in self.actions:
            raise ApplicationError(f"unknown action {action!r}", code="not_found", status=404)
        # every action reads the body its schema declares: one the schema refuses (force=AAA, a
        # list) is a 400 for gate and rollback too, never taken as no body
        s = PromoteSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        if action == "promote":
            space = migrations.promote(space, force=s.validated_data["force"], by=request.user.get_username())
        elif action == "rollback":
            if space.state != SpaceState.ACTIVE:
                raise ApplicationError(f"{space.model_id} is not the active space: roll back from the active one",
                                       code="not_active", status=409, extra={"state": space.state})
            space = migrations.rollback(by=request.user.get_username())
        else:
            gate.gate_start(space.id)
            return Response(migration_view(space), status=status.HTTP_202_ACCEPTED)
        return Response(migration_view(space))

