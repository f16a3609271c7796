"""The seed experiment's matrix, in process: concurrent requests × request sizes × batch sizes ×
where preprocessing runs, with the per-stage min / max / avg table and the % change against batch 16.

    python -m benchmarks.matrix                 # 30 requests × 50 and × 100 images, batch 16/32/64
    python -m benchmarks.matrix --quick         # 6 requests × 10 and × 20 images: a minute here
    make bench-matrix [BENCH_ARGS="--quick"]

The experiment (CLIP ViT-B/32 on a T4) sent 30 concurrent requests of 50 (and of 100) images to a
service that decoded on a thread pool and embedded in batches of 16, 32 or 64, with preprocessing
on the CPU or on the GPU. Here the service is the worker library itself, without Celery: each of
``--requests`` client threads starts at the same instant, splits its images into batches of the
batch size, prepares each batch on the process's shared decode pool (``BatchRunner.prepare``) and
embeds it on the one model (``BatchRunner.embed`` under a lock). Decoding of some requests
therefore overlaps the forward passes of others, as in the service's lanes.

Per request, in milliseconds (the experiment's columns): ``load``, ``decode``, ``decode_wait``
(an image's wait for a free decode thread) and ``preprocess`` (resize and crop per image, plus the
batch's normalisation and copy to the device) are summed over the request's images; ``embed`` is
the sum of its forward passes; ``model_wait`` (extra column) its batches' wait for the model;
``total`` the request's wall time from the common start to its last vector. Images are read from
the photo files (page cache) for each use.

Rows ``preprocess = gpu`` / ``gpu_decode`` appear only where CUDA exists (``PipelineConfig``:
``gpu`` normalises on the device, ``gpu_decode`` also decodes JPEGs with nvJPEG). CPU % (psutil)
and GPU busy % (NVML) are sampled once a second per cell.

Writes to ``--out`` (default ``var/bench/matrix``): ``results.json``, ``matrix.md`` (what is
printed), ``matrix_stages.png`` and ``matrix_throughput.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from pathlib import Path

from benchmarks._common import ROOT, machine, machine_line, markdown_table, min_avg_max, photo_dir, pyplot, write_json

STAGES = ("load", "decode", "decode_wait", "preprocess", "embed", "model_wait", "total")


@dataclasses.dataclass
class Cell:
    """One cell of the matrix: per-request stage sums (ms) and what the cell achieved."""

    preprocess: str
    images: int
    batch_size: int
    requests: int
    per_request: list[dict[str, float]]
    wall_s: float
    images_per_s: float
    timeouts: int
    cpu_percent: float | None
    gpu_percent: float | None

    def stats(self, stage: str) -> dict[str, float]:
        return min_avg_max([r[stage] for r in self.per_request])


def run_cell(runner, files: list[Path], *, requests: int, images: int, batch_size: int, timeout_s: float,
             sampler) -> dict:
    """``requests`` client threads × ``images`` each, in batches of ``batch_size``."""
    model_lock = threading.Lock()
    start = threading.Barrier(requests + 1)
    per_request: list[dict[str, float] | None] = [None] * requests
    errors: list[BaseException] = []

    def client(r: int) -> None:
        keys = [str(files[(r * images + i) % len(files)]) for i in range(images)]
        sums = dict.fromkeys(STAGES, 0.0)
        start.wait()
        t0 = time.perf_counter()
        try:
            for b in range(0, images, batch_size):
                prepared = runner.prepare(keys[b : b + batch_size], lambda k: Path(k).read_bytes())
                w0 = time.perf_counter()
                with model_lock:
                    sums["model_wait"] += (time.perf_counter() - w0) * 1000
                    result = runner.embed(prepared)
                if result.failed:
                    raise RuntimeError(f"unexpected failures: {result.failed[:3]}")
                t = result.timings
                for stage in ("load", "decode", "decode_wait", "preprocess", "embed"):
                    sums[stage] += getattr(t, stage)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        sums["total"] = (time.perf_counter() - t0) * 1000
        per_request[r] = sums

    threads = [threading.Thread(target=client, args=(r,), name=f"client-{r}") for r in range(requests)]
    for t in threads:
        t.start()
    start.wait()
    t0, wall0 = time.perf_counter(), time.time()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    samples = sampler.samples(since=wall0)
    cpu = [s.cpu_percent for s in samples]
    gpu = [s.gpu_percent for s in samples if s.gpu_percent is not None]
    return {"per_request": per_request, "wall_s": wall, "images_per_s": requests * images / wall,
            "timeouts": sum(1 for p in per_request if p["total"] > timeout_s * 1000),
            "cpu_percent": sum(cpu) / len(cpu) if cpu else None, "gpu_percent": sum(gpu) / len(gpu) if gpu else None}


def stage_table(cells: list[Cell]) -> str:
    """Rows: stages; columns: min / max / avg per batch size, and the avg's % change against the
    first (smallest) batch size."""
    base = cells[0]
    headers = ["stage (ms per request)"]
    for c in cells:
        headers += [f"b{c.batch_size} min", f"b{c.batch_size} max", f"b{c.batch_size} avg"]
        if c is not base:
            headers.append(f"b{c.batch_size} vs b{base.batch_size}")
    rows = []
    for stage in STAGES:
        row = [stage]
        for c in cells:
            s = c.stats(stage)
            row += [s["min"], s["max"], s["avg"]]
            if c is not base:
                b = base.stats(stage)["avg"]
                row.append(f"{(s['avg'] - b) / b * 100:+.0f} %" if b > 0 else "")
        rows.append(row)
    return markdown_table(headers, rows)


def summary_table(cells: list[Cell], timeout_s: float) -> str:
    rows = []
    for c in cells:
        total = c.stats("total")
        share = (sum(r["embed"] for r in c.per_request) / sum(r["total"] for r in c.per_request) * 100)
        rows.append([c.preprocess, c.images, c.batch_size, c.requests, round(c.images_per_s, 1), total["avg"] / 1000,
                     total["p95"] / 1000, f"{share:.0f} %", c.timeouts,
                     None if c.cpu_percent is None else round(c.cpu_percent),
                     None if c.gpu_percent is None else round(c.gpu_percent)])
    return markdown_table(["preprocess", "images/request", "batch", "requests", "images/s", "latency avg (s)",
                           "latency p95 (s)", "embed share of request", f"over {timeout_s:g} s", "CPU %",
                           "GPU busy %"], rows)


def plot(cells: list[Cell], out: Path) -> list[Path]:
    plt = pyplot()
    groups = sorted({(c.images, c.preprocess) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    shown = [s for s in STAGES if s != "total"]
    for ax, (images, prep) in zip(axes[0], groups):
        row = [c for c in cells if (c.images, c.preprocess) == (images, prep)]
        width = 0.8 / len(row)
        for i, c in enumerate(row):
            ax.bar([x + i * width for x in range(len(shown))], [c.stats(s)["avg"] / 1000 for s in shown], width,
                   label=f"batch {c.batch_size}")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shown))], shown, rotation=30, fontsize=8)
        ax.set_title(f"{images} images/request, preprocess {prep}", fontsize=9)
        ax.set_yscale("log")  # decode wait (summed over a request's images) dwarfs the rest
        ax.set_ylabel("s per request (avg, log scale)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    stages_png = out / "matrix_stages.png"
    fig.savefig(stages_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for images, prep in groups:
        row = [c for c in cells if (c.images, c.preprocess) == (images, prep)]
        ax.plot([c.batch_size for c in row], [c.images_per_s for c in row], marker="o",
                label=f"{images} img/req, {prep}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("images/s")
    ax.set_xticks(sorted({c.batch_size for c in cells}))
    ax.legend(fontsize=8)
    ax.set_title("throughput of the matrix cells")
    fig.tight_layout()
    thr_png = out / "matrix_throughput.png"
    fig.savefig(thr_png, dpi=110)
    plt.close(fig)
    return [stages_png, thr_png]


def main(argv: list[str] | None = None) -> list[Cell]:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--images", default="50,100", help="images per request, comma-separated")
    p.add_argument("--batch-sizes", default="16,32,64")
    p.add_argument("--preprocess", default=None,
                   help="comma-separated cpu,gpu,gpu_decode (default: cpu, plus gpu and gpu_decode on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default=None,
                   help="fp32/bf16/fp16/auto (default: auto on the CPU, bf16 only where native; fp16 on CUDA)")
    p.add_argument("--decode-threads", type=int, default=None, help="default: PipelineConfig.threads()")
    p.add_argument("--torch-threads", type=int, default=None, help="default: PipelineConfig.threads()")
    p.add_argument("--timeout-s", type=float, default=60.0, help="a request slower than this counts as a timeout")
    p.add_argument("--quick", action="store_true", help="6 requests × 10 and × 20 images")
    p.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "matrix")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.images = 6, "10,20"
    from workers.config import PipelineConfig, resolve_precision
    from workers.model import ClipEncoder, EncoderHolder
    from workers.runner import BatchRunner
    from workers.utilisation import Sampler

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    preprocess = (args.preprocess or ("cpu,gpu,gpu_decode" if cuda else "cpu")).split(",")
    if not cuda and set(preprocess) - {"cpu"}:
        print(f"no CUDA: skipping preprocess {sorted(set(preprocess) - {'cpu'})}")
        preprocess = ["cpu"]
    precision = resolve_precision(args.precision or ("fp16" if cuda else "auto"), args.device)
    images_list = [int(x) for x in args.images.split(",")]
    batch_sizes = sorted(int(x) for x in args.batch_sizes.split(","))
    files = sorted(f for f in photo_dir().iterdir() if f.is_file())
    base = PipelineConfig(pretrained="random", device=args.device, precision=precision,
                          decode_threads=args.decode_threads, torch_threads=args.torch_threads)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {**machine(), "device": args.device, "precision": precision, "requests": args.requests,
            "threads": dataclasses.asdict(base.threads()), "photos": str(photo_dir()), "files": len(files)}
    print(f"matrix on {info}\n{machine_line(info)}")
    encoder = ClipEncoder(base)
    cells: list[Cell] = []
    text = [f"# Experiment matrix ({args.device}, {precision}, {args.requests} concurrent requests)\n",
            f"{machine_line(info)}\n", f"Machine: `{info}`\n", "Command: `python -m benchmarks.matrix " + " ".join(sys.argv[1:] if argv is None else argv) + "`\n"]
    with Sampler(interval_s=1.0) as sampler:
        for prep in preprocess:
            cfg = base.replace(preprocess=prep)
            holder = EncoderHolder(cfg)
            holder._encoder = encoder  # one model for every cell; the runner decides where preprocessing runs
            runner = BatchRunner(cfg, holder)
            runner.run([str(f) for f in files[:8]], lambda k: Path(k).read_bytes())  # warm-up
            try:
                for images in images_list:
                    group = []
                    for bs in batch_sizes:
                        r = run_cell(runner, files, requests=args.requests, images=images, batch_size=bs,
                                     timeout_s=args.timeout_s, sampler=sampler)
                        cell = Cell(prep, images, bs, args.requests, **r)
                        group.append(cell)
                        print(f"  preprocess {prep}, {images} images/request, batch {bs}: "
                              f"{cell.images_per_s:.1f} images/s, request avg {cell.stats('total')['avg'] / 1000:.2f} s",
                              flush=True)
                    cells += group
                    part = (f"\n## {args.requests} requests × {images} images, preprocess {prep}\n\n"
                            f"{stage_table(group)}\n")
                    print(part)
                    text.append(part)
                    (args.out / "matrix.md").write_text("\n".join(text))  # a run cut short keeps its tables
            finally:
                runner.close()
    summary = f"\n## Summary\n\n{summary_table(cells, args.timeout_s)}\n"
    print(summary)
    text.append(summary)
    pngs = plot(cells, args.out)
    text.append("\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    (args.out / "matrix.md").write_text("\n".join(text))
    write_json(args.out / "results.json", {"machine": info, "cells": cells})
    print(f"wrote {args.out}/matrix.md, results.json, {', '.join(p.name for p in pngs)}")
    return cells


if __name__ == "__main__":
    main()
