"""Each scope against every route (issue 55), from the URL sweep's routes and real objects
(``tests/embeddings/test_url_sweep.py``): every operation under ``/api/`` and ``/v1/`` declares the
scope it needs (``required_scope``), a key holding every scope but that one is refused with 403
``insufficient_scope`` in the area's error shape, and a key holding only that one is not.

The keys belong to a staff user (so ``admin`` can be held) and have limits far above what the sweep
sends. Refused and admitted requests alike are judged by the URL sweep's :func:`judge` (no 5xx, the
area's error shape).
"""
from __future__ import annotations

import json

import pytest

from embeddings.api.access import required_scope
from embeddings.models import SCOPES
from embeddings.services.access.keys import key_create
from tests.embeddings.test_url_sweep import (  # noqa: F401 - world is a fixture
    Case,
    SweepClient,
    area,
    destructive,
    judge,
    quiet,
    real_url,
    report,
    routes,
    world,
)

pytestmark = pytest.mark.django_db(transaction=True)

#: Routes under /api/ and /v1/ that need no credential, and so no scope.
PUBLIC = ("/api/auth/token/", "/api/schema/", "/api/docs/")
#: The operations the sweep must find: (route, method) pairs whose view declares a scope. 31 views:
#: images 5 (+ thumbnail 1), jobs 4, search 1, duplicates 6, embeddings 2, stats 1, export 1,
#: migrations 5, webhooks 8, keys 5, usage 1, /v1/files 5, /v1/batches 4.
OPERATIONS = 49

_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def declared_operations() -> list[tuple[object, str, str]]:
    """``(route, method, scope)`` of every API route's view method, in route order."""
    out = []
    for route in routes():
        if area(route.template) not in ("api", "v1") or route.template.startswith(PUBLIC):
            continue
        view = route.callback.view_class
        for method in _METHODS:
            if hasattr(view, method.lower()):
                out.append((route, method, required_scope(view, method)))
    return out


def test_every_api_operation_declares_a_scope_of_the_vocabulary():
    ops = declared_operations()
    assert len(ops) == OPERATIONS
    undeclared = [f"{m} {r.template}" for r, m, scope in ops if scope not in SCOPES]
    assert undeclared == []


def test_a_key_without_the_routes_scope_is_refused_and_with_it_is_not(world, staff, settings):
    settings.API_KEY_REQUESTS_PER_MINUTE = settings.API_KEY_IMAGES_PER_MINUTE = 10 ** 6
    without = {s: key_create(owner=staff, name=f"all but {s}", scopes=[x for x in SCOPES if x != s]).secret
               for s in SCOPES}
    only = {s: key_create(owner=staff, name=f"only {s}", scopes=[s]).secret for s in SCOPES}
    cases = []
    for route, method, scope in declared_operations():
        url = real_url(route, world)
        cases.append((Case(method, url, f"without {scope}", "key"), without[scope], True))
        cases.append((Case(method, url, f"only {scope}", "key"), only[scope], False))
    failures, refused, admitted = [], 0, 0
    client = SweepClient(raise_request_exception=False)
    with quiet():
        for case, secret, expect_refusal in sorted(cases, key=lambda c: (destructive(c[0]), not c[2])):
            r = client.generic(case.method, case.url, data=b"{}" if case.method != "GET" else b"",
                               content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}")
            body = b"".join(r.streaming_content) if r.streaming else r.content
            found = judge(case, r.status_code, r.get("Content-Type", ""), body)
            failures += [case.line(r.status_code, p) for p in found]
            data = json.loads(body) if r.get("Content-Type", "").startswith("application/json") and body else {}
            data = data if isinstance(data, dict) else {}  # a list answers a listing
            code = (data.get("error") or {}).get("code") if area(case.url) == "v1" else data.get("code")
            if expect_refusal:
                refused += 1
                if (r.status_code, code) != (403, "insufficient_scope"):
                    failures.append(case.line(r.status_code, f"not refused for its scope ({code})"))
            else:
                admitted += 1
                if r.status_code in (401, 403) and code in ("insufficient_scope", "key_unknown", "key_revoked"):
                    failures.append(case.line(r.status_code, f"refused with its scope ({code})"))
    assert not failures, report(failures, len(cases))
    assert (refused, admitted) == (OPERATIONS, OPERATIONS)
