"""Issue 13 with real processes (gunicorn, Redis, one Celery worker per queue, embedded Qdrant): a
catalogue of 500 stored images in the active space (ViT-B-32, seeded random weights) is migrated to
ViT-S-32 (CLIP_MODELS, seeded random weights) while interactive uploads and searches run.

- zero errors: every interactive request answers 200 (no 4xx, no 5xx) before, during and after;
- every live image (the catalogue and the uploads made during the migration) has a point in the new
  space's collection, exactly one per image;
- after ``promote`` every search sent more than 1 s after its answer answers from the new space
  (``SPACE_CACHE_S`` 0.5 s; searches sent every 0.1 s from 8 threads), and after ``rollback`` from
  the old one.

The catalogue is pre-filled fast (:func:`prefill`): real image bytes stored in the blob store and
rows created as for a job, but their old-space vectors are seeded random unit vectors written
through the vectors worker (``index_chunk``), not computed by the model. The migration computes
every new vector with the real ViT-S-32. The interactive p95 with and without a migration is
13B's benchmark (benchmarks/migration.py), not this test.
"""
from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest

from tests.e2e.conftest import Api

N = 500


def picture(i: int, size: int = 96) -> bytes:
    """A distinct seeded ``size``×``size`` JPEG (colour field and a few discs)."""
    import cv2

    rng = np.random.default_rng(10_000 + i)
    img = cv2.resize(rng.integers(0, 255, (4, 4, 3), dtype=np.uint8), (size, size), interpolation=cv2.INTER_CUBIC)
    for _ in range(3):
        c = tuple(int(x) for x in rng.integers(0, 255, 3))
        cv2.circle(img, (int(rng.integers(0, size)), int(rng.integers(0, size))), int(rng.integers(5, 30)), c, -1)
    return cv2.imencode(".jpg", img)[1].tobytes()


def prefill(n: int = N, owner: str = "catalogue") -> None:
    """Run inside the stack (``manage.py shell``): ``n`` real images stored and their rows created in
    the active space as one bulk job, their points (seeded random unit vectors) written by the
    vectors worker through ``index_chunk``, which marks them embedded. Prints the job id."""
    from django.contrib.auth import get_user_model

    from embeddings import dispatch, runtime
    from embeddings.messages import encode_vector
    from embeddings.models import Image, Job, Lane
    from embeddings import spaces
    from workers.ids import point_id

    user, _ = get_user_model().objects.get_or_create(username=owner)
    space = spaces.active()
    job = Job.objects.create(owner=user, name="catalogue", model_id=space.model_id, total=n, chunk_size=64)
    store, rows = runtime.blob_store(), []
    for i in range(n):
        key, sha, size = store.put([picture(i)])
        rows.append(Image(owner=user, job=job, lane=Lane.BULK, sha256=sha, size_bytes=size, storage_key=key,
                          original_name=f"cat-{i:03d}.jpg", model_id=space.model_id,
                          point_id=point_id(sha, space.model_id)))
    Image.objects.bulk_create(rows, batch_size=500)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, space.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for start in range(0, n, 64):
        items = [{"id": str(im.id), "point_id": str(im.point_id), "sha256": im.sha256, "width": 96, "height": 96,
                  "format": "jpeg", "vector": encode_vector(v), "model_id": space.model_id}
                 for im, v in zip(rows[start:start + 64], vectors[start:start + 64])]
        dispatch.send_index_chunk(job_id=str(job.id), stat_id=None, items=items, priority="urgent")
    print(job.id)


def facts(a: str, s: str) -> None:
    """Run inside the stack: what the database and the vectors worker say about spaces ``a`` (the
    old) and ``s`` (the new), as one JSON line."""
    from embeddings.models import Image
    from embeddings import sink

    users = Image.objects.filter(source__isnull=True, duplicate_of__isnull=True)
    out = {
        "originals_embedded": users.filter(status="embedded").count(),
        "not_embedded": list(users.exclude(status="embedded").values_list("status", flat=True)),
        "copies": {st: Image.objects.filter(model_id=s, source__isnull=False, status=st).count()
                   for st in ("queued", "embedded", "failed")},
        "points": {m: sink.store_call("collection_stats", m, timeout_s=30)["points"] for m in (a, s)},
    }
    print(json.dumps(out))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, database_url):
    from scripts.stack import Stack

    env = {"CLIP_PRETRAINED": "random", "CLIP_MODELS": "ViT-S-32:random", "DATABASE_URL": database_url,
           "DJANGO_DEBUG": "0", "INTERACTIVE_DEADLINE_S": "30", "SPACE_CACHE_S": "0.5",
           "MIGRATION_GATE_SAMPLE": "16", "RECONCILE_INTERVAL_S": "0"}
    s = Stack(tmp_path_factory.mktemp("stack"), env, private_redis=True, log=lambda *a: None)
    with s:
        yield s


def _shell(stack, call: str) -> str:
    return stack.manage("shell", "-c", f"from tests.e2e.test_migration import *; {call}").strip().splitlines()[-1]


class Load:
    """Interactive traffic in a thread: an upload of a new picture, a text search and a search by a
    stored image id, over and over; every answer's status (and searched space) is kept."""

    def __init__(self, api: Api) -> None:
        self.api, self.stop = api, threading.Event()
        self.answers: list[tuple[str, int, str | None]] = []
        self.uploaded: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            r = self.api.post("/api/images/", files=[("files", (f"u{i}.jpg", io.BytesIO(picture(5000 + i)),
                                                               "image/jpeg"))], data={"k": 3})
            self.answers.append(("upload", r.status_code, None))
            if r.status_code == 200:
                self.uploaded.append(r.json()["images"][0]["id"])
            r = self.api.post("/api/search/", json={"text": "a photo", "k": 5, "min_score": 0})
            self.answers.append(("text", r.status_code, r.json().get("model_id") if r.ok else None))
            if self.uploaded:
                r = self.api.post("/api/search/", json={"image_id": self.uploaded[-1], "k": 5, "min_score": 0})
                self.answers.append(("image_id", r.status_code, r.json().get("model_id") if r.ok else None))
            i += 1
            time.sleep(1.0)

    def __enter__(self) -> "Load":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=90)


def _last_old_answer(api: Api, image_id: str, new: str, since: float, *, for_s: float = 3.0) -> float:
    """Searches by ``image_id`` sent every 0.1 s from ``since`` (the promote's or rollback's answer)
    for ``for_s`` seconds, in threads (a slow answer never delays the next send). Returns when the
    last search answering from another space than ``new`` was *sent*, in seconds after ``since``
    (0.0 when none did): after that moment every search answered from ``new``."""
    from concurrent.futures import ThreadPoolExecutor

    def one(delay: float) -> tuple[float, str]:
        time.sleep(max(0.0, since + delay - time.monotonic()))
        sent = time.monotonic() - since
        r = api.post("/api/search/", json={"image_id": image_id, "k": 3, "min_score": 0})
        assert r.status_code == 200, r.text
        return sent, r.json()["model_id"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, [i * 0.1 for i in range(int(for_s * 10))]))
    assert answers[-1][1] == new, answers
    return max([sent for sent, model in answers if model != new], default=0.0)


def test_migrate_500_images_under_interactive_load_promote_and_roll_back(stack, api):
    t_start = time.monotonic()
    job_id = _shell(stack, "prefill()")
    alice = Api(stack.web_url, stack.manage("apiuser", "alice").strip())
    deadline = time.monotonic() + 60
    while api.get(f"/api/jobs/{job_id}/").json()["embedded"] < N:
        assert time.monotonic() < deadline, "the catalogue's points were not written"
        time.sleep(0.5)

    prefilled_in = time.monotonic() - t_start
    with Load(alice) as during:
        time.sleep(2)  # some traffic before the migration
        r = api.post("/api/migrations/", json={"model": "ViT-S-32", "pretrained": "random"})
        assert r.status_code == 202, r.text
        url, S = r.json()["url"], r.json()["model_id"]
        A = r.json()["source"]
        assert S.startswith("ViT-S-32/random-seed0/") and A.startswith("ViT-B-32/random-seed0/")
        started = time.monotonic()
        deadline = started + 240
        while True:
            m = api.get(url).json()
            if m["job"]["status"] == "done" and m["job"]["total"] >= N:
                break
            assert time.monotonic() < deadline, f"the migration did not finish: {m['job']['counts']}"
            time.sleep(1)
        migrated_in = time.monotonic() - started
        assert (m["job"]["embedded"], m["job"]["failed"], m["job"]["total"]) == (m["job"]["total"], 0, m["job"]["total"])
        during.stop.set()
        during.thread.join(timeout=90)
        # the uploads' dual copies ride the bulk lane behind the migration: wait for them too
        deadline = time.monotonic() + 60
        while True:
            stats = api.get("/api/stats/").json()
            rows = {sp["model_id"]: sp["embedded_rows"] for sp in stats["spaces"]}
            if rows[S] == stats["images"]["embedded"]:
                break
            assert time.monotonic() < deadline, (rows, stats["images"])
            time.sleep(0.5)
        f = json.loads(_shell(stack, f"facts({A!r}, {S!r})"))
        # every live image has exactly one point in each space (all distinct bytes)
        assert f["not_embedded"] == [] and f["copies"]["failed"] == 0
        assert f["copies"]["embedded"] == f["originals_embedded"] == f["points"][S] == f["points"][A]
        assert f["originals_embedded"] >= N + 3

    probe = during.uploaded[0]  # an upload made during the migration: a point in both spaces
    with Load(alice) as load:
        r = api.post(f"{url}promote/", json={"force": True})  # mechanics here; the gate is 13B's test
        assert r.status_code == 200 and r.json()["state"] == "active", r.text
        promoted_in = _last_old_answer(api, probe, S, time.monotonic())
        r = api.post(f"{url}rollback/", json={})
        assert r.status_code == 200 and r.json()["model_id"] == A, r.text
        rolled_back_in = _last_old_answer(api, probe, A, time.monotonic())
    assert promoted_in <= 1.0 and rolled_back_in <= 1.0, (promoted_in, rolled_back_in)
    answers = during.answers + load.answers
    statuses = [s for _, s, _ in answers]
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert {m for k, s, m in answers if k == "text"} <= {A, S}
    print(f"migrated {m['job']['total']} images in {migrated_in:.1f} s; last search from the old space sent "
          f"{promoted_in:.2f} s after the promote answered, {rolled_back_in:.2f} s after the rollback; "
          f"prefill {prefilled_in:.1f} s, whole test {time.monotonic() - t_start:.1f} s; "
          f"{len(statuses)} interactive answers, all 200")
