"""No one let in: authentication, staff-only surfaces, owner isolation down to the Qdrant query,
upload limits, and production settings (``manage.py check --deploy``)."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile

import pytest

from embeddings import runtime
from embeddings.models import Image
from tests.conftest import ROOT
from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


# --- authentication and staff ----------------------------------------------------------------------

@pytest.mark.parametrize("method,url", [
    ("get", "/api/images/"), ("post", "/api/images/"), ("get", "/api/images/00000000-0000-0000-0000-000000000000/"),
    ("delete", "/api/images/00000000-0000-0000-0000-000000000000/"), ("get", "/api/jobs/"), ("post", "/api/jobs/"),
    ("get", "/api/jobs/00000000-0000-0000-0000-000000000000/"),
    ("post", "/api/jobs/00000000-0000-0000-0000-000000000000/cancel/"), ("post", "/api/search/"),
    ("get", "/api/stats/"),
])
def test_every_endpoint_requires_a_token(client, method, url):
    r = getattr(client, method)(url)
    assert r.status_code == 401 and r.json()["code"] == "not_authenticated"
    bad = getattr(client, method)(url, HTTP_AUTHORIZATION="Token " + "0" * 40)  # no key or token has it
    assert bad.status_code == 401 and bad.json()["code"] == "key_unknown"


def test_admin_requires_staff(client, user, staff):
    assert client.get("/admin/embeddings/image/").status_code == 302  # to the login page
    client.force_login(user)
    r = client.get("/admin/embeddings/image/")
    assert r.status_code == 302 and "/admin/login/" in r["Location"]
    client.force_login(staff)
    assert client.get("/admin/embeddings/image/").status_code == 200


def test_stats_are_staff_only(service, api, staff):
    assert api.get("/api/stats/").status_code == 403
    assert client_for(staff).get("/api/stats/").status_code == 200


# --- owners: enforced in the Qdrant query ------------------------------------------------------------

def test_a_point_shared_by_two_owners_is_filtered_per_owner_in_qdrant(service, user, other_user, django_user_model):
    carol = django_user_model.objects.create_user("carol")
    alice, bob = client_for(user), client_for(other_user)
    data = jpeg_bytes(700)
    a = alice.post("/api/images/", {"files": [upload("a.jpg", data)]}, format="multipart").json()["images"][0]
    b = bob.post("/api/images/", {"files": [upload("b.jpg", data)]}, format="multipart").json()["images"][0]
    assert a["status"] == b["status"] == "embedded"  # different owners: one row each, one point
    store = runtime.vector_store()
    pid = Image.objects.get(id=a["id"]).point_id
    assert Image.objects.get(id=b["id"]).point_id == pid and store.count() == 1
    vector = store.vectors([pid])[pid]
    assert store.payloads([pid])[pid]["owner_ids"] == sorted([user.id, other_user.id])
    assert [h.id for h in store.search(vector, k=5, owner_id=user.id)] == [pid]
    assert [h.id for h in store.search(vector, k=5, owner_id=other_user.id)] == [pid]
    assert store.search(vector, k=5, owner_id=carol.id) == []  # the query itself excludes it

    assert alice.delete(f"/api/images/{a['id']}/").status_code == 204
    assert store.count() == 1  # bob still has it
    assert store.payloads([pid])[pid]["owner_ids"] == [other_user.id]
    assert store.search(vector, k=5, owner_id=user.id) == []
    assert [h.id for h in store.search(vector, k=5, owner_id=other_user.id)] == [pid]
    assert bob.post("/api/search/", {"image_id": b["id"], "k": 5}, format="json").json()["results"][0]["image_id"] == b["id"]

    assert bob.delete(f"/api/images/{b['id']}/").status_code == 204
    assert store.count() == 0


def test_searches_pass_the_owner_to_qdrant(service, user, other_user, staff, monkeypatch):
    client_for(user).post("/api/images/", {"files": [upload("m.jpg", jpeg_bytes(710))]}, format="multipart")
    store = runtime.vector_store()
    real, owners = store.search, []
    monkeypatch.setattr(store, "search", lambda v, **kw: owners.append(kw.get("owner_id")) or real(v, **kw))
    bob = client_for(other_user)
    assert bob.post("/api/search/", {"text": "anything", "k": 10}, format="json").json()["results"] == []
    assert bob.post("/api/search/", {"image": upload("q.jpg", jpeg_bytes(710)), "k": 10},
                    format="multipart").json()["results"] == []
    client_for(staff).post("/api/search/", {"text": "anything"}, format="json")
    assert owners == [other_user.id, other_user.id, None]  # staff: every owner


def test_jobs_and_images_of_others_are_invisible(service, api, other_user):
    r = api.post("/api/jobs/", {"files": [upload("j.jpg", jpeg_bytes(720))]}, format="multipart")
    job_id = r.json()["id"]
    image_id = str(Image.objects.get(job_id=job_id).id)
    bob = client_for(other_user)
    for method, url in (("get", f"/api/jobs/{job_id}/"), ("post", f"/api/jobs/{job_id}/cancel/"),
                        ("get", f"/api/images/{image_id}/"), ("delete", f"/api/images/{image_id}/")):
        assert getattr(bob, method)(url).status_code == 404, url
    assert bob.get("/api/jobs/").json()["results"] == [] and bob.get("/api/images/").json()["results"] == []
    r = bob.post("/api/search/", {"text": "x", "job_id": job_id}, format="json")
    assert (r.status_code, r.json()["code"]) == (404, "not_found")


def test_a_search_filtered_by_another_users_job_is_not_found(service, user, other_user, staff, monkeypatch):
    # points are shared per sha256: bob's job holding alice's bytes must not let alice probe it
    alice, bob = client_for(user), client_for(other_user)
    data = jpeg_bytes(730)
    mine = alice.post("/api/images/", {"files": [upload("a.jpg", data)]}, format="multipart").json()["images"][0]
    bobs_job = bob.post("/api/jobs/", {"files": [upload("b.jpg", data)]}, format="multipart").json()["id"]
    my_job = alice.post("/api/jobs/", {"files": [upload("c.jpg", jpeg_bytes(731))]}, format="multipart").json()["id"]
    store = runtime.vector_store()
    real, calls = store.search, []
    monkeypatch.setattr(store, "search", lambda v, **kw: calls.append(kw.get("job_id")) or real(v, **kw))
    for query, fmt in (({"text": "x"}, "json"), ({"image_id": mine["id"]}, "json"),
                       ({"image": upload("q.jpg", data)}, "multipart")):
        r = alice.post("/api/search/", {**query, "job_id": bobs_job, "k": 5}, format=fmt)
        assert (r.status_code, r.json()["code"]) == (404, "not_found"), (query, r.json())
    missing = alice.post("/api/search/", {"text": "x", "job_id": "00000000-0000-0000-0000-000000000000"}, format="json")
    assert (missing.status_code, missing.json()["code"]) == (404, "not_found")
    assert calls == []  # refused before any query ran
    own = alice.post("/api/search/", {"text": "x", "job_id": my_job, "k": 5}, format="json")
    assert own.status_code == 200
    assert [r["image_id"] for r in own.json()["results"]] == [str(Image.objects.get(job_id=my_job).id)]
    as_staff = client_for(staff).post("/api/search/", {"text": "x", "job_id": bobs_job, "k": 5}, format="json")
    assert as_staff.status_code == 200
    assert [r["sha256"] for r in as_staff.json()["results"]] == [mine["sha256"]]
    assert calls == [my_job, bobs_job]


# --- upload limits -------------------------------------------------------------------------------------

def test_upload_limits_answer_413_400_415(service, api, settings):
    settings.PIPELINE = settings.PIPELINE.replace(max_image_bytes=5_000, max_image_pixels=100 * 100)
    big = jpeg_bytes(1, (400, 400))
    assert len(big) > 5_000
    r = api.post("/api/images/", {"files": [upload("big.jpg", big)]}, format="multipart")
    assert (r.status_code, r.json()["images"][0]["reason"]) == (413, "too_large")
    r = api.post("/api/images/", {"files": [upload("wide.jpg", jpeg_bytes(2, (120, 120)))]}, format="multipart")
    assert (r.status_code, r.json()["images"][0]["reason"]) == (413, "too_many_pixels")
    r = api.post("/api/images/", {"files": [upload("x.jpg", b"GIF87a" + b"\0" * 10)]}, format="multipart")
    assert r.status_code in (400, 415)
    r = api.post("/api/images/", {"files": [upload("doc.jpg", b"%PDF-1.7 hello")]}, format="multipart")
    assert (r.status_code, r.json()["images"][0]["reason"]) == (415, "not_an_image")
    many = [upload(f"{i}.jpg", jpeg_bytes(i, (32, 32))) for i in range(settings.INTERACTIVE_MAX_FILES + 1)]
    r = api.post("/api/images/", {"files": many}, format="multipart")
    assert (r.status_code, r.json()["code"]) == (400, "too_many_files")
    settings.UPLOAD_MAX_REQUEST_BYTES = 2_000
    r = api.post("/api/images/", {"files": [upload("b.jpg", big)]}, format="multipart")
    assert (r.status_code, r.json()["extra"]["limit"]) == (413, "UPLOAD_MAX_REQUEST_BYTES")
    assert not Image.objects.filter(original_name="b.jpg").exists()  # refused before anything is stored


def test_oversized_search_image_is_refused(service, api, settings):
    settings.PIPELINE = settings.PIPELINE.replace(max_image_bytes=1_000)
    r = api.post("/api/search/", {"image": upload("q.jpg", jpeg_bytes(3, (300, 300)))}, format="multipart")
    assert (r.status_code, r.json()["code"]) == (413, "too_large")


# --- production settings -------------------------------------------------------------------------------

def production_env(**extra) -> dict:
    """A production process's environment, with its own empty state folder: the checkout's ``var/``
    (a ``make demo`` or ``make run`` before the tests) holds a database whose active space the
    checks compare with ``CLIP_MODEL``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST", "CELERY_", "VAR_DIR"))}
    env.update({"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": secrets.token_urlsafe(50), "DJANGO_HTTPS": "1",
                "DJANGO_ALLOWED_HOSTS": "clip.example.com", "DJANGO_SETTINGS_MODULE": "project.settings",
                "VAR_DIR": tempfile.mkdtemp(prefix="production-check-")})
    env.update(extra)
    return env


def manage(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_deploy_check_is_clean_with_production_settings():
    out = manage("check", "--deploy", env=production_env())
    assert out.returncode == 0, out.stderr
    assert "System check identified no issues (0 silenced)." in out.stdout, out.stdout + out.stderr
    security = manage("check", "--deploy", "--tag", "security", "--fail-level", "WARNING", env=production_env())
    assert security.returncode == 0 and "no issues" in security.stdout, security.stdout + security.stderr


def test_production_settings_are_read_from_the_environment():
    code = ("from django.conf import settings as s; print(s.DEBUG, s.SECURE_SSL_REDIRECT, s.SESSION_COOKIE_SECURE, "
            "s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_SECONDS > 0, s.ALLOWED_HOSTS, s.SECRET_KEY == '%s')")
    env = production_env()
    out = manage("shell", "-c", code % env["DJANGO_SECRET_KEY"], env=env)
    assert out.stdout.split("\n")[-2] == "False True True True True ['clip.example.com'] True", out.stderr


def test_an_empty_secret_key_stops_the_service():
    out = manage("check", env=production_env(DJANGO_SECRET_KEY=""))
    assert out.returncode != 0 and "SECRET_KEY" in out.stderr
