"""``POST /api/auth/token/``: a user's API token for a username and password."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.authtoken.serializers import AuthTokenSerializer
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.parsers import FormParser

from embeddings.api.parsers import DrfMultiPartParser as MultiPartParser
from embeddings.api.parsers import JSONParser
from embeddings.api.schema import errors


class TokenView(ObtainAuthToken):
    """``POST /api/auth/token/``: a user's token for a username and password (no authentication)."""

    parser_classes = (FormParser, MultiPartParser, JSONParser)  # ours: DRF's view names DRF's own

    @extend_schema(operation_id="auth_token", auth=[], request=AuthTokenSerializer,
                   responses={200: AuthTokenSerializer, **errors(400)})
    def post(self, request, *args, **kwargs):
        return super().post(request, *args, **kwargs)
