"""The Batch API against a manifest job of the same inputs (issue 56), in one run on one stack.

    python -m benchmarks.batch_api                     # 10,000 lines (make bench-batch)
    python -m benchmarks.batch_api --lines 500         # a check in minutes

The whole service (``scripts.stack.Stack``: web, the interactive, bulk, vectors and fetch workers,
a private Redis, embedded Qdrant, ViT-B-32 with seeded random weights at the precision ``auto`` picks for the CPU, SQLite) and the tests'
origin server in its own process (``benchmarks.ingest.origin_server``). Inputs: ``--lines`` image
URLs ``/img/<n>.jpg`` (a distinct small JPEG each), every tenth line with a text beside its image.

1. warm-up: a batch and a manifest job of 64 other images each, run to their end (the bulk
   children have loaded the model);
2. **batch**: the JSONL uploaded with ``POST /v1/files``, ``POST /v1/batches``, polled once a second
   until it ends; the web's resident set sampled every 0.2 s (``benchmarks.load.Sampler``) from the
   upload to the end (the output files are written then): growth over the 2 s before;
3. **manifest job**: a CSV manifest of the same URLs with ``POST /api/jobs/``, polled until ``done``.

Order job, batch, job (JBJ) on distinct images: the first job takes ``--lines / 2`` images, the
batch ``--lines``, the second job the other ``--lines / 2``; the job's rate is both halves' images over
both halves' seconds, so a load that drifts linearly during the run weighs on both kinds alike. (Two
ABBA rounds would run ``4 × --lines`` images, more than a shared 2-core machine finishes in an hour at
10,000 lines; JBJ balances the same linear drift with half the images and the batch still at full size.)

Images per second = images / seconds from the request that made the work to its end (the batch's
``completed_at``, the job's ``finished_at``). Verdict: batch ≥ 0.9 × job, the web's growth under
``MEMORY_FLAT_MB``. Prints a table and writes the JSON (``--out``).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks._common import machine, machine_line
from benchmarks.ingest import memory_growth, origin_server

#: What "the web's memory flat while the output is written" allows (MB): the upload's own buffers.
MEMORY_FLAT_MB = 50.0
#: The images/s a batch must reach, as a share of the manifest job's.
RATIO_MIN = 0.9


def batch_lines(urls: list[str]) -> bytes:
    """The JSONL: one ``/v1/embeddings`` request per URL, every tenth with a text too."""
    out = io.StringIO()
    for i, url in enumerate(urls):
        inputs = [url, f"a photo number {i}"] if i % 10 == 0 else url
        out.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings",
                              "body": {"model": "ViT-B-32", "input": inputs}}) + "\n")
    return out.getvalue().encode()


def run_batch(http: httpx.Client, urls: list[str], *, timeout: float) -> dict:
    data = batch_lines(urls)
    t0 = time.time()
    f = http.post("/v1/files", files={"file": ("bench.jsonl", data, "application/jsonl")}, data={"purpose": "batch"})
    f.raise_for_status()
    b = http.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/embeddings",
                                       "completion_window": "24h"})
    b.raise_for_status()
    made = time.time()
    batch_id = b.json()["id"]
    while True:
        got = http.get(f"/v1/batches/{batch_id}").json()
        if got["status"] in ("completed", "failed", "expired", "cancelled") or time.time() - made > timeout:
            break
        time.sleep(1.0)
    end = got.get("completed_at") or time.time()
    return {"id": batch_id, "status": got["status"], "counts": got["request_counts"], "bytes": len(data),
            "upload_s": round(made - t0, 2), "started": t0, "made": made, "end": end,
            "seconds": round(end - made, 2), "images_per_s": round(len(urls) / max(1e-9, end - made), 2)}


def run_job(http: httpx.Client, urls: list[str], *, timeout: float) -> dict:
    manifest = "url\n" + "".join(u + "\n" for u in urls)
    made = time.time()
    r = http.post("/api/jobs/", files={"manifest": ("bench.csv", manifest.encode(), "text/csv")},
                  data={"name": "bench"})
    r.raise_for_status()
    job_id = r.json()["id"]
    while True:
        job = http.get(f"/api/jobs/{job_id}/").json()
        if job["status"] in ("done", "cancelled") or time.time() - made > timeout:
            break
        time.sleep(1.0)
    finished = job.get("finished_at")
    end = time.time() if not finished else _unix(finished)
    return {"id": job_id, "status": job["status"], "counts": job.get("counts"), "seconds": round(end - made, 2),
            "images_per_s": round(len(urls) / max(1e-9, end - made), 2)}


def _unix(iso: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.load import Sampler
    from scripts.stack import Stack

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--timeout", type=float, default=3600.0, help="longest wait for each phase (s)")
    p.add_argument("--out", type=Path, default=Path("docs/bench/batch-api.json"))
    args = p.parse_args(argv)
    env = {"CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0",
           "FETCH_ALLOW_NETWORKS": "127.0.0.1/32"}
    hardware = machine()
    print(machine_line(hardware) + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    result: dict = {"lines": args.lines, "machine": hardware}
    with tempfile.TemporaryDirectory() as tmp, origin_server() as origin, \
            Stack(Path(tmp) / "stack", env, private_redis=True, log=lambda *a: None) as stack:
        token = stack.manage("apiuser", "bench").strip()
        with httpx.Client(base_url=stack.web_url, headers={"Authorization": f"Bearer {token}"}, timeout=300) as http:
            warm = [f"{origin}/img/{n}.jpg" for n in range(1_000_000, 1_000_064)]
            result["warm_up"] = {"batch": run_batch(http, warm, timeout=args.timeout),
                                 "job": run_job(http, [u + "?job" for u in warm], timeout=args.timeout)}
            # job, batch, job on distinct images (JBJ): a load that drifts linearly during the run weighs
            # on both kinds alike; the job's rate is both halves' images over both halves' seconds
            n, half = args.lines, args.lines // 2
            job_urls = ([f"{origin}/img/{i}.jpg" for i in range(0, half)],
                        [f"{origin}/img/{i}.jpg" for i in range(half + n, 2 * n)])
            batch_urls = [f"{origin}/img/{i}.jpg" for i in range(half, half + n)]
            runs: dict[str, list[dict]] = {"batch": [], "job": []}
            runs["job"].append(run_job(http, job_urls[0], timeout=args.timeout))
            print(f"job 1: {runs['job'][0]}; load average {os.getloadavg()[0]:.2f}", flush=True)
            sampler = Sampler({"web": stack.pid("web")}, every=0.2)
            sampler.start()
            time.sleep(2.5)
            batch = run_batch(http, batch_urls, timeout=args.timeout)
            time.sleep(1.0)
            sampler.stop.set()
            sampler.join()
            batch["web_memory"] = memory_growth(sampler.samples, "web", batch["started"], time.time())
            runs["batch"].append(batch)
            print(f"batch: {batch}; load average {os.getloadavg()[0]:.2f}", flush=True)
            runs["job"].append(run_job(http, job_urls[1], timeout=args.timeout))
            result["runs"] = runs
            result["design"] = {"order": "job, batch, job", "job_images": [len(u) for u in job_urls],
                                "batch_images": len(batch_urls)}
            result["batch"] = {"images_per_s": batch["images_per_s"], "web_memory": batch["web_memory"]}
            job_images = sum(len(u) for u in job_urls)
            job_seconds = sum(r["seconds"] for r in runs["job"])
            result["job"] = {"images": job_images, "seconds": round(job_seconds, 2),
                             "images_per_s": round(job_images / max(1e-9, job_seconds), 2)}
    ratio = result["batch"]["images_per_s"] / max(1e-9, result["job"]["images_per_s"])
    result["ratio"] = round(ratio, 3)
    result["verdict"] = {"ratio_at_least_0.9": ratio >= RATIO_MIN,
                         "web_memory_flat": result["batch"]["web_memory"]["growth_mb"] <= MEMORY_FLAT_MB}
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| run | images | seconds | images/s |\n| --- | --- | --- | --- |")
    order = [("job 1", result["runs"]["job"][0], result["design"]["job_images"][0]),
             ("batch", result["runs"]["batch"][0], result["design"]["batch_images"]),
             ("job 2", result["runs"]["job"][1], result["design"]["job_images"][1])]
    for name, r, images in order:
        print(f"| {name} ({r['status']}) | {images} | {r['seconds']} | {r['images_per_s']} |")
    print(f"images/s: batch {result['batch']['images_per_s']}, job {result['job']['images_per_s']}; ratio "
          f"{result['ratio']} (≥ {RATIO_MIN}: {result['verdict']['ratio_at_least_0.9']}); web memory growth "
          f"{result['batch']['web_memory']['growth_mb']} MB (flat: {result['verdict']['web_memory_flat']}); "
          f"load average at the end {result['load_average_end']}", flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
