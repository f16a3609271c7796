"""Per-key limits in Redis (``embeddings.services.access.limits``): exact counts, refusals that add
nothing, the day's bulk images, concurrent bulk jobs against the database, and threads racing."""
from __future__ import annotations

import concurrent.futures

import pytest

from embeddings.errors import ApplicationError
from embeddings.models import Job, JobStatus
from embeddings.services.access import limits
from embeddings.services.access.keys import key_create

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def rdb(private_redis, settings):
    settings.REDIS_URL = private_redis[0]
    return private_redis[1]


def make_key(user, **limit_values):
    return key_create(owner=user, name="k", scopes=["all"], limits=limit_values, by_staff=True).key


def test_images_per_minute_count_exactly_and_a_refusal_adds_nothing(user, rdb):
    key = make_key(user, images_per_minute=10)
    assert limits.images_admit(key=key, images=4)["x-ratelimit-remaining-images"] == "6"
    assert limits.images_admit(key=key, images=6)["x-ratelimit-remaining-images"] == "0"
    with pytest.raises(ApplicationError) as e:
        limits.images_admit(key=key, images=1)
    assert (e.value.status, e.value.code, e.value.extra["limit"]) == (429, "rate_limited", "images_per_minute")
    assert 1 <= int(e.value.headers["Retry-After"]) <= 60
    assert int(rdb.get(limits._counter("images", key))) == 10
    with pytest.raises(ApplicationError) as e:
        limits.images_admit(key=key, images=11)  # never fits: a retry cannot help
    assert (e.value.status, e.value.code) == (413, "exceeds_key_limit")
    assert limits.images_admit(key=key, images=0) == {}


def test_the_defaults_come_from_settings(user, rdb, settings):
    settings.API_KEY_REQUESTS_PER_MINUTE = 2
    key = make_key(user)
    assert limits.request_admit(key=key)["x-ratelimit-limit-requests"] == "2"
    limits.request_admit(key=key)
    with pytest.raises(ApplicationError):
        limits.request_admit(key=key)


def test_threads_racing_never_admit_more_than_the_limit(user, rdb):
    key = make_key(user, requests_per_minute=25)

    def one(_):
        try:
            limits.request_admit(key=key)
            return True
        except ApplicationError:
            return False

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        admitted = list(pool.map(one, range(100)))
    assert admitted.count(True) == 25 and admitted.count(False) == 75


def test_bulk_images_per_day(user, rdb):
    key = make_key(user, bulk_images_per_day=5)
    assert limits.bulk_images_admit(key=key, images=3)["x-ratelimit-remaining-bulk-images"] == "2"
    assert limits.bulk_images_admit(key=key, images=0)["x-ratelimit-remaining-bulk-images"] == "2"  # unknown: 0
    with pytest.raises(ApplicationError) as e:
        limits.bulk_images_admit(key=key, images=3)
    assert (e.value.status, e.value.code) == (429, "rate_limited")
    assert 1 <= int(e.value.headers["Retry-After"]) <= 86_400
    limits.bulk_images_admit(key=key, images=2)
    with pytest.raises(ApplicationError):
        limits.bulk_images_admit(key=key, images=0)  # the day is used up: a manifest job too
    with pytest.raises(ApplicationError) as e:
        limits.bulk_images_admit(key=key, images=6)
    assert e.value.code == "exceeds_key_limit"


def test_concurrent_bulk_jobs_are_read_from_the_database(user, rdb):
    key = make_key(user, concurrent_bulk_jobs=2)
    jobs = []
    for _ in range(2):
        slot = limits.job_slot_reserve(key=key)
        job = Job.objects.create(owner=user, status=JobStatus.QUEUED)
        slot.fill(job.id)
        jobs.append(job)
    with pytest.raises(ApplicationError) as e:
        limits.job_slot_reserve(key=key)
    assert (e.value.status, e.value.code, e.value.headers["Retry-After"]) == (429, "rate_limited", "30")
    assert sorted(e.value.extra["running_jobs"]) == sorted(str(j.id) for j in jobs)
    Job.objects.filter(id=jobs[0].id).update(status=JobStatus.DONE)
    slot = limits.job_slot_reserve(key=key)  # a job ended: a slot is free
    with pytest.raises(ApplicationError):
        limits.job_slot_reserve(key=key)  # a reservation holds its slot until filled or released
    slot.release()
    limits.job_slot_reserve(key=key).release()
    assert rdb.zcard(limits._counter("jobs", key)) == 1  # the finished job was dropped, the live one kept


def test_without_redis_a_request_is_admitted_and_says_so(user, settings, caplog):
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nobody listens
    key = make_key(user, requests_per_minute=1)
    assert limits.request_admit(key=key) == {} and limits.request_admit(key=key) == {}
    assert "per-key limit not checked" in caplog.text
