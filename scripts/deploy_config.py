"""The Kubernetes base's configuration, generated from ``project/configuration.py``.

``deploy/kubernetes/base/config.env`` (the ``clip-config`` ConfigMap) holds every declared variable
that is not a credential, ``deploy/kubernetes/base/secret.env`` (the ``clip-secrets`` Secret) the
credentials of :data:`project.configuration.SECRET_NAMES`, with placeholders to replace. A value is
the variable's default unless :data:`BASE` sets it for a cluster; a derived default (HSTS follows
``DJANGO_HTTPS``, ``METRICS_DIR`` follows ``VAR_DIR``...) is written as derived from those values,
and ``scripts/deploy_check.py`` fails on a rendered overlay whose derived values no longer follow
its own inputs (an overlay that sets ``QDRANT_URL`` and forgets ``VECTOR_STORE``).

    python -m scripts.deploy_config --write   # rewrite both files (make deploy-config)
    python -m scripts.deploy_config --check   # exit 1 when they differ from the declarations

``tests/test_deploy.py`` fails while the committed files differ.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from project import configuration, lanes  # noqa: E402

DEPLOY = ROOT / "deploy" / "kubernetes"
CONFIG_ENV = DEPLOY / "base" / "config.env"
SECRET_ENV = DEPLOY / "base" / "secret.env"
#: What a placeholder credential starts with: replace every one before applying (docs/deploy.md).
PLACEHOLDER = "REPLACE-ME"

#: A cluster's values where the defaults suit one machine: every process on its own pod (bind all
#: addresses, state on the pod's /data volume), image bytes in S3 (pods never share a folder), behind
#: a TLS Ingress, each worker serving its own metrics; Redis is the base's ``redis`` Service. The bulk
#: lane scales to zero (KEDA), so readiness requires the other lanes only.
BASE: dict[str, str] = {
    "VAR_DIR": "/data",
    "WEB_BIND": "0.0.0.0",
    "WEB_PORT": "8000",
    "DJANGO_ALLOWED_HOSTS": "clip.example.com,localhost",
    "DJANGO_HTTPS": "1",
    "DJANGO_BEHIND_PROXY": "1",
    "DJANGO_CSRF_TRUSTED_ORIGINS": "https://clip.example.com",
    "REDIS_URL": "redis://redis:6379/0",
    "METRICS_PORT": "9100",
    "STORAGE_URL": "s3://clip-images",
    "CLIP_PRETRAINED": "laion2b_s34b_b79k",
    "READY_LANES": f"{lanes.INTERACTIVE},{lanes.VECTORS},{lanes.FETCH}",
}


def env_text(value: Any) -> str:
    """A typed value as the environment text that reads back as it (``configuration.read``): bools
    ``1``/``0``, lists comma-separated, ``None`` empty (unset, for the pipeline's variables)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def values(inputs: Mapping[str, str] = BASE) -> dict[str, str]:
    """``{name: text}`` of every declared variable under ``inputs`` (the rest at their defaults,
    derived ones derived from ``inputs``), credentials as placeholders."""
    env = {**inputs}
    for name in configuration.SECRET_NAMES:
        env.setdefault(name, f"{PLACEHOLDER}-{name.lower().replace('_', '-')}")
    typed = configuration.read(env)
    return {name: env[name] if name in env else env_text(value) for name, value in typed.items()}


def derived(config: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{name: (value in config, value derived from config's inputs)}`` for each variable with a
    derived default whose value in ``config`` (a rendered ConfigMap's data, Secret merged) is not
    what the rest of ``config`` derives: empty when the overlay is consistent."""
    names = [v.name for v in configuration.VARS if callable(v.default)]
    inputs = {k: v for k, v in config.items() if k not in names}
    want = configuration.read(inputs, names)
    have = configuration.read(config, names)
    return {n: (config.get(n, ""), env_text(want[n])) for n in names if want[n] != have[n]}


def render(names: list[str], all_values: Mapping[str, str], header: str) -> str:
    lines = [header]
    for name in names:
        lines.append(f"{name}={all_values[name]}")
    return "\n".join(lines) + "\n"


def files() -> dict[Path, str]:
    """``{path: text}`` of the two generated files."""
    v = values()
    secret = [n for n in v if n in configuration.SECRET_NAMES]
    plain = [n for n in v if n not in configuration.SECRET_NAMES]
    head = "# generated from project/configuration.py by `make deploy-config` (scripts/deploy_config.py): edit there"
    return {
        CONFIG_ENV: render(plain, v, head),
        SECRET_ENV: render(secret, v, head + f"\n# every {PLACEHOLDER} value must be replaced before applying "
                                           "(docs/deploy.md, \"Secrets\")"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = ap.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite base/config.env and base/secret.env")
    action.add_argument("--check", action="store_true", help="exit 1 when they differ from the declarations")
    args = ap.parse_args(argv)
    stale = []
    for path, text in files().items():
        if args.write:
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(ROOT)))
    if stale:
        sys.stderr.write(f"out of date (run make deploy-config): {', '.join(stale)}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
