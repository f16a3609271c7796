"""``include=vector`` in the API's answers: the query fields that ask for stored vectors
(``include``, ``vector_format``), their schema, and the fields that render an image's vector in the
active embedding space. Shared by the image and search endpoints (exports take ``vector_format``)."""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema_field
from rest_framework import serializers

from embeddings.api.form_input import FormSerializer
from embeddings.services.exports.formats import vector_json

#: Extra fields an answer can include on request (``include``, comma-separated): ``vector``, the
#: image's stored vector in the searched / active embedding space.
INCLUDE_CHOICES = ("vector",)

INCLUDE_HELP = ("extra fields, comma-separated: `vector` adds each image's stored vector (in the active "
                "embedding space, `vector_model_id`; null when it has none there yet)")

VECTOR_FORMAT_HELP = ("how `vector` is written: `float` (default), a list of D numbers (each the float32 "
                      "value's shortest float64 form: read back as float32 it is the stored value, bit for "
                      "bit), or `base64`, the little-endian float32 bytes (4 × D bytes, base64)")


class IncludeField(serializers.CharField):
    """``include``: a comma-separated list of :data:`INCLUDE_CHOICES` → a set of them.

    Raises:
        ValidationError: an unknown name (400 ``invalid``, naming the ones there are).
    """

    def __init__(self, **kwargs):
        super().__init__(required=False, allow_blank=True, max_length=200, help_text=INCLUDE_HELP, **kwargs)

    def to_internal_value(self, data):
        names = {n.strip() for n in super().to_internal_value(data).split(",") if n.strip()}
        unknown = sorted(names - set(INCLUDE_CHOICES))
        if unknown:
            raise serializers.ValidationError(
                f"unknown include {', '.join(unknown)}: one of {', '.join(INCLUDE_CHOICES)}")
        return names


class VectorQuerySerializer(FormSerializer):
    """``include`` and ``vector_format`` of a request that can answer stored vectors (query
    parameters of ``GET /api/images/``, ``GET /api/images/{id}/``; fields of a search)."""

    include = IncludeField()
    vector_format = serializers.ChoiceField(choices=["float", "base64"], default="float", help_text=VECTOR_FORMAT_HELP)


#: The query parameters of the image endpoints that can answer vectors (``VectorQuerySerializer``).
VECTOR_PARAMETERS = [
    OpenApiParameter("include", str, OpenApiParameter.QUERY, enum=list(INCLUDE_CHOICES), description=INCLUDE_HELP),
    OpenApiParameter("vector_format", str, OpenApiParameter.QUERY, enum=["float", "base64"],
                     description=VECTOR_FORMAT_HELP),
]

#: The schema of a vector in an answer: a list of numbers, base64 text, or null (no vector yet).
VECTOR_SCHEMA = {
    "oneOf": [{"type": "array", "items": {"type": "number", "format": "float"}},
              {"type": "string", "format": "byte"}],
    "nullable": True,
    "description": "the stored vector (D float32, unit length): a list of numbers (vector_format=float) or "
                   "base64 of its little-endian float32 bytes (vector_format=base64); null: the image has no "
                   "vector in that space yet (not embedded, failed, or embedded only before a model switch "
                   "and not re-embedded yet). Present only with include=vector",
}


class VectorView:
    """What ``include=vector`` renders, given to a serializer as ``context["vectors"]``: the space
    (``model_id``), ``vector_format`` and the vectors by image id (``{str: (D,) float32}``;
    ``services.vectors.image_vectors``)."""

    def __init__(self, *, model_id: str, vector_format: str, vectors: dict) -> None:
        self.model_id, self.vector_format, self.vectors = model_id, vector_format, vectors

    def render(self, image_id: str):
        """The image's vector as JSON (``services.exports.vector_json``), None when it has none."""

        v = self.vectors.get(image_id)
        return None if v is None else vector_json(v, self.vector_format)


class _Included(serializers.Field):
    """A field shown only when the serializer's context holds ``vectors`` (``include=vector``):
    otherwise left out of the answer altogether (not null), so answers without it stay as they were."""

    def __init__(self, **kwargs):
        super().__init__(source="*", required=False, **kwargs)

    def get_attribute(self, instance):
        view = self.context.get("vectors")
        if view is None:
            raise serializers.SkipField()
        return (view, str(instance.id))


@extend_schema_field(VECTOR_SCHEMA)
class ImageVectorField(_Included):
    """``vector`` of an image (:data:`VECTOR_SCHEMA`)."""

    def __init__(self, **kwargs):
        super().__init__(allow_null=True, **kwargs)

    def to_representation(self, value):
        view, image_id = value
        return view.render(image_id)


@extend_schema_field({"type": "string", "description": "the embedding space `vector` is in (the active one). "
                                                       "Present only with include=vector"})
class VectorModelIdField(_Included):
    """``vector_model_id`` of an image: the space of its ``vector``."""

    def to_representation(self, value):
        return value[0].model_id
