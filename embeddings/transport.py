"""A request before and after its view: what its transport cannot carry is refused, and every error
Django answers outside a view is in the shape of the area the URL belongs to.

Areas (:func:`area`): ``/api/`` answers the API's error shape ``{"message", "code", "extra"}``
(``embeddings.api.errors``), ``/v1/`` OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(``embeddings.api.embeddings``), everything else (the site, the admin) the site's page
``site/error.html``.

Refused before any view (:class:`RequestGuardMiddleware`):

- a body sent with ``Transfer-Encoding`` (chunked) and no ``Content-Length``: 411
  ``length_required``. gunicorn de-chunks the body but sets no ``CONTENT_LENGTH``, and Django reads
  a request without one as empty (Django ticket #35838): the view would see no body at all and blame
  the client for it. WSGI has no portable way to read such a body, so the client is asked for a length.
- a C0 control character other than tab, LF and CR (:data:`CONTROL`) in the path, the query string,
  or a form field of the site or the admin: 400 ``invalid_characters``. PostgreSQL text cannot hold
  NUL (psycopg raises ``DataError``: a 500 from any admin filter), and none of them means anything in
  a URL or a form field. The API's bodies are left to its parsers and serializers (DRF's fields
  refuse NUL and lone surrogates themselves).

A URL that lacks only its trailing slash is redirected with 308, which keeps the method and the body
(:class:`CommonMiddleware`; Django's ``APPEND_SLASH`` answers 301, which clients repeat as a GET).
"""
from __future__ import annotations

import re
from http import HTTPStatus
from urllib.parse import unquote_to_bytes

from django.core.exceptions import BadRequest
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponsePermanentRedirect,
    JsonResponse,
)
from django.http.multipartparser import MultiPartParserError
from django.middleware import common
from django.template import loader
from django.urls import is_valid_path
from django.utils.http import escape_leading_slashes

from embeddings.api.embeddings import OPENAI_TYPES
from embeddings.api.errors import as_application_error
from embeddings.site.words import reason_words

#: C0 control characters other than tab, line feed and carriage return: the ones XML 1.0's ``Char``
#: production leaves out too. Tab, LF and CR stay allowed: JSON or text pasted into a query parameter
#: holds them.
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")
#: Methods whose body a view reads; a ``Transfer-Encoding`` on another (a GET) loses nothing.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Form bodies Django parses into ``request.POST``.
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
#: Codes of the errors answered here by status (DRF's where DRF has one; else the status's phrase).
CODES = {400: "bad_request", 401: "not_authenticated", 403: "permission_denied", 404: "not_found",
         405: "method_not_allowed", 411: "length_required", 413: "request_too_large", 414: "uri_too_long",
         500: "internal_error"}
#: Page titles of the site's error page by status.
TITLES = {400: "This request cannot be read", 403: "Not allowed", 404: "Not found", 405: "Not allowed here",
          411: "The upload has no length", 413: "Too large", 500: "Something went wrong"}
#: Response headers an error page keeps from the answer it replaces.
_KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


def area(request: HttpRequest) -> str:
    """``"api"`` (``/api`` and below), ``"openai"`` (``/v1`` and below) or ``"site"`` (the rest:
    pages, admin, docs' HTML)."""
    path = request.path_info
    if path == "/api" or path.startswith("/api/"):
        return "api"
    if path == "/v1" or path.startswith("/v1/"):
        return "openai"
    return "site"


def code_for(status: int) -> str:
    """The stable code of an error answered with ``status`` and nothing more specific."""
    return CODES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")


def body_for(request: HttpRequest, status: int, code: str, message: str, extra: dict | None = None) -> dict | None:
    """The JSON body of an answer in ``request``'s area: the API's shape under ``/api/``, OpenAI's
    under ``/v1/`` (``extra["param"]`` its ``param``), None for the site (a page)."""
    where = area(request)
    if where == "api":
        return {"message": message, "code": code, "extra": extra or {}}
    if where == "openai":

        kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": (extra or {}).get("param"), "code": code}}
    return None


def refusal(request: HttpRequest, status: int, code: str, message: str, extra: dict | None = None, *,
            with_request: bool = True) -> HttpResponse:
    """An error answer in ``request``'s area: JSON under ``/api/`` and ``/v1/`` (:func:`body_for`),
    else the site's page ``site/error.html`` (title, message, code). ``with_request=False`` renders
    the page without context processors, which read the session and the database (a 500 must not
    fail again on what failed)."""
    body = body_for(request, status, code, message, extra)
    if body is not None:
        return JsonResponse(body, status=status)

    context = {"status": status, "title": TITLES.get(status, HTTPStatus(status).phrase), "message": message,
               "code": code, "words": reason_words(code)}
    html = loader.render_to_string("site/error.html", context, request=request if with_request else None)
    return HttpResponse(html, status=status)


def _control_in(request: HttpRequest) -> dict | None:
    """Where a :data:`CONTROL` character is in the path or query string: ``{"where": "path" |
    "query"}``, else None."""
    if CONTROL.search(request.path_info):
        return {"where": "path"}
    if _CONTROL_BYTES.search(unquote_to_bytes(request.META.get("QUERY_STRING", ""))):
        return {"where": "query"}
    return None


def _control_in_form(request: HttpRequest) -> dict | None:
    """The first form field (name or value) of a site or admin POST holding a :data:`CONTROL`
    character: ``{"where": "form", "field": name}``, else None. Files are not read here."""
    if request.method != "POST" or request.content_type not in _FORM_TYPES:
        return None
    for name, values in request.POST.lists():
        if CONTROL.search(name) or any(CONTROL.search(v) for v in values):
            return {"where": "form", "field": CONTROL.sub("?", name)}
    return None


class RequestGuardMiddleware:
    """Refuses what no view can use (module docstring): a body without a length (411
    ``length_required``), control characters in the URL or a site form (400 ``invalid_characters``);
    and gives the site's page to a site or admin error answered with no body (Django's 405
    ``require_http_methods``, ``HttpResponseBadRequest()``), the API's shape to one under ``/api/``
    or ``/v1/``. Placed before every middleware that reads the body (CSRF)."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        refused = self.refuse(request)
        if refused is not None:
            return refused
        response = self.get_response(request)
        if response.status_code >= 400 and not response.streaming and not response.content:
            page = refusal(request, response.status_code, code_for(response.status_code),
                           HTTPStatus(response.status_code).phrase)
            for name in _KEPT_HEADERS:
                if response.has_header(name):
                    page[name] = response[name]
            return page
        return response

    def refuse(self, request: HttpRequest) -> HttpResponse | None:
        """The refusal of ``request`` before its view, or None when it may go on."""
        if request.method in _BODY_METHODS and "HTTP_TRANSFER_ENCODING" in request.META \
                and not request.META.get("CONTENT_LENGTH"):
            return refusal(request, 411, "length_required",
                           "the body was sent with Transfer-Encoding and no Content-Length, which this service "
                           "cannot read: send it with a Content-Length header",
                           {"header": "Content-Length"})
        found = _control_in(request)
        if found is None and area(request) == "site":
            found = _control_in_form(request)
        if found is not None:
            return refusal(request, 400, "invalid_characters",
                           f"the request's {found['where']} holds a control character (U+0000 to U+001F other "
                           f"than tab, line feed and carriage return)", found)
        return None


class PermanentRedirectKeepingMethod(HttpResponsePermanentRedirect):
    """308 Permanent Redirect (RFC 9110 15.4.9): the client repeats the request, method and body
    included, at ``Location``."""

    status_code = 308


class CommonMiddleware(common.CommonMiddleware):
    """Django's ``CommonMiddleware`` whose ``APPEND_SLASH`` redirect is a 308 for every method
    (a 301 turns a POST into a GET in every client), with a body in the API's shape under ``/api/``
    and ``/v1/`` naming the URL with the slash (code ``trailing_slash``). Django raises instead of
    redirecting a POST when ``DEBUG`` is on, because a 301 would lose its body; a 308 does not."""

    response_redirect_class = PermanentRedirectKeepingMethod

    def get_full_path_with_slash(self, request: HttpRequest) -> str:
        return escape_leading_slashes(request.get_full_path(force_append_slash=True))

    def process_response(self, request, response):
        if response.status_code == 404 and self.should_redirect_with_slash(request):
            location = self.get_full_path_with_slash(request)
            response = self.response_redirect_class(location)
            body = body_for(request, 308, "trailing_slash",
                            f"this URL ends with a slash: repeat the request at {location} (a 308 keeps its "
                            f"method and body)", {"location": location})
            if body is not None:
                response = JsonResponse(body, status=308, headers={"Location": location})
        return super().process_response(request, response)


# --- handlers (project.urls) -----------------------------------------------------------------------

def handler400(request, exception=None):
    """``handler400``: a request Django cannot read (``SuspiciousOperation``, ``BadRequest``, a form
    body over its limits) → 400, or 413 ``request_too_large`` for a body over
    ``DATA_UPLOAD_MAX_MEMORY_SIZE``, in the area's shape."""

    err = as_application_error(exception) if exception is not None else None
    if err is not None:
        return refusal(request, err.status, err.code, err.message, err.extra)
    # what was wrong with the body is the client's to know; a SuspiciousOperation's details (a
    # disallowed Host, a path outside a folder) are for the security log only
    told = isinstance(exception, (BadRequest, MultiPartParserError))
    return refusal(request, 400, "bad_request", str(exception) if told else "the request cannot be read")


def handler403(request, exception=None):
    """``handler403``: ``PermissionDenied`` outside the API's views → 403 ``permission_denied``."""
    return refusal(request, 403, "permission_denied", str(exception or "") or "you may not do this")


def handler404(request, exception=None):
    """``handler404``: a URL no view matches (or a malformed id) → 404 ``not_found``, naming the URL
    without its trailing slash where only that one exists."""
    path = request.path_info
    message, extra = f"no such resource: {request.path}", {}
    if path.endswith("/") and len(path) > 1 and is_valid_path(path[:-1], getattr(request, "urlconf", None)):
        message += f" (the resource is {request.path[:-1]}, without the trailing slash)"
        extra = {"location": request.path[:-1]}
    return refusal(request, 404, "not_found", message, extra)


def handler500(request):
    """``handler500``: an unhandled exception → 500 ``internal_error`` (details are logged, not
    answered), the page rendered without the session or the database."""
    return refusal(request, 500, "internal_error", "internal error", with_request=False)


def csrf_failure(request, reason: str = ""):
    """``CSRF_FAILURE_VIEW``: a form posted without its CSRF token or cookie → 403 ``csrf_failed``."""
    return refusal(request, 403, "csrf_failed", f"the form could not be verified: {reason}" if reason
                   else "the form could not be verified")
