"""One error shape for the whole API: ``{"message": str, "code": str, "extra": {...}}``."""
from __future__ import annotations

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from embeddings.services.errors import ApplicationError


def as_application_error(exc: Exception) -> ApplicationError | None:
    """Django's request-limit exceptions → an :class:`ApplicationError` naming the limit."""
    from django.conf import settings

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
    """Render an :class:`ApplicationError`."""
    return Response({"message": err.message, "code": err.code, "extra": err.extra}, status=err.status,
                    headers=err.headers)


def exception_handler(exc, context):
    """DRF exception handler producing the one error shape for every error."""
    if isinstance(exc, ApplicationError):
        return error_response(exc)
    app_err = as_application_error(exc)
    if app_err is not None:
        return error_response(app_err)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        body = {"message": "invalid request", "code": "invalid", "extra": {"fields": response.data}}
    else:
        detail = response.data.get("detail", "") if isinstance(response.data, dict) else response.data
        code = getattr(getattr(exc, "detail", None), "code", None) or exc.__class__.__name__.lower()
        body = {"message": str(detail), "code": str(code), "extra": {}}
    response.data = body
    return response


__all__ = ["exception_handler", "error_response", "as_application_error", "status"]
