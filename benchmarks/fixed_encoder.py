"""A benchmark-only encoder that costs nothing, and the Celery worker that uses it.

    python -m benchmarks.fixed_encoder -A project worker ...   # a Celery worker whose model is free

What it is for: measuring everything in the bulk path except the model (fetch, decode, previews,
thumbnails, Celery, SQL, the vectors worker and the store) on a machine without a GPU, where the
real model would hide every other cost (docs/scaling.md, "The CPU cost of everything but the model").

It is never selectable from the product's configuration: no setting names it and nothing under
``embeddings/``, ``workers/`` or ``project/`` imports this module. A process gets it only by being
started through this module's ``main``, which replaces ``workers.model.ClipEncoder`` in that process
before Celery starts (``benchmarks.bulk_path`` starts its bulk, interactive and shared workers so).

The vectors are unit vectors derived from an 8 × 8 grey thumbnail of the model input through a fixed
seeded projection: distinct pictures get distinct vectors (searches, the migration's quality gate
and the screen of unusable vectors still see real data), and the cost is one ``(N, 192) @ (192, D)``
matmul per batch.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

#: Side of the grey thumbnail the vector is drawn from: 8 × 8 × 3 channels = 192 inputs.
_GRID = 8


class FixedEncoder:
    """Drop-in for :class:`workers.model.ClipEncoder` that does no model work.

    Attributes (as ClipEncoder's): ``config``, ``preprocess_config`` (the architecture's own, read from
    open_clip's model config without building the model), ``embed_dim`` (its ``embed_dim``),
    ``load_ms``, ``torch_threads``, ``device``, ``dtype``.
    """

    def __init__(self, config) -> None:
        import open_clip

        from workers.preprocess import PreprocessConfig

        t0 = time.perf_counter()
        self.config = config
        self.torch_threads = config.threads().torch
        torch.set_num_threads(self.torch_threads)
        self.device = torch.device(config.device)
        self.dtype = torch.float32
        model_cfg = open_clip.get_model_config(config.model_name)
        if model_cfg is None:
            raise ValueError(f"unknown open_clip model {config.model_name!r}")
        self.embed_dim = int(model_cfg["embed_dim"])
        self.has_text = True
        size = model_cfg["vision_cfg"].get("image_size", 224)
        pre = {"size": (size, size) if isinstance(size, int) else tuple(size),
               "mode": "RGB", "mean": open_clip.OPENAI_DATASET_MEAN, "std": open_clip.OPENAI_DATASET_STD,
               "interpolation": "bicubic", "resize_mode": "shortest", "fill_color": 0}
        pre.update(model_cfg.get("preprocess_cfg", {}))
        self.preprocess_config = PreprocessConfig.from_open_clip(pre)
        rng = np.random.default_rng(config.seed)
        self._projection = torch.from_numpy(rng.standard_normal((3 * _GRID * _GRID, self.embed_dim), dtype=np.float32))
        self.tokenizer = open_clip.get_tokenizer(config.model_name)
        self.load_ms = (time.perf_counter() - t0) * 1000

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> np.ndarray:
        """``(N, 3, S, S)`` model input (any dtype, any device) → ``(N, D) float32`` unit vectors."""
        step = max(1, pixels.shape[-1] // _GRID)  # one pixel per cell: no pass over the whole input
        small = pixels[..., ::step, ::step][..., :_GRID, :_GRID].float().cpu().flatten(1)
        out = small @ self._projection
        out[:, 0] += 1e-3  # never all zero, even for a uniform picture
        return (out / out.norm(dim=-1, keepdim=True)).numpy()

    @torch.inference_mode()
    def encode_texts(self, texts: list[str]) -> np.ndarray:
        """Texts → ``(N, D) float32`` unit vectors from their token ids (deterministic per text)."""
        if not texts:
            raise ValueError("encode_texts needs at least one text")
        tokens = self.tokenizer(texts).float()[:, : 3 * _GRID * _GRID]
        tokens = torch.nn.functional.pad(tokens, (0, 3 * _GRID * _GRID - tokens.shape[1]))
        out = tokens @ self._projection
        out[:, 0] += 1e-3
        return (out / out.norm(dim=-1, keepdim=True)).numpy()

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [int(n) for n in (self.tokenizer(texts) != 0).sum(dim=-1).tolist()] if texts else []

    @property
    def image_tokens(self) -> int:
        return 50

    def _use_threads(self) -> None:
        pass


def _count_sql(out_dir: Path) -> None:
    """Count each task's SQL statements and their time (ms) into ``out_dir/sql-<pid>.jsonl``, one
    line per task: ``{"task", "statements", "writes", "sql_ms", "wall_ms", "images"}``."""
    from celery import signals
    from django.db import connection

    state: dict = {}

    def wrapper(execute, sql, params, many, context):
        t0 = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            state["n"] = state.get("n", 0) + 1
            state["ms"] = state.get("ms", 0.0) + (time.perf_counter() - t0) * 1000
            if not sql.lstrip()[:6].upper().startswith("SELECT"):
                state["w"] = state.get("w", 0) + 1

    @signals.task_prerun.connect(weak=False)
    def started(task=None, kwargs=None, **_):
        state.clear()
        state["t0"] = time.perf_counter()
        state["cm"] = connection.execute_wrapper(wrapper)
        state["cm"].__enter__()

    @signals.task_postrun.connect(weak=False)
    def finished(task=None, args=None, kwargs=None, **_):
        cm = state.pop("cm", None)
        if cm is None:
            return
        cm.__exit__(None, None, None)
        # a chunk task's images: its first list argument (``image_ids`` or ``items``)
        lists = [a for a in [*(args or ()), *(kwargs or {}).values()] if isinstance(a, list)]
        images = len(lists[0]) if lists else 0
        row = {"task": task.name if task else "?", "statements": state.get("n", 0), "writes": state.get("w", 0),
               "sql_ms": round(state.get("ms", 0.0), 2), "wall_ms": round((time.perf_counter() - state["t0"]) * 1000, 2),
               "images": images, "t": time.time()}
        with open(out_dir / f"sql-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    """``python -m benchmarks.fixed_encoder <celery arguments>``: a Celery worker whose encoders are
    :class:`FixedEncoder`; with ``BENCH_SQL_DIR`` set, each task's SQL is counted there."""
    import workers.model

    workers.model.ClipEncoder = FixedEncoder
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    if os.environ.get("BENCH_SQL_DIR"):
        import django

        django.setup()
        _count_sql(Path(os.environ["BENCH_SQL_DIR"]))
    from celery.bin.celery import main as celery_main

    sys.argv = ["celery", *sys.argv[1:]]
    celery_main()


if __name__ == "__main__":
    main()
