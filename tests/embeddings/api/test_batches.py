"""``/v1/files`` and ``/v1/batches`` in one process (eager Celery, embedded Qdrant, the
random-weights ViT-B-32): OpenAI's shapes, exact counts (output + errors = total, every line in
exactly one file), vectors equal to ``POST /v1/embeddings``', owner isolation, the limits, file-level
validation, cancel and expiry part way (parts run by hand), webhook events in OpenAI's body."""
from __future__ import annotations

import base64
import datetime as dt
import json

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone
from rest_framework.test import APIClient

from embeddings import dispatch
from embeddings.models import Batch, BatchFile, BatchPart, Job, JobKind, WebhookDelivery, WebhookEndpoint
from embeddings.services.batches import batches as batch_services
from embeddings.services.batches import parts as batch_parts
from tests.embeddings.conftest import client_for
from tests.origin_server import pixels_jpeg

pytestmark = pytest.mark.django_db(transaction=True)


def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def line(cid: str, inputs, model: str = "ViT-B-32", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": model, "input": inputs, **body}}


def jsonl(lines) -> bytes:
    """Lines as a file: a dict as one JSON line, text or bytes as they are."""
    out = b""
    for x in lines:
        out += (json.dumps(x) + "\n").encode() if isinstance(x, dict) else x.encode() if isinstance(x, str) else x
    return out


def upload(api, content: bytes, purpose: str = "batch", name: str = "in.jsonl"):
    return api.post("/v1/files", {"file": SimpleUploadedFile(name, content, content_type="application/jsonl"),
                                  "purpose": purpose}, format="multipart")


def create(api, file_id: str, window: str = "24h", **more):
    return api.post("/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                    "completion_window": window, **more}, format="json")


def content(api, file_id: str) -> list[dict]:
    r = api.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200, r
    return [json.loads(x) for x in b"".join(r.streaming_content).splitlines() if x.strip()]


def vec(e) -> np.ndarray:
    return np.frombuffer(base64.b64decode(e), "<f4") if isinstance(e, str) else np.asarray(e, np.float32)


def openai_error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.content
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    return body["error"]


# --- files -------------------------------------------------------------------------------------------

def test_files_upload_list_get_content_delete_in_openais_shapes(service, api, user, other_user):
    data = jsonl([line("a", "a cat"), "\n", line("b", ["a dog", "a bird"])])
    r = upload(api, data)
    assert r.status_code == 200, r.content
    f = r.json()
    assert f["id"].startswith("file-") and f["object"] == "file" and f["purpose"] == "batch"
    assert f["bytes"] == len(data) and f["filename"] == "in.jsonl" and isinstance(f["created_at"], int)
    assert BatchFile.objects.get(id=f["id"]).lines == 2  # the blank line is not a request
    second = upload(api, jsonl([line("c", "x")])).json()
    listed = api.get("/v1/files").json()
    assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == [second["id"], f["id"]]
    page = api.get("/v1/files", {"limit": 1}).json()
    assert [x["id"] for x in page["data"]] == [second["id"]] and page["has_more"] is True
    rest = api.get("/v1/files", {"limit": 1, "after": page["last_id"]}).json()
    assert [x["id"] for x in rest["data"]] == [f["id"]] and rest["has_more"] is False
    assert api.get(f"/v1/files/{f['id']}").json() == f
    r = api.get(f"/v1/files/{f['id']}/content", HTTP_ACCEPT="application/binary")  # what OpenAI's client sends
    assert r.status_code == 200 and b"".join(r.streaming_content) == data
    # another owner sees nothing of it
    other = client_for(other_user)
    assert other.get("/v1/files").json()["data"] == []
    for method, url in (("get", f"/v1/files/{f['id']}"), ("get", f"/v1/files/{f['id']}/content"),
                        ("delete", f"/v1/files/{f['id']}")):
        openai_error(getattr(other, method)(url), 404, "not_found")
    openai_error(other.post("/v1/batches", {"input_file_id": f["id"], "endpoint": "/v1/embeddings",
                                            "completion_window": "24h"}, format="json"), 404, "not_found")
    # delete: the row and (nothing else naming it) the blob
    key = BatchFile.objects.get(id=f["id"]).storage_key
    r = api.delete(f"/v1/files/{f['id']}")
    assert r.json() == {"id": f["id"], "object": "file", "deleted": True}
    openai_error(api.get(f"/v1/files/{f['id']}"), 404, "not_found")
    from embeddings import runtime
    assert not runtime.blob_store().exists(key)
    openai_error(api.get("/v1/files", {"after": f["id"]}), 404, "not_found")


def test_files_limits_and_refusals(service, api, settings):
    settings.BATCH_MAX_LINES = 3
    openai_error(upload(api, jsonl([line(str(i), "x") for i in range(4)])), 400, "too_many_lines")
    assert upload(api, jsonl([line(str(i), "x") for i in range(3)])).status_code == 200
    settings.BATCH_MAX_FILE_BYTES = 100
    err = openai_error(upload(api, b"x" * 101 + b"\n"), 413, "file_too_large")
    assert err["param"] == "file" and err["type"] == "invalid_request_error"
    settings.BATCH_MAX_FILE_BYTES = 1 << 20
    openai_error(upload(api, b"\n  \n"), 400, "empty_file")
    openai_error(upload(api, b'{"a": 1}\n', purpose="fine-tune"), 400, "invalid_purpose")
    openai_error(api.post("/v1/files", {"purpose": "batch"}, format="multipart"), 400, "invalid_input")
    openai_error(api.post("/v1/files", {"file": "x"}, format="json"), 415, "unsupported_media_type")
    openai_error(api.get("/v1/files", {"limit": 0}), 400, "invalid_limit")
    assert BatchFile.objects.count() == 1
    openai_error(APIClient().get("/v1/files"), 401, "not_authenticated")


# --- batches ----------------------------------------------------------------------------------------

def test_a_batch_runs_on_the_bulk_lane_with_exact_counts_and_the_vectors_of_v1_embeddings(service, api):
    a, b = pixels_jpeg(5601), pixels_jpeg(5602)
    lines = [line("texts", ["a photo of a cat", "a photo of a dog"]),
             line("image", data_url(a), encoding_format="base64"),
             line("mixed", ["a red shoe", data_url(b)]),
             line("bad-image", ["a cat", "data:text/plain;base64,aGVsbG8="]),
             line("bad-dims", "a cat", dimensions=128),
             line("no-input", None)]
    lines[-1]["body"].pop("input")
    f = upload(api, jsonl(lines)).json()
    r = create(api, f["id"], metadata={"team": "search"})
    assert r.status_code == 200, r.content
    created = r.json()
    assert created["object"] == "batch" and created["id"].startswith("batch_")
    assert created["metadata"] == {"team": "search"} and created["input_file_id"] == f["id"]
    assert created["expires_at"] - created["created_at"] == 24 * 3600
    got = api.get(f"/v1/batches/{created['id']}").json()  # eager Celery: validated, run and finalised already
    assert got["status"] == "completed", got
    assert got["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert isinstance(got[stamp], int)
    assert got["failed_at"] is None and got["cancelled_at"] is None and got["errors"] is None
    out, err = content(api, got["output_file_id"]), content(api, got["error_file_id"])
    assert [x["custom_id"] for x in out] == ["texts", "image", "mixed"]
    assert sorted(x["custom_id"] for x in err) == ["bad-dims", "bad-image", "no-input"]
    assert len(out) + len(err) == 6 and len({x["id"] for x in out + err}) == 6
    codes = {x["custom_id"]: (x["response"]["status_code"], x["response"]["body"]["error"]["code"]) for x in err}
    assert codes == {"bad-image": (400, "not_an_image"), "bad-dims": (400, "invalid_dimensions"),
                     "no-input": (400, "invalid_input")}
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in out)
    # the same vectors as POST /v1/embeddings for the same inputs
    for x, inputs in zip(out, (lines[0]["body"]["input"], [lines[1]["body"]["input"]], lines[2]["body"]["input"])):
        ref = api.post("/v1/embeddings", {"model": "ViT-B-32", "input": inputs}, format="json")
        assert ref.status_code == 200, ref.content
        body = x["response"]["body"]
        assert body["object"] == "list" and body["model"] == ref.json()["model"]
        assert body["usage"] == ref.json()["usage"]
        for mine, theirs in zip(body["data"], ref.json()["data"]):
            assert float(vec(mine["embedding"]) @ vec(theirs["embedding"])) == pytest.approx(1.0, abs=1e-5)
    assert isinstance(out[1]["response"]["body"]["data"][0]["embedding"], str)  # base64 asked
    # a batch is a bulk job, done; nothing of it went to the interactive lane
    job = Batch.objects.get(id=got["id"]).job
    assert job.kind == JobKind.BATCH and job.status == "done" and job.total == 6
    assert job.deadline == Batch.objects.get(id=got["id"]).expires_at
    # listed, newest first, owner-isolated
    listed = api.get("/v1/batches").json()
    assert [x["id"] for x in listed["data"]] == [got["id"]] and listed["has_more"] is False


def test_every_line_failing_gives_only_an_error_file(service, api):
    f = upload(api, jsonl([line("a", "data:text/plain;base64,aGVsbG8="), line("b", []), line("c", [1, 2])])).json()
    got = create(api, f["id"]).json()
    got = api.get(f"/v1/batches/{got['id']}").json()
    assert got["status"] == "completed" and got["output_file_id"] is None
    assert got["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    err = content(api, got["error_file_id"])
    assert [(x["custom_id"], x["response"]["status_code"], x["response"]["body"]["error"]["code"]) for x in err] == \
        [("a", 400, "not_an_image"), ("b", 400, "no_inputs"), ("c", 400, "invalid_input")]
    # one model the service does not know: every line a 404, as /v1/embeddings answers
    f = upload(api, jsonl([line("a", "x", model="no-such-model")])).json()
    got = api.get(f"/v1/batches/{create(api, f['id']).json()['id']}").json()
    (x,) = content(api, got["error_file_id"])
    assert (x["response"]["status_code"], x["response"]["body"]["error"]["type"]) == (404, "not_found_error")


@pytest.mark.parametrize("lines,code,number", [
    ([b"not json\n"], "invalid_json_line", 1),
    ([line("a", "x"), b"[1, 2]\n"], "invalid_line", 2),
    ([line("a", "x"), line("a", "y")], "duplicate_custom_id", 2),
    ([line("a", "x"), {**line("b", "x"), "url": "/v1/chat/completions"}], "mismatched_endpoint", 2),
    ([{**line("a", "x"), "method": "GET"}], "invalid_method", 1),
    ([{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": "x"}], "invalid_body", 1),
    ([{**line("a", "x"), "custom_id": 7}], "missing_custom_id", 1),
    ([line("a", "x"), line("b", "y", model="ViT-B-16")], "mismatched_model", None),
])
def test_a_file_failing_validation_fails_the_batch_with_errors(service, api, lines, code, number):
    f = upload(api, jsonl(lines)).json()
    got = api.get(f"/v1/batches/{create(api, f['id']).json()['id']}").json()
    assert got["status"] == "failed" and isinstance(got["failed_at"], int)
    assert got["errors"]["object"] == "list"
    assert [(e["code"], e["line"]) for e in got["errors"]["data"]] == [(code, number)]
    assert got["output_file_id"] is None and got["error_file_id"] is None
    openai_error(api.post(f"/v1/batches/{got['id']}/cancel"), 409, "invalid_transition")


def test_batch_create_refusals(service, api):
    f = upload(api, jsonl([line("a", "x")])).json()
    openai_error(create(api, f["id"], window="1h1m"), 400, "invalid_completion_window")
    openai_error(create(api, f["id"], window="1s"), 400, "invalid_completion_window")
    openai_error(create(api, f["id"], window="365d"), 400, "invalid_completion_window")
    r = api.post("/v1/batches", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                 "completion_window": "24h"}, format="json")
    err = openai_error(r, 400, "unsupported_endpoint")
    assert err["param"] == "endpoint"
    assert openai_error(create(api, "file-nope"), 404, "not_found")["param"] == "input_file_id"
    openai_error(create(api, f["id"], metadata={"k": 1}), 400, "invalid_metadata")
    openai_error(create(api, f["id"], metadata={str(i): "v" for i in range(17)}), 400, "invalid_metadata")
    openai_error(create(api, f["id"], metadata={"k": "a\x00"}), 400, "invalid_metadata")  # a 500 on PostgreSQL
    openai_error(create(api, f["id"], metadata={"k\x00": "a"}), 400, "invalid_metadata")
    openai_error(api.post("/v1/batches", {"endpoint": "/v1/embeddings"}, format="json"), 400, "invalid_input")
    openai_error(api.get("/v1/batches/batch_nope"), 404, "not_found")
    openai_error(api.post("/v1/batches/batch_nope/cancel"), 404, "not_found")
    openai_error(api.get("/v1/batches", {"after": "batch_nope"}), 404, "not_found")
    openai_error(api.get("/v1/batches", {"limit": 101}), 400, "invalid_limit")
    # found by the schema fuzz on PostgreSQL: an id with a NUL was sent to the database, whose
    # driver refused it (a 500); an id not of the service's form names nothing
    for odd in ("file-\x00", "\x00", "file-" + "0" * 31 + "\x00"):
        body = json.dumps({"input_file_id": odd, "endpoint": "/v1/embeddings", "completion_window": "24h"})
        assert openai_error(api.post("/v1/batches", body, content_type="application/json"), 404,
                            "not_found")["param"] == "input_file_id"
    assert Batch.objects.count() == 0



def test_expires_at_is_created_at_plus_the_window_to_the_second_whatever_the_clock_does(service, api, monkeypatch):
    # found by CI: created_at was a second clock reading (the model's auto_now_add) after the one the
    # deadline came from; when a second ticked between them, expires_at - created_at was 86,399
    f = upload(api, jsonl([line("a", "x")])).json()
    start = timezone.now().replace(microsecond=999_000)
    readings = iter(start + dt.timedelta(milliseconds=600 * i) for i in range(1000))
    monkeypatch.setattr(timezone, "now", lambda: next(readings))
    for window, seconds in (("24h", 24 * 3600), ("1h", 3600), ("90m", 5400)):
        made = create(api, f["id"], window=window)
        assert made.status_code == 200, made.content
        assert made.json()["expires_at"] - made.json()["created_at"] == seconds

@pytest.fixture
def held_parts(monkeypatch):
    """Parts queued but not run (the test runs them with ``parts.part_run``): ``[(batch id, index)]``."""
    sent = []
    monkeypatch.setattr(dispatch, "send_batch_part",
                        lambda *, batch_id, index, priority: sent.append((batch_id, index)))
    return sent


def _two_part_batch(api, settings, n_lines: int = 6) -> tuple[str, list[str]]:
    settings.PIPELINE = settings.PIPELINE.replace(batch_size=2)  # two inputs a part: three parts
    cids = [f"line-{i}" for i in range(n_lines)]
    f = upload(api, jsonl([line(c, f"text {i}") for i, c in enumerate(cids)])).json()
    r = create(api, f["id"])
    assert r.status_code == 200, r.content
    return r.json()["id"], cids


def test_cancel_part_way_keeps_the_finished_lines_and_the_rest_are_batch_cancelled(service, api, settings,
                                                                                   held_parts, other_user):
    batch_id, cids = _two_part_batch(api, settings)
    assert [i for _, i in held_parts] == [0, 1, 2]
    assert batch_parts.part_run(batch_id=batch_id, index=0)["completed"] == 2
    mid = api.get(f"/v1/batches/{batch_id}").json()
    assert mid["status"] == "in_progress" and mid["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
    openai_error(client_for(other_user).post(f"/v1/batches/{batch_id}/cancel"), 404, "not_found")
    r = api.post(f"/v1/batches/{batch_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    assert batch_parts.part_run(batch_id=batch_id, index=1)["state"] == "skipped"  # its message arrives later
    got = api.get(f"/v1/batches/{batch_id}").json()
    assert got["status"] == "cancelled" and got["finalizing_at"] is None
    assert isinstance(got["cancelling_at"], int) and isinstance(got["cancelled_at"], int)
    assert got["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    out, err = content(api, got["output_file_id"]), content(api, got["error_file_id"])
    assert [x["custom_id"] for x in out] == cids[:2]
    assert [x["custom_id"] for x in err] == cids[2:]
    assert all(x["response"] is None and x["error"]["code"] == "batch_cancelled" for x in err)
    assert Batch.objects.get(id=batch_id).job.status == "cancelled"
    openai_error(api.post(f"/v1/batches/{batch_id}/cancel"), 409, "invalid_transition")


def test_expiry_keeps_the_finished_lines_and_the_rest_are_batch_expired(service, api, settings, held_parts):
    batch_id, cids = _two_part_batch(api, settings)
    batch_parts.part_run(batch_id=batch_id, index=1)  # parts finish in any order; lines stay in order
    Batch.objects.filter(id=batch_id).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert batch_parts.part_run(batch_id=batch_id, index=2)["state"] == "expired"  # reached after the window
    assert batch_services.batches_expire() == 1  # the reconciler: part 0, still queued
    got = api.get(f"/v1/batches/{batch_id}").json()
    assert got["status"] == "expired" and isinstance(got["expired_at"], int)
    assert got["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    assert [x["custom_id"] for x in content(api, got["output_file_id"])] == cids[2:4]
    err = content(api, got["error_file_id"])
    assert [x["custom_id"] for x in err] == cids[:2] + cids[4:]
    assert {x["error"]["code"] for x in err} == {"batch_expired"}
    assert set(BatchPart.objects.filter(batch_id=batch_id).values_list("state", flat=True)) == {"done", "expired"}


def test_batch_events_are_openais_event_bodies_signed_the_standard_webhooks_way(service, api, user):
    openai = pytest.importorskip("openai")
    from embeddings.services.webhooks.delivery import body_of, signatures

    endpoint = WebhookEndpoint.objects.create(owner=user, url="http://127.0.0.1:9/hook",
                                              secret="whsec_" + base64.b64encode(b"k" * 32).decode())
    f = upload(api, jsonl([line("a", "x")])).json()
    done = create(api, f["id"]).json()["id"]
    bad = upload(api, b"nope\n").json()
    failed = create(api, bad["id"]).json()["id"]
    events = {d.event: d for d in WebhookDelivery.objects.filter(endpoint=endpoint)}
    assert set(events) == {"batch.completed", "batch.failed"}
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9/v1", webhook_secret=endpoint.secret)
    for event, batch_id in (("batch.completed", done), ("batch.failed", failed)):
        d = events[event]
        body = body_of(d.payload)
        ts = int(timezone.now().timestamp())
        headers = {"webhook-id": d.message_id, "webhook-timestamp": str(ts),
                   "webhook-signature": signatures(endpoint, d.message_id, ts, body)}
        parsed = client.webhooks.unwrap(body.decode(), headers)
        assert parsed.type == event and parsed.data.id == batch_id and parsed.id.startswith("evt_")
    assert Job.objects.filter(kind=JobKind.BATCH).count() == 2


def test_a_finalisation_whose_worker_died_is_queued_again_by_the_reconciler(service, api, settings, held_parts,
                                                                            monkeypatch):
    batch_id, cids = _two_part_batch(api, settings, n_lines=2)
    # its one part done; the finalisation claimed by a worker that died before writing the files
    with monkeypatch.context() as lost:
        lost.setattr(dispatch, "send_batch_finalize", lambda **kw: None)
        batch_parts.part_run(batch_id=batch_id, index=0)
    Batch.objects.filter(id=batch_id).update(status="finalizing", finalizing_at=timezone.now())
    assert api.get(f"/v1/batches/{batch_id}").json()["status"] == "finalizing"
    assert batch_services.batches_expire() == 0  # within the lease: left alone
    Batch.objects.filter(id=batch_id).update(finalizing_at=timezone.now() - batch_services.FINALIZE_LEASE
                                             - dt.timedelta(seconds=1))
    assert batch_services.batches_expire() == 1
    got = api.get(f"/v1/batches/{batch_id}").json()
    assert got["status"] == "completed" and got["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert [x["custom_id"] for x in content(api, got["output_file_id"])] == cids


@pytest.fixture
def fetching(service, origin):
    """The service allowed to fetch from the test server on 127.0.0.1 (refused by default)."""
    from embeddings import runtime

    service.FETCH_ALLOW_NETWORKS = ["127.0.0.1/32"]
    service.FETCH_RETRIES = 0
    runtime.fetcher.cache_clear()
    yield service
    runtime.fetcher.cache_clear()


def test_image_urls_are_fetched_ahead_on_the_fetch_worker_and_read_by_the_part(fetching, api, origin, held_parts):
    from embeddings import runtime

    urls = [f"{origin.url}/pixels/{n}.jpg" for n in (5611, 5612)]
    lines = [line("urls", urls), line("private", "http://169.254.169.254/latest/meta-data/"),
             line("missing", f"{origin.url}/status/404"), line("text", "a cat")]
    batch_id = create(api, upload(api, jsonl(lines)).json()["id"]).json()["id"]
    (part,) = BatchPart.objects.filter(batch_id=batch_id)  # fetched (eager), then held for the bulk queue
    assert held_parts == [(batch_id, 0)]
    assert set(part.staged) == {"0.0", "0.1", "1.0", "2.0"}
    assert part.staged["1.0"]["reason"] == "fetch_refused_address" and part.staged["2.0"]["reason"] == "fetch_status"
    keys = [part.staged[k]["key"] for k in ("0.0", "0.1")]
    assert all(runtime.blob_store().exists(k) for k in keys)
    seen = origin.count()
    assert batch_parts.part_run(batch_id=batch_id, index=0) == {"state": "done", "completed": 2, "failed": 2}
    assert origin.count() == seen  # the bulk worker read what the fetch worker fetched
    assert not any(runtime.blob_store().exists(k) for k in keys)  # released once read
    got = api.get(f"/v1/batches/{batch_id}").json()
    assert got["status"] == "completed"
    (out_urls, _), err = content(api, got["output_file_id"]), content(api, got["error_file_id"])
    ref = api.post("/v1/embeddings", {"model": "ViT-B-32", "input": urls}, format="json").json()
    for mine, theirs in zip(out_urls["response"]["body"]["data"], ref["data"]):
        assert float(vec(mine["embedding"]) @ vec(theirs["embedding"])) == pytest.approx(1.0, abs=1e-5)
    assert {x["custom_id"]: x["response"]["body"]["error"]["code"] for x in err} == \
        {"private": "fetch_refused_address", "missing": "fetch_status"}


def test_a_lost_validation_is_queued_again_by_the_reconciler(service, api, monkeypatch):
    f = upload(api, jsonl([line("a", "a cat")])).json()
    with monkeypatch.context() as lost:
        lost.setattr(dispatch, "send_batch_validate", lambda **kw: None)
        batch_id = create(api, f["id"]).json()["id"]
    assert batch_services.batches_expire() == 0  # within the lease
    assert api.get(f"/v1/batches/{batch_id}").json()["status"] == "validating"
    Batch.objects.filter(id=batch_id).update(created_at=timezone.now() - batch_services.VALIDATE_LEASE
                                             - dt.timedelta(seconds=1))
    assert batch_services.batches_expire() == 1
    got = api.get(f"/v1/batches/{batch_id}").json()
    assert got["status"] == "completed" and got["request_counts"] == {"total": 1, "completed": 1, "failed": 0}


def _aged_lease(batch_id: str, *indexes: int) -> None:
    BatchPart.objects.filter(batch_id=batch_id, index__in=indexes).update(
        leased_at=timezone.now() - batch_services.PART_LEASE - dt.timedelta(seconds=1))


def _one_each(api, got: dict, cids: list[str]) -> tuple[list[dict], list[dict]]:
    """The batch's output and error lines, after checking every input line is in exactly one of them."""
    out = content(api, got["output_file_id"]) if got["output_file_id"] else []
    err = content(api, got["error_file_id"]) if got["error_file_id"] else []
    assert sorted(x["custom_id"] for x in out + err) == sorted(cids)
    assert got["request_counts"] == {"total": len(cids), "completed": len(out), "failed": len(err)}
    return out, err


def test_a_part_whose_message_was_lost_is_queued_again_past_its_lease(service, api, settings, monkeypatch):
    # three parts: part 1's message lost (a broker restart), part 2 claimed by a worker killed before
    # its ack, part 0 run; one line refused (an error line)
    settings.PIPELINE = settings.PIPELINE.replace(batch_size=2)
    cids = [f"line-{i}" for i in range(6)]
    lines = [line(c, f"text {i}") for i, c in enumerate(cids)]
    lines[3] = line(cids[3], "text 3", dimensions=7)
    f = upload(api, jsonl(lines)).json()
    sent = []
    with monkeypatch.context() as lost:
        lost.setattr(dispatch, "send_batch_part", lambda *, batch_id, index, priority: sent.append(index))
        batch_id = create(api, f["id"]).json()["id"]
    assert sent == [0, 1, 2]
    assert batch_parts.part_run(batch_id=batch_id, index=0)["state"] == "done"
    BatchPart.objects.filter(batch_id=batch_id, index=2).update(state="running")
    assert batch_services.batches_expire() == 0  # within the lease: left alone
    assert api.get(f"/v1/batches/{batch_id}").json()["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
    _aged_lease(batch_id, 1, 2)
    assert batch_services.batches_expire() == 1  # queued again (fetch queue, then bulk: eager here)
    got = api.get(f"/v1/batches/{batch_id}").json()
    assert got["status"] == "completed"
    out, err = _one_each(api, got, cids)
    assert [x["custom_id"] for x in out] == cids[:3] + cids[4:]
    assert [x["custom_id"] for x in err] == [cids[3]] and err[0]["response"]["body"]["error"]["code"] == \
        "invalid_dimensions"
    assert batch_services.batches_expire() == 0  # nothing left open
    assert batch_parts.part_run(batch_id=batch_id, index=1)["state"] == "skipped"  # the lost message, found late


def test_a_resent_part_whose_first_worker_finishes_too_writes_its_lines_once(service, api, settings, monkeypatch,
                                                                               held_parts):
    # the first worker of the one part is alive but slow: past its lease the reconciler queues the
    # part again and that delivery records it; the first worker then finishes and writes nothing.
    # (The deliveries are called here as the bulk worker calls them, outside its bulk turn.)
    settings.PIPELINE = settings.PIPELINE.replace(batch_size=4)
    cids = ["a", "b", "c"]
    batch_id = create(api, upload(api, jsonl([line(c, f"text {c}") for c in cids])).json()["id"]).json()["id"]
    assert held_parts == [(batch_id, 0)]
    run_lines, seen, resent = batch_parts._run_lines, [], []
    monkeypatch.setattr(dispatch, "send_batch_part_fetch", lambda *, batch_id, index, priority: resent.append(index))

    def slow_first_worker(batch, part):
        if not seen:  # the first delivery: the reconciler's round comes while it computes
            seen.append("first")
            _aged_lease(batch.id, part.index)
            assert batch_services.parts_resend() == {batch.id} and resent == [0]
            assert batch_parts.part_run(batch_id=batch.id, index=part.index)["state"] == "done"  # the resent one
        return run_lines(batch, part)

    monkeypatch.setattr(batch_parts, "_run_lines", slow_first_worker)
    assert batch_parts.part_run(batch_id=batch_id, index=0)["state"] == "late"  # its lines dropped
    got = api.get(f"/v1/batches/{batch_id}").json()
    assert got["status"] == "completed"
    out, err = _one_each(api, got, cids)
    assert [x["custom_id"] for x in out] == cids and err == []
    (part,) = BatchPart.objects.filter(batch_id=batch_id)
    assert (part.state, part.completed, part.failed) == ("done", 3, 0)


# --- the admin; blobs gone with their rows ---------------------------------------------------------

def test_the_admin_shows_files_and_batches_read_only_linked_to_each_other_and_the_job(service, api, user, staff,
                                                                                       settings, held_parts):
    from django.test import Client

    batch_id, cids = _two_part_batch(api, settings)
    for index in (0, 1, 2):
        batch_parts.part_run(batch_id=batch_id, index=index)
    batch = Batch.objects.get(id=batch_id)
    assert batch.status == "completed" and batch.error_file_id is None
    admin = Client()
    admin.force_login(staff)
    page = admin.get(f"/admin/embeddings/batch/{batch_id}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    for f in (batch.input_file_id, batch.output_file_id):
        assert f'href="/admin/embeddings/batchfile/{f}/change/"' in html
    assert f'href="/admin/embeddings/job/{batch.job_id}/change/"' in html
    assert "6 completed, 0 failed of 6" in html
    assert 'name="status"' not in html and 'name="_save"' not in html  # shown, not a form to change
    job_page = admin.get(f"/admin/embeddings/job/{batch.job_id}/change/").content.decode()
    assert f'href="/admin/embeddings/batch/{batch_id}/change/"' in job_page
    file_page = admin.get(f"/admin/embeddings/batchfile/{batch.output_file_id}/change/").content.decode()
    assert f'href="/admin/embeddings/batch/{batch_id}/change/"' in file_page
    for url in ("/admin/embeddings/batch/", "/admin/embeddings/batchfile/", "/admin/embeddings/batch/?status__exact=completed"):
        assert admin.get(url).status_code == 200, url
    # read-only: no add, no edit; a change posted is refused
    assert admin.get("/admin/embeddings/batch/add/").status_code == 403
    assert admin.get("/admin/embeddings/batchfile/add/").status_code == 403
    assert admin.post(f"/admin/embeddings/batch/{batch_id}/change/", {"status": "in_progress"}).status_code == 403
    assert Batch.objects.get(id=batch_id).status == "completed"
    # cancel through the service: a finished batch is refused with a message, nothing changes
    r = admin.post("/admin/embeddings/batch/", {"action": "cancel", "_selected_action": [batch_id]}, follow=True)
    assert r.status_code == 200 and "a completed batch cannot be cancelled" in r.content.decode()
    assert Batch.objects.get(id=batch_id).status == "completed"
    # the batch's job is not paused or cancelled on its own
    admin.post("/admin/embeddings/job/", {"action": "cancel", "_selected_action": [str(batch.job_id)]})
    assert Job.objects.get(id=batch.job_id).status == "done"


def test_deleting_a_user_leaves_none_of_their_files_or_batches_blobs(service, api, user, other_user, settings,
                                                                     held_parts):
    from embeddings import runtime

    store = runtime.blob_store()
    batch_id, cids = _two_part_batch(api, settings)
    lines = [line("ok", "a cat"), line("bad", "a dog", dimensions=7)]
    second = create(api, upload(api, jsonl(lines)).json()["id"]).json()["id"]
    for index in (0, 1, 2):
        batch_parts.part_run(batch_id=batch_id, index=index)
    batch_parts.part_run(batch_id=second, index=0)
    spare = upload(api, jsonl([line("x", "spare")])).json()["id"]
    # another owner's file of the same bytes as one of alice's: its blob stays
    theirs = upload(client_for(other_user), jsonl([line("x", "spare")])).json()["id"]
    files = list(BatchFile.objects.filter(owner=user))
    assert len(files) == 2 + 3 + 1  # two inputs; outputs of both batches, the second's error file; the spare
    keys = {f.storage_key for f in files}
    assert all(store.exists(k) for k in keys)
    # a deleted file goes with its blob (the API)
    (first_output,) = [f for f in files if f.id == Batch.objects.get(id=batch_id).output_file_id]
    assert api.delete(f"/v1/files/{first_output.id}").status_code == 200
    assert not store.exists(first_output.storage_key)
    user.delete()  # the cascade: files, batches, their jobs and parts
    assert not BatchFile.objects.filter(owner_id=user.id).exists() and not Batch.objects.filter(id=second).exists()
    left = {k for k in keys if store.exists(k)}
    assert left == {BatchFile.objects.get(id=theirs).storage_key}  # the shared bytes, still named by bob's file
    assert BatchFile.objects.get(id=theirs).storage_key == {f.storage_key for f in files if f.id == spare}.pop()
