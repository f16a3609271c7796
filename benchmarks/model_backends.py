"""Issue 43 item 4: the image tower on each CPU runtime, model only, side by side on the same cores.

Backends × precisions × batch sizes (1, 16, 64): torch eager (open_clip itself, the reference),
``torch.compile`` (inductor, frozen weights), OpenVINO (f32 / bf16 inference precision, dynamic or
static batch, the LATENCY hint or THROUGHPUT with two streams) and ONNX Runtime's CPU provider
(fp32, and dynamically quantised int8 as an extra row). Every backend runs ``--threads`` intra-op
threads (2: the whole of this machine's share).

Input: the 84 real photos (``../shared/data/images/photos``, or ``$BENCH_PHOTOS``) decoded and preprocessed by ``workers.decode`` / ``workers.preprocess``.
Speed is images/s of the forward pass alone, the best of ``--rounds`` rounds, the variants
interleaved within each round so that another process's load falls on all of them alike; ratios are
to torch eager bf16 of the same run. Cosine is per photo to open_clip's own output at the same
precision (``vs space``) and to open_clip fp32 (``vs fp32``): min and mean over every photo.

Prints the CPU model and flags, a markdown table; saves ``model_backends.md``, ``.json`` and ``.png``
under ``var/bench/model/``. Full run ~5 min; ``--quick`` ~1 min (batch 64 only, no torch.compile).

    python -m benchmarks.model_backends [--quick] [--rounds 3] [--out var/bench/model]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks._common import (
    ROOT,
    machine,
    machine_line,
    markdown_table,
    pyplot,
    write_json,
)

#: The 84 real photos: $BENCH_PHOTOS, else ../shared/data/images/photos beside the checkout.
PHOTOS = Path(os.environ.get("BENCH_PHOTOS") or ROOT / ".." / "shared" / "data" / "images" / "photos").resolve()

#: The variant every ratio is taken against: open_clip eager in bf16 (the service's CPU default today).
BASELINE = "torch eager bf16"


@dataclasses.dataclass
class Variant:
    """One way to run the tower: ``run((N,3,S,S) float32 ndarray) -> (N,D) float32 ndarray``."""

    name: str
    backend: str
    precision: str  # the embedding space it serves: fp32 or bf16
    run: Callable[[np.ndarray], np.ndarray]
    build_s: float
    batches: tuple[int, ...]  # the batch sizes it runs (a static shape runs one)
    cosine_space: tuple[float, float] = (float("nan"), float("nan"))
    cosine_fp32: tuple[float, float] = (float("nan"), float("nan"))
    rate: dict = dataclasses.field(default_factory=dict)


def _pixels(threads: int):
    """``(84, 3, 224, 224) float32`` of the real photos, and the preprocess config."""
    import open_clip
    import torch

    from workers.decode import decode_image
    from workers.preprocess import PreprocessConfig, preprocess_batch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval().requires_grad_(False)
    cfg = PreprocessConfig.from_open_clip(open_clip.get_model_preprocess_cfg(model))
    paths = sorted(p for p in PHOTOS.iterdir() if p.is_file()) if PHOTOS.is_dir() else []
    if not paths:
        raise SystemExit(f"no photos in {PHOTOS}; set BENCH_PHOTOS")
    rgbs = [decode_image(p.read_bytes(), min_side=cfg.min_side).rgb for p in paths]
    return model, preprocess_batch(rgbs, cfg).numpy()


def _unit(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _in_chunks(run, x: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([run(x[i:i + n]) for i in range(0, len(x), n)])


def variants(model, threads: int, cache: Path, *, quick: bool, compile_timeout_s: float) -> list[Variant]:
    """Every variant that builds here (a runtime that is missing or fails is printed and skipped)."""
    import torch

    from workers.backends import build_image_tower

    out: list[Variant] = []
    visual32 = model.visual

    def add(name, backend, precision, build, batches=(1, 16, 64)):
        t0 = time.perf_counter()
        try:
            run = build()
        except Exception as e:  # noqa: BLE001 - a benchmark reports what does not build, and goes on
            print(f"  {name}: not built ({type(e).__name__}: {str(e)[:200]})", flush=True)
            return
        if run is None:
            print(f"  {name}: not built (see the warning above)", flush=True)
            return
        out.append(Variant(name, backend, precision, run, time.perf_counter() - t0, batches))
        print(f"  {name}: built in {out[-1].build_s:.1f} s", flush=True)

    def eager(dtype):
        tower = copy.deepcopy(visual32).to(dtype)

        def run(x):
            with torch.inference_mode():
                return tower(torch.from_numpy(x).to(dtype)).float().numpy()
        return run

    add("torch eager fp32", "torch", "fp32", lambda: eager(torch.float32))
    add(BASELINE, "torch", "bf16", lambda: eager(torch.bfloat16))

    def tower(backend, precision):
        def build():
            t = build_image_tower(backend, visual32, model_name="ViT-B-32", weights_id="random-seed0",
                                  precision=precision, image_size=224, threads=threads, cache_dir=cache)
            return t
        return build

    add("openvino f32", "openvino", "fp32", tower("openvino", "fp32"))
    add("openvino bf16", "openvino", "bf16", tower("openvino", "bf16"))
    add("onnxruntime fp32", "onnxruntime", "fp32", tower("onnxruntime", "fp32"))
    if quick:
        return out

    def openvino_static(batch):
        import openvino as ov

        core = ov.Core()
        with torch.no_grad():
            m = ov.convert_model(visual32, example_input=torch.zeros(1, 3, 224, 224), input=[(batch, 3, 224, 224)])
        req = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY",
                                            "INFERENCE_NUM_THREADS": threads}).create_infer_request()

        def run(x):
            if len(x) == batch:
                return req.infer({0: x})[0].copy()
            full = np.concatenate([x, np.zeros(((batch - len(x) % batch) % batch, *x.shape[1:]), np.float32)])
            return np.concatenate([req.infer({0: full[i:i + batch]})[0].copy()
                                   for i in range(0, len(full), batch)])[:len(x)]
        return run

    def openvino_throughput():
        import openvino as ov

        core = ov.Core()
        with torch.no_grad():
            m = ov.convert_model(visual32, example_input=torch.zeros(1, 3, 224, 224), input=[(-1, 3, 224, 224)])
        compiled = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "THROUGHPUT",
                                                 "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 2})
        queue = ov.AsyncInferQueue(compiled, 2)
        results = {}
        queue.set_callback(lambda request, i: results.__setitem__(i, request.get_output_tensor(0).data.copy()))

        def run(x):  # the batch split across the two streams
            halves = [x[: (len(x) + 1) // 2], x[(len(x) + 1) // 2:]]
            for i, h in enumerate(halves):
                if len(h):
                    queue.start_async({0: np.ascontiguousarray(h)}, i)
            queue.wait_all()
            return np.concatenate([results[i] for i, h in enumerate(halves) if len(h)])
        return run

    def onnxruntime_int8():
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic

        fp32 = next(cache.glob("onnxruntime-*/visual.onnx"))
        int8 = cache / "visual-int8.onnx"
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(str(int8), options, providers=["CPUExecutionProvider"])
        return lambda x: session.run(None, {"pixels": x})[0]

    def compiled(dtype):
        import torch._inductor.config as inductor

        inductor.freezing = True  # weights as constants: oneDNN packs the linear layers once
        module = torch.compile(copy.deepcopy(visual32).to(dtype))
        t0 = time.perf_counter()
        with torch.inference_mode():
            module(torch.zeros(64, 3, 224, 224, dtype=dtype))
        if time.perf_counter() - t0 > compile_timeout_s:
            print(f"  torch.compile took {time.perf_counter() - t0:.0f} s (> {compile_timeout_s:.0f} s)")

        def run(x):
            with torch.inference_mode():
                return module(torch.from_numpy(x).to(dtype)).float().numpy()
        return run

    add("openvino bf16 static 64", "openvino", "bf16", lambda: openvino_static(64), batches=(64,))
    add("openvino bf16 THROUGHPUT 2 streams", "openvino", "bf16", openvino_throughput)
    add("onnxruntime int8 (dynamic quant.)", "onnxruntime", "fp32", onnxruntime_int8)
    add("torch.compile bf16 (freezing)", "torch", "bf16", lambda: compiled(torch.bfloat16), batches=(64,))
    return out


def measure(vs: list[Variant], pixels: np.ndarray, batches: tuple[int, ...], rounds: int) -> None:
    """Fill each variant's ``rate[batch]``: images/s, best of ``rounds`` interleaved rounds. A round
    runs 64 images per variant (64 passes of 1, 4 of 16, 1 of 64)."""
    for batch in batches:
        todo = [v for v in vs if batch in v.batches]
        x = np.ascontiguousarray(pixels[:batch])
        passes = max(1, 64 // batch) if batch > 1 else 16  # batch 1: 16 images keep a round short
        for v in todo:
            v.run(x)  # warm-up: first-call allocations, shape compilation
        for _ in range(rounds):
            for v in todo:
                t0 = time.perf_counter()
                for _ in range(passes):
                    v.run(x)
                v.rate[batch] = max(v.rate.get(batch, 0.0), passes * batch / (time.perf_counter() - t0))
        print("  batch", batch, ", ".join(f"{v.name} {v.rate[batch]:.1f}" for v in todo), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 64 only, no torch.compile / extra rows (~1 min)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (best kept)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every backend")
    parser.add_argument("--compile-timeout", type=float, default=180.0, help="torch.compile time worth noting (s)")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "model")
    args = parser.parse_args(argv)

    import torch

    info = machine()
    print(machine_line(info), flush=True)
    model, pixels = _pixels(args.threads)
    print(f"{len(pixels)} photos preprocessed to {pixels.shape} float32; threads {args.threads}", flush=True)
    with torch.inference_mode():
        ref32 = _unit(_in_chunks(lambda x: model.encode_image(torch.from_numpy(x)).numpy(), pixels, 64))
    with tempfile.TemporaryDirectory() as cache:
        vs = variants(model, args.threads, Path(cache), quick=args.quick, compile_timeout_s=args.compile_timeout)
        refs = {"fp32": ref32}
        base = next(v for v in vs if v.name == BASELINE)
        refs["bf16"] = _unit(_in_chunks(base.run, pixels, 64))
        for v in vs:
            got = _unit(_in_chunks(v.run, pixels, max(v.batches)))
            cs, c32 = (got * refs[v.precision]).sum(1), (got * ref32).sum(1)
            v.cosine_space, v.cosine_fp32 = (float(cs.min()), float(cs.mean())), (float(c32.min()), float(c32.mean()))
        batches = (64,) if args.quick else (1, 16, 64)
        measure(vs, pixels, batches, args.rounds)

    headers = ["variant", "space", "build s", *[f"img/s bs{b}" for b in batches], *[f"× bf16 eager bs{b}" for b in batches],
               "cos vs space min", "cos vs space mean", "cos vs fp32 min"]
    rows = [[v.name, v.precision, round(v.build_s, 1), *[v.rate.get(b) for b in batches],
             *[(round(v.rate[b] / base.rate[b], 2) if b in v.rate else None) for b in batches],
             f"{v.cosine_space[0]:.5f}", f"{v.cosine_space[1]:.5f}", f"{v.cosine_fp32[0]:.5f}"] for v in vs]
    table = markdown_table(headers, rows)
    header = (f"{machine_line(info)}\n\ntorch {torch.__version__}; threads {args.threads}; best of {args.rounds} "
              f"interleaved rounds; {len(pixels)} photos; load average at start {info.get('load_average_1m')}")
    print("\n" + header + "\n\n" + table, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_backends.md").write_text(f"# Model-only image tower by backend\n\n{header}\n\n{table}\n")
    write_json(args.out / "model_backends.json", {"machine": info, "threads": args.threads, "rounds": args.rounds,
                                                  "rows": [dict(zip(headers, r)) for r in rows]})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(vs)))
    height = 0.8 / len(batches)
    for i, b in enumerate(batches):
        ax.barh([j + i * height for j in range(len(vs))], [v.rate.get(b, 0) for v in vs], height, label=f"batch {b}")
    ax.set_yticks([j + height * (len(batches) - 1) / 2 for j in range(len(vs))], [v.name for v in vs])
    ax.invert_yaxis()
    ax.set_xlabel(f"images/s, model only, {args.threads} threads")
    ax.set_title(f"ViT-B-32 image tower by backend ({info['cpu']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "model_backends.png", dpi=100)
    print(f"saved {args.out}/model_backends.md, .json, .png")


if __name__ == "__main__":
    main()
