"""Sending signed webhooks (issue 42, docs/webhooks.md): each message signed as Standard Webhooks
says (checked by the reference library, ``standardwebhooks``), retried on the schedule kept in the
database, with the fetcher's address rules at every attempt; a receiver that hangs holds up no other.

A real receiver on 127.0.0.1 (``FETCH_ALLOW_NETWORKS`` = 127.0.0.1/32) verifies each message and
records what it accepted; the schedule is driven by calling the due-delivery sender with a clock
moved on, never by sleeping. Eager Celery. The events themselves: ``test_events.py``.
"""
from __future__ import annotations

import base64
import datetime as dt
import http.server
import itertools
import json
import threading
import time

import pytest
import standardwebhooks
from django.utils import timezone

from embeddings import dispatch
from embeddings.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint
from embeddings.services.webhooks import delivery as webhook_delivery
from embeddings.services.webhooks import endpoints as webhook_endpoints
from embeddings.services.webhooks import events as webhook_events

pytestmark = pytest.mark.django_db(transaction=True)

class Receiver:
    """A threaded HTTP receiver on 127.0.0.1. ``POST /<name>`` checks the message against the
    secret registered for ``name`` with the reference library; routes by name:

    - ``flaky``: answers 500 to its first ``fail_first`` requests, then verifies and answers 200;
    - ``ok``: verifies, 200; ``down``: 500 always; ``hang``: never answers within ``hang_s``;
    - a name without a secret yet (the test has not read it from the answer): 401.

    ``accepted``: ``[(name, webhook-id, payload)]``; ``duplicates``: ids accepted twice (a bug);
    ``rejected``: messages whose signature failed.
    """

    def __init__(self, *, fail_first: int = 3, hang_s: float = 3.0) -> None:
        self.secrets: dict[str, str] = {}
        self.fail_first, self.hang_s = fail_first, hang_s
        self.requests = 0
        self.flaky_requests = 0
        self.accepted: list[tuple[str, str, dict]] = []
        self.duplicates: list[str] = []
        self.rejected: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(receiver.handle(self.path.strip("/"), dict(self.headers.items()), body))

            def _answer(self, code: int) -> None:
                if code == 0:
                    time.sleep(receiver.hang_s)
                    code = 200
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                try:
                    self.wfile.write(b"ok")
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def handle(self, name: str, headers: dict, body: bytes) -> int:
        with self.lock:
            self.requests += 1
            if name == "hang":
                return 0
            if name == "flaky":
                self.flaky_requests += 1
            if name == "down" or (name == "flaky" and self.flaky_requests <= self.fail_first):
                return 500
            if name not in self.secrets:
                return 401
            try:
                payload = standardwebhooks.Webhook(self.secrets[name]).verify(body, headers)
            except standardwebhooks.WebhookVerificationError:
                self.rejected.append(headers.get("webhook-id", "?"))
                return 400
            msg_id = headers["webhook-id"]
            if any(m == msg_id for _, m, _ in self.accepted):
                self.duplicates.append(msg_id)
            self.accepted.append((name, msg_id, payload))
            return 200

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(settings):
    settings.FETCH_ALLOW_NETWORKS = ["127.0.0.1/32"]
    with Receiver() as r:
        yield r


def endpoint(owner, receiver: Receiver, name: str, **kwargs) -> WebhookEndpoint:
    e = webhook_endpoints.endpoint_create(owner=owner, url=f"{receiver.url}/{name}", **kwargs)
    receiver.secrets[name] = e.secret
    return e


def drive(rounds: int = 12) -> None:
    """The reconciler's rounds, each an hour later than the last: every due attempt is sent."""
    at = timezone.now()
    for _ in range(rounds):
        at += dt.timedelta(hours=12)
        if not WebhookDelivery.objects.filter(status=DeliveryStatus.PENDING).exists():
            return
        webhook_delivery.deliveries_due_send(now=at)


def test_a_receiver_that_never_answers_times_out_without_holding_up_another(service, receiver, user, settings,
                                                                             monkeypatch):
    settings.WEBHOOK_TIMEOUT_S = 0.5
    queued = []
    monkeypatch.setattr(dispatch, "send_webhook_delivery", lambda **kw: queued.append(kw))
    slow, quick = endpoint(user, receiver, "hang"), endpoint(user, receiver, "ok")
    made = webhook_events.event_emit(event="job.done", key="job.done:x", data={}, endpoints=[slow, quick])
    assert len(made) == 2 and [q["attempt"] for q in queued] == [1, 1]
    d_slow, d_quick = (WebhookDelivery.objects.get(endpoint=e) for e in (slow, quick))

    t0 = time.monotonic()
    waiting = threading.Thread(target=webhook_delivery.delivery_attempt, kwargs={"delivery_id": d_slow.id,
                                                                                  "attempt": 1})
    waiting.start()
    time.sleep(0.05)
    assert webhook_delivery.delivery_attempt(delivery_id=d_quick.id, attempt=1)["ok"]
    assert waiting.is_alive() and time.monotonic() - t0 < 0.5  # went through while the other waits
    waiting.join()
    d_slow.refresh_from_db()
    assert (d_slow.status, d_slow.attempts, d_slow.last_reason) == ("pending", 1, "fetch_timeout")
    wait = (d_slow.next_attempt_at - d_slow.attempt_log.get().started_at).total_seconds()
    assert wait == pytest.approx(settings.WEBHOOK_RETRY_SCHEDULE_S[1])
    # the same attempt's message again (a redelivered task) sends nothing
    assert webhook_delivery.delivery_attempt(delivery_id=d_slow.id, attempt=1) == {"sent": False}
    assert WebhookDelivery.objects.get(id=d_quick.id).status == "delivered"


def test_a_host_name_resolving_to_a_refused_address_fails_each_attempt(service, receiver, user, settings):
    settings.FETCH_ALLOW_NETWORKS = []
    port = receiver.url.rsplit(":", 1)[1]
    e = webhook_endpoints.endpoint_create(owner=user, url=f"http://localhost:{port}/ok")  # a name: checked when sent
    webhook_events.event_emit(event="job.done", key="k", data={}, endpoints=[e])
    d = WebhookDelivery.objects.get(endpoint=e)
    assert (d.status, d.attempts, d.last_reason) == ("pending", 1, "fetch_refused_address")
    # the rule and the URL; what the name resolves to on this server stays in its log
    assert d.last_error == (f"http://localhost:{port}/ok: localhost resolves to a loopback address, refused unless "
                            "FETCH_ALLOW_NETWORKS allows it")
    assert receiver.requests == 0


def test_the_last_attempt_fails_the_delivery(service, receiver, user, settings):
    settings.WEBHOOK_RETRY_SCHEDULE_S = [0.0, 5.0, 300.0]
    e = endpoint(user, receiver, "down")
    webhook_events.event_emit(event="job.failed", key="k", data={}, endpoints=[e])
    drive()
    d = WebhookDelivery.objects.get(endpoint=e)
    assert (d.status, d.attempts, d.last_status_code, d.next_attempt_at) == ("failed", 3, 500, None)
    assert [a.number for a in d.attempt_log.all()] == [1, 2, 3]
    # redeliver: the same message from the first attempt again
    receiver.secrets["down"] = e.secret
    webhook_delivery.delivery_redeliver(delivery=d)
    d.refresh_from_db()
    assert (d.status, d.attempts) == ("pending", 1)


def test_signing_matches_the_reference_and_tampering_is_rejected():
    secret = webhook_endpoints.secret_new()
    assert secret.startswith("whsec_") and 24 <= len(base64.b64decode(secret[6:])) <= 64
    body = webhook_delivery.body_of({"type": "job.done", "timestamp": "2030-01-01T00:00:00+00:00", "data": {"é": 1}})
    ts = int(time.time())
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(ts),
               "webhook-signature": webhook_delivery.sign(secret, "msg_1", ts, body)}
    hook = standardwebhooks.Webhook(secret)
    assert hook.verify(body, headers)["data"] == {"é": 1}
    assert headers["webhook-signature"] == hook.sign("msg_1", dt.datetime.fromtimestamp(ts, dt.UTC), body)
    for tampered in (body.replace(b"job.done", b"job.fail"), body + b" "):
        with pytest.raises(standardwebhooks.WebhookVerificationError):
            hook.verify(tampered, headers)
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        hook.verify(body, {**headers, "webhook-id": "msg_2"})
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(webhook_endpoints.secret_new()).verify(body, headers)
    assert json.loads(body) == {"data": {"é": 1}, "timestamp": "2030-01-01T00:00:00+00:00", "type": "job.done"}


def test_the_retry_schedule_spans_at_least_a_day(settings):
    schedule = settings.WEBHOOK_RETRY_SCHEDULE_S
    assert schedule[0] == 0 and sum(schedule) >= 24 * 3600
    assert all(a <= b for a, b in itertools.pairwise(schedule))
