"""Webhooks through the real processes: a bulk job posted to gunicorn names a callback URL; when the
bulk and vectors workers finish it, the fetch worker POSTs ``job.done`` to a receiver this test
starts, signed as Standard Webhooks says (verified by the reference ``standardwebhooks`` library),
and the delivery shows as delivered in the API. The retry schedule and every event kind are tested
in-process (tests/embeddings/services/webhooks/test_delivery.py); this checks the wiring: the message is
queued when the job's end commits, routed to the fetch queue, and sent from there.
"""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.origin_server import pixels_jpeg

standardwebhooks = pytest.importorskip("standardwebhooks")

#: Seeds of this module's images (distinct pixels: the stack is shared with other modules).
SEEDS = (4301, 4302, 4303)


class Receiver:
    """A local HTTP endpoint that records every POST: ``(headers, body)``."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_a_finished_job_posts_one_signed_job_done_from_the_fetch_worker(stack, api, receiver):
    files = [("files", (f"hook-{n}.jpg", pixels_jpeg(n), "image/jpeg")) for n in SEEDS]
    r = api.post("/api/jobs/", files=files, data={"callback_url": receiver.url, "name": "webhook e2e"})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    (hook,) = r.json()["webhooks"]
    assert hook["url"] == receiver.url and hook["secret"].startswith("whsec_")
    # what this test holds is one signed message, not how soon: on the shared stack a job can wait
    # behind earlier modules' bulk work, minutes on a 2-core machine running the model in fp32
    end = time.monotonic() + 300
    while not receiver.received:
        assert time.monotonic() < end, api.get(f"/api/jobs/{job_id}/").json()
        time.sleep(0.2)
    time.sleep(1.0)  # a second message (a duplicate) would arrive now
    assert len(receiver.received) == 1
    headers, body = receiver.received[0]
    payload = standardwebhooks.Webhook(hook["secret"]).verify(body, headers)
    assert payload["type"] == "job.done"
    assert (payload["data"]["job_id"], payload["data"]["status"]) == (job_id, "done")
    assert payload["data"]["counts"]["embedded"] == 3 and payload["data"]["counts"]["total"] == 3
    # the message left from the fetch worker, not from the web process
    log = (stack.var_dir / "log" / "worker-fetch.log").read_text(errors="replace")
    assert "send_webhook_delivery" in log
    assert "send_webhook_delivery" not in (stack.var_dir / "log" / "web.log").read_text(errors="replace")
    deliveries = api.get(f"/api/webhooks/{hook['id']}/deliveries/").json()["results"]
    assert [(d["event"], d["status"], d["attempts"]) for d in deliveries] == [("job.done", "delivered", 1)]
    assert deliveries[0]["message_id"] == headers["webhook-id"]
