"""The one typed configuration object of the pipeline, built once per process and passed in.

``project/configuration.py`` declares the environment variables that set it and builds it
(``pipeline_config``); code in ``workers/`` never reads Django settings or the environment itself.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]
#: What ``CLIP_PRECISION`` accepts: a precision, or ``"auto"`` (the service's default), which
#: :func:`resolve_precision` turns into ``"bf16"`` where the hardware computes bf16 natively and
#: ``"fp32"`` elsewhere, before the precision names anything (model id, collection, point ids).
PrecisionChoice = Literal["auto", "fp32", "bf16", "fp16"]
Device = Literal["cpu", "cuda"]
#: Where preprocessing runs: ``cpu`` (decode, resize and normalise on the CPU; float32 copied to the
#: device), ``gpu`` (decode and resize on the CPU; uint8 copied, normalised on the device: the
#: experiment's "preprocessing on the GPU"), ``gpu_decode`` (JPEGs decoded by nvJPEG through
#: ``torchvision.io.decode_jpeg(device="cuda")`` and resized there too; other formats as ``gpu``).
Preprocess = Literal["cpu", "gpu", "gpu_decode"]
#: What runs the image tower (``MODEL_BACKEND``): open_clip's own torch module, the same weights
#: exported to OpenVINO or ONNX Runtime, or ``"auto"``: the backend ``workers.backends`` adopted
#: for the CPU where there is one and it is installed, torch elsewhere and always on CUDA
#: (``workers.backends.resolve_backend``; none is adopted today: docs/benchmarks-model.md). The
#: text tower is always torch.
BackendChoice = Literal["auto", "torch", "openvino", "onnxruntime"]
BACKEND_CHOICES = ("auto", "torch", "openvino", "onnxruntime")

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
            ``"auto"`` is accepted and resolved at once (:func:`resolve_precision`, this machine's
            hardware), so the attribute always holds a concrete precision. The constructor's
            default stays ``"fp32"`` (library use and tests are the same everywhere); the
            service's default, ``CLIP_PRECISION`` unset, is ``"auto"`` (project/configuration.py).
        batch_size: images per bulk chunk and per bulk forward pass.
        preprocess: ``"cpu"``, ``"gpu"`` or ``"gpu_decode"`` (the last two need ``device="cuda"``);
            see :data:`Preprocess`.
        bulk_processes: prefork children of the bulk worker (``celery -c``). Two children overlap
            one chunk's load/decode/preprocess with the other's forward pass; the automatic thread
            counts divide the cores between them (see :meth:`threads`).
        interactive_max_batch_size: largest interactive forward pass (dynamic batcher).
        interactive_max_queue_delay_ms: longest a lone interactive request waits for company (ms).
        micro_batch: ``None``: a bulk chunk is one forward pass. ``n``: the chunk is run as
            forward passes of ``n`` images, each next one loaded, decoded and preprocessed while
            the model runs the current one (``BatchRunner.run_many`` inside the chunk); the
            automatic thread counts then split each process's share between the two.
        decode_threads: threads that load and decode images in parallel (OpenCV releases the GIL);
            ``None``: automatic (see :meth:`threads`).
        torch_threads: torch intra-op threads; ``None``: automatic (see :meth:`threads`).
        max_image_bytes: largest accepted encoded file (bytes).
        max_image_pixels: largest accepted header width × height (pixels); checked before decoding.
        decode_timeout_s: per-image decode time limit (s).
        preview_side: short side (px) of the preview a worker keeps of each picture it decodes,
            which re-embeds read when their model fits in it (``workers.preview``); 0: none drawn
            nor read.
        backend: what runs the image tower, see :data:`BackendChoice`. It is not part of the
            embedding space (:attr:`model_id`): every backend keeps cosine >= 0.999 to open_clip's
            own vectors at the same precision (``workers.backends``). The constructor's default is
            ``"torch"`` (library use and tests need no export); the service's, ``MODEL_BACKEND``
            unset, is ``"auto"`` (project/configuration.py).
        backend_cache_dir: where exported towers are cached; ``None``: ``var/model-cache`` under
            the working directory (the service passes ``$VAR_DIR/model-cache``).
    """

    model_name: str = "ViT-B-32"
    pretrained: str = "laion2b_s34b_b79k"
    seed: int = 0
    device: Device = "cpu"
    precision: Precision = "fp32"
    batch_size: int = 64
    preprocess: Preprocess = "cpu"
    bulk_processes: int = 2
    micro_batch: int | None = None
    interactive_max_batch_size: int = 8
    interactive_max_queue_delay_ms: float = 5.0
    decode_threads: int | None = None
    torch_threads: int | None = None
    max_image_bytes: int = 50 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    decode_timeout_s: float = 10.0
    preview_side: int = 384  # workers.preview.PREVIEW_SIDE (issue 43)
    backend: BackendChoice = "torch"
    backend_cache_dir: str | None = None
    #: CPU decode processes beside each worker process (``workers.decode_pool.planned_processes``):
    #: ``None`` automatic (0 on the CPU, the process's share of the cores less one on CUDA), 0 none.
    decode_processes: int | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        if self.precision == "auto":  # frozen: resolved once, here, before anything is named after it
            object.__setattr__(self, "precision", resolve_precision("auto", self.device))
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be auto, fp32, bf16 or fp16, not {self.precision!r}")
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError("precision fp16 needs device cuda; use bf16 on the CPU")
        if self.batch_size < 1 or self.interactive_max_batch_size < 1:
            raise ValueError("batch sizes must be >= 1")
        if self.preprocess not in ("cpu", "gpu", "gpu_decode"):
            raise ValueError(f"preprocess must be cpu, gpu or gpu_decode, not {self.preprocess!r}")
        if self.preprocess != "cpu" and self.device != "cuda":
            raise ValueError(f"preprocess {self.preprocess} needs device cuda; use preprocess cpu on the CPU")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {', '.join(BACKEND_CHOICES)}, not {self.backend!r}")
        if self.bulk_processes < 1:
            raise ValueError("bulk_processes must be >= 1")
        if self.preview_side < 0:
            raise ValueError(f"preview_side must be >= 0 (0: no previews), not {self.preview_side}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError("micro_batch must be >= 1 or None")
        for name in ("decode_threads", "torch_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None (automatic), not {value}")

    def threads(self, cpu_count: int | None = None) -> "ThreadPlan":
        """The decode and torch thread counts one worker process uses.

        Automatic values never oversubscribe the cores (pytorch/pytorch#37259: intra-op threads
        that compete for cores with other busy threads stall at every barrier). The bulk worker runs
        ``bulk_processes`` children side by side, so each gets ``budget = cores // bulk_processes``:

        - on the CPU, ``decode_threads = torch_threads = budget``: a child decodes *or* runs the
          model, never both at once, so ``bulk_processes × budget <= cores`` busy threads. The
          interactive worker overlaps its decode threads with its model thread, and with the
          default two children ``budget + budget <= cores`` holds for it too.
        - on CUDA the model runs on the device: ``torch_threads = 1`` (normalisation and copies
          only; it also keeps torch's resize in the decode threads single-threaded) and
          ``decode_threads = budget``.
        - with ``micro_batch`` on the CPU a process decodes *and* runs the model at once, so its
          budget is split: ``decode = budget // 2``, ``torch = budget - decode`` (at least 1 each).

        An explicit ``decode_threads`` / ``torch_threads`` wins (an operator's choice, benchmarks);
        :attr:`ThreadPlan.oversubscribed` then says whether it exceeds the cores.

        Args:
            cpu_count: cores to plan for (default: the cores this process may run on).
        """
        cores = cpu_count or available_cores()
        budget = max(1, cores // self.bulk_processes)
        overlapped = self.micro_batch is not None and self.device == "cpu"
        if overlapped:
            auto_decode = max(1, budget // 2)
            auto_torch = max(1, budget - auto_decode)
        else:
            auto_decode, auto_torch = budget, (budget if self.device == "cpu" else 1)
        decode = self.decode_threads or auto_decode
        torch_threads = self.torch_threads or auto_torch
        per_process = decode + torch_threads if overlapped else max(decode, torch_threads)
        busy = self.bulk_processes * per_process
        return ThreadPlan(decode=decode, torch=torch_threads, cores=cores, oversubscribed=busy > cores)

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


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    """Threads of one worker process (see :meth:`PipelineConfig.threads`).

    Attributes:
        decode: decode/preprocess pool size.
        torch: torch intra-op threads.
        cores: the cores planned for.
        oversubscribed: explicit settings ask for more busy threads than there are cores.
    """

    decode: int
    torch: int
    cores: int
    oversubscribed: bool


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


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


# --- the hardware a precision runs on --------------------------------------------------------------

#: ``/proc/cpuinfo`` flags of CPUs that compute bf16 natively: AVX-512 BF16 (``vdpbf16ps``: Intel
#: Cooper Lake and later, AMD Zen 4 and later) and AMX (Intel Sapphire Rapids and later). Elsewhere
#: torch emulates bf16 through fp32, about ten times slower than fp32 for the image tower; with
#: native bf16 it runs about twice fp32's rate (../shared/NOTES.md).
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
#: The CPU flags every benchmark prints with its figures: the vector widths and bf16 units that
#: decide what the model's matmuls cost (``benchmarks._common.machine``).
BENCHMARK_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
#: CUDA compute capability from which bf16 runs natively (Ampere, sm_80: bf16 tensor cores); older
#: GPUs emulate it (torch's ``torch.cuda.is_bf16_supported(including_emulation=False)`` uses the
#: same bound).
CUDA_NATIVE_BF16_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What decides whether bf16 is native here. Read without torch (:func:`detect_hardware`),
    so the web process, which names the collection after the precision too, resolves ``auto``
    exactly as the workers on the same machine do.

    Attributes:
        cpu_model: ``model name`` of ``/proc/cpuinfo`` (``""`` where there is none).
        cpu_flags: the CPU's feature flags (lower case, as ``/proc/cpuinfo`` spells them).
        cuda_capabilities: ``(major, minor)`` compute capability of each GPU NVML sees; empty
            when there is no GPU or NVML cannot be read.
    """

    cpu_model: str = ""
    cpu_flags: frozenset[str] = dataclasses.field(default=frozenset(), repr=False)  # ~100 names
    cuda_capabilities: tuple[tuple[int, int], ...] = ()

    def native_bf16(self, device: str) -> bool:
        """Whether ``device`` (``"cpu"``/``"cuda"``) computes bf16 natively: a CPU flag of
        :data:`NATIVE_BF16_CPU_FLAGS`, or every GPU at :data:`CUDA_NATIVE_BF16_CAPABILITY` or
        later (NVML's order need not be CUDA's, so a mixed machine counts as not native)."""
        if device == "cuda":
            return bool(self.cuda_capabilities) and min(self.cuda_capabilities) >= CUDA_NATIVE_BF16_CAPABILITY
        return any(f in self.cpu_flags for f in NATIVE_BF16_CPU_FLAGS)

    def describe(self, device: str) -> str:
        """One line for logs: the CPU model and its relevant flags, or the GPUs' capabilities."""
        if device == "cuda":
            caps = ", ".join(f"sm_{a}{b}" for a, b in self.cuda_capabilities) or "unknown (NVML unavailable)"
            return f"CUDA compute capability {caps}"
        flags = " ".join(f for f in BENCHMARK_CPU_FLAGS if f in self.cpu_flags) or "none of " + "/".join(
            BENCHMARK_CPU_FLAGS)
        return f"CPU {self.cpu_model or 'unknown'} (flags: {flags})"


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """``(model name, flags)`` of the first processor in ``path``; ``("", frozenset())`` where the
    file does not exist (not Linux) or cannot be read."""
    model, flags = "", frozenset()
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86 / ARM
            flags = frozenset(value.lower().split())
        if model and flags:
            break
    return model, flags


def cuda_capabilities() -> tuple[tuple[int, int], ...]:
    """Compute capability of every GPU, read through NVML (``nvidia-ml-py``), never through torch:
    initialising CUDA in the web process or a Celery parent before it forks breaks the children
    (celery/celery#3402). Empty when there is no GPU, no driver or no NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU as far as we can tell
        return ()
    try:
        return tuple(tuple(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i)))
                     for i in range(pynvml.nvmlDeviceGetCount()))
    except Exception:  # noqa: BLE001
        return ()
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


@functools.cache
def detect_hardware(*, cuda: bool = False) -> Hardware:
    """This machine's :class:`Hardware` (cached per process); GPUs are asked about only with ``cuda``."""
    model, flags = read_cpuinfo()
    return Hardware(cpu_model=model, cpu_flags=flags, cuda_capabilities=cuda_capabilities() if cuda else ())


def resolve_precision(requested: str, device: str, *, hardware: Hardware | None = None) -> Precision:
    """The concrete precision for ``CLIP_PRECISION=requested`` on ``device``.

    ``"auto"``: ``"bf16"`` where ``hardware`` computes it natively (:meth:`Hardware.native_bf16`),
    ``"fp32"`` otherwise (fp16 is never chosen: it needs care a default should not take). Any other
    value is returned unchanged and validated by :class:`PipelineConfig`.

    Args:
        hardware: what to decide on (tests inject it); default :func:`detect_hardware`.
    """
    if requested != "auto":
        return requested  # type: ignore[return-value]
    hardware = hardware or detect_hardware(cuda=device == "cuda")
    return "bf16" if hardware.native_bf16(device) else "fp32"


def emulated_precision_warning(config: PipelineConfig, *, hardware: Hardware | None = None) -> str | None:
    """A warning when ``config`` asks for bf16 on hardware that only emulates it, else ``None``.

    Args:
        hardware: default :func:`detect_hardware` for the config's device.
    """
    if config.precision != "bf16":
        return None
    hardware = hardware or detect_hardware(cuda=config.device == "cuda")
    if hardware.native_bf16(config.device):
        return None
    return (f"CLIP_PRECISION=bf16 on hardware without native bf16 ({hardware.describe(config.device)}): "
            f"torch emulates it, measured up to 10x SLOWER than fp32 (../shared/NOTES.md); "
            f"set CLIP_PRECISION=auto or fp32 unless this is meant")
