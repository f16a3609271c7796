"""The Kubernetes manifests (deploy/kubernetes), checked without a cluster: ``make deploy-check``
passes on every overlay, and each of its assertions fails on the mistake it is there for."""
from __future__ import annotations

import copy
import shutil

import pytest
import yaml

from project import configuration, processes
from scripts import deploy_check, deploy_config
from tests.conftest import ROOT

TOOLS = ROOT / ".venv-deploy" / "bin"
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
needs_tools = pytest.mark.skipif(not (TOOLS / "checkov").exists() or not (TOOLS / "kubernetes-validate").exists(),
                                 reason="the checkers are not installed: make deploy-tools (make test does)")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    return {p.name: deploy_check.render(p) for p in sorted(deploy_check.OVERLAYS.iterdir())}


def test_the_generated_configuration_is_current():
    assert deploy_config.main(["--check"]) == 0, "run make deploy-config"
    names = {line.split("=", 1)[0] for f in deploy_config.files().values() for line in f.splitlines()
             if line and not line.startswith("#")}
    assert names == {v.name for v in configuration.VARS}


@needs_kubectl
@needs_tools
def test_deploy_check_passes_on_every_overlay(tmp_path):
    lines = []
    assert deploy_check.check(TOOLS, tmp_path, log=lines.append) == []
    assert [line.split(":")[0] for line in lines[:6]] == ["cpu-edge", "cpu-edge-owner", "cpu-qdrant", "gpu-edge",
                                                          "gpu-edge-owner", "gpu-qdrant"]
    assert any(line.startswith("checkov") for line in lines)


def test_every_overlay_runs_every_process_with_every_setting(rendered):
    assert set(rendered) == {"cpu-edge", "cpu-edge-owner", "cpu-qdrant", "gpu-edge", "gpu-edge-owner", "gpu-qdrant"}
    for name, docs in rendered.items():
        assert deploy_check.overlay_errors(docs) == [], name
        deployments = deploy_check.objects(docs, "Deployment")
        config = deploy_check.config_of(docs)
        assert set(processes.commands(config)) == set(deployments) - {"redis"}, name
        store = config["VECTOR_STORE"]
        assert store == ("server" if "qdrant" in name else "edge"), name
        gpu = "nvidia.com/gpu" in deploy_check._container(deployments["worker-bulk"])["resources"]["limits"]
        assert gpu == name.startswith("gpu"), name


def _first(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name))


@pytest.mark.parametrize("overlay", ["cpu-edge", "gpu-edge"])
def test_the_owner_overlays_have_one_interactive_pod_on_the_store_and_no_vectors_pod(rendered, overlay):
    """<overlay>-owner (STORE_OWNER=interactive): the interactive pod runs both queues on the store's
    volume, alone (one replica, Recreate, no ScaledObject, a budget that lets it be drained); no
    vectors pod, and nothing else changed beside the edge overlay of the same nodes."""
    docs, edge = rendered[f"{overlay}-owner"], rendered[overlay]
    config = deploy_check.config_of(docs)
    assert config["STORE_OWNER"] == "interactive" and config["VECTOR_STORE"] == "edge"
    assert {k: v for k, v in config.items() if k != "STORE_OWNER"} == {
        k: v for k, v in deploy_check.config_of(edge).items() if k != "STORE_OWNER"}
    deployments = deploy_check.objects(docs, "Deployment")
    assert set(deploy_check.objects(edge, "Deployment")) - set(deployments) == {"worker-vectors"}
    owner = deployments["worker-interactive"]["spec"]
    assert (owner["replicas"], owner["strategy"]) == (1, {"type": "Recreate"})
    volumes = {v["name"]: v for v in owner["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "vectors-store"}}
    worker = deploy_check._container(deployments["worker-interactive"])
    assert ("nvidia.com/gpu" in worker["resources"]["limits"]) == overlay.startswith("gpu")
    command = worker["command"]
    assert command[command.index("-Q") + 1] == "interactive,vectors"
    assert command[command.index("-c") + 1] == str(int(config["INTERACTIVE_THREADS"]) + processes.VECTORS_HELD)
    assert set(deploy_check.objects(docs, "ScaledObject")) == {"worker-bulk"}
    budgets = deploy_check.objects(docs, "PodDisruptionBudget")
    assert "worker-vectors" not in budgets
    assert budgets["worker-interactive"]["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "worker-interactive"}}}


@pytest.mark.parametrize("mistake, expected", [
    ("owner_two_replicas", "worker-interactive must be one replica"),
    ("owner_without_volume", "worker-interactive' /data (QDRANT_PATH) must be a persistent volume"),
    ("owner_scaled", "ScaledObject worker-interactive scales worker-interactive"),
    ("vectors_pod_beside_owner", "project/processes.py says"),
])
def test_the_owner_overlay_assertions_catch_their_mistakes(rendered, mistake, expected):
    docs = copy.deepcopy(rendered["cpu-edge-owner"])
    deployments = deploy_check.objects(docs, "Deployment")
    spec = deployments["worker-interactive"]["spec"]
    if mistake == "owner_two_replicas":
        spec["replicas"] = 2
    elif mistake == "owner_without_volume":
        spec["template"]["spec"]["volumes"][0] = {"name": "data", "emptyDir": {}}
    elif mistake == "owner_scaled":
        so = copy.deepcopy(_first(docs, "ScaledObject", "worker-bulk"))
        so["metadata"]["name"] = so["spec"]["scaleTargetRef"]["name"] = "worker-interactive"
        docs.append(so)
    elif mistake == "vectors_pod_beside_owner":  # the interactive worker left on its own queue
        command = deploy_check._container(deployments["worker-interactive"])["command"]
        command[command.index("-Q") + 1] = "interactive"
    assert any(expected in e for e in deploy_check.overlay_errors(docs)), deploy_check.overlay_errors(docs)


@pytest.mark.parametrize("mistake, expected", [
    ("drop_setting", "absent from clip-config"),
    ("unknown_setting", "declared nowhere"),
    ("server_without_store", "does not follow from the rest"),
    ("other_command", "project/processes.py says"),
    ("missing_process", "has no Deployment"),
    ("short_grace", "terminationGracePeriodSeconds"),
    ("warm_sigterm", "REMAP_SIGTERM"),
    ("prestop_other_worker", "preStop must be"),
    ("edge_two_replicas", "one replica"),
    ("scaled_target_missing", "scaleTargetRef"),
    ("no_schema_wait", "does not wait for the schema"),
    ("secret_in_configmap", "in both the ConfigMap and the Secret"),
    ("no_secrets", "does not read both clip-config and clip-secrets"),
    ("summed_over_pods", "take its max across pods"),
])
def test_each_assertion_catches_its_mistake(rendered, mistake, expected):
    docs = copy.deepcopy(rendered["gpu-edge"])
    cm, deployments = _first(docs, "ConfigMap", "clip-config"), deploy_check.objects(docs, "Deployment")
    if mistake == "drop_setting":
        del cm["data"]["BULK_MAX_ATTEMPTS"]
    elif mistake == "unknown_setting":
        cm["data"]["BULK_MAX_ATTEMTPS"] = "3"
    elif mistake == "server_without_store":
        cm["data"]["QDRANT_URL"] = "http://qdrant:6333"  # VECTOR_STORE left at edge
    elif mistake == "other_command":
        deploy_check._container(deployments["worker-bulk"])["command"][9] = "4"  # -c 4
    elif mistake == "missing_process":
        docs.remove(deployments["worker-fetch"])
    elif mistake == "short_grace":
        deployments["worker-interactive"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 60
    elif mistake == "warm_sigterm":
        deploy_check._container(deployments["worker-bulk"])["env"] = []
    elif mistake == "prestop_other_worker":
        deploy_check._container(deployments["worker-bulk"])["lifecycle"]["preStop"]["exec"]["command"][-1] = "fetch"
    elif mistake == "edge_two_replicas":
        deployments["worker-vectors"]["spec"]["replicas"] = 2
    elif mistake == "scaled_target_missing":
        _first(docs, "ScaledObject", "worker-bulk")["spec"]["scaleTargetRef"]["name"] = "worker-gpu"
    elif mistake == "summed_over_pods":
        _first(docs, "ScaledObject", "worker-bulk")["spec"]["triggers"][0]["metadata"]["query"] = \
            "sum(clip_bulk_backlog_images)"
    elif mistake == "no_secrets":
        deploy_check._container(deployments["web"])["envFrom"].pop()
    elif mistake == "no_schema_wait":
        deployments["worker-fetch"]["spec"]["template"]["spec"]["initContainers"] = []
    elif mistake == "secret_in_configmap":
        cm["data"]["DATABASE_URL"] = "postgres://u:p@db/clip"
    try:
        errors = deploy_check.overlay_errors(docs)
    except deploy_check.CheckFailed as e:
        errors = [str(e)]
    assert any(expected in e for e in errors), errors


@needs_kubectl
@needs_tools
def test_the_linter_and_the_validator_refuse_the_usual_mistakes(rendered, tmp_path):
    docs = copy.deepcopy(rendered["cpu-qdrant"])
    web = deploy_check.objects(docs, "Deployment")["web"]
    c = deploy_check._container(web)
    del c["resources"]["limits"], c["readinessProbe"]
    c["securityContext"] = {"privileged": True}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump_all(docs))
    with pytest.raises(deploy_check.CheckFailed) as e:
        deploy_check.run_tool([str(TOOLS / "checkov"), "--config-file", str(deploy_check.CHECKOV_CONFIG),
                               "--directory", str(tmp_path)], "checkov")
    # CPU and memory limits, the readiness probe, a privileged container
    for check_id in ("CKV_K8S_11", "CKV_K8S_13", "CKV_K8S_9", "CKV_K8S_16"):
        assert check_id in str(e.value), check_id

    c["resources"]["limits"] = {"cpu": "2"}
    c["livenessProbe"]["httpGet"]["prot"] = 8000  # a misspelt field
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump_all(docs))
    with pytest.raises(deploy_check.CheckFailed, match="prot"):
        deploy_check.run_tool([str(TOOLS / "kubernetes-validate"), "--strict", "--quiet", "--no-warn",
                               str(tmp_path / "bad.yaml")], "kubernetes-validate")


@pytest.mark.django_db
def test_the_scalers_read_metrics_and_labels_the_service_exports(rendered):
    """Every metric a ScaledObject queries is on the web's /metrics, with every label the query
    selects on (a misspelt name or label would read nothing: KEDA scales on no data)."""
    import re

    from prometheus_client import generate_latest

    from embeddings import metrics

    exported = generate_latest(metrics.registry()).decode()
    labels = {}
    for line in exported.splitlines():
        if m := re.match(r"^(clip_[a-z_]+)\{(.*)\} ", line):
            labels.setdefault(m.group(1), set()).update(re.findall(r'(\w+)="', m.group(2)))
    queries = [t["metadata"]["query"] for docs in rendered.values()
               for so in deploy_check.objects(docs, "ScaledObject").values() for t in so["spec"]["triggers"]]
    assert {"clip_bulk_backlog_images", "clip_queue_oldest_age_seconds"} <= set().union(
        *(deploy_check.scaled_metrics(docs) for docs in rendered.values()))
    for query in queries:
        for name, selector in re.findall(r"(clip_[a-z_]+)(?:\{([^}]*)\})?", query):
            assert name in labels, (name, query)
            wanted = set(re.findall(r"(\w+)\s*=~?", selector))
            assert wanted <= labels[name], (query, wanted - labels[name])
