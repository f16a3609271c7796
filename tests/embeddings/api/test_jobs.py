"""``/api/jobs/`` end to end in one process (eager Celery, embedded Qdrant, random-weights model): a
bulk job from files and a zip with its progress and timings, unsafe zips, cancel."""
from __future__ import annotations

import io
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from embeddings.models import Job, JobStatus
from tests.embeddings.conftest import jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


def test_bulk_job_from_files_and_zip_with_progress_and_timings(service, api):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i in range(3):
            z.writestr(f"folder/{i}.jpg", jpeg_bytes(100 + i))
        z.writestr("notes.txt", "hello")
    buf.seek(0)
    r = api.post("/api/jobs/", {"files": [upload("f1.jpg", jpeg_bytes(200)), upload("dup.jpg", jpeg_bytes(200))],
                                "zip": [SimpleUploadedFile("a.zip", buf.read(), content_type="application/zip")],
                                "name": "catalogue"}, format="multipart")
    assert r.status_code == 202, r.json()
    job_id = r.json()["id"]
    assert r.json()["total"] == 6
    p = api.get(f"/api/jobs/{job_id}/").json()
    assert p["status"] == "done"
    assert (p["embedded"], p["skipped"], p["failed"]) == (4, 1, 1)
    assert [f["reason"] for f in p["failures"]] == ["not_an_image"]
    assert set(p["timings_ms"]) == {"load", "decode", "decode_wait", "preprocess", "embed", "upsert", "total"}
    for v in p["timings_ms"].values():
        assert v["min"] <= v["avg"] <= v["max"]
    assert p["throughput_images_per_s"] > 0 and p["started_at"] and p["finished_at"]


def test_zip_slip_is_refused(service, api):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../../etc/evil.jpg", jpeg_bytes(1))
    r = api.post("/api/jobs/", {"zip": [SimpleUploadedFile("e.zip", buf.getvalue())]}, format="multipart")
    assert r.status_code == 400 and r.json()["code"] == "zip_unsafe_path"
    assert Job.objects.count() == 0


def test_cancel_marks_queued_images_and_is_final(service, api, user):
    job = Job.objects.create(owner=user, model_id="m", total=1)
    r = api.post(f"/api/jobs/{job.id}/cancel/")
    assert r.status_code == 200 and r.json()["status"] == JobStatus.CANCELLED
    again = api.post(f"/api/jobs/{job.id}/resume/")
    assert again.status_code == 409 and again.json()["code"] == "invalid_transition"
