"""Every odd file of the shared set through the REST API (interactive lane, eager Celery): files
that must decode are embedded with their upright size; files that must be refused fail with the
same stable reason code as the decode stage, and a single refused file answers its 4xx."""
from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings.services.interactive.waiting import REASON_STATUS
from tests.conftest import IMAGES, needs_shared
from tests.workers.test_decode_manifest import ODD_EXPECTED, Decodes, Refused

pytestmark = [pytest.mark.django_db(transaction=True), needs_shared]

ROWS = sorted(ODD_EXPECTED)
GROUPS = [ROWS[i : i + 8] for i in range(0, len(ROWS), 8)]


def _post(api, paths):
    files = [SimpleUploadedFile(p.split("/")[-1], (IMAGES / p).read_bytes()) for p in paths]
    return api.post("/api/images/", {"files": files, "k": 1}, format="multipart")


@pytest.mark.parametrize("group", GROUPS, ids=[g[0].split("/")[-1][:30] for g in GROUPS])
def test_manifest_rows_through_the_api(service, api, group):
    service.INTERACTIVE_DEADLINE_S = 300  # correctness, not latency: never expire on a busy machine
    r = _post(api, group)
    assert r.status_code in (200, 400, 413, 415), r.content[:300]
    results = r.json()["images"]
    assert [im["original_name"] for im in results] == [p.split("/")[-1] for p in group]
    for path, im in zip(group, results):
        want = ODD_EXPECTED[path]
        if isinstance(want, Decodes):
            assert im["status"] in ("embedded", "skipped"), (path, im)
            assert (im["width"], im["height"]) == want.size, path
        else:
            assert isinstance(want, Refused)
            assert (im["status"], im["reason"]) == ("failed", want.reason.value), (path, im)


@pytest.mark.parametrize("path", [p for p in ROWS if isinstance(ODD_EXPECTED[p], Refused)])
def test_single_refused_file_answers_its_status(service, api, path):
    service.INTERACTIVE_DEADLINE_S = 300
    reason = ODD_EXPECTED[path].reason.value
    r = _post(api, [path])
    assert r.status_code == REASON_STATUS[reason], (path, r.json())
    assert r.json()["images"][0]["reason"] == reason
