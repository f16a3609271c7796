"""Stable reason codes for images the pipeline refuses, and the one exception that carries them.

A bad image is data, not a crash: every stage raises :class:`ImageRejected` with one of the codes
below, the runner records it against that image alone, and the rest of its batch goes on. The
codes are part of the public API (REST responses, admin, job failures, metrics): never rename one.
"""
from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Why an image was refused. Values are stable strings shown to users."""

    EMPTY = "empty"  #: zero bytes
    NOT_AN_IMAGE = "not_an_image"  #: content is not a known image format (sniffed, not by name)
    UNSUPPORTED_FORMAT = "unsupported_format"  #: an image format no installed decoder handles
    TRUNCATED = "truncated"  #: the file ends before the image data does
    CORRUPT = "corrupt"  #: the data is damaged (bad CRC, bad markers, decoder error)
    TOO_LARGE = "too_large"  #: more bytes than the configured limit
    TOO_MANY_PIXELS = "too_many_pixels"  #: header width × height above the configured limit
    DECODE_TIMEOUT = "decode_timeout"  #: decoding took longer than the per-image time limit
    SOURCE_MISSING = "source_missing"  #: the stored bytes are gone
    SOURCE_CHANGED = "source_changed"  #: the stored bytes no longer match their sha256
    EXPIRED = "expired"  #: an interactive request whose deadline passed before the model
    CANCELLED = "cancelled"  #: its job was cancelled before it ran
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"  #: delivered BULK_MAX_ATTEMPTS times without finishing
    MODEL_NOT_CONFIGURED = "model_not_configured"  #: work for a model this worker may not load (CLIP_MODELS)
    FETCH_TIMEOUT = "fetch_timeout"  #: a URL's connect, read or total time limit passed (after retries)
    FETCH_STATUS = "fetch_status"  #: a URL answered a non-2xx status (after retries for 429/5xx)
    FETCH_TOO_LARGE = "fetch_too_large"  #: a URL's body is above the byte cap, or longer than its Content-Length
    FETCH_REFUSED_ADDRESS = "fetch_refused_address"  #: a URL's host resolves to a loopback, private, link-local... address
    FETCH_TLS = "fetch_tls"  #: a URL's TLS handshake failed (certificate not trusted, wrong host name)
    FETCH_CONNECT = "fetch_connect"  #: DNS failure, connection refused/reset, or a body cut short
    FETCH_REDIRECTS = "fetch_redirects"  #: too many redirects, or a redirect without a usable Location
    FETCH_INVALID_URL = "fetch_invalid_url"  #: not an http/https URL with a host (other scheme, userinfo, bad port)
    INVALID_BASE64 = "invalid_base64"  #: an image sent as base64 (or a base64 data URL) that does not decode
    NON_FINITE_EMBEDDING = "non_finite_embedding"  #: the model gave NaN or infinity (fp16 overflow, a broken checkpoint)
    ZERO_EMBEDDING = "zero_embedding"  #: the model gave an all-zero vector (no direction to compare)
    TEXT_TOWER_MISSING = "text_tower_missing"  #: a text in a space whose checkpoint holds only the image tower


class ImageRejected(Exception):
    """One image cannot be embedded, for a stable :class:`Reason`.

    Args:
        reason: the stable code.
        detail: a human sentence (may include sizes, the decoder's message).
    """

    def __init__(self, reason: Reason | str, detail: str = "") -> None:
        # args = (code, detail) so the exception survives pickling and Celery's JSON round trip.
        super().__init__(Reason(reason).value, detail)
        self.reason = Reason(reason)
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value
