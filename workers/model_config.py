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


@functools.cache
def preprocess_config(model_name: str) -> dict:
    """The image preprocessing open_clip applies for architecture ``model_name``, read without
    importing torch: open_clip's ``PreprocessCfg`` defaults (``open_clip/transform.py``, mean and std
    from ``open_clip/constants.py``, read as literals) merged with the architecture's own
    ``preprocess_cfg`` and ``vision_cfg.image_size``. A pretrained tag may override these at load
    time (``open_clip.get_model_preprocess_cfg`` in a process that loads the model is the final word).

    Returns:
        ``{"size", "mode", "mean", "std", "interpolation", "resize_mode", "fill_color"}``.

    Raises:
        ValueError: open_clip has no such architecture, or its constants cannot be read.
    """
    import ast

    cfg = model_config(model_name)
    spec = importlib.util.find_spec("open_clip")
    constants = {}
    for node in ast.parse((Path(list(spec.submodule_search_locations)[0]) / "constants.py").read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:  # not a literal: not one of the values read here
                continue
    try:
        out = {"size": 224, "mode": "RGB", "mean": list(constants["OPENAI_DATASET_MEAN"]),
               "std": list(constants["OPENAI_DATASET_STD"]), "interpolation": "bicubic", "resize_mode": "shortest",
               "fill_color": 0}
    except KeyError as e:
        raise ValueError(f"open_clip's constants.py has no {e}") from e
    out["size"] = cfg.get("vision_cfg", {}).get("image_size", out["size"])
    out.update({k: v for k, v in cfg.get("preprocess_cfg", {}).items() if k in out})
    return out
