"""JSON from a request, checked the same way wherever it comes from: a request body
(``parsers.JSONParser``) and JSON text inside form fields (``metadata``, ``filter``, ``inputs``,
``callback_url``).

- Depth: at most :data:`JSON_MAX_DEPTH` levels. Python's ``json`` parses recursively: ``[[[…]]]``
  a few thousand levels deep (a few KB of body) raises ``RecursionError``, which is not the
  ``ValueError`` DRF and most callers catch, and a structure just under the interpreter's limit
  parses but then overflows whatever walks it next (a serializer, ``json.dumps``, a database
  adapter). Bounding the depth right after parsing keeps every later step far from that limit.
- Text: no string (key or value) may hold an unpaired UTF-16 surrogate. JSON's ``\\ud800`` escape
  decodes to one, a Python string that cannot be encoded as UTF-8: echoed in an error message
  (``"\\ud800" is not a valid choice``) or written to the database it raised
  ``UnicodeEncodeError``, a 500.
"""
from __future__ import annotations

import json
import re
from typing import Any

from rest_framework import serializers

from embeddings.errors import ApplicationError

#: Deepest JSON nesting a request may send (the outermost value is level 1). The deepest structure
#: this API reads is a search filter: ``workers.vector_store.filters.MAX_DEPTH`` (8) operators,
#: 2 JSON levels each, about 17 levels; 64 leaves room and stays far below Python's recursion limit.
JSON_MAX_DEPTH = 64

_SURROGATE = re.compile("[\ud800-\udfff]")


def too_deep(field: str | None = None) -> ApplicationError:
    """``json_too_deep`` (400) naming the limit; ``field``: the form field that held the JSON text
    (None: the request body)."""
    where = f"{field} is JSON" if field else "the JSON body"
    return ApplicationError(f"{where} nested deeper than JSON_MAX_DEPTH ({JSON_MAX_DEPTH} levels)",
                            code="json_too_deep",
                            extra={"limit": "JSON_MAX_DEPTH", "value": JSON_MAX_DEPTH, "field": field})


def not_text(field: str | None = None) -> ApplicationError:
    """``parse_error`` (400, DRF's code for a body that is not JSON) for a string holding an
    unpaired surrogate."""
    where = f"{field}: " if field else ""
    return ApplicationError(f"JSON parse error - {where}a string holds an unpaired UTF-16 surrogate "
                            "(a \\ud800-\\udfff escape not in a pair), which is not text", code="parse_error",
                            extra={"field": field})


def problem(value: Any, max_depth: int = JSON_MAX_DEPTH) -> str | None:
    """``"too_deep"`` when ``value`` (parsed JSON: dicts, lists, scalars) nests deeper than
    ``max_depth`` levels, ``"surrogate"`` when a string in it (key or value) holds an unpaired
    surrogate, else None. Iterative, so it cannot overflow the stack itself; visits each value once
    (a non-ASCII string is searched, in C)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and _SURROGATE.search(node):
                return "surrogate"
            continue
        if isinstance(node, dict):
            children = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            return "too_deep"
        stack.extend((c, depth + 1) for c in children if isinstance(c, (str, dict, list)))
    return None


def checked(value: Any, *, field: str | None = None) -> Any:
    """``value`` (already parsed JSON) when it nests at most :data:`JSON_MAX_DEPTH` levels and
    holds only text.

    Raises:
        ApplicationError: ``json_too_deep`` (400; ``extra.limit``: ``JSON_MAX_DEPTH``,
            ``extra.value``: 64, ``extra.field``: ``field``), ``parse_error`` (400: a surrogate).
    """
    found = problem(value)
    if found == "too_deep":
        raise too_deep(field)
    if found == "surrogate":
        raise not_text(field)
    return value


def loads(text: str | bytes, *, field: str | None = None, **kwargs) -> Any:
    """``json.loads(text, **kwargs)``, then :func:`checked`.

    Raises:
        ApplicationError: ``json_too_deep`` or ``parse_error`` (400; ``extra.field``: ``field``).
        ValueError: text that is not JSON (``json.JSONDecodeError``), as ``json.loads``.
    """
    try:
        value = json.loads(text, **kwargs)
    except RecursionError:  # deeper than the interpreter's recursion limit: deeper than ours too
        raise too_deep(field) from None
    return checked(value, field=field)


class JSONField(serializers.JSONField):
    """DRF's ``JSONField`` checked as :func:`checked` says: a JSON body's value as it is (the
    parser checked it already); a form's value arrives as its JSON text and is parsed here.

    Raises:
        ValidationError: ``invalid`` (400): a form value that is not JSON.
        ApplicationError: ``json_too_deep`` / ``parse_error`` (400, ``extra.field``: the field's name).
    """

    def to_internal_value(self, data):
        if self.binary or getattr(data, "is_json_string", False):
            try:
                return loads(data, field=self.field_name, cls=self.decoder)
            except ValueError:  # UnicodeDecodeError of bytes too
                self.fail("invalid")
        return super().to_internal_value(checked(data, field=self.field_name))
