"""Near-duplicate groups (issue 45 item 3, docs/duplicates-benchmarks.md): how well the calibrated
threshold groups real photos with their copies, what a scan of 100,000 points costs, and what
grouping a long chain of similar points costs.

    flock /tmp/bench.lock .venv/bin/python -m benchmarks.duplicates          # all parts, ~10 min on 2 cores
    python -m benchmarks.duplicates --points 20000 --clusters 400           # a quick check, ~3 min
    make bench-duplicates

1. **Labelled set** (``--parts labelled``): each of the 84 photos (``benchmarks._common.photos``)
   and its :data:`VARIANTS` (``workers.image_copies.copy_of``: JPEG 40/70/95, resized to 50 %/75 %,
   centre crops of 80 %/95 %, grey, a watermarked corner) form one true group; points of different
   photos are negatives. Everything is embedded by ``BatchRunner`` with ViT-B-32's seeded random
   weights (``pretrained="random"``, seed 0). The threshold is calibrated as the service does
   (``embeddings.services.duplicates.calibration`` → ``workers.duplicates.calibrate``) on a seeded
   sample of ``--sample`` photos (not their variants): positives are the cosines of each sampled
   photo to its ``CALIBRATION_COPIES``, pairs the sampled photos' cosines to each other, and
   neighbours (reported, not used for the threshold) each sampled photo's nearest other point of
   the labelled store (``VectorStore.neighbours`` at threshold -1, k = 1). All 840 points go into
   one owner's edge store; ``edges_of`` + ``group`` at each threshold; pairwise precision and
   recall of the groups (pairs in one predicted group against pairs of one photo), recall per
   variant kind (the variant shares a group with its photo), groups that mix two photos, photos
   whose ten points form one group.
2. **Scale** (``--parts scale``): ``--points`` random unit 512-d points (seed 0) of which
   ``--clusters`` planted clusters of 2–6 noisy copies of a centre (cosine to each other ≥ 0.97)
   and ``--decoys`` near misses (cosine ≈ 0.89 to a cluster's copies: below the threshold), one
   owner, in an edge store (upserted, then optimised as the background optimizer would). A fresh
   process opens it and runs the full scan at ``--scan-threshold``: pages of ``--slice`` points
   (``VectorStore.page``) through ``edges_of``, then ``group`` on the edges alone (no vector is
   read). Times of each step, peak RSS of that process (``VmHWM`` from the store's opening on),
   the Python-side peak of grouping (``tracemalloc``), edges found, and clusters recovered exactly
   vs planted. Then ``--new`` new points (3/10 new copies of existing clusters, 1/10 as new pairs,
   the rest unrelated), as the service's update does: upsert, ``edges_of`` for the new points, then
   ``links_within`` + ``group`` over the new points, their neighbours and the members of the groups
   they touch; the recovery again.
3. **Chain** (``--parts chain``): ``group`` alone on the edges of a random walk of ``--chain``
   unit points (each step cosine ≈ 0.995, so each point links to its ~20 nearest along the walk
   and the whole walk is one component whose ends share nothing), each point's
   ``NEIGHBOURS_K`` nearest at or above ``--scan-threshold`` as ``edges_of`` would find them: the
   case a component-wide similarity matrix made quadratic. Seconds of ``group`` per size.

Prints the CPU and its flags and markdown tables; writes ``results.json`` / ``results.md`` under
``--out`` (``var/bench/duplicates``) and the threshold plot to ``--plot``
(``docs/bench/duplicates-threshold.png``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import numpy as np

from benchmarks._common import ROOT, machine, machine_line, markdown_table, photos, pyplot, write_json

DIM = 512
OWNER = 1
#: Points per upsert call (the store splits them into requests of ``UPSERT_BATCH``).
WRITE_CHUNK = 2048

#: The labelled copies of each photo: ``(name, copy_of kind, amount)``.
VARIANTS = (("jpeg40", "jpeg", 40), ("jpeg70", "jpeg", 70), ("jpeg95", "jpeg", 95),
            ("resize50", "resize", 0.5), ("resize75", "resize", 0.75),
            ("crop80", "crop", 0.8), ("crop95", "crop", 0.95),
            ("grey", "grey", 0), ("watermark", "watermark", 0.06))

#: Fixed thresholds of the sweep, besides the calibrated one: with the seeded random weights the
#: labelled copies sit at 0.20–1 (crops from 0.90, grey from 0.20) and each photo's nearest other
#: photo at 0.92–0.997 (docs/duplicates-benchmarks.md).
SWEEP = (0.93, 0.95, 0.96, 0.97, 0.975, 0.98, 0.985, 0.99, 0.995, 0.998)

#: Photos sampled for the calibration: the service's ``DUPLICATES_CALIBRATION_SAMPLE`` default
#: (project/configuration.py).
SAMPLE = 48

#: Scale part: noise of a planted copy, ``copy = unit(centre + s·g)`` with ``g ~ N(0, I/D)``: cosine
#: ≈ 1/sqrt(1 + s²) ≈ 0.987 to the centre and ≈ 1/(1 + s²) ≈ 0.975 between two copies.
COPY_NOISE = 0.16
#: A near miss: cosine ≈ 0.90 to the centre, ≈ 0.89 to its copies (s² = 1/0.9² − 1).
DECOY_NOISE = 0.484
#: The scale part's threshold: between the copies' pairwise ≈ 0.975 and the near misses' ≈ 0.89.
SCAN_THRESHOLD = 0.95
#: Chain part: noise of one step of the walk, ``next = unit(prev + s·g)``: cosine ≈ (1 + s²)^(-d/2)
#: between points d steps apart, so ≈ 0.995 a step and ≥ :data:`SCAN_THRESHOLD` up to ~10 steps.
CHAIN_NOISE = 0.1
#: Chain lengths timed by default: the sizes the component-matrix cut was measured at before.
CHAIN_SIZES = (1_000, 2_000, 3_000)


# --- shared scoring --------------------------------------------------------------------------------


def _pairs(members: Sequence) -> Iterable[tuple]:
    for i in range(len(members)):
        for j in range(i + 1, len(members)):
            yield members[i], members[j]


def pairwise(groups: Sequence[Sequence[Hashable]], label: dict[Hashable, Hashable]) -> dict:
    """Pairwise precision and recall of predicted ``groups`` (lists of point ids) against the true
    grouping ``label`` (point id -> true group; every point of the set, singletons included).

    Returns:
        ``{"predicted_pairs", "true_pairs", "correct_pairs", "precision", "recall", "mixed_groups"}``;
        precision 1.0 when nothing is predicted; ``mixed_groups``: groups holding two true groups.
    """
    sizes: dict[Hashable, int] = {}
    for lab in label.values():
        sizes[lab] = sizes.get(lab, 0) + 1
    true_pairs = sum(s * (s - 1) // 2 for s in sizes.values())
    predicted = correct = mixed = 0
    for g in groups:
        predicted += len(g) * (len(g) - 1) // 2
        correct += sum(label[a] == label[b] for a, b in _pairs(list(g)))
        mixed += len({label[m] for m in g}) > 1
    return {"predicted_pairs": predicted, "true_pairs": true_pairs, "correct_pairs": correct,
            "precision": correct / predicted if predicted else 1.0,
            "recall": correct / true_pairs if true_pairs else 1.0, "mixed_groups": mixed}


def recovery(groups: Sequence[Sequence[Hashable]], truth: Sequence[Sequence[Hashable]]) -> dict:
    """Exact recovery of planted clusters: ``{"planted", "predicted", "exact"}`` where ``exact`` is
    the number of predicted groups whose member set equals a planted cluster's, and
    ``recall = exact / planted``, ``precision = exact / predicted``."""
    want = {frozenset(c) for c in truth}
    exact = sum(frozenset(g) in want for g in groups)
    return {"planted": len(want), "predicted": len(groups), "exact": exact,
            "recall": exact / len(want) if want else 1.0, "precision": exact / len(groups) if groups else 1.0}


def members(groups) -> list[list]:
    """Member ids of ``workers.duplicates.Group`` objects."""
    return [[m for m, _ in g.members] for g in groups]


# --- 1. labelled photos ----------------------------------------------------------------------------


def labelled_images() -> tuple[dict[str, bytes], dict[str, tuple[str, str]]]:
    """The labelled set and the calibration copies as JPEG bytes.

    Returns:
        ``(blobs, meta)``: ``blobs`` key -> bytes for every point (``"<photo>|original"``,
        ``"<photo>|<variant>"``) and calibration copy (``"<photo>|cal:<kind><amount>"``); ``meta``
        key -> ``(photo, variant or "original" or "cal:...")``.
    """
    from workers.decode import decode_image
    from workers.image_copies import CALIBRATION_COPIES, copy_of

    blobs: dict[str, bytes] = {}
    meta: dict[str, tuple[str, str]] = {}
    for name, data in photos():
        rgb = decode_image(data).rgb
        copies = [("original", data)] + [(v, copy_of(rgb, kind, amount)) for v, kind, amount in VARIANTS]
        copies += [(f"cal:{kind}{amount}", copy_of(rgb, kind, amount)) for kind, amount in CALIBRATION_COPIES]
        for v, b in copies:
            blobs[f"{name}|{v}"] = b
            meta[f"{name}|{v}"] = (name, v)
    return blobs, meta


def embed(blobs: dict[str, bytes]) -> tuple[dict[str, np.ndarray], float, int]:
    """Embeddings ``key -> (512,) float32`` (unit) by ViT-B-32 with seeded random weights; bytes
    that repeat (a calibration copy equal to a labelled variant) are embedded once.

    Returns:
        ``(vectors, seconds, distinct images embedded)``.

    Raises:
        RuntimeError: an image failed to embed.
    """
    from workers.config import PipelineConfig
    from workers.model import EncoderHolder
    from workers.runner import BatchRunner

    by_sha: dict[str, bytes] = {}
    sha_of = {}
    for k, b in blobs.items():
        sha_of[k] = hashlib.sha256(b).hexdigest()
        by_sha.setdefault(sha_of[k], b)
    cfg = PipelineConfig(pretrained="random", seed=0, torch_threads=2)
    runner = BatchRunner(cfg, EncoderHolder(cfg))
    keys = sorted(by_sha)
    got: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    for res in runner.run_many([keys[i:i + 64] for i in range(0, len(keys), 64)], lambda k: by_sha[k]):
        if res.failed:
            raise RuntimeError(f"images failed to embed: {res.failed}")
        for m, v in zip(res.metas, res.vectors):
            got[m.key] = np.asarray(v, np.float32)
    seconds = time.perf_counter() - t0
    return {k: got[sha_of[k]] for k in blobs}, seconds, len(keys)


def _store(folder: str, collection: str, ids: Sequence[uuid.UUID], vectors: np.ndarray):
    from workers.vector_store import Point, open_store

    store = open_store("edge", collection=collection, dim=DIM, path=folder)
    store.ensure_collection()
    payload = {"owner_ids": [OWNER], "job_ids": [], "items": []}
    for i in range(0, len(ids), WRITE_CHUNK):
        store.upsert([Point(ids[j], vectors[j], payload) for j in range(i, min(i + WRITE_CHUNK, len(ids)))])
    return store


def nearest_other(store, queries: Sequence[tuple[uuid.UUID, np.ndarray]]) -> list[float]:
    """Cosine of each query point to its nearest other point in ``store`` (neighbours at threshold
    -1, k = 1): the calibration's ``neighbours``."""
    out = []
    for i in range(0, len(queries), 256):
        out += [hits[0].score for hits in store.neighbours(queries[i:i + 256], k=1, threshold=-1.0, owner_id=OWNER)
                if hits]
    return out


def grouping_at(store, points: dict[uuid.UUID, np.ndarray], threshold: float) -> tuple[list, float]:
    """``edges_of`` every point of ``points`` then ``group``: ``(groups as member-id lists, seconds)``."""
    from workers import duplicates

    t0 = time.perf_counter()
    edges = duplicates.edges_of(store, list(points.items()), threshold=threshold, owner_id=OWNER)
    groups = duplicates.group(edges)
    return members(groups), time.perf_counter() - t0


def score_labelled(groups: list[list[uuid.UUID]], meta_of: dict[uuid.UUID, tuple[str, str]]) -> dict:
    """Pairwise precision/recall (:func:`pairwise`), recall per variant kind (the variant shares a
    predicted group with its photo's original), and ``whole``: photos whose ten points are exactly
    one predicted group."""
    label = {pid: m[0] for pid, m in meta_of.items()}
    out = pairwise(groups, label)
    group_of = {pid: i for i, g in enumerate(groups) for pid in g}
    original = {m[0]: pid for pid, m in meta_of.items() if m[1] == "original"}
    kinds: dict[str, list[bool]] = {}
    for pid, (photo, v) in meta_of.items():
        if v != "original":
            kinds.setdefault(v, []).append(pid in group_of and group_of[pid] == group_of.get(original[photo]))
    out["recall_by_kind"] = {v: sum(f) / len(f) for v, f in kinds.items()}
    points_of: dict[str, set] = {}
    for pid, (photo, _) in meta_of.items():
        points_of.setdefault(photo, set()).add(pid)
    as_sets = {frozenset(g) for g in groups}
    out["whole"] = sum(frozenset(p) in as_sets for p in points_of.values())
    out["groups"] = len(groups)
    return out


def run_labelled(thresholds: Sequence[float], sample: int = SAMPLE) -> dict:
    """Part 1 (see the module docstring). Returns the calibration, per-threshold scores, the cosines
    per kind, and the embedding time."""
    import random

    from workers import duplicates

    blobs, meta = labelled_images()
    vecs, embed_s, distinct = embed(blobs)
    photo_names = sorted({p for p, _ in meta.values()})
    points = [k for k in blobs if not meta[k][1].startswith("cal:")]
    ids = {k: uuid.UUID(int=i + 1) for i, k in enumerate(points)}
    meta_of = {ids[k]: meta[k] for k in points}
    picked = sorted(random.Random(0).sample(photo_names, min(sample, len(photo_names))))
    out: dict = {"photos": len(photo_names), "points": len(points), "variants": [v for v, _, _ in VARIANTS],
                 "embed_s": embed_s, "embedded_images": distinct, "sample": len(picked)}

    def to_photo(name: str, k: str) -> float:
        return float(vecs[f"{name}|original"] @ vecs[k])

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        originals = [f"{p}|original" for p in photo_names]
        photo_store = _store(tmp, "photos", [ids[k] for k in originals], np.stack([vecs[k] for k in originals]))
        store = _store(tmp, "labelled", [ids[k] for k in points], np.stack([vecs[k] for k in points]))
        copies = [k for k in blobs if meta[k][1].startswith("cal:")]
        o = np.stack([vecs[f"{p}|original"] for p in picked])
        cal = duplicates.calibrate(
            [to_photo(meta[k][0], k) for k in copies if meta[k][0] in picked],
            (o @ o.T)[np.triu_indices(len(picked), k=1)].tolist(),
            neighbours=nearest_other(store, [(ids[f"{p}|original"], vecs[f"{p}|original"]) for p in picked]),
            default=float("nan"))
        out["calibration"] = cal
        queries = [(ids[k], vecs[k]) for k in originals]
        o = np.stack([vecs[k] for k in originals])
        out["cosines"] = {"calibration copies": [to_photo(meta[k][0], k) for k in copies],
                          "other photos (each pair)": (o @ o.T)[np.triu_indices(len(o), k=1)].tolist(),
                          "nearest other photo": nearest_other(photo_store, queries),
                          "nearest other point": nearest_other(store, queries),
                          **{v: [to_photo(p, f"{p}|{v}") for p in photo_names] for v, _, _ in VARIANTS}}
        out["rows"] = []
        pts = {ids[k]: vecs[k] for k in points}
        for t in sorted(set(thresholds) | {cal["threshold"]}):
            groups, seconds = grouping_at(store, pts, t)
            out["rows"].append({"threshold": t, "seconds": seconds, "calibrated": t == cal["threshold"],
                                **score_labelled(groups, meta_of)})
        photo_store.close()
        store.close()
    return out


def labelled_tables(res: dict) -> str:
    """Markdown: the calibration, the cosines per kind, and precision/recall per threshold."""
    lines = [(f"{res['photos']} photos × (original + {len(res['variants'])} variants) = {res['points']} points; "
              f"{res['embedded_images']} distinct images embedded in {res['embed_s']:.0f} s "
              "(ViT-B-32, seeded random weights)"), ""]
    c = res["calibration"]
    p, q = c["positives"], c["pairs"]
    lines += [markdown_table(
        ["sample", "positives", "pos q05", "pos q50", "pairs", "pairs q50", "pairs max", "separable", "threshold",
         "copies ≥ t", "pairs ≥ t", "neighbours ≥ t"],
        [[res["sample"], p["n"], f"{p['q05']:.4f}", f"{p['q50']:.4f}", q["n"], f"{q['q50']:.4f}", f"{q['max']:.4f}",
          c["separable"], f"{c['threshold']:.4f}", f"{c['recall_copies']:.2f}", f"{c['pairs_above']:.3f}",
          f"{c['neighbours_above']:.2f}"]]), ""]
    rows = []
    for name, vals in res["cosines"].items():
        v = np.asarray(vals)
        rows.append([name, len(v), f"{v.min():.4f}", f"{np.quantile(v, 0.05):.4f}", f"{np.median(v):.4f}",
                     f"{np.quantile(v, 0.95):.4f}", f"{v.max():.4f}"])
    lines += [markdown_table(["cosine to the photo", "n", "min", "q05", "median", "q95", "max"], rows), ""]
    kinds = res["variants"]
    rows = []
    for r in res["rows"]:
        rows.append([f"{r['threshold']:.4f}{' (calibrated)' if r['calibrated'] else ''}", f"{r['precision']:.3f}",
                     f"{r['recall']:.3f}", r["groups"], r["mixed_groups"], r["whole"]]
                    + [f"{r['recall_by_kind'][k]:.2f}" for k in kinds])
    lines.append(markdown_table(["threshold", "precision", "recall", "groups", "mixed", "whole photos"] + kinds, rows))
    return "\n".join(lines)


def plot_labelled(res: dict, path: Path) -> None:
    """Precision, recall and recall per kind against the threshold (left), and the cosine
    distributions the calibration sees (right), the calibrated threshold marked."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"wspace": 0.55})
    t = [r["threshold"] for r in res["rows"]]
    for k in res["variants"]:
        ax.plot(t, [r["recall_by_kind"][k] for r in res["rows"]], lw=0.8, alpha=0.6, label=f"recall {k}")
    ax.plot(t, [r["precision"] for r in res["rows"]], "k-o", lw=2, label="pairwise precision")
    ax.plot(t, [r["recall"] for r in res["rows"]], "r-o", lw=2, label="pairwise recall")
    seen = ("calibration copies", "other photos (each pair)", "nearest other photo")
    lo = min(0.9, min(min(res["cosines"][k]) for k in seen[::2]))
    bins = np.linspace(lo, 1.0, 50)
    for k, label in zip(seen, ("photo vs its calibration copies", "photo vs each other photo",
                               "photo vs its nearest other photo")):
        bx.hist(np.clip(res["cosines"][k], lo, 1.0), bins=bins, alpha=0.5, label=label)
    bx.set_yscale("log")
    threshold = res["calibration"]["threshold"]
    for a in (ax, bx):
        a.axvline(threshold, ls="--", color="grey", label=f"calibrated {threshold:.4f}")
    ax.set(xlabel="threshold (cosine)", ylabel="share", ylim=(-0.02, 1.02),
           title=f"{res['photos']} photos + {len(res['variants'])} variants each")
    bx.set(xlabel=f"cosine (below {lo:.2f} counted at {lo:.2f})", ylabel="count",
           title=f"what the calibration sees (all {res['photos']} photos)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    bx.legend(fontsize=7, loc="upper left")
    fig.suptitle("Near-duplicate groups, ViT-B-32 with seeded random weights")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --- 2. scale ----------------------------------------------------------------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _copies(rng: np.random.Generator, centre: np.ndarray, n: int, noise: float) -> np.ndarray:
    return _unit(centre + noise * rng.normal(size=(n, DIM)) / np.sqrt(DIM))


def planted(n: int, clusters: int, decoys: int, *, seed: int = 0) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
    """``n`` unit 512-d points: ``clusters`` clusters of 2–6 copies of a random centre
    (:data:`COPY_NOISE`), ``decoys`` near misses of random clusters' centres (:data:`DECOY_NOISE`),
    the rest independent random points; all at shuffled positions.

    Returns:
        ``(vectors (n, 512) float32, clusters as lists of row indices, centres (clusters, 512))``.

    Raises:
        ValueError: the clusters and decoys need more than ``n`` points.
    """
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 7, size=clusters)
    if sizes.sum() + decoys > n:
        raise ValueError(f"{clusters} clusters ({sizes.sum()} points) and {decoys} decoys do not fit in {n} points")
    centres = _unit(rng.normal(size=(clusters, DIM)))
    x = np.empty((n, DIM), np.float32)
    order = rng.permutation(n)
    truth, at = [], 0
    for c, size in enumerate(sizes):
        rows = order[at:at + size]
        x[rows] = _copies(rng, centres[c], size, COPY_NOISE)
        truth.append(sorted(int(r) for r in rows))
        at += size
    for _ in range(decoys):
        x[order[at]] = _copies(rng, centres[rng.integers(clusters)], 1, DECOY_NOISE)[0]
        at += 1
    rest = order[at:]
    x[rest] = _unit(rng.normal(size=(len(rest), DIM)))
    return x, truth, centres


def new_points(new: int, truth: list[list[int]], centres: np.ndarray, n: int, *,
               seed: int = 1) -> tuple[np.ndarray, list[list[int]]]:
    """``new`` points for the incremental step (row indices ``n`` on): 3/10 new copies of distinct
    existing clusters, 1/10 as new pairs, the rest unrelated.

    Returns:
        ``(vectors (new, 512) float32, the clusters after the step as lists of row indices)``.
    """
    rng = np.random.default_rng(seed)
    copies = min(new * 3 // 10, len(truth))
    pairs = new // 20
    x = _unit(rng.normal(size=(new, DIM)))
    after = [list(c) for c in truth]
    for i, c in enumerate(rng.choice(len(truth), size=copies, replace=False)):
        x[i] = _copies(rng, centres[c], 1, COPY_NOISE)[0]
        after[c].append(n + i)
    for p in range(pairs):
        rows = [copies + 2 * p, copies + 2 * p + 1]
        x[rows] = _copies(rng, _unit(rng.normal(size=DIM)), 2, COPY_NOISE)
        after.append([n + r for r in rows])
    return x, after


def point_ids(start: int, count: int) -> list[uuid.UUID]:
    """The point id of row ``i`` is ``UUID(int=i + 1)``."""
    return [uuid.UUID(int=i + 1) for i in range(start, start + count)]


def fill(store, vectors: np.ndarray, *, start: int = 0) -> float:
    """Upsert ``vectors`` as rows ``start…`` of the owner's points; seconds taken."""
    from workers.vector_store import Point

    ids = point_ids(start, len(vectors))
    payload = {"owner_ids": [OWNER], "job_ids": [], "items": []}
    t0 = time.perf_counter()
    for i in range(0, len(ids), WRITE_CHUNK):
        store.upsert([Point(ids[j], vectors[j], payload) for j in range(i, min(i + WRITE_CHUNK, len(ids)))])
    return time.perf_counter() - t0


def scan(store, *, threshold: float, slice_: int) -> dict:
    """The full scan: pages of ``slice_`` of the owner's points (``VectorStore.page``) through
    ``edges_of``, then ``group`` on the edges (no vector read).

    Returns:
        ``{"edges" ((a, b, cosine) list), "groups" (workers.duplicates.Group list), "page_s",
        "query_s", "group_s", "points"}``; times in seconds.
    """
    from workers import duplicates

    edges: dict[tuple, float] = {}
    page_s = query_s = 0.0
    points = 0
    offset = None
    while True:
        t0 = time.perf_counter()
        page, offset = store.page(limit=slice_, offset=offset, owner_id=OWNER)
        t1 = time.perf_counter()
        queries = [(p.id, p.vector) for p in page]
        for a, b, s in duplicates.edges_of(store, queries, threshold=threshold, owner_id=OWNER):
            edges[(a, b)] = max(edges.get((a, b), -1.0), s)
        page_s, query_s, points = page_s + t1 - t0, query_s + time.perf_counter() - t1, points + len(page)
        if offset is None:
            break
    edge_list = [(a, b, s) for (a, b), s in edges.items()]
    t0 = time.perf_counter()
    groups = duplicates.group(edge_list)
    return {"edges": edge_list, "groups": groups, "page_s": page_s, "query_s": query_s,
            "group_s": time.perf_counter() - t0, "points": points}


def increment(store, groups: list, new: np.ndarray, *, start: int, threshold: float) -> dict:
    """Add ``new`` points (rows ``start…``) and regroup what they touch, as the service's update
    does (``embeddings.services.duplicates.scan.scan_update``): upsert, ``edges_of`` for the new
    points, then the new points, their neighbours and every member of the groups they touch
    regrouped together: their stored vectors (``VectorStore.vectors``), all pairs at or above
    ``threshold`` (``links_within``), ``group``. The untouched groups are kept as they are.

    Returns:
        ``{"groups" (all groups after the step), "upsert_s", "query_s", "regroup_s" (vectors +
        links_within + group), "edges" (of the new points), "touched" (groups), "regrouped_points"}``;
        times in seconds.
    """
    from workers import duplicates

    upsert_s = fill(store, new, start=start)
    ids = point_ids(start, len(new))
    t0 = time.perf_counter()
    edges = duplicates.edges_of(store, list(zip(ids, new)), threshold=threshold, owner_id=OWNER)
    t1 = time.perf_counter()
    linked = {x for a, b, _ in edges for x in (a, b)}
    touched = [g for g in groups if any(m in linked for m, _ in g.members)]
    kept = [g for g in groups if not any(m in linked for m, _ in g.members)]
    nodes = linked | {m for g in touched for m, _ in g.members}
    regrouped = duplicates.group(duplicates.links_within(store.vectors(list(nodes)), threshold))
    t2 = time.perf_counter()
    return {"groups": kept + regrouped, "upsert_s": upsert_s, "query_s": t1 - t0, "regroup_s": t2 - t1,
            "edges": len(edges), "touched": len(touched), "regrouped_points": len(nodes)}


def _rss_kib(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in KiB (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux ``clear_refs`` 5); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def scale_child(folder: Path) -> None:
    """The scan process (``--child``): opens the store in ``folder``, runs :func:`scan`, scores it
    against ``folder/truth.json``, then :func:`increment` with ``folder/new.npy``; writes
    ``folder/child.json``."""
    from workers.vector_store import open_store

    spec = json.loads((folder / "spec.json").read_text())
    truth = json.loads((folder / "truth.json").read_text())
    t0 = time.perf_counter()
    store = open_store("edge", collection="scale", dim=DIM, path=str(folder / "store"))
    store.ensure_collection()
    out: dict = {"open_s": time.perf_counter() - t0, "rss_open_mib": _rss_kib("VmRSS") / 1024}
    peak_reset = _reset_peak()
    res = scan(store, threshold=spec["threshold"], slice_=spec["slice"])
    out.update({k: res[k] for k in ("page_s", "query_s", "group_s", "points")})
    out["edges"] = len(res["edges"])
    peak_kib = _rss_kib("VmHWM") if peak_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peak_rss_mib"] = peak_kib / 1024
    out["peak_reset"] = peak_reset
    row = {pid: i for i, pid in enumerate(point_ids(0, spec["points"] + spec["new"]))}
    groups = res["groups"]
    as_rows = [[row[m] for m in g] for g in members(groups)]
    label = {r: ("c", i) for i, c in enumerate(truth["before"]) for r in c}
    out["recovery"] = recovery(as_rows, truth["before"])
    out["pairwise"] = pairwise(as_rows, {**{r: ("p", r) for r in range(spec["points"])}, **label})
    # the Python side of grouping alone, repeated under tracemalloc (its allocations are traced)
    tracemalloc.start()
    from workers import duplicates

    duplicates.group(res["edges"])
    out["group_python_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    new = np.load(folder / "new.npy")
    inc = increment(store, groups, new, start=spec["points"], threshold=spec["threshold"])
    total = spec["points"] + len(new)
    as_rows = [[row[m] for m in g] for g in members(inc["groups"])]
    label = {r: ("c", i) for i, c in enumerate(truth["after"]) for r in c}
    out["increment"] = {**{k: inc[k] for k in ("upsert_s", "query_s", "regroup_s", "edges", "touched",
                                                "regrouped_points")},
                        "recovery": recovery(as_rows, truth["after"]),
                        "pairwise": pairwise(as_rows, {**{r: ("p", r) for r in range(total)}, **label})}
    store.close()
    (folder / "child.json").write_text(json.dumps(out))


def run_scale(points: int, clusters: int, decoys: int, new: int, threshold: float, slice_: int) -> dict:
    """Part 2 (see the module docstring): builds the store here, scans in a fresh process."""
    from workers.vector_store import open_store

    t0 = time.perf_counter()
    x, truth, centres = planted(points, clusters, decoys)
    extra, after = new_points(new, truth, centres, points)
    out: dict = {"points": points, "clusters": clusters, "planted_points": sum(map(len, truth)), "decoys": decoys,
                 "new": new, "threshold": threshold, "slice": slice_, "generate_s": time.perf_counter() - t0}
    # the worst pairs the threshold must separate: inside a planted cluster, and a decoy to its cluster
    out["min_cosine_in_cluster"] = float(min((x[c] @ x[c].T).min() for c in truth))
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        folder = Path(tmp)
        store = open_store("edge", collection="scale", dim=DIM, path=str(folder / "store"))
        store.ensure_collection()
        out["upsert_s"] = fill(store, x)
        _, out["optimize_s"] = store.optimize()
        store.close()
        del x
        (folder / "truth.json").write_text(json.dumps({"before": truth, "after": after}))
        (folder / "spec.json").write_text(json.dumps({"threshold": threshold, "slice": slice_, "points": points,
                                                      "new": new}))
        np.save(folder / "new.npy", extra)
        subprocess.run([sys.executable, "-m", "benchmarks.duplicates", "--child", str(folder)], cwd=ROOT, check=True)
        out.update(json.loads((folder / "child.json").read_text()))
    return out


def scale_tables(res: dict) -> str:
    """Markdown: the full scan and the incremental step."""
    n = res["points"]
    scan_s = res["page_s"] + res["query_s"] + res["group_s"]
    rec, inc = res["recovery"], res["increment"]
    lines = [(f"{n:,} unit 512-d points, one owner: {res['clusters']:,} planted clusters of 2–6 "
             f"({res['planted_points']:,} points, min cosine inside a cluster {res['min_cosine_in_cluster']:.4f}), "
             f"{res['decoys']:,} near misses, threshold {res['threshold']}, slices of {res['slice']:,}; "
             f"upsert {res['upsert_s']:.1f} s, optimise {res['optimize_s']:.1f} s, open in the scan process "
             f"{res['open_s']:.1f} s"), ""]
    rows = [["read pages (`page`)", f"{res['page_s']:.1f}", ""],
            ["neighbour queries (`edges_of`)", f"{res['query_s']:.1f}",
             f"{1000 * res['query_s'] / res['points']:.2f} ms / point"],
            ["grouping (`group`, edges only)", f"{res['group_s']:.3f}", ""],
            ["full scan", f"{scan_s:.1f}", f"{scan_s / 60:.1f} min"]]
    lines += [markdown_table(["full scan step", "s", ""], rows), ""]
    lines += [markdown_table(
        ["", "edges", "groups", "exact = planted", "recall", "precision", "pairwise P / R", "mixed"],
        [["full scan", f"{res['edges']:,}", f"{rec['predicted']:,}", f"{rec['exact']:,} / {rec['planted']:,}", f"{rec['recall']:.4f}",
          f"{rec['precision']:.4f}", f"{res['pairwise']['precision']:.4f} / {res['pairwise']['recall']:.4f}",
          res["pairwise"]["mixed_groups"]],
         [f"after +{res['new']:,}", f"{inc['edges']:,}", f"{inc['recovery']['predicted']:,}",
          f"{inc['recovery']['exact']:,} / {inc['recovery']['planted']:,}", f"{inc['recovery']['recall']:.4f}",
          f"{inc['recovery']['precision']:.4f}",
          f"{inc['pairwise']['precision']:.4f} / {inc['pairwise']['recall']:.4f}",
          inc["pairwise"]["mixed_groups"]]]), ""]
    peak = "VmHWM since the store opened" if res["peak_reset"] else "ru_maxrss of the process"
    lines.append(f"Memory of the scan process: {res['rss_open_mib']:.0f} MiB after opening the store, peak "
                 f"{res['peak_rss_mib']:.0f} MiB ({peak}); grouping's Python-side peak "
                 f"{res['group_python_peak_mib']:.1f} MiB (tracemalloc).")
    lines += ["", markdown_table(["incremental step", "s"], [
        [f"upsert {res['new']:,} points", f"{inc['upsert_s']:.2f}"],
        [f"`edges_of` for the {res['new']:,}", f"{inc['query_s']:.2f}"],
        [(f"regroup {inc['touched']} touched groups ({inc['regrouped_points']:,} points: `vectors`, "
          "`links_within`, `group`)"), f"{inc['regroup_s']:.3f}"],
        ["edges_of + regroup", f"{inc['query_s'] + inc['regroup_s']:.2f}"]])]
    return "\n".join(lines)


# --- 3. chain ----------------------------------------------------------------------------------------


def chain_edges(n: int, threshold: float, *, k: int | None = None, seed: int = 0) -> list[tuple[int, int, float]]:
    """Edges of a random walk of ``n`` unit 512-d points (:data:`CHAIN_NOISE` a step): each point's
    ``k`` (default ``NEIGHBOURS_K``) nearest others at or above ``threshold``, as ``edges_of``
    returns them: ``(a, b, cosine)`` with ``a < b``, each pair once, sorted.

    Raises:
        ValueError: ``n`` < 2.
    """
    from workers.duplicates import NEIGHBOURS_K

    if n < 2:
        raise ValueError(f"a chain needs at least 2 points, got {n}")
    k = NEIGHBOURS_K if k is None else k
    rng = np.random.default_rng(seed)
    x = np.empty((n, DIM), np.float32)
    x[0] = _unit(rng.normal(size=DIM))
    for i in range(1, n):
        x[i] = _copies(rng, x[i - 1], 1, CHAIN_NOISE)[0]
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    near = np.argsort(-sims, axis=1)[:, :k]
    found: dict[tuple[int, int], float] = {}
    for a in range(n):
        for b in near[a].tolist():
            if sims[a, b] >= threshold:
                found[(min(a, b), max(a, b))] = float(sims[a, b])
    return sorted((a, b, s) for (a, b), s in found.items())


def run_chain(sizes: Sequence[int], threshold: float) -> list[dict]:
    """Part 3 (see the module docstring): per chain length, the edges, the seconds of ``group``
    on them (best of 3), the groups it cuts and the largest one."""
    from workers import duplicates

    rows = []
    for n in sizes:
        edges = chain_edges(n, threshold)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            groups = duplicates.group(edges)
            times.append(time.perf_counter() - t0)
        rows.append({"points": n, "edges": len(edges), "group_s": min(times), "groups": len(groups),
                     "grouped_points": sum(len(g.members) for g in groups),
                     "largest": max((len(g.members) for g in groups), default=0)})
    return rows


def chain_table(rows: list[dict]) -> str:
    """Markdown: ``group`` on chains."""
    return markdown_table(["chain points", "edges", "`group` s (best of 3)", "groups", "points grouped", "largest"],
                          [[f"{r['points']:,}", f"{r['edges']:,}", f"{r['group_s']:.3f}", r["groups"],
                            f"{r['grouped_points']:,}", r["largest"]] for r in rows])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=("labelled", "scale", "chain"),
                    default=["labelled", "scale", "chain"])
    ap.add_argument("--thresholds", type=float, nargs="+", default=list(SWEEP),
                    help="the labelled sweep, besides the calibrated threshold")
    ap.add_argument("--sample", type=int, default=SAMPLE, help="photos sampled for the calibration")
    ap.add_argument("--points", type=int, default=100_000)
    ap.add_argument("--clusters", type=int, default=2_000)
    ap.add_argument("--decoys", type=int, default=1_000)
    ap.add_argument("--new", type=int, default=1_000, help="points added in the incremental step")
    ap.add_argument("--scan-threshold", type=float, default=SCAN_THRESHOLD)
    ap.add_argument("--slice", type=int, default=10_000, help="points per page of the full scan")
    ap.add_argument("--chain", type=int, nargs="+", default=list(CHAIN_SIZES), help="chain lengths to group")
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "duplicates")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench" / "duplicates-threshold.png")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        scale_child(a.child)
        return
    info = machine()
    print(machine_line(info), flush=True)
    res: dict = {"machine": info}
    md = [machine_line(info)]
    if "labelled" in a.parts:
        res["labelled"] = run_labelled(a.thresholds, a.sample)
        text = labelled_tables(res["labelled"])
        plot_labelled(res["labelled"], a.plot)
        print("\n## Labelled photos\n\n" + text + f"\n\nplot: {a.plot}", flush=True)
        md += ["## Labelled photos", text]
    if "scale" in a.parts:
        res["scale"] = run_scale(a.points, a.clusters, a.decoys, a.new, a.scan_threshold, a.slice)
        text = scale_tables(res["scale"])
        print(f"\n## Scale: {a.points:,} points\n\n" + text, flush=True)
        md += [f"## Scale: {a.points:,} points", text]
    if "chain" in a.parts:
        res["chain"] = run_chain(a.chain, a.scan_threshold)
        text = chain_table(res["chain"])
        print("\n## Grouping a chain\n\n" + text, flush=True)
        md += ["## Grouping a chain", text]
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "results.json", res)
    (a.out / "results.md").write_text("\n\n".join(md) + "\n")


if __name__ == "__main__":
    main()
