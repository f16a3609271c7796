"""Encode stage: open_clip model loading and ``encode_images`` / ``encode_texts``.

The model loads once per worker process, lazily, on first use (never at import, never in the web
process or the Celery parent before it forks: celery/celery#3402). Weights come from an open_clip
pretrained tag, a local checkpoint file, or, only when asked for explicitly with
``pretrained="random"``, seeded random weights of the real architecture.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from workers.backends import build_image_tower, resolve_backend
from workers.config import RANDOM_WEIGHTS, PipelineConfig, emulated_precision_warning
from workers.preprocess import PreprocessConfig

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class WeightsUnavailable(RuntimeError):
    """The configured weights cannot be loaded (unknown tag, missing file, no network)."""


class TextTowerMissing(RuntimeError):
    """A text was given to an encoder whose checkpoint holds only the image tower
    (:attr:`ClipEncoder.has_text` False); reason code ``text_tower_missing``."""

    code = "text_tower_missing"


#: The state-dict prefix of open_clip's image tower (``CLIP.visual``): a checkpoint whose every
#: tensor is under it is an image-only space (a fine-tuned image tower exported alone).
VISUAL_PREFIX = "visual."


class ClipEncoder:
    """An open_clip model ready to embed images and texts.

    Attributes:
        config: the :class:`PipelineConfig` it was built from.
        preprocess_config: the model's own preprocessing parameters.
        embed_dim: embedding dimension D (512 for ViT-B-32).
        has_text: whether the model has a text tower: False for a checkpoint file that holds only
            the image tower (``visual.*``), whose texts are refused (:class:`TextTowerMissing`).
        image_tower: the image tower on another runtime (``workers.backends.ImageTower``), or
            ``None``: open_clip's own torch module runs it (``config.backend`` torch, CUDA, or a
            backend that could not load here, logged as a WARNING).
        backend: what runs the image tower: ``"torch"``, ``"openvino"`` or ``"onnxruntime"``.
        load_ms: time spent building and loading the model (ms).
    """

    def __init__(self, config: PipelineConfig) -> None:
        """Build the model of ``config`` (see the class docstring).

        Logs a WARNING when ``config.precision`` is bf16 on hardware that only emulates it
        (``workers.config.emulated_precision_warning``: up to 10x slower than fp32), and when
        ``config.backend`` cannot run here (the image tower then runs on torch).

        Raises:
            WeightsUnavailable: the weights cannot be loaded.
            FileNotFoundError: ``pretrained`` names a checkpoint file that does not exist.
        """
        import open_clip  # heavy; only worker processes get here

        if (warning := emulated_precision_warning(config)) is not None:
            log.warning("%s", warning)
        #: torch intra-op threads of this encoder (``PipelineConfig.threads``: never more than
        #: this process's share of the cores unless set explicitly).
        self.torch_threads = config.threads().torch
        torch.set_num_threads(self.torch_threads)
        t0 = time.perf_counter()
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.precision]
        model, self.has_text = _create_model(open_clip, config)
        self.preprocess_config = PreprocessConfig.from_open_clip(open_clip.get_model_preprocess_cfg(model))
        # Exported from the fp32 tower before the cast below: the runtime applies the precision itself.
        self.image_tower = build_image_tower(
            resolve_backend(config.backend, config.device), model.visual, model_name=config.model_name,
            weights_id=config.weights_id, precision=config.precision,
            image_size=self.preprocess_config.size, threads=self.torch_threads,
            cache_dir=config.backend_cache_dir) if config.device == "cpu" else None
        self.backend = self.image_tower.backend if self.image_tower is not None else "torch"
        # Reduced precision = the weights cast (and the input cast to match), not autocast: on this
        # CPU autocast keeps fp32 master weights and re-casts per op, which measured slower than
        # the cast model (../shared/NOTES.md); the cast model runs bf16 matmuls end to end. Outputs are
        # normalised in fp32 (``_normalise``).
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = open_clip.get_tokenizer(config.model_name)
        self.embed_dim = int(self.model.text_projection.shape[-1]) if hasattr(self.model, "text_projection") \
            else int(self.model.visual.output_dim)
        self.load_ms = (time.perf_counter() - t0) * 1000
        log.info("loaded %s on %s (image tower: %s) in %.0f ms", config.model_id, config.device, self.backend,
                 self.load_ms)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> np.ndarray:
        """Embed a batch of preprocessed images.

        Args:
            pixels: ``(N, 3, S, S) float32`` on any device, normalised (see ``workers.preprocess``).

        Returns:
            ``(N, D) float32`` L2-normalised embeddings, on the CPU.
        """
        if self.image_tower is not None:
            return _normalise(torch.from_numpy(self.image_tower(pixels.to("cpu", torch.float32).numpy())))
        self._use_threads()
        x = pixels.to(device=self.device, dtype=self.dtype, non_blocking=True)
        out = self.model.encode_image(x)
        return _normalise(out)

    @torch.inference_mode()
    def encode_texts(self, texts: list[str]) -> np.ndarray:
        """Embed texts (tokenised with the model's own tokenizer, truncated to its context length).

        Returns:
            ``(N, D) float32`` L2-normalised embeddings.

        Raises:
            ValueError: ``texts`` is empty.
            TextTowerMissing: the checkpoint holds only the image tower.
        """
        if not texts:
            raise ValueError("encode_texts needs at least one text")
        if not self.has_text:
            raise TextTowerMissing(f"{self.config.model_id} holds only an image tower: texts cannot be embedded")
        self._use_threads()
        tokens = self.tokenizer(texts).to(self.device)
        return _normalise(self.model.encode_text(tokens))

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens the text tower reads of each text: its tokenizer's ids, start and end markers
        included, at most the context length (77 for CLIP: the rest is cut, as in
        :meth:`encode_texts`); padding (id 0) not counted. Empty ``texts``: ``[]``."""
        if not texts:
            return []
        return [int(n) for n in (self.tokenizer(texts) != 0).sum(dim=-1).tolist()]

    @property
    def image_tokens(self) -> int:
        """Positions the image tower reads per image: a ViT's patches plus its class token (50 for
        ViT-B/32 at 224 px); 1 for a tower without patches (a ResNet)."""
        grid = getattr(getattr(self.model, "visual", None), "grid_size", None)
        return int(grid[0] * grid[1] + 1) if grid else 1

    def _use_threads(self) -> None:
        # torch's thread count is per process; a process holding encoders of two configurations
        # (tests, benchmarks) gives each forward pass its own encoder's count.
        if torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)


def _normalise(out: torch.Tensor) -> np.ndarray:
    # Normalise in fp32: a bf16 norm loses ~3 significant digits.
    out = out.float()
    out = out / out.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return out.cpu().numpy()


def _create_model(open_clip, config: PipelineConfig):
    """The open_clip model of ``config`` and whether it has a text tower: ``(model, has_text)``.

    Raises:
        WeightsUnavailable: an unknown model or tag, or a checkpoint that does not load.
        FileNotFoundError: a checkpoint file that does not exist.
    """
    name = config.model_name
    if name not in open_clip.list_models():
        raise WeightsUnavailable(f"unknown open_clip model {name!r}")
    if config.pretrained == RANDOM_WEIGHTS:
        # Explicitly requested: the real architecture with seeded random weights.
        torch.manual_seed(config.seed)
        return open_clip.create_model(name, pretrained=None), True
    if config.is_checkpoint_file:
        config.weights_id  # raises FileNotFoundError with the options if the file is missing
        try:
            visual = _image_tower_only(config.pretrained)
            if visual is not None:
                model = open_clip.create_model(name, pretrained=None)
                model.visual.load_state_dict(visual, strict=True)
                return model, False
            return open_clip.create_model(name, pretrained=config.pretrained), True
        except Exception as e:  # open_clip raises RuntimeError/KeyError on a bad state dict
            raise WeightsUnavailable(f"checkpoint {config.pretrained!r} does not load into {name}: {e}") from e
    tags = open_clip.list_pretrained_tags_by_model(name)
    if config.pretrained not in tags:
        raise WeightsUnavailable(
            f"{config.pretrained!r} is not a pretrained tag of {name} (known: {', '.join(tags)}); "
            f"CLIP_PRETRAINED also takes a checkpoint file path or 'random'"
        )
    try:
        return open_clip.create_model(name, pretrained=config.pretrained), True
    except Exception as e:  # download failures surface as many exception types
        raise WeightsUnavailable(
            f"could not load weights {config.pretrained!r} for {name} ({e}); without network access "
            f"set CLIP_PRETRAINED to a local checkpoint file, or to 'random' for seeded random weights"
        ) from e


def _image_tower_only(path: str) -> dict | None:
    """The image tower's state dict (prefix :data:`VISUAL_PREFIX` removed) when every tensor of the
    checkpoint at ``path`` is under it, else None (a whole model: open_clip loads it). Memory-mapped,
    so looking costs no copy of a whole model's weights."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # a checkpoint in torch's legacy (non-zip) format cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not state:
        return None
    keys = [k.removeprefix("module.") for k in state]
    if not all(k.startswith(VISUAL_PREFIX) for k in keys):
        return None
    return {k.removeprefix(VISUAL_PREFIX): v for k, v in zip(keys, state.values())}


class EncoderHolder:
    """Loads a :class:`ClipEncoder` once, lazily, thread-safely (first caller pays ``load_ms``)."""

    def __init__(self, config: PipelineConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._encoder: ClipEncoder | None = None

    def get(self) -> ClipEncoder:
        """The encoder, loading it on first call. Raises :class:`WeightsUnavailable`."""
        if self._encoder is None:
            with self._lock:
                if self._encoder is None:
                    self._encoder = ClipEncoder(self._config)
        return self._encoder

    @property
    def loaded(self) -> bool:
        """Whether the model has been loaded in this process."""
        return self._encoder is not None
