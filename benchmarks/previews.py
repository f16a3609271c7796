"""Previews (issue 43 item 1, docs/previews.md): which format, what a preview costs the first
embedding, what it saves a re-embed, and how close its embeddings are to the original's.

    python -m benchmarks.previews            # everything: ~4 min on 2 busy cores
    make bench-previews

1. **Formats**, for each of the 84 photos decoded at a 384 px short side (smaller photos whole): a
   preview in each candidate (JPEG q90/q95 by OpenCV, 4:2:0 and 4:4:4; JPEG by simplejpeg when it is
   importable; WebP q90; PNG level 1; raw uint8 ``.npy``): decode ms per image (one thread, best of
   ``--repeat``), bytes, and cosine of its ViT-B-32 embedding (seeded random weights) to the
   original's through the real decode path.
2. **First embedding**: the decode hook's work per image on the pixels a 224 px model decodes,
   thumbnail only (before) against preview + thumbnail drawn from the preview (after), both
   written to a filesystem blob store: the added ms per image.
3. **Re-embed**: decode + resize/crop per image from the original vs from the preview (one
   thread), and ``BatchRunner.prepare`` over the 84 photos on every core (in memory, no model):
   the decode-bound rate of a re-embed.
4. **Fidelity of the service's own path**: ``BatchRunner`` embeds every photo and every odd file
   that embeds (``../shared/data/images/odd``) from its original, drawing previews as a worker
   does, then again from those previews: cosine per image, min and mean
   (``tests/workers/test_preview.py`` asserts min >= 0.99 on the same sets).
5. **Whole pictures** (those that are their own preview) stored as JPEG q90 instead of the lossless
   copy: cosine, decode ms and bytes of both forms.

Writes ``docs/bench/previews.json`` and ``docs/bench/previews.png`` (``--out``), prints markdown.
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import ROOT, machine, machine_line, markdown_table, photo_dir, pyplot, write_json

ODD = (ROOT / ".." / "shared" / "data" / "images" / "odd").resolve()


def _codecs() -> dict[str, tuple]:
    """``name -> (encode(rgb) -> bytes, decode(bytes) -> rgb)``: the candidates."""
    import cv2

    upright = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION  # as workers.preview reads

    def cv_jpeg(q: int, sampling: int | None = None):
        params = [cv2.IMWRITE_JPEG_QUALITY, q] + ([cv2.IMWRITE_JPEG_SAMPLING_FACTOR, sampling] if sampling else [])
        return (lambda rgb: cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), params)[1].tobytes(),
                lambda b: cv2.imdecode(np.frombuffer(b, np.uint8), upright))

    def cv_other(ext: str, params: list[int]):
        return (lambda rgb: cv2.imencode(ext, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), params)[1].tobytes(),
                lambda b: cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR_RGB))

    def npy_encode(rgb):
        buf = io.BytesIO()
        np.save(buf, rgb, allow_pickle=False)
        return buf.getvalue()

    out = {
        "jpeg q90 (OpenCV, 4:2:0)": cv_jpeg(90),
        "jpeg q95 (OpenCV, 4:2:0)": cv_jpeg(95),
        "jpeg q95 (OpenCV, 4:4:4)": cv_jpeg(95, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444),
    }
    try:
        import simplejpeg

        for q in (90, 95):
            out[f"jpeg q{q} (simplejpeg, 4:2:0)"] = (
                lambda rgb, q=q: simplejpeg.encode_jpeg(np.ascontiguousarray(rgb), quality=q, colorspace="RGB"),
                lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB"))
    except ImportError:
        pass
    out["webp q90 (OpenCV)"] = cv_other(".webp", [cv2.IMWRITE_WEBP_QUALITY, 90])
    out["png level 1 (OpenCV)"] = cv_other(".png", [cv2.IMWRITE_PNG_COMPRESSION, 1])
    out["raw uint8 .npy"] = (npy_encode, lambda b: np.load(io.BytesIO(b), allow_pickle=False))
    return out


def _best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _embed(encoder, cfg, images: list[np.ndarray]) -> np.ndarray:
    """Rows: the embedding of each upright RGB picture through the model's own resize/crop."""
    import torch

    from workers.preprocess import normalize, resize_and_crop

    out = []
    for i in range(0, len(images), 32):
        pixels = torch.stack([resize_and_crop(im, cfg) for im in images[i : i + 32]])
        out.append(encoder.encode_images(normalize(pixels, cfg)))
    return np.concatenate(out)


def formats(photos, encoder, cfg, repeat: int) -> dict:
    """Part 1: every candidate on every photo."""
    from workers.decode import decode_image
    from workers.preview import preview_pixels

    originals = [decode_image(data, min_side=cfg.min_side).rgb for _, data in photos]
    reference = _embed(encoder, cfg, originals)
    sources = [preview_pixels(decode_image(data, min_side=384).rgb, 384) for _, data in photos]
    rows = {}
    for name, (encode, decode) in _codecs().items():
        blobs = [encode(rgb) for rgb in sources]
        enc_ms = [_best_ms(lambda rgb=rgb, encode=encode: encode(rgb), 1) for rgb in sources]
        dec_ms = [_best_ms(lambda b=b, decode=decode: decode(b), repeat) for b in blobs]
        decoded = [decode(b) for b in blobs]
        assert all(d.shape == s.shape for d, s in zip(decoded, sources)), name
        cos = np.sum(_embed(encoder, cfg, decoded) * reference, axis=1)
        rows[name] = {"decode_ms_mean": statistics.fmean(dec_ms), "decode_ms_median": statistics.median(dec_ms),
                      "encode_ms_mean": statistics.fmean(enc_ms), "kb_mean": statistics.fmean(map(len, blobs)) / 1024,
                      "cos_min": float(cos.min()), "cos_mean": float(cos.mean())}
        print(f"  {name}: decode {rows[name]['decode_ms_mean']:.2f} ms, {rows[name]['kb_mean']:.0f} KB, "
              f"cos min {rows[name]['cos_min']:.5f}", flush=True)
    shorts = [min(s.shape[:2]) for s in sources]
    return {"rows": rows, "preview_short_side": {"min": min(shorts), "median": statistics.median(shorts),
                                                 "max": max(shorts), "at_384": sum(s == 384 for s in shorts)}}


def first_embed_cost(photos, cfg, repeat: int) -> dict:
    """Part 2: the decode hook's added work per image on a 224 px model's decoded pixels."""
    from django.conf import settings

    if not settings.configured:
        settings.configure()
    from embeddings.storage import BlobStore, preview_put, thumbnail_put
    from workers.decode import decode_image
    from workers.preview import PREVIEW_SIDE, preview_bytes
    from workers.thumbnail import thumbnail_bytes

    decoded = [decode_image(data, min_side=cfg.min_side) for _, data in photos]
    before, after, decode_ms, decode_384_ms = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(repeat):
            store = BlobStore(Path(tmp) / f"r{run}")
            for i, d in enumerate(decoded):
                sha = f"{run:02x}{i:062x}"
                t0 = time.perf_counter()
                thumbnail_put(store, sha, thumbnail_bytes(d.rgb))
                t1 = time.perf_counter()
                data, pixels = preview_bytes(d.rgb, width=d.width, height=d.height, format=d.format,
                                             short_side=PREVIEW_SIDE)
                preview_put(store, "f" + sha[1:], data)
                thumbnail_put(store, "f" + sha[1:], thumbnail_bytes(pixels))
                t2 = time.perf_counter()
                if run == 0:
                    before.append((t1 - t0) * 1000)
                    after.append((t2 - t1) * 1000)
                else:
                    before[i] = min(before[i], (t1 - t0) * 1000)
                    after[i] = min(after[i], (t2 - t1) * 1000)
    for _, data in photos:  # what drawing every preview at a full 384 px at the first embed would cost
        decode_ms.append(_best_ms(lambda data=data: decode_image(data, min_side=cfg.min_side), repeat))
        decode_384_ms.append(_best_ms(lambda data=data: decode_image(data, min_side=PREVIEW_SIDE), repeat))
    drawn = [preview_bytes(d.rgb, width=d.width, height=d.height, format=d.format) for d in decoded]
    shorts = [min(pixels.shape[:2]) for _, pixels in drawn]
    jpeg = [len(b) for b, _ in drawn if b[:2] == b"\xff\xd8"]
    lossless = [len(b) for b, _ in drawn if b[:2] != b"\xff\xd8"]
    return {"thumbnail_only_ms": statistics.fmean(before), "preview_and_thumbnail_ms": statistics.fmean(after),
            "added_ms": statistics.fmean(after) - statistics.fmean(before),
            "decode_ms": statistics.fmean(decode_ms), "decode_at_384_ms": statistics.fmean(decode_384_ms),
            "worker_preview_short_side": {"min": min(shorts), "median": statistics.median(shorts),
                                          "at_384": sum(s == 384 for s in shorts), "of": len(shorts)},
            "jpeg": {"n": len(jpeg), "kb_mean": statistics.fmean(jpeg) / 1024 if jpeg else 0},
            "lossless": {"n": len(lossless), "kb_mean": statistics.fmean(lossless) / 1024 if lossless else 0}}


def reembed_cost(photos, cfg, repeat: int) -> dict:
    """Part 3: per image, one thread: original (decode at the model's side + resize/crop) vs preview."""
    from workers.decode import decode_image
    from workers.preprocess import resize_and_crop
    from workers.preview import preview_bytes, preview_read

    previews = []
    for _, data in photos:
        d = decode_image(data, min_side=cfg.min_side)
        previews.append(preview_bytes(d.rgb, width=d.width, height=d.height, format=d.format)[0])
    orig = [_best_ms(lambda data=data: resize_and_crop(decode_image(data, min_side=cfg.min_side).rgb, cfg), repeat)
            for _, data in photos]
    prev = [_best_ms(lambda p=p: resize_and_crop(preview_read(p).rgb, cfg), repeat) for p in previews]
    return {"original_ms": statistics.fmean(orig), "preview_ms": statistics.fmean(prev),
            "original_per_core_s": 1000 / statistics.fmean(orig), "preview_per_core_s": 1000 / statistics.fmean(prev),
            "speedup": statistics.fmean(orig) / statistics.fmean(prev),
            "original_bytes_mean": statistics.fmean(len(d) for _, d in photos),
            "preview_bytes_mean": statistics.fmean(map(len, previews))}


class _Previews:
    """An in-memory preview store for the runner."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs

    def read(self, key: str) -> bytes:
        if key not in self.blobs:
            raise FileNotFoundError(key)
        return self.blobs[key]

    def discard(self, key: str) -> None:
        self.blobs.pop(key, None)


def service_path_cosines(runner, images: dict[str, bytes]) -> dict:
    """Part 4: the runner from the originals (drawing previews as a worker does), then from them."""
    from workers.preview import preview_bytes

    stored: dict[str, bytes] = {}

    def draw(key, rgb, meta):
        stored[key] = preview_bytes(rgb, width=meta.width, height=meta.height, format=meta.format,
                                    short_side=runner.config.preview_side)[0]

    first = runner.run(list(images), images.__getitem__, draw)
    reads = []
    rates = {}
    for source, kw in (("original", {}), ("preview", {"previews": _Previews(stored)})):
        best = min(_best_ms(lambda kw=kw: runner.prepare(list(images), images.__getitem__, **kw), 1) for _ in range(3))
        rates[source] = len(images) / best * 1000

    def original(key):
        reads.append(key)
        return images[key]

    again = runner.run([m.key for m in first.metas], original, previews=_Previews(stored))
    assert reads == [] and again.previews.used == len(first.metas), (reads, again.previews)
    by_key = dict(zip([m.key for m in first.metas], first.vectors))
    cos = {m.key: float(np.dot(v, by_key[m.key])) for m, v in zip(again.metas, again.vectors)}
    return {"images": len(cos), "refused": len(first.failed), "cos": cos, "prepare_images_per_s": rates}


def whole_as_jpeg(encoder, cfg, images: dict[str, bytes]) -> dict:
    """Part 5: pictures that are their own preview (not shrunk), kept as JPEG q90 instead of the
    lossless copy: cosine to the original path, and decode ms of both forms (one thread)."""
    import cv2

    from workers.decode import decode_image
    from workers.errors import ImageRejected
    from workers.preview import PREVIEW_SIDE, preview_bytes, preview_read

    whole = {}
    for name, data in images.items():
        try:
            d = decode_image(data, min_side=cfg.min_side)
        except ImageRejected:
            continue
        if d.scale == 1 and min(d.rgb.shape[:2]) <= PREVIEW_SIDE:
            whole[name] = d.rgb
    names = list(whole)
    jpegs = {n: cv2.imencode(".jpg", cv2.cvtColor(whole[n], cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90])[1]
             for n in names}
    raws = {n: preview_bytes(whole[n], width=whole[n].shape[1], height=whole[n].shape[0], format="png")[0]
            for n in names}
    reference = _embed(encoder, cfg, [whole[n] for n in names])
    lossy = _embed(encoder, cfg, [cv2.imdecode(jpegs[n], cv2.IMREAD_COLOR_RGB) for n in names])
    cos = np.sum(reference * lossy, axis=1)
    return {"images": len(names), "jpeg_q90_cos_min": float(cos.min()), "jpeg_q90_cos_mean": float(cos.mean()),
            "jpeg_q90_worst": [names[i] for i in np.argsort(cos)[:2]],
            "jpeg_q90_decode_ms": statistics.fmean(_best_ms(lambda b=jpegs[n]: cv2.imdecode(b, cv2.IMREAD_COLOR_RGB), 3)
                                                   for n in names),
            "lossless_decode_ms": statistics.fmean(_best_ms(lambda b=raws[n]: preview_read(b), 3) for n in names),
            "jpeg_q90_kb": statistics.fmean(len(jpegs[n]) for n in names) / 1024,
            "lossless_kb": statistics.fmean(len(raws[n]) for n in names) / 1024}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="timing runs per image; the best counts")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    args = ap.parse_args(argv)

    import cv2
    import torch

    from workers.config import PipelineConfig
    from workers.model import EncoderHolder
    from workers.runner import BatchRunner

    cv2.setNumThreads(1)
    info = machine()
    print(machine_line(info), f"; load average {info.get('load_average_1m')}", flush=True)
    config = PipelineConfig(pretrained="random", seed=0, torch_threads=info["cores"])
    holder = EncoderHolder(config)
    encoder = holder.get()
    cfg = encoder.preprocess_config
    torch.set_num_threads(info["cores"])
    photos = [(p.name, p.read_bytes()) for p in sorted(photo_dir().iterdir()) if p.is_file()]
    results = {"machine": info, "command": "python -m benchmarks.previews " + " ".join(argv or sys.argv[1:]),
               "photos": len(photos)}
    print("1. formats", flush=True)
    results["formats"] = formats(photos, encoder, cfg, args.repeat)
    print("2. first embedding", flush=True)
    results["first_embed"] = first_embed_cost(photos, cfg, args.repeat)
    print("3. re-embed", flush=True)
    results["reembed"] = reembed_cost(photos, cfg, args.repeat)
    print("4. the service's path", flush=True)
    runner = BatchRunner(config.replace(decode_threads=info["cores"]), holder)
    odd = {f"odd/{p.name}": p.read_bytes() for p in sorted(ODD.iterdir()) if p.is_file()} if ODD.is_dir() else {}
    fidelity = {}
    for name, images in (("photos", {f"photos/{n}": d for n, d in photos}), ("odd", odd)):
        got = service_path_cosines(runner, images)
        values = list(got["cos"].values())
        fidelity[name] = {"images": got["images"], "refused": got["refused"], "cos_min": min(values),
                          "prepare_images_per_s": got["prepare_images_per_s"],
                          "cos_mean": statistics.fmean(values),
                          "worst": sorted(got["cos"].items(), key=lambda kv: kv[1])[:3]}
    results["fidelity"] = fidelity
    print("5. whole pictures as JPEG", flush=True)
    results["whole"] = whole_as_jpeg(encoder, cfg, {**{f"photos/{n}": d for n, d in photos}, **odd})
    results["load_average_1m_end"] = round(__import__("os").getloadavg()[0], 2)
    runner.close()

    rows = [(name, f"{r['decode_ms_mean']:.2f}", f"{r['decode_ms_median']:.2f}", f"{r['encode_ms_mean']:.2f}",
             f"{r['kb_mean']:.1f}", f"{r['cos_min']:.5f}", f"{r['cos_mean']:.5f}")
            for name, r in results["formats"]["rows"].items()]
    print(markdown_table(("format", "decode ms (mean)", "decode ms (median)", "encode ms", "KB", "cos min",
                          "cos mean"), rows))
    fe, re_ = results["first_embed"], results["reembed"]
    print(f"first embedding: thumbnail only {fe['thumbnail_only_ms']:.2f} ms, preview + thumbnail "
          f"{fe['preview_and_thumbnail_ms']:.2f} ms: +{fe['added_ms']:.2f} ms per image "
          f"(decode {fe['decode_ms']:.2f} ms;"
          f" {fe['decode_at_384_ms']:.2f} ms at a 384 px short side)")
    print(f"worker previews: {fe['jpeg']['n']} JPEG ({fe['jpeg']['kb_mean']:.1f} KB), {fe['lossless']['n']} lossless "
          f"({fe['lossless']['kb_mean']:.1f} KB); short side {fe['worker_preview_short_side']}")
    print(f"re-embed per image: original {re_['original_ms']:.2f} ms, preview {re_['preview_ms']:.2f} ms "
          f"({re_['speedup']:.1f}x)")
    for name, f in fidelity.items():
        print(f"fidelity {name}: {f['images']} images, cos min {f['cos_min']:.5f}, mean {f['cos_mean']:.5f}; "
              f"prepare {f['prepare_images_per_s']['original']:.0f} images/s from originals, "
              f"{f['prepare_images_per_s']['preview']:.0f} from previews")
    w = results["whole"]
    print(f"whole pictures ({w['images']}): as JPEG q90 cos min {w['jpeg_q90_cos_min']:.5f} "
          f"({w['jpeg_q90_worst'][0]}), "
          f"{w['jpeg_q90_decode_ms']:.2f} ms, {w['jpeg_q90_kb']:.1f} KB; lossless {w['lossless_decode_ms']:.2f} ms, "
          f"{w['lossless_kb']:.1f} KB")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "previews.json", results)
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(results["formats"]["rows"])
    a.barh(names, [results["formats"]["rows"][n]["decode_ms_mean"] for n in names])
    a.set_xlabel("decode ms per image (mean, one thread)")
    b.barh(names, [results["formats"]["rows"][n]["kb_mean"] for n in names])
    b.set_xlabel("KB per preview (mean)")
    b.set_yticks([])
    fig.suptitle(f"84 photos as 384 px previews; {info['cpu']}, {info['cores']} cores")
    fig.tight_layout()
    fig.savefig(args.out / "previews.png", dpi=100)


if __name__ == "__main__":
    main()
