"""A bulk chunk's model input with glibc's default malloc thresholds against
``workers.memory.keep_batch_memory`` (``BULK_BATCH_MEMORY_MB``, issue 58 item 3): what a chunk's
memory costs before the model sees it.

    python -m benchmarks.batch_memory [--chunks 64 512] [--rounds 4] [--repeat 6]
    make bench-batch-memory [BENCH_ARGS="..."]

Per chunk, in one process with one torch thread, as ``BatchRunner`` does it: the chunk's
``(3, 224, 224) uint8`` crops stacked (``prepare``), then normalised to float32 (``model_input``,
``workers.preprocess.normalize``), then freed. Each setting runs in a fresh child process (the
thresholds are the whole process's), rounds alternating default, kept, kept, default, ... on the
same machine and load, so their ratio holds where absolute times move with other work; each child
times ``--repeat`` chunks after one warm-up chunk and reports the median ms and the minor page
faults per chunk (``getrusage``). The 1-minute load average is printed beside every row. Results:
docs/scaling.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ROOT, begin, markdown_table, write_json  # noqa: E402

#: The child: ``chunk limit_mb repeat`` → JSON ``{"ms", "faults", "kept"}`` (medians per chunk).
CHILD = """
import json, resource, statistics, sys, time
import torch
from workers import memory
from workers.preprocess import PreprocessConfig, normalize
chunk, limit_mb, repeat = map(int, sys.argv[1:4])
kept = memory.keep_batch_memory(limit_mb)
torch.set_num_threads(1)
cfg = PreprocessConfig(size=(224, 224), mean=(0.48145466, 0.4578275, 0.40821073),
                       std=(0.26862954, 0.26130258, 0.27577711))  # open_clip's OPENAI_DATASET_MEAN / _STD
g = torch.Generator().manual_seed(0)
crops = [torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=g) for _ in range(chunk)]
ms, faults = [], []
for i in range(repeat + 1):
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    x = normalize(torch.stack(crops), cfg)
    float(x[-1, -1, -1, -1])
    del x
    if i:  # the first chunk warms the heap up
        ms.append((time.perf_counter() - t0) * 1000)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"ms": statistics.median(ms), "faults": statistics.median(faults), "kept": kept}))
"""


def child(chunk: int, limit_mb: int, repeat: int) -> dict:
    """One setting in a fresh process (one torch thread): its median ms and page faults per chunk."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(chunk), str(limit_mb), str(repeat)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.batch_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 512], help="chunk sizes (images; default 64 512)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per chunk size, settings alternating (default 4)")
    ap.add_argument("--repeat", type=int, default=6, help="chunks timed per child (default 6)")
    ap.add_argument("--limit-mb", type=int, default=1024, help="the kept setting's limit (default 1024, the default)")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "batch-memory"), help="output folder")
    args = ap.parse_args(argv)
    out, hardware = begin(args.out)
    rows, results = [], []
    for chunk in args.chunks:
        for r in range(args.rounds):
            order = (0, args.limit_mb) if r % 2 == 0 else (args.limit_mb, 0)
            for limit in order:
                res = {"chunk": chunk, "round": r + 1, "limit_mb": limit, **child(chunk, limit, args.repeat),
                       "load_1m": round(os.getloadavg()[0], 2)}
                results.append(res)
                rows.append((chunk, r + 1, "kept" if limit else "glibc default", f"{res['ms']:.1f}",
                             f"{res['faults']:,.0f}", res["load_1m"]))
    print(markdown_table(("images per chunk", "round", "malloc thresholds", "ms per chunk (stack + normalise)",
                          "page faults per chunk", "load 1m"), rows))
    print()
    for chunk in args.chunks:
        base = statistics.median(x["ms"] for x in results if x["chunk"] == chunk and not x["limit_mb"])
        kept = statistics.median(x["ms"] for x in results if x["chunk"] == chunk and x["limit_mb"])
        print(f"{chunk} images per chunk: {base:.1f} -> {kept:.1f} ms per chunk (median of rounds), "
              f"{base / kept:.2f} x faster with the memory kept")
    write_json(out / "results.json", {"machine": hardware, "config": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
