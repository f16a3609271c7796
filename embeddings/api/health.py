"""``/healthz``: liveness of the web process; ``/readyz``: readiness of the service, lane by lane."""
from __future__ import annotations

from django.http import JsonResponse

from embeddings.services import readiness


def healthz(request):
    """Liveness of the web process (no authentication, no dependencies)."""

    return JsonResponse({"ok": True})


def readyz(request):
    """Readiness (no authentication): the database, Redis, the vector store and each lane's workers
    (``embeddings.services.readiness``). 200 when every check passes, else 503; the body names each
    check, and each failed one with a stable ``code`` (``lane_canary_failed``, ...) and the lane."""
    ready, body = readiness.readiness()
    return JsonResponse(body, status=200 if ready else 503)
