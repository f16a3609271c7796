"""A key's limits across web processes (issue 55): the web process alone (gunicorn, 2 processes,
``project.processes``) on its own fresh database (``database_url``: SQLite in the stack's folder,
or a new PostgreSQL database, never ``DATABASE_URL``'s own) and a private Redis. Requests sent at
once from 16 threads are taken by whichever of the two processes accepts each (their counters are
not shared in memory); Redis admits exactly the limit between them."""
from __future__ import annotations

import concurrent.futures

import pytest
import requests

from scripts.stack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    env = {"CLIP_PRETRAINED": "random", "DATABASE_URL": database_url}
    with Stack(tmp_path_factory.mktemp("keys"), env, private_redis=True, only=("web",), log=lambda *a: None) as s:
        yield s


def test_two_web_processes_admit_exactly_a_keys_requests_per_minute(stack):
    stack.manage("apiuser", "limits")  # the user (its DRF token is not used)
    secret = stack.manage("apikeys", "create", "limits", "--scopes", "keys", "--limit",
                          "requests_per_minute=20").strip()
    url = stack.web_url + "/api/keys/"

    def get(_):
        r = requests.get(url, headers={"Authorization": f"Bearer {secret}"}, timeout=60)
        return r.status_code, r.headers.get("x-ratelimit-remaining-requests"), r.headers.get("Retry-After")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(get, range(64)))
    statuses = [a[0] for a in answers]
    assert (statuses.count(200), statuses.count(429)) == (20, 44), statuses
    assert sorted(int(a[1]) for a in answers if a[0] == 200) == list(range(20))  # each count seen once
    assert all(1 <= int(a[2]) <= 60 for a in answers if a[0] == 429)
    r = requests.get(url, headers={"Authorization": f"Token {secret}"}, timeout=60)  # the other keyword: same key
    assert r.status_code == 429 and r.json()["code"] == "rate_limited"
    listed = stack.manage("apikeys", "list", "limits")
    assert secret not in listed and secret[:11] in listed  # the prefix, never the secret
    stack.manage("apikeys", "revoke", secret[:11])
    r = requests.get(url, headers={"Authorization": f"Bearer {secret}"}, timeout=60)
    assert (r.status_code, r.json()["code"]) == (401, "key_revoked")
