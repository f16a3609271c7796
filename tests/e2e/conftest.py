"""The whole service as real processes: a private Redis, the web process (gunicorn), one Celery
worker per queue, embedded Qdrant, on SQLite or on a fresh PostgreSQL database when DATABASE_URL
names PostgreSQL. Weights: the real ViT-B-32 architecture with seeded random weights.

The default ``stack`` is one stack for the whole session, shared by every module that takes it
(a start costs 15-35 s of the 2-core CI machine; five modules took one each). It is stopped as
soon as no later test takes it, so it does not idle beside the modules that start their own. A
module on it counts what it adds itself (:func:`settled_stats` before, :func:`stats_added` after)
and uses its own user (``api.user``), never totals of a fresh, empty service. A module whose
environment differs defines its own ``stack`` fixture (module-scoped, on ``database_url``).
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid

import pytest
import requests

from scripts.stack import Stack

#: Environment of the shared stack: seeded random weights, a 30 s interactive deadline (the photos'
#: first interactive batch may wait for the model on a loaded 2-core machine).
SHARED_ENV = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0", "INTERACTIVE_DEADLINE_S": "30",
              "FETCH_ALLOW_NETWORKS": "127.0.0.1/32",  # the catalogue tests' own HTTP server (test_catalogue.py)
              "BATCH_WINDOW_MIN_S": "1"}  # a batch's window of seconds: expiry (test_openai_batches.py)


@contextlib.contextmanager
def fresh_database():
    """A new, empty PostgreSQL database when DATABASE_URL names PostgreSQL (dropped afterwards),
    else ``""`` (SQLite in the stack's var folder). Yields the URL."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        yield ""
        return
    import psycopg

    base, _, _ = url.rpartition("/")
    name = f"clip_e2e_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def database_url():
    """A fresh database for a module that starts its own stack."""
    with fresh_database() as url:
        yield url


#: The session's shared stack while it runs (``pytest_runtest_teardown`` stops it early).
_running: list[Stack] = []


@pytest.fixture(scope="session")
def session_stack(tmp_path_factory):
    """The one stack of every module that takes the default ``stack``, on its own database."""
    with fresh_database() as url:
        s = Stack(tmp_path_factory.mktemp("stack"), {**SHARED_ENV, "DATABASE_URL": url}, private_redis=True,
                  log=lambda *a: None)
        with s:
            _running.append(s)
            yield s
        if s in _running:
            _running.remove(s)


@pytest.fixture(scope="module")
def stack(session_stack):
    return session_stack


def _takes_session_stack(item) -> bool:
    return "session_stack" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Run the tests on the shared stack one module after another (each in its file order) from
    where the first of them runs, so that no module with its own stack starts while the shared
    one is up (its idle processes would hold memory and take CPU beside a timing-sensitive test)."""
    shared = [item for item in items if _takes_session_stack(item)]
    if shared:
        first = items.index(shared[0])
        others = [item for item in items if not _takes_session_stack(item)]
        items[:] = others[:first] + shared + others[first:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared stack after the last test that takes it (in the order the session runs),
    instead of at the end of the session: idle, it would still hold memory and wake up every
    second beside the stacks of later modules (``Stack.stop`` is idempotent: the session's
    teardown finds nothing left to stop)."""
    if not _running or nextitem is None or not _takes_session_stack(item):
        return
    items = item.session.items
    if not any(_takes_session_stack(later) for later in items[items.index(nextitem):]):
        _running.pop().stop()


def stats_now(api) -> dict:
    """``GET /api/stats/`` (staff)."""
    r = api.get("/api/stats/")
    assert r.status_code == 200, r.text
    return r.json()


def settled_stats(api, timeout: float = 120) -> dict:
    """``GET /api/stats/`` once no image is queued and there is one point per distinct embedded
    image: the baseline of a test that counts what it adds. On the shared stack the work of an
    earlier module may still be finishing (schema fuzzing leaves bulk jobs running).

    Raises:
        AssertionError: not settled within ``timeout`` seconds (e.g. a job left paused).
    """
    end = time.monotonic() + timeout
    while True:
        stats = stats_now(api)
        if not stats["images"].get("queued") and stats["points"] == stats["distinct_embedded"]:
            return stats
        assert time.monotonic() < end, f"the service did not settle in {timeout} s: {stats}"
        time.sleep(0.2)


def stats_added(before: dict, after: dict) -> dict[str, int]:
    """What changed between two ``/api/stats/`` answers: rows per image status (every status
    either shows), ``points`` and ``distinct_embedded``."""
    statuses = set(before["images"]) | set(after["images"])
    added = {s: after["images"].get(s, 0) - before["images"].get(s, 0) for s in statuses}
    return {**added, "points": after["points"] - before["points"],
            "distinct_embedded": after["distinct_embedded"] - before["distinct_embedded"]}


class Api:
    """A tiny HTTP client for the running web process, as ``user`` (the token's owner)."""

    def __init__(self, base: str, token: str, user: str | None = None) -> None:
        self.base = base
        self.user = user
        self.s = requests.Session()
        self.s.headers["Authorization"] = f"Token {token}"

    def get(self, path, **kw):
        return self.s.get(self.base + path, timeout=60, **kw)

    def post(self, path, **kw):
        return self.s.post(self.base + path, timeout=60, **kw)


@pytest.fixture(scope="module")
def api(stack, request):
    """A staff user of this module alone (``e2e-<module>``): on the shared stack what it uploads
    is its own, whatever other modules uploaded."""
    user = "e2e-" + request.module.__name__.rpartition(".")[2].removeprefix("test_")
    return Api(stack.web_url, stack.manage("apiuser", user, "--staff").strip(), user)


@pytest.fixture(scope="module")
def token(api) -> str:
    """The module's user's API token (``api``'s)."""
    return api.s.headers["Authorization"].split()[1]


@pytest.fixture(scope="module")
def client(stack, token):
    """The official ``openai`` client on the stack's ``/v1`` as the module's user (no retries: a
    failure shows as it happened); the module is skipped where ``openai`` is not installed."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=stack.web_url + "/v1", api_key=token, max_retries=0, timeout=60) as c:
        yield c
