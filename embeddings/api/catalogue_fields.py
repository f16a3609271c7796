"""Request fields of the caller's catalogue (issue 41): ids and metadata sent with files, search filters.

The views read them from the request and hand services validated values; every refusal is the API's
error shape with a stable code.
"""
from __future__ import annotations

import dataclasses

from django.conf import settings
from rest_framework import serializers

from embeddings.api import json_input
from embeddings.errors import ApplicationError
from embeddings.services.catalogue.metadata import (
    MetadataError,
    check_declared,
    normal_external_id,
    validate_external_id,
    validate_metadata,
)
from embeddings.services.catalogue.reading import declared_types
from embeddings.services.catalogue.sources import SourceFile
from workers.vector_store import filters


class ExternalIdField(serializers.CharField):
    """A caller's ``external_id`` as a request field: its length (``max_length``, 256) is counted in
    the id's stored form (stripped, NFC: ``normal_external_id``), as every other door counts it, so
    an id of 256 characters typed decomposed (``e`` + U+0301 for each ``é``, 512 code points) is
    the id it is and not a too-long one. DRF runs the validators on the internal value; the view
    still hands the service the value as sent (``validate_external_id`` puts it in NFC again)."""

    def to_internal_value(self, data):
        if not isinstance(data, str):  # the schema says a string; DRF's CharField would take 0 as "0"
            self.fail("invalid")
        return normal_external_id(super().to_internal_value(data))


def _getlist(data, name: str) -> list:
    if hasattr(data, "getlist"):
        return data.getlist(name)
    value = data.get(name) if isinstance(data, dict) else None
    return [] if value is None else value if isinstance(value, list) else [value]


def with_identities(data, sources: list[SourceFile]) -> list[SourceFile]:
    """``sources`` with the caller's ``external_id`` (one per file, in order) and ``metadata`` (a
    JSON object for every file, or one per file) from the form fields of the request.

    Raises:
        ApplicationError: ``external_id_count`` / ``metadata_count`` (400: neither none, one (metadata
            only) nor one per file), ``external_id_repeated`` (400), ``external_id_invalid``,
            ``metadata_invalid``, ``metadata_too_large``, ``metadata_too_deep`` (400, ``extra.index``:
            the file's 0-based position).
    """
    ids, metas = _getlist(data, "external_id"), _getlist(data, "metadata")
    n = len(sources)
    if ids and len(ids) != n:
        raise ApplicationError(f"{len(ids)} external_id values for {n} files: give one per file, in order",
                               code="external_id_count", extra={"external_ids": len(ids), "files": n})
    if metas and len(metas) not in (1, n):
        raise ApplicationError(f"{len(metas)} metadata values for {n} files: give one for all, or one per file",
                               code="metadata_count", extra={"metadata": len(metas), "files": n})
    if not ids and not metas:
        return sources
    out, seen = [], set()
    for i, src in enumerate(sources):
        try:
            ext = validate_external_id(ids[i]) if ids and ids[i] != "" else None
            meta = None
            if metas:
                raw = metas[0] if len(metas) == 1 else metas[i]
                try:
                    obj = json_input.loads(raw, field="metadata") if isinstance(raw, (str, bytes)) else raw
                except ValueError as e:
                    raise MetadataError("metadata_invalid", f"not JSON: {e}") from e
                except ApplicationError as e:  # json_too_deep: far deeper than metadata may nest
                    raise MetadataError("metadata_too_deep", e.message) from e
                meta = check_declared(validate_metadata(obj, max_bytes=settings.METADATA_MAX_BYTES), declared_types())
        except MetadataError as e:
            raise ApplicationError(f"file {i}: {e.message}", code=e.code, extra={"index": i}) from e
        if ext is not None and ext in seen:
            raise ApplicationError(f"external_id {ext!r} is given to two files of this request",
                                   code="external_id_repeated", extra={"index": i, "external_id": ext})
        if ext is not None:
            seen.add(ext)
        out.append(dataclasses.replace(src, external_id=ext, metadata=meta))
    return out


def search_filter(value) -> dict | None:
    """The search's metadata filter as JSON (an object, or its JSON text from a form), checked by
    ``workers.vector_store.filters.parse``; None when not given.

    Raises:
        ApplicationError: ``invalid_filter`` (400, ``extra.path``: where in the object);
            ``json_too_deep`` / ``parse_error`` (400) for JSON text ``json_input.loads`` refuses.
    """
    if value is None or value == "":
        return None
    if isinstance(value, (str, bytes)):
        try:
            value = json_input.loads(value, field="filter")
        except ValueError as e:
            raise ApplicationError(f"filter is not JSON: {e}", code="invalid_filter", extra={"path": ""}) from e
    try:
        filters.parse(value)
    except filters.FilterError as e:
        raise ApplicationError(f"filter: {e}", code="invalid_filter", extra={"path": e.path}) from e
    except RecursionError as e:
        raise ApplicationError("filter is nested too deep", code="invalid_filter", extra={"path": ""}) from e
    return value
