"""Prometheus metrics from workers and web, utilisation stored with jobs, per-lane summaries."""
from __future__ import annotations

import re

import pytest

from tests.embeddings.conftest import client_for, jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)


def sample(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def test_metrics_endpoint_counts_a_bulk_job(service, api, client):
    before = client.get("/metrics").content.decode()
    r = api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(300 + i)) for i in range(3)]
                                + [upload("cut.jpg", jpeg_bytes(399)[:-300])]}, format="multipart")
    assert r.status_code == 202
    resp = client.get("/metrics")  # unauthenticated, like most exporters
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/plain")
    after = resp.content.decode()

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    for stage in ("load", "decode", "decode_wait", "preprocess", "embed", "upsert", "total"):
        assert delta("clip_stage_seconds_count", lane="bulk", stage=stage) >= 1, stage
    assert delta("clip_batch_images_count", lane="bulk") >= 1
    assert delta("clip_images_processed_total", lane="bulk", status="embedded") >= 3
    assert delta("clip_images_processed_total", lane="bulk", status="failed") >= 1
    assert sample(after, "clip_images", status="embedded") == 3  # read from the database at scrape time


def test_job_api_shows_utilisation_pipeline_and_p95(service, api, staff):
    from embeddings.metrics import worker_sampler

    worker_sampler().sample_now()  # a reading inside the chunk's window, whatever the 1 s timer does
    r = api.post("/api/jobs/", {"files": [upload(f"{i}.jpg", jpeg_bytes(400 + i)) for i in range(2)]},
                 format="multipart")
    p = api.get(f"/api/jobs/{r.json()['id']}/").json()
    assert p["status"] == "done"
    u = p["utilisation"]
    assert u["interval_s"] == 1.0 and u["summary"]["samples"] == len(u["rows"]) >= 1
    assert 0 <= u["summary"]["cpu_percent"]["avg"] <= 100
    for row in u["rows"]:
        assert len(row) == 4 and 0 <= row[1] <= 100
    assert p["pipeline"]["precision"] == "fp32" and p["pipeline"]["torch_threads"] >= 1
    assert p["pipeline"]["model_id"].endswith("/fp32")
    assert all("p95" in v for v in p["timings_ms"].values())

    stats = client_for(staff).get("/api/stats/").json()
    bulk = stats["lanes"]["bulk"]
    assert bulk["batches"] >= 1 and bulk["timings_ms"]["embed"]["p95"] > 0


def test_utilisation_rows_from_two_processes_keep_one_per_second(service, user):
    from embeddings.metrics import job_record_utilisation
    from embeddings.models import Job
    from workers.utilisation import Sample

    job = Job.objects.create(owner=user, model_id="m")

    class FakeSampler:
        interval_s = 1.0

        def __init__(self, samples):
            self.samples = samples

        def take_new(self, key, since):
            return [s for s in self.samples if s.t > since]

    import embeddings.metrics as m

    for samples in ([Sample(100.2, 10.0), Sample(101.2, 20.0)], [Sample(101.7, 99.0), Sample(102.1, 30.0)]):
        m.worker_sampler.cache_clear()
        original = m.worker_sampler
        m.worker_sampler = lambda s=samples: FakeSampler(s)
        try:
            job_record_utilisation(job_id=job.id, since=0, config=service.PIPELINE)
        finally:
            m.worker_sampler = original
    job.refresh_from_db()
    assert [r[:2] for r in job.utilisation["rows"]] == [[100.2, 10.0], [101.2, 20.0], [102.1, 30.0]]
    assert job.pipeline["precision"] == "fp32"


def test_a_worker_host_serves_its_own_metrics_endpoint(settings):
    """Issue 11: a worker started with METRICS_PORT serves its host's process metrics (the pool
    children's files in multiprocess mode) over HTTP; a second process of the host finds the port
    taken and leaves it to the first. No database or Redis read happens there."""
    import socket
    import urllib.request

    from embeddings import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings.METRICS_PORT = 0
    assert metrics.serve_worker_metrics() is None  # not asked for
    settings.METRICS_PORT, settings.METRICS_BIND = port, "127.0.0.1"
    served = metrics.serve_worker_metrics()  # what the worker_ready signal runs
    try:
        assert served is not None
        assert metrics.worker_endpoint(port, addr="127.0.0.1") is None  # taken: the first one serves
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        before = sample(text, "clip_images_processed_total", lane="bulk", status="embedded")
        metrics.count_images(lane="bulk", status="embedded", n=7)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert sample(text, "clip_images_processed_total", lane="bulk", status="embedded") == before + 7
        assert "clip_images{" not in text and "clip_queue_messages" not in text  # cluster-wide: the web's
    finally:
        server, thread = served
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_bulk_backlog_counts_images_of_live_jobs_per_priority(client, django_user_model):
    """``clip_bulk_backlog_images{priority}``: what the bulk autoscaler sizes the lane on
    (deploy/kubernetes/components/keda): queued images of queued or running jobs only."""
    from embeddings.models import Image, ImageStatus, Job, JobPriority, JobStatus

    owner = django_user_model.objects.create(username="backlog")
    n = 0

    def job(status, priority, images, image_status=ImageStatus.QUEUED):
        nonlocal n
        j = Job.objects.create(owner=owner, status=status, priority=priority, model_id="m")
        for _ in range(images):
            n += 1
            Image.objects.create(owner=owner, job=j, lane="bulk", status=image_status, sha256=f"{n:064x}",
                                 size_bytes=1, storage_key=f"k{n}", model_id="m")

    job(JobStatus.RUNNING, JobPriority.URGENT, 3)
    job(JobStatus.QUEUED, JobPriority.BACKGROUND, 2)
    job(JobStatus.RUNNING, JobPriority.BACKGROUND, 4, ImageStatus.EMBEDDED)  # done work
    job(JobStatus.PAUSED, JobPriority.BACKGROUND, 5)  # a paused job keeps no worker up
    job(JobStatus.CANCELLED, JobPriority.URGENT, 1)
    text = client.get("/metrics").content.decode()
    assert sample(text, "clip_bulk_backlog_images", priority="urgent") == 3
    assert sample(text, "clip_bulk_backlog_images", priority="background") == 2
    assert 'clip_bulk_backlog_images{priority="background"} 2.0' in text
