"""API keys under the ``Bearer`` and ``Token`` keywords, and how the OpenAPI schema shows them.

``Authorization: Bearer <secret>`` (OpenAI's clients, most HTTP tooling) and ``Authorization: Token
<secret>`` (DRF's keyword) are read alike, everywhere in the API: the secret is an API key's
(``embeddings.services.access.keys``), or a DRF ``authtoken`` token not yet migrated
(``manage.py apikeys migrate-tokens``). A credential that authenticates nothing is a 401 whose
``code`` says why: ``key_malformed``, ``key_unknown``, ``key_revoked``, ``key_expired``,
``user_inactive``.

A key without the ``admin`` scope carries its owner without staff powers: ``request.user`` is the
owner with ``is_staff`` and ``is_superuser`` off for this request (never saved), so every selector
that widens what staff see keeps to the owner's own objects (``api_key.staff_owner`` remembers
what the owner is).
"""
from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication, get_authorization_header
from rest_framework.authtoken.models import Token

from embeddings.models import ADMIN_SCOPE
from embeddings.services.access.keys import KeyRefused, key_authenticate


class KeyAuthentication(TokenAuthentication):
    """``Authorization: Token <secret>``: an API key, or a DRF token not yet migrated.

    Returns ``(user, auth)``: ``auth`` the :class:`~embeddings.models.ApiKey` or the DRF ``Token``;
    ``None`` when the header names another scheme (the session is tried next).

    Raises:
        AuthenticationFailed: 401 with the codes above.
    """

    keyword = "Token"

    def authenticate(self, request):
        words = get_authorization_header(request).split()
        if not words or words[0].lower() != self.keyword.lower().encode():
            return None
        if len(words) != 2:
            raise exceptions.AuthenticationFailed(f"the header is malformed: {self.keyword} and one key, no spaces",
                                                  code="key_malformed")
        try:
            secret = words[1].decode("ascii")
        except UnicodeError:
            raise exceptions.AuthenticationFailed("the key is malformed: ASCII only", code="key_malformed") from None
        return self.authenticate_credentials(secret)

    def authenticate_credentials(self, key):
        try:
            api_key = key_authenticate(key)
        except KeyRefused as e:
            raise exceptions.AuthenticationFailed(str(e), code=e.code) from None
        if api_key is not None:
            user = api_key.owner
            api_key.staff_owner = user.is_staff
            if user.is_staff and ADMIN_SCOPE not in api_key.scopes:
                user.is_staff = user.is_superuser = False  # this request's copy only: staff powers need admin
            return user, api_key
        token = Token.objects.select_related("user").filter(key=key).first()
        if token is None:
            raise exceptions.AuthenticationFailed("no such key (revoked keys and tokens are refused by name)",
                                                  code="key_unknown")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("the key's user is inactive", code="user_inactive")
        return token.user, token


class BearerTokenAuthentication(KeyAuthentication):
    """``Authorization: Bearer <secret>``: the same keys with OpenAI's keyword."""

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
                "description": 'an API key (docs/api-keys.md), as "Authorization: Bearer <key>"; '
                               '"Authorization: Token <key>" reads the same keys'}
