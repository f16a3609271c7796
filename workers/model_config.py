"""Facts about open_clip models read without importing torch (for the web and vector processes).

open_clip ships one JSON file per architecture in ``open_clip/model_configs/``; we locate the package
with ``importlib.util.find_spec`` (which does not execute it) and read the JSON.
"""
from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path


@functools.cache
def model_config(model_name: str) -> dict:
    """open_clip's config dict for ``model_name`` (``embed_dim``, ``vision_cfg``, ...).

    Raises:
        ValueError: open_clip has no such architecture (the message lists some that exist).
    """
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("open_clip is not installed")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model_configs"
    path = folder / f"{model_name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.json"))
        raise ValueError(f"unknown open_clip model {model_name!r}; e.g. {', '.join(known[:12])}")
    return json.loads(path.read_text())


def embed_dim(model_name: str) -> int:
    """Embedding dimension of ``model_name`` (512 for ViT-B-32)."""
    return int(model_config(model_name)["embed_dim"])
