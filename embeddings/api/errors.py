"""One error shape for the whole API: ``{"message": str, "code": str, "extra": {...}}``."""
from __future__ import annotations

from django.conf import settings
from django.core.exceptions import (
    PermissionDenied,
    RequestDataTooBig,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.http import Http404
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from embeddings.api.answer_size import bounded_error
from embeddings.errors import ApplicationError
from embeddings.sink import broker_refusal


def as_application_error(exc: Exception) -> ApplicationError | None:
    """Django's request-limit exceptions → an :class:`ApplicationError` naming the limit; a write
    the broker's Redis refused (full, or not reachable) → its 503 (``sink.broker_refusal``)."""


    refused = broker_refusal(exc)
    if refused is not None:
        return refused

    if isinstance(exc, RequestDataTooBig):
        return ApplicationError(
            f"the request body is larger than DATA_UPLOAD_MAX_MEMORY_SIZE ({settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes)",
            code="request_too_large", status=413, extra={"limit": "DATA_UPLOAD_MAX_MEMORY_SIZE",
                                                          "value": settings.DATA_UPLOAD_MAX_MEMORY_SIZE},
        )
    if isinstance(exc, TooManyFilesSent):
        return ApplicationError(
            f"more files than DATA_UPLOAD_MAX_NUMBER_FILES ({settings.DATA_UPLOAD_MAX_NUMBER_FILES}) in one request",
            code="too_many_files", status=400, extra={"limit": "DATA_UPLOAD_MAX_NUMBER_FILES",
                                                      "value": settings.DATA_UPLOAD_MAX_NUMBER_FILES},
        )
    if isinstance(exc, TooManyFieldsSent):
        return ApplicationError(
            f"more fields than DATA_UPLOAD_MAX_NUMBER_FIELDS ({settings.DATA_UPLOAD_MAX_NUMBER_FIELDS})",
            code="too_many_fields", status=400, extra={"limit": "DATA_UPLOAD_MAX_NUMBER_FIELDS",
                                                       "value": settings.DATA_UPLOAD_MAX_NUMBER_FIELDS},
        )
    return None


def error_response(err: ApplicationError) -> Response:
    """Render an :class:`ApplicationError`, its size bounded (``answer_size.bounded_error``)."""
    return Response(bounded_error({"message": err.message, "code": err.code, "extra": err.extra}), status=err.status,
                    headers=err.headers)


def exception_handler(exc, context):
    """DRF exception handler producing the one error shape for every error."""
    if isinstance(exc, ApplicationError):
        return error_response(exc)
    app_err = as_application_error(exc)
    if app_err is not None:
        return error_response(app_err)
    # Django's own exceptions as DRF's, so they carry DRF's codes ("not_found", not "http404")
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(*exc.args)
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied(*exc.args)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        body = {"message": "invalid request", "code": "invalid", "extra": {"fields": response.data}}
    else:
        detail = response.data.get("detail", "") if isinstance(response.data, dict) else response.data
        code = getattr(getattr(exc, "detail", None), "code", None) or exc.__class__.__name__.lower()
        body = {"message": str(detail), "code": str(code), "extra": {}}
    response.data = bounded_error(body)  # DRF lists every invalid item of a list: a few KB at most
    return response


__all__ = ["exception_handler", "error_response", "as_application_error", "status"]


class ErrorSerializer(serializers.Serializer):
    """The one error shape (``embeddings.api.errors``): a stable ``code`` and facts in ``extra``."""

    message = serializers.CharField()
    code = serializers.CharField(help_text="stable reason code: not_found, invalid, overloaded, ...")
    extra = serializers.DictField(help_text="facts of the refusal (limit names and values, fields)")
