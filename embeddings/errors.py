"""The one application error, rendered by the API as ``{"message", "code", "extra"}``."""
from __future__ import annotations


class ApplicationError(Exception):
    """A request that cannot be served, with an HTTP ``status``, a stable ``code`` and ``extra`` data."""

    def __init__(self, message: str, *, code: str, status: int = 400, extra: dict | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.extra = extra or {}
        self.headers = headers or {}
