"""The one typed configuration object of the pipeline, built once per process and passed in.

``project/settings.py`` builds it from the environment (``PipelineConfig.from_env``); code in
``workers/`` never reads Django settings or the environment itself.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Literal, Mapping

Precision = Literal["fp32", "bf16", "fp16"]
Device = Literal["cpu", "cuda"]

#: The explicit choice for "the real architecture with seeded random weights" (tests, CI, demos on
#: machines that cannot download weights). Never chosen implicitly.
RANDOM_WEIGHTS = "random"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Everything the decode → preprocess → encode → sink pipeline needs to know.

    Attributes:
        model_name: open_clip architecture name, e.g. ``"ViT-B-32"``.
        pretrained: an open_clip pretrained tag (``"laion2b_s34b_b79k"``, ``"openai"``), a path to
            a local checkpoint file, or ``"random"`` for seeded random weights (explicit only).
        seed: torch seed used when ``pretrained == "random"``.
        device: ``"cpu"`` or ``"cuda"``.
        precision: weights and activations dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (CUDA only).
        batch_size: images per bulk chunk and per bulk forward pass.
        interactive_max_batch_size: largest interactive forward pass (dynamic batcher).
        interactive_max_queue_delay_ms: longest a lone interactive request waits for company (ms).
        decode_threads: threads that load and decode images in parallel (OpenCV releases the GIL).
        torch_threads: torch intra-op threads; ``None`` leaves torch's default.
        max_image_bytes: largest accepted encoded file (bytes).
        max_image_pixels: largest accepted header width × height (pixels); checked before decoding.
        decode_timeout_s: per-image decode time limit (s).
    """

    model_name: str = "ViT-B-32"
    pretrained: str = "laion2b_s34b_b79k"
    seed: int = 0
    device: Device = "cpu"
    precision: Precision = "fp32"
    batch_size: int = 64
    interactive_max_batch_size: int = 8
    interactive_max_queue_delay_ms: float = 5.0
    decode_threads: int = 2
    torch_threads: int | None = None
    max_image_bytes: int = 50 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    decode_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, not {self.precision!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError("precision fp16 needs device cuda; use bf16 on the CPU")
        if self.batch_size < 1 or self.interactive_max_batch_size < 1:
            raise ValueError("batch sizes must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "PipelineConfig":
        """Build from ``CLIP_*`` / ``PIPELINE_*`` variables (see README's configuration table).

        Raises:
            ValueError: a variable does not parse or is out of range.
        """
        env = os.environ if env is None else env
        d = cls()

        def get(name: str, default, cast=str):
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return cast(raw)
            except ValueError as e:
                raise ValueError(f"{name}={raw!r}: {e}") from e

        threads = get("TORCH_THREADS", None, int)
        return cls(
            model_name=get("CLIP_MODEL", d.model_name),
            pretrained=get("CLIP_PRETRAINED", d.pretrained),
            seed=get("CLIP_SEED", d.seed, int),
            device=get("CLIP_DEVICE", d.device),
            precision=get("CLIP_PRECISION", d.precision),
            batch_size=get("BULK_BATCH_SIZE", d.batch_size, int),
            interactive_max_batch_size=get("INTERACTIVE_MAX_BATCH_SIZE", d.interactive_max_batch_size, int),
            interactive_max_queue_delay_ms=get(
                "INTERACTIVE_MAX_QUEUE_DELAY_MS", d.interactive_max_queue_delay_ms, float
            ),
            decode_threads=get("DECODE_THREADS", d.decode_threads, int),
            torch_threads=threads,
            max_image_bytes=get("MAX_IMAGE_BYTES", d.max_image_bytes, int),
            max_image_pixels=get("MAX_IMAGE_PIXELS", d.max_image_pixels, int),
            decode_timeout_s=get("DECODE_TIMEOUT_S", d.decode_timeout_s, float),
        )

    def replace(self, **changes) -> "PipelineConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def is_checkpoint_file(self) -> bool:
        """True when ``pretrained`` names a local file rather than a tag or ``"random"``."""
        return self.pretrained != RANDOM_WEIGHTS and (
            os.sep in self.pretrained or self.pretrained.endswith((".pt", ".pth", ".bin", ".safetensors"))
        )

    @property
    def weights_id(self) -> str:
        """A stable name for the weights: the tag, ``random-seed<N>``, or ``file-<sha256[:12]>``.

        Raises:
            FileNotFoundError: ``pretrained`` names a checkpoint file that does not exist.
        """
        if self.pretrained == RANDOM_WEIGHTS:
            return f"random-seed{self.seed}"
        if self.is_checkpoint_file:
            return "file-" + _file_sha256(Path(self.pretrained))[:12]
        return self.pretrained

    @property
    def model_id(self) -> str:
        """Identifies the embedding space: ``"<model>/<weights_id>/<precision>"``.

        Two vectors are comparable only if their ``model_id`` is equal; point ids and collection
        names derive from it, so precisions and weights never mix unknowingly.
        """
        return f"{self.model_name}/{self.weights_id}/{self.precision}"

    @property
    def collection_name(self) -> str:
        """Qdrant collection for this embedding space, e.g. ``clip_vit-b-32_laion2b_s34b_b79k_fp32``."""
        return "clip_" + re.sub(r"[^a-z0-9]+", "_", self.model_id.lower()).strip("_")


@functools.cache
def _file_sha256(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint file {str(path)!r} does not exist; CLIP_PRETRAINED takes an open_clip tag "
            f"(e.g. laion2b_s34b_b79k, openai), a checkpoint file path, or 'random'"
        )
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
