"""Vector exports (``embeddings.services.exports``: its rows and formats) against a real embedded
store: rows made in the database, points written straight into the store (no model), files read
back with pyarrow / numpy."""
from __future__ import annotations

import hashlib
import io
import json
import uuid
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embeddings import runtime, spaces
from embeddings.errors import ApplicationError
from embeddings.models import Image, ImageStatus, Job, Lane
from embeddings.services.exports import formats as export_formats
from embeddings.services.exports import rows as export_rows
from workers.ids import point_id
from workers.vector_store import Point

pytestmark = pytest.mark.django_db(transaction=True)


def _sha(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


def seed(owner, n: int, *, job=None, tag: str = "", status=ImageStatus.EMBEDDED, write_points: bool = True,
         rng=None) -> list[Image]:
    """``n`` rows of ``owner`` in the active space, each with its own bytes, metadata and external id,
    and (``write_points``) their points in the store: random unit vectors."""
    model_id = spaces.active().model_id
    rng = rng or np.random.default_rng(len(tag) + n)
    rows = []
    for i in range(n):
        sha = _sha(f"{owner.id}-{tag}-{i}")
        rows.append(Image(owner=owner, job=job, lane=Lane.BULK, status=status, sha256=sha, size_bytes=10,
                          storage_key=f"blob/{sha[:2]}/{sha[2:4]}/{sha}", model_id=model_id,
                          point_id=point_id(sha, model_id),
                          external_id=f"{tag}sku-{i}", metadata={"i": i, "tag": tag, "name": f"é {i}"}))
    Image.objects.bulk_create(rows)
    if write_points:
        v = rng.standard_normal((n, 512)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        runtime.vector_store(model_id).upsert([Point(im.point_id, v[i], {"sha256": im.sha256})
                                               for i, im in enumerate(rows)])
    return rows


def stored(rows) -> dict[str, np.ndarray]:
    """The store's own vectors of ``rows`` by image id (what every export must equal, bit for bit)."""
    model_id = spaces.active().model_id
    got = runtime.vector_store(model_id).vectors([point_id(im.sha256, model_id) for im in rows])
    return {str(im.id): got[point_id(im.sha256, model_id)] for im in rows}


def read_parquet(export, pages=None) -> pa.Table:
    data = b"".join(export_formats.write_parquet(export, export.pages() if pages is None else pages))
    return pq.read_table(io.BytesIO(data))


def assert_bit_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.tobytes() == np.asarray(want, np.float32).tobytes()


def test_parquet_has_every_row_with_its_exact_vector_and_the_space(service, user, other_user):
    mine = seed(user, 23, tag="a")
    seed(other_user, 4, tag="b")
    export = export_rows.export_start(user=user, page_rows=5)  # 5 pages, the last one short
    table = read_parquet(export)
    assert table.num_rows == 23
    assert table.schema.field("vector").type == pa.list_(pa.float32(), 512)
    assert table.column("id").to_pylist() == sorted(str(im.id) for im in mine)  # keyset order
    want = stored(mine)
    vectors = table.column("vector").combine_chunks().flatten().to_numpy().reshape(-1, 512)
    for i, image_id in enumerate(table.column("id").to_pylist()):
        assert_bit_equal(vectors[i], want[image_id])
    by_id = {str(im.id): im for im in mine}
    for row in table.select(["id", "external_id", "sha256", "model_id", "metadata"]).to_pylist():
        im = by_id[row["id"]]
        assert (row["external_id"], row["sha256"]) == (im.external_id, im.sha256)
        assert json.loads(row["metadata"]) == im.metadata  # unicode and numbers round-trip
        assert row["model_id"] == spaces.active().model_id
    info = json.loads(table.schema.metadata[b"embedding_space"])
    space = spaces.active()
    assert {k: info[k] for k in ("model_id", "model_name", "pretrained", "precision", "dim", "dtype")} == {
        "model_id": space.model_id, "model_name": "ViT-B-32", "pretrained": "random", "precision": space.precision,
        "dim": 512, "dtype": "float32"}
    assert info["preprocess"]["size"] == 224 and len(info["preprocess"]["mean"]) == 3 and info["job_id"] is None


def test_rows_without_a_vector_are_left_out_and_skipped_duplicates_share_their_originals(service, user):
    embedded = seed(user, 3, tag="e")
    seed(user, 2, tag="q", status=ImageStatus.QUEUED, write_points=False)
    seed(user, 1, tag="f", status=ImageStatus.FAILED, write_points=False)
    original = embedded[0]
    dup = Image.objects.create(owner=user, lane=Lane.BULK, status=ImageStatus.SKIPPED, sha256=original.sha256,
                               size_bytes=10, storage_key=original.storage_key, model_id=original.model_id,
                               point_id=original.point_id, duplicate_of=original, external_id="dup",
                               metadata={"copy": True})
    queued = seed(user, 1, tag="w", status=ImageStatus.QUEUED, write_points=False)[0]
    Image.objects.create(owner=user, lane=Lane.BULK, status=ImageStatus.SKIPPED, sha256=queued.sha256,
                         size_bytes=10, storage_key=queued.storage_key, model_id=queued.model_id,
                         duplicate_of=queued)  # its original has no vector yet: neither has it
    table = read_parquet(export_rows.export_start(user=user))
    rows = {r["id"]: r for r in table.to_pylist()}
    assert set(rows) == {str(im.id) for im in embedded} | {str(dup.id)}
    assert (rows[str(dup.id)]["external_id"], json.loads(rows[str(dup.id)]["metadata"])) == ("dup", {"copy": True})
    assert_bit_equal(np.asarray(rows[str(dup.id)]["vector"], np.float32), stored([original])[str(original.id)])


def test_owner_isolation_staff_and_the_job_filter(service, user, other_user, staff):
    job = Job.objects.create(owner=user, model_id=spaces.active().model_id, total=4)
    in_job = seed(user, 4, job=job, tag="j")
    loose = seed(user, 3, tag="l")
    theirs = seed(other_user, 5, tag="o")
    ids = lambda export: set(read_parquet(export).column("id").to_pylist())  # noqa: E731
    assert ids(export_rows.export_start(user=user)) == {str(im.id) for im in in_job + loose}
    assert ids(export_rows.export_start(user=other_user)) == {str(im.id) for im in theirs}
    assert ids(export_rows.export_start(user=staff)) == {str(im.id) for im in in_job + loose + theirs}
    export = export_rows.export_start(user=user, job_id=str(job.id))
    assert ids(export) == {str(im.id) for im in in_job} and export.space_info()["job_id"] == str(job.id)
    with pytest.raises(ApplicationError) as e:  # another's job is no job
        export_rows.export_start(user=other_user, job_id=str(job.id))
    assert (e.value.status, e.value.code) == (404, "not_found")
    assert ids(export_rows.export_start(user=staff, job_id=str(job.id))) == {str(im.id) for im in in_job}
    with pytest.raises(ApplicationError) as e:
        export_rows.export_start(user=user, model_id="no/such/space")
    assert (e.value.status, e.value.code) == (404, "not_found")


def test_a_long_export_sees_deletions_after_its_page_and_no_rows_created_after_it_began(service, user):
    rows = sorted(seed(user, 12, tag="d"), key=lambda im: str(im.id))
    export = export_rows.export_start(user=user, page_rows=4)
    pages = export.pages()
    first = next(pages)
    assert first.ids == [str(im.id) for im in rows[:4]]
    # while the export runs: a row of page 1 (already read) and one of page 2 go, with their point
    # (page 2's point only: page 1's is shared by nobody else either, but it was read already)
    Image.objects.filter(id__in=[rows[1].id, rows[5].id]).delete()
    runtime.vector_store(spaces.active().model_id).delete([rows[9].point_id])  # the row stays, its point goes
    seed(user, 3, tag="late")  # created after the export began
    rest = [i for page in pages for i in page.ids]
    assert first.ids + rest == [str(im.id) for im in rows if im not in (rows[5], rows[9])]


def test_jsonl_rows_are_the_stored_vectors_in_either_format(service, user):
    mine = seed(user, 7, tag="js")
    want = stored(mine)
    for fmt in ("float", "base64"):
        export = export_rows.export_start(user=user, page_rows=3)
        lines = b"".join(export_formats.export_stream(export, "jsonl", vector_format=fmt)).decode().splitlines()
        assert len(lines) == 7
        for line in lines:
            row = json.loads(line)
            v = row["vector"]
            got = (np.asarray(v, np.float64).astype(np.float32) if fmt == "float"
                   else np.frombuffer(__import__("base64").b64decode(v), "<f4").astype(np.float32))
            assert_bit_equal(got, want[row["id"]])
            assert row["metadata"]["tag"] == "js" and row["model_id"] == spaces.active().model_id


def test_npz_holds_vectors_ids_and_space(service, user):
    mine = seed(user, 11, tag="np")
    export = export_rows.export_start(user=user, page_rows=4)
    data = b"".join(export_formats.export_stream(export, "npz"))
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert [i.compress_type for i in z.infolist()] == [zipfile.ZIP_STORED] * 3
        assert z.namelist() == ["space.json", "ids.parquet", "vectors.npy"]
    npz = np.load(io.BytesIO(data))
    vectors = npz["vectors"]
    ids = pq.read_table(pa.BufferReader(npz["ids.parquet"]))
    assert vectors.shape == (11, 512) and vectors.dtype == np.float32 and ids.num_rows == 11
    assert "vector" not in ids.column_names
    want = stored(mine)
    for i, image_id in enumerate(ids.column("id").to_pylist()):
        assert_bit_equal(vectors[i], want[image_id])
    assert json.loads(npz["space.json"])["model_id"] == spaces.active().model_id


def test_an_empty_export_is_a_valid_empty_file(service, user):
    for fmt in export_formats.FORMATS:
        data = b"".join(export_formats.export_stream(export_rows.export_start(user=user), fmt))
        if fmt == "parquet":
            assert pq.read_table(io.BytesIO(data)).num_rows == 0
        elif fmt == "jsonl":
            assert data == b""
        else:
            assert np.load(io.BytesIO(data))["vectors"].shape == (0, 512)


def test_unknown_formats_are_refused_before_any_store_call(service, user, monkeypatch):
    from embeddings import sink

    monkeypatch.setattr(sink, "store_call", lambda *a, **k: pytest.fail("no store call expected"))
    export = export_rows.export_start(user=user)
    with pytest.raises(ApplicationError) as e:
        export_formats.export_stream(export, "csv")
    assert (e.value.status, e.value.code) == (400, "unsupported_export_format")
    with pytest.raises(ApplicationError) as e:
        export_formats.export_stream(export, "parquet", vector_format="base64")
    assert (e.value.status, e.value.code) == (400, "invalid")


def test_one_store_call_per_page(service, user, monkeypatch):
    from embeddings import sink

    seed(user, 10, tag="c")
    calls = []
    real = sink.store_call
    monkeypatch.setattr(sink, "store_call",
                        lambda name, *a, **k: calls.append((name, len(a[0]))) or real(name, *a, **k))
    assert read_parquet(export_rows.export_start(user=user, page_rows=4)).num_rows == 10
    assert calls == [("point_vectors", 4), ("point_vectors", 4), ("point_vectors", 2)]


def test_rows_from_before_a_model_switch_count_once_their_bytes_are_in_the_space(service, user):
    mine = seed(user, 3, tag="old")
    Image.objects.filter(id=mine[0].id).update(model_id="ViT-B-32/older/fp32")  # made by an older space
    Image.objects.filter(id=mine[1].id).update(model_id="ViT-B-32/older/fp32")
    copy = Image.objects.get(id=mine[1].id)
    Image.objects.create(owner=user, lane=Lane.BULK, status=ImageStatus.EMBEDDED, sha256=copy.sha256, size_bytes=10,
                         storage_key=copy.storage_key, model_id=spaces.active().model_id, source=copy,
                         point_id=point_id(copy.sha256, spaces.active().model_id))  # its migration copy
    ids = set(read_parquet(export_rows.export_start(user=user)).column("id").to_pylist())
    assert ids == {str(mine[1].id), str(mine[2].id)}  # the copy itself is never a row of its own


def test_point_vectors_reads_only_present_points(service, user):
    from embeddings.services.vectors import point_vectors

    mine = seed(user, 2, tag="pv")
    missing = uuid.uuid4()
    got = point_vectors([mine[0].point_id, missing, mine[1].point_id, mine[0].point_id],
                        model_id=spaces.active().model_id)
    assert set(got) == {mine[0].point_id, mine[1].point_id}
    assert_bit_equal(got[mine[1].point_id], stored(mine)[str(mine[1].id)])


@pytest.mark.parametrize("kind", ["edge", "local"])
def test_a_search_with_vectors_returns_the_stored_vectors(tmp_path, kind):
    from workers.vector_store import open_store

    store = open_store(kind, collection="c", dim=8, path=str(tmp_path / kind))
    store.ensure_collection()
    rng = np.random.default_rng(1)
    ids = [uuid.uuid4() for _ in range(5)]
    store.upsert([Point(i, rng.standard_normal(8).astype(np.float32), {"sha256": "x"}) for i in ids])
    hits = store.search(rng.standard_normal(8).astype(np.float32), k=3, with_vectors=True)
    want = store.vectors([h.id for h in hits])
    assert len(hits) == 3 and all(h.vector.tobytes() == want[h.id].tobytes() for h in hits)
    assert all(h.vector is None for h in store.search(np.ones(8, np.float32), k=2))
    store.close()
