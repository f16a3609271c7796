"""Every environment variable is declared once (project/configuration.py), read only there, typed by
its rules, and the README's configuration tables are the ones generated from the declaration."""
from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest

from project import configuration
from project.configuration import BY_NAME, VARS, ConfigurationError, pipeline_config, read
from queueing import wait_model
from tests.conftest import ROOT
from workers.config import Hardware, PipelineConfig

#: The packages whose modules may not read the environment for a setting.
PACKAGES = ("project", "embeddings", "workers", "queueing")
#: Environment names code may touch outside the declaration, none of them a setting of ours: Django's
#: and Celery's entry points choose the settings module, settings.py hands METRICS_DIR to
#: prometheus_client (which reads PROMETHEUS_MULTIPROC_DIR itself), and workers/decode.py mirrors
#: OpenCV's own image-size limits.
NOT_SETTINGS = {"DJANGO_SETTINGS_MODULE", "PROMETHEUS_MULTIPROC_DIR", "OPENCV_IO_MAX_IMAGE_WIDTH",
                "OPENCV_IO_MAX_IMAGE_HEIGHT"}
SECRET = {"DJANGO_SECRET_KEY": "s" * 50}


def test_the_readme_tables_are_the_generated_ones():
    text = (ROOT / "README.md").read_text()
    assert configuration.BEGIN in text and configuration.END in text
    assert configuration.rewrite(text) == text, "README.md's configuration tables are stale: run `make config-docs`"


def test_every_variable_is_declared_once_with_a_group_a_type_and_a_one_line_meaning():
    names = [v.name for v in VARS]
    assert len(names) == len(set(names))
    groups = {key for key, _ in configuration.GROUPS}
    for v in VARS:
        assert v.group in groups, v.name
        assert v.meaning and "\n" not in v.meaning and "|" not in v.meaning, v.name
        assert v.type in configuration.TYPES[v.rules], v.name
        if callable(v.default) or v.default is configuration.REQUIRED:
            assert v.shown, f"{v.name}: a derived or required default says in words what it is"
    table = configuration.markdown()
    for v in VARS:
        assert table.count(f"\n| `{v.name}` |") == 1, v.name


#: Variables the docs set that are not the service's: docker compose's own interpolation (one GPU
#: worker per GPU, docs/scaling.md), glibc's, the browser test's screenshot folder (docs/ui.md),
#: benchmarks/gpu_check.sh's switch that leaves nvJPEG's wheel behind (docs/benchmarks-bulk.md), and
#: Celery's own switch that makes SIGTERM its soft shutdown (docs/deploy.md).
OTHER_DOCUMENTED = {"GPU_ID", "METRICS_HOST_PORT", "MALLOC_ARENA_MAX", "SITE_SCREENSHOTS", "GPU_CHECK_NO_NVJPEG",
                    "REMAP_SIGTERM"}


def test_every_variable_the_docs_set_or_tabulate_is_declared():
    """A ``NAME=value`` anywhere in README.md or docs/, and a name heading a row of a docs table."""
    found = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        names = set(re.findall(r"`([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)=", text))
        names |= set(re.findall(r"^\| `([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)` \|", text, flags=re.M))
        if unknown := sorted(names - set(BY_NAME) - OTHER_DOCUMENTED):
            found[path.name] = unknown
    assert found == {}


def env_reads(path: Path) -> list[tuple[str | None, int]]:
    """``(name, line)`` of every read of ``os.environ`` / ``os.getenv`` in ``path`` (``None`` where the
    name is not a literal) and of every ``environ.Env()`` reader it makes (as ``"environ.Env()"``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[tuple[str | None, int]] = []

    def literal(node: ast.AST | None) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Env" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "environ":
            found.append(("environ.Env()", node.lineno))
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "getenv")):
            continue
        parent = parents.get(node)
        name = None
        if node.attr == "getenv" and isinstance(parent, ast.Call):
            name = literal(parent.args[0] if parent.args else None)
        elif isinstance(parent, ast.Subscript):
            name = literal(parent.slice)
        elif isinstance(parent, ast.Attribute) and isinstance(call := parents.get(parent), ast.Call):
            name = literal(call.args[0] if call.args else None)
        elif isinstance(parent, ast.Compare):
            name = literal(parent.left)
        found.append((name, node.lineno))
    return sorted(found, key=lambda read: read[1])


def test_no_module_but_the_declaration_reads_the_environment_for_a_setting():
    offenders = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "project" / "configuration.py":
                continue
            bad = [(name, line) for name, line in env_reads(path) if name not in NOT_SETTINGS]
            if bad:
                offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}, "read settings through project.configuration (declare the name there)"


def test_the_scan_sees_every_kind_of_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('import os, environ\nos.environ["A"]\nos.environ.get("B", "1")\nos.getenv("C")\n'
                     '"D" in os.environ\nenv = os.environ\nenviron.Env()\n')
    assert env_reads(probe) == [("A", 2), ("B", 3), ("C", 4), ("D", 5), (None, 6), ("environ.Env()", 7)]


def test_defaults_are_typed_and_follow_the_variables_they_derive_from():
    v = read(SECRET)
    assert v["DJANGO_DEBUG"] is False and v["ADMISSION_CONTROL"] is True
    assert v["DJANGO_ALLOWED_HOSTS"] == ["127.0.0.1", "localhost", "testserver"] and v["INGEST_ROOTS"] == []
    assert v["VAR_DIR"] == ROOT / "var" and v["METRICS_DIR"] == str(ROOT / "var" / "prometheus")
    assert (v["VECTOR_STORE"], v["VECTORS_WRITE_SLICE"]) == ("edge", 32)
    assert v["QDRANT_PATH"] == str(ROOT / "var" / "qdrant-edge")
    assert (v["DJANGO_HSTS_SECONDS"], v["DJANGO_HSTS_PRELOAD"]) == (0, False)
    assert (v["CELERY_BULK_TIME_LIMIT_S"], v["INTERACTIVE_THREADS"]) == (1200, 16)
    assert isinstance(v["SPACE_CACHE_S"], float) and isinstance(v["UPLOAD_MAX_FILES"], int)
    server = read({**SECRET, "QDRANT_URL": "http://q:6333", "DJANGO_HTTPS": "yes", "VAR_DIR": "/srv/clip"})
    assert (server["VECTOR_STORE"], server["VECTORS_WRITE_SLICE"]) == ("server", 64)
    assert (server["DJANGO_HSTS_SECONDS"], server["DJANGO_HSTS_PRELOAD"]) == (31_536_000, True)
    local = read({"VECTOR_STORE": "local", "VAR_DIR": "/srv/clip"}, ["QDRANT_PATH"])  # a part read alone
    assert local == {"QDRANT_PATH": "/srv/clip/qdrant"}
    derived = read({"CELERY_VISIBILITY_TIMEOUT_S": "900", "INTERACTIVE_MAX_BATCH_SIZE": "4"},
                   ["CELERY_BULK_TIME_LIMIT_S", "INTERACTIVE_THREADS"])
    assert derived == {"CELERY_BULK_TIME_LIMIT_S": 300, "INTERACTIVE_THREADS": 8}


def test_defaults_come_from_their_sources():
    assert BY_NAME["ADMISSION_MARGIN_QUANTILE"].default == wait_model.MARGIN_QUANTILE
    assert BY_NAME["ADMISSION_MIN_MARGIN_SHARE"].default == wait_model.MIN_MARGIN_SHARE
    assert BY_NAME["ADMISSION_MAX_MARGIN_SHARE"].default == wait_model.MAX_MARGIN_SHARE
    fields = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}
    assert BY_NAME["BULK_BATCH_SIZE"].default == fields["batch_size"]
    assert BY_NAME["INTERACTIVE_MAX_BATCH_SIZE"].default == fields["interactive_max_batch_size"]
    # auto → fp32 without native bf16; the service's backend is auto (the constructor's torch), its cache in VAR_DIR
    assert pipeline_config({}, hardware=Hardware()) == PipelineConfig(
        backend="auto", backend_cache_dir=str(BY_NAME["VAR_DIR"].default / "model-cache"))


def test_settings_values_follow_django_environs_rules():
    v = read({**SECRET, "DJANGO_DEBUG": "", "DJANGO_HTTPS": "on", "DJANGO_ALLOWED_HOSTS": "a,,b",
              "SPACE_CACHE_S": "1,5", "LOG_LEVEL": "$LEVEL", "LEVEL": "DEBUG", "STORAGE_URL": ""})
    assert (v["DJANGO_DEBUG"], v["DJANGO_HTTPS"], v["DJANGO_ALLOWED_HOSTS"]) == (False, True, ["a", "b"])
    assert (v["SPACE_CACHE_S"], v["LOG_LEVEL"], v["STORAGE_URL"]) == (1.5, "DEBUG", "")
    assert read({"LOG_LEVEL": "$UNSET"}, ["LOG_LEVEL"]) == {"LOG_LEVEL": "INFO"}
    with pytest.raises(ConfigurationError, match="UPLOAD_MAX_FILES=''"):
        read({"UPLOAD_MAX_FILES": ""}, ["UPLOAD_MAX_FILES"])  # an empty number is refused, not the default
    with pytest.raises(ConfigurationError, match="Set the DJANGO_SECRET_KEY environment variable"):
        read({})
    with pytest.raises(ConfigurationError, match="refers back to itself"):
        read({"LOG_LEVEL": "$LOG_LEVEL"}, ["LOG_LEVEL"])


@pytest.mark.parametrize("env, message", [
    ({"STORE_OWNER": "web"}, "STORE_OWNER must be 'vectors' or 'interactive', not 'web'"),
    ({"STORE_OWNER": "interactive", "QDRANT_URL": "http://qdrant:6333"}, "STORE_OWNER=interactive is for an embedded"),
], ids=["unknown owner", "owner with a server"])
def test_settings_refuse_a_store_owner_they_cannot_honour(env, message):
    """The settings refuse at start what the deployment could not do (every process loads them)."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", "import project.settings"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **SECRET, **env})
    assert got.returncode != 0 and "ImproperlyConfigured" in got.stderr and message in got.stderr


def test_pipeline_values_follow_the_pipelines_own_rules():
    cfg = pipeline_config({"CLIP_MODEL": "", "BULK_MICRO_BATCH": "", "DECODE_TIMEOUT_S": "2.5", "TORCH_THREADS": "3"},
                          hardware=Hardware())
    assert (cfg.model_name, cfg.micro_batch, cfg.decode_timeout_s, cfg.torch_threads) == ("ViT-B-32", None, 2.5, 3)
    with pytest.raises(ValueError, match="INTERACTIVE_MAX_BATCH_SIZE='eight'"):
        pipeline_config({"INTERACTIVE_MAX_BATCH_SIZE": "eight"})
