"""Encode stage, image tower on another runtime: OpenVINO or ONNX Runtime instead of torch eager.

The tower is exported from the real loaded open_clip model (``model.visual``, so it carries the same
weights whatever ``pretrained`` is), compiled at the :class:`~workers.config.PipelineConfig`'s
precision, and cached on disk under a key of the model name, the weights id, the precision and the
runtime's version, so a second worker start loads the export instead of making it again. The text
tower always stays torch/open_clip.

The embedding space (``PipelineConfig.model_id``: model, weights, precision) does not name the
backend. That holds only because every backend here gives vectors at cosine >= 0.999 to
open_clip's own at the same precision, image by image (``tests/workers/test_backends.py``,
``docs/benchmarks-model.md``); a backend that cannot keep that bound must not be added here, it
would be a new embedding space.

A backend that is not installed or fails to export or compile is not an error: :func:`build_image_tower`
logs a WARNING naming the reason and returns ``None``, and the encoder runs torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

from workers.config import BACKEND_CHOICES

log = logging.getLogger(__name__)

Backend = Literal["torch", "openvino", "onnxruntime"]
#: The backend ``auto`` picks on the CPU where it is installed: one at least 1.5x torch eager's
#: images/s at cosine >= 0.999 to open_clip's own output, on these cores. None is (OpenVINO bf16:
#: 0.95x to 1.3x by batch size; ONNX Runtime slower; docs/benchmarks-model.md, ``make bench-model``),
#: so ``auto`` runs torch; ``openvino`` and ``onnxruntime`` stay explicit choices.
ADOPTED_CPU_BACKEND: Backend | None = None
#: The default cache folder of exported towers, relative to the working directory when
#: ``PipelineConfig.backend_cache_dir`` is unset (the service sets ``$VAR_DIR/model-cache``).
DEFAULT_CACHE_DIR = Path("var") / "model-cache"
#: Version of the cache layout; bumping it rebuilds every cached export.
_LAYOUT = 1


def resolve_backend(requested: str, device: str, *, installed: Callable[[str], bool] | None = None) -> Backend:
    """The backend to run for ``MODEL_BACKEND=requested`` on ``device``.

    ``"auto"``: :data:`ADOPTED_CPU_BACKEND` on the CPU where there is one and its module imports,
    else ``"torch"``.
    On CUDA always ``"torch"`` (the runtimes here are built for the CPU). An explicit backend is
    returned as asked on the CPU; :func:`build_image_tower` falls back to torch if it cannot load.

    Raises:
        ValueError: ``requested`` is not one of :data:`BACKEND_CHOICES` (the message names them).
    """
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, not {requested!r}")
    if device != "cpu":
        return "torch"
    if requested == "auto":
        installed = installed or _installed
        adopted = ADOPTED_CPU_BACKEND
        return adopted if adopted is not None and installed(adopted) else "torch"
    return requested  # type: ignore[return-value]


def _installed(backend: str) -> bool:
    if backend == "torch":
        return True
    try:
        _runtime(backend)
    except ImportError:
        return False
    return True


def _runtime(backend: str):
    """The runtime's module (imported on first use: heavy). Raises ``ImportError``."""
    if backend == "openvino":
        import openvino

        return openvino
    if backend == "onnxruntime":
        import onnxruntime

        return onnxruntime
    raise ValueError(f"no runtime module for backend {backend!r}")


@dataclasses.dataclass
class TowerStats:
    """What building a tower did (tests and benchmarks read it).

    Attributes:
        from_cache: the export was loaded from the cache rather than made.
        export_s: seconds spent exporting the torch module (0 when loaded from the cache).
        compile_s: seconds spent loading and compiling the export for this CPU.
        path: the cached export's folder.
    """

    from_cache: bool = False
    export_s: float = 0.0
    compile_s: float = 0.0
    path: Path | None = None


class ImageTower:
    """A compiled image tower: ``(N, 3, S, S) float32`` pixels → ``(N, D) float32`` features.

    Features are the tower's raw output (not yet normalised), as ``model.encode_image(x)``. Calls
    are serialised by a lock: one compiled model holds one inference request.

    Attributes:
        backend: ``"openvino"`` or ``"onnxruntime"``.
        precision: the precision it computes in (``"fp32"`` or ``"bf16"``).
        stats: :class:`TowerStats` of its build.
    """

    def __init__(self, backend: str, precision: str, run: Callable[[np.ndarray], np.ndarray],
                 stats: TowerStats) -> None:
        self.backend = backend
        self.precision = precision
        self.stats = stats
        self._run = run
        self._lock = threading.Lock()

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        """Features of ``pixels`` (``(N, 3, S, S) float32``, C-contiguous) as ``(N, D) float32``."""
        with self._lock:
            return np.asarray(self._run(np.ascontiguousarray(pixels, dtype=np.float32)), dtype=np.float32)

    def __repr__(self) -> str:
        return f"ImageTower({self.backend}, {self.precision}, from_cache={self.stats.from_cache})"


def build_image_tower(backend: str, visual, *, model_name: str, weights_id: str, precision: str,
                      image_size: int | tuple[int, int], threads: int, cache_dir: str | Path | None = None,
                      ) -> ImageTower | None:
    """The image tower ``visual`` (open_clip's ``model.visual``, fp32, on the CPU) on ``backend``.

    Args:
        backend: ``"torch"`` (returns ``None``: run open_clip itself), ``"openvino"`` or ``"onnxruntime"``.
        visual: the loaded tower, in fp32 (exported as it is: the same weights as the torch model);
            set to eval mode with parameters that require no grad (an inference-only tower).
        model_name, weights_id, precision: name the cache entry (``PipelineConfig.model_name``,
            ``.weights_id``, ``.precision``) together with the runtime's version.
        image_size: input ``(height, width)`` or side S in pixels (the model's preprocessing size,
            224 for ViT-B-32).
        threads: the runtime's intra-op threads (``PipelineConfig.threads().torch``).
        cache_dir: where exports are cached (default :data:`DEFAULT_CACHE_DIR`).

    Returns:
        The tower, or ``None`` when ``backend`` is torch or cannot run here: its module is missing,
        or the export or compilation raised (logged as a WARNING naming the reason; the caller
        runs torch). A corrupt or incompatible cache entry is removed and made again.
    """
    if backend == "torch":
        return None
    visual.eval().requires_grad_(False)
    image_size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    try:
        runtime = _runtime(backend)
    except ImportError as e:
        log.warning("MODEL_BACKEND %s is not installed (%s): the image tower runs on torch", backend, e)
        return None
    build = {"openvino": _build_openvino, "onnxruntime": _build_onnxruntime}[backend]
    version = runtime.__version__ if hasattr(runtime, "__version__") else runtime.get_version()
    entry = Path(cache_dir or DEFAULT_CACHE_DIR) / _cache_key(backend, version, model_name, weights_id, precision)
    try:
        return build(runtime, visual, entry, precision=precision, image_size=image_size, threads=threads)
    except Exception as e:  # noqa: BLE001 - any failure of a runtime means "run torch", never a crash
        log.warning("MODEL_BACKEND %s could not build the image tower of %s (%s: %s): the image tower runs on "
                    "torch", backend, model_name, type(e).__name__, e)
        return None


def _cache_key(backend: str, version: str, model_name: str, weights_id: str, precision: str) -> str:
    """A folder name: readable prefix + a digest of every part (tags and versions may hold any character)."""
    parts = json.dumps([_LAYOUT, backend, str(version), model_name, weights_id, precision])
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{backend}-{model_name}-{precision}")
    return f"{safe}-{hashlib.sha256(parts.encode()).hexdigest()[:16]}"


def _cached_export(entry: Path, filename: str, export: Callable[[Path], None], load: Callable[[Path], object],
                   stats: TowerStats):
    """``load(entry / filename)``, exporting it first when absent; a file that does not load is
    exported again once. The export is written into a temporary folder renamed into place, so a
    worker killed mid-export or two workers exporting at once never leave a partial entry."""
    path = entry / filename
    stats.path = entry
    if path.is_file():
        t0 = time.perf_counter()
        try:
            loaded = load(path)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: make it again
            log.warning("cached image tower %s does not load (%s: %s): exporting it again", path, type(e).__name__, e)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            stats.from_cache, stats.compile_s = True, time.perf_counter() - t0
            return loaded
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".", suffix=".tmp", dir=entry.parent))
    try:
        t0 = time.perf_counter()
        export(tmp / filename)
        stats.export_s = time.perf_counter() - t0
        try:
            os.rename(tmp, entry)
        except OSError:  # another process renamed its own export into place first: use that one
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    loaded = load(path)
    stats.compile_s = time.perf_counter() - t0
    return loaded


def _example(image_size: tuple[int, int]):
    import torch

    return torch.zeros(1, 3, *image_size, dtype=torch.float32)


def _build_openvino(ov, visual, entry: Path, *, precision: str, image_size: tuple[int, int], threads: int) -> ImageTower:
    """OpenVINO IR with a dynamic batch, compiled for the CPU with ``INFERENCE_PRECISION_HINT``
    bf16 (AMX / AVX-512 BF16 tiles where the CPU has them) or f32, the LATENCY hint (one stream:
    the worker's own batch is the parallelism) and ``threads`` inference threads."""
    import torch

    core = ov.Core()
    stats = TowerStats()

    def export(path: Path) -> None:
        with torch.no_grad():  # one MultiheadAttention path in the trace and its check (no fast-path switch)
            model = ov.convert_model(visual.eval(), example_input=_example(image_size),
                                     input=[(-1, 3, *image_size)])
        ov.save_model(model, str(path), compress_to_fp16=False)

    def load(path: Path):
        return core.compile_model(core.read_model(str(path)), "CPU", {
            "INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32",
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
        })

    compiled = _cached_export(entry, "visual.xml", export, load, stats)
    request = compiled.create_infer_request()

    def run(x: np.ndarray) -> np.ndarray:
        return request.infer({0: x}, share_inputs=True)[0].copy()

    return ImageTower("openvino", "bf16" if precision == "bf16" else "fp32", run, stats)


def _build_onnxruntime(ort, visual, entry: Path, *, precision: str, image_size: tuple[int, int], threads: int) -> ImageTower:
    """ONNX (opset 17, dynamic batch) on ONNX Runtime's CPU execution provider, in fp32 whatever
    ``precision`` says: its CPU provider has no bf16 kernels for these operators. fp32 is within
    the bound of the bf16 space too (the bound is what decides, see the module docstring)."""
    import torch

    stats = TowerStats()

    def export(path: Path) -> None:
        # nn.MultiheadAttention's inference fast path (aten::_native_multi_head_attention) has no
        # ONNX operator: export the composed path, the same arithmetic.
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with torch.no_grad():
                torch.onnx.export(visual, (_example(image_size),), str(path), input_names=["pixels"],
                                  output_names=["features"], opset_version=17, dynamo=False,
                                  dynamic_axes={"pixels": {0: "batch"}, "features": {0: "batch"}})
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)

    def load(path: Path):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    session = _cached_export(entry, "visual.onnx", export, load, stats)

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {"pixels": x})[0]

    return ImageTower("onnxruntime", "fp32", run, stats)
