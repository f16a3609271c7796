"""A job's deadline: whether it is at risk at the rate it has run so far (``jobs.job_deadline_at_risk``,
what ``GET /api/jobs/{id}/`` shows as ``at_risk`` and what decides whether a background job's chunks
may give way to the interactive lane)."""
from __future__ import annotations

import datetime as dt
import io

import pytest
from django.db import transaction
from django.utils import timezone

from embeddings.models import Image, ImageStatus, Job, JobStatus
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue.sources import SourceFile
from tests.embeddings.services.catalogue.test_jobs_pause import jpeg_bytes

pytestmark = pytest.mark.django_db(transaction=True)


def paused_job(user, deadline: dt.datetime | None, seed0: int) -> Job:
    """A job of 5 queued images (distinct from other jobs' for distinct ``seed0``: a duplicate is
    skipped) whose chunks were parked (nothing computes), started 10 s ago."""
    files = [SourceFile(name=f"{i}.jpg", size=len(d), open=lambda d=d: io.BytesIO(d))
             for i, d in enumerate(jpeg_bytes(seed0 + i) for i in range(5))]
    with transaction.atomic():
        job = job_services.job_create(owner=user, sources=files, name="catalogue", deadline=deadline)
        job_services.job_transition(job=job, to=JobStatus.PAUSED)
    Job.objects.filter(id=job.id).update(started_at=timezone.now() - dt.timedelta(seconds=10))
    job.refresh_from_db()
    return job


def test_a_job_is_at_risk_when_its_rate_so_far_misses_its_deadline(service, user):
    """No deadline: never at risk. No row settled yet (no rate) in the 10 s since it started: at risk
    only when even one row per 10 s (5 rows: 50 s) misses the deadline. 4 of 5 done in 10 s
    (0.4 images/s, the last one due in 2.5 s): at risk only for a deadline sooner than that;
    the answer is read once per ``max_age_s`` and agrees with the job's progress."""
    assert job_services.job_deadline_at_risk(paused_job(user, None, 90)) is False

    job = paused_job(user, timezone.now() + dt.timedelta(hours=1), 100)
    assert job_services.job_counts(job)[ImageStatus.QUEUED] == 5
    assert job_services.job_deadline_at_risk(job, max_age_s=0) is False  # no rate yet, 50 s of an hour
    Job.objects.filter(id=job.id).update(deadline=timezone.now() + dt.timedelta(seconds=30))
    job.refresh_from_db()
    assert job_services.job_deadline_at_risk(job, max_age_s=0) is True  # under 1 row per 10 s: > 50 s
    Job.objects.filter(id=job.id).update(deadline=timezone.now() + dt.timedelta(hours=1))
    job.refresh_from_db()
    ids = list(Image.objects.filter(job=job).order_by("created_at").values_list("id", flat=True))
    Image.objects.filter(id__in=ids[:3]).update(status=ImageStatus.EMBEDDED)
    Image.objects.filter(id=ids[3]).update(status=ImageStatus.SKIPPED)  # settled: it counts in the rate
    assert job_services.job_deadline_at_risk(job) is True  # read less than 30 s ago: the same answer
    assert job_services.job_progress(job)["throughput_images_per_s"] == pytest.approx(0.4, abs=0.005)  # 4 in 10 s
    assert job_services.job_deadline_at_risk(job, max_age_s=0) is False
    assert job_services.job_progress(job)["at_risk"] is False

    Job.objects.filter(id=job.id).update(deadline=timezone.now() + dt.timedelta(seconds=1))
    job.refresh_from_db()
    assert job_services.job_deadline_at_risk(job, max_age_s=0) is True
    assert job_services.job_progress(job)["at_risk"] is True
    Image.objects.filter(id=ids[4]).update(status=ImageStatus.FAILED)  # nothing left: no risk
    assert job_services.job_deadline_at_risk(job, max_age_s=0) is False
