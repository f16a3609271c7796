"""``STORE_OWNER=interactive``: the interactive worker owns the embedded store, and an upload or a
query is embedded, written and searched by one task (``embed_index_interactive``, ``embed_search``)
instead of a chain through the vectors worker. In one process (eager Celery, the edge store, the
random-weights model): the same answers as the chain's, exact ids and scores, and the refusals
pass through; the web sends one message per request."""
from __future__ import annotations

import time

import pytest

from embeddings import dispatch, sink
from embeddings.services.queues import interactive as interactive_queue
from tests.embeddings.conftest import jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sent(monkeypatch):
    """The names of the dispatch functions the web calls, in order."""
    calls: list[str] = []
    for name in ("send_upload", "send_upload_direct", "send_query", "send_embed_search"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name),
                                                                                       _real(*a, **kw))[1])
    return calls


def _search(api, **body) -> list[tuple[str, float]]:
    fmt = "multipart" if "image" in body else "json"
    r = api.post("/api/search/", body, format=fmt)
    assert r.status_code == 200, r.json()
    return [(x["image_id"], round(x["score"], 5)) for x in r.json()["results"]]


def test_one_task_answers_as_the_chain_does(service, api, sent):
    """Uploads, a text search and an image search: with the interactive worker as the store's owner
    each is one message (``send_upload_direct``, ``send_embed_search``), and its answer is the
    chain's: the same neighbours and scores."""
    assert sink.write_target() is sink.WriteTarget.VECTORS_WORKER
    ids = [api.post("/api/images/", {"files": [upload(f"{i}.jpg", jpeg_bytes(700 + i))], "k": 0}, format="multipart")
           .json()["images"][0]["id"] for i in range(4)]
    chain_text = _search(api, text="a red bicycle", k=3)
    chain_image = _search(api, image=upload("q.jpg", jpeg_bytes(701)), k=2)
    assert sent == ["send_upload"] * 4 + ["send_query"] * 2

    service.STORE_OWNER = "interactive"
    assert sink.write_target() is sink.WriteTarget.INTERACTIVE_WORKER and sink.answers_in_one_task()
    sent.clear()
    assert _search(api, text="a red bicycle", k=3) == chain_text
    assert _search(api, image=upload("q.jpg", jpeg_bytes(701)), k=2) == chain_image
    assert chain_image[0][0] == ids[1] and len(chain_text) == 3
    r = api.post("/api/images/", {"files": [upload("n.jpg", jpeg_bytes(710))], "k": 4}, format="multipart")
    assert r.status_code == 200, r.json()
    new = r.json()["images"][0]
    assert new["status"] == "embedded"
    assert sent == ["send_embed_search", "send_embed_search", "send_upload_direct"]
    # the point it wrote is searched like any other, and its neighbours are the store's top-k
    by_id = _search(api, image_id=new["id"], k=5)
    assert by_id[0] == (new["id"], 1.0)
    assert [(n["image_id"], round(n["score"], 5)) for n in new["neighbours"]] == by_id[1:] and len(by_id) == 5


def test_a_refused_query_is_answered_with_its_reason(service, api, sent, monkeypatch):
    """The embedding's refusal passes through the one task as it does through the chain: a query
    past its deadline is a 504 ``deadline_exceeded``, an undecodable query image its 4xx reason."""
    service.STORE_OWNER = "interactive"
    monkeypatch.setattr(interactive_queue, "_query_expired",
                        lambda deadline_ts: {"reason": "expired", "detail": "deadline passed"})
    r = api.post("/api/search/", {"text": "late", "k": 3}, format="json")
    assert r.status_code == 504 and r.json()["code"] == "deadline_exceeded"
    monkeypatch.undo()
    service.STORE_OWNER = "interactive"
    bad = api.post("/api/search/", {"image": upload("bad.jpg", b"\xff\xd8\xff\xe0" + b"\0" * 300), "k": 3},
                   format="multipart")
    assert bad.status_code in (400, 415) and bad.json()["code"] in ("corrupt", "truncated", "not_an_image")


def test_embed_search_refuses_a_query_embedded_after_its_deadline(service, user, monkeypatch):
    """Embedded, but only after the deadline: nobody waits any more, so the store is not asked."""
    from embeddings import runtime, tasks

    service.STORE_OWNER = "interactive"
    searched = []
    monkeypatch.setattr(tasks.vectors_queue, "vector_search", lambda **kw: searched.append(kw))
    deadline = time.time() + 30
    embedded = []
    monkeypatch.setattr(tasks.interactive_queue, "text_embed",
                        lambda **kw: (embedded.append(kw), time.sleep(0.3), {"vector": "AAAA"})[2])
    out = tasks.embed_search.apply(args=("encode_text", ["x"], time.time() + 0.1, runtime.model_id(), None, 3,
                                         None)).get()
    assert out["reason"] == "expired" and searched == [] and embedded[0]["text"] == "x"
    ok = tasks.embed_search.apply(args=("encode_text", ["x"], deadline, runtime.model_id(), None, 3, None)).get()
    assert ok is None and len(searched) == 1  # the search ran (stubbed here)
    with pytest.raises(ValueError, match="embed must be one of"):
        tasks.embed_search.apply(args=("search_point", ["x"], deadline, "m", None, 3, None)).get()
