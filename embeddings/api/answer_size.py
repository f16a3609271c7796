"""Error answers of bounded size, whatever the request held.

An error that echoes its input grows with it: DRF lists every invalid item of a list field (100,000
bad ``callback_events`` made a 4.3 MB answer), a refusal lists every part it refuses. The API renders
every error body through :func:`bounded_error` (``embeddings.api.errors``): below ``extra``'s own
keys, each list and object keeps its first :data:`MAX_ITEMS` items and counts the rest, each string its first :data:`MAX_CHARS`
characters, and once :data:`BUDGET_CHARS` characters of strings and keys are spent the remaining
items are counted instead of shown. An error answer stays under about 8 KB.

Left-out items are counted where they were: an object gets the key :data:`MORE` (``"…"``) with the
number of keys left out, a list ends with the string ``"… N more"``, a cut string with
``"… (N characters)"``.
"""
from __future__ import annotations

import itertools
from typing import Any

#: Items of a list, or keys of an object, kept at each level; the rest are counted.
MAX_ITEMS = 10
#: Characters kept of one string (the message, a field's error, a name sent back).
MAX_CHARS = 1000
#: Characters of strings and keys an answer's ``extra`` shows in all.
BUDGET_CHARS = 4000
#: The key counting an object's left-out keys, and the start of a list's last item when it counts.
MORE = "…"
#: What a number, a boolean, null and each item's punctuation count against the budget.
_ITEM_CHARS = 8


def bounded(value: Any, *, budget: int = BUDGET_CHARS) -> Any:
    """``value`` (JSON-like: dicts, lists, tuples, strings, scalars) cut as the module says; the
    input is left as it was. Strings that are not cut are returned as they are (DRF's
    ``ErrorDetail`` keeps its code)."""
    return _cut(value, [budget])


def bounded_error(body: Any) -> Any:
    """An error body ``{"message", "code", "extra"}`` with its message cut to :data:`MAX_CHARS`
    characters and each value of its ``extra`` cut as :func:`bounded` cuts (one budget for all;
    ``extra``'s own keys are the service's, never the request's, so all of them stay); any other
    value as it is."""
    if not isinstance(body, dict) or "message" not in body:
        return body
    out = dict(body)
    if isinstance(out["message"], str):
        out["message"] = _text(out["message"], [0])
    extra = out.get("extra")
    if isinstance(extra, dict):  # its keys are the service's own (a 429 has 20): each kept, its value cut
        left = [BUDGET_CHARS]
        out["extra"] = {key: _cut(item, left) for key, item in extra.items()}
    elif extra is not None:
        out["extra"] = bounded(extra)
    return out


def _cut(value: Any, left: list[int]) -> Any:
    if isinstance(value, dict):
        out = {}
        for i, (key, item) in enumerate(itertools.islice(value.items(), MAX_ITEMS + 1)):
            if i == MAX_ITEMS or left[0] <= 0:
                out[MORE] = len(value) - i
                break
            out[_text(str(key), left)] = _cut(item, left)
        return out
    if isinstance(value, (list, tuple)):
        out = []
        for i, item in enumerate(itertools.islice(value, MAX_ITEMS + 1)):
            if i == MAX_ITEMS or left[0] <= 0:
                out.append(f"{MORE} {len(value) - i} more")
                break
            out.append(_cut(item, left))
        return out
    if isinstance(value, str):
        return _text(value, left)
    left[0] -= _ITEM_CHARS
    return value


def _text(s: str, left: list[int]) -> str:
    cut = s if len(s) <= MAX_CHARS else f"{s[:MAX_CHARS]}{MORE} ({len(s)} characters)"
    left[0] -= len(cut) + _ITEM_CHARS
    return cut
