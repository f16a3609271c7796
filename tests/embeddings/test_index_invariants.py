"""Issue 9, kind 5: deletes, cancels and cascades keep the index whole.

Whatever way a row goes (``DELETE /api/images/{id}/``, the admin's "delete selected", deleting its
job or its owner, a job cancelled while it is queued), afterwards:

- points in the store = distinct embedded bytes among the rows left,
- every embedded or skipped row left is searchable by id (a copy stays searchable while any row
  holds its bytes),
- blob files = the storage keys of the rows left (query images leave nothing behind), and no
  thumbnail or preview outlives every row of its bytes.

The directed tests each show one way; ``test_random_sequences_keep_the_index_whole`` drives a seeded
random mix of them through the API and the admin. Eager Celery runs the real tasks in this process;
bulk chunks are held back (a broker that has not delivered them yet) so jobs can be cancelled or
deleted while their images are queued, and delivered later.
"""
from __future__ import annotations

import random

import pytest
from django.test import Client

from embeddings import runtime, tasks
from embeddings.models import Image, ImageStatus, Job, Lane
from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)

#: Steps of the random sequence (about 0.2 s each here with random ViT-B/32 weights on 2 cores).
STEPS = 60


class Broker:
    """Bulk chunks sent but not yet delivered: ``deliver`` runs them (eagerly) when the test says."""

    def __init__(self, monkeypatch) -> None:
        from embeddings import dispatch

        self.pending: list[tuple] = []
        monkeypatch.setattr(tasks.embed_chunk, "apply_async", lambda args=(), **kw: self.pending.append(args))
        monkeypatch.setattr(dispatch, "send_chunk", lambda *, job_id, image_ids, priority: self.pending.append(
            (job_id, image_ids)))

    def deliver(self, n: int | None = None) -> int:
        """Run the first ``n`` held chunks; ``None``: every held chunk, and those their runs send
        (a copy queued again when its original failed), until none is left. Returns how many ran."""
        ran = 0
        while self.pending:
            take = len(self.pending) if n is None else n
            todo, self.pending = self.pending[:take], self.pending[take:]
            for args in todo:
                tasks.embed_chunk.apply(args=args)
            ran += len(todo)
            if n is not None:
                break
        return ran


def blob_files() -> set[str]:
    """Keys of the content blobs on disk (``blob/<aa>/<bb>/<sha256>``; not thumbnails)."""
    root = runtime.blob_store().root
    return {f"blob/{p.relative_to(root).as_posix()}" for p in root.glob("??/??/*") if len(p.name) == 64}


def check_index(*, searchable: bool = True) -> None:
    """The three invariants (searchability only once nothing is left queued)."""
    live = Image.objects.all()
    embedded = {(m, s): pid for m, s, pid in live.filter(status=ImageStatus.EMBEDDED)
                .values_list("model_id", "sha256", "point_id")}
    store = runtime.vector_store()
    assert store.count() == len(embedded), "points != distinct embedded bytes"
    assert set(store.vectors(list(embedded.values()))) == set(embedded.values())
    keys = set(live.filter(storage_key__startswith="blob/").values_list("storage_key", flat=True))
    assert blob_files() == keys, "blob files != live keys"
    assert not list((runtime.blob_store().root / "tmp").glob("*")), "a query image was left behind"
    thumbs = {p.stem for p in (runtime.blob_store().root / "thumb").glob("*/*.jpg")}
    assert thumbs <= set(live.values_list("sha256", flat=True)), "a thumbnail outlived every row of its bytes"
    previews = {p.name for p in (runtime.blob_store().root / "preview").glob("*/*")}
    assert previews <= set(live.values_list("sha256", flat=True)), "a preview outlived every row of its bytes"
    if not searchable:
        return
    for im in live.filter(status__in=(ImageStatus.EMBEDDED, ImageStatus.SKIPPED)).select_related("owner"):
        r = client_for(im.owner).post("/api/search/", {"image_id": str(im.id), "k": 3}, format="json")
        assert r.status_code == 200, (im.status, r.json())
        assert r.json()["results"][0]["sha256"] == im.sha256 and r.json()["results"][0]["score"] > 0.99


def admin_client(staff) -> Client:
    c = Client()
    c.force_login(staff)
    return c


def admin_delete_selected(staff, model: str, ids) -> None:
    r = admin_client(staff).post(f"/admin/{model}/", {"action": "delete_selected", "post": "yes",
                                                       "_selected_action": [str(i) for i in ids]})
    assert r.status_code == 302, r.content[:500]


# --- one way at a time ---------------------------------------------------------------------------

def test_deleting_the_original_keeps_its_copy_searchable(service, api):
    data = jpeg_bytes(800)
    a = api.post("/api/images/", {"files": [upload("a.jpg", data)]}, format="multipart").json()["images"][0]
    b = api.post("/api/images/", {"files": [upload("b.jpg", data)]}, format="multipart").json()["images"][0]
    assert (a["status"], b["status"]) == ("embedded", "skipped")
    assert api.delete(f"/api/images/{a['id']}/").status_code == 204
    r = api.post("/api/search/", {"image_id": b["id"], "k": 1}, format="json")
    assert r.status_code == 200, r.json()
    assert [h["image_id"] for h in r.json()["results"]] == [b["id"]]  # b holds the point now
    got = api.get(f"/api/images/{b['id']}/").json()
    assert (got["status"], got["width"], got["height"]) == ("embedded", a["width"], a["height"])
    check_index()
    assert api.delete(f"/api/images/{b['id']}/").status_code == 204
    check_index()
    assert runtime.vector_store().count() == 0


def test_cancelling_the_originals_job_while_it_is_queued_keeps_the_copy_searchable(service, api, monkeypatch):
    broker = Broker(monkeypatch)
    data = jpeg_bytes(801)
    job = api.post("/api/jobs/", {"files": [upload("a.jpg", data), upload("a-in-job.jpg", data)]},
                   format="multipart").json()
    a, in_job = Image.objects.filter(job_id=job["id"]).order_by("created_at")
    b = api.post("/api/images/", {"files": [upload("b.jpg", data)]}, format="multipart").json()["images"][0]
    assert (a.status, in_job.status, b["status"]) == ("queued", "skipped", "skipped")
    assert api.post("/api/search/", {"image_id": b["id"]}, format="json").json()["code"] == "not_embedded"
    assert api.post(f"/api/jobs/{job['id']}/cancel/").status_code == 200
    in_job.refresh_from_db()
    assert in_job.status == ImageStatus.CANCELLED  # the job's own copy goes with it
    broker.deliver()  # the cancelled chunk does nothing; b was queued again in a job of its own
    r = api.post("/api/search/", {"image_id": b["id"], "k": 1}, format="json")
    assert r.status_code == 200, r.json()
    assert [h["image_id"] for h in r.json()["results"]] == [b["id"]]
    assert Image.objects.get(id=b["id"]).job.name == "re-queued copies"
    check_index()


def test_copies_queued_again_share_one_open_job(service, api, monkeypatch):
    broker = Broker(monkeypatch)
    jobs, copies = [], []
    for i in range(2):
        data = jpeg_bytes(804 + i)
        jobs.append(api.post("/api/jobs/", {"files": [upload("a.jpg", data)]}, format="multipart").json()["id"])
        copies.append(api.post("/api/images/", {"files": [upload("b.jpg", data)]}, format="multipart")
                      .json()["images"][0]["id"])
    for job_id in jobs:
        assert api.post(f"/api/jobs/{job_id}/cancel/").status_code == 200
    requeued = Job.objects.get(name="re-queued copies")
    assert requeued.total == 2 and set(requeued.images.values_list("status", flat=True)) == {"queued"}
    broker.deliver()
    assert Job.objects.get(id=requeued.id).status == "done"
    check_index()


def test_a_missing_point_is_a_409_with_a_code_not_a_timeout(service, api):
    im = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(802))]}, format="multipart").json()["images"][0]
    runtime.vector_store().delete([Image.objects.get(id=im["id"]).point_id])  # lost behind the service's back
    r = api.post("/api/search/", {"image_id": im["id"]}, format="json")
    assert (r.status_code, r.json()["code"]) == (409, "vector_missing")


def test_admin_bulk_delete_and_cascades_from_jobs_and_users_remove_points_and_blobs(
        service, api, user, other_user, staff):
    bob = client_for(other_user)
    mine = [api.post("/api/images/", {"files": [upload(f"{i}.jpg", jpeg_bytes(810 + i))]}, format="multipart")
            .json()["images"][0]["id"] for i in range(3)]
    job = api.post("/api/jobs/", {"files": [upload("j1.jpg", jpeg_bytes(820)), upload("j2.jpg", jpeg_bytes(821))]},
                   format="multipart").json()
    bobs = bob.post("/api/images/", {"files": [upload("b.jpg", jpeg_bytes(830)), upload("shared.jpg", jpeg_bytes(810))]},
                    format="multipart").json()["images"]
    assert runtime.vector_store().count() == 6  # 3 + 2 + 1 (bob's shared.jpg shares mine[0]'s point)
    check_index()
    admin_delete_selected(staff, "embeddings/image", mine[1:])
    assert runtime.vector_store().count() == 4
    check_index()
    r = admin_client(staff).post(f"/admin/embeddings/job/{job['id']}/delete/", {"post": "yes"})
    assert r.status_code == 302 and not Job.objects.filter(id=job["id"]).exists()
    assert runtime.vector_store().count() == 2
    check_index()
    admin_delete_selected(staff, "auth/user", [user.id])  # alice and everything she had
    assert runtime.vector_store().count() == 2  # bob's two images; the shared point now lists bob only
    check_index()
    assert {str(i) for i in Image.objects.values_list("id", flat=True)} == {im["id"] for im in bobs}


def test_query_images_leave_no_blob_behind(service, api):
    api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(840))]}, format="multipart")
    before = blob_files()
    for i in range(5):
        r = api.post("/api/search/", {"image": upload("q.jpg", jpeg_bytes(850 + i)), "k": 1}, format="multipart")
        assert r.status_code == 200, r.json()
    same = api.post("/api/search/", {"image": upload("q.jpg", jpeg_bytes(840)), "k": 1}, format="multipart")
    assert same.status_code == 200 and same.json()["results"][0]["score"] > 0.99
    assert blob_files() == before  # the stored image's own blob is untouched
    check_index()


# --- all of them, in random order ------------------------------------------------------------------

@pytest.mark.parametrize("seed", [9, 12])
def test_random_sequences_keep_the_index_whole(seed, service, user, other_user, staff, monkeypatch):
    """STEPS seeded random steps: uploads (new bytes, and bytes some row already holds, also another
    owner's), bulk jobs, deliveries of held chunks, deletes through the API and the admin, job
    cancels, job deletes and one user delete; the invariants are checked after every step, and
    searchability of every embedded or skipped row once all chunks are delivered."""
    broker = Broker(monkeypatch)
    rng = random.Random(seed)
    variants = [jpeg_bytes(900 + i) for i in range(6)]  # few byte strings: duplicates are common
    owners = [user, other_user]
    seen = []

    def step_upload():
        owner = rng.choice(owners)
        files = [upload(f"{n}.jpg", variants[rng.randrange(len(variants))]) for n in range(rng.randint(1, 3))]
        r = client_for(owner).post("/api/images/", {"files": files, "k": 2}, format="multipart")
        assert r.status_code == 200, r.json()

    def step_job():
        owner = rng.choice(owners)
        files = [upload(f"{n}.jpg", variants[rng.randrange(len(variants))]) for n in range(rng.randint(1, 4))]
        assert client_for(owner).post("/api/jobs/", {"files": files}, format="multipart").status_code == 202

    def step_deliver():
        broker.deliver(1)

    def step_delete():
        im = Image.objects.filter(owner__in=owners).order_by("?").first()
        if im is not None:
            assert client_for(im.owner).delete(f"/api/images/{im.id}/").status_code == 204

    def step_admin_delete():
        ids = list(Image.objects.order_by("?").values_list("id", flat=True)[:2])
        if ids:
            admin_delete_selected(staff, "embeddings/image", ids)

    def step_cancel():
        job = Job.objects.filter(owner__in=owners, status__in=("queued", "running")).order_by("?").first()
        if job is not None:
            assert client_for(job.owner).post(f"/api/jobs/{job.id}/cancel/").status_code == 200

    def step_job_delete():
        job = Job.objects.order_by("?").first()
        if job is not None:
            assert admin_client(staff).post(f"/admin/embeddings/job/{job.id}/delete/", {"post": "yes"}).status_code == 302

    def step_user_delete():
        if len(owners) == 2 and len(seen) > 25:
            admin_delete_selected(staff, "auth/user", [owners.pop(rng.randrange(2)).id])

    steps = [step_upload] * 4 + [step_job] * 3 + [step_deliver] * 3 + [step_delete] * 2 + [
        step_admin_delete, step_cancel, step_cancel, step_job_delete, step_user_delete]
    for _ in range(STEPS):
        step = rng.choice(steps)
        step()
        seen.append(step.__name__)
        check_index(searchable=False)
    broker.deliver()
    check_index()
    assert Image.objects.filter(status=ImageStatus.QUEUED).count() == 0
    assert {"step_upload", "step_job", "step_cancel", "step_delete"} <= set(seen)


def test_an_expired_original_takes_its_own_requests_copies_and_another_copy_takes_its_place(
        service, api, user, monkeypatch):
    """The reconciler expires an interactive original that no worker holds: the copy uploaded in the
    same request expires with it; a copy uploaded later is queued again and becomes searchable."""
    from embeddings.services.catalogue import images as image_services
    from tests.embeddings.services.catalogue.test_images import src

    broker = Broker(monkeypatch)
    data = jpeg_bytes(860)
    a, same_request = image_services.images_create(owner=user, lane=Lane.INTERACTIVE,
                                                   sources=[src("a.jpg", data), src("a2.jpg", data)])
    later = api.post("/api/images/", {"files": [upload("b.jpg", data)]}, format="multipart").json()["images"][0]
    assert (a.status, same_request.status, later["status"]) == ("queued", "skipped", "skipped")
    image_services.images_mark_failed([(str(a.id), "expired", "its deadline passed and no worker holds it")])
    same_request.refresh_from_db()
    assert (same_request.status, same_request.reason) == (ImageStatus.EXPIRED, "expired")
    assert Image.objects.get(id=later["id"]).status == ImageStatus.QUEUED
    assert broker.deliver() == 1
    r = api.post("/api/search/", {"image_id": later["id"], "k": 1}, format="json")
    assert r.status_code == 200 and [h["image_id"] for h in r.json()["results"]] == [later["id"]]
    check_index()
