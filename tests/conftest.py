"""Shared fixtures: the shared real-image data, a random-weights model, isolated state folders."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The real image sets (photos, decoder edge cases): ``$SHARED_DIR``, else ``../shared`` beside the
#: checkout. Tests that need them are skipped when neither exists.
SHARED = Path(os.environ.get("SHARED_DIR") or ROOT / ".." / "shared").resolve()
IMAGES = SHARED / "data" / "images"


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
