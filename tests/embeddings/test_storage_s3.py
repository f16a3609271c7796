"""Issue 11 item 1: image bytes in S3-compatible object storage through Django's storage API.

Every test talks HTTP to a real S3 endpoint that it starts itself: moto's standalone server
(``moto_server``, a separate process), reached by boto3 through django-storages' ``S3Storage``,
exactly as a worker on another host reaches its bucket. No client is mocked.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from embeddings import runtime
from embeddings.models import Image, ImageStatus
from embeddings.storage import (BlobStore, preview_delete, preview_exists, preview_put, preview_read, thumbnail_delete,
                                thumbnail_exists, thumbnail_put, thumbnail_read)
from scripts.stack import free_port
from workers.errors import ImageRejected

BUCKET = "clip-blobs"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_S3_REGION_NAME": "us-east-1"}


class MotoServer:
    """moto's S3 server as a child process on a free port of 127.0.0.1 (``moto_server -p PORT``)."""

    def __init__(self, log: Path) -> None:
        exe = Path(sys.executable).parent / "moto_server"
        if not exe.exists():
            exe = Path(shutil.which("moto_server") or "moto_server")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}; see {log}")
            try:
                requests.get(self.url + "/moto-api/", timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"moto_server did not answer within 30 s; see {log}")

    def client(self):
        """A plain boto3 client of this endpoint (for creating buckets and listing what is stored)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def env(self, bucket: str = BUCKET, prefix: str = "") -> dict[str, str]:
        """The environment that points a process's ``STORAGE_URL`` at ``bucket`` on this server."""
        return {"STORAGE_URL": f"s3://{bucket}/{prefix}".rstrip("/"), "S3_ENDPOINT_URL": self.url, **CREDENTIALS}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


def s3_config(moto: MotoServer, prefix: str) -> dict:
    """``STORAGES["blobs"]`` as project/settings.py builds it from ``moto.env(prefix=prefix)``."""
    return {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
        "bucket_name": BUCKET, "location": prefix, "endpoint_url": moto.url, "region_name": "us-east-1",
        "access_key": "testing", "secret_key": "testing", "file_overwrite": True, "default_acl": None,
        "querystring_auth": False}}


def keys(moto: MotoServer, prefix: str) -> list[str]:
    """Every object name under ``prefix`` in the bucket, sorted."""
    out = moto.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


@pytest.fixture
def s3_store(moto, request):
    from storages.backends.s3 import S3Storage

    prefix = f"t-{request.node.name[-40:]}"
    return BlobStore(S3Storage(**s3_config(moto, prefix)["OPTIONS"])), prefix


def test_put_read_delete_over_http(moto, s3_store):
    store, prefix = s3_store
    assert store.root is None
    key, sha, size = store.put([b"abc", b"def"])
    assert (sha, size) == (hashlib.sha256(b"abcdef").hexdigest(), 6)
    assert key == f"blob/{sha[:2]}/{sha[2:4]}/{sha}"
    assert store.put([b"abcdef"])[0] == key  # the same bytes: the same key, stored once
    assert keys(moto, prefix) == [f"{prefix}/{sha[:2]}/{sha[2:4]}/{sha}"]
    assert store.exists(key) and store.read(key, sha) == b"abcdef"
    with pytest.raises(ImageRejected) as e:
        store.read(key, "0" * 64)
    assert e.value.reason.value == "source_changed"
    store.delete(key)
    assert keys(moto, prefix) == [] and not store.exists(key)
    with pytest.raises(ImageRejected) as e:
        store.read(key, sha)
    assert e.value.reason.value == "source_missing"
    with pytest.raises(ImageRejected) as e:
        store.read("blob/../../etc/passwd", "0" * 64)
    assert e.value.reason.value == "source_missing"


def test_bytes_changed_in_the_bucket_are_refused(moto, s3_store):
    store, prefix = s3_store
    key, sha, _ = store.put([b"original bytes"])
    moto.client().put_object(Bucket=BUCKET, Key=f"{prefix}/{key.removeprefix('blob/')}", Body=b"tampered")
    with pytest.raises(ImageRejected) as e:
        store.read(key, sha)
    assert e.value.reason.value == "source_changed"


def test_temporary_keys_thumbnails_and_previews(moto, s3_store):
    store, prefix = s3_store
    key, sha, size = store.put_temporary([b"query ", b"image"])
    assert key.startswith("tmp/") and size == 11 and store.read(key, sha) == b"query image"
    assert keys(moto, prefix) == [f"{prefix}/{key}"]
    store.delete(key)
    assert keys(moto, prefix) == []
    s = hashlib.sha256(b"x").hexdigest()
    assert not thumbnail_exists(store, s) and thumbnail_read(store, s) is None
    assert thumbnail_put(store, s, b"jpeg bytes") is True
    assert thumbnail_put(store, s, b"other") is False  # drawn once, never redrawn
    assert thumbnail_read(store, s) == b"jpeg bytes"
    assert keys(moto, prefix) == [f"{prefix}/thumb/{s[:2]}/{s}.jpg"]
    thumbnail_delete(store, s)
    assert keys(moto, prefix) == []
    with pytest.raises(FileNotFoundError):
        preview_read(store, s)
    assert not preview_exists(store, s) and preview_put(store, s, b"preview bytes") is True
    assert preview_put(store, s, b"other") is False and preview_read(store, s) == b"preview bytes"
    assert keys(moto, prefix) == [f"{prefix}/preview/{s[:2]}/{s}"]
    preview_delete(store, s)
    assert keys(moto, prefix) == []


def test_a_store_on_another_host_reads_what_this_one_wrote(moto, s3_store, tmp_path):
    """Two stores with nothing in common but the bucket (as two hosts): bytes written by one are
    read, verified, by the other; a filesystem store elsewhere would not have them."""
    from storages.backends.s3 import S3Storage

    store, prefix = s3_store
    key, sha, _ = store.put([b"shared bytes"])
    other = BlobStore(S3Storage(**s3_config(moto, prefix)["OPTIONS"]))
    assert other.read(key, sha) == b"shared bytes"
    with pytest.raises(ImageRejected) as e:
        BlobStore(tmp_path / "host-b").read(key, sha)
    assert e.value.reason.value == "source_missing"


@pytest.mark.django_db(transaction=True)
def test_uploads_and_jobs_store_in_the_bucket_and_embed_from_it(moto, service, api, settings):
    """The API with ``STORAGES["blobs"]`` on S3 (eager Celery: the worker code reads the bucket):
    uploads and a job are embedded, identical bytes stored once, and deleting the last image that
    names the bytes deletes the object, its thumbnail and its preview; nothing lands under ``BLOB_ROOT``."""
    from tests.embeddings.conftest import jpeg_bytes, upload

    prefix = "api"
    settings.STORAGES = {**settings.STORAGES, "blobs": s3_config(moto, prefix)}
    settings.INTERACTIVE_DEADLINE_S = 60  # busy shared cores: what is tested here is where bytes go
    runtime.blob_store.cache_clear()
    r = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1)), upload("b.jpg", jpeg_bytes(2))]},
                 format="multipart")
    assert r.status_code == 200, r.json()
    assert [im["status"] for im in r.json()["images"]] == ["embedded", "embedded"]
    r = api.post("/api/jobs/", {"files": [upload("c.jpg", jpeg_bytes(3)), upload("a-again.jpg", jpeg_bytes(1))]},
                 format="multipart")
    assert r.status_code == 202, r.json()
    job = api.get(f"/api/jobs/{r.json()['id']}/").json()
    assert (job["status"], job["embedded"], job["skipped"]) == ("done", 1, 1)
    shas = sorted({im.sha256 for im in Image.objects.all()})
    assert len(shas) == 3 and Image.objects.filter(status=ImageStatus.EMBEDDED).count() == 3
    blobs = [f"{prefix}/{s[:2]}/{s[2:4]}/{s}" for s in shas]
    thumbs = [f"{prefix}/thumb/{s[:2]}/{s}.jpg" for s in shas]
    previews = [f"{prefix}/preview/{s[:2]}/{s}" for s in shas]
    assert keys(moto, prefix) == sorted(blobs + thumbs + previews)
    assert not Path(settings.BLOB_ROOT).exists() or not any(Path(settings.BLOB_ROOT).rglob("*"))
    c = Image.objects.get(original_name="c.jpg")
    assert api.delete(f"/api/images/{c.id}/").status_code == 204
    gone = {f"{prefix}/{c.sha256[:2]}/{c.sha256[2:4]}/{c.sha256}", f"{prefix}/thumb/{c.sha256[:2]}/{c.sha256}.jpg",
            f"{prefix}/preview/{c.sha256[:2]}/{c.sha256}"}
    assert keys(moto, prefix) == sorted(set(blobs + thumbs + previews) - gone)


def test_settings_build_the_s3_storage_from_storage_url(moto, tmp_path):
    """project/settings.py turns ``STORAGE_URL`` and friends into ``STORAGES["blobs"]`` (a fresh
    interpreter, as a worker host starts); a bad scheme is a configuration error naming the forms."""
    code = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'project.settings'); django.setup(); "
            "from django.conf import settings; from embeddings import runtime; s = runtime.blob_store(); "
            "k, sha, _ = s.put([b'from settings']); print(type(s.storage).__name__, s.storage.location, "
            "s.read(k, sha).decode())")
    root = Path(__file__).resolve().parents[2]
    env = {**moto.env(prefix="fromenv/sub"), "PATH": "/usr/bin:/bin", "DJANGO_SECRET_KEY": "x" * 50,
           "VAR_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["S3Storage", "fromenv/sub", "from", "settings"]
    assert len(keys(moto, "fromenv/sub/")) == 1
    out = subprocess.run([sys.executable, "-c", code], env={**env, "STORAGE_URL": "ftp://x"}, cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "STORAGE_URL must be empty, file:///folder or s3://bucket[/prefix]" in out.stderr
