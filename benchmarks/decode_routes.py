"""CPU JPEG decoders for the routed decode (issue 43 item 2): simplejpeg against OpenCV, and the
process pool against in-process decoding.

    python -m benchmarks.decode_routes              # 5 rounds, ~1 minute here
    python -m benchmarks.decode_routes --rounds 2   # shorter
    make bench-decode [BENCH_ARGS="--rounds 2"]

Measures, on the JPEG photos (``../shared/data/images/photos``; baseline and progressive apart),
one thread (the one greyscale JPEG left out: simplejpeg takes 3-component JPEGs), each decode timed ``--rounds`` times round-robin, the median kept:

1. **decoders**: OpenCV ``imdecode`` (what ``workers.decode`` runs) and simplejpeg, at full size
   and at the DCT scale ``workers.decode`` picks for a 224 px model (1/2, 1/4, 1/8), and
   simplejpeg at its finest scale whose short side is still ≥ 224 (libjpeg-turbo's M/8 factors),
   with and without ``fastdct``/``fastupsample``.
2. **agreement**: for each variant, the largest pixel difference to OpenCV at the same size, and the
   cosine of the random-weight ViT-B-32 embedding of its preprocessed 224 px crop to OpenCV's
   (``workers.preprocess.resize_and_crop``; the acceptance bound is 0.999 per image).
3. **CPU path, in process vs process pool**: every photo (JPEG and PNG) through
   ``workers.decode_pool`` with 0 processes (threads, today's CPU-only path) and with a pool, the
   same total of workers (the machine's cores), images/s; the pool's pixels must equal the
   in-process ones.

Writes ``var/bench/decode/`` (``--out``): ``decode_routes.md`` (what is printed),
``results.json``, ``decode_routes.png``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks._common import ROOT, machine, machine_line, markdown_table, photos, pyplot, write_json

MODEL_SIDE = 224


def _variants(info):
    """``{name: decode(data) -> (H, W, 3) uint8}`` for one JPEG's header ``info``."""
    import cv2
    import numpy as np
    import simplejpeg

    from workers.containers import jpeg_scale
    from workers.decode import CV_REDUCE, CV_RGB

    scale = jpeg_scale(info.width, info.height, MODEL_SIDE, False)
    reduced = {"min_height": -(-info.height // scale), "min_width": -(-info.width // scale)}
    finest = {"min_height": MODEL_SIDE} if info.height <= info.width else {"min_width": MODEL_SIDE}
    cv = lambda flags: lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), flags)  # noqa: E731
    sj = lambda **kw: lambda d: simplejpeg.decode_jpeg(d, "rgb", strict=False, **kw)  # noqa: E731
    return {
        "opencv full": cv(CV_RGB),
        "simplejpeg full": sj(),
        f"opencv 1/{scale}": cv(CV_RGB | CV_REDUCE[scale]),
        f"simplejpeg 1/{scale}": sj(**reduced),
        "simplejpeg finest M/8": sj(**finest),
        "simplejpeg 1/s fastdct+fastupsample": sj(fastdct=True, fastupsample=True, **reduced),
    }


def _kind(name: str) -> str:
    """Variant name without its scale, so that images of different scales share a row."""
    return name.replace("1/2", "1/s").replace("1/4", "1/s").replace("1/8", "1/s").replace("1/1", "1/s")


def decoders(jpegs: list[tuple[str, bytes]], rounds: int) -> tuple[dict, dict]:
    """Median ms per image per (kind, variant); per-variant pixels for the agreement check."""
    import cv2

    from workers.containers import scan_jpeg

    cv2.setNumThreads(1)
    times: dict[tuple[str, str], list[float]] = {}
    outputs: dict[str, dict[str, object]] = {}
    for name, data in jpegs:
        info = scan_jpeg(data)
        kind = "progressive" if info.sof == 0xC2 else "baseline"
        if info.components != 3:  # the one greyscale photo: simplejpeg does not take it (workers.decode)
            continue
        variants = _variants(info)
        outputs[name] = {k: fn(data) for k, fn in variants.items()}  # warm-up and the pixels
        per: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn(data)
                per[k].append(time.perf_counter() - t0)
        for k, ts in per.items():
            times.setdefault((kind, _kind(k)), []).append(statistics.median(ts) * 1000)
    return times, outputs


def agreement(jpegs: list[tuple[str, bytes]], outputs: dict) -> dict[str, dict[str, float]]:
    """Per variant: max |pixel − OpenCV's at the same size| and the min cosine of the embeddings."""
    import numpy as np
    import torch

    from workers.config import PipelineConfig
    from workers.model import ClipEncoder
    from workers.preprocess import normalize, resize_and_crop

    enc = ClipEncoder(PipelineConfig(pretrained="random", bulk_processes=1))
    cfg = enc.preprocess_config
    crops: dict[str, list] = {}
    diffs: dict[str, float] = {}
    names = [n for n, _ in jpegs if len(outputs[n]) > 4]
    for n in names:
        out = outputs[n]
        ref_full = out["opencv full"]
        ref_scaled = next(v for k, v in out.items() if k.startswith("opencv 1/"))
        for k, rgb in out.items():
            kind = _kind(k)
            crops.setdefault(kind, []).append(resize_and_crop(np.ascontiguousarray(rgb), cfg))
            ref = ref_full if "full" in k else ref_scaled
            if rgb.shape == ref.shape:
                d = float(np.abs(rgb.astype(np.int16) - ref.astype(np.int16)).max())
                diffs[kind] = max(diffs.get(kind, 0.0), d)
            else:
                diffs[kind] = float("nan")  # another size: only the embedding compares
    vectors = {k: enc.encode_images(normalize(torch.stack(v), cfg)) for k, v in crops.items()}
    ref = vectors["opencv full"]
    return {k: {"max_abs_pixel_diff": diffs.get(k, float("nan")),
                "min_cosine_vs_opencv_full": float((v * ref).sum(axis=1).min()),
                "min_cosine_vs_opencv_scaled": float((v * vectors["opencv 1/s"]).sum(axis=1).min()),
                "images": len(v)} for k, v in vectors.items()}


def cpu_path(blobs: list[tuple[str, bytes]], rounds: int, workers: int) -> dict:
    """Images/s of the CPU decode path (decode + resize + crop) in threads vs in a process pool."""
    import numpy as np

    from workers.decode_pool import CpuDecoder
    from workers.preprocess import PreprocessConfig

    cfg = PreprocessConfig(size=(224, 224), mean=(0.48145466, 0.4578275, 0.40821073),
                           std=(0.26862954, 0.26130258, 0.27577711))
    limits = {"max_pixels": 50_000_000, "max_bytes": 50 << 20, "timeout_s": 10.0}
    out: dict[str, list[float]] = {}
    pixels = {}
    decoders = {f"threads ({workers}, in process: the CPU-only path)": CpuDecoder(processes=0, threads=workers, **limits),
                f"process pool ({workers} processes)": CpuDecoder(processes=workers, threads=workers, **limits)}
    try:
        for name, dec in decoders.items():
            pixels[name] = [r.pixels for r in dec.decode_many([d for _, d in blobs], cfg)]  # warm-up (spawn)
        for _ in range(rounds):
            for name, dec in decoders.items():
                t0 = time.perf_counter()
                dec.decode_many([d for _, d in blobs], cfg)
                out.setdefault(name, []).append(len(blobs) / (time.perf_counter() - t0))
    finally:
        for dec in decoders.values():
            dec.close()
    first, second = pixels.values()
    same = all((a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
               for a, b in zip(first, second))
    return {"images_per_s": {k: statistics.median(v) for k, v in out.items()}, "rounds": out,
            "identical_pixels": same}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-pool", action="store_true", help="skip the process-pool comparison")
    p.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "decode")
    args = p.parse_args(argv)
    from workers.config import available_cores
    from workers.containers import sniff_format

    info = machine()
    command = "python -m benchmarks.decode_routes " + " ".join(argv if argv is not None else sys.argv[1:])
    blobs = photos()
    jpegs = [(n, d) for n, d in blobs if sniff_format(d) == "jpeg"]
    text = [f"# CPU JPEG decoders and the process pool ({len(jpegs)} JPEG photos)\n",
            f"Command: `{command}`\n", machine_line(info) + "\n"]
    print("\n".join(text), flush=True)
    times, outputs = decoders(jpegs, args.rounds)
    agree = agreement(jpegs, outputs)
    rows = []
    for (kind, variant), ms in sorted(times.items()):
        base = sum(times[(kind, "opencv full")])
        a = agree.get(variant, {})
        cos = a.get("min_cosine_vs_opencv_full")
        rows.append([kind, variant, len(ms), round(sum(ms), 1), round(base / sum(ms), 2),
                     a.get("max_abs_pixel_diff", "-"), "-" if cos is None else f"{cos:.5f}"])
    table = markdown_table(["JPEGs", "decoder", "images", "total ms (median of rounds, 1 thread)",
                            "speed vs opencv full", "max |Δpixel| vs opencv same size",
                            "min cosine vs opencv full"], rows)
    text.append("## Decoders, one thread\n\n" + table + "\n")
    print(text[-1], flush=True)
    results = {"machine": info, "command": command, "decoders_ms": {f"{k}|{v}": ms for (k, v), ms in times.items()},
               "agreement": agree}
    if not args.no_pool:
        workers = available_cores()
        pool = cpu_path(blobs, args.rounds, workers)
        results["cpu_path"] = pool
        text.append(f"## CPU path over all {len(blobs)} photos (decode + resize + crop), {workers} workers\n\n"
                    + markdown_table(["how", "images/s (median)", "each round"],
                                     [[k, round(v, 1), " / ".join(f"{x:.1f}" for x in pool["rounds"][k])]
                                      for k, v in pool["images_per_s"].items()])
                    + f"\n\nPool pixels identical to in-process: **{pool['identical_pixels']}**\n")
        print(text[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_routes.md").write_text("\n".join(text))
    write_json(args.out / "results.json", results)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{k}\n{v}" for k, v in sorted(times)]
    ax.barh(labels, [sum(times[kv]) for kv in sorted(times)])
    ax.set_xlabel("total decode ms over the photos (1 thread)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "decode_routes.png", dpi=110)
    print(f"wrote {args.out}/decode_routes.md, results.json, decode_routes.png")
    return results


if __name__ == "__main__":
    main()
