"""Issue 11 item 6: big jobs start at once. Job creation streams: each chunk is sent as soon as its
images are stored, so the workers embed a big upload's first images while the rest is still being
stored.

- ``test_chunks_leave_while_the_upload_is_stored``: in-process (eager Celery), small chunks: the
  first chunk is embedded before the last source is stored, and the job is ``done`` only once
  every source is stored and embedded (never in between, when the chunks sent so far are done).
- ``test_first_image_of_a_5000_image_zip_is_embedded_within_10_s``: the real stack (gunicorn, Redis,
  Celery workers, random ViT-B-32 weights), a zip of 5,000 tiny distinct PNGs made by the test;
  the first image's ``embedded_at`` is within 10 s of the moment the upload starts. The workers are
  warmed first (one image embedded: the model is loaded), since what is measured is the job's
  start, not a worker's; chunks are of 16 images there (``CHUNK``: a 64-image chunk alone takes
  6-21 s of CPU model time on the 2-core test machine; with 64 the first image came 16.5 and 21.5 s
  after the upload started, once all 5,000 rows were stored, 14 s in). Measured with 16 (AMD EPYC,
  2 cores, shared): first image 6.05 s after the upload started, all 5,000 rows stored at 15.7 s.
"""
from __future__ import annotations

import io
import json
import time
import zipfile

import cv2
import numpy as np
import pytest
import requests

from scripts.stack import Stack
from tests.embeddings.conftest import service, user  # noqa: F401 - the app's in-process fixtures

#: The figure issue 11 asks for: the first image of a 5,000-image zip embedded within 10 s.
FIRST_EMBEDDED_WITHIN_S = 10.0
#: Images per chunk in the real-process test (see the ``stack`` fixture).
CHUNK = 16


def tiny_png(i: int) -> bytes:
    """An 8×8 PNG whose pixels spell ``i`` (so every image of the zip is distinct)."""
    px = np.zeros((8, 8, 3), np.uint8)
    px.reshape(-1)[:4] = np.frombuffer(int(i).to_bytes(4, "little"), np.uint8)
    px[4:] = (i * 37) % 251
    return cv2.imencode(".png", px)[1].tobytes()


def png_zip(n: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for i in range(n):
            z.writestr(f"img/{i:05d}.png", tiny_png(i))
    return buf.getvalue()


@pytest.mark.django_db(transaction=True)
def test_chunks_leave_while_the_upload_is_stored(service, user, settings):
    from embeddings.models import Image, ImageStatus, Job, JobStatus
    from embeddings import dispatch
    from embeddings.services.catalogue import jobs as job_services
    from embeddings.services.catalogue.sources import SourceFile

    settings.PIPELINE = settings.PIPELINE.replace(batch_size=4)
    statuses: list[tuple[int, str]] = []  # (rows stored so far, job status) whenever a chunk is sent
    send = dispatch.send_job_chunks

    def dispatch_and_look(*, job, image_ids):
        statuses.append((Image.objects.filter(job=job).count(), Job.objects.get(id=job.id).status))
        n = send(job=job, image_ids=image_ids)  # eager: the chunk runs now, before the next slice is stored
        statuses.append((Image.objects.filter(job=job).count(), Job.objects.get(id=job.id).status))
        return n

    dispatch.send_job_chunks = dispatch_and_look
    try:
        data = [tiny_png(i) for i in range(13)] + [tiny_png(0)]  # 13 distinct, one duplicate
        job = job_services.job_create(owner=user, sources=[
            SourceFile(name=f"{i}.png", size=len(d), open=lambda d=d: io.BytesIO(d)) for i, d in enumerate(data)])
    finally:
        dispatch.send_job_chunks = send
    # slices of 5, 4, 4, 1 sources: chunks of 4 leave after 5, 9 and 13 rows; the last queued image at the end
    assert [rows for rows, _ in statuses[::2]] == [5, 9, 13, 14]
    # between chunks the job runs; it is done only after the last one, once every source is stored
    assert [s for _, s in statuses] == ["queued", "running", "running", "running", "running", "running", "running",
                                        "done"]
    job.refresh_from_db()
    assert (job.status, job.total) == (JobStatus.DONE, 14)
    rows = Image.objects.filter(job=job)
    assert rows.filter(status=ImageStatus.EMBEDDED).count() == 13 and rows.filter(status=ImageStatus.SKIPPED).count() == 1
    first_embedded = min(rows.exclude(embedded_at=None).values_list("embedded_at", flat=True))
    last_stored = max(rows.values_list("created_at", flat=True))
    assert first_embedded < last_stored


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    # One bulk process: the one the warm-up loads the model into is the one that takes the job.
    # Chunks of 16: on this 2-core CPU one 64-image chunk alone takes 6-21 s of model time (what a GPU
    # does in ~30 ms), which is not what is measured here: how soon the first chunk leaves is.
    env = {"CLIP_PRETRAINED": "random", "DATABASE_URL": database_url, "DJANGO_DEBUG": "0",
           "INTERACTIVE_DEADLINE_S": "30", "BULK_PROCESSES": "1", "BULK_BATCH_SIZE": str(CHUNK)}
    with Stack(tmp_path_factory.mktemp("stream"), env, private_redis=True, log=lambda *a: None) as s:
        yield s


def _first_embedded(stack: Stack, job_id: str) -> dict:
    code = ("import json; from django.db.models import Min, Max; from embeddings.models import Image; "
            f"q = Image.objects.filter(job_id='{job_id}'); "
            "a = q.aggregate(first=Min('embedded_at'), stored=Max('created_at')); "
            "print(json.dumps({k: v and v.timestamp() for k, v in a.items()} | {'rows': q.count()}))")
    return json.loads(stack.manage("shell", "-c", code).strip().splitlines()[-1])


def test_first_image_of_a_5000_image_zip_is_embedded_within_10_s(stack, api):
    warm = api.post("/api/jobs/", files=[("files", ("warm.png", tiny_png(99_999), "image/png"))])
    assert warm.status_code == 202, warm.text
    for _ in range(240):
        if api.get(warm.json()["url"]).json()["status"] == "done":
            break
        time.sleep(0.5)
    else:
        pytest.fail("the warm-up image was not embedded in 120 s")
    body = png_zip(5000)
    t0 = time.time()  # the upload starts
    r = requests.post(api.base + "/api/jobs/", headers=api.s.headers, timeout=300,
                      files=[("zip", ("catalogue.zip", body, "application/zip"))])
    answered = time.time() - t0
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.json()["total"] == 5000
    facts = {}
    for _ in range(120):
        facts = _first_embedded(stack, job_id)
        if facts["first"]:
            break
        time.sleep(0.25)
    api.post(f"/api/jobs/{job_id}/cancel/")  # the other 4,900-odd images are not what is measured
    first_s = facts["first"] - t0
    stored_s = facts["stored"] - t0
    print(f"\n5,000-image zip ({len(body)} bytes): first image embedded {first_s:.2f} s after the upload "
          f"started; all {facts['rows']} rows stored after {stored_s:.2f} s; response after {answered:.2f} s")
    assert facts["rows"] == 5000
    assert first_s < FIRST_EMBEDDED_WITHIN_S, f"first image embedded {first_s:.2f} s after the upload started"
