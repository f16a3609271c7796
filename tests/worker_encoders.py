"""Real Celery workers whose model misbehaves on purpose, for the drain and readiness tests.

    python -m tests.worker_encoders -A project worker ...   # a Celery worker with this model

The model is :class:`benchmarks.fixed_encoder.FixedEncoder` (no model work, real unit vectors),
changed by the environment of the worker it runs in:

- ``TEST_ENCODER_DELAY_S``: each forward pass of pictures sleeps this long first, so a test can
  stop the worker while a chunk or a request is in the model;
- ``TEST_ENCODER_PASSES``: a folder where each pass of pictures writes one file as it starts (the
  test waits for it, and counts the passes: how much work a stop repeated);
- ``TEST_ENCODER_FAULT=nan``: every vector NaN, pictures and texts (a poisoned model).

Started only by :class:`EncoderStack` (a ``scripts.stack.Stack`` that starts its Celery workers
through this module), as ``benchmarks.bulk_path`` starts its own.
"""
from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks.fixed_encoder import FixedEncoder
from scripts.stack import Stack


class MisbehavingEncoder(FixedEncoder):
    """:class:`FixedEncoder` slowed, watched or poisoned by ``TEST_ENCODER_*`` (module docstring)."""

    def encode_images(self, pixels) -> np.ndarray:
        passes = os.environ.get("TEST_ENCODER_PASSES")
        if passes:
            (Path(passes) / f"{os.getpid()}-{uuid.uuid4().hex}").write_text(f"{time.time()} {len(pixels)}")
        time.sleep(float(os.environ.get("TEST_ENCODER_DELAY_S") or 0))
        return self._fault(super().encode_images(pixels))

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        return self._fault(super().encode_texts(texts))

    @staticmethod
    def _fault(vectors: np.ndarray) -> np.ndarray:
        if os.environ.get("TEST_ENCODER_FAULT") == "nan":
            vectors = np.full_like(vectors, np.nan)
        return vectors


class EncoderStack(Stack):
    """A :class:`Stack` whose Celery workers run :class:`MisbehavingEncoder`; the web is the product's."""

    def _spawn(self, name, cmd):
        argv = cmd.split() if isinstance(cmd, str) else list(cmd)
        if argv and argv[0] == "celery":
            argv = [sys.executable, "-m", "tests.worker_encoders", *argv[1:]]
        return super()._spawn(name, argv)


def main() -> None:
    """``python -m tests.worker_encoders <celery arguments>``: a Celery worker with this model."""
    import workers.model

    workers.model.ClipEncoder = MisbehavingEncoder
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    from celery.bin.celery import main as celery_main

    sys.argv = ["celery", *sys.argv[1:]]
    celery_main()


if __name__ == "__main__":
    main()
