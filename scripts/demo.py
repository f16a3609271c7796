"""``make demo``: start the service, ingest a folder of photos as a bulk job, upload one photo on the
interactive lane, search by image, by text and by id, print the results and the stage timings, stop.

    python -m scripts.demo [FOLDER]      (default: samples/)
"""
from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import cv2
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.stack import Stack  # noqa: E402

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".avif", ".heic"}


def show(title: str, results: list[dict], n: int = 5) -> None:
    print(f"\n{title}")
    for r in results[:n]:
        print(f"  {r['score']:+.4f}  {r['original_name']}  ({r['image_id']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default=str(ROOT / "samples"))
    ap.add_argument("--var-dir", default=os.environ.get("VAR_DIR", str(ROOT / "var")))
    args = ap.parse_args()
    folder = Path(args.folder).resolve()
    photos = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not photos:
        print(f"no photos in {folder}", file=sys.stderr)
        return 2
    weights = os.environ.get("CLIP_PRETRAINED", "laion2b_s34b_b79k")
    print(f"model {os.environ.get('CLIP_MODEL', 'ViT-B-32')} with weights {weights!r}"
          + (" (seeded random weights, chosen explicitly: similarity scores are not semantic)" if weights == "random" else ""))
    with Stack(Path(args.var_dir)) as stack:
        print(f"stack up: web {stack.web_url}, Redis {stack.env['REDIS_URL']}, logs {stack.var_dir}/log")
        token = stack.manage("apiuser", "demo").strip()
        api = requests.Session()
        api.headers["Authorization"] = f"Token {token}"

        print(f"\n== bulk: ingest {folder} ==")
        subprocess.run([sys.executable, str(ROOT / "manage.py"), "ingest", str(folder), "--user", "demo"],
                       env=stack.env, cwd=ROOT, check=True)

        # A phone-style re-upload: the same picture re-encoded (new bytes, so it is embedded afresh);
        # its nearest neighbour should be the original.
        probe = photos[len(photos) // 2]
        ok, jpeg = cv2.imencode(".jpg", cv2.imread(str(probe)), [cv2.IMWRITE_JPEG_QUALITY, 85])
        print(f"\n== interactive: upload {probe.name} re-encoded as JPEG q85 ==")
        t0 = time.perf_counter()
        r = api.post(stack.web_url + "/api/images/", files={"files": ("reupload.jpg", jpeg.tobytes())}, data={"k": 5})
        ms = (time.perf_counter() - t0) * 1000
        r.raise_for_status()
        im = r.json()["images"][0]
        print(f"HTTP {r.status_code} in {ms:.0f} ms: {im['original_name']} → {im['status']} "
              f"{im['width']}x{im['height']} sha256 {im['sha256'][:12]}…")
        show("its top-5 neighbours already indexed:", im.get("neighbours") or [])

        query = photos[0]
        with query.open("rb") as f:
            r = api.post(stack.web_url + "/api/search/", files={"image": (query.name, f)}, data={"k": 5})
        r.raise_for_status()
        show(f"search by image {query.name}:", r.json()["results"])
        r = api.post(stack.web_url + "/api/search/", json={"text": "a photo of a cat", "k": 5})
        r.raise_for_status()
        show("search by text 'a photo of a cat':", r.json()["results"])
        r = api.post(stack.web_url + "/api/search/", json={"image_id": im["id"], "k": 3})
        r.raise_for_status()
        show(f"search by id {im['id']}:", r.json()["results"])
        password = stack.site_user("demo", secrets.token_urlsafe(9))
        print(f"\nthe site (search, upload, jobs) was at {stack.web_url}/ , API docs at {stack.web_url}/api/docs/")
        print("stopping the stack")
    print(f"\nSee it in a browser: `make run`, then open the address it prints and sign in as demo, password "
          f"{password} (this demo's images are there: same {args.var_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
