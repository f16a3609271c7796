"""Re-embed from previews: images/s of the service's own path, and how close its vectors are to the
originals' (issue 43: ≥ 15,000 images/s with the GPU busy ≥ 85 %).

    python -m benchmarks.previews_gpu                # on CUDA: fp16, preprocess gpu_decode
    python -m benchmarks.previews_gpu --quick        # the CPU rehearsal: a small size
    bash benchmarks/gpu_check.sh                     # runs it as one of its steps

1. **Previews and cosine**: ``BatchRunner.run`` over the 84 photos from their originals, the decode
   hook drawing each preview as a worker does (``workers.preview.preview_bytes`` from the pixels it
   has decoded; on CUDA with ``gpu_decode`` the device-decoded JPEGs come back shrunk there,
   ``workers.preview.device_pixels``); then ``run`` again from those previews (an in-memory
   ``PreviewStore``, as ``embeddings.services.queues.blobs.Previews`` reads the blob store): cosine of
   each photo's preview-path vector to its original-path vector, min / mean, and the worst.
2. **Throughput**: the previews repeated to ``--inputs`` keys (a key per copy; the store returns the
   same preview bytes for each copy of a photo), ``--processes`` bulk-worker processes (default the
   service's ``PipelineConfig.bulk_processes``), each running migration chunks of ``--chunk`` keys
   through ``BatchRunner.run(keys, loader, previews=store, micro_batch=..., before_pass=...)`` as the
   migration chunk task does (``embeddings.services.queues.bulk``; ``before_pass`` returns at once:
   no interactive work here), cycling over the keys for ``--seconds`` per row. Rows: the service's
   migration defaults (``MIGRATION_CHUNK_SIZE`` images, passes of ``MIGRATION_MICRO_BATCH``), and
   the chunk as one forward pass. Images/s = embedded images / wall time from the common start to
   the last chunk's end; CPU % and GPU busy % once a second (``workers.utilisation.Sampler``);
   stage ms per image (``StageTimings`` summed). A preview never read (missing, unreadable, too
   small) fails the run: every input must come from its preview.

Previews are read and checked (facts, CRC) on the runner's decode threads
(``BatchRunner._from_preview``); where a device decoder is there (``gpu_decode`` on CUDA: nvImageCodec,
or ``--jpeg-device cpu``: torchvision's libjpeg, the same route rehearsed on the CPU) their JPEGs are
decoded in one batched call with the originals' and resized on the device; otherwise (no device
decoder, a lossless preview) OpenCV decodes them on the CPU. The JPEG decoder % that
``benchmarks/gpu_check.sh`` samples for this step is nvJPEG's hardware engine decoding previews.

``--steps-csv`` appends ``name,t0,t1,row`` per row (Unix seconds) so the GPU check's NVML sampler
summarises each row on its own (GPU %, JPEG decoder %, CPU %). Writes ``previews_gpu.md`` and
``results.json`` under ``--out`` (default ``var/bench/previews_gpu``).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks._common import ROOT, machine, machine_line, markdown_table, photo_dir, photos, write_json

#: The target of issue 43 for a re-embed from previews on one GPU (images/s, GPU busy %).
TARGET_IMAGES_PER_S, TARGET_GPU_PERCENT = 15_000, 85
#: The migration chunk task's defaults (``MIGRATION_CHUNK_SIZE``, ``MIGRATION_MICRO_BATCH``,
#: project/configuration.py), used where that module cannot be imported (the GPU machine has no Django).
CHUNK_DEFAULT, MICRO_BATCH_DEFAULT = 512, 4


def _migration_defaults() -> tuple[int, int]:
    """``(MIGRATION_CHUNK_SIZE, MIGRATION_MICRO_BATCH)`` as configured by default."""
    try:
        from project.configuration import read

        got = read({}, names=["MIGRATION_CHUNK_SIZE", "MIGRATION_MICRO_BATCH"])
        return int(got["MIGRATION_CHUNK_SIZE"]), int(got["MIGRATION_MICRO_BATCH"])
    except Exception:  # noqa: BLE001 - no django-environ here: the constants above
        return CHUNK_DEFAULT, MICRO_BATCH_DEFAULT


class MemoryPreviews:
    """An in-memory ``workers.preview.PreviewStore``: key -> preview bytes (``keys[i]`` maps to the
    preview of photo ``photo_of[key]``); counts discards, which a sound run never has."""

    def __init__(self, blobs: dict[str, bytes], photo_of: dict[str, str] | None = None) -> None:
        self.blobs, self.photo_of, self.discarded = blobs, photo_of, 0

    def read(self, key: str) -> bytes:
        name = self.photo_of.get(key) if self.photo_of is not None else key
        if name not in self.blobs:
            raise FileNotFoundError(key)
        return self.blobs[name]

    def discard(self, key: str) -> None:
        self.discarded += 1


def draw_and_compare(cfg, originals: dict[str, bytes], jpeg_device: str | None = None) -> dict:
    """Part 1: previews drawn by the decode hook of a run from the originals, then the run from them.

    Returns:
        ``{"previews": {name: bytes}, "images", "refused", "cos_min", "cos_mean", "worst", "jpeg",
        "lossless", "bytes_mean", "original_ms", "preview_ms"}`` (ms: wall time of each whole run).
    """
    from workers.model import EncoderHolder
    from workers.preview import PreviewTooLong, preview_bytes
    from workers.runner import BatchRunner

    runner = BatchRunner(cfg, EncoderHolder(cfg), jpeg_device=jpeg_device)
    drawn: dict[str, bytes] = {}

    def on_decoded(key, rgb, meta):  # as embeddings.services.queues.blobs.thumbnailer, without the blob store
        try:
            drawn[key] = preview_bytes(rgb, width=meta.width, height=meta.height, format=meta.format,
                                       short_side=cfg.preview_side)[0]
        except PreviewTooLong:
            pass

    reads: list[str] = []

    def loader(key):
        reads.append(key)
        return originals[key]

    try:
        names = list(originals)
        runner.run(names[:8], originals.__getitem__)  # model loaded, device warm: not measured
        t0 = time.perf_counter()
        first = runner.run(names, loader, on_decoded)
        t1 = time.perf_counter()
        reads.clear()
        kept = [m.key for m in first.metas if m.key in drawn]
        again = runner.run(kept, loader, previews=MemoryPreviews(drawn))
        t2 = time.perf_counter()
    finally:
        runner.close()
    if reads or again.previews.used != len(kept):
        raise RuntimeError(f"the preview run read {len(reads)} originals; previews {again.previews}")
    by_key = dict(zip([m.key for m in first.metas], first.vectors))
    cos = {m.key: float(np.dot(v, by_key[m.key])) for m, v in zip(again.metas, again.vectors)}
    values = list(cos.values())
    blobs = [drawn[k] for k in kept]
    return {"previews": {k: drawn[k] for k in kept}, "images": len(cos), "refused": len(first.failed),
            "cos_min": min(values), "cos_mean": statistics.fmean(values),
            "worst": sorted(cos.items(), key=lambda kv: kv[1])[:3],
            "jpeg": sum(b[:2] == b"\xff\xd8" for b in blobs), "lossless": sum(b[:2] != b"\xff\xd8" for b in blobs),
            "bytes_mean": statistics.fmean(map(len, blobs)), "original_ms": (t1 - t0) * 1000,
            "preview_ms": (t2 - t1) * 1000}


def _child(index: int, cfg_fields: dict, previews: dict[str, bytes], folder: str, inputs: int,
           rows: list[tuple[str, int, int | None]], seconds: float, barrier, results,
           jpeg_device: str | None = None) -> None:
    """One bulk-worker process: for each row ``(name, chunk, micro_batch)``, after the common start,
    migration chunks through ``BatchRunner.run`` from the previews for ``seconds``."""
    from workers.config import PipelineConfig
    from workers.model import EncoderHolder
    from workers.runner import BatchRunner

    cfg = PipelineConfig(**cfg_fields)
    runner = BatchRunner(cfg, EncoderHolder(cfg), jpeg_device=jpeg_device)
    names = sorted(previews)
    keys = [f"{i:07d}/{names[i % len(names)]}" for i in range(inputs)]
    photo_of = {k: k.split("/", 1)[1] for k in keys}
    store = MemoryPreviews(previews, photo_of)
    originals_read = [0]

    def loader(key):  # only for a preview that cannot be used: counted, and the row says so
        originals_read[0] += 1
        return (Path(folder) / photo_of[key]).read_bytes()

    def before_pass() -> float:  # the migration's yielder when no interactive work waits
        return 0.0

    processes = barrier.parties - 1
    runner.run(keys[:rows[0][1]], loader, previews=store, micro_batch=rows[0][2], before_pass=before_pass)  # warm
    for name, chunk, micro in rows:
        originals_read[0] = 0
        tally: dict[str, int] = {}
        stages = {s: 0.0 for s in ("load", "decode", "decode_wait", "preprocess", "embed")}
        images = failed = passes = 0
        start = (index * chunk) % len(keys)
        barrier.wait(timeout=600)
        t0 = time.time()
        while time.time() - t0 < seconds:
            batch = [keys[(start + j) % len(keys)] for j in range(chunk)]
            start = (start + processes * chunk) % len(keys)
            r = runner.run(batch, loader, previews=store, micro_batch=micro, before_pass=before_pass)
            images += len(r.metas)
            failed += len(r.failed)
            passes += -(-chunk // micro) if micro else 1
            for s in stages:
                stages[s] += getattr(r.timings, s)
            for k, v in r.previews.as_dict().items():
                tally[k] = tally.get(k, 0) + v
        results.put({"row": name, "index": index, "t0": t0, "t1": time.time(), "images": images, "failed": failed,
                     "passes": passes, "stages_ms": stages, "previews": tally, "originals_read": originals_read[0],
                     "discarded": store.discarded})
    runner.close()


def throughput(cfg, previews: dict[str, bytes], *, inputs: int, processes: int,
               rows: list[tuple[str, int, int | None]], seconds: float, steps_csv: Path | None, emit,
               jpeg_device: str | None = None) -> list[dict]:
    """Part 2: ``processes`` children, every row in turn from a common start; one dict per row."""
    import multiprocessing as mp

    from workers.utilisation import Sampler, summarise

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes + 1), ctx.Queue()
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    procs = [ctx.Process(target=_child, args=(i, fields, previews, str(photo_dir()), inputs, rows, seconds, barrier, results,
                                                     jpeg_device),
                         daemon=True) for i in range(processes)]
    for p in procs:
        p.start()
    out = []
    try:
        with Sampler(interval_s=1.0) as sampler:
            for name, chunk, micro in rows:
                barrier.wait(timeout=600)  # every child warm (first row) or done with the previous row
                got = [results.get(timeout=seconds + 600) for _ in procs]
                t0, t1 = min(g["t0"] for g in got), max(g["t1"] for g in got)
                images = sum(g["images"] for g in got)
                stages = {s: sum(g["stages_ms"][s] for g in got) / max(1, images) for s in got[0]["stages_ms"]}
                tally = {k: sum(g["previews"].get(k, 0) for g in got) for k in got[0]["previews"]}
                util = summarise(s for s in sampler.samples(since=t0) if s.t <= t1 + 0.5)
                row = {"row": name, "chunk": chunk, "micro_batch": micro, "processes": processes, "images": images,
                       "failed": sum(g["failed"] for g in got), "passes": sum(g["passes"] for g in got),
                       "wall_s": t1 - t0, "images_per_s": images / (t1 - t0), "stage_ms_per_image": stages,
                       "previews": tally, "originals_read": sum(g["originals_read"] for g in got),
                       "discarded": sum(g["discarded"] for g in got), "utilisation": util}
                out.append(row)
                if steps_csv is not None:
                    with open(steps_csv, "a") as f:
                        f.write(f"previews: {name.replace(',', ';')},{int(t0)},{int(t1) + 1},row\n")
                emit(f"  {name}: {images} images in {row['wall_s']:.1f} s = {row['images_per_s']:.0f} images/s; "
                     f"CPU {_avg(util, 'cpu_percent')} %, GPU busy {_avg(util, 'gpu_percent')} %; previews {tally}, "
                     f"originals read {row['originals_read']}, refused {row['failed']}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


def _avg(util: dict, field: str):
    v = util.get(field)
    return "-" if not v else f"{v['avg']:.0f}"


def main(argv: list[str] | None = None) -> dict:
    import torch

    from workers.config import PipelineConfig, resolve_precision

    chunk_default, micro_default = _migration_defaults()
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--precision", default=None, help="default: fp16 on CUDA, auto (bf16 where native) on the CPU")
    p.add_argument("--preprocess", default=None, help="default: gpu_decode on CUDA, cpu on the CPU")
    p.add_argument("--jpeg-device", default=None,
                   help="decode the device JPEG route (originals and previews) on this device; 'cpu': torchvision's "
                        "libjpeg, the same code path as on CUDA (the CPU rehearsal); default: the config's (CUDA with "
                        "gpu_decode)")
    p.add_argument("--processes", type=int, default=None, help="bulk-worker processes (default: PipelineConfig)")
    p.add_argument("--inputs", type=int, default=4096, help="distinct keys (the previews repeated)")
    p.add_argument("--chunk", type=int, default=chunk_default, help="images per migration chunk")
    p.add_argument("--micro-batch", type=int, default=micro_default, help="images per forward pass of the "
                   "service's row (MIGRATION_MICRO_BATCH)")
    p.add_argument("--seconds", type=float, default=15.0, help="measured time per row")
    p.add_argument("--quick", action="store_true", help="the CPU rehearsal: 256 inputs, chunks of 64, 4 s a row")
    p.add_argument("--steps-csv", type=Path, default=None, help="append name,t0,t1 per row (gpu_check.sh)")
    p.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "previews_gpu")
    args = p.parse_args(argv)
    if args.quick:
        args.inputs, args.chunk, args.seconds = min(args.inputs, 256), min(args.chunk, 64), min(args.seconds, 4.0)
    on_cuda = args.device.startswith("cuda")
    precision = resolve_precision(args.precision or ("fp16" if on_cuda else "auto"), args.device)
    cfg = PipelineConfig(pretrained="random", seed=0, device=args.device, precision=precision,
                         preprocess=args.preprocess or ("gpu_decode" if on_cuda else "cpu"),
                         **({"bulk_processes": args.processes} if args.processes else {}))
    info = machine()
    command = "python -m benchmarks.previews_gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {"machine": info, "command": command, "device": args.device, "precision": precision,
                     "preprocess": cfg.preprocess, "jpeg_device": args.jpeg_device, "preview_side": cfg.preview_side,
                     "threads": dataclasses.asdict(cfg.threads())}
    args.out.mkdir(parents=True, exist_ok=True)
    text = [f"# Re-embed from previews ({args.device}, {precision}, preprocess {cfg.preprocess})\n",
            f"Command: `{command}`\n", f"{machine_line(info)}\n"]

    def emit(line: str) -> None:
        """Print a line and keep previews_gpu.md current (a run cut short keeps what it measured)."""
        text.append(line)
        print(line, flush=True)
        (args.out / "previews_gpu.md").write_text("\n".join(text) + "\n")

    if not on_cuda:
        emit("no GPU: CPU rehearsal" + (" (--quick sizes)" if args.quick else ""))
    originals = dict(photos())
    emit(f"\n1. previews of {len(originals)} photos drawn by the decode hook, then the run from them")
    drawn = draw_and_compare(cfg, originals, jpeg_device=args.jpeg_device)
    previews = drawn.pop("previews")
    results["cosine"] = drawn
    write_json(args.out / "results.json", results)  # kept if the throughput part is cut short
    emit(f"  {drawn['images']} images ({drawn['refused']} refused), {drawn['jpeg']} JPEG + {drawn['lossless']} "
         f"lossless previews, {drawn['bytes_mean'] / 1024:.1f} KB mean; cosine preview path vs original path: "
         f"min {drawn['cos_min']:.5f}, mean {drawn['cos_mean']:.5f}; worst "
         + ", ".join(f"{k} {v:.5f}" for k, v in drawn["worst"])
         + f"; one run of all: originals {drawn['original_ms']:.0f} ms, previews {drawn['preview_ms']:.0f} ms")

    rows = [(f"service: chunks of {args.chunk}, passes of {args.micro_batch}", args.chunk, args.micro_batch),
            (f"chunks of {args.chunk}, one pass each", args.chunk, None)]
    processes = cfg.bulk_processes
    emit(f"\n2. throughput: {processes} processes × threads {dataclasses.asdict(cfg.threads())}, {args.inputs} "
         f"inputs, {args.seconds:g} s a row")
    out = throughput(cfg, previews, inputs=args.inputs, processes=processes, rows=rows,
                     seconds=args.seconds, steps_csv=args.steps_csv, emit=emit, jpeg_device=args.jpeg_device)
    results["throughput"] = out
    table = []
    for r in out:
        st, util = r["stage_ms_per_image"], r["utilisation"]
        table.append([r["row"], r["images"], round(r["images_per_s"]), _avg(util, "cpu_percent"),
                      _avg(util, "gpu_percent"), f"{st['load']:.3f}", f"{st['decode']:.3f}",
                      f"{st['preprocess']:.3f}", f"{st['embed']:.3f}", r["originals_read"]])
    emit("\n" + markdown_table(["row", "images", "images/s", "CPU % avg", "GPU busy % avg", "load ms/img",
                                "decode ms/img", "preprocess ms/img", "embed ms/img", "originals read"], table))
    best = max(out, key=lambda r: r["images_per_s"]) if out else None
    if best is not None:
        gpu = (best["utilisation"].get("gpu_percent") or {}).get("avg")
        ok = best["images_per_s"] >= TARGET_IMAGES_PER_S and gpu is not None and gpu >= TARGET_GPU_PERCENT
        service = out[0]
        results["target"] = {"images_per_s": best["images_per_s"], "gpu_percent": gpu, "row": best["row"],
                             "service_images_per_s": service["images_per_s"], "pass": ok}
        emit(f"\nSUMMARY previews: service row {service['images_per_s']:.0f} images/s; best row "
             f"{best['images_per_s']:.0f} images/s with the GPU busy {'-' if gpu is None else f'{gpu:.0f}'} % "
             f"({best['row']}); target ≥ {TARGET_IMAGES_PER_S:,} images/s with the GPU ≥ {TARGET_GPU_PERCENT} %: "
             f"{'PASS' if ok else ('not applicable (no GPU)' if not on_cuda else 'FAIL')}; cosine preview vs "
             f"original min {drawn['cos_min']:.5f} mean {drawn['cos_mean']:.5f}")
    write_json(args.out / "results.json", results)
    return results


if __name__ == "__main__":
    main()
