"""A caller's metadata and external ids, checked before anything is stored (issue 41).

Plain functions, no Django: the API, the manifest rows (``catalogue.manifest_rows``) and the job
service share them. ``metadata`` is a bounded JSON object that travels into the database row and
the point's payload, so its keys, types, size and depth are bounded here; ``coerce`` turns the text
cells of a CSV manifest into the types its declared fields say.

Errors are :class:`MetadataError` with a stable ``code``:

- ``metadata_invalid``: not an object, a bad key, a value of an unsupported type or out of range,
  or a text cell that is not the declared type;
- ``metadata_too_large``: the compact JSON encoding is over ``max_bytes``, or more than
  ``max_keys`` keys in all;
- ``metadata_too_deep``: objects nested deeper than ``max_depth``;
- ``external_id_invalid``: an external id that is empty, too long or not printable.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from embeddings.errors import ApplicationError
from workers.vector_store.filters import check_metadata

#: A metadata key: an identifier of at most 64 characters, so it is also a valid payload field
#: name and a query-string parameter without escaping.
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
#: Keys the caller may not use inside metadata: ``external_id`` is a column and payload field of its own.
RESERVED_KEYS = frozenset({"external_id"})
#: Longest string value, in characters.
MAX_STRING_CHARS = 1024
#: Most items in one list value.
MAX_LIST_ITEMS = 64
#: Largest integer magnitude: 2**53, the last integer a JSON reader that stores numbers as IEEE
#: doubles (JavaScript, many JSON libraries) keeps exactly.
MAX_INT = 2**53
#: Longest external id, in characters (``Image.external_id`` is a ``CharField(max_length=256)``).
MAX_EXTERNAL_ID_CHARS = 256
#: The field types a text manifest may declare (the names ``METADATA_INDEXES`` uses).
KINDS = ("keyword", "integer", "float", "bool", "datetime")

_INTEGER = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
#: ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)``, built once rather than per call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


class MetadataError(ApplicationError, ValueError):
    """Metadata or an external id refused: a stable ``code`` (module docstring) and a ``message``
    naming the field; rendered by the API as a 400."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code, status=400)


def validate_metadata(obj: Any, *, max_bytes: int = 4096, max_depth: int = 3, max_keys: int = 64) -> dict:
    """The caller's metadata, checked and cleaned: a new dict, the input left as it was.

    Args:
        obj: a JSON object (``Mapping``). Keys match :data:`KEY` (``external_id`` is reserved at
            the top level); values are ``str`` (at most :data:`MAX_STRING_CHARS` characters, no
            U+0000, which PostgreSQL's ``jsonb`` cannot store), ``int`` (``|v| <= 2**53``),
            finite ``float``, ``bool``, ``datetime.date``/``datetime.datetime`` (kept as ISO-8601
            strings; ISO strings stay strings), lists of those scalars (at most
            :data:`MAX_LIST_ITEMS`), or nested objects. ``None`` values are dropped, in objects and
            in lists.
        max_bytes: largest size, in UTF-8 bytes of the compact JSON encoding
            (``json.dumps(out, separators=(",", ":"), ensure_ascii=False)``); ``METADATA_MAX_BYTES``.
        max_depth: the top-level object is depth 1; an object inside it depth 2, and so on.
        max_keys: most keys in all, counted over every nested object.

    Returns:
        The cleaned object (dates as ISO strings, ``None`` values gone).

    Raises:
        MetadataError: ``metadata_invalid``, ``metadata_too_large`` or ``metadata_too_deep``.
    """
    if not isinstance(obj, Mapping):
        raise MetadataError("metadata_invalid", f"metadata must be a JSON object, not {_type_name(obj)}")
    if not obj:
        return {}
    budget = [max_keys]
    out = _object(obj, "", 1, max_depth, budget)
    try:
        size = len(_COMPACT.encode(out).encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") has no UTF-8 encoding
        raise MetadataError("metadata_invalid", "metadata holds a string that is not valid Unicode") from e
    if size > max_bytes:
        raise MetadataError("metadata_too_large", f"metadata is {size} bytes as JSON; at most {max_bytes}")
    return out


def _object(obj: Mapping, path: str, depth: int, max_depth: int, budget: list[int]) -> dict:
    if depth > max_depth:
        raise MetadataError("metadata_too_deep", f"{path} nests objects deeper than {max_depth} levels")
    out = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not KEY.match(key):
            raise MetadataError("metadata_invalid",
                                f"key {str(key)[:80]!r}{_at(path)} must match [A-Za-z_][A-Za-z0-9_]{{0,63}}")
        if depth == 1 and key in RESERVED_KEYS:
            raise MetadataError("metadata_invalid", f"{key!r} is reserved: give it as its own field, not in metadata")
        budget[0] -= 1
        if budget[0] < 0:
            raise MetadataError("metadata_too_large", "metadata has too many keys")
        if value is None:
            continue
        where = f"{path}.{key}" if path else key
        if isinstance(value, Mapping):
            out[key] = _object(value, where, depth + 1, max_depth, budget)
        elif isinstance(value, (list, tuple)):
            if len(value) > MAX_LIST_ITEMS:
                raise MetadataError("metadata_too_large", f"{where} has {len(value)} items; at most {MAX_LIST_ITEMS}")
            out[key] = [_scalar(v, f"{where}[{i}]") for i, v in enumerate(value) if v is not None]
        else:
            out[key] = _scalar(value, where)
    return out


def _scalar(value: Any, where: str) -> str | int | float | bool:
    if isinstance(value, bool):  # before int: bool is a subclass of int
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise MetadataError("metadata_invalid", f"{where}: integer beyond ±2**53")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MetadataError("metadata_invalid", f"{where}: {value} is not a finite number")
        return value
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise MetadataError("metadata_too_large",
                                f"{where}: string of {len(value)} characters; at most {MAX_STRING_CHARS}")
        if "\x00" in value:
            raise MetadataError("metadata_invalid", f"{where}: string holds U+0000")
        return value
    if isinstance(value, (dt.date, dt.time)):  # datetime is a date
        return value.isoformat()
    kind = "an object" if isinstance(value, Mapping) else "a list" if isinstance(value, (list, tuple)) else None
    if kind:
        raise MetadataError("metadata_invalid", f"{where}: lists hold scalars only, not {kind}")
    raise MetadataError("metadata_invalid", f"{where}: unsupported value of type {_type_name(value)}")


def merge_patch(target: Any, patch: Any) -> Any:
    """``target`` changed by ``patch`` as JSON Merge Patch says (RFC 7396): a new value, neither
    argument changed.

    An object ``patch`` merges key by key: a ``None`` (JSON ``null``) value removes the key, an
    object value merges into the key's value the same way (a key holding no object starts from
    ``{}``), any other value (a string, a number, a list) replaces it. A ``patch`` that is not an
    object replaces ``target`` whole. So ``{"category": "hats"}`` changes one key and leaves the
    others; ``{"price": null}`` removes one; lists are replaced, never merged.
    """
    if not isinstance(patch, Mapping):
        return patch
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def check_declared(metadata: Mapping, types: Mapping[str, str] | None) -> dict:
    """``metadata`` unchanged when every value of a declared field (``METADATA_INDEXES``: a payload
    index of that type) has its type: the engine answers a filter on an indexed field from the
    index, which holds only values of its type, so a value of another type would be missed by
    filters without a word.

    Raises:
        MetadataError: ``metadata_invalid`` naming the field, its declared type and the value.
    """

    try:
        check_metadata(metadata, types)
    except ValueError as e:
        raise MetadataError("metadata_invalid", str(e)) from e
    return dict(metadata)


def normal_external_id(s: str) -> str:
    """``s`` in the one form ids are stored and compared in: outer whitespace stripped, then Unicode
    NFC (canonical composition).

    One id can be typed in several code point sequences that display and mean the same: ``Café``
    with ``é`` as U+00E9 or as ``e`` + U+0301 (macOS file names and some keyboards give the second),
    ``Å`` as U+00C5 or as U+212B ANGSTROM SIGN. Canonically equivalent strings have one NFC form,
    so every door that takes an id (manifest rows, upload fields, PATCH) stores it in NFC and every
    lookup (``?external_id=``, a search filter on ``external_id``, the admin's search) compares in
    NFC: either spelling finds the image, and two spellings of one id in a manifest are a repeat.
    Compatibility forms (NFKC: ``ﬁ`` and ``fi``, full-width digits) stay distinct: they are
    different characters, and folding them would merge ids a caller may keep apart.
    """
    return unicodedata.normalize("NFC", s.strip())


def validate_external_id(s: Any) -> str:
    """The caller's id of one image: a string of 1 to :data:`MAX_EXTERNAL_ID_CHARS` printable
    characters once outer whitespace is stripped and it is put in NFC (:func:`normal_external_id`),
    not starting with ``{`` or ``[``; an ``int`` (not ``bool``) is taken as its decimal text, as a
    JSON or Parquet manifest may give numeric ids.

    Returns:
        The id in its stored form (stripped, NFC).

    The first character rule: a form part, a CSV cell and a JSON string are all text, so an object
    or a list sent where an id belongs (a client's serialising mistake) would arrive as its JSON
    text and be taken for an id; no SKU starts with a JSON bracket.

    Raises:
        MetadataError: ``external_id_invalid``.
    """
    if isinstance(s, int) and not isinstance(s, bool):
        s = str(s)
    if not isinstance(s, str):
        raise MetadataError("external_id_invalid", f"external_id must be a string, not {_type_name(s)}")
    s = normal_external_id(s)
    if not s:
        raise MetadataError("external_id_invalid", "external_id is empty")
    if len(s) > MAX_EXTERNAL_ID_CHARS:
        raise MetadataError("external_id_invalid",
                            f"external_id has {len(s)} characters; at most {MAX_EXTERNAL_ID_CHARS}")
    # str.isprintable() is False for control, format (e.g. U+202E), separator other than the space,
    # surrogate and unassigned characters: ids that would display differently from what they are.
    if not s.isprintable():
        raise MetadataError("external_id_invalid", "external_id holds characters that are not printable")
    if s[0] in "{[":
        raise MetadataError("external_id_invalid", "external_id starts with a JSON bracket: send the id itself, "
                                                   "not an object or a list")
    return s


def check_types(types: Mapping[str, str] | None) -> dict[str, str]:
    """Declared field types (``{"price": "float"}``), checked: keys are metadata keys, kinds are
    in :data:`KINDS`. Returns a plain dict (empty for ``None``).

    Raises:
        MetadataError: ``metadata_invalid`` naming the field.
    """
    out = {}
    for field, kind in (types or {}).items():
        if not isinstance(field, str) or not KEY.match(field) or field in RESERVED_KEYS:
            raise MetadataError("metadata_invalid", f"declared field {field!r} is not a metadata key")
        if kind not in KINDS:
            raise MetadataError("metadata_invalid", f"field {field!r} has type {kind!r}; one of {', '.join(KINDS)}")
        out[field] = kind
    return out


def coerce(value: str, kind: str) -> str | int | float | bool:
    """One text cell as the declared type of its field.

    Args:
        value: the cell's text (outer whitespace is ignored for every kind but ``keyword``).
        kind: ``keyword`` (the text as given), ``integer`` (decimal digits with an optional sign),
            ``float`` (decimal or exponent notation, finite: no ``nan``/``inf``), ``bool``
            (``true/false/1/0/yes/no``, any case), ``datetime`` (ISO-8601 as Python's
            ``fromisoformat`` reads it: a date gives ``YYYY-MM-DD``, a date and time gives
            ``datetime.isoformat()``, ``Z`` becoming ``+00:00``).

    Raises:
        MetadataError: ``metadata_invalid`` when the text is not of that kind or ``kind`` is unknown.
    """
    text = value.strip()
    if kind == "keyword":
        return value
    if kind == "integer":
        if _INTEGER.match(text):
            return int(text)
    elif kind == "float":
        if _FLOAT.match(text):
            number = float(text)
            if math.isfinite(number):
                return number
    elif kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    elif kind == "datetime":
        try:
            return dt.date.fromisoformat(text).isoformat()
        except ValueError:
            pass
        try:
            return dt.datetime.fromisoformat(text).isoformat()
        except ValueError:
            pass
    else:
        raise MetadataError("metadata_invalid", f"unknown field type {kind!r}; one of {', '.join(KINDS)}")
    raise MetadataError("metadata_invalid", f"{value[:80]!r} is not {'an' if kind == 'integer' else 'a'} {kind}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _at(path: str) -> str:
    return f" in {path}" if path else ""
