"""Object storage as a catalogue source (embeddings/objects.py), against a real
S3 endpoint: moto's standalone server (``MotoServer`` of tests/embeddings/test_storage_s3.py) reached
over HTTP by the client :func:`make_client` builds. No client is mocked."""
from __future__ import annotations

import io
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embeddings import objects

from embeddings.objects import (
    Allowed,
    ObjectError,
    ObjectInfo,
    copy_object,
    list_prefix,
    make_client,
    open_object,
    parse_s3_uri,
)
from tests.embeddings.test_storage_s3 import MotoServer

BUCKET = "catalogue-photos"
OTHER = "catalogue-other"
#: 2,500 images under photos/: 1,250 .jpg, 625 .PNG, 625 .txt, and 3 "folder" markers beside them.
N = 2500


def photo_key(i: int) -> str:
    extension = (".jpg", ".PNG", ".jpg", ".txt")[i % 4]
    return f"photos/{i:05d}{extension}"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    client = make_client(endpoint_url=server.url, region="us-east-1", access_key="testing", secret_key="testing",
                         addressing_style="path")
    client.create_bucket(Bucket=BUCKET)
    client.create_bucket(Bucket=OTHER)
    keys = [photo_key(i) for i in range(N)]
    with ThreadPoolExecutor(8) as pool:  # boto3 clients are thread-safe
        list(pool.map(lambda k: client.put_object(Bucket=BUCKET, Key=k, Body=k.encode()), keys))
    for folder in ("photos/", "photos/sub/", "other/"):
        client.put_object(Bucket=BUCKET, Key=folder, Body=b"")
    client.put_object(Bucket=BUCKET, Key="other/x.jpg", Body=b"x" * 10)
    yield client
    server.stop()


def test_a_prefix_of_2500_objects_in_3_pages(s3):
    pages = list(list_prefix(s3, BUCKET, "photos/", page_size=1000))
    # The folder markers photos/ (first page) and photos/sub/ (last page) are listed, never yielded.
    assert [len(p) for p in pages] == [999, 1000, 501]
    listed = [o.key for page in pages for o in page]
    assert listed == sorted(photo_key(i) for i in range(N))
    assert pages[0][0] == ObjectInfo("photos/00000.jpg", len("photos/00000.jpg"), pages[0][0].etag)
    assert len(pages[0][0].etag) == 32 and '"' not in pages[0][0].etag  # the MD5, unquoted


def test_extension_filter_is_case_insensitive(s3):
    pages = list(list_prefix(s3, BUCKET, "photos/", extensions={".jpg", "png"}, page_size=1000))
    listed = [o.key for page in pages for o in page]
    assert len(listed) == 1875 and not any(k.endswith(".txt") for k in listed)
    assert sum(k.endswith(".PNG") for k in listed) == 625
    assert [len(p) for p in pages] == [750, 750, 375]  # i % 4 == 3 (.txt) left out of each page
    assert list(list_prefix(s3, BUCKET, "photos/", extensions={".gif"})) == []  # empty pages are not yielded


def test_small_pages_and_other_prefixes(s3):
    assert [len(p) for p in list_prefix(s3, BUCKET, "photos/0000", page_size=4)] == [4, 4, 2]  # 00000..00009
    assert [[o.key for o in p] for p in list_prefix(s3, BUCKET, "other/")] == [["other/x.jpg"]]
    assert list(list_prefix(s3, BUCKET, "nothing-here/")) == []
    with pytest.raises(ValueError):
        list(list_prefix(s3, BUCKET, "photos/", page_size=1001))


def test_missing_bucket(s3):
    with pytest.raises(ObjectError) as e:
        list(list_prefix(s3, "no-such-bucket", ""))
    assert e.value.code == "source_missing"


def test_open_object_streams_under_a_cap(s3):
    key = photo_key(7)
    assert open_object(s3, BUCKET, key, max_bytes=1000) == key.encode()
    assert open_object(s3, BUCKET, key, max_bytes=len(key)) == key.encode()  # the cap is inclusive
    with pytest.raises(ObjectError) as e:
        open_object(s3, BUCKET, key, max_bytes=len(key) - 1)
    assert (e.value.code, e.value.status) == ("too_large", 413)
    for bucket, missing in ((BUCKET, "photos/missing.jpg"), ("no-such-bucket", "x.jpg")):
        with pytest.raises(ObjectError) as e:
            open_object(s3, bucket, missing, max_bytes=1000)
        assert e.value.code == "source_missing"


def test_copy_object_into_a_file(s3, tmp_path):
    big = bytes(range(256)) * 20_000  # 5 MB: several chunks
    s3.put_object(Bucket=OTHER, Key="manifest.csv", Body=big)
    with (tmp_path / "m.csv").open("w+b") as f:
        assert copy_object(s3, OTHER, "manifest.csv", f, max_bytes=len(big)) == len(big)
        f.seek(0)
        assert f.read() == big
    with pytest.raises(ObjectError) as e:
        copy_object(s3, OTHER, "manifest.csv", io.BytesIO(), max_bytes=len(big) - 1)
    assert e.value.code == "too_large"


@pytest.mark.parametrize("uri, expected", [
    ("s3://bucket-a/photos/", ("bucket-a", "photos/")), ("s3://bucket-a", ("bucket-a", "")),
    ("S3://bucket-a/", ("bucket-a", "")), ("s3://my.bucket.1/a/b/c.jpg", ("my.bucket.1", "a/b/c.jpg")),
    ("s3://bucket-a/photos/.hidden", ("bucket-a", "photos/.hidden")),
])
def test_parse_s3_uri(uri, expected):
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize("uri", ["https://bucket-a/x", "bucket-a/x", "s3://", "s3://Bucket_A/x", "s3://ab/x",
                                 "s3://bucket-a//x", "s3://bucket-a/a/../b", "s3://bucket-a/..", "s3://bucket-a/a\nb",
                                 "s3://-bucket/x", None])
def test_parse_s3_uri_refuses(uri):
    with pytest.raises(ObjectError) as e:
        parse_s3_uri(uri)
    assert e.value.code == "source_uri_invalid" and isinstance(e.value, ValueError)


def test_allowed_buckets_and_prefixes():
    allowed = Allowed.parse(" bucket-a/photos/ , bucket-b,,s3://bucket-c/shop ")
    assert allowed.rules == (("bucket-a", "photos/"), ("bucket-b", ""), ("bucket-c", "shop/"))
    assert Allowed.parse(["bucket-a/photos/", "bucket-b"]).rules == allowed.rules[:2]  # SOURCE_BUCKETS is a list
    for bucket, key in (("bucket-a", "photos/"), ("bucket-a", "photos/2024/x.jpg"), ("bucket-a", "photos/2024"),
                        ("bucket-b", ""), ("bucket-b", "anything/x.jpg"), ("bucket-c", "shop/x.jpg")):
        allowed.check(bucket, key)
    for bucket, key in (("bucket-a", ""), ("bucket-a", "photos"), ("bucket-a", "photos-private/x.jpg"),
                        ("bucket-a", "other/x.jpg"), ("bucket-c", "shopping/x.jpg"), ("bucket-d", "x.jpg"),
                        ("bucket-a", "photos/../secret/x.jpg"), ("bucket-b", "/etc/passwd"), ("bucket-b", "a/../b")):
        with pytest.raises(ObjectError) as e:
            allowed.check(bucket, key)
        assert (e.value.code, e.value.status) == ("source_not_allowed", 403)
    with pytest.raises(ObjectError):
        Allowed().check("bucket-b", "x.jpg")  # no rules: nothing is allowed
    with pytest.raises(ObjectError) as e:
        Allowed.parse("bucket-a/../x")
    assert e.value.code == "source_uri_invalid"


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(uri=st.from_regex(objects.S3_URI_PATTERN, fullmatch=True).filter(
    lambda u: len(u.partition("//")[2].partition("/")[2].encode()) <= objects.MAX_KEY_BYTES))
def test_every_uri_the_schema_pattern_allows_parses(uri):
    objects.parse_s3_uri(uri)  # the schema states what parse_s3_uri takes (embeddings.api.schema_rules)


@pytest.mark.parametrize("uri", ["data", "s3://", "s3://A-bucket/x", "s3://bucket//x", "s3://bucket/a/../b",
                                 "s3://bucket/..", "s3://bucket/./x", "s3://bucket/a\x01", "gs://bucket/x"])
def test_a_uri_the_schema_pattern_refuses_is_refused(uri):
    assert not re.fullmatch(objects.S3_URI_PATTERN, uri)
    with pytest.raises(objects.ObjectError) as e:
        objects.parse_s3_uri(uri)
    assert e.value.code == "source_uri_invalid"
