"""What the OpenAPI schema says beyond the serializers: the error responses each endpoint can give
(one component, ``Error``), ``Retry-After`` on 429/503, and the statuses every operation shares.

Views declare their own statuses with :func:`errors`; :func:`postprocess` (a drf-spectacular
postprocessing hook, ``SPECTACULAR_SETTINGS``) adds the ones that follow from the URL and the
authentication alone, for views this module does not own too (the thumbnail): 401 on every
operation that needs a token or a session, 404 on every operation with a path parameter.
:class:`SchemaView` serves it at ``/api/schema/``.
"""
from __future__ import annotations

import inspect

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from drf_spectacular.views import (
    SCHEMA_KWARGS,
    SpectacularAPIView,
    SpectacularSwaggerView,
)
from rest_framework.renderers import JSONRenderer

from embeddings.api.errors import ErrorSerializer
from embeddings.api.parsers import AnyAccept
from workers.vector_store import filters

#: A 429 any key can meet (``services.access.limits``): the 429 of an operation that has no other.
KEY_LIMITED = ("a key over one of its limits (code: rate_limited; extra.limit names it; Retry-After: whole "
               "seconds to its window's reset; docs/api-keys.md)")
#: What each error status means in this service (README "API"); the ``code`` values are stable.
ERROR_STATUS = {
    400: "the request is invalid (code: invalid, invalid_query, no_files, too_many_files, malformed_request, "
         "malformed_multipart, unexpected_parts, too_many_parts, parse_error, json_too_deep, zip_unsafe, "
         "invalid_characters: a control character in the path or the query string, a refused query image's "
         "reason ...; an extra that would list many items lists 10 and counts the rest)",
    401: "no credential (code: not_authenticated), or a key that authenticates nothing (code: key_malformed, "
         "key_unknown, key_revoked, key_expired, user_inactive; docs/api-keys.md)",
    403: "a key without the operation's scope (code: insufficient_scope; extra.required, extra.held), or staff "
         "only (code: forbidden, permission_denied)",
    404: "no such resource, or one the caller may not see (code: not_found)",
    406: "Accept names only media types this operation does not answer (code: not_acceptable)",
    409: "the resource is not in a state that allows it (code: invalid_transition, not_embedded, vector_missing)",
    411: "a body sent with Transfer-Encoding and no Content-Length (code: length_required): send its length",
    413: "a request or an image over a limit; extra names the limit (code: request_too_large, too_large, "
         "too_many_pixels; request_exceeds_deadline: so many images miss the deadline even in an empty "
         "interactive lane, a retry cannot help)",
    415: "not an image, an unsupported image format, or a Content-Type the endpoint does not read",
    422: "the model gave no usable vector for an input: NaN or infinity (code: non_finite_embedding) or all zeros "
         "(code: zero_embedding); nothing was stored, and the same input gives the same vector",
    429: KEY_LIMITED + ", or the interactive lane is overloaded (code: overloaded): the predicted wait plus a learnt margin is "
         "longer than the deadline. extra.wait_ahead_s (s, 3 decimals) is about what a request admitted at "
         "this moment waits, learnt from what the requests admitted around earlier refusals of deadlines "
         "within about ×1.25 of its own waited (wait_ahead_samples: how many refusals; 0: not yet) from a "
         "first estimate (first_wait_ahead_s): the admission edge, the longest predicted wait admitted "
         "now, where the next request admitted is admitted, or the time the backlog needs to drain to it "
         "where longer, at least the wait of a request of its size alone (wait_ahead_from: edge, drain or "
         "alone); beside bulk work that yields to this lane, the same as the quiet lane predicts it once "
         "that work parks, or the wait of the backlog of the moment there (parks); "
         "work_ahead_wait_s is what the work queued now needs; "
         "Retry-After is that plus its margin (retry_margin_s) "
         "rounded up to whole seconds, so a retry never comes too early. extra also has predicted_wait_s, "
         "deadline_s, retry_after_s, queued_messages, inflight_images, running_pass_images, running_pass_left_s, capacity_ips, workers, "
         "overhead_s, scale, margin_s (the margin applied: learnt_margin_s, at least ADMISSION_MIN_MARGIN_SHARE "
         "of predicted_wait_s, at most ADMISSION_MAX_MARGIN_SHARE of deadline_s), learnt_margin_s, retry_margin_s, "
         "beside_bulk (a bulk chunk computes now: the wait model learnt beside bulk work was used)",
    503: "a worker or the vector store is unavailable: retry after Retry-After seconds "
         "(code: vectors_unavailable, worker_error, broker_full, broker_unavailable)",
    504: "the search or the embeddings did not finish in time (code: deadline_exceeded)",
}

#: How the schema shows a 429's ``Retry-After`` where the view did not declare the header itself.
_RETRY_AFTER_HEADER = {"Retry-After": {"schema": {"type": "integer"}, "required": True,
                                       "description": "whole seconds to wait before retrying"}}


#: ``Retry-After`` (whole seconds) on the statuses that carry it (services.admission, services.calls).
RETRY_AFTER = OpenApiParameter(
    "Retry-After", OpenApiTypes.INT, location=OpenApiParameter.HEADER, response=[429, 503], required=True,
    description="whole seconds to wait before retrying (RFC 9110 delay-seconds). 429: about what a request "
                "admitted now waits plus its margin, rounded up (extra.wait_ahead_s, extra.retry_margin_s); 503: a "
                "fixed back-off",
)


def errors(*statuses: int) -> dict[int, OpenApiResponse]:
    """``{status: OpenApiResponse(Error)}`` for ``statuses`` (keys of :data:`ERROR_STATUS`), for
    ``extend_schema(responses={...})``.

    Raises:
        KeyError: a status this service never answers with the error shape.
    """
    return {s: OpenApiResponse(ErrorSerializer, description=ERROR_STATUS[s]) for s in statuses}


#: A query string's or a path parameter's text holds no control character other than tab, LF and
#: CR: the service refuses one before any view (``embeddings.transport.CONTROL``, 400
#: ``invalid_characters``).
NO_CONTROL_CHARACTERS = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f]*$"
#: Methods whose request body a view reads (``embeddings.transport``: 411 without a length).
_BODY_METHODS = frozenset({"post", "put", "patch", "delete"})


def _error_ref() -> dict:
    return {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _openai_error_ref() -> dict:
    """The error shape under ``/v1/`` (OpenAI's, ``embeddings.api.embeddings``)."""
    return {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}


def postprocess(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: 401 on every secured operation, 403 and 429 on every one
    that declares a scope (a key's scope and limits), 404 on every operation with a path parameter, 400 and 406 on every operation, 411 on every operation with a body, in the
    ``Error`` shape, where the view did not say; the
    ``MetadataFilter`` components of the search filter."""
    for path, item in result.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            responses = op["responses"]
            # drf-spectacular lists ``{}`` among the requirements when no authentication is needed
            secured = bool(op.get("security")) and all(op["security"])
            if secured and "401" not in responses:
                responses["401"] = {"description": ERROR_STATUS[401], **_error_ref()}
            if "{" in path and "404" not in responses:
                responses["404"] = {"description": ERROR_STATUS[404], **_error_ref()}
            # embeddings.transport refuses these before any view: a control character anywhere in the
            # URL (400), a body without a length (411); content negotiation, an Accept it cannot meet (406)
            for parameter in op.get("parameters", []):
                schema = parameter.get("schema", {})
                if parameter.get("in") in ("query", "path") and schema.get("type") == "string" \
                        and not ({"pattern", "format", "enum"} & set(schema)):
                    schema["pattern"] = NO_CONTROL_CHARACTERS
            shape = _openai_error_ref() if path.startswith("/v1/") else _error_ref()
            if secured and "x-required-scope" in op:  # a key: its scope (403) and its limits (429)
                responses.setdefault("403", {"description": ERROR_STATUS[403], **shape})
                responses.setdefault("429", {"description": KEY_LIMITED, "headers": _RETRY_AFTER_HEADER,
                                             **shape})
            for status, applies in ((400, True), (406, True), (411, method in _BODY_METHODS)):
                if applies and str(status) not in responses:
                    responses[str(status)] = {"description": ERROR_STATUS[status], **shape}
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(metadata_filter_components())
    if "PatchedImagePatchRequest" in schemas:  # PATCH names what may change; anything else is a 400
        schemas["PatchedImagePatchRequest"]["additionalProperties"] = False
    return result


def metadata_filter_components() -> dict:
    """The search's metadata filter as components (``workers.vector_store.filters.json_schema``),
    each alternative of its ``oneOf`` a named component of its own (``MetadataAnd``, ``MetadataOr``,
    ``MetadataNot``, ``MetadataCondition``): generated clients (openapi-python-client) read a union
    of named objects, not one of inline objects."""

    ref = "#/components/schemas/"
    components = filters.json_schema(ref=ref)
    alternatives = []
    for option in components["MetadataFilter"]["oneOf"]:
        if "$ref" in option:
            alternatives.append(option)
            continue
        name = "Metadata" + option["required"][0].capitalize()  # and / or / not
        components[name] = option
        alternatives.append({"$ref": ref + name})
    components["MetadataFilter"] = {**components["MetadataFilter"], "oneOf": alternatives}
    return components


class SchemaView(SpectacularAPIView):
    """``GET /api/schema/``: drf-spectacular's schema view with its query parameters made harmless.

    - ``version`` is ignored: this API has one version (``SPECTACULAR_SETTINGS["VERSION"]``), and
      drf-spectacular copies the value into the schema's ``info.version`` and into the
      ``Content-Disposition`` file name (a CR/LF there was a 500; a quote added a second
      ``filename``);
    - ``lang`` is read only when it is one of ``LANGUAGES`` (the enum the schema shows), else
      ignored: Django caches a translation object for every distinct language string activated;
    - ``format``: ``yaml`` or ``json`` (DRF's override; another is 404 ``not_found``).

    Every error answers the API's JSON error shape (DRF would render it with the YAML renderer).
    """

    def _get_version_parameter(self, request):
        return None

    @extend_schema(description=inspect.cleandoc(str(SpectacularAPIView.__doc__)), **SCHEMA_KWARGS)  # not this docstring
    def get(self, request, *args, **kwargs):
        lang = request.query_params.get("lang")
        if lang is not None and lang not in dict(settings.LANGUAGES):
            query = request._request.GET.copy()
            del query["lang"]
            request._request.GET = query
        return super().get(request, *args, **kwargs)

    def handle_exception(self, exc):
        self.request.accepted_renderer, self.request.accepted_media_type = JSONRenderer(), JSONRenderer.media_type
        return super().handle_exception(exc)


class DocsView(SpectacularSwaggerView):
    """``GET /api/docs/``: drf-spectacular's Swagger UI page, whatever ``Accept`` or ``?format=`` say
    (:class:`AnyAccept`; DRF would answer a plain-text 406), for GET and HEAD only, its errors in the
    API's JSON error shape (drf-spectacular renders them with the page's template renderer: a
    plain-text 405, and a 500 for ``OPTIONS``, which has no template)."""

    http_method_names = ["get", "head"]
    content_negotiation_class = AnyAccept

    def handle_exception(self, exc):
        self.request.accepted_renderer, self.request.accepted_media_type = JSONRenderer(), JSONRenderer.media_type
        return super().handle_exception(exc)
