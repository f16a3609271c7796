"""A client generated from docs/openapi.yaml drives the service's main flows, as a team consuming
the API would: if a flow cannot be written with it, the schema is wrong.

openapi-python-client generates the client at test time into a temporary folder (generated code is
not committed); it talks to the real processes (web, one worker per queue, private Redis, embedded
Qdrant, random-weights CLIP) with a non-staff user's token. The 429 is real: with the interactive
worker stopped, an upload whose deadline passes leaves its message queued, so the next upload's
predicted wait is longer than its deadline; the client waits ``Retry-After`` seconds between tries
while the worker comes back. On the shared stack (tests/e2e/conftest.py) the staff counts are what
this module adds; the lists and searches are the non-staff user's own.
"""
from __future__ import annotations

import importlib
import io
import subprocess
import sys
import threading
import time
from http import HTTPStatus
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.e2e.conftest import Api, settled_stats

pytestmark = pytest.mark.e2e

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
PACKAGE = "clip_embeddings_client"  # openapi-python-client's name for the schema's title


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = cv2.resize(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), (320, 256), interpolation=cv2.INTER_CUBIC)
    return cv2.imencode(".jpg", img)[1].tobytes()


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """The generated package's modules, as ``gen.api`` / ``gen.models`` / ``gen.types``."""
    out = tmp_path_factory.mktemp("client")
    tool = Path(sys.executable).with_name("openapi-python-client")
    r = subprocess.run([str(tool), "generate", "--path", str(SCHEMA), "--meta", "none"], cwd=out,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    sys.path.insert(0, str(out))
    try:
        pkg = importlib.import_module(PACKAGE)
        mods = {name: importlib.import_module(f"{PACKAGE}.{name}") for name in ("models", "types")}
        api = {op: importlib.import_module(f"{PACKAGE}.api.{tag}.{op}") for tag, op in (
            ("images", "images_upload"), ("images", "images_list"), ("images", "images_retrieve"),
            ("jobs", "jobs_create"), ("jobs", "jobs_retrieve"), ("jobs", "jobs_list"), ("search", "search"),
            ("stats", "stats"))}
    finally:
        sys.path.remove(str(out))
    return type("Generated", (), {"pkg": pkg, "api": api, **mods})


@pytest.fixture(scope="module")
def client(stack, gen):
    token = stack.manage("apiuser", "generated").strip()
    return gen.pkg.AuthenticatedClient(base_url=stack.web_url, token=token, prefix="Token", timeout=120)


@pytest.fixture(scope="module")
def staff_token(stack):
    return stack.manage("apiuser", "gen-staff", "--staff").strip()


def _files(gen, seeds):
    return [gen.types.File(payload=io.BytesIO(jpeg(s)), file_name=f"{s}.jpg", mime_type="image/jpeg") for s in seeds]


def test_main_flows_through_the_generated_client(stack, gen, client, staff_token):
    m, api = gen.models, gen.api
    before = settled_stats(Api(stack.web_url, staff_token))

    # upload with neighbours: two images, the second one's nearest neighbour is itself... or the first
    r = api["images_upload"].sync_detailed(client=client, body=m.ImageUploadRequest(files=_files(gen, [1, 2]), k=3))
    assert r.status_code == HTTPStatus.OK, r.content
    up = r.parsed
    assert isinstance(up, m.UploadResponse) and [im.status for im in up.images] == [m.ImageStatusEnum.EMBEDDED] * 2
    assert all(len(im.neighbours) >= 1 for im in up.images)
    assert {n.image_id for n in up.images[1].neighbours} <= {up.images[0].id, up.images[1].id}

    # a bulk job to done
    r = api["jobs_create"].sync_detailed(client=client, body=m.JobSubmitRequest(
        files=_files(gen, range(10, 16)), name="generated", priority=m.PriorityEnum.URGENT))
    assert r.status_code == HTTPStatus.ACCEPTED, r.content
    created = r.parsed
    assert isinstance(created, m.JobCreated) and created.total == 6
    for _ in range(240):
        job = api["jobs_retrieve"].sync(client=client, job_id=created.id)
        if job.status == m.JobStatusEnum.DONE:
            break
        time.sleep(0.5)
    assert isinstance(job, m.JobProgress) and job.status == m.JobStatusEnum.DONE
    assert (job.embedded, job.failed, job.total) == (6, 0, 6)

    # the lists: paginated objects, newest first
    jobs = api["jobs_list"].sync(client=client)
    assert isinstance(jobs, m.PaginatedJobList) and [j.id for j in jobs.results] == [created.id]
    images = api["images_list"].sync(client=client)
    assert len(images.results) == 8 and images.next_ is None

    # search by text, by an uploaded image, by a stored image's id (in the job)
    # min_score 0: the cutoff off (random weights score texts near 0; the space's calibrated cutoff
    # follows whatever the shared stack holds, and this test is about the client, not the cutoff)
    by_text = api["search"].sync(client=client, body=m.SearchTextRequest(text="a photo", k=5, min_score=0))
    assert isinstance(by_text, m.SearchResponse) and len(by_text.results) == 5
    by_image = api["search"].sync(client=client, body=m.SearchImageRequest(image=_files(gen, [12])[0], k=1))
    assert isinstance(by_image, m.SearchResponse) and len(by_image.results) == 1
    in_job = {im.id for im in images.results if im.job == created.id}
    assert by_image.results[0].image_id in in_job and by_image.results[0].score > 0.99
    some = min(in_job)
    by_id = api["search"].sync(client=client, body=m.SearchImageIdRequest(image_id=some, k=3, job_id=created.id))
    assert isinstance(by_id, m.SearchResponse) and by_id.results[0].image_id == some
    assert all(n.job_id == created.id for n in by_id.results)

    # errors come back typed: an unknown image is a 404 in the Error shape
    missing = api["images_retrieve"].sync_detailed(client=client, image_id=created.id)
    assert missing.status_code == HTTPStatus.NOT_FOUND and missing.parsed.code == "not_found"

    # stats are for staff: a typed 403 for this user, the Stats shape for a staff token
    refused = api["stats"].sync_detailed(client=client)
    assert refused.status_code == HTTPStatus.FORBIDDEN and refused.parsed.code == "forbidden"
    staff = gen.pkg.AuthenticatedClient(base_url=stack.web_url, token=staff_token, prefix="Token", timeout=120)
    stats = api["stats"].sync(client=staff)
    assert isinstance(stats, m.Stats)
    assert stats.points - before["points"] == stats.distinct_embedded - before["distinct_embedded"] == 8


def test_a_429_is_retried_after_retry_after(stack, gen, client):
    m, upload, retrieve = gen.models, gen.api["images_upload"], gen.api["images_retrieve"]
    # one answered upload first: admission predicts from the lane's measured time per image
    warm = upload.sync_detailed(client=client, body=m.ImageUploadRequest(files=_files(gen, [99]), k=0))
    assert warm.status_code == HTTPStatus.OK, warm.content
    stack.stop_process("worker-interactive")
    # With the worker down every admitted upload's deadline passes (202) and its message stays
    # queued, until the predicted wait of the next one is longer than its deadline: 429.
    answers, seed = [], 100
    while not answers or answers[-1].status_code == HTTPStatus.ACCEPTED:
        assert len(answers) < 12, [a.status_code for a in answers]
        seed += 1
        body = m.ImageUploadRequest(files=_files(gen, [seed]), k=1, deadline=1.0)
        answers.append(upload.sync_detailed(client=client, body=body))
    r = answers[-1]
    assert r.status_code == HTTPStatus.TOO_MANY_REQUESTS, r.content
    assert isinstance(r.parsed, m.Error) and r.parsed.code == "overloaded"
    assert int(r.headers["Retry-After"]) >= 1

    # The client waits Retry-After seconds between tries of the same request while the worker
    # comes back and drops the expired messages.
    restart = threading.Thread(target=stack.restart, args=("worker-interactive",))
    restart.start()
    tries, waited = 1, 0
    while r.status_code == HTTPStatus.TOO_MANY_REQUESTS and waited < 240:
        pause = int(r.headers["Retry-After"])
        time.sleep(pause)
        waited += pause
        r = upload.sync_detailed(client=client, body=m.ImageUploadRequest(files=_files(gen, [seed]), k=1,
                                                                            deadline=1.0))
        tries += 1
    restart.join()
    assert tries >= 2 and r.status_code in (HTTPStatus.OK, HTTPStatus.ACCEPTED), r.content
    image = r.parsed.images[0]
    if r.status_code == HTTPStatus.OK:
        assert image.status == m.ImageStatusEnum.EMBEDDED
    # Admitted while the restarted worker still drops the expired messages, the 1 s deadline may
    # pass (202): its url answers how it ended (embedded, or expired in the broker).
    for _ in range(120):
        if image.status != m.ImageStatusEnum.QUEUED:
            break
        time.sleep(0.5)
        image = retrieve.sync(client=client, image_id=image.id)
    assert image.status in (m.ImageStatusEnum.EMBEDDED, m.ImageStatusEnum.EXPIRED)
