"""``lane_control.hops``: hop records are written by a thread of their own, never on the request's
path, in the order handed over, and a failed write never reaches the request (issue 58)."""
from __future__ import annotations

import json
import threading

from django.test import override_settings

from embeddings.lane_control import hops
from embeddings.lane_control.keys import HOPS_KEY, redis_client


def test_records_are_written_off_the_callers_thread_in_order():
    client = redis_client()
    client.delete(HOPS_KEY)
    writers: list[str] = []
    send = hops.records._send

    def spy(writes):
        writers.append(threading.current_thread().name)
        send(writes)

    hops.records._send = spy
    try:
        for i in range(50):
            hops._push({"side": "web", "id": str(i)})
        hops.flush()
    finally:
        del hops.records._send
    assert [json.loads(r)["id"] for r in client.lrange(HOPS_KEY, 0, -1)] == [str(i) for i in range(50)]
    assert writers and set(writers) == {"hop-records"}  # the caller's thread never waited on Redis


def test_a_record_that_cannot_be_written_is_logged_not_raised(caplog):
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):  # nobody listens there
        hops._push({"side": "web", "id": "lost"})
        hops.flush()
    assert any("hop-records: 1 Redis writes lost" in r.getMessage() for r in caplog.records)
