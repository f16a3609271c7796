"""Token authentication under the ``Bearer`` keyword, and how the OpenAPI schema shows it.

DRF's ``TokenAuthentication`` reads ``Authorization: Token <key>``; OpenAI's clients (and most HTTP
tooling) send ``Authorization: Bearer <key>``. Both are accepted everywhere in the API, with the
same tokens (``POST /api/auth/token/``, ``manage.py apiuser``).
"""
from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import TokenAuthentication


class BearerTokenAuthentication(TokenAuthentication):
    """``Authorization: Bearer <token>``: DRF's token authentication with OpenAI's keyword."""

    keyword = "Bearer"


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """The schema's ``bearerAuth`` security scheme (HTTP bearer) for :class:`BearerTokenAuthentication`.

    drf-spectacular's own token extension matches subclasses of ``TokenAuthentication`` too, under
    the name ``tokenAuth`` that the ``Token`` keyword already has; this one wins (higher priority)
    and names the scheme apart."""

    target_class = "embeddings.api.authentication.BearerTokenAuthentication"
    name = "bearerAuth"
    priority = 1

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer",
                "description": 'the token of "Authorization: Token <token>", sent as "Authorization: Bearer <token>"'}
