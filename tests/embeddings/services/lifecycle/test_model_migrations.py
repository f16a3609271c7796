"""Changing the model without downtime (issue 13 part A): a migration re-embeds every live original
as a copy row in the new space, new uploads are embedded in both spaces, promote / rollback move the
active row, drop deletes a space's collection and copies, users never see copies and keep their ids.

Two real open_clip architectures with seeded random weights: ViT-B-32 (the configured, active one,
the session's encoder) and ViT-S-32 (CLIP_MODELS; 384-dimensional), and one saved ViT-S-32
checkpoint through the file-path loader. Eager Celery: every task runs in the test process.
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from embeddings import runtime
from embeddings.models import EmbeddingSpace, Image, ImageStatus, Job, JobKind, SpaceState
from embeddings.services.queues import bulk
from embeddings.services.lifecycle import gate
from embeddings.services.lifecycle import model_migrations as migrations
from embeddings.services.catalogue import copies as copies_services
from embeddings import spaces
from tests.embeddings.conftest import client_for, jpeg_bytes, upload
from workers.ids import point_id

pytestmark = pytest.mark.django_db(transaction=True)

A = "ViT-B-32/random-seed0/fp32"
S = "ViT-S-32/random-seed0/fp32"


@pytest.fixture(scope="session")
def small_encoder(random_config):
    """ViT-S-32 with seeded random weights, loaded once for the session."""
    from workers.model import ClipEncoder

    return ClipEncoder(random_config.replace(model_name="ViT-S-32"))


@pytest.fixture
def two_models(service, settings, small_encoder, monkeypatch):
    """The service with ViT-S-32 in CLIP_MODELS (its encoder the session's) and a gate that says
    yes (13B's gate has its own tests; here ``verdict`` can be changed)."""
    settings.CLIP_MODELS = ["ViT-S-32:random"]
    settings.SPACE_CACHE_S = 0.0
    spaces.forget_cache()
    runtime.encoder_holder(S)._encoder = small_encoder
    verdict = {"v": (True, "", "the probe passed")}
    monkeypatch.setattr(gate, "gate_verdict", lambda space: verdict["v"])
    started = []
    monkeypatch.setattr(migrations, "migration_job_done", lambda job: started.append(job.id))
    yield {"verdict": verdict, "gate_started": started}
    spaces.forget_cache()


def store(model_id: str):
    return runtime.vector_store(model_id)


def copies(model_id: str):
    return Image.objects.filter(model_id=model_id, source__isnull=False)


def test_migrate_dual_embed_promote_rollback_delete_and_drop(two_models, api, user, other_user, staff):
    admin, bob = client_for(staff), client_for(other_user)
    # the catalogue in the active space A: alice 2 originals + 1 duplicate (interactive); bob 2
    # originals + 1 refused file (a job)
    r = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1)), upload("b.jpg", jpeg_bytes(2)),
                                            upload("a2.jpg", jpeg_bytes(1))]}, format="multipart")
    assert r.status_code == 200, r.content
    a, b, a_dup = (im["id"] for im in r.json()["images"])
    r = bob.post("/api/jobs/", {"files": [upload("c.jpg", jpeg_bytes(3)), upload("d.jpg", jpeg_bytes(4)),
                                          upload("x.jpg", b"not an image")]}, format="multipart")
    bob_job = r.json()["id"]
    assert spaces.active().model_id == A and store(A).count() == 4

    r = admin.post("/api/migrations/", {"model": "ViT-S-32", "pretrained": "random"}, format="json")
    assert r.status_code == 202, r.content
    m = r.json()
    assert (m["model_id"], m["state"], m["dim"], m["source"]) == (S, "candidate", 384, A)
    space = EmbeddingSpace.objects.get(model_id=S)
    # exactly the 4 live originals, all owners; never the duplicate nor the refused file
    assert copies(S).count() == 4
    assert set(copies(S).values_list("source_id", flat=True)) == {
        i for i in Image.objects.filter(model_id=A, status=ImageStatus.EMBEDDED, duplicate_of__isnull=True)
        .values_list("id", flat=True)}
    assert set(copies(S).values_list("status", "lane", "job_id")) == {("embedded", "bulk", space.job_id)}
    assert all(c.point_id == point_id(c.sha256, S) for c in copies(S))
    job = Job.objects.get(id=space.job_id)
    assert (job.kind, job.priority, job.status, job.total) == (JobKind.MIGRATION, "background", "done", 4)
    assert two_models["gate_started"] == [job.id]
    assert store(S).count() == 4 and store(S).dim == 384
    detail = admin.get(m["url"]).json()
    assert (detail["job"]["embedded"], detail["job"]["failed"], detail["job"]["total"]) == (4, 0, 4)

    # users never see copies: lists, look-ups, job lists
    assert len(api.get("/api/images/").json()["results"]) == 3
    assert len(admin.get("/api/images/").json()["results"]) == 6
    copy_of_a = copies(S).get(source_id=a)
    assert admin.get(f"/api/images/{copy_of_a.id}/").status_code == 404
    assert str(job.id) not in {j["id"] for j in api.get("/api/jobs/").json()["results"]}

    # a new upload during the migration: its row in A, a copy in S (the dual job), both embedded
    r = api.post("/api/images/", {"files": [upload("e.jpg", jpeg_bytes(5))]}, format="multipart")
    e = r.json()["images"][0]["id"]
    assert Image.objects.get(id=e).model_id == A
    dual = copies(S).get(source_id=e)
    assert dual.status == ImageStatus.EMBEDDED and Job.objects.get(id=dual.job_id).name == copies_services.DUAL_JOB
    assert (store(A).count(), store(S).count()) == (5, 5)

    # promote: S active, A standby; searches now answer from S and map to the users' rows
    r = admin.post(f"{m['url']}promote/", {"force": False}, format="json")
    assert r.status_code == 200 and r.json()["state"] == "active", r.content
    assert EmbeddingSpace.objects.get(model_id=A).state == SpaceState.STANDBY
    hits = api.post("/api/search/", {"text": "a photo", "k": 10, "min_score": 0}, format="json").json()
    assert {h["image_id"] for h in hits["results"]} == {a, b, e}
    assert hits.get("model_id", S) == S
    by_id = api.post("/api/search/", {"image_id": a, "k": 1, "min_score": 0}, format="json").json()["results"]
    assert by_id[0]["image_id"] == a and by_id[0]["score"] == pytest.approx(1.0, abs=1e-4)
    # a job filter after the switch: bob's job id still finds bob's images (payload: the user's job)
    got = bob.post("/api/search/", {"text": "x", "k": 10, "job_id": bob_job, "min_score": 0}, format="json").json()
    assert {h["job_id"] for h in got["results"]} == {bob_job} and len(got["results"]) == 2

    # an upload after the switch: the user's row in S, a copy in the standby A
    f = api.post("/api/images/", {"files": [upload("f.jpg", jpeg_bytes(6))]}, format="multipart").json()["images"][0]
    assert f["status"] == "embedded" and Image.objects.get(id=f["id"]).model_id == S
    assert copies(A).get(source_id=f["id"]).status == ImageStatus.EMBEDDED

    # rollback (on the active space): A active again within the cache time; f is found through its copy
    r = admin.post(f"{m['url']}rollback/", {}, format="json")
    assert r.status_code == 200 and (r.json()["model_id"], r.json()["state"]) == (A, "active")
    hits = api.post("/api/search/", {"text": "a photo", "k": 10, "min_score": 0}, format="json").json()["results"]
    assert {h["image_id"] for h in hits} == {a, b, e, f["id"]}

    # deleting a user's row deletes its copies and their points in every space
    assert api.delete(f"/api/images/{a}/").status_code == 204
    assert not copies(S).filter(source_id=a).exists()
    assert a_dup in {h["image_id"] for h in api.post("/api/search/", {"text": "a", "k": 10, "min_score": 0},
                                                     format="json").json()["results"]}  # the duplicate took over
    assert store(S).count() == 5  # a's copy's point gone; b, c, d, e copies and f's own row remain

    # drop S (now standby): its copies and collection go, f's own row stays (its vector lives in A)
    assert admin.delete(f"/api/migrations/{EmbeddingSpace.objects.get(model_id=A).id}/").status_code == 409
    folder = Path(store(S).folder)
    r = admin.delete(m["url"])
    assert r.status_code == 200 and r.json()["state"] == "dropped", r.content
    assert not copies(S).exists() and not folder.exists()
    assert Image.objects.get(id=f["id"]).status == ImageStatus.EMBEDDED
    assert spaces.dual_targets() == []
    g = api.post("/api/images/", {"files": [upload("g.jpg", jpeg_bytes(7))]}, format="multipart").json()["images"][0]
    assert g["status"] == "embedded" and not copies(S).exists()


def test_refusals_model_not_configured_incomplete_gate_and_states(two_models, api, user, staff):
    admin = client_for(staff)
    assert api.post("/api/migrations/", {"model": "ViT-S-32"}, format="json").status_code == 403
    r = admin.post("/api/migrations/", {"model": "ViT-B-16", "pretrained": "random"}, format="json")
    assert (r.status_code, r.json()["code"]) == (400, "model_not_configured")
    r = admin.post("/api/migrations/", {"model": "ViT-Nope", "pretrained": "random"}, format="json")
    assert (r.status_code, r.json()["code"]) == (400, "invalid")
    # one embedded original, no bytes needed: the fill is not run
    Image.objects.create(owner=user, lane="bulk", status=ImageStatus.EMBEDDED, sha256="a" * 64, size_bytes=1,
                         storage_key="blob/x", model_id=spaces.active().model_id, point_id=point_id("a" * 64, A))
    space = migrations.migration_start(owner=staff, model_name="ViT-S-32", pretrained="random", fill=False)
    assert migrations.migration_incomplete(space) == {"queued": 0, "uncopied": 1, "job_status": "queued"}
    url = f"/api/migrations/{space.id}/"
    r = admin.post(url + "promote/", {}, format="json")
    assert (r.status_code, r.json()["code"], r.json()["extra"]["uncopied"]) == (409, "migration_incomplete", 1)
    r = admin.post("/api/migrations/", {"model": "ViT-S-32"}, format="json")
    assert (r.status_code, r.json()["code"]) == (409, "migration_running")
    assert admin.post(f"/api/migrations/{EmbeddingSpace.objects.get(model_id=A).id}/rollback/",
                      {}, format="json").json()["code"] == "no_standby"
    # the copy exists (made by hand here) but failed: not queued any more, the gate decides
    Image.objects.create(owner=user, lane="bulk", status=ImageStatus.FAILED, reason="corrupt", sha256="a" * 64,
                         size_bytes=1, storage_key="blob/x", model_id=S, point_id=point_id("a" * 64, S),
                         source=Image.objects.get(model_id=A), job=space.job)
    Job.objects.filter(id=space.job_id).update(status="done")
    assert migrations.migration_incomplete(space) is None
    two_models["verdict"]["v"] = (False, "gate_failed", "rate 0.5 < 0.99")
    r = admin.post(url + "promote/", {"force": False}, format="json")
    assert (r.status_code, r.json()["code"]) == (409, "gate_failed")
    assert EmbeddingSpace.objects.get(id=space.id).state == SpaceState.CANDIDATE
    r = admin.post(url + "promote/", {"force": True}, format="json")
    assert r.status_code == 200 and r.json()["state"] == "active"
    assert r.json()["gate_report"]["forced"]["code"] == "gate_failed"
    assert (admin.delete(url).status_code, admin.delete(url).json()["code"]) == (409, "space_active")
    assert admin.post(url + "promote/", {}, format="json").json()["code"] == "already_active"


def test_a_chunk_for_a_model_this_worker_is_not_configured_for_fails_its_images(two_models, user, staff):
    other = "ViT-B-16/random-seed0/fp32"
    EmbeddingSpace.objects.create(model_id=other, model_name="ViT-B-16", pretrained="random", precision="fp32",
                                  collection="clip_vit_b_16_random_seed0_fp32", dim=512, state=SpaceState.CANDIDATE)
    job = Job.objects.create(owner=staff, kind=JobKind.MIGRATION, model_id=other, total=1)
    im = Image.objects.create(owner=user, job=job, lane="bulk", sha256="b" * 64, size_bytes=1, storage_key="blob/y",
                              model_id=other, point_id=point_id("b" * 64, other))
    out = bulk.chunk_embed(job_id=str(job.id), image_ids=[str(im.id)])
    im.refresh_from_db()
    assert out["failed"] == 1 and (im.status, im.reason) == ("failed", "model_not_configured")
    assert Job.objects.get(id=job.id).status == "done"
    # a user's upload that expires takes its queued copies in other spaces along
    from embeddings.services.catalogue.images import images_mark_failed

    mine = Image.objects.create(owner=user, lane="interactive", sha256="c" * 64, size_bytes=1, storage_key="blob/z",
                                model_id=A, point_id=point_id("c" * 64, A))
    copy = Image.objects.create(owner=user, job=job, lane="bulk", sha256="c" * 64, size_bytes=1, storage_key="blob/z",
                                model_id=other, point_id=point_id("c" * 64, other), source=mine)
    images_mark_failed([(str(mine.id), "expired", "deadline passed")])
    copy.refresh_from_db()
    assert (copy.status, copy.reason) == ("expired", "expired")
    # an interactive worker warms only the spaces it is configured for (the candidate here is not)
    assert runtime.warm_spaces() == [] and set(runtime.encoder_holder.held()) == {A, S}


def test_the_configured_model_differing_from_the_active_space_is_a_warning(two_models, settings):
    from embeddings.checks import check_configured_model

    spaces.active()
    assert check_configured_model(None) == []
    settings.PIPELINE = settings.PIPELINE.replace(model_name="ViT-S-32")
    (warning,) = check_configured_model(None)
    assert warning.id == "embeddings.W002"
    assert warning.msg.startswith(f"CLIP_MODEL names {S} but the active space is {A}: ")


def test_a_checkpoint_file_through_the_file_path_loader(two_models, settings, tmp_path, small_encoder, api, staff):
    """A saved ViT-S-32 state dict (the seeded random weights) as CLIP_MODELS' file path: a space of
    its own (``file-<sha256[:12]>``) whose vectors equal the random-seed0 model's on the same image."""
    import torch

    path = tmp_path / "vit-s-32.pt"
    torch.save(small_encoder.model.state_dict(), path)
    settings.CLIP_MODELS = [f"ViT-S-32:{path}"]
    api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(11))]}, format="multipart")
    r = client_for(staff).post("/api/migrations/", {"model": "ViT-S-32", "pretrained": str(path)}, format="json")
    assert r.status_code == 202, r.content
    mid = r.json()["model_id"]
    assert mid.startswith("ViT-S-32/file-") and mid.endswith("/fp32")
    copy = copies(mid).get()
    assert copy.status == ImageStatus.EMBEDDED
    vector = store(mid).vectors([copy.point_id])[copy.point_id]
    from workers.preprocess import normalize

    runner = runtime.batch_runner(A)  # decode and resize: the same 224 px preprocessing
    prepared = runner.prepare([copy.storage_key], lambda key: runtime.blob_store().read(key, copy.sha256))
    expected = small_encoder.encode_images(normalize(prepared.pixels, small_encoder.preprocess_config))[0]
    assert float(vector @ expected) == pytest.approx(1.0, abs=1e-4)


def test_the_management_command_start_status_promote_rollback_drop(two_models, staff):
    import json

    from django.core.management import call_command
    from django.core.management.base import CommandError

    def run(*args) -> dict | list:
        out = io.StringIO()
        call_command("model_migration", *args, stdout=out)
        return json.loads(out.getvalue())

    spaces.active()
    started = run("start", "--model", "ViT-S-32", "--pretrained", "random", "--here")
    assert (started["model_id"], started["state"], started["job"]["status"]) == (S, "candidate", "done")
    assert [s["state"] for s in run("status")] == ["active", "candidate"]
    assert run("promote", S)["state"] == "active"
    assert run("rollback")["model_id"] == A
    assert run("drop", S)["state"] == "dropped"
    with pytest.raises(CommandError, match="space_active"):
        run("drop", A)


def test_every_action_refuses_a_body_its_schema_refuses_and_the_first_space_has_no_source(service, staff, api,
                                                                                        user, monkeypatch):
    admin = client_for(staff)
    ran = []
    monkeypatch.setattr(gate, "gate_start", lambda space_id: ran.append(space_id))
    spaces.active(fresh=True)  # the space the deployment starts with, made on first use
    (space,) = admin.get("/api/migrations/").json()
    assert (space["state"], space["source"]) == ("active", None)  # what the schema now says may be
    assert admin.get(space["url"]).json()["source"] is None
    form = {"content_type": "application/x-www-form-urlencoded"}
    for action in ("gate", "rollback", "promote"):
        for body, kw in (({"force": "AAA"}, {"format": "json"}), ({"force": 1}, {"format": "json"}),
                         ({"force": None}, {"format": "json"}), ([True], {"format": "json"}),
                         ("force=0", form), ("force=AAA", form), ("force=yes", form)):
            r = admin.post(f"{space['url']}{action}/", body, **kw)
            assert r.status_code == 400, (action, body, r.json())
            assert r.json()["code"] == "invalid" and set(r.json()) == {"message", "code", "extra"}
    assert ran == []  # nothing started by a refused request
    for body, kw in (({"force": True}, {"format": "json"}), ("force=false", form), ("force=True", form),
                     ({}, {"format": "json"})):
        assert admin.post(f"{space['url']}gate/", body, **kw).status_code == 202
    assert ran == [space["id"]] * 4
    # the same kind elsewhere: a boolean is true or false, never 1, "yes" or "on"
    hook = api.post("/api/webhooks/", {"url": "https://example.com/hook"}, format="json").json()
    assert api.patch(f"/api/webhooks/{hook['id']}/", {"active": 1}, format="json").status_code == 400
    assert api.patch(f"/api/webhooks/{hook['id']}/", {"active": False}, format="json").json()["active"] is False
    r = api.post("/api/embeddings/", {"store": "yes", "inputs": [{"text": "a cat"}]}, format="json")
    assert r.status_code == 400 and "store" in r.json()["extra"]["fields"]
