"""The key a request came with, as metering records it: the API key's public prefix."""
from __future__ import annotations

#: Longest prefix kept (``UsageRecord.key_prefix``, ``Job.key_prefix``, ``Image.key_prefix``).
MAX_PREFIX = 32


def key_prefix_of(request) -> str:
    """The public prefix (``ck_…``) of the API key ``request`` was authenticated with, or ``""`` for
    a session, a legacy token or no authentication: whatever authenticated it put in
    ``request.auth``, read as its ``prefix`` attribute (DRF's ``Token`` has none). Never the secret.

    Args:
        request: a DRF ``Request`` (or a Django ``HttpRequest``, which has no ``auth``: ``""``).

    Returns:
        At most :data:`MAX_PREFIX` characters.
    """
    prefix = getattr(getattr(request, "auth", None), "prefix", "")
    return prefix[:MAX_PREFIX] if isinstance(prefix, str) else ""
