"""Serializers of webhook endpoints (issue 42, docs/webhooks.md), shared by ``/api/webhooks/`` and
the job endpoints (a job's ``callback_url``): the endpoint as shown (never its secret) and as made
(its secret, shown once)."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from embeddings.api import json_input
from embeddings.models import WebhookEndpoint, WebhookEvent


class WebhookSerializer(serializers.ModelSerializer):
    """A webhook endpoint; its secret is shown only when made or rotated."""

    job = serializers.UUIDField(source="job_id", read_only=True, allow_null=True,
                                help_text="the job whose events it hears; null: every job of the account "
                                          "(and, for staff, the model migrations)")
    events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEvent.choices), read_only=True,
                                   help_text="event types subscribed; empty: every event")
    url = serializers.CharField(read_only=True)
    deliveries_url = serializers.SerializerMethodField()

    class Meta:
        model = WebhookEndpoint
        fields = ("id", "url", "job", "events", "active", "description", "created_at", "deliveries_url")
        read_only_fields = fields

    def get_deliveries_url(self, endpoint: WebhookEndpoint) -> str:
        return f"/api/webhooks/{endpoint.id}/deliveries/"


class WebhookCreatedSerializer(WebhookSerializer):
    """A webhook endpoint just made (or its secret rotated), with its secret: shown this once."""

    secret = serializers.CharField(read_only=True, help_text="`whsec_` + base64 of 32 random bytes: verify each "
                                   "message's `webhook-signature` with it (Standard Webhooks); never shown again")

    class Meta(WebhookSerializer.Meta):
        fields = WebhookSerializer.Meta.fields + ("secret",)
        read_only_fields = fields


@extend_schema_field({"oneOf": [{"type": "string", "format": "uri", "maxLength": 2048},
                                {"type": "array", "items": {"type": "string", "format": "uri", "maxLength": 2048},
                                 "maxItems": 5}]})
class CallbackUrlsField(serializers.Field):
    """``callback_url``: one URL, or a list of at most 5 (JSON), or the field repeated (a form)."""

    def get_value(self, dictionary):
        if hasattr(dictionary, "getlist"):  # a form: the field may repeat
            values = dictionary.getlist(self.field_name)
            return values if values else serializers.empty
        return dictionary.get(self.field_name, serializers.empty)

    def to_internal_value(self, data) -> list[str]:
        if isinstance(data, list) and len(data) == 1 and isinstance(data[0], str) and data[0].lstrip().startswith("["):
            data = data[0]  # a form's one part holding a JSON list (what a JSON body sends as a list)
        if isinstance(data, str) and data.lstrip().startswith("["):
            try:
                data = json_input.loads(data, field=self.field_name)
            except ValueError:
                raise serializers.ValidationError("a URL, or a JSON list of URLs") from None
        values = [data] if isinstance(data, str) else data
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise serializers.ValidationError("a URL or a list of URLs")
        if len(values) > 5:
            raise serializers.ValidationError("at most 5 callback URLs")
        if any(len(v) > 2048 for v in values):
            raise serializers.ValidationError("a URL has at most 2048 characters")
        return [v.strip() for v in values if v.strip()]

    def to_representation(self, value):
        return value

