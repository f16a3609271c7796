"""``/api/images/`` end to end in one process (eager Celery, embedded Qdrant, random-weights model):
interactive uploads and their neighbours, refusals, deadlines and limits, owners, deletion; and every
odd file of the shared set through the interactive lane: files that must decode are embedded with
their upright size, files that must be refused fail with the same stable reason code as the decode
stage, and a single refused file answers its 4xx."""
from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings.models import Image, ImageStatus
from embeddings.services.interactive.waiting import REASON_STATUS
from tests.conftest import IMAGES, needs_shared
from tests.embeddings.conftest import client_for, jpeg_bytes, upload
from tests.workers.test_decode_manifest import ODD_EXPECTED, Decodes, Refused

pytestmark = pytest.mark.django_db(transaction=True)


def test_interactive_upload_embeds_and_returns_neighbours(service, api):
    r1 = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1))]}, format="multipart")
    assert r1.status_code == 200, r1.json()
    a = r1.json()["images"][0]
    assert a["status"] == "embedded" and (a["width"], a["height"]) == (260, 200) and a["neighbours"] == []
    r2 = api.post("/api/images/", {"files": [upload("b.jpg", jpeg_bytes(2)), upload("c.jpg", jpeg_bytes(3))], "k": 5},
                  format="multipart")
    assert r2.status_code == 200
    b, c = r2.json()["images"]
    assert {b["status"], c["status"]} == {"embedded"}
    # b's neighbours: a (indexed before) and c (indexed in the same request), never b itself
    assert {n["image_id"] for n in b["neighbours"]} == {a["id"], c["id"]}
    assert Image.objects.filter(status=ImageStatus.EMBEDDED).count() == 3


def test_upload_with_k_0_embeds_without_neighbours(service, api):
    first = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(10))]}, format="multipart")
    assert first.status_code == 200
    r = api.post("/api/images/", {"files": [upload("b.jpg", jpeg_bytes(11)), upload("a2.jpg", jpeg_bytes(10))],
                                  "k": 0}, format="multipart")
    assert r.status_code == 200, r.json()
    b, again = r.json()["images"]
    assert (b["status"], again["status"]) == ("embedded", "skipped")  # embedded (or shared), nothing searched
    assert b["neighbours"] == [] and again["neighbours"] == []
    assert Image.objects.get(id=b["id"]).status == ImageStatus.EMBEDDED


def test_same_bytes_again_are_skipped_and_share_the_point(service, api):
    data = jpeg_bytes(4)
    first = api.post("/api/images/", {"files": [upload("x.jpg", data)]}, format="multipart").json()["images"][0]
    again = api.post("/api/images/", {"files": [upload("y.jpg", data)]}, format="multipart").json()["images"][0]
    assert again["status"] == "skipped"
    im = Image.objects.get(id=again["id"])
    assert str(im.duplicate_of_id) == first["id"] and im.point_id == Image.objects.get(id=first["id"]).point_id


def test_bad_file_in_a_request_fails_alone(service, api):
    r = api.post("/api/images/", {"files": [upload("ok.jpg", jpeg_bytes(5)), upload("bad.jpg", b"not an image")]},
                 format="multipart")
    assert r.status_code == 200
    ok, bad = r.json()["images"]
    assert ok["status"] == "embedded"
    assert (bad["status"], bad["reason"]) == ("failed", "not_an_image")


@pytest.mark.parametrize("data,status,reason", [
    (b"", 400, "empty"),
    (b"%PDF-1.4 not an image", 415, "not_an_image"),
])
def test_single_refused_file_answers_4xx_with_reason(service, api, data, status, reason):
    r = api.post("/api/images/", {"files": [upload("f.jpg", data)]}, format="multipart")
    assert r.status_code == status
    assert r.json()["images"][0]["reason"] == reason


def test_deadline_may_shorten_but_not_lengthen(service, api):
    r = api.post("/api/images/", {"files": [upload("d.jpg", jpeg_bytes(6))], "deadline": 60}, format="multipart")
    assert r.json()["deadline_s"] == service.INTERACTIVE_DEADLINE_S
    r = api.post("/api/images/", {"files": [upload("e.jpg", jpeg_bytes(7))], "deadline": 0}, format="multipart")
    assert r.status_code == 400 and r.json()["code"] == "invalid_deadline"


def test_too_many_files_names_the_limit(service, api):
    files = [upload(f"{i}.jpg", jpeg_bytes(i)) for i in range(service.INTERACTIVE_MAX_FILES + 1)]
    r = api.post("/api/images/", {"files": files}, format="multipart")
    assert r.status_code == 400 and r.json()["extra"]["limit"] == "INTERACTIVE_MAX_FILES"
    assert r.json()["extra"]["value"] == service.INTERACTIVE_MAX_FILES  # the limit, and what was sent
    assert r.json()["extra"]["files"] == service.INTERACTIVE_MAX_FILES + 1


def test_owners_only_see_their_own_images(service, api, other_user, staff):
    mine = api.post("/api/images/", {"files": [upload("m.jpg", jpeg_bytes(400))]}, format="multipart").json()["images"][0]
    bob = client_for(other_user)
    theirs = bob.post("/api/images/", {"files": [upload("t.jpg", jpeg_bytes(401))]}, format="multipart").json()["images"][0]
    assert theirs["neighbours"] == []  # alice's image is not bob's neighbour
    assert bob.get(f"/api/images/{mine['id']}/").status_code == 404
    assert bob.delete(f"/api/images/{mine['id']}/").status_code == 404
    assert bob.post("/api/search/", {"image_id": mine["id"]}, format="json").status_code == 404
    found = bob.post("/api/search/", {"text": "anything", "k": 10}, format="json").json()["results"]
    assert [r["image_id"] for r in found] == [theirs["id"]]
    everything = client_for(staff).post("/api/search/", {"text": "anything", "k": 10}, format="json").json()["results"]
    assert {r["image_id"] for r in everything} == {mine["id"], theirs["id"]}


def test_delete_removes_the_vector(service, api):
    from embeddings import runtime

    im = api.post("/api/images/", {"files": [upload("d.jpg", jpeg_bytes(500))]}, format="multipart").json()["images"][0]
    assert runtime.vector_store().count() == 1
    assert api.delete(f"/api/images/{im['id']}/").status_code == 204
    assert runtime.vector_store().count() == 0
    assert api.get(f"/api/images/{im['id']}/").status_code == 404


def test_patch_merges_metadata_and_the_filtered_search_follows(service, api):
    """``PATCH {"metadata": {"category": "hats"}}`` changes one key (JSON Merge Patch, RFC 7396):
    ``price`` and ``launched`` stay, in the row, the answer, the payload and a filtered search."""
    from embeddings import runtime

    meta = '{"category": "shoes", "price": 49.5, "launched": "2024-05-01", "size": {"eu": 42, "us": 9}}'
    im = api.post("/api/images/", {"files": [upload("m.jpg", jpeg_bytes(600))], "metadata": [meta]},
                  format="multipart").json()["images"][0]
    url = f"/api/images/{im['id']}/"
    r = api.patch(url, {"metadata": {"category": "hats"}}, format="json")
    assert r.status_code == 200, r.json()
    kept = {"category": "hats", "price": 49.5, "launched": "2024-05-01", "size": {"eu": 42, "us": 9}}
    assert r.json()["metadata"] == kept and api.get(url).json()["metadata"] == kept
    pid = Image.objects.get(id=im["id"]).point_id
    assert runtime.vector_store().payloads([pid])[pid]["items"][0]["m"] == kept
    found = api.post("/api/search/", {"text": "a photo", "k": 5, "min_score": -1,
                                      "filter": {"and": [{"field": "category", "eq": "hats"},
                                                         {"field": "price", "gte": 40}]}}, format="json")
    assert [(h["image_id"], h["metadata"]) for h in found.json()["results"]] == [(im["id"], kept)]
    r = api.patch(url, {"metadata": {"price": None, "size": {"us": None}}}, format="json")
    assert r.json()["metadata"] == {"category": "hats", "launched": "2024-05-01", "size": {"eu": 42}}
    assert api.patch(url, {"metadata": None}, format="json").json()["metadata"] == {}  # null: every key goes
    refused = api.patch(url, {"metadata": "hats"}, format="json")
    assert (refused.status_code, refused.json()["code"]) == (400, "metadata_invalid")


# --- the shared set's odd files -------------------------------------------------------------------

ROWS = sorted(ODD_EXPECTED)
GROUPS = [ROWS[i : i + 8] for i in range(0, len(ROWS), 8)]


def _post(api, paths):
    files = [SimpleUploadedFile(p.split("/")[-1], (IMAGES / p).read_bytes()) for p in paths]
    return api.post("/api/images/", {"files": files, "k": 1}, format="multipart")


@needs_shared
@pytest.mark.parametrize("group", GROUPS, ids=[g[0].split("/")[-1][:30] for g in GROUPS])
def test_manifest_rows_through_the_api(service, api, group):
    service.INTERACTIVE_DEADLINE_S = 300  # correctness, not latency: never expire on a busy machine
    r = _post(api, group)
    assert r.status_code in (200, 400, 413, 415), r.content[:300]
    results = r.json()["images"]
    assert [im["original_name"] for im in results] == [p.split("/")[-1] for p in group]
    for path, im in zip(group, results):
        want = ODD_EXPECTED[path]
        if isinstance(want, Decodes):
            assert im["status"] in ("embedded", "skipped"), (path, im)
            assert (im["width"], im["height"]) == want.size, path
        else:
            assert isinstance(want, Refused)
            assert (im["status"], im["reason"]) == ("failed", want.reason.value), (path, im)


@needs_shared
@pytest.mark.parametrize("path", [p for p in ROWS if isinstance(ODD_EXPECTED[p], Refused)])
def test_single_refused_file_answers_its_status(service, api, path):
    service.INTERACTIVE_DEADLINE_S = 300
    reason = ODD_EXPECTED[path].reason.value
    r = _post(api, [path])
    assert r.status_code == REASON_STATUS[reason], (path, r.json())
    assert r.json()["images"][0]["reason"] == reason
