"""The URL sweep's transport part, through the real web process (gunicorn, ``project.wsgi``): what
Django's test client cannot send (issue 44, item 4; the in-process sweep is
``tests/embeddings/test_url_sweep.py``, whose routes, fills and shape checks this reuses).

Every route of the URL configuration, filled with ids made here on the shared stack, as the user
the route is for (a token: the site and the admin then send to sign in):

- a POST whose body is sent ``Transfer-Encoding: chunked`` (no ``Content-Length``): 411
  ``length_required`` on every route (``embeddings.transport``: gunicorn passes no length on, and
  Django would read the body as empty);
- a GET whose request line is just under gunicorn's limit (``REQUEST_LINE_BYTES``): Django reads
  it, and answers in the area's shape;
- a GET whose request line is past that limit: gunicorn's own 414 (or 400), never a 5xx.

Nothing here changes what other modules on the shared stack use: the objects are this module's
users' own, and the migration route is sent ``promote`` on the active space (409), never ``gate``,
``rollback`` or a ``DELETE``.
"""
from __future__ import annotations

import collections

import cv2
import numpy as np
import pytest
import requests

from project.processes import REQUEST_LINE_BYTES
from tests.e2e.conftest import Api
from tests.embeddings.test_url_sweep import (
    UNKNOWN_UUID,
    Case,
    World,
    judge,
    primary_user,
    real_url,
    report,
    routes,
)

pytestmark = pytest.mark.e2e


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return cv2.imencode(".png", rng.integers(0, 255, (64, 80, 3), dtype=np.uint8))[1].tobytes()


@pytest.fixture(scope="module")
def sweep_world(stack, api) -> tuple[World, dict[str, dict]]:
    """The ids of a user's image, job, webhook endpoint, batch input file, batch and API key and of
    the active space (admin pages and deliveries: ids of no object; a token user is sent to sign in there
    anyway), and the ``Authorization`` header of each user."""
    user = Api(stack.web_url, stack.manage("apiuser", "e2e-url-sweep-user").strip())
    r = user.post("/api/images/", files={"files": ("a.png", _png(1), "image/png")}, data={"k": "0"})
    assert r.status_code == 200, r.text[:300]
    image = r.json()["images"][0]["id"]
    r = user.post("/api/jobs/", files={"files": ("b.png", _png(2), "image/png")})
    assert r.status_code == 202, r.text[:300]
    job = r.json()["id"]
    r = user.post("/api/webhooks/", json={"url": "http://127.0.0.1:9/hook"})
    assert r.status_code == 201, r.text[:300]
    webhook = r.json()["id"]
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "ViT-B-32", "input": "a"}}'
    r = user.post("/v1/files", files={"file": ("in.jsonl", line + b"\n", "application/jsonl")},
                  data={"purpose": "batch"})
    assert r.status_code == 200, r.text[:300]
    batch_file = r.json()["id"]
    r = user.post("/v1/batches", json={"input_file_id": batch_file, "endpoint": "/v1/embeddings",
                                       "completion_window": "24h"})
    assert r.status_code == 200, r.text[:300]
    batch = r.json()["id"]
    r = user.post("/api/keys/", json={"name": "sweep", "scopes": ["all"]})
    assert r.status_code == 201, r.text[:300]
    key = r.json()["id"]
    spaces = api.get("/api/migrations/").json()
    space = next(s["id"] for s in spaces if s["state"] == "active")
    ids = {"image_id": image, "job_id": job, "webhook_id": webhook, "delivery_id": "999999999",
           "space_id": str(space), "id": "1", "group_id": UNKNOWN_UUID, "file_id": batch_file,
           "batch_id": batch, "key_id": str(key)}
    world = World({}, {}, ids, collections.defaultdict(lambda: UNKNOWN_UUID), "1")
    auth = {"anonymous": {}, "user-token": {"Authorization": user.s.headers["Authorization"]},
            "staff": {"Authorization": api.s.headers["Authorization"]}}
    auth["user-session"] = auth["user-token"]
    return world, auth


def _judged(case: Case, r: requests.Response) -> list[str]:
    return [case.line(r.status_code, p) for p in judge(case, r.status_code, r.headers.get("Content-Type", ""),
                                                        r.content)]


def test_chunked_bodies_and_request_lines_at_the_servers_limit(stack, sweep_world):
    world, auth = sweep_world
    failures, n = [], 0
    for route in routes():
        url = real_url(route, world)
        user = primary_user(route.template)
        headers = auth[user]
        n += 3
        case = Case("POST", url, "chunked", user)
        r = requests.post(stack.web_url + url, data=iter([b'{"text": ', b'"a cat"}']), allow_redirects=False,
                          headers={**headers, "Content-Type": "application/json"}, timeout=60)
        failures += _judged(case, r)
        if r.status_code != 411:  # embeddings.transport: never read as an empty body, on any route
            failures.append(case.line(r.status_code, "a chunked body not answered 411 length_required"))
        # "GET <target> HTTP/1.1": the target padded to 16 bytes under the limit, then past it
        pad = REQUEST_LINE_BYTES - 16 - len(f"GET {url}?pad= HTTP/1.1")
        case = Case("GET", f"{url}?pad={'x' * pad}", "request-line=limit-16", user)
        failures += _judged(case, requests.get(stack.web_url + case.url, headers=headers, allow_redirects=False,
                                               timeout=60))
        case = Case("GET", f"{url}?pad={'x' * (pad + 116)}", "request-line=limit+100", user)
        r = requests.get(stack.web_url + case.url, headers=headers, allow_redirects=False, timeout=60)
        if r.status_code >= 500 or r.status_code not in (400, 414):
            failures.append(case.line(r.status_code, "past the server's limit: not its own 414 or 400"))
    assert not failures, report(failures, n)
