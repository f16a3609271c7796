"""What a zip costs the web request that receives it: wall time and the web process's memory.

A fresh process (its own SQLite database and blob folder under a temporary ``VAR_DIR``) sends
``POST /api/jobs/`` with one ``zip`` part through ``project.wsgi.application`` (the WSGI callable
gunicorn serves: multipart parsing, the upload spooled to a temporary file, the view, the job's
images stored), the body read from a file as gunicorn hands it over. The job's chunk messages are
recorded, not sent (no broker): the figure is the web request's own work, not the model's. A thread
samples the process's RSS every 5 ms (psutil); reported: seconds, RSS before and its peak.

The archives: ``--mb`` (default 100) MB of the real photos (``../shared/data/images/photos``), each
copy with distinct bytes (``_common.make_distinct``), deflated as ``zip`` does by default; the
hostile cases of ``../shared/data/cases/`` (``p08_*``) when present; and, for comparison, the same
photos sent as file parts (``files``) instead of a zip.

Then the parts of that request, timed one by one on the same archive: spooling the body
(``MultiPartParser``), checking the archive (``from_zip``: directory, local headers, bounds),
storing the archive as one blob (what the request would do if a worker read the entries), and
inflating, hashing and storing every entry with its row (``job_create``: what it does today).

Prints the machine, the table, and writes ``--out`` (JSON). docs/catalogues.md has the figures.
``python -m benchmarks.zip_request`` (run it from another checkout to measure that code).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from benchmarks._common import ROOT, machine, machine_line, make_distinct, markdown_table, photos, write_json

CASES = (ROOT / ".." / "shared" / "data" / "cases").resolve()
BOUNDARY = "benchZipB0undary"


def photo_zip(path: Path, mb: float) -> dict:
    """Write a deflated zip of distinct photos of about ``mb`` MB to ``path``; its facts."""
    base = photos()
    total, n = 0, 0
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        while total < mb * 1e6:  # as _common.distinct_photos names and tags them, one at a time
            name, data = base[n % len(base)]
            data = data if n < len(base) else make_distinct(data, str(n))
            z.writestr(f"photos/{n:06d}_{name}", data)
            total, n = total + len(data), n + 1
    return {"entries": n, "uncompressed_bytes": total, "archive_bytes": path.stat().st_size}


def multipart_file(archive: Path, out: Path) -> Path:
    """A multipart/form-data body holding ``archive`` as the ``zip`` part, written to ``out``."""
    with out.open("wb") as f, archive.open("rb") as a:
        f.write(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="zip"; filename="{archive.name}"\r\n'
                f"Content-Type: application/zip\r\n\r\n".encode())
        while block := a.read(1 << 20):
            f.write(block)
        f.write(f"\r\n--{BOUNDARY}--\r\n".encode())
    return out


def files_body(archive: Path, out: Path) -> Path:
    """The same images as ``archive``'s entries, each its own ``files`` part, written to ``out``."""
    with out.open("wb") as f, zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            f.write(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="files"; '
                    f'filename="{Path(info.filename).name}"\r\nContent-Type: image/jpeg\r\n\r\n'.encode())
            f.write(z.read(info))
            f.write(b"\r\n")
        f.write(f"--{BOUNDARY}--\r\n".encode())
    return out


def post(app, token: str, body: Path) -> dict:
    """``POST /api/jobs/`` with ``body`` through the WSGI callable; status, answer, seconds, RSS."""
    import gc

    from benchmarks.export import RssSampler

    gc.collect()
    sampler = RssSampler()
    before = sampler.peak
    sampler.start()
    started = []
    with body.open("rb") as f:
        environ = {
            "REQUEST_METHOD": "POST", "PATH_INFO": "/api/jobs/", "SCRIPT_NAME": "", "QUERY_STRING": "",
            "SERVER_NAME": "testserver", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1", "HTTP_HOST": "testserver",
            "CONTENT_TYPE": f"multipart/form-data; boundary={BOUNDARY}", "CONTENT_LENGTH": str(body.stat().st_size),
            "HTTP_AUTHORIZATION": f"Token {token}", "wsgi.input": f, "wsgi.version": (1, 0), "wsgi.url_scheme": "http",
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": True, "wsgi.run_once": False,
        }
        t0 = time.perf_counter()
        result = app(environ, lambda status, headers, exc_info=None: started.append(status))
        answer = b"".join(result)
        result.close()
        seconds = time.perf_counter() - t0
    peak = sampler.stop()
    data = json.loads(answer)
    return {"status": int(started[0].split()[0]), "code": data.get("code"), "total": data.get("total"),
            "seconds": round(seconds, 3), "rss_before_mb": round(before / 2**20, 1),
            "rss_peak_mb": round(peak / 2**20, 1), "rss_growth_mb": round((peak - before) / 2**20, 1)}


def parts(archive: Path, body: Path, user) -> dict:
    """The request's parts, timed one by one on the same archive (seconds)."""
    from django.conf import settings
    from django.core.files.uploadhandler import MemoryFileUploadHandler, TemporaryFileUploadHandler

    from embeddings import runtime
    from embeddings.api.parsers import MultiPartParser
    from embeddings.services.catalogue import jobs
    from embeddings.services.catalogue.sources import from_zip

    out = {}
    with body.open("rb") as f:
        meta = {"CONTENT_TYPE": f"multipart/form-data; boundary={BOUNDARY}", "CONTENT_LENGTH": str(body.stat().st_size)}
        t0 = time.perf_counter()
        _, files = MultiPartParser(meta, f, [MemoryFileUploadHandler(), TemporaryFileUploadHandler()]).parse()
        out["spool_s"] = round(time.perf_counter() - t0, 3)
    upload = files["zip"]
    limits = {"max_entries": settings.ZIP_MAX_ENTRIES, "max_uncompressed": settings.ZIP_MAX_UNCOMPRESSED_BYTES}
    if hasattr(settings, "ZIP_MAX_RATIO"):
        limits.update(max_ratio=settings.ZIP_MAX_RATIO, max_entry_bytes=settings.PIPELINE.max_image_bytes)
    t0 = time.perf_counter()
    sources = from_zip(upload, **limits)
    out["check_s"] = round(time.perf_counter() - t0, 3)
    upload.seek(0)
    t0 = time.perf_counter()
    key, _, _ = runtime.blob_store().put_file(upload)
    out["store_archive_s"] = round(time.perf_counter() - t0, 3)
    runtime.blob_store().delete(key)
    t0 = time.perf_counter()
    jobs.job_create(owner=user, sources=sources, name="parts")
    out["store_entries_s"] = round(time.perf_counter() - t0, 3)
    upload.close()
    return out


def child(mb: float) -> dict:
    """In a fresh process (env set by :func:`main`): the requests, then the parts."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token

    from embeddings import dispatch
    from project.wsgi import application

    call_command("migrate", verbosity=0)
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    sent = []
    dispatch.send_job_chunks = lambda *, job, image_ids: sent.append(len(image_ids)) or 1
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-zip-") as tmp:
        tmp = Path(tmp)
        archive = tmp / "photos.zip"
        photo_zip(tmp / "warm.zip", 1)  # the first request pays for imports and the first blob folders
        warm = get_user_model().objects.create_user("warm", password="pw")
        post(application, Token.objects.create(user=warm).key, multipart_file(tmp / "warm.zip", tmp / "warm.body"))
        facts = photo_zip(archive, mb)
        cases = [("photos", archive)] + [(p.stem, p) for p in sorted(CASES.glob("p08_*.zip"))]
        for i, (name, path) in enumerate(cases):
            user = get_user_model().objects.create_user(f"bench{i}", password="pw")
            token = Token.objects.create(user=user).key
            body = multipart_file(path, tmp / f"{name}.body")
            runs.append({"archive": name, "archive_bytes": path.stat().st_size, **post(application, token, body)})
        # the same photos as file parts, for another user (nothing deduplicated): what files cost
        user = get_user_model().objects.create_user("files", password="pw")
        body = files_body(archive, tmp / "files.body")
        runs.append({"archive": "photos as file parts", "archive_bytes": body.stat().st_size,
                     **post(application, Token.objects.create(user=user).key, body)})
        user = get_user_model().objects.create_user("parts", password="pw")
        split = parts(archive, tmp / "photos.body", user)
    return {"photos": facts, "runs": runs, "parts": split}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="MB of photos in the zip")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_zip_request.json")
    ap.add_argument("--child", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-zip-var-") as var:
        env = {**os.environ, "VAR_DIR": var, "DATABASE_URL": "", "CLIP_PRETRAINED": "random", "DJANGO_DEBUG": "0",
               "METRICS_DIR": "", "DJANGO_SETTINGS_MODULE": "project.settings"}
        out = subprocess.run([sys.executable, "-m", "benchmarks.zip_request", "--child", str(args.mb)], env=env,
                             cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the run failed:\n{out.stderr[-4000:]}")
    result = {"machine": machine(), **json.loads(out.stdout.strip().splitlines()[-1])}
    print(machine_line(result["machine"]))
    p = result["photos"]
    print(f"photos.zip: {p['entries']} entries, {p['uncompressed_bytes'] / 1e6:.1f} MB inflated, "
          f"{p['archive_bytes'] / 1e6:.1f} MB archive")
    print(markdown_table(["archive", "archive MB", "status", "code", "total", "s", "RSS before MiB", "RSS peak MiB",
                          "growth MiB"],
                         [(r["archive"], f"{r['archive_bytes'] / 1e6:.2f}", r["status"], r["code"] or "", r["total"],
                           r["seconds"], r["rss_before_mb"], r["rss_peak_mb"], r["rss_growth_mb"])
                          for r in result["runs"]]))
    print("parts of the photos request (s):", json.dumps(result["parts"]))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
