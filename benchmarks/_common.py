"""Shared helpers of ``benchmarks.matrix`` and ``benchmarks.bulk``: the photo set made distinct,
stage statistics, markdown tables, plots and a description of the machine.

Import-light on purpose (no Django): the GPU check runs these benchmarks where only torch,
torchvision, open_clip and their neighbours are installed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from project import configuration, lanes  # noqa: E402 - after the checkout is on the path


def redis_prefix(environ=None) -> str:
    """``"<DEPLOYMENT_NAME>:"``: the start of every Redis key a stack started with ``environ``
    (default ``os.environ``, which a benchmark's stacks inherit) writes (project/lanes.py ``key_prefix``)."""
    return lanes.key_prefix(configuration.read(environ, names=["DEPLOYMENT_NAME"])["DEPLOYMENT_NAME"])


#: The benchmarks' stacks' Redis key prefix (they run under this process's environment).
REDIS_PREFIX = redis_prefix()

#: Where the real photos are looked for, first match wins: $BENCH_PHOTOS, a copy carried to the
#: GPU machine (benchmarks/gpu_check.sh), the shared data beside the checkout.
PHOTO_DIRS = [Path(p) for p in (os.environ.get("BENCH_PHOTOS"),) if p] + [
    ROOT / "out" / "gpu_data" / "photos",
    (ROOT / ".." / "shared" / "data" / "images" / "photos").resolve(),
]

def photo_dir() -> Path:
    """The first existing folder of :data:`PHOTO_DIRS`. Raises ``SystemExit`` naming them all."""
    for d in PHOTO_DIRS:
        if d.is_dir() and any(d.iterdir()):
            return d
    raise SystemExit("no photos found; set BENCH_PHOTOS or provide one of: " + ", ".join(map(str, PHOTO_DIRS)))


def photos() -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of every real photo, sorted by name."""
    return [(p.name, p.read_bytes()) for p in sorted(photo_dir().iterdir()) if p.is_file()]


def make_distinct(data: bytes, tag: str) -> bytes:
    """The same picture with new bytes: a JPEG comment (COM) segment after SOI, or a PNG ``tEXt``
    chunk after IHDR, carrying ``tag``. Decoding cost and pixels are unchanged; the sha256 differs,
    so deduplication does not skip the copy.

    Raises:
        ValueError: neither JPEG nor PNG.
    """
    payload = f"bench {tag}".encode()
    if data[:2] == b"\xff\xd8":
        return data[:2] + b"\xff\xfe" + struct.pack(">H", len(payload) + 2) + payload + data[2:]
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        ihdr_end = 8 + 8 + struct.unpack(">I", data[8:12])[0] + 4
        body = b"Comment\x00" + payload
        chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
        return data[:ihdr_end] + chunk + data[ihdr_end:]
    raise ValueError("make_distinct handles JPEG and PNG only")


def distinct_photos(n: int) -> list[tuple[str, bytes]]:
    """``n`` images: the real photos repeated in order, each copy with distinct bytes."""
    base = photos()
    out = []
    for i in range(n):
        name, data = base[i % len(base)]
        stem, _, ext = name.rpartition(".")
        out.append((f"{i:06d}_{stem}.{ext}", data if i < len(base) else make_distinct(data, str(i))))
    return out


def write_folder(folder: Path, images: Iterable[tuple[str, bytes]]) -> Path:
    """Write ``images`` into ``folder`` (created); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in images:
        (folder / name).write_bytes(data)
    return folder


def min_avg_max(values: Sequence[float]) -> dict[str, float]:
    """``{"min", "avg", "max", "p95"}`` of ``values`` (all 0 when empty)."""
    vals = sorted(values)
    if not vals:
        return {"min": 0.0, "avg": 0.0, "max": 0.0, "p95": 0.0}
    return {"min": vals[0], "avg": statistics.fmean(vals), "max": vals[-1],
            "p95": vals[min(len(vals) - 1, int(0.95 * len(vals)))]}


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A GitHub-flavoured markdown table; floats with one decimal (two below 10)."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict:
    """The machine a figure was measured on, for the header and the saved results of every benchmark.

    ``cpu`` is ``lscpu``'s model name (``/proc/cpuinfo``), ``cpu_flags`` says for each flag of
    ``workers.config.BENCHMARK_CPU_FLAGS`` (avx2, avx512f, avx512_bf16, amx_bf16, amx_tile) whether
    this CPU has it: machines sold as one kind differ, and bf16 is 10x slower than fp32 on one that
    only emulates it (../shared/NOTES.md). ``precision_auto`` is what ``CLIP_PRECISION=auto``
    resolves to on its CPU. Also cores, python, torch and the GPU when there is one.
    """
    from workers.config import BENCHMARK_CPU_FLAGS, available_cores, detect_hardware, resolve_precision

    hw = detect_hardware()
    info = {"cores": available_cores(), "cpu": hw.cpu_model or platform.processor() or "",
            "cpu_flags": {f: f in hw.cpu_flags for f in BENCHMARK_CPU_FLAGS},
            "precision_auto": resolve_precision("auto", "cpu", hardware=hw), "python": platform.python_version()}
    try:
        import torch
    except ImportError:  # a stack benchmark's driver needs no torch
        pass
    else:
        info.update(torch=torch.__version__, cuda=torch.cuda.is_available())
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_capability"] = "sm_%d%d" % torch.cuda.get_device_capability(0)
    try:
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def machine_line(info: dict) -> str:
    """One line for a benchmark's header: CPU model, cores, which relevant flags it has and lacks,
    and what ``auto`` precision picks; plus the GPU when there is one."""
    has = [f for f, on in info["cpu_flags"].items() if on]
    lacks = [f for f, on in info["cpu_flags"].items() if not on]
    line = (f"CPU: {info['cpu'] or 'unknown'}, {info['cores']} cores; flags: {' '.join(has) or '-'}"
            f"{' (no ' + ', '.join(lacks) + ')' if lacks else ''}; CLIP_PRECISION=auto -> {info['precision_auto']}")
    if info.get("gpu"):
        line += f"; GPU: {info['gpu']} ({info.get('gpu_capability', '?')})"
    return line


def begin(out: str) -> tuple[Path, dict]:
    """A benchmark's start: its output folder ``out`` made (absolute path returned) and the machine
    (:func:`machine`) printed on one line with the 1-minute load average, so every figure that
    follows can be read against how busy the cores were."""
    folder = Path(out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    hardware = machine()
    print(machine_line(hardware) + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    return folder, hardware


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON (dataclasses converted)."""
    def default(o):
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        return str(o)

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=default))


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def hms(seconds: float) -> str:
    """``H:MM:SS``."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def wait_for(fetch, ok, *, timeout: float, every: float = 1.0):
    """``fetch()`` every ``every`` s until ``ok(value)``; the value. Raises ``TimeoutError`` (with the
    last value) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached after {timeout} s: {json.dumps(value, default=str)[:2000]}")
        time.sleep(every)
