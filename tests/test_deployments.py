"""Two deployments on one Redis database (issue 53): each one's queues, unacknowledged messages,
results and lane-control keys live under its own ``DEPLOYMENT_NAME`` prefix (project/lanes.py
``key_prefix``), so neither takes the other's tasks; and the suite itself never uses the machine's
``redis://127.0.0.1:6379/0`` (tests/conftest.py ``session_redis``)."""
from __future__ import annotations

import queue as queue_module

import pytest
from celery import Celery
from kombu import Connection

from project import lanes


def deployment_app(url: str, name: str) -> Celery:
    """A Celery client configured as a deployment named ``name`` is (project/settings.py)."""
    app = Celery(f"deployment-{name}", broker=url, backend="project.results:DeadlineRedisBackend+" + url,
                 set_as_current=False)
    options = lanes.transport_options(name)
    app.conf.update(broker_transport_options={"priority_steps": [0, 3, 6, 9], **options},
                    result_backend_transport_options=options)
    return app


def take(url: str, name: str, queue: str) -> list:
    """Every message a worker of deployment ``name`` would take from ``queue`` now (BRPOP, as a
    worker consumes), each acknowledged."""
    taken = []
    with Connection(url, transport_options={"priority_steps": [0, 3, 6, 9], **lanes.transport_options(name)}) as c:
        with c.SimpleQueue(queue) as q:
            while True:
                try:
                    message = q.get(timeout=0.3)
                except queue_module.Empty:
                    return taken
                message.ack()
                taken.append(message.headers["task"])


def test_two_deployments_on_one_redis_database_never_see_each_others_tasks_or_results(private_redis):
    url, client = private_redis
    alpha, beta = deployment_app(url, "alpha"), deployment_app(url, "beta")
    try:
        for queue, priority in ((lanes.BULK, 9), (lanes.INTERACTIVE, 0), (lanes.FETCH, 6)):
            alpha.send_task("embeddings.tasks.embed_chunk", args=("job", ["a"]), queue=queue, priority=priority)
        alpha.backend.store_result("t-1", {"answer": 1}, "SUCCESS")
        # every key the broker and the result backend wrote is alpha's
        written = sorted(k.decode() for k in client.keys("*"))
        assert written and all(k.startswith("alpha:") for k in written), written
        assert "alpha:bulk\x06\x169" in written and "alpha:celery-task-meta-t-1" in written

        # beta's workers, on the same queue names, take nothing; its results are not alpha's
        for queue in (lanes.BULK, lanes.INTERACTIVE, lanes.FETCH):
            assert take(url, "beta", queue) == []
        assert beta.backend.get_task_meta("t-1")["status"] == "PENDING"
        assert alpha.backend.get_task_meta("t-1")["result"] == {"answer": 1}
        # alpha's do
        for queue in (lanes.BULK, lanes.INTERACTIVE, lanes.FETCH):
            assert take(url, "alpha", queue) == ["embeddings.tasks.embed_chunk"]
    finally:
        alpha.close()
        beta.close()


def test_the_service_names_every_key_with_its_deployment(settings):
    """The settings put the broker, the results and lane control under ``"<DEPLOYMENT_NAME>:"``."""
    from embeddings import lane_control
    from embeddings.lane_control import keys
    from embeddings.services import reconcile

    prefix = settings.REDIS_KEY_PREFIX
    assert prefix == lanes.key_prefix(settings.DEPLOYMENT_NAME) == "clip:"  # the default name
    assert settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] == prefix
    assert settings.CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS == {"global_keyprefix": prefix}
    assert lane_control.queue_keys(lanes.BULK) == ["clip:bulk", "clip:bulk\x06\x163", "clip:bulk\x06\x166",
                                                   "clip:bulk\x06\x169"]
    named = [v for k, v in vars(keys).items() if k.endswith("_KEY")]
    named += [reconcile.LOCK_KEY, reconcile._UNACKED, reconcile._UNACKED_INDEX]
    assert len(named) >= 15 and all(v.startswith(prefix) for v in named), named


@pytest.mark.parametrize("name", ["", "a:b", "two words", "-lead", "x" * 64, "é"])
def test_a_deployment_name_that_cannot_start_a_key_is_refused(name):
    with pytest.raises(ValueError, match="DEPLOYMENT_NAME"):
        lanes.key_prefix(name)


def test_the_suite_never_uses_the_machines_redis(session_redis, settings):
    """tests/conftest.py points the broker, results and lane control at the session's own Redis."""
    from project.celery import app

    default = "redis://127.0.0.1:6379/0"
    assert session_redis != default
    assert settings.REDIS_URL == settings.CELERY_BROKER_URL == app.conf.broker_url == session_redis
    assert app.conf.result_backend.endswith("+" + session_redis)
