"""Metadata filters for similarity search: a typed filter (:data:`Where`), its JSON form, an exact
evaluator, and the Qdrant payload filters that apply it inside the vector query.

A point stands for every image with the same bytes in one embedding space, so its payload holds one
item per image: ``{"sha256", "owner_ids": [int], "job_ids": [str], "items": [{"image": "<uuid>",
"owner": int, "job": "<uuid>" (absent when none), "external_id": str (absent when none), "m":
{metadata}}]}``. A point matches a search when ONE of its items satisfies the owner (if given), the
job (if given) and the filter. That is a Qdrant nested condition on ``items``, evaluated by the
engine while it ranks (:func:`to_edge`, :func:`to_client`), never after: top-k returns k points
whenever k points match (exact below the edge store's HNSW threshold, ``edge.INDEXING_THRESHOLD_KB``).

JSON form (the API's ``filter`` object, read by :func:`parse`; :func:`json_schema` gives it as JSON
Schema for OpenAPI)::

    where     := {"and": [where, ...]} | {"or": [where, ...]} | {"not": where} | condition
    condition := {"field": FIELD, "eq": string | integer | number | boolean}
               | {"field": FIELD, "in": [string, ...] | [integer, ...]}
               | {"field": FIELD, "gt"|"gte"|"lt"|"lte": number | DATE, ...}   at least one bound,
                                                                             all numbers or all dates
               | {"field": FIELD, "exists": boolean}                         false: the field is absent
    FIELD     := SEGMENT ("." SEGMENT){0,2}     a metadata key, or a dotted path into nested objects;
                 SEGMENT := [A-Za-z_][A-Za-z0-9_]{0,63}        "external_id" is the image's external id
    DATE      := ISO 8601 string, "YYYY-MM-DD" or "YYYY-MM-DDThh:mm:ssZ" (no offset: UTC)

Bounds (:data:`MAX_DEPTH`, :data:`MAX_CONDITIONS`, :data:`MAX_IN`, :data:`MAX_STRING`): a filter is
user input evaluated per item of every candidate point, so its size is capped.

Semantics (Qdrant's, which :func:`matches` reproduces exactly; the property tests hold the engines
to it): a list value matches when any element does; ``eq`` on a string is exact (case-sensitive;
an ``external_id`` value is first put in the form ids are stored in, stripped and Unicode NFC);
``eq``/``in`` on integers match integer values only (``3.0`` is a float: use a range), booleans only
booleans (``true`` is not ``1``); ``eq`` with a float is the range ``gte = lte = value``; a numeric
range matches int and float values, never strings or booleans; a date range matches strings that
parse as dates (Qdrant core's formats, naive = UTC); ``exists`` is false for a missing field and an
empty list; paths go through nested objects, never through lists.

Payload indexes (``indexed_fields``, ``METADATA_INDEXES``): a declared type is a promise about the
values. The engine answers a selective condition from the index, which holds only values of its
type (an integer index has no ``3.5``, a datetime index no ``"soon"``), so a value of another type in
an indexed field may be missed or seen depending on the query plan. :func:`check_metadata` rejects
such values where metadata comes in.

Errors: :class:`FilterError` (a ``ValueError``, reason code ``invalid_filter``) with ``path``, where
in the JSON object it is (``"and[2].field"``; ``""`` for the whole object).
"""
from __future__ import annotations

from .evaluate import field_values, item_matches, matches, matching_items
from .indexes import (
    check_indexed_fields,
    check_metadata,
    parse_indexed_fields,
    payload_indexes,
)
from .qdrant import item_key, to_client, to_edge
from .where import (
    EXTERNAL_ID,
    INDEX_TYPES,
    MAX_CONDITIONS,
    MAX_DEPTH,
    MAX_IN,
    MAX_PATH_DEPTH,
    MAX_STRING,
    OWNER_INDEX,
    And,
    AnyOf,
    Eq,
    Exists,
    FilterError,
    Not,
    Or,
    Range,
    Where,
    check_field,
    dump,
    json_schema,
    parse,
    parse_date,
)

__all__ = ["EXTERNAL_ID", "INDEX_TYPES", "MAX_CONDITIONS", "MAX_DEPTH", "MAX_IN", "MAX_PATH_DEPTH", "MAX_STRING",
           "OWNER_INDEX", "And", "AnyOf", "Eq", "Exists", "FilterError", "Not", "Or", "Range", "Where", "check_field",
           "check_indexed_fields", "check_metadata", "dump", "field_values", "item_key", "item_matches",
           "json_schema", "matches", "matching_items", "parse", "parse_date", "parse_indexed_fields",
           "payload_indexes", "to_client", "to_edge"]
