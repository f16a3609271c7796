"""Server mode without a funnel (issue 11, item 3): with a Qdrant server every embedding worker
upserts its own points and the web process searches, counts and deletes through its own
connection; embedded mode keeps the vectors worker as the one owner.

The routing is tested for real without a server: the ``server`` write target with qdrant-client's
in-memory engine (``QdrantClient(":memory:")``, the same client code and collection as a server)
standing in for the store of every process. ``test_against_a_real_qdrant_server`` runs the same
flow against ``QDRANT_URL`` when one answers (docs/operations.md, "Server mode"), and is skipped
otherwise: no Qdrant server can be installed on these machines.
"""
from __future__ import annotations

import functools
import os
import uuid

import httpx
import pytest

from embeddings import runtime, tasks
from embeddings.models import BatchStat, Image, ImageStatus, Job, JobStatus
from embeddings.services.catalogue import jobs as job_services
from embeddings import sink
from embeddings.services.interactive.search import search
from embeddings.services.interactive.upload import images_upload
from tests.embeddings.services.test_reconcile import sources
from workers.model_config import embed_dim

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sent(monkeypatch):
    """Messages to the vector store's owner, captured instead of run: ``{task name: [args, ...]}``."""
    out: dict[str, list] = {}
    for task in (tasks.index_chunk, tasks.index_interactive, tasks.search_vector, tasks.search_point,
                 tasks.forget_point, tasks.collection_stats):
        monkeypatch.setattr(task, "apply_async",
                            lambda args=(), task=task, **kw: out.setdefault(task.name, []).append(args))
    return out


def server_store(url: str | None = None):
    """The collection of this embedding space on qdrant-client: in memory, or on a server at ``url``."""
    from django.conf import settings
    from qdrant_client import QdrantClient

    from workers.vector_store.client import QdrantClientStore

    cfg = settings.PIPELINE
    collection = cfg.collection_name if url is None else f"test-{uuid.uuid4().hex[:12]}"
    store = QdrantClientStore(QdrantClient(url=url) if url else QdrantClient(":memory:"), collection,
                              embed_dim(cfg.model_name))
    store.ensure_collection()
    return store


@pytest.fixture
def server_mode(service, monkeypatch):
    """``VECTOR_STORE=server`` with an in-memory qdrant-client store as every process's server."""
    service.VECTOR_STORE, service.VECTORS_WRITE_SLICE = "server", 64
    store = server_store()
    monkeypatch.setattr(runtime, "vector_store", functools.cache(lambda model_id=None: store))  # conftest clears and closes it
    return store


def test_the_write_target_is_chosen_from_the_backend(settings):
    for kind, target in (("server", sink.WriteTarget.DIRECT), ("edge", sink.WriteTarget.VECTORS_WORKER),
                         ("local", sink.WriteTarget.VECTORS_WORKER)):
        settings.VECTOR_STORE = kind
        assert sink.write_target() is target


def test_server_mode_bulk_worker_writes_its_own_points_and_sends_no_index_message(server_mode, user, sent):
    job = job_services.job_create(owner=user, sources=sources(5))  # eager: its chunk runs here
    assert sent == {}  # no index_chunk (no vectors through Redis), nothing for a vectors worker
    assert Job.objects.get(id=job.id).status == JobStatus.DONE
    rows = list(Image.objects.filter(job=job).values_list("status", "reason", "point_id"))
    assert [(s, r) for s, r, _ in rows] == [(ImageStatus.EMBEDDED, "")] * 5
    assert server_mode.count() == 5
    payloads = server_mode.payloads([pid for *_, pid in rows])
    assert {p["owner_ids"][0] for p in payloads.values()} == {user.id}
    assert {p["job_ids"][0] for p in payloads.values()} == {str(job.id)}


def test_embedded_mode_hands_the_chunk_to_the_vectors_worker(service, user, sent, monkeypatch):
    def no_store():
        raise AssertionError("an embedding worker opened the embedded store")

    monkeypatch.setattr(runtime, "vector_store", functools.cache(no_store))
    job = job_services.job_create(owner=user, sources=sources(5))
    (job_id, stat_id, items), = sent["embeddings.tasks.index_chunk"]
    assert (job_id, len(items), sorted(sent)) == (str(job.id), 5, ["embeddings.tasks.index_chunk"])
    assert BatchStat.objects.filter(id=stat_id, job_id=job.id, images=5).count() == 1
    assert {len(it["vector"]) for it in items} == {2732}  # 512 float32 as base64: what crosses Redis
    assert set(Image.objects.filter(job=job).values_list("status", "reason")) == {
        (ImageStatus.QUEUED, "waiting_for_store")}


def test_server_mode_web_searches_counts_and_deletes_through_its_own_connection(server_mode, user, sent):
    job = job_services.job_create(owner=user, sources=sources(4))
    first = Image.objects.filter(job=job).order_by("created_at").first()

    by_text = search(user=user, k=3, text="a photo")  # embedded on the interactive lane, searched here
    by_id = search(user=user, k=4, image_id=str(first.id), job_id=str(job.id))
    assert (len(by_text), len(by_id)) == (3, 4)
    assert by_id[0]["image_id"] == str(first.id) and by_id[0]["score"] == pytest.approx(1.0, abs=1e-5)
    stats = sink.store_call("collection_stats", runtime.model_id())
    assert stats == {"collection": server_mode.collection, "points": 4}

    from embeddings.services.catalogue.images import image_delete

    image_delete(image=first)
    assert server_mode.count() == 3 and server_mode.vectors([first.point_id]) == {}
    assert sent == {}  # every store call above ran in this process, none went to a vectors queue


def test_server_mode_interactive_worker_writes_its_points_and_answers_neighbours(server_mode, user, sent):
    job_services.job_create(owner=user, sources=sources(3))
    out = images_upload(owner=user, sources=sources(2, seed=10), deadline_s=30.0, k=2)
    assert out.status == 200 and sent == {}
    assert [(v["status"], len(v["neighbours"])) for v in out.images] == [(ImageStatus.EMBEDDED, 2)] * 2
    assert server_mode.count() == 5
    again = images_upload(owner=user, sources=sources(1, seed=10), deadline_s=30.0, k=2)  # a copy: searched here
    assert [(v["status"], len(v["neighbours"])) for v in again.images] == [(ImageStatus.SKIPPED, 2)]


def _qdrant_url() -> str | None:
    url = os.environ.get("QDRANT_URL", "")
    if not url:
        return None
    try:
        return url if httpx.get(f"{url.rstrip('/')}/readyz", timeout=2.0).status_code == 200 else None
    except httpx.HTTPError:
        return None


def test_against_a_real_qdrant_server(service, user, sent, monkeypatch):
    url = _qdrant_url()
    if url is None:
        pytest.skip("no Qdrant server answers at QDRANT_URL (docs/operations.md, 'Server mode': how to run this)")
    service.VECTOR_STORE, service.QDRANT_URL = "server", url
    store = server_store(url)
    monkeypatch.setattr(runtime, "vector_store", functools.cache(lambda model_id=None: store))
    try:
        job = job_services.job_create(owner=user, sources=sources(6))
        assert sent == {} and store.count() == 6
        assert Job.objects.get(id=job.id).status == JobStatus.DONE
        assert len(search(user=user, k=6, text="a photo", job_id=str(job.id))) == 6
    finally:
        store.client.delete_collection(store.collection)
