"""The whole service as real processes: a private Redis, the web process (gunicorn), one Celery
worker per queue, embedded Qdrant, on SQLite or on a fresh PostgreSQL database when DATABASE_URL
names PostgreSQL. Weights: the real ViT-B-32 architecture with seeded random weights."""
from __future__ import annotations

import os
import uuid

import pytest
import requests

from scripts.stack import Stack


@pytest.fixture(scope="module")
def database_url():
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        yield ""  # SQLite in the stack's var folder
        return
    import psycopg

    base, _, _ = url.rpartition("/")
    name = f"clip_e2e_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{base}/{name}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    env = {"CLIP_PRETRAINED": "random", "DATABASE_URL": database_url, "DJANGO_DEBUG": "0",
           "INTERACTIVE_DEADLINE_S": "30"}
    s = Stack(tmp_path_factory.mktemp("stack"), env, private_redis=True, log=lambda *a: None)
    with s:
        yield s


class Api:
    """A tiny HTTP client for the running web process."""

    def __init__(self, base: str, token: str) -> None:
        self.base = base
        self.s = requests.Session()
        self.s.headers["Authorization"] = f"Token {token}"

    def get(self, path, **kw):
        return self.s.get(self.base + path, timeout=60, **kw)

    def post(self, path, **kw):
        return self.s.post(self.base + path, timeout=60, **kw)


@pytest.fixture(scope="module")
def api(stack):
    return Api(stack.web_url, stack.manage("apiuser", "e2e", "--staff").strip())
