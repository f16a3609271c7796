"""Authentication of the API (``embeddings.api.authentication``): no token, no answer but 401 in the
error shape."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def test_authentication_is_required(client, service):
    for method, url in (("get", "/api/images/"), ("post", "/api/images/"), ("get", "/api/jobs/"),
                        ("post", "/api/search/")):
        r = getattr(client, method)(url)
        assert r.status_code == 401, url
        assert set(r.json()) == {"message", "code", "extra"}
