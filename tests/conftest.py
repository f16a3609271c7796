"""Shared fixtures: the shared real-image data, a random-weights model, isolated state folders."""
from __future__ import annotations

import contextlib
import csv
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The real image sets (photos, decoder edge cases): ``$SHARED_DIR``, else ``../shared`` beside the
#: checkout. Tests that need them are skipped when neither exists.
SHARED = Path(os.environ.get("SHARED_DIR") or ROOT / ".." / "shared").resolve()
IMAGES = SHARED / "data" / "images"
# The suite runs the image tower on torch (open_clip itself): an exported tower costs seconds per
# worker start and per configuration. tests/workers/test_backends.py exercises the other backends
# explicitly; MODEL_BACKEND set outside wins (os.environ reaches the stacks the e2e tests start).
os.environ.setdefault("MODEL_BACKEND", "torch")


def manifest_rows(prefix: str) -> list[dict]:
    """Rows of ``../shared/data/images/MANIFEST.tsv`` whose path starts with ``prefix``."""
    path = IMAGES / "MANIFEST.tsv"
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [r for r in csv.DictReader(f, delimiter="\t") if r["path"].startswith(prefix)]


def photo_paths() -> list[Path]:
    """All 84 real photos (empty when ../shared is missing)."""
    return [IMAGES / r["path"] for r in manifest_rows("photos/")]


needs_shared = pytest.mark.skipif(not (IMAGES / "MANIFEST.tsv").exists(), reason="../shared/data is not present")


#: Fixtures that build the real model's configuration or the model itself: a test that takes one,
#: directly or through other fixtures (``service``, ``runner``, ``measured``...), is marked ``model``.
MODEL_FIXTURES = frozenset({"random_config", "encoder"})


def pytest_addoption(parser):
    parser.addoption(
        "--part", choices=("all", "parallel", "serial"), default="all",
        help="which part of the suite to run: 'parallel', the tests that start no stack of their own beside "
             "the others (spread over processes with pytest-xdist's -n), or 'serial', the end-to-end tests "
             "(marker e2e), run one after another on quiet cores; both with any -m or path given (make test)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark ``e2e`` every test under tests/e2e and ``model`` every test that loads the real model
    (:data:`MODEL_FIXTURES` in its fixture closure), before ``-m`` deselects: ``make test-fast``
    leaves both out. Runs first so that the marks exist when pytest's own hook filters. Then keeps
    the ``--part`` asked for: ``serial`` the ``e2e`` tests, ``parallel`` the others."""
    e2e = ROOT / "tests" / "e2e"
    for item in items:
        if item.path.is_relative_to(e2e) and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())) and item.get_closest_marker("model") is None:
            item.add_marker(pytest.mark.model)
    part = config.getoption("part")
    if part != "all":
        keep, left = [], []
        for item in items:
            (keep if (item.get_closest_marker("e2e") is not None) == (part == "serial") else left).append(item)
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = keep


@pytest.fixture(scope="session")
def random_config():
    """The real ViT-B-32 architecture with seeded random weights, selected explicitly."""
    from workers.config import PipelineConfig

    return PipelineConfig(pretrained="random", seed=0, torch_threads=os.cpu_count())


@pytest.fixture(scope="session")
def encoder(random_config):
    """One loaded ``ClipEncoder`` for the session (loading takes ~3 s)."""
    from workers.model import ClipEncoder

    return ClipEncoder(random_config)


@contextlib.contextmanager
def redis_server(folder: Path, *options: str):
    """A redis-server of the caller's own on a free port, with more ``options`` (``"--maxmemory",
    "2mb"``): ``(url, client)``; the test is skipped when redis-server is not installed."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(folder), *options], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0", client
    finally:
        p.kill()
        p.wait()


@pytest.fixture(autouse=True)
def outside_any_request():
    """Each test starts outside a web request: one whose response an earlier test never closed (the
    test client re-raises a view's exception without closing it) would otherwise hold this thread's
    after-response calls (``embeddings.deferred``) back for good."""
    from embeddings import deferred

    deferred.forget_request()


@pytest.fixture(scope="session", autouse=True)
def session_redis(tmp_path_factory):
    """The whole session's broker, result backend and lane-control Redis: a redis-server of the
    suite's own (or, without redis-server, a port nobody listens on), never the machine's
    ``redis://127.0.0.1:6379/0``, which may be a running deployment's. Set in the settings, in the
    Celery app and in ``REDIS_URL`` for the processes tests start (a stack's ``private_redis``
    still starts its own). Yields the URL."""
    from django.conf import settings

    from project.celery import app

    with contextlib.ExitStack() as stack:
        if shutil.which("redis-server"):
            url, _ = stack.enter_context(redis_server(tmp_path_factory.mktemp("session-redis")))
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
        saved = {name: getattr(settings, name) for name in ("REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")}
        saved_env = os.environ.get("REDIS_URL")
        backend = "project.results:DeadlineRedisBackend+" + url
        settings.REDIS_URL = settings.CELERY_BROKER_URL = url
        settings.CELERY_RESULT_BACKEND = backend
        app.conf.update(broker_url=url, result_backend=backend)
        os.environ["REDIS_URL"] = url
        try:
            yield url
        finally:
            for name, value in saved.items():
                setattr(settings, name, value)
            app.conf.update(broker_url=saved["CELERY_BROKER_URL"], result_backend=saved["CELERY_RESULT_BACKEND"])
            if saved_env is None:
                os.environ.pop("REDIS_URL", None)
            else:
                os.environ["REDIS_URL"] = saved_env


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of the test's own on a free port: ``(url, client)``; skipped when not installed."""
    with redis_server(tmp_path) as server:
        yield server
