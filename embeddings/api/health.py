"""``/healthz``: liveness of the web process."""
from __future__ import annotations

from django.http import JsonResponse


def healthz(request):
    """Liveness of the web process (no authentication, no dependencies)."""

    return JsonResponse({"ok": True})
