"""The schema class of every API view (``REST_FRAMEWORK["DEFAULT_SCHEMA_CLASS"]``): drf-spectacular's
``AutoSchema`` stating each operation's scope. Its own module: DRF imports it while ``APIView`` is
being made, so it imports no view."""
from __future__ import annotations

from drf_spectacular.openapi import AutoSchema

from embeddings.api.access import required_scope


class ScopedAutoSchema(AutoSchema):
    """``AutoSchema`` with each operation's scope (``embeddings.api.access.HasScope``) as its
    ``x-required-scope`` and a line of its description; ``embeddings.api.schema.postprocess`` adds
    the 403 and 429 a key can meet there."""

    def get_operation(self, *args, **kwargs):
        operation = super().get_operation(*args, **kwargs)
        scope = required_scope(self.view, self.method) if operation is not None else None
        if scope is not None:
            operation["x-required-scope"] = scope
            line = f"Scope: `{scope}` (docs/api-keys.md)."
            operation["description"] = f"{operation['description']}\n\n{line}" if operation.get("description") \
                else line
        return operation
