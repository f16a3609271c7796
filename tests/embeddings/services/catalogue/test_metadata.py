"""A caller's metadata, external ids and typed text cells (embeddings/services/catalogue/metadata.py)."""
from __future__ import annotations

import datetime as dt
import json

import pytest

from embeddings.errors import ApplicationError
from embeddings.services.catalogue.metadata import (
    MetadataError,
    check_types,
    coerce,
    merge_patch,
    normal_external_id,
    validate_external_id,
    validate_metadata,
)


def code_of(call, *args, **kwargs) -> str:
    with pytest.raises(MetadataError) as e:
        call(*args, **kwargs)
    assert isinstance(e.value, ApplicationError) and isinstance(e.value, ValueError) and e.value.status == 400
    return e.value.code


def test_metadata_kept_cleaned_and_not_mutated():
    given = {"category": "shoes", "price": 12.5, "stock": 3, "sale": False, "tags": ["red", None, "leather"],
             "released": dt.date(2024, 5, 1), "seen": dt.datetime(2024, 5, 1, 10, 30, tzinfo=dt.UTC),
             "day": "2024-05-01", "gone": None, "size": {"eu": 42, "us": None, "fit": {"width": "wide"}}}
    copy = json.loads(json.dumps(given, default=str))
    out = validate_metadata(given)
    assert out == {"category": "shoes", "price": 12.5, "stock": 3, "sale": False, "tags": ["red", "leather"],
                   "released": "2024-05-01", "seen": "2024-05-01T10:30:00+00:00", "day": "2024-05-01",
                   "size": {"eu": 42, "fit": {"width": "wide"}}}
    assert given["tags"] == ["red", None, "leather"] and "gone" in given  # the input is left as it was
    assert json.loads(json.dumps(given, default=str)) == copy
    assert validate_metadata({}) == {} and validate_metadata({"a": None}) == {}


@pytest.mark.parametrize("obj", [None, [], "text", 3, [("a", 1)]])
def test_metadata_must_be_an_object(obj):
    assert code_of(validate_metadata, obj) == "metadata_invalid"


@pytest.mark.parametrize("obj", [
    {"1st": 1}, {"has space": 1}, {"": 1}, {"a" * 65: 1}, {"ünicode": 1}, {"a-b": 1}, {3: "x"},
    {"external_id": "x"},  # reserved at the top level
    {"big": 2**53 + 1}, {"small": -(2**53) - 1}, {"nan": float("nan")}, {"inf": float("inf")},
    {"bytes": b"abc"}, {"set": {1, 2}}, {"nul": "a\x00b"}, {"surrogate": "\ud800"},
    {"objects_in_list": [{"a": 1}]}, {"lists_in_list": [[1]]},
])
def test_metadata_invalid(obj):
    assert code_of(validate_metadata, obj) == "metadata_invalid"


def test_metadata_limits_are_inclusive():
    assert validate_metadata({"n": 2**53, "m": -(2**53)}) == {"n": 2**53, "m": -(2**53)}
    assert validate_metadata({"a" * 64: "x" * 1024})  # longest key, longest string
    assert validate_metadata({"tags": list(range(64))})["tags"][-1] == 63
    assert validate_metadata({"nested": {"inner": {"leaf": 1}}}) == {"nested": {"inner": {"leaf": 1}}}  # depth 3
    assert validate_metadata({"o": {"external_id": "x"}}) == {"o": {"external_id": "x"}}  # reserved only at the top
    assert validate_metadata({f"k{i}": i for i in range(64)})  # 64 keys


def test_metadata_too_large_by_bytes_counts_utf8_of_compact_json():
    # {"a":"…"} is 8 bytes of JSON around the value; "é" is 2 bytes in UTF-8.
    assert validate_metadata({"a": "x" * 92}, max_bytes=100) == {"a": "x" * 92}  # exactly 100 bytes
    assert code_of(validate_metadata, {"a": "x" * 93}, max_bytes=100) == "metadata_too_large"
    assert validate_metadata({"a": "é" * 46}, max_bytes=100)  # 8 + 92 = 100 bytes
    assert code_of(validate_metadata, {"a": "é" * 47}, max_bytes=100) == "metadata_too_large"


def test_metadata_too_large_by_keys_strings_and_lists():
    assert code_of(validate_metadata, {f"k{i}": i for i in range(65)}, max_bytes=10**6) == "metadata_too_large"
    # keys of nested objects count too
    assert code_of(validate_metadata, {"a": {f"k{i}": i for i in range(64)}}, max_bytes=10**6) == "metadata_too_large"
    assert code_of(validate_metadata, {"s": "x" * 1025}, max_bytes=10**6) == "metadata_too_large"
    assert code_of(validate_metadata, {"tags": list(range(65))}, max_bytes=10**6) == "metadata_too_large"


def test_metadata_too_deep():
    assert code_of(validate_metadata, {"a": {"b": {"c": {"d": 1}}}}) == "metadata_too_deep"
    assert validate_metadata({"a": {"b": 1}}, max_depth=2) == {"a": {"b": 1}}
    assert code_of(validate_metadata, {"a": {"b": {}}}, max_depth=2) == "metadata_too_deep"
    deep: dict = {}
    cursor = deep
    for _ in range(5000):  # far deeper than Python's recursion limit: refused at level 4, not a crash
        cursor["x"] = {}
        cursor = cursor["x"]
    assert code_of(validate_metadata, deep) == "metadata_too_deep"


@pytest.mark.parametrize("given, expected", [("sku-1", "sku-1"), ("  sku 1\t", "sku 1"), (12345, "12345"),
                                             ("x" * 256, "x" * 256), ("日本-7", "日本-7")])
def test_external_id_valid(given, expected):
    assert validate_external_id(given) == expected


#: Canonically equivalent spellings of one id (issue 53): NFC and NFD ``Café``, ``Å`` as U+00C5 and
#: as U+212B ANGSTROM SIGN, Hangul as a syllable and as its jamo.
LOOKALIKES = [("Caf\u00e9-1", "Cafe\u0301-1"), ("\u00c5-2", "\u212b-2"), ("\uac00", "\u1100\u1161")]


@pytest.mark.parametrize("nfc, other", LOOKALIKES)
def test_external_ids_that_look_the_same_are_one_id_in_nfc(nfc, other):
    assert nfc != other
    assert validate_external_id(other) == validate_external_id(nfc) == nfc
    assert normal_external_id(f"  {other}\t") == nfc


def test_compatibility_forms_stay_distinct_ids():
    # NFC, not NFKC: the ligature and full-width digits are other characters, kept apart
    assert validate_external_id("\ufb01le-\uff11") == "\ufb01le-\uff11"


def test_an_id_is_measured_in_its_nfc_form():
    assert validate_external_id("e\u0301" * 256) == "\u00e9" * 256  # 512 code points as sent, 256 stored


@pytest.mark.parametrize("given", ["", "   ", "x" * 257, "a\nb", "a\x00", "a\u202eb", True, 1.5, None, ["a"]])
def test_external_id_invalid(given):
    assert code_of(validate_external_id, given) == "external_id_invalid"


@pytest.mark.parametrize("value, kind, expected", [
    (" Shoes ", "keyword", " Shoes "),
    ("42", "integer", 42), (" -7 ", "integer", -7), ("+3", "integer", 3),
    ("12.50", "float", 12.5), ("1e3", "float", 1000.0), ("-.5", "float", -0.5), ("7", "float", 7.0),
    ("true", "bool", True), ("YES", "bool", True), ("1", "bool", True),
    ("False", "bool", False), ("no", "bool", False), ("0", "bool", False),
    ("2024-05-01", "datetime", "2024-05-01"),
    ("2024-05-01T10:30:00Z", "datetime", "2024-05-01T10:30:00+00:00"),
    ("2024-05-01 10:30", "datetime", "2024-05-01T10:30:00"),
    ("2024-05-01T10:30:00.250+02:00", "datetime", "2024-05-01T10:30:00.250000+02:00"),
])
def test_coerce(value, kind, expected):
    out = coerce(value, kind)
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize("value, kind", [
    ("4.2", "integer"), ("1_000", "integer"), ("", "integer"), ("twelve", "integer"),
    ("nan", "float"), ("inf", "float"), ("1_0.5", "float"), ("1,5", "float"),
    ("maybe", "bool"), ("", "bool"), ("2024-13-01", "datetime"), ("yesterday", "datetime"),
    ("x", "colour"),
])
def test_coerce_refuses(value, kind):
    assert code_of(coerce, value, kind) == "metadata_invalid"


def test_check_types():
    assert check_types(None) == {} and check_types({"price": "float"}) == {"price": "float"}
    assert code_of(check_types, {"price": "money"}) == "metadata_invalid"
    assert code_of(check_types, {"bad key": "float"}) == "metadata_invalid"
    assert code_of(check_types, {"external_id": "keyword"}) == "metadata_invalid"


@pytest.mark.parametrize("text", ['{"sku": 1}', "[1, 2]", "{", "[x"])
def test_an_external_id_never_starts_with_a_json_bracket(text):
    """An object or a list sent where an id belongs arrives as its JSON text (a form part, a CSV
    cell): refused, never taken for an id."""
    with pytest.raises(MetadataError) as e:
        validate_external_id(text)
    assert e.value.code == "external_id_invalid"
    assert validate_external_id("SKU-{1}") == "SKU-{1}"  # inside an id a bracket is just a character


#: RFC 7396 appendix A: (target, patch, result), every example of the RFC.
RFC_7396_EXAMPLES = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize(("target", "patch", "result"), RFC_7396_EXAMPLES)
def test_merge_patch_follows_every_example_of_rfc_7396(target, patch, result):
    before = json.dumps(target), json.dumps(patch)
    assert merge_patch(target, patch) == result
    assert (json.dumps(target), json.dumps(patch)) == before  # neither argument changed


def test_merge_patch_changes_one_key_and_keeps_the_others():
    stored = {"category": "shoes", "price": 49.5, "launched": "2024-05-01", "size": {"eu": 42, "us": 9}}
    assert merge_patch(stored, {"category": "hats"}) == {"category": "hats", "price": 49.5,
                                                         "launched": "2024-05-01", "size": {"eu": 42, "us": 9}}
    assert merge_patch(stored, {"price": None, "size": {"us": None, "uk": 8}}) == {
        "category": "shoes", "launched": "2024-05-01", "size": {"eu": 42, "uk": 8}}
    assert merge_patch(stored, {}) == stored
