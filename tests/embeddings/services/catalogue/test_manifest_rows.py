"""One manifest row checked and mapped (embeddings/services/catalogue/manifest_rows.py), read
through the format readers: an undeclared CSV cell's number, a declared field's type, the metadata
bound and a nested ``metadata`` object, a repeated ``external_id`` left alone, and the row limit."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pytest

from embeddings.services.catalogue.manifest_rows import ManifestRow, RowError, infer
from embeddings.services.catalogue.manifests import read_manifest
from tests.embeddings.services.catalogue.test_manifests import accepted, errors, parquet_bytes, read


@pytest.mark.parametrize("text, value", [
    ("0", 0), ("-7", -7), ("12.50", 12.5), ("1e3", 1000.0), ("true", True), ("false", False),
    ("00123", "00123"), ("1,5", "1,5"), ("+3", "+3"), ("1e", "1e"), ("True", "True"), ("NaN", "NaN"),
    ("1e999", "1e999"), (str(2 ** 53 + 1), str(2 ** 53 + 1)), ("", ""), (" 1", " 1"),
])
def test_an_undeclared_csv_cell_is_a_number_only_when_written_as_json_writes_one(text, value):
    assert infer(text) == value and type(infer(text)) is type(value)


def test_repeated_external_id_is_left_to_the_job_service():
    items = read(b"url,external_id\nhttps://a.example/1.jpg,dup\nhttps://a.example/2.jpg,dup\n")
    assert [(r.row, r.external_id) for r in items] == [(1, "dup"), (2, "dup")]


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_every_format_gives_ids_in_nfc(fmt):
    """Issue 53: look-alike spellings of one id arrive as one id (its NFC form) in every format,
    so the job service sees the second of a pair as a repeat."""
    ids = ["Caf\u00e9-1", "Cafe\u0301-1", "\u00c5-2", "\u212b-2", "plain-3"]
    urls = [f"https://a.example/{i}.jpg" for i in range(5)]
    if fmt == "csv":
        data = ("url,external_id\n" + "".join(f"{u},{i}\n" for u, i in zip(urls, ids))).encode()
    elif fmt == "jsonl":
        data = "".join(json.dumps({"url": u, "external_id": i}) + "\n" for u, i in zip(urls, ids)).encode()
    else:
        data = parquet_bytes(pa.table({"url": urls, "external_id": ids}))
    assert [r.external_id for r in read(data, fmt)] == ["Caf\u00e9-1", "Caf\u00e9-1", "\u00c5-2", "\u00c5-2", "plain-3"]


def test_max_rows_ends_with_one_error():
    data = b"url\n" + b"".join(b"https://a.example/%d.jpg\n" % i for i in range(1, 6)) + b"\n"
    items = read(data, max_rows=3)
    assert [r.row for r in items] == [1, 2, 3, 4] and errors(items) == [(4, "manifest_too_many_rows")]
    assert errors(read(data, max_rows=5)) == []  # the trailing blank line is not a sixth row


def test_metadata_bound_is_the_callers():
    data = b"url,note\nhttps://a.example/1.jpg," + b"n" * 200 + b"\n"
    assert errors(read(data)) == []
    assert errors(read(data, max_metadata_bytes=100)) == [(1, "metadata_too_large")]


def test_jsonl_nested_metadata_and_which_wins():
    lines = [
        {"url": "https://a.example/1.jpg", "external_id": "a-1", "colour": "red",
         "metadata": {"colour": "blue", "size": {"eu": 42, "fit": {"width": "wide"}}, "tags": ["x", "y"]}},
        {"key": "photos/2.jpg", "external_id": 17, "price": "12.50", "metadata": None, "gone": None},
        {"url": "https://a.example/3.jpg", "metadata": {"a": {"b": {"c": {"d": 1}}}}},
        {"url": "https://a.example/4.jpg", "metadata": "not an object"},
        {"url": "https://a.example/5.jpg", "metadata": {"big": "x" * 1000, "more": "y" * 1000, "and": "z" * 1000,
                                                          "last": "w" * 1000, "over": "v" * 200}},
        {"url": "https://a.example/6.jpg", "external_id": "a-1", "bad key": 1},
        {"url": "https://a.example/7.jpg", "metadata": {"external_id": "x"}},
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    items = read(data, "jsonl", types={"price": "float"})
    assert errors(items) == [(3, "metadata_too_deep"), (4, "metadata_invalid"), (5, "metadata_too_large"),
                             (6, "metadata_invalid"), (7, "metadata_invalid")]
    assert accepted(items) == {
        1: ManifestRow(1, "https://a.example/1.jpg", None, "a-1",
                       {"colour": "blue", "size": {"eu": 42, "fit": {"width": "wide"}}, "tags": ["x", "y"]}),
        2: ManifestRow(2, None, "photos/2.jpg", "17", {"price": 12.5}),
    }
    assert [e.external_id for e in items if isinstance(e, RowError)] == [None, None, None, "a-1", None]


def test_a_declared_field_holds_its_type_or_the_row_fails():
    """A payload index answers filters from values of its type only: a declared field's value of
    another type would be missed silently, so the row is refused instead."""
    rows = list(read_manifest(io.BytesIO(b'{"url": "https://a.example/1.jpg", "price": true}\n'
                                         b'{"url": "https://a.example/2.jpg", "price": "12.5"}\n'
                                         b'{"url": "https://a.example/3.jpg", "price": [1, "x"]}\n'),
                              "jsonl", types={"price": "float"}))
    assert [(r.row, r.code) for r in rows if isinstance(r, RowError)] == [(1, "metadata_invalid"), (3, "metadata_invalid")]
    assert rows[1] == ManifestRow(2, "https://a.example/2.jpg", None, None, {"price": 12.5})
    assert "indexed as float" in rows[0].detail
