"""The JSONL lines of a batch's files: the input read line by line from a byte offset (bounded
memory: one line at a time), what a line's body asks for, and an output or error line as OpenAI's
Batch API writes it (docs/batch-api.md). Shared by validation, the parts and finalisation."""
from __future__ import annotations

import json
import uuid

from embeddings.services.interactive import embed as embed_services


def line_inputs(body: dict) -> int:
    """How many inputs a line's body asks for (its share of a part): a list's length, else 1."""
    value = body.get("input")
    return max(1, len(value)) if isinstance(value, list) else 1


def line_fetches(body: dict) -> bool:
    """Whether a line's body names an image to fetch (an http(s) URL read as an image: the rule of
    ``embed.openai_inputs``)."""
    value = body.get("input")
    strings = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return body.get("modality", "auto") != "text" and any(
        isinstance(x, str) and embed_services.HTTP_URL.fullmatch(x) for x in strings)


def _raw_lines(f, block: int = 1 << 20):
    """The lines of a binary file from where it stands, each with its newline (``f.read`` in blocks:
    Django's ``File`` iterates from byte 0 whatever was sought)."""
    pending = b""
    while True:
        data = f.read(block)
        if not data:
            break
        pending += data
        *whole, pending = pending.split(b"\n")
        for raw in whole:
            yield raw + b"\n"
    if pending:
        yield pending


def iter_lines(f, *, offset: int = 0, size: int | None = None):
    """``(physical line number, byte offset, raw bytes)`` of each non-blank line of a binary file,
    from ``offset`` for ``size`` bytes (the whole rest: None); one line (and a read block) in memory
    at a time. Line numbers count from the offset."""
    f.seek(offset)
    number, pos, end = 0, offset, None if size is None else offset + size
    for raw in _raw_lines(f):
        number += 1
        start = pos
        pos += len(raw)
        if raw.strip():
            yield number, start, raw
        if end is not None and pos >= end:
            break


def result_line(custom_id, *, response: dict | None, error: dict | None) -> bytes:
    """One line of an output or error file (OpenAI's shape): ``{"id": "batch_req_…", "custom_id",
    "response", "error"}`` as compact JSON and a newline."""
    return (json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                        "error": error}, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
