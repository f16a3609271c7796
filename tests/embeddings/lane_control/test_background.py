"""``lane_control.background``: lane control's bookkeeping leaves from one writer thread per process,
never on the caller's path: in the order handed over (an entry's HSET before its HDEL), what waits
together in one round trip, a Redis that cannot be reached logged and never raised, and a forked
child with a writer of its own (issue 58)."""
from __future__ import annotations

import multiprocessing
import threading

from django.test import override_settings

from embeddings.lane_control import background
from embeddings.lane_control.keys import redis_client


def test_writes_leave_in_order_from_the_writer_thread_and_what_waits_goes_together():
    client = redis_client()
    client.delete("bg:h", "bg:l")
    writer = background.Writer("test-writes")
    sends: list[tuple[str, int]] = []
    send = writer._send
    writer._send = lambda writes: sends.append((threading.current_thread().name, len(writes))) or send(writes)
    gate = threading.Event()
    writer.put(lambda pipe: gate.wait(5))  # holds the thread while the rest queue up behind it
    for i in range(20):
        writer.put(lambda pipe, i=i: pipe.rpush("bg:l", i))
    writer.put(lambda pipe: pipe.hset("bg:h", "task", "1 0.0"))
    writer.put(lambda pipe: pipe.hdel("bg:h", "task"))
    gate.set()
    assert writer.flush()
    assert client.lrange("bg:l", 0, -1) == [str(i) for i in range(20)]
    assert not client.hexists("bg:h", "task")  # the HDEL came after its HSET
    assert {name for name, _ in sends} == {"test-writes"}  # never the caller's thread
    assert sum(n for _, n in sends) == 23 and len(sends) <= 2  # 23 writes, one or two round trips


def test_a_write_that_cannot_reach_redis_is_logged_not_raised(caplog):
    writer = background.Writer("test-lost")
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):  # nobody listens there
        writer.put(lambda pipe: pipe.hset("bg:h", "x", "1"))
        assert writer.flush()  # tried, and counted as done
    assert any("test-lost: 1 Redis writes lost" in r.getMessage() for r in caplog.records)


def _child(url: str, done) -> None:
    with override_settings(REDIS_URL=url):
        background.write(lambda pipe: pipe.set("bg:child", "written"))
        done.put(background.flush())


def test_a_forked_child_writes_through_a_thread_of_its_own():
    client = redis_client()
    client.delete("bg:child")
    background.write(lambda pipe: pipe.set("bg:parent", "1"))  # the parent's thread runs before the fork
    assert background.flush()
    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    p = ctx.Process(target=_child, args=(_url(client), done))
    p.start()
    assert done.get(timeout=20) is True
    p.join(20)
    assert client.get("bg:child") == "written"


def _url(client) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
