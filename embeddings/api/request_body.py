"""What a view reads from a request's body, shared by every endpoint that takes files: the parsed
``(data, files)`` (Django's upload limits and an unreadable Content-Type become the error shape),
the files of some fields in the order their parts came, and the rule that every part sent is read."""
from __future__ import annotations

from django.conf import settings

from embeddings.api.errors import as_application_error
from embeddings.api.parsers import LISTED_PARTS, content_type_error, listed
from embeddings.errors import ApplicationError


def parsed(request):
    """``(data, files)`` of the request; Django's upload limits become a 4xx naming the limit, an
    unparseable Content-Type a 400 ``malformed_request`` (also when the body is empty)."""
    error = content_type_error(request)
    if error is not None:
        raise error
    length = int(request.META.get("CONTENT_LENGTH") or 0)
    if length > settings.UPLOAD_MAX_REQUEST_BYTES:
        raise ApplicationError(
            f"the request is {length} bytes; UPLOAD_MAX_REQUEST_BYTES is {settings.UPLOAD_MAX_REQUEST_BYTES}",
            code="request_too_large", status=413,
            extra={"limit": "UPLOAD_MAX_REQUEST_BYTES", "value": settings.UPLOAD_MAX_REQUEST_BYTES},
        )
    try:
        return request.data, request.FILES
    except Exception as e:
        err = as_application_error(e) or as_application_error(getattr(e, "__cause__", None) or e)
        if err is not None:
            raise err from e
        raise


def uploaded_files(files, *names: str) -> list:
    """The uploaded files of fields ``names``, in the order their parts came in the body."""
    out = []
    for name in names:
        out.extend(files.getlist(name))
    return sorted(out, key=lambda f: getattr(f, "part", 0))


def check_parts(data, files, *, file_fields: tuple[str, ...]) -> None:
    """Every part sent must be read: a file in a field this endpoint does not read, or a text value
    (a part without ``filename``) in one of its file fields, would otherwise vanish unanswered.

    Raises:
        ApplicationError: ``unexpected_parts`` (400), ``extra.parts`` listing the first such parts
            (``parsers.LISTED_PARTS``), ``extra.refused_count`` counting them all.
    """
    stray = [{"part": getattr(f, "part", None), "field": field, "filename": f.name,
              "reason": f"a file in a field this endpoint does not read ({', '.join(file_fields)})"}
             for field, fs in files.lists() if field not in file_fields for f in fs]
    if hasattr(data, "getlist"):
        stray += [{"part": None, "field": field, "filename": None,
                   "reason": "a text value (no filename in its Content-Disposition) in a file field"}
                  for field in file_fields for v in data.getlist(field) if isinstance(v, str)]
    if stray:
        raise ApplicationError(f"{len(stray)} part(s) of the request cannot be used: "
                               + listed(stray, len(stray), lambda p: f"field {p['field']!r}: {p['reason']}"),
                               code="unexpected_parts",
                               extra={"parts": stray[:LISTED_PARTS], "refused_count": len(stray)})
