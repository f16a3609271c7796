"""The site's Keys page (``embeddings/site/keys.py``): a signed-in user's keys, made with the secret
shown on the answering page once, refused in words, revoked by a button."""
from __future__ import annotations

import pytest
from django.test import Client

from embeddings.models import ApiKey
from embeddings.services.access.keys import secret_hash

pytestmark = pytest.mark.django_db(transaction=True)


def signed_in(u) -> Client:
    c = Client()
    c.force_login(u)
    return c


def test_the_keys_page_makes_shows_once_and_revokes(user, other_user, settings, private_redis):
    settings.REDIS_URL = private_redis[0]
    assert Client().get("/keys/").status_code == 302  # to sign in
    c = signed_in(user)
    page = c.get("/keys/")
    assert page.status_code == 200 and "No keys yet." in page.content.decode()
    assert 'value="admin"' not in page.content.decode()  # staff only
    r = c.post("/keys/", {"name": "search script", "preset": "read-only", "scopes": ["exports"], "days": "30"})
    assert r.status_code == 200
    key = ApiKey.objects.get()
    assert key.scopes == ["images:read", "search", "embeddings", "jobs:read", "exports", "usage"]
    assert key.expires_at is not None and key.owner == user
    text = r.content.decode()
    secret = text.split('id="secret">', 1)[1].split("<", 1)[0]
    assert secret_hash(secret) == key.secret_hash
    again = c.get("/keys/").content.decode()
    assert key.prefix in again and secret not in again  # shown once
    r = c.post("/keys/", {"name": "bad", "scopes": ["admin"]})  # not a choice for a user who is not staff
    assert r.status_code == 400 and "<html" in r.content.decode()
    assert ApiKey.objects.count() == 1
    assert signed_in(other_user).post(f"/keys/{key.pk}/revoke/").status_code == 404  # not theirs
    r = c.post(f"/keys/{key.pk}/revoke/")
    assert r.status_code == 302
    key.refresh_from_db()
    assert key.state() == "revoked"
    r = Client().get("/api/images/", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert (r.status_code, r.json()["code"]) == (401, "key_revoked")
