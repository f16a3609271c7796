"""Metadata filters (the ``workers/vector_store/filters`` package) and filtered search in the real engines.

The JSON form is checked error by error (message and path). The exact evaluator ``matches`` is the
oracle: a table of cases states Qdrant's semantics (True is not 1, 3.0 is not 3, a list matches by
any element, dates parse, exists is false for []) and each case runs in the edge engine too. Then
hypothesis draws filters (and / or / not over every condition kind), owners, jobs, exclusions and
k against a few hundred points (shared points with items of two owners, lists, missing fields,
mixed types in indexed fields, dates in several forms) in a real edge store and, smaller, in
qdrant-client's local mode: every hit matches, the hit count is min(k, matching points), and the
scores are the exact cosines of the best matching points, best first.
"""
from __future__ import annotations

import json
import random
import re
import uuid
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.vector_store import Point, open_store
from workers.vector_store import filters as F
from workers.vector_store.edge import EdgeStore
from workers.vector_store.filters import (
    And,
    AnyOf,
    Eq,
    Exists,
    FilterError,
    Not,
    Or,
    Range,
)

DIM = 16
OWNERS = (1, 2, 3)
JOBS = tuple(str(uuid.UUID(int=0xA000 + i)) for i in range(3))
INDEXED = {"cat": "keyword", "n": "integer", "price": "float", "d": "datetime", "flag": "bool", "x.y": "integer"}
F.parse_date("2024-05-01")  # loads qdrant-client's date parser now: its import draws from random, which
# hypothesis forbids inside a strategy (a date Range parses its bounds when it is built)


# --- the JSON form ---------------------------------------------------------------------------------

LEAF = {"field": "cat", "eq": "a"}


def nest(levels: int) -> dict:
    obj = LEAF
    for _ in range(levels):
        obj = {"not": obj}
    return obj


@pytest.mark.parametrize("obj, path, words", [
    ([], "", "is an object"),
    ({}, "", '"and", "or", "not" or "field"'),
    ({"and": []}, "and", "non-empty list"),
    ({"or": {"field": "a", "eq": 1}}, "or", "non-empty list"),
    ({"and": [LEAF, {"field": "1a", "eq": 2}]}, "and[1].field", "not a field name"),
    ({"and": [LEAF], "or": [LEAF]}, "or", "no other key"),
    ({"field": "a.b.c.d", "eq": 1}, "field", "not a field name"),
    ({"field": "a-b", "eq": 1}, "field", "not a field name"),
    ({"field": "a" * 65, "eq": 1}, "field", "not a field name"),
    ({"field": 3, "eq": 1}, "field", "a field name is a string"),
    ({"field": "a"}, "", "exactly one of"),
    ({"field": "a", "eq": 1, "in": [1]}, "", "exactly one of"),
    ({"field": "a", "eq": 1, "gte": 0}, "", "exactly one of"),
    ({"field": "a", "like": "x"}, "like", "unknown key"),
    ({"field": "a", "eq": None}, "eq", "no null"),
    ({"field": "a", "eq": [1]}, "eq", "string, number or boolean"),
    ({"field": "a", "eq": "s" * 257}, "eq", "at most 256 characters"),
    ({"field": "a", "eq": 2**63}, "eq", "64 bits"),
    ({"field": "a", "eq": float("nan")}, "eq", "finite"),
    ({"or": [{"field": "a", "in": [1, "b"]}]}, "or[0].in[1]", "all of one kind"),
    ({"field": "a", "in": [True]}, "in[0]", "strings or integers"),
    ({"field": "a", "in": [1.5]}, "in[0]", "strings or integers"),
    ({"field": "a", "in": []}, "in", "1 to 256"),
    ({"field": "a", "in": list(range(257))}, "in", "1 to 256"),
    ({"field": "a", "in": "abc"}, "in", "takes a list"),
    ({"field": "a", "in": ["ok", "s" * 257]}, "in[1]", "at most 256 characters"),
    ({"not": {"field": "d", "gte": "2024-13-01"}}, "not.gte", "not a date"),
    ({"field": "d", "gte": "yesterday"}, "gte", "not a date"),
    ({"field": "p", "gte": 1, "lt": "2024-01-01"}, "lt", "all numbers or all dates"),
    ({"field": "p", "gte": "2024-01-01", "lt": 5}, "lt", "all numbers or all dates"),
    ({"field": "p", "gte": True}, "gte", "expected a number"),
    ({"field": "p", "lte": float("inf")}, "lte", "finite"),
    ({"field": "p", "gt": None}, "gt", "number or a date string"),
    ({"field": "p", "gt": [1]}, "gt", "expected a number"),
    ({"field": "a", "exists": "yes"}, "exists", "true or false"),
    ({"and": [LEAF, {"or": [LEAF, {"not": {"field": "a", "in": [1, 2, "x"]}}]}]}, "and[1].or[1].not.in[2]", "one kind"),
    (nest(8), "not." * 8, "at most 8 levels"),
    ({"and": [LEAF] * 65}, "and", "at most 64 filters"),
    ({"and": [{"and": [LEAF] * 40}, {"and": [LEAF] * 25}]}, "and[1].and[24]", "at most 64 conditions"),
])
def test_parse_errors_say_what_and_where(obj, path, words):
    with pytest.raises(FilterError) as err:
        F.parse(obj)
    assert err.value.path == path.rstrip(".")
    assert words in err.value.message
    assert err.value.code == "invalid_filter" and isinstance(err.value, ValueError)
    assert str(err.value) == (f"{err.value.path}: {err.value.message}" if err.value.path else err.value.message)


def test_parse_builds_the_typed_filter_and_dump_reads_back():
    obj = {"and": [
        {"field": "category", "eq": "shoes"},
        {"or": [{"field": "brand", "in": ["a", "b"]}, {"field": "size", "in": [40, 41]}]},
        {"field": "price", "gte": 10, "lt": 49.5},
        {"field": "date", "gte": "2024-01-01", "lt": "2024-05-01T10:00:00+02:00"},
        {"field": "brand", "exists": True},
        {"field": "discontinued", "exists": False},
        {"not": {"field": "meta.colour.name", "eq": "red"}},
        {"field": "external_id", "eq": "sku-1"},
        {"field": "weight", "eq": 1.5},
        {"field": "sale", "eq": False},
    ]}
    where = F.parse(obj)
    assert where == And((
        Eq("category", "shoes"),
        Or((AnyOf("brand", ("a", "b")), AnyOf("size", (40, 41)))),
        Range("price", gte=10, lt=49.5),
        Range("date", gte=datetime(2024, 1, 1, tzinfo=UTC), lt=datetime(2024, 5, 1, 8, tzinfo=UTC)),
        Exists("brand"),
        Not(Exists("discontinued")),
        Not(Eq("meta.colour.name", "red")),
        Eq("external_id", "sku-1"),
        Eq("weight", 1.5),
        Eq("sale", False),
    ))
    assert where.items[3].is_date and not where.items[2].is_date
    dumped = F.dump(where)
    assert dumped["and"][3] == {"field": "date", "gte": "2024-01-01T00:00:00+00:00", "lt": "2024-05-01T08:00:00+00:00"}
    assert dumped["and"][5] == {"not": {"field": "discontinued", "exists": True}}
    assert F.parse(json.loads(json.dumps(dumped))) == where
    # the limits themselves are allowed
    assert F.parse(nest(7)) == F.parse(nest(7)) and isinstance(F.parse({"and": [LEAF] * 64}), And)
    assert len(F.parse({"field": "a", "in": [str(i) for i in range(256)]}).values) == 256


def test_json_schema_names_both_parts_and_refers_by_the_given_prefix():
    schema = F.json_schema("#/components/schemas/")
    forms = {"MetadataEquals", "MetadataIn", "MetadataExists", "MetadataNumberRange", "MetadataDateRange"}
    assert set(schema) == {"MetadataFilter", "MetadataCondition"} | forms
    assert {"$ref": "#/components/schemas/MetadataCondition"} in schema["MetadataFilter"]["oneOf"]
    assert [o["$ref"].rpartition("/")[2] for o in schema["MetadataCondition"]["oneOf"]] == sorted(forms, key=[
        "MetadataEquals", "MetadataIn", "MetadataExists", "MetadataNumberRange", "MetadataDateRange"].index)
    operators = set().union(*(schema[f]["properties"] for f in forms))
    assert operators == {"field", "eq", "in", "gt", "gte", "lt", "lte", "exists"}
    assert json.loads(json.dumps(schema)) == schema


def test_parse_indexed_fields():
    assert F.parse_indexed_fields("category:keyword, price:float ,date:DateTime,meta.size:integer,ok:bool") == {
        "category": "keyword", "price": "float", "date": "datetime", "meta.size": "integer", "ok": "bool"}
    assert F.parse_indexed_fields("") == {} and F.parse_indexed_fields(" , ") == {}
    for text, part in [("category", "'category'"), ("price:money", "'price:money'"), ("1x:keyword", "'1x:keyword'"),
                       ("a:keyword,a:float", "'a:float'"), ("a.b.c.d:keyword", "'a.b.c.d:keyword'")]:
        with pytest.raises(ValueError, match=part):
            F.parse_indexed_fields(text)
    assert F.payload_indexes({"cat": "keyword", "external_id": "keyword"}) == {
        "items[].owner": "integer", "items[].m.cat": "keyword", "items[].external_id": "keyword"}


# --- semantics: the evaluator and the engine agree with the stated rules ----------------------------

def test_check_metadata_holds_indexed_fields_to_their_type():
    ok = {"cat": ["a", "b"], "n": 3, "price": 2, "flag": [True], "d": "2024-05-01", "x": {"y": 1}, "other": [1, "a"]}
    F.check_metadata(ok, INDEXED)
    F.check_metadata({}, INDEXED)
    for bad, words in [({"n": 3.0}, "'n' is indexed as integer: 3.0 is not an integer"),
                       ({"n": [1, True]}, "True is not an integer"), ({"cat": 5}, "5 is not a string"),
                       ({"price": "12 EUR"}, "'12 EUR' is not a number"), ({"flag": 1}, "1 is not a boolean"),
                       ({"d": "soon"}, "'soon' is not an ISO 8601 date"), ({"x": {"y": {"z": 1}}}, "'x.y'")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            F.check_metadata(bad, INDEXED)


ITEM_METADATA = [
    {"cat": "a", "n": 3, "flag": True, "price": 3.0, "d": "2024-05-01", "tags": ["x", "y"]},
    {"cat": "A", "n": 3.0, "flag": 1, "price": 3, "d": "2024-05-01T10:00:00Z", "tags": []},
    {"cat": ["a", "b"], "n": [1, 7], "flag": [False, True], "d": ["soon", "2023-01-01"], "x": {"y": 2}},
    {"cat": [], "n": "3", "x": {"y": "2", "z": {"w": "deep"}}, "d": 20240501},
    {"cat": "", "n": True, "l": [{"y": 1}], "d": "2024-05-01 12:30:00+02:00"},
    {},
]

SEMANTICS = [  # (filter, indexes of ITEM_METADATA that match)
    ({"field": "cat", "eq": "a"}, {0, 2}),
    ({"field": "cat", "eq": ""}, {4}),
    ({"field": "cat", "in": ["A", "b"]}, {1, 2}),
    ({"field": "n", "eq": 3}, {0}),
    ({"field": "n", "eq": 3.0}, {0, 1}),
    ({"field": "n", "eq": True}, {4}),
    ({"field": "n", "eq": 1}, {2}),
    ({"field": "n", "in": [7, 3]}, {0, 2}),
    ({"field": "n", "gte": 2.5, "lte": 3.5}, {0, 1}),
    ({"field": "n", "lt": 2}, {2}),
    ({"field": "flag", "eq": True}, {0, 2}),
    ({"field": "flag", "eq": False}, {2}),
    ({"field": "flag", "eq": 1}, {1}),
    ({"field": "price", "eq": 3}, {1}),
    ({"field": "price", "gt": 2}, {0, 1}),
    ({"field": "d", "gte": "2024-05-01"}, {0, 1, 4}),
    ({"field": "d", "gt": "2024-05-01T10:00:00+00:00"}, {4}),
    ({"field": "d", "lte": "2024-05-01T12:00:00+02:00"}, {0, 1, 2}),
    ({"field": "d", "gte": "2024-05-01T10:00:00Z"}, {1, 4}),
    ({"field": "d", "lt": "2024-01-01"}, {2}),
    ({"field": "cat", "exists": True}, {0, 1, 2, 4}),
    ({"field": "cat", "exists": False}, {3, 5}),
    ({"field": "tags", "exists": True}, {0}),
    ({"field": "x", "exists": True}, {2, 3}),
    ({"field": "x.z.w", "eq": "deep"}, {3}),
    ({"field": "x.y", "eq": 2}, {2}),
    ({"field": "x.y", "in": ["2"]}, {3}),
    ({"field": "l.y", "eq": 1}, set()),
    ({"field": "tags", "eq": "y"}, {0}),
    ({"not": {"field": "cat", "eq": "a"}}, {1, 3, 4, 5}),
    ({"or": [{"field": "n", "eq": True}, {"and": [{"field": "cat", "eq": "a"}, {"field": "x", "exists": True}]}]}, {2, 4}),
]


@pytest.fixture(scope="module")
def semantics_store(tmp_path_factory):
    store = EdgeStore(tmp_path_factory.mktemp("semantics"), "sem", 4)  # mixed types: no metadata index
    store.ensure_collection()
    store.upsert([Point(uuid.UUID(int=i + 1), np.array([1, 0, 0, 0.1 * i], np.float32),
                        {"owner_ids": [1], "job_ids": [], "items": [{"image": str(uuid.UUID(int=i + 1)), "owner": 1, "m": m}]})
                  for i, m in enumerate(ITEM_METADATA)])
    yield store
    store.close()


@pytest.mark.parametrize("obj, expected", SEMANTICS, ids=[json.dumps(o) for o, _ in SEMANTICS])
def test_semantics_of_the_evaluator_and_the_engine(semantics_store, obj, expected):
    where = F.parse(obj)
    assert {i for i, m in enumerate(ITEM_METADATA) if F.matches(where, {"owner": 1, "m": m})} == expected
    hits = semantics_store.search(np.array([1, 0, 0, 0], np.float32), k=10, where=where)
    assert {h.id.int - 1 for h in hits} == expected


def test_one_item_must_satisfy_owner_job_and_filter_together(tmp_path):
    store = EdgeStore(tmp_path, "shared", 4, indexed_fields={"cat": "keyword"})
    store.ensure_collection()
    pid = uuid.uuid4()
    items = [{"image": "i1", "owner": 1, "job": JOBS[0], "m": {"cat": "a"}},
             {"image": "i2", "owner": 2, "external_id": "sku", "m": {"cat": "b"}}]
    store.upsert([Point(pid, np.array([1, 0, 0, 0], np.float32), {"owner_ids": [1, 2], "job_ids": [JOBS[0]], "items": items})])
    q = np.array([1, 0, 0, 0], np.float32)
    def cat(c):
        return Eq("cat", c)

    assert [h.id for h in store.search(q, k=5, owner_id=1, where=cat("a"))] == [pid]
    assert store.search(q, k=5, owner_id=1, where=cat("b")) == []  # owner 1's item is "a", owner 2's "b"
    assert store.search(q, k=5, owner_id=2, job_id=JOBS[0], where=cat("b")) == []  # owner 2's item has no job
    assert store.search(q, k=5, owner_id=2, where=Not(cat("b"))) == []
    hit = store.search(q, k=5, owner_id=2, where=Not(cat("a")))[0]
    assert F.matching_items(hit.payload, Not(cat("a")), owner_id=2) == [items[1]]
    assert F.matching_items(hit.payload, Exists("cat")) == items
    assert store.search(q, k=5, where=Eq("external_id", "sku"), exclude=[pid]) == []
    store.close()


def test_an_external_id_filter_compares_in_nfc(tmp_path):
    """Issue 53: ids are stored in NFC; a filter value in another canonically equivalent spelling
    (NFD ``Café``, ``Å`` as U+212B) is put in NFC, so it finds the id. Metadata values are exact."""
    assert F.parse({"field": "external_id", "eq": "Cafe\u0301-1"}) == Eq("external_id", "Caf\u00e9-1")
    assert F.parse({"field": "external_id", "in": ["\u212b-2", "x"]}).values == ("\u00c5-2", "x")
    assert F.parse({"field": "cat", "eq": "Cafe\u0301"}).value == "Cafe\u0301"  # metadata: as sent
    store = EdgeStore(tmp_path, "nfc", 4, indexed_fields={"external_id": "keyword"})
    store.ensure_collection()
    pid = uuid.uuid4()
    items = [{"image": "i1", "owner": 1, "external_id": "Caf\u00e9-1", "m": {}}]
    store.upsert([Point(pid, np.array([1, 0, 0, 0], np.float32), {"owner_ids": [1], "job_ids": [], "items": items})])
    q = np.array([1, 0, 0, 0], np.float32)
    for spelling in ("Caf\u00e9-1", "Cafe\u0301-1"):
        where = F.parse({"field": "external_id", "eq": spelling})
        assert [h.id for h in store.search(q, k=5, owner_id=1, where=where)] == [pid]
        assert F.matches(where, items[0])
        where = F.parse({"field": "external_id", "in": [spelling]})
        assert [h.id for h in store.search(q, k=5, owner_id=1, where=where)] == [pid]
    store.close()


def test_declared_indexes_are_created_and_added_on_the_next_open(tmp_path):
    store = EdgeStore(tmp_path, "idx", 4, indexed_fields={"cat": "keyword"})
    store.ensure_collection()
    def types(s):  # field -> type, with "/items" when each item is indexed as its own entry
        return {k: str(v.data_type).rpartition(".")[2] + ("/items" if v.params and v.params.nested else "")
                for k, v in s.client.info().payload_schema.items()}

    assert types(store) == {"owner_ids": "Integer", "job_ids": "Keyword", "items[].owner": "Integer/items",
                            "items[].m.cat": "Keyword/items"}
    store.upsert([Point(uuid.UUID(int=1), np.ones(4, np.float32),
                        {"owner_ids": [1], "job_ids": [], "items": [{"owner": 1, "m": {"cat": "a", "p": 2.5}}]})])
    store.close()
    store = EdgeStore(tmp_path, "idx", 4, indexed_fields={"cat": "integer", "p": "float", "when": "datetime"})
    store.ensure_collection()
    assert types(store) == {"owner_ids": "Integer", "job_ids": "Keyword", "items[].owner": "Integer/items",
                            "items[].m.cat": "Integer/items", "items[].m.p": "Float/items",
                            "items[].m.when": "Datetime/items"}
    assert [h.id.int for h in store.search(np.ones(4, np.float32), k=3, owner_id=1, where=Range("p", gt=2))] == [1]
    store.close()
    with pytest.raises(ValueError, match="unknown type 'text'"):
        open_store("edge", collection="x", dim=4, path=str(tmp_path), indexed_fields={"t": "text"})


# --- property tests against real stores ------------------------------------------------------------


def _date(rng: random.Random) -> str:
    day, hour = rng.randint(1, 28), rng.randint(0, 23)
    return rng.choice([f"2024-05-{day:02d}", f"2024-05-{day:02d}T{hour:02d}:00:00Z",
                       f"2024-05-{day:02d}T{hour:02d}:30:00+02:00", f"2024-05-{day:02d} {hour:02d}:15:00"])


def _metadata(rng: random.Random) -> dict:
    """Random metadata: each field sometimes missing or a list (empty too); the indexed fields
    (:data:`INDEXED`) hold their declared type, ``v``, ``w`` and ``e`` a mix of types."""
    m = {}
    pick = rng.random
    if pick() < 0.85:
        m["cat"] = rng.choice([rng.choice("abcd"), [rng.choice("abcd") for _ in range(rng.randint(0, 3))], "A"])
    if pick() < 0.8:
        m["n"] = rng.choice([rng.randint(0, 9), [rng.randint(0, 9), rng.randint(0, 9)], []])
    if pick() < 0.7:
        m["price"] = rng.choice([round(rng.uniform(0, 100), 2), rng.randint(0, 100), [rng.uniform(0, 100)], 3.0])
    if pick() < 0.7:
        m["flag"] = rng.choice([True, False, [True, False]])
    if pick() < 0.7:
        m["d"] = rng.choice([_date(rng), [_date(rng), _date(rng)]])
    if pick() < 0.6:
        m["v"] = rng.choice([rng.randint(0, 9), rng.randint(0, 9) + 0.5, 3.0, True, False, 1, "3", [1, 2.5, "a"]])
    if pick() < 0.6:
        m["w"] = rng.choice(["a", "b", 5, 1, True, ["a", 1], ""])
    if pick() < 0.5:
        m["e"] = rng.choice([_date(rng), "soon", 20240501, [_date(rng), "soon"]])
    if pick() < 0.5:
        m["tags"] = [rng.choice(["red", "blue", "green"]) for _ in range(rng.randint(0, 2))]
    if pick() < 0.5:
        m["x"] = {"y": rng.randint(0, 3)}
        if pick() < 0.5:
            m["x"]["z"] = {"w": rng.choice(["p", "q", 2])}
    return m


def make_points(n: int, seed: int) -> list[Point]:
    """``n`` random unit points; a quarter stand for two images (of two owners) and a few for three."""
    rng, vrng = random.Random(seed), np.random.default_rng(seed)
    vecs = vrng.normal(size=(n, DIM)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    points = []
    for i in range(n):
        owners = rng.sample(OWNERS, rng.choice([1, 1, 1, 2, 2, 3]))
        items = []
        for owner in owners:
            item = {"image": str(uuid.UUID(int=rng.getrandbits(128))), "owner": owner, "m": _metadata(rng)}
            if rng.random() < 0.6:
                item["job"] = rng.choice(JOBS)
            if rng.random() < 0.5:
                item["external_id"] = f"e{rng.randint(0, 20)}"
            items.append(item)
        payload = {"sha256": f"{i:064x}", "owner_ids": sorted({it["owner"] for it in items}),
                   "job_ids": sorted({it["job"] for it in items if "job" in it}), "items": items}
        points.append(Point(uuid.UUID(int=i + 1), vecs[i], payload))
    return points


FIELDS = ["cat", "n", "price", "flag", "d", "v", "w", "e", "tags", "x", "x.y", "x.z.w", "external_id", "absent"]
_dates = st.builds(lambda d, h, fmt: fmt.format(d, h), st.integers(1, 28), st.integers(0, 23),
                   st.sampled_from(["2024-05-{:02d}T{:02d}:00:00Z", "2024-05-{:02d}T{:02d}:00:00+02:00", "2024-05-{:02d}"]))
_strings = st.sampled_from(["a", "b", "c", "d", "A", "", "red", "blue", "p", "2", "3", "e1", "e7"])
_ints = st.integers(-1, 10)
_leaves = st.one_of(
    st.builds(Eq, st.sampled_from(FIELDS), st.one_of(_strings, _ints, st.booleans(), st.sampled_from([3.0, 4.5, 0.5]))),
    st.builds(AnyOf, st.sampled_from(FIELDS), st.one_of(st.lists(_strings, min_size=1, max_size=4),
                                                        st.lists(_ints, min_size=1, max_size=4))),
    st.builds(lambda f, lo, hi, incl: Range(f, **{"gte" if incl else "gt": lo}, lt=hi),
              st.sampled_from(["n", "price", "v", "w", "x.y", "flag", "cat"]), st.floats(-1, 60, allow_nan=False),
              st.one_of(st.none(), st.floats(0, 101, allow_nan=False)), st.booleans()),
    st.builds(lambda f, lo, hi: Range(f, gte=lo, lt=hi), st.sampled_from(["d", "e", "w"]), _dates,
              st.one_of(st.none(), _dates)),
    st.builds(Exists, st.sampled_from(FIELDS)),
)
wheres = st.recursive(_leaves, lambda sub: st.one_of(
    st.builds(And, st.lists(sub, min_size=1, max_size=3)), st.builds(Or, st.lists(sub, min_size=1, max_size=3)),
    st.builds(Not, sub)), max_leaves=8)


class Oracle:
    """The exact answer for a search over ``points``: numpy cosines and :func:`filters.item_matches`
    (without a filter: the payload's ``owner_ids`` / ``job_ids``, the store's fast path)."""

    def __init__(self, points: list[Point]) -> None:
        self.points = points
        self.x = np.stack([p.vector for p in points])

    def check(self, store, where, owner_id, job_id, k, qseed, excluded):
        q = np.random.default_rng(qseed).normal(size=DIM).astype(np.float32)
        q /= np.linalg.norm(q)
        exclude = [self.points[i].id for i in excluded]
        hits = store.search(q, k=k, owner_id=owner_id, job_id=job_id, exclude=exclude, where=where)
        scores = self.x @ q
        if where is None:
            ok = [i for i, p in enumerate(self.points) if p.id not in exclude
                  and (owner_id is None or owner_id in p.payload["owner_ids"])
                  and (job_id is None or job_id in p.payload["job_ids"])]
        else:
            ok = [i for i, p in enumerate(self.points) if p.id not in exclude and
                  any(F.item_matches(it, where, owner_id=owner_id, job_id=job_id) for it in p.payload["items"])]
        best = sorted(ok, key=lambda i: -scores[i])[:k]
        assert len(hits) == min(k, len(ok))
        ids, allowed = {p.id: i for i, p in enumerate(self.points)}, set(ok)
        assert all(ids[h.id] in allowed for h in hits), "a hit outside the filter"
        if where is not None:
            assert all(F.matching_items(h.payload, where, owner_id=owner_id, job_id=job_id) for h in hits)
        got = [h.score for h in hits]
        assert got == sorted(got, reverse=True)
        np.testing.assert_allclose(got, scores[best], atol=1e-5)
        np.testing.assert_allclose([scores[ids[h.id]] for h in hits], got, atol=1e-5)
        return len(ok)


@pytest.fixture(scope="module")
def edge_case(tmp_path_factory):
    points = make_points(400, seed=7)
    store = EdgeStore(tmp_path_factory.mktemp("edge"), "props", DIM, indexed_fields=INDEXED)
    store.ensure_collection()
    store.upsert(points)
    yield store, Oracle(points)
    store.close()


@pytest.fixture(scope="module")
def local_case(tmp_path_factory):
    points = make_points(120, seed=11)
    store = open_store("local", collection="props", dim=DIM, path=str(tmp_path_factory.mktemp("local")),
                       indexed_fields=INDEXED)
    store.ensure_collection()
    store.upsert(points)
    yield store, Oracle(points)
    store.close()


searches = {"where": wheres, "owner_id": st.one_of(st.none(), st.sampled_from(OWNERS)),
            "job_id": st.one_of(st.none(), st.none(), st.sampled_from(JOBS)), "k": st.integers(1, 40),
            "qseed": st.integers(0, 2**32 - 1), "excluded": st.lists(st.integers(0, 119), max_size=3)}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**searches)
def test_edge_filtered_top_k_is_exact(edge_case, where, owner_id, job_id, k, qseed, excluded):
    store, oracle = edge_case
    assert F.parse(json.loads(json.dumps(F.dump(where)))) == where
    oracle.check(store, where, owner_id, job_id, k, qseed, excluded)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**searches)
def test_local_filtered_top_k_is_exact(local_case, where, owner_id, job_id, k, qseed, excluded):
    store, oracle = local_case
    oracle.check(store, where, owner_id, job_id, k, qseed, excluded)


def test_edge_without_a_filter_keeps_the_owner_and_job_fast_path(edge_case):
    store, oracle = edge_case
    assert F.to_edge(None) is None
    assert [type(c).__name__ for c in F.to_edge(None, owner_id=3, job_id=JOBS[0]).must] == ["FieldCondition"] * 2
    assert "NestedCondition" in [type(c).__name__ for c in F.to_edge(Exists("cat"), owner_id=3).must]
    for owner_id, job_id in [(None, None), (2, None), (None, JOBS[1]), (3, JOBS[0])]:
        matched = oracle.check(store, None, owner_id, job_id, 25, 5, [])
        assert matched >= 25


def test_the_generated_data_exercises_every_case(edge_case):
    """Guards the property test's reach: filters that match none, few and many points all occur."""
    _, oracle = edge_case
    items = [it for p in oracle.points for it in p.payload["items"]]
    shared = [p for p in oracle.points if len(p.payload["items"]) > 1]
    assert len(shared) >= 100 and len(items) >= 550
    for it in items:
        F.check_metadata(it["m"], INDEXED)
    counts = {w: sum(F.matches(F.parse(json.loads(w)), it) for it in items) for w in [
        '{"field": "cat", "eq": "a"}', '{"field": "cat", "exists": false}', '{"field": "price", "eq": 3.0}',
        '{"field": "v", "eq": 1}', '{"field": "v", "eq": true}', '{"field": "v", "eq": 3.0}', '{"field": "w", "eq": 1}',
        '{"field": "d", "gte": "2024-05-10"}', '{"field": "e", "gte": "2024-05-10"}', '{"field": "x.z.w", "eq": "p"}']}
    assert all(c >= 10 for c in counts.values()), counts
