"""What the OpenAPI schema says beyond the serializers: the error responses each endpoint can give
(one component, ``Error``), ``Retry-After`` on 429/503, and the statuses every operation shares.

Views declare their own statuses with :func:`errors`; :func:`postprocess` (a drf-spectacular
postprocessing hook, ``SPECTACULAR_SETTINGS``) adds the ones that follow from the URL and the
authentication alone, for views this module does not own too (the thumbnail): 401 on every
operation that needs a token or a session, 404 on every operation with a path parameter.
"""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse

from embeddings.api.serializers import ErrorSerializer

#: What each error status means in this service (README "API"); the ``code`` values are stable.
ERROR_STATUS = {
    400: "the request is invalid (code: invalid, invalid_query, no_files, too_many_files, malformed_request, "
         "malformed_multipart, unexpected_parts, a refused query image's reason ...)",
    401: "no or a wrong token / session (code: not_authenticated, authentication_failed)",
    403: "staff only (code: forbidden, permission_denied)",
    404: "no such resource, or one the caller may not see (code: not_found)",
    409: "the resource is not in a state that allows it (code: invalid_transition, not_embedded, vector_missing)",
    413: "a request or an image over a limit; extra names the limit (code: request_too_large, too_large, "
         "too_many_pixels; request_exceeds_deadline: so many images miss the deadline even in an empty "
         "interactive lane, a retry cannot help)",
    415: "not an image, an unsupported image format, or a Content-Type the endpoint does not read",
    429: "the interactive lane is overloaded (code: overloaded): the predicted wait plus a learnt margin is "
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
         "(code: vectors_unavailable, worker_error)",
    504: "the search or the embeddings did not finish in time (code: deadline_exceeded)",
}

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


def _error_ref() -> dict:
    return {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def postprocess(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: 401 on every secured operation and 404 on every
    operation with a path parameter, in the ``Error`` shape, where the view did not say; the
    ``MetadataFilter`` components of the search filter."""
    for path, item in result.get("paths", {}).items():
        for op in item.values():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            responses = op["responses"]
            # drf-spectacular lists ``{}`` among the requirements when no authentication is needed
            secured = bool(op.get("security")) and all(op["security"])
            if secured and "401" not in responses:
                responses["401"] = {"description": ERROR_STATUS[401], **_error_ref()}
            if "{" in path and "404" not in responses:
                responses["404"] = {"description": ERROR_STATUS[404], **_error_ref()}
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
    from workers.vector_store import filters

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
