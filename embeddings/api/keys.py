"""``/api/keys/``: the caller's API keys (docs/api-keys.md). JSON only.

``POST`` makes a key and answers its secret, this once; ``GET`` lists keys (never a secret: the
``prefix`` names each); ``GET``/``PATCH``/``DELETE /api/keys/{id}/`` read one, rename it (staff: set
its limits) and revoke it. Each operation needs the ``keys`` scope; staff (with ``admin``) see and
revoke every user's keys.
"""
from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings import bulk_schedule
from embeddings.api.pagination import NewestFirst
from embeddings.api.parsers import JSONParser
from embeddings.api.schema import errors
from embeddings.errors import ApplicationError
from embeddings.models import BULK_WEIGHT_MAX, BULK_WEIGHT_MIN, LIMIT_SETTINGS, PRESETS, SCOPES, ApiKey
from embeddings.services.access import keys as key_services

_SCOPE_NAMES = f"scopes: {', '.join(SCOPES)}; presets: {', '.join(PRESETS)}"


def _limit(help_text: str = "") -> serializers.IntegerField:
    return serializers.IntegerField(min_value=1, max_value=key_services.LIMIT_MAX, allow_null=True, required=False,
                                    help_text=help_text or None)


class LimitsSerializer(serializers.Serializer):
    """A key's limits: each a whole number of at least 1, or null (the setting's default); its bulk
    weight a number from 0.01 to 100, or null (the owner's weight)."""

    requests_per_minute = _limit()
    images_per_minute = _limit("interactive images (uploads, embeddings' image inputs)")
    bulk_images_per_day = _limit("bulk images submitted per UTC day")
    concurrent_bulk_jobs = _limit()
    bulk_weight = serializers.FloatField(
        min_value=BULK_WEIGHT_MIN, max_value=BULK_WEIGHT_MAX, allow_null=True, required=False,
        help_text="the weight of the key's bulk jobs in the bulk lane's fair shares (an owner's share is the "
                  "largest weight among its jobs in the lane); null: the owner's (BULK_OWNER_WEIGHTS, else 1)")


class ApiKeySerializer(serializers.ModelSerializer):
    """A key as listed: never its secret."""

    scopes = serializers.ListField(child=serializers.CharField(), read_only=True,
                                   help_text=f"the key's scopes ({', '.join(SCOPES)})")
    state = serializers.SerializerMethodField(help_text="active, revoked or expired")
    limits = serializers.SerializerMethodField(help_text="the limits in force: the key's own, else the defaults")
    custom_limits = serializers.SerializerMethodField(help_text="the limits staff set on this key (null: default)")

    class Meta:
        model = ApiKey
        fields = ("id", "prefix", "name", "scopes", "state", "created_at", "expires_at", "last_used_at", "revoked_at",
                  "limits", "custom_limits")
        read_only_fields = fields

    def get_state(self, key) -> str:
        return key.state()

    @extend_schema_field(LimitsSerializer)
    def get_limits(self, key) -> dict:
        weight = bulk_schedule.job_weight(owner=key.owner.get_username(), key_weight=key.bulk_weight)
        return {**{name: key.limit(name) for name in LIMIT_SETTINGS}, "bulk_weight": weight}

    @extend_schema_field(LimitsSerializer)
    def get_custom_limits(self, key) -> dict:
        return {name: getattr(key, name) for name in key_services.LIMITS}


class ApiKeyCreatedSerializer(ApiKeySerializer):
    """A key just made, with its ``secret``: shown this once, never stored."""

    secret = serializers.CharField(help_text="Authorization: Bearer <secret>; shown this once")

    class Meta(ApiKeySerializer.Meta):
        fields = (*ApiKeySerializer.Meta.fields, "secret")
        read_only_fields = fields


class ApiKeyCreateSerializer(serializers.Serializer):
    """``POST /api/keys/``."""

    name = serializers.CharField(max_length=100, trim_whitespace=False,
                                 help_text="what the key is for (shown in lists)")
    # a ChoiceField would answer an unknown name 400 invalid; the service's unknown_scope names the valid ones
    scopes = serializers.ListField(child=serializers.CharField(max_length=50), min_length=1, max_length=50,
                                   help_text=f"scopes and presets ({_SCOPE_NAMES}); admin is for staff; another "
                                             f"name: 400 unknown_scope")
    expires_at = serializers.DateTimeField(required=False, allow_null=True, help_text="in the future; null: never")
    limits = LimitsSerializer(required=False, help_text="staff only: this key's own limits")


class ApiKeyUpdateSerializer(serializers.Serializer):
    """``PATCH /api/keys/{id}/``: a new name; (staff) limits."""

    name = serializers.CharField(max_length=100, trim_whitespace=False, required=False)
    limits = LimitsSerializer(required=False, help_text="staff only; null: the default")


def _visible(user):
    keys = ApiKey.objects.select_related("owner")  # the owner's name gives the bulk weight in force
    return keys if user.is_staff else keys.filter(owner=user)


class KeyListView(GenericAPIView):
    """``GET /api/keys/``: the caller's keys (staff: everyone's); ``POST``: a new key (secret shown once)."""

    required_scope = "keys"
    parser_classes = (JSONParser,)
    pagination_class = NewestFirst
    serializer_class = ApiKeySerializer

    @extend_schema(operation_id="keys_list", responses={200: ApiKeySerializer(many=True), **errors(400, 404)},
                   description="The caller's API keys (staff: everyone's), newest first, a page at a time; "
                               "secrets are never shown here.")
    def get(self, request):
        page = self.paginate_queryset(_visible(request.user))
        return self.get_paginated_response(ApiKeySerializer(page, many=True).data)

    @extend_schema(operation_id="keys_create", request=ApiKeyCreateSerializer,
                   responses={201: ApiKeyCreatedSerializer, **errors(400, 403)},
                   description="A new API key of the caller. The answer holds its `secret`, shown this once. "
                               "400 `unknown_scope` for a name that is neither a scope nor a preset, "
                               "`invalid` for a limit under 1 or a bulk weight outside 0.01 to 100; 403 "
                               "`scope_not_allowed` (admin asked by a user who is not staff), `forbidden` (limits "
                               "set by a user who is not staff).")
    def post(self, request):
        s = ApiKeyCreateSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        made = key_services.key_create(owner=request.user, name=v["name"], scopes=v["scopes"],
                                       expires_at=v.get("expires_at"), limits=v.get("limits"),
                                       by_staff=request.user.is_staff)
        return Response({**ApiKeySerializer(made.key).data, "secret": made.secret}, status=status.HTTP_201_CREATED,
                        headers={"Cache-Control": "no-store"})  # the secret: no cache keeps a copy


class KeyDetailView(APIView):
    """``GET``, ``PATCH``, ``DELETE`` (revoke) ``/api/keys/{id}/``."""

    required_scope = "keys"
    parser_classes = (JSONParser,)

    @extend_schema(operation_id="keys_retrieve", responses={200: ApiKeySerializer, **errors(404)})
    def get(self, request, key_id):
        return Response(ApiKeySerializer(get_object_or_404(_visible(request.user), pk=key_id)).data)

    @extend_schema(operation_id="keys_partial_update", request=ApiKeyUpdateSerializer,
                   responses={200: ApiKeySerializer, **errors(400, 403, 404)},
                   description="Rename a key; staff set its limits (403 `forbidden` for others; 400 "
                               "`invalid` for a limit under 1 or a bulk weight outside 0.01 to 100).")
    def patch(self, request, key_id):
        key = get_object_or_404(_visible(request.user), pk=key_id)
        s = ApiKeyUpdateSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        if "limits" in v:
            if not request.user.is_staff:
                raise ApplicationError("only staff set a key's limits", code="forbidden", status=403)
            for name, value in v["limits"].items():
                setattr(key, name, value)
        if "name" in v:
            key.name = v["name"]
        key.save(update_fields=["name", *key_services.LIMITS])
        return Response(ApiKeySerializer(key).data)

    @extend_schema(operation_id="keys_revoke", request=None, responses={200: ApiKeySerializer, **errors(404)},
                   description="Revoke the key: refused at once (401 `key_revoked`) on every web process.")
    def delete(self, request, key_id):
        key = key_services.key_revoke(key=get_object_or_404(_visible(request.user), pk=key_id))
        return Response(ApiKeySerializer(key).data)
