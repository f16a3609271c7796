"""Nothing the web process (or a Celery parent before it forks) imports pulls in torch or open_clip:
the model loads lazily inside the process that runs embedding tasks (celery/celery#3402)."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "import-probe")
import django
django.setup()
import project.urls, project.wsgi, embeddings.tasks, embeddings.admin, embeddings.api.urls  # noqa
from embeddings.services.queues import bulk, interactive, vectors  # noqa
import embeddings.services.interactive.upload, embeddings.services.interactive.search  # noqa
from project.celery import app
app.loader.import_default_modules()
heavy = sorted(m for m in ("torch", "open_clip", "torchvision") if m in sys.modules)
print(",".join(heavy))
"""


def test_web_and_celery_parent_imports_do_not_load_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
