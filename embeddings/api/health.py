"""``/healthz``: liveness of the web process."""
from __future__ import annotations


def healthz(request):
    """Liveness of the web process (no authentication, no dependencies)."""
    from django.http import JsonResponse

    return JsonResponse({"ok": True})
