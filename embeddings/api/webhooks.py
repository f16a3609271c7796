"""``/api/webhooks/``: an account's signed webhook endpoints, their deliveries and attempts (issue
42, docs/webhooks.md). A job's own endpoints (``callback_url`` of ``POST /api/jobs/``) are listed
here too. The caller's endpoints only (staff: everyone's)."""
from __future__ import annotations

import uuid

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api.form_input import FormSerializer, StrictBooleanField
from embeddings.api.pagination import NewestFirst
from embeddings.api.parsers import JSONParser
from embeddings.api.schema import errors
from embeddings.api.webhook_fields import WebhookCreatedSerializer, WebhookSerializer
from embeddings.errors import ApplicationError
from embeddings.models import (
    DeliveryStatus,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)
from embeddings.services.webhooks import delivery as webhook_delivery
from embeddings.services.webhooks import endpoints as webhook_services

#: Attempts shown with each delivery (newest last); the count is ``attempts``.
SHOWN_ATTEMPTS = 20


class WebhookCreateSerializer(FormSerializer):
    """``POST /api/webhooks/``: an endpoint for every job of the account (staff: and every model
    migration)."""

    url = serializers.CharField(max_length=2048, help_text="http or https URL; a literal address in a refused "
                                "network (loopback, private, link-local, ...) is refused (400 `fetch_refused_address`)")
    events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEvent.choices), required=False,
                                   max_length=len(WebhookEvent.choices), help_text="event types; empty or absent: all")
    description = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class WebhookUpdateSerializer(FormSerializer):
    """``PATCH /api/webhooks/{id}/``: what is given changes."""

    url = serializers.CharField(max_length=2048, required=False)
    events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEvent.choices), required=False,
                                   max_length=len(WebhookEvent.choices), help_text="event types; empty: all")
    active = StrictBooleanField(required=False, help_text="false: no message is made or sent to it")
    description = serializers.CharField(max_length=200, required=False, allow_blank=True)


class WebhookAttemptSerializer(serializers.ModelSerializer):
    """One attempt: when, how long, the answer's status or why it failed."""

    class Meta:
        model = WebhookAttempt
        fields = ("number", "started_at", "duration_ms", "status_code", "reason", "error")
        read_only_fields = fields
        extra_kwargs = {"reason": {"help_text": "empty when answered 2xx; fetch_status (another status), "
                                                "fetch_timeout, fetch_connect, fetch_refused_address, fetch_tls, "
                                                "fetch_invalid_url, endpoint_inactive"},
                        "duration_ms": {"help_text": "ms"}}


class WebhookDeliverySerializer(serializers.ModelSerializer):
    """One message to one endpoint: its body, status, attempts and last error."""

    attempt_log = serializers.SerializerMethodField()

    class Meta:
        model = WebhookDelivery
        fields = ("id", "event", "message_id", "payload", "status", "attempts", "next_attempt_at",
                  "last_status_code", "last_reason", "last_error", "delivered_at", "created_at", "attempt_log")
        read_only_fields = fields
        extra_kwargs = {"message_id": {"help_text": "the `webhook-id` header, the same on every attempt"},
                        "payload": {"help_text": "the body sent: {type, timestamp, data}"},
                        "next_attempt_at": {"help_text": "when the next attempt is due; null once delivered or failed"}}

    @extend_schema_field(WebhookAttemptSerializer(many=True))
    def get_attempt_log(self, delivery: WebhookDelivery) -> list:
        rows = list(delivery.attempt_log.order_by("-started_at", "-id")[:SHOWN_ATTEMPTS])[::-1]
        return WebhookAttemptSerializer(rows, many=True).data


def _visible(user):
    qs = WebhookEndpoint.objects.all()
    return qs if user.is_staff else qs.filter(owner=user)


def _endpoint(request, webhook_id) -> WebhookEndpoint:
    return get_object_or_404(_visible(request.user), id=webhook_id)


class WebhookListView(GenericAPIView):
    """``GET /api/webhooks/``: the caller's endpoints; ``POST``: a new one (its secret shown once)."""

    required_scope = "webhooks"

    parser_classes = (JSONParser, FormParser)
    pagination_class = NewestFirst
    serializer_class = WebhookSerializer

    @extend_schema(operation_id="webhooks_list", responses={200: WebhookSerializer(many=True), **errors(400, 404)},
                   parameters=[OpenApiParameter("job", OpenApiTypes.UUID, description="only this job's own endpoints")],
                   description="The caller's webhook endpoints (staff: everyone's), newest first, a page at a time; "
                               "account endpoints and jobs' own (`job`). Secrets are never shown here.")
    def get(self, request):
        qs = _visible(request.user)
        if "job" in request.query_params:  # given empty is not a job id either
            qs = qs.filter(job_id=_uuid(request.query_params["job"]))
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(WebhookSerializer(page, many=True).data)

    @extend_schema(operation_id="webhooks_create", request=WebhookCreateSerializer,
                   responses={201: WebhookCreatedSerializer, **errors(400)},
                   description="An endpoint for every job of the account (staff: and the model migrations). The "
                               "answer holds its `secret` (`whsec_...`), shown this once: verify every message's "
                               "`webhook-signature` with it (docs/webhooks.md).")
    def post(self, request):
        s = WebhookCreateSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        endpoint = webhook_services.endpoint_create(owner=request.user, url=v["url"], events=v.get("events"),
                                                    description=v["description"])
        return Response(WebhookCreatedSerializer(endpoint).data, status=status.HTTP_201_CREATED)


class WebhookDetailView(APIView):
    """``GET``, ``PATCH``, ``DELETE /api/webhooks/{id}/``."""

    required_scope = "webhooks"

    parser_classes = (JSONParser, FormParser)

    @extend_schema(operation_id="webhooks_retrieve", responses={200: WebhookSerializer, **errors(404)})
    def get(self, request, webhook_id):
        return Response(WebhookSerializer(_endpoint(request, webhook_id)).data)

    @extend_schema(operation_id="webhooks_partial_update", request=WebhookUpdateSerializer,
                   responses={200: WebhookSerializer, **errors(400, 404)})
    def patch(self, request, webhook_id):
        endpoint = _endpoint(request, webhook_id)
        s = WebhookUpdateSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        endpoint = webhook_services.endpoint_update(endpoint=endpoint, **s.validated_data)
        return Response(WebhookSerializer(endpoint).data)

    @extend_schema(operation_id="webhooks_destroy", responses={204: None, **errors(404)},
                   description="Delete the endpoint and its deliveries (pending ones are not sent).")
    def delete(self, request, webhook_id):
        webhook_services.endpoint_delete(endpoint=_endpoint(request, webhook_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookRotateView(APIView):
    """``POST /api/webhooks/{id}/rotate/``: a new secret, shown once."""

    required_scope = "webhooks"

    @extend_schema(operation_id="webhooks_rotate", request=None, responses={200: WebhookCreatedSerializer,
                                                                            **errors(404)},
                   description="A new secret, shown this once. For 24 hours the old one signs too (a second "
                               "signature in `webhook-signature`), so the receiver can switch without losing a "
                               "message.")
    def post(self, request, webhook_id):
        endpoint = webhook_services.endpoint_rotate(endpoint=_endpoint(request, webhook_id))
        return Response(WebhookCreatedSerializer(endpoint).data)


class DeliveryListView(GenericAPIView):
    """``GET /api/webhooks/{id}/deliveries/``: the endpoint's messages, newest first."""

    required_scope = "webhooks"

    pagination_class = NewestFirst
    serializer_class = WebhookDeliverySerializer

    @extend_schema(operation_id="webhooks_deliveries_list",
                   responses={200: WebhookDeliverySerializer(many=True), **errors(400, 404)},
                   parameters=[OpenApiParameter("status", str, enum=DeliveryStatus.values),
                               OpenApiParameter("event", str, enum=WebhookEvent.values)],
                   description="The endpoint's messages, newest first, a page at a time: status (pending, "
                               "delivered, failed), attempts, the next one's due time, the last error, and the "
                               "latest attempts.")
    def get(self, request, webhook_id):
        endpoint = _endpoint(request, webhook_id)
        qs = WebhookDelivery.objects.filter(endpoint=endpoint)
        for name, values in (("status", DeliveryStatus.values), ("event", WebhookEvent.values)):
            value = request.query_params.get(name)
            if value is not None:
                if value not in values:
                    raise ApplicationError(f"{name} must be one of {', '.join(values)}", code="invalid",
                                           extra={name: [f"{value!r} is not a valid choice"]})
                qs = qs.filter(**{name: value})
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(WebhookDeliverySerializer(page, many=True).data)


class DeliveryRedeliverView(APIView):
    """``POST /api/webhooks/{id}/deliveries/{delivery_id}/redeliver/``."""

    required_scope = "webhooks"

    @extend_schema(operation_id="webhooks_deliveries_redeliver", request=None,
                   responses={202: WebhookDeliverySerializer, **errors(404)},
                   description="Send the message again from its first attempt (same `webhook-id`: a receiver "
                               "that had it deduplicates it).")
    def post(self, request, webhook_id, delivery_id):
        endpoint = _endpoint(request, webhook_id)
        delivery = get_object_or_404(WebhookDelivery, endpoint=endpoint, id=delivery_id)
        delivery = webhook_delivery.delivery_redeliver(delivery=delivery)
        return Response(WebhookDeliverySerializer(delivery).data, status=status.HTTP_202_ACCEPTED)


def _uuid(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise ApplicationError("job must be a job id (uuid)", code="invalid", extra={"job": [f"{value!r}"]}) from None
