"""``embeddings/services/usage/meter.py``: counter rows incremented in place, and images counted by
the statement that marks them embedded, so a chunk delivered twice counts each image once
(``tests/embeddings/services/queues/conftest.py`` says how the bulk messages are caught)."""
from __future__ import annotations

import datetime as dt
import re

import pytest

from embeddings.models import BatchStat, Image, ImageStatus, UsageKind, UsageRecord
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.queues import bulk, vectors
from embeddings.services.usage import meter
from tests.embeddings.services.queues.conftest import photos
from tests.origin_server import pixels_jpeg
from tests.embeddings.test_metrics import sample

pytestmark = pytest.mark.django_db(transaction=True)


def rows() -> dict[tuple, tuple]:
    """``{(owner, key, model, kind): (units, bytes, compute_s)}`` of today's counter rows."""
    return {(r.owner_id, r.key_prefix, r.model_id, r.kind): (r.units, r.bytes, r.compute_s)
            for r in UsageRecord.objects.all()}


def test_increments_of_one_row_add_up_in_place_and_other_rows_stay_apart(user, other_user):
    meter.usage_add([meter.Usage(owner_id=user.id, kind=UsageKind.TEXT, units=2, key_prefix="ck_a", model_id="m",
                                 compute_s=0.5),
                     meter.Usage(owner_id=user.id, kind=UsageKind.TEXT, units=1, key_prefix="ck_a", model_id="m",
                                 compute_s=0.25)])
    meter.usage_add([meter.Usage(owner_id=user.id, kind=UsageKind.TEXT, units=4, key_prefix="ck_a", model_id="m"),
                     meter.Usage(owner_id=user.id, kind=UsageKind.FETCH, units=1, key_prefix="ck_a", model_id="m",
                                 bytes=1000),
                     meter.Usage(owner_id=other_user.id, kind=UsageKind.TEXT, units=1, model_id="m"),
                     meter.Usage(owner_id=user.id, kind=UsageKind.SEARCH, units=0)])  # nothing: no row
    assert rows() == {(user.id, "ck_a", "m", "text"): (7, 0, 0.75), (user.id, "ck_a", "m", "fetch"): (1, 1000, 0.0),
                      (other_user.id, "", "m", "text"): (1, 0, 0.0)}
    assert UsageRecord.objects.get(kind="text", owner=user).day == dt.datetime.now(dt.timezone.utc).date()


def test_prometheus_counts_committed_usage_by_kind_lane_and_model_only(user, client):
    before = client.get("/metrics").content.decode()
    meter.answered(owner_id=user.id, key_prefix="ck_notalabel", model_id="m-prom", searches=3, texts=2, compute_s=0.5)
    after = client.get("/metrics").content.decode()
    for kind, n in (("search", 3), ("text", 2)):
        labels = {"kind": kind, "lane": "interactive", "model": "m-prom"}
        assert sample(after, "clip_usage_units_total", **labels) - sample(before, "clip_usage_units_total", **labels) == n
    assert sample(after, "clip_usage_compute_seconds_total", kind="text", model="m-prom") \
        - sample(before, "clip_usage_compute_seconds_total", kind="text", model="m-prom") == pytest.approx(0.5)
    usage_lines = [line for line in after.splitlines() if line.startswith("clip_usage")]
    assert usage_lines and all(set(re.findall(r'(\w+)="', line)) <= {"kind", "lane", "model"} for line in usage_lines)
    assert "ck_notalabel" not in after


def test_a_chunk_delivered_twice_counts_each_image_once_with_one_deliverys_compute(service, user, sent_args):
    """A redelivered chunk (its worker outlived the visibility timeout, or died after its points were
    handed over): both deliveries embed and both writes run; each image is counted by the write that
    marked it, once, and a third delivery after the writes counts nothing."""
    job = job_services.job_create(owner=user, sources=photos(4, 300), key_prefix="ck_bulk0001")
    (job_id, chunk), = sent_args["embeddings.tasks.embed_chunk"]
    bulk.chunk_embed(job_id=job_id, image_ids=chunk)
    bulk.chunk_embed(job_id=job_id, image_ids=chunk)  # redelivered while the first is unwritten
    first, second = sent_args["embeddings.tasks.index_chunk"]
    computed_ms = BatchStat.objects.get(id=first[1]).total_ms  # the first delivery's, before its write ends it
    vectors.chunk_index(job_id=first[0], stat_id=first[1], items=first[2], priority="background")
    after_first = rows()
    vectors.chunk_index(job_id=second[0], stat_id=second[1], items=second[2], priority="background")
    assert rows() == after_first  # the second write marked nothing
    bulk.chunk_embed(job_id=job_id, image_ids=chunk)  # a third delivery finds nothing queued
    assert len(sent_args["embeddings.tasks.index_chunk"]) == 2
    (owner, key, model, kind), (units, nbytes, compute_s) = next(iter(rows().items()))
    assert len(rows()) == 1
    assert (owner, key, model, kind, units, nbytes) == (user.id, "ck_bulk0001", job.model_id, "image_bulk", 4, 0)
    assert compute_s == pytest.approx(computed_ms / 1000)  # the delivery whose write marked the images
    assert Image.objects.filter(job=job, status=ImageStatus.EMBEDDED).count() == 4


def test_duplicates_are_counted_apart_with_no_compute(service, user, sent_args):
    same = photos(1, 400)
    job_services.job_create(owner=user, sources=same + same + photos(1, 401))  # the second copy is skipped
    assert rows() == {(user.id, "", Image.objects.first().model_id, "duplicate"): (1, 0, 0.0)}


@pytest.fixture
def fetching_allowed(service, origin):
    """The service allowed to fetch from the test server on 127.0.0.1 (refused by default)."""
    from embeddings import runtime

    service.FETCH_ALLOW_NETWORKS = ["127.0.0.1/32"]
    service.FETCH_RETRIES = 1
    runtime.fetcher.cache_clear()
    yield service
    runtime.fetcher.cache_clear()


def test_a_catalogues_fetches_are_counted_where_rows_get_their_bytes_once(fetching_allowed, user, origin):
    """A manifest of three URLs (the third the first's bytes again, a duplicate) and one that fails:
    three fetches with their bytes, two bulk images, one duplicate, all for the job's key; resolving
    the rows again (a redelivered fetch chunk) finds none without bytes and counts nothing."""
    from embeddings.services.catalogue import fetching
    from tests.embeddings.api.test_usage import keyed
    from tests.embeddings.services.catalogue.test_reading import post_manifest

    job = post_manifest(keyed(user, "ck_cat00001"), "url\n" + "".join(
        f"{origin.url}/{path}\n" for path in ("pixels/0.jpg", "pixels/1.jpg", "pixels/0.jpg?again=1", "status/404")))
    model = job.model_id
    size = len(pixels_jpeg(0)) * 2 + len(pixels_jpeg(1))
    expected = {(user.id, "ck_cat00001", model, "fetch"): (3, size, 0.0),
                (user.id, "ck_cat00001", model, "duplicate"): (1, 0, 0.0)}
    got = rows()
    assert {k: v for k, v in got.items() if k[3] != "image_bulk"} == expected
    assert got[(user.id, "ck_cat00001", model, "image_bulk")][0] == 2
    again = [(im, im.storage_key, im.sha256, im.size_bytes, b"") for im in Image.objects.filter(job=job, row__lte=3)]
    assert fetching.rows_resolve(again) == []
    assert rows() == got
