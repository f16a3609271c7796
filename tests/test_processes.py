"""The process command lines have one source (project/processes.py) that docker-compose.yml,
the Procfile and scripts/stack.py all follow; queue names come from project/lanes.py."""
from __future__ import annotations

import yaml

from project import lanes, processes
from tests.conftest import ROOT


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_compose_runs_the_same_commands():
    want = processes.commands({"WEB_BIND": "0.0.0.0", "WEB_PORT": "8000"})
    services = compose()
    for name, cmd in want.items():
        assert services[name]["command"] == cmd, name


def test_every_queue_has_its_worker_and_names_come_from_lanes():
    cmds = processes.commands({})
    consumed = {c.split(" -Q ")[1].split()[0] for n, c in cmds.items() if n.startswith("worker-")}
    assert consumed == set(lanes.ALL_QUEUES)


def test_embedding_workers_ask_for_a_gpu_and_the_vector_owner_does_not():
    s = compose()
    for name in ("worker-interactive", "worker-bulk"):
        assert s[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "deploy" not in s["worker-vectors"]
    assert {"redis", "qdrant", "postgres", "web"} <= set(s)


def test_an_interactive_worker_that_owns_the_store_consumes_the_vectors_queue_and_no_vectors_worker_runs():
    """``STORE_OWNER=interactive`` with an embedded store: the interactive worker takes the vectors
    queue after its own, with ``VECTORS_HELD`` more threads; every queue still has its worker. With
    a server the setting changes nothing; the shared worker (deployment (b)) refuses it."""
    import pytest

    cmds = processes.commands({"STORE_OWNER": "interactive", "INTERACTIVE_THREADS": "16"})
    assert "worker-vectors" not in cmds
    assert f" -Q {lanes.INTERACTIVE},{lanes.VECTORS} -P threads -c {16 + processes.VECTORS_HELD} " \
        in cmds["worker-interactive"]
    consumed = {q for n, c in cmds.items() if n.startswith("worker-") for q in c.split(" -Q ")[1].split()[0].split(",")}
    assert consumed == set(lanes.ALL_QUEUES)
    assert processes.commands({"STORE_OWNER": "interactive", "QDRANT_URL": "http://qdrant:6333"}) == \
        processes.commands({"QDRANT_URL": "http://qdrant:6333"})
    with pytest.raises(ValueError, match="deployment \\(a\\)"):
        processes.shared_commands({"STORE_OWNER": "interactive"})


def test_shared_worker_lists_interactive_first():
    cmd = processes.shared_worker_command({})
    assert f"-Q {lanes.INTERACTIVE},{lanes.BULK} " in cmd


def test_compose_gpu_worker_runs_the_shared_worker_with_the_storage_it_needs_across_hosts():
    gpu = compose()["worker-gpu"]
    assert gpu["command"] == processes.shared_worker_command({})
    assert gpu["profiles"] == ["gpu"] and gpu["environment"]["CLIP_DEVICE"] == "cuda"
    # on another host than the web, image bytes come from S3-compatible storage (docs/operations.md)
    for name in ("STORAGE_URL", "S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "CLIP_MODELS"):
        assert name in gpu["environment"], name


def test_every_compose_process_runs_under_one_deployment_name():
    """One ``DEPLOYMENT_NAME`` (default the service's own) for every process of the stack: its
    queues and keys are its own on a shared Redis (project/lanes.py ``key_prefix``)."""
    from project import configuration

    wanted = f"${{DEPLOYMENT_NAME:-{configuration.BY_NAME['DEPLOYMENT_NAME'].default}}}"
    apps = {name: svc for name, svc in compose().items() if "celery" in str(svc.get("command", ""))
            or name == "web"}
    assert {"web", "worker-bulk", "worker-gpu"} <= set(apps)
    assert {name: svc["environment"].get("DEPLOYMENT_NAME") for name, svc in apps.items()} == dict.fromkeys(apps, wanted)


def test_compose_workers_stop_softly_within_their_grace_period_and_the_web_health_is_readiness():
    """SIGTERM is Celery's soft shutdown (``REMAP_SIGTERM=SIGQUIT``, bounded by ``WORKER_DRAIN_S``),
    and docker's grace period outlasts it (its default 10 s would SIGKILL a chunk mid-way); the web's
    health check is ``/readyz`` (docs/deploy.md)."""
    from project import configuration

    drain = configuration.BY_NAME["WORKER_DRAIN_S"].default
    workers = {name: svc for name, svc in compose().items() if "celery" in str(svc.get("command", ""))}
    assert {"worker-interactive", "worker-bulk", "worker-vectors", "worker-fetch", "worker-gpu"} <= set(workers)
    for name, svc in workers.items():
        assert svc["environment"]["REMAP_SIGTERM"] == "SIGQUIT", name
        assert float(svc["stop_grace_period"].removesuffix("s")) >= 2 * drain + 10, name
    assert "/readyz" in " ".join(compose()["web"]["healthcheck"]["test"])
