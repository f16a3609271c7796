"""The official ``openai`` client against the running stack's Batch API (real web, Redis, fetch and
bulk workers, random-weights ViT-B-32): upload a JSONL file (``files.create(purpose="batch")``),
``batches.create``, poll ``retrieve`` to ``completed``, ``files.content`` of the output; the vectors
equal ``/v1/embeddings``' for the same inputs (texts, data URLs, an image URL of a local origin
server); cancel part way (counts add up, finished lines kept); expiry with a short window; a file
failing validation. Images are distinct pixels (``pixels_jpeg``) this module alone sends."""
from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest

from tests.origin_server import OriginServer, pixels_jpeg

openai = pytest.importorskip("openai")

#: Seeds of this module's images (test_openai_client.py uses 42xx).
SEED = 5700


def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def as_array(embedding) -> np.ndarray:
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float32)


def request(cid: str, inputs, model: str = "ViT-B-32", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": inputs,
                                                                                    **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def origin():
    with OriginServer() as server:
        yield server


def wait(client, batch_id: str, statuses: tuple[str, ...], timeout: float = 240):
    """Poll ``batches.retrieve`` until the batch is in one of ``statuses``."""
    end = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < end, f"batch {batch_id} still {b.status} after {timeout} s: {b}"
        time.sleep(0.2)


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines() if x.strip()]


def upload(client, lines: list[dict]):
    return client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")


def test_a_batch_through_the_client_completes_with_the_vectors_of_v1_embeddings(client, origin):
    url = f"{origin.url}/img/{SEED}.jpg"
    lines = [request("texts", ["a photo of a cat", "a photo of a dog"]),
             request("images", [data_url(pixels_jpeg(SEED + 1)), url], encoding_format="base64"),
             request("mixed", "a red shoe"),
             request("refused", ["a cat", "data:text/plain;base64,aGVsbG8="]),
             request("private", "http://169.254.169.254/latest/meta-data/")]
    f = upload(client, lines)
    assert f.id.startswith("file-") and f.purpose == "batch" and f.bytes == len(jsonl(lines))
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h",
                              metadata={"suite": "e2e"})
    assert b.status in ("validating", "in_progress", "finalizing", "completed") and b.metadata == {"suite": "e2e"}
    done = wait(client, b.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed", done
    assert done.request_counts.total == 5 and done.request_counts.completed == 3 and done.request_counts.failed == 2
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.output_file_id and \
        done.error_file_id
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert [x["custom_id"] for x in out] == ["texts", "images", "mixed"]
    codes = {x["custom_id"]: x["response"]["body"]["error"]["code"] for x in err}
    assert codes == {"refused": "not_an_image", "private": "fetch_refused_address"}
    for x, line in zip(out, lines):
        ref = client.embeddings.create(model="ViT-B-32", input=line["body"]["input"], encoding_format="float")
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["model"] == ref.model
        assert body["usage"]["total_tokens"] == ref.usage.total_tokens
        cosines = [float(as_array(mine["embedding"]) @ as_array(theirs.embedding))
                   for mine, theirs in zip(body["data"], ref.data)]
        # the same model and inputs on two processes: the stack's precision is auto (bf16 on a CPU with
        # native bf16), whose kernels sum in an order that follows each worker's thread count, so the
        # bulk worker's vector and the interactive worker's agree to a cosine of 1 - 1e-4, not bit
        # for bit (in one process they do: tests/embeddings/api/test_batches.py)
        assert cosines == pytest.approx([1.0] * len(cosines), abs=1e-4), (x["custom_id"], body["model"], cosines)
    assert isinstance(out[1]["response"]["body"]["data"][0]["embedding"], str)
    assert b.id in [x.id for x in client.batches.list(limit=100).data]
    # the input file deleted: gone, while the batch keeps its record
    assert client.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    assert client.batches.retrieve(b.id).input_file_id == f.id


def test_a_file_failing_validation_fails_the_batch_with_its_lines(client):
    lines = [request("a", "x"), request("a", "y")]
    f = client.files.create(file=("bad.jsonl", io.BytesIO(jsonl(lines) + b"not json\n")), purpose="batch")
    b = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                           completion_window="24h").id, ("failed", "completed"))
    assert b.status == "failed" and b.failed_at and b.output_file_id is None and b.error_file_id is None
    assert [(e.code, e.line) for e in b.errors.data] == [("duplicate_custom_id", 2), ("invalid_json_line", 3)]
    with pytest.raises(openai.ConflictError) as raised:
        client.batches.cancel(b.id)
    assert raised.value.body["code"] == "invalid_transition"
    with pytest.raises(openai.BadRequestError) as raised:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert raised.value.body["code"] == "unsupported_endpoint"
    with pytest.raises(openai.BadRequestError) as raised:
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="forever")
    assert raised.value.body["code"] == "invalid_completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")


def _big(n_lines: int, seed: int) -> list[dict]:
    """Lines of four images each: several parts (64 inputs a part), seconds of bulk work."""
    return [request(f"line-{i}", [data_url(pixels_jpeg(seed + 4 * i + j)) for j in range(4)])
            for i in range(n_lines)]


def _settled(b, out: list[dict], err: list[dict], unrun: str) -> None:
    """Counts add up, every line in exactly one file, the unrun lines with ``unrun``."""
    counts = b.request_counts
    assert counts.completed + counts.failed == counts.total == len(out) + len(err)
    assert len({x["custom_id"] for x in out + err}) == counts.total
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert {x["error"]["code"] for x in err} == {unrun}


def test_cancel_part_way_keeps_the_finished_lines(client):
    f = upload(client, _big(96, SEED + 100))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    end = time.monotonic() + 240
    while (got := client.batches.retrieve(b.id)).request_counts.completed == 0:
        assert got.status in ("validating", "in_progress"), got
        assert time.monotonic() < end
        time.sleep(0.1)
    assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = wait(client, b.id, ("cancelled",))
    assert done.cancelling_at and done.cancelled_at and done.completed_at is None
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert 0 < len(out) < 96
    _settled(done, out, err, "batch_cancelled")


def test_expiry_with_a_short_window_keeps_the_finished_lines(client):
    # 480 lines are 30 parts of 64 images: a quiet machine with AMX started all 6 parts of 96 lines
    # within 3 s; of 30 most start after the window and end unrun (a part checks it as it starts)
    f = upload(client, _big(480, SEED + 600))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="3s")
    assert b.expires_at - b.created_at == 3
    done = wait(client, b.id, ("expired", "completed"))
    assert done.status == "expired" and done.expired_at
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert len(out) < 480 and err
    _settled(done, out, err, "batch_expired")
