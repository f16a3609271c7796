"""Issue 41 through the real processes: a manifest of image URLs posted to gunicorn becomes a job that
the fetch worker reads and fetches (never the web process), the bulk worker embeds and the vectors
worker writes; a metadata filter then narrows a search inside the vector query.

The URLs point at a real local HTTP server started by the test (the shared stack allows 127.0.0.1
through ``FETCH_ALLOW_NETWORKS``; every other private or link-local address stays refused, so a
redirect to the cloud metadata address fails its row with ``fetch_refused_address``).
"""
from __future__ import annotations

import time
import urllib.parse

import pytest

from tests.origin_server import OriginServer


@pytest.fixture(scope="module")
def origin():
    with OriginServer() as server:
        yield server


def wait_done(api, job_id: str, timeout: float = 180) -> dict:
    end = time.monotonic() + timeout
    while True:
        job = api.get(f"/api/jobs/{job_id}/").json()
        if job["status"] == "done":
            return job
        assert time.monotonic() < end, f"job not done in {timeout} s: {job['counts']}"
        time.sleep(0.5)


def test_a_manifest_of_urls_is_fetched_by_the_fetch_worker_and_searched_by_metadata(stack, api, origin):
    # images of this module's own, distinct in pixels (/pixels/<n>.jpg): the photos are other modules'
    # uploads on the shared stack, where every image must stay its own nearest neighbour
    names = [f"{900_000 + i}.jpg" for i in range(8)]
    metadata_redirect = f"{origin.url}/redirect-to?url={urllib.parse.quote('http://169.254.169.254/latest/meta-data/')}"
    lines = ["url,external_id,category,price"]
    lines += [f"{origin.url}/pixels/{n},E2E-{i},{'shoes' if i < 3 else 'hats'},{10 + i}" for i, n in enumerate(names)]
    lines += [f"{origin.url}/status/404,E2E-404,shoes,1", f"{metadata_redirect},E2E-META,shoes,1",
              "gopher://example.com/a.jpg,E2E-GOPHER,shoes,1"]
    r = api.post("/api/jobs/", files={"manifest": ("catalogue.csv", "\n".join(lines).encode(), "text/csv")})
    assert r.status_code == 202, r.text
    assert r.json()["reading"] is True
    job = wait_done(api, r.json()["id"])
    assert job["total"] == 11 and job["reading"] is False
    assert job["counts"]["embedded"] == 8, job["counts"]
    assert job["failure_reasons"] == {"fetch_refused_address": 1, "fetch_status": 1, "url_invalid": 1}
    # the server never saw the metadata address: the redirect hop was refused before connecting
    assert origin.count("/redirect-to") == 1
    log = (stack.var_dir / "log" / "worker-fetch.log").read_text(errors="replace")
    assert "embeddings.tasks.job_read" in log and "embeddings.tasks.fetch_chunk" in log
    assert "fetch_chunk" not in (stack.var_dir / "log" / "web.log").read_text(errors="replace")
    found = api.post("/api/search/", json={"text": "a photo", "k": 20, "min_score": -1, "filter": {
        "and": [{"field": "category", "eq": "shoes"}, {"field": "price", "gte": 11}]}})
    assert found.status_code == 200, found.text
    assert sorted(h["external_id"] for h in found.json()["results"]) == ["E2E-1", "E2E-2"]
