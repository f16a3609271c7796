"""Reading a request's body (``embeddings.api.request_body``): Django's upload limits and the
service's own become a 4xx naming the limit."""
from __future__ import annotations

import pytest

from tests.embeddings.conftest import jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


def test_django_upload_limits_become_4xx_naming_the_limit(service, api, settings):
    settings.DATA_UPLOAD_MAX_NUMBER_FILES = 2
    r = api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(i)) for i in range(3)]}, format="multipart")
    assert r.status_code == 400 and r.json()["extra"]["limit"] == "DATA_UPLOAD_MAX_NUMBER_FILES"
    settings.UPLOAD_MAX_REQUEST_BYTES = 1000
    r = api.post("/api/jobs/", {"files": [upload("big.jpg", jpeg_bytes(1, (400, 400)))]}, format="multipart")
    assert r.status_code == 413 and r.json()["extra"]["limit"] == "UPLOAD_MAX_REQUEST_BYTES"
