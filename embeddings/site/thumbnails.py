"""``GET /api/images/{id}/thumbnail/``: the JPEG thumbnail drawn by the worker that decoded the image.

Same owner check as ``GET /api/images/{id}/`` (the owner, or staff; anyone else gets 404 as for an
unknown id), token or session authentication. The bytes never change for an id (they are keyed by
the original's sha256), so the answer is cacheable for a year by the browser alone (``private``:
it is one user's picture) with the sha256 as its ETag; ``If-None-Match`` with it answers 304.
"""
from __future__ import annotations

import time

from django.http import HttpResponse, HttpResponseNotModified
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.views import APIView

from embeddings import runtime
from embeddings.api.parsers import AnyAccept
from embeddings.models import ImageStatus
from embeddings.selectors import images_visible_to
from embeddings.errors import ApplicationError
from embeddings.storage import thumbnail_read
from workers.thumbnail import CONTENT_TYPE, content_type

#: One year (s), the longest max-age HTTP caches honour (RFC 9111 §5.2.1.1 suggests no more).
MAX_AGE_S = 31_536_000
CACHE_CONTROL = f"private, max-age={MAX_AGE_S}, immutable"


#: How long (s) after an image was embedded its thumbnail may still be on its way: the interactive
#: worker draws it once the answer is out (``services.queues.blobs.LateThumbnails``), milliseconds
#: later on an idle worker; a request for it inside this window waits for it instead of a 404.
THUMBNAIL_LATE_S = 2.0
_POLL_S = 0.02


def _thumbnail(image) -> bytes | None:
    """The thumbnail bytes, waiting up to :data:`THUMBNAIL_LATE_S` after the image was embedded (or
    created, for a copy of stored bytes) for one still being drawn; None when there is none."""
    store = runtime.blob_store()
    since = (image.embedded_at or image.created_at) if image.status in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED) else None
    while (data := thumbnail_read(store, image.sha256)) is None:
        if since is None or (timezone.now() - since).total_seconds() > THUMBNAIL_LATE_S:
            return None
        time.sleep(_POLL_S)
    return data


def thumbnail_response(request, image) -> HttpResponse:
    """The thumbnail of ``image`` (already owner-checked) with its cache headers, or 304.

    Raises:
        ApplicationError: ``not_found`` (404) when no thumbnail exists (the image never decoded), once
            :data:`THUMBNAIL_LATE_S` have passed since it was embedded.
    """
    etag = f'"{image.sha256}"'
    if etag in [t.strip() for t in request.META.get("HTTP_IF_NONE_MATCH", "").split(",")]:
        r = HttpResponseNotModified()
    else:
        data = _thumbnail(image)
        if data is None:
            raise ApplicationError("this image has no thumbnail (it was not decoded)", code="not_found", status=404)
        r = HttpResponse(data, content_type=content_type(data))
    r["ETag"] = etag
    r["Cache-Control"] = CACHE_CONTROL
    return r


class ThumbnailView(APIView):
    """``GET /api/images/{id}/thumbnail/``: ``image/jpeg`` (``image/webp`` when an older release drew
    it), 256 px on the long side."""

    required_scope = "images:read"

    content_negotiation_class = AnyAccept  # the image whatever Accept says (DRF: 406 to image/jpeg)

    @extend_schema(operation_id="images_thumbnail",
                   responses={(200, CONTENT_TYPE): OpenApiResponse(OpenApiTypes.BINARY),
                              (200, "image/webp"): OpenApiResponse(OpenApiTypes.BINARY), 304: None})
    def get(self, request, image_id):
        return thumbnail_response(request, get_object_or_404(images_visible_to(request.user), id=image_id))
