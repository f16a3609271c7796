"""``make deploy-check``: the Kubernetes manifests checked without a cluster.

For every overlay under ``deploy/kubernetes/overlays/``:

1. **render** it (``kubectl kustomize``);
2. **validate** it against the Kubernetes schemas, offline (``kubernetes-validate --strict``: unknown
   fields are errors); KEDA's ``ScaledObject`` has no schema there, so :func:`scaled_object_errors`
   checks what the service relies on (its target exists, each trigger is a Prometheus query with a
   numeric threshold);
3. **lint** it (``checkov``, every Kubernetes check but those ``deploy/kubernetes/.checkov.yaml``
   skips, each with its reason): resource limits, privileged or root pods, probes, ...;
4. **assert** it runs this checkout's service (:func:`overlay_errors`): every variable declared in
   ``project/configuration.py`` is in the ``clip-config`` ConfigMap or the ``clip-secrets`` Secret
   (and nothing else is), derived values follow their inputs, every process of
   ``project/processes.py`` is a Deployment running its exact command line after the schema is
   migrated, workers drain within their grace period; the store, GPU and KEDA objects fit together.

    python -m scripts.deploy_check [--tools .venv-deploy/bin] [--out DIR]

Exit status 0 when every overlay passes; otherwise 1, each problem on its own line. The tools:
``kubectl`` on ``PATH``; ``kubernetes-validate`` and ``checkov`` in ``--tools`` (their own
virtual environment, ``make deploy-tools``: checkov pins its own versions of common packages).
"""
from __future__ import annotations

import argparse
import base64
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from project import configuration, lanes, processes  # noqa: E402
from scripts import deploy_config  # noqa: E402

DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = DEPLOY / "overlays"
CHECKOV_CONFIG = DEPLOY / ".checkov.yaml"
#: Seconds a worker's grace period keeps beyond its two drain bounds (the preStop's wait, then
#: Celery's soft shutdown): the interpreter's exit and the pool's children.
GRACE_MARGIN_S = 10


class CheckFailed(RuntimeError):
    """A tool could not run or reported problems (the message says which and what)."""


def render(overlay: Path) -> list[dict]:
    """The overlay's objects, as ``kubectl kustomize`` renders them.

    Raises:
        CheckFailed: kustomize refused it (its message included).
    """
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True)
    if out.returncode:
        raise CheckFailed(f"{overlay.name}: kubectl kustomize failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def objects(docs: Iterable[dict], kind: str) -> dict[str, dict]:
    """``{name: object}`` of the ``kind`` objects among ``docs``."""
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}


def config_of(docs: list[dict]) -> dict[str, str]:
    """The ``clip-config`` ConfigMap's data and the ``clip-secrets`` Secret's (decoded), merged.

    Raises:
        CheckFailed: either is missing (kustomize appends a hash to generated names: matched on the prefix).
    """
    cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("clip-config")]
    sec = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("clip-secrets")]
    if len(cm) != 1 or len(sec) != 1:
        raise CheckFailed(f"expected one clip-config ConfigMap and one clip-secrets Secret, "
                          f"found {len(cm)} and {len(sec)}")
    data = {k: base64.b64decode(v).decode() for k, v in (sec[0].get("data") or {}).items()}
    data.update(sec[0].get("stringData") or {})
    overlap = set(data) & set(cm[0].get("data") or {})
    if overlap:
        raise CheckFailed(f"in both the ConfigMap and the Secret: {sorted(overlap)}")
    return {**(cm[0].get("data") or {}), **data}


def _container(deployment: dict, name: str | None = None) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next((c for c in containers if name is None or c["name"] == name), containers[0])


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def overlay_errors(docs: list[dict]) -> list[str]:
    """What keeps a rendered overlay from running this checkout's service: one line per problem."""
    errors: list[str] = []
    config = config_of(docs)
    declared = {v.name for v in configuration.VARS}
    missing = sorted(declared - set(config))
    unknown = sorted(set(config) - declared)
    if missing:
        errors.append(f"declared in project/configuration.py, absent from clip-config and clip-secrets: {missing}")
    if unknown:
        errors.append(f"in clip-config or clip-secrets, declared nowhere (a typo?): {unknown}")
    for name, (have, want) in deploy_config.derived(config).items():
        errors.append(f"{name}={have!r} does not follow from the rest of the configuration, which derives {want!r}")
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("clip-config"))
    for name in configuration.SECRET_NAMES:
        if name in (cm.get("data") or {}):
            errors.append(f"{name} is a credential: it belongs in clip-secrets, not the ConfigMap")

    deployments = objects(docs, "Deployment")
    try:
        commands = processes.commands(config)
    except configuration.ConfigurationError as e:
        return [*errors, f"the configuration does not read: {e}"]
    for name, cmd in commands.items():
        d = deployments.get(name)
        if d is None:
            errors.append(f"process {name} of project/processes.py has no Deployment")
            continue
        c = _container(d)
        if c.get("command") != shlex.split(cmd):
            errors.append(f"{name} runs {c.get('command')}, project/processes.py says {shlex.split(cmd)}")
        refs = [next(iter(r.values()))["name"] for r in c.get("envFrom") or []]  # generated: "<name>-<hash>"
        if not all(any(r.startswith(f"{want}-") for r in refs) for want in ("clip-config", "clip-secrets")):
            errors.append(f"{name} does not read both clip-config and clip-secrets (envFrom)")
        inits = d["spec"]["template"]["spec"].get("initContainers") or []
        if not any("migrate --check" in " ".join(i.get("command") or []) for i in inits):
            errors.append(f"{name} does not wait for the schema (an initContainer running `manage.py migrate --check`)")
        if name.startswith("worker-"):
            errors += _worker_drain_errors(name, d, cmd, float(config["WORKER_DRAIN_S"]))

    if config.get("VECTOR_STORE") == "edge":
        owns = processes.interactive_owns_store(configuration.read(config, ["STORE_OWNER", "VECTOR_STORE"]))
        owner = "worker-interactive" if owns else "worker-vectors"
        spec = deployments.get(owner, {}).get("spec", {})
        volumes = {v["name"]: v for v in spec.get("template", {}).get("spec", {}).get("volumes", [])}
        if spec.get("replicas") != 1 or spec.get("strategy", {}).get("type") != "Recreate":
            errors.append(f"edge store: {owner} must be one replica replaced with Recreate "
                          "(one owner of the folder)")
        if "persistentVolumeClaim" not in volumes.get("data", {}):
            errors.append(f"edge store: {owner}' /data (QDRANT_PATH) must be a persistent volume")
        scaled = [n for n, so in objects(docs, "ScaledObject").items()
                  if (so.get("spec") or {}).get("scaleTargetRef", {}).get("name") == owner]
        if scaled:
            errors.append(f"edge store: ScaledObject {scaled[0]} scales {owner}, the folder's one owner")
    elif config.get("VECTOR_STORE") == "server" and not config.get("QDRANT_URL"):
        errors.append("VECTOR_STORE=server without QDRANT_URL")

    gpu = [n for n in ("worker-interactive", "worker-bulk") if n in deployments
           and "nvidia.com/gpu" in (_container(deployments[n]).get("resources", {}).get("limits") or {})]
    for n in gpu:
        if _env(_container(deployments[n])).get("CLIP_DEVICE", config.get("CLIP_DEVICE")) != "cuda":
            errors.append(f"{n} has a GPU but does not embed on it (CLIP_DEVICE)")

    for name, so in objects(docs, "ScaledObject").items():
        errors += [f"ScaledObject {name}: {e}" for e in scaled_object_errors(so, deployments)]
    return errors


def _worker_drain_errors(name: str, d: dict, cmd: str, drain_s: float) -> list[str]:
    """A worker hands its tasks back within its grace period: SIGTERM is Celery's soft shutdown, the
    preStop drains the worker this command line names, and the grace period exceeds both bounds."""
    errors = []
    c = _container(d)
    if _env(c).get("REMAP_SIGTERM") != "SIGQUIT":
        errors.append(f"{name}: SIGTERM must start the soft shutdown (env REMAP_SIGTERM=SIGQUIT)")
    node = shlex.split(cmd)[shlex.split(cmd).index("-n") + 1].split("@")[0]
    pre = (c.get("lifecycle", {}).get("preStop") or {}).get("exec", {}).get("command") or []
    if "worker_drain" not in pre or pre[pre.index("worker_drain"):][1:3] != ["--name", node]:
        errors.append(f"{name}: preStop must be `manage.py worker_drain --name {node}`, not {pre}")
    grace = d["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    if grace < 2 * drain_s + GRACE_MARGIN_S:
        errors.append(f"{name}: terminationGracePeriodSeconds {grace} must be at least 2 x WORKER_DRAIN_S + "
                      f"{GRACE_MARGIN_S} = {2 * drain_s + GRACE_MARGIN_S:g}")
    return errors


#: Metric names a ScaledObject's query may read: ``clip_`` names (checked against the exported
#: ones by tests/test_deploy.py, which can load Django).
METRIC_NAME = re.compile(r"\bclip_[a-z_]+\b")
#: Cluster-wide gauges (embeddings/metrics.py): every web pod exports the same value, so a query sums
#: them over pods only after taking their max (else two web pods double the backlog).
CLUSTER_WIDE = {"clip_bulk_backlog_images", "clip_queue_messages", "clip_queue_oldest_age_seconds", "clip_images",
                "clip_broker_up"}


def scaled_object_errors(so: dict, deployments: dict[str, dict]) -> list[str]:
    """What is wrong with one KEDA ScaledObject (keda.sh/v1alpha1) for this service."""
    errors = []
    if so.get("apiVersion") != "keda.sh/v1alpha1":
        errors.append(f"apiVersion {so.get('apiVersion')!r}")
    spec = so.get("spec") or {}
    target = (spec.get("scaleTargetRef") or {}).get("name")
    if target not in deployments:
        errors.append(f"scaleTargetRef {target!r} is no Deployment of the overlay")
    lo, hi = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
        errors.append(f"replica counts {lo}..{hi}")
    triggers = spec.get("triggers") or []
    if not triggers:
        errors.append("no triggers")
    for t in triggers:
        meta = t.get("metadata") or {}
        if t.get("type") != "prometheus":
            errors.append(f"trigger type {t.get('type')!r}: the lanes are scaled on the service's own gauges")
            continue
        if t.get("metricType", "AverageValue") not in ("AverageValue", "Value"):
            errors.append(f"metricType {t.get('metricType')!r}")
        for key in ("serverAddress", "query", "threshold"):
            if not isinstance(meta.get(key), str) or not meta.get(key):
                errors.append(f"prometheus trigger without a string {key}")
        for key in ("threshold", "activationThreshold"):
            if key in meta:
                try:
                    float(meta[key])
                except (TypeError, ValueError):
                    errors.append(f"{key} {meta[key]!r} is not a number")
        query = meta.get("query") or ""
        if not METRIC_NAME.search(query):
            errors.append(f"query {query!r} reads none of the service's metrics")
        if CLUSTER_WIDE & set(METRIC_NAME.findall(query)) and not re.search(r"\bmax\b", query):
            errors.append(f"query {query!r}: every web pod exports the same cluster-wide gauge; "
                          f"take its max across pods")
    return errors


def scaled_metrics(docs: Iterable[dict]) -> set[str]:
    """Every ``clip_`` metric name the ScaledObjects among ``docs`` query."""
    return {m for so in objects(docs, "ScaledObject").values() for t in so["spec"].get("triggers", [])
            for m in METRIC_NAME.findall((t.get("metadata") or {}).get("query", ""))}


def run_tool(argv: list[str], what: str) -> None:
    """Run a checker; raise :class:`CheckFailed` with its output when it reports problems."""
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise CheckFailed(f"{what} failed ({out.returncode}):\n{(out.stdout + out.stderr).strip()}")


def check(tools: Path, out_dir: Path, log=print) -> list[str]:
    """Render, validate, lint and assert every overlay; returns the problems (empty: all pass).

    Raises:
        CheckFailed: a tool is missing.
    """
    kubectl = shutil.which("kubectl")
    validate, checkov = tools / "kubernetes-validate", tools / "checkov"
    for tool in (Path(kubectl or "kubectl"), validate, checkov):
        if not tool.exists():
            raise CheckFailed(f"{tool} is not installed (kubectl: apt-get install kubectl; "
                              f"the others: make deploy-tools)")
    problems = []
    if deploy_config.main(["--check"]):
        problems.append("deploy/kubernetes/base/config.env or secret.env is stale: make deploy-config")
    rendered = []
    for overlay in sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").exists()):
        started = time.monotonic()
        try:
            docs = render(overlay)
        except CheckFailed as e:
            problems.append(str(e))
            continue
        path = out_dir / f"{overlay.name}.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        rendered.append(path)
        found = overlay_errors(docs)
        problems += [f"{overlay.name}: {e}" for e in found]
        log(f"{overlay.name}: {len(docs)} objects rendered, {len(found)} problems "
            f"({time.monotonic() - started:.1f} s)")
    if rendered:
        started = time.monotonic()
        try:
            run_tool([str(validate), "--strict", "--quiet", "--no-warn", *map(str, rendered)], "kubernetes-validate")
        except CheckFailed as e:
            problems.append(str(e))
        log(f"kubernetes-validate: {len(rendered)} overlays ({time.monotonic() - started:.1f} s)")
        started = time.monotonic()
        try:
            run_tool([str(checkov), "--config-file", str(CHECKOV_CONFIG), "--directory", str(out_dir)], "checkov")
        except CheckFailed as e:
            problems.append(str(e))
        log(f"checkov: {len(rendered)} overlays ({time.monotonic() - started:.1f} s)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", type=Path, default=ROOT / ".venv-deploy" / "bin",
                    help="folder holding kubernetes-validate and checkov (default .venv-deploy/bin)")
    ap.add_argument("--out", type=Path, help="keep the rendered overlays here (default: a temporary folder)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="deploy-check-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        try:
            problems = check(args.tools, out)
        except CheckFailed as e:
            problems = [str(e)]
    for p in problems:
        sys.stderr.write(p + "\n")
    print(f"deploy-check: {'FAILED, ' + str(len(problems)) + ' problems' if problems else 'passed'} "
          f"in {time.monotonic() - started:.1f} s (lanes: {', '.join(lanes.ALL_QUEUES)})")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
