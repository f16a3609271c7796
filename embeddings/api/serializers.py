"""Input validation for the API (views validate, call one service, serialise the result)."""
from __future__ import annotations

import math
import uuid

from django.conf import settings
from django.core.validators import RegexValidator
from drf_spectacular.utils import OpenApiParameter, PolymorphicProxySerializer, extend_schema_field
from rest_framework import serializers

from embeddings.api.json_input import JSONField
from embeddings.api.webhook_fields import CallbackUrlsField, WebhookCreatedSerializer, WebhookSerializer
from embeddings.models import Image, ImageStatus, Job, JobPriority, WebhookEvent
from embeddings.services.interactive.examples import MAX_EXAMPLES
from embeddings.services.interactive.search import MAX_CANDIDATES
from workers.vector_store import DEFAULT_STRATEGY, STRATEGIES


class FormSerializer(serializers.Serializer):
    """A serializer of form fields (multipart or urlencoded) in which an empty value is refused like
    any other wrong one: DRF alone reads ``k=`` as "not sent" and uses the default, so a value the
    schema says is an integer, a uuid or a date-time would pass when blank.

    Raises:
        ValidationError: ``{field: ["This field may not be blank."]}`` (400 ``invalid``).
    """

    def to_internal_value(self, data):
        if hasattr(data, "getlist"):  # a QueryDict: multipart or urlencoded
            blank = {name: ["This field may not be blank."] for name, field in self.fields.items()
                     if not field.read_only and not getattr(field, "allow_blank", False)
                     and "" in data.getlist(name)}
            if blank:
                raise serializers.ValidationError(blank)
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """A boolean as the schema says one is: JSON ``true`` / ``false``, or in a form, multipart part
    or query string the text ``true`` / ``false`` (any case: form encoders write Python's ``True``).
    DRF's own field also takes ``1``, ``0``, ``"yes"``, ``"off"``, ``"t"`` ... which the schema
    (``type: boolean``) does not allow: a client sending one has made a mistake it should hear about.

    Raises:
        ValidationError: ``"Must be a valid boolean."`` (400 ``invalid``).
    """

    def to_internal_value(self, data):
        if isinstance(data, bool):
            return data
        if isinstance(data, str) and data.lower() in ("true", "false"):
            return data.lower() == "true"
        self.fail("invalid", input=data)


class UploadQuerySerializer(FormSerializer):
    """Fields of ``POST /api/images/`` besides the files."""

    k = serializers.IntegerField(min_value=0, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    deadline = serializers.FloatField(required=False, help_text="seconds; may shorten the default, not lengthen it")


class JobCreateSerializer(FormSerializer):
    """Fields of ``POST /api/jobs/`` besides the files / zip / manifest file."""

    name = serializers.CharField(required=False, allow_blank=True, max_length=200, default="")
    priority = serializers.ChoiceField(choices=JobPriority.choices, default=JobPriority.BACKGROUND)
    deadline = serializers.DateTimeField(required=False, allow_null=True, default=None)
    folder = serializers.CharField(required=False, help_text="server-side folder (staff only)")
    manifest_key = serializers.CharField(
        required=False, max_length=2048,
        help_text="a manifest (CSV, JSON Lines or Parquet) in object storage: s3://bucket/key of a bucket in "
                  "SOURCE_BUCKETS; one row per image: url or key, optional external_id, other columns metadata")
    prefix = serializers.CharField(required=False, max_length=2048,
                                   help_text="every object under s3://bucket/prefix (a bucket in SOURCE_BUCKETS)")
    extensions = serializers.CharField(required=False, max_length=256,
                                       help_text="with prefix: only these name endings, comma-separated (jpg,png)")
    bucket = serializers.CharField(required=False, max_length=2048,
                                   help_text="s3://bucket that a manifest's bare `key` values name objects of "
                                             "(default: the manifest's own bucket)")
    # webhooks (issue 42, docs/webhooks.md): the job's own endpoints
    callback_url = CallbackUrlsField(required=False, help_text="URL(s) that receive this job's events, signed "
                                     "(Standard Webhooks); each one's secret is in the answer's `webhooks`, once")
    callback_events = serializers.ListField(child=serializers.ChoiceField(choices=WebhookEvent.choices),
                                            required=False, max_length=len(WebhookEvent.choices),
                                            help_text="event types the callback URLs receive (default: all)")


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


class VectorExportQuerySerializer(FormSerializer):
    """Query parameters of ``GET /api/exports/vectors.{format}``."""

    job = serializers.UUIDField(required=False, help_text="only this job's images (one of yours; any job for staff)")
    space = serializers.CharField(required=False, max_length=200,
                                  help_text="the embedding space's model_id (default: the active one)")
    vector_format = serializers.ChoiceField(choices=["float", "base64"], default="float",
                                            help_text="JSON Lines only: " + VECTOR_FORMAT_HELP)


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
        """The image's vector as JSON (``services.exports.formats.vector_json``), None when it has none."""
        from embeddings.services.exports.formats import vector_json

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


class SearchSerializer(FormSerializer):
    """``POST /api/search/``: exactly one of ``text``, ``image`` (file) or ``image_id``, or
    ``positive`` (and ``negative``) examples (lists in JSON, their JSON text in a form; checked by
    the view: :func:`examples`); ``filter`` (an object in JSON, its JSON text in a form) is
    validated by the view (``invalid_filter``)."""

    filter = JSONField(required=False)
    positive = JSONField(required=False)
    negative = JSONField(required=False)
    strategy = serializers.ChoiceField(choices=STRATEGIES, required=False)
    diversity = serializers.FloatField(min_value=0.0, max_value=1.0, default=0.0)
    candidates = serializers.IntegerField(min_value=1, max_value=MAX_CANDIDATES, required=False)

    def validate_diversity(self, value: float) -> float:
        if not math.isfinite(value):  # "nan" in a form passes both bounds
            raise serializers.ValidationError("diversity must be a number in [0, 1]")
        return value

    text = serializers.CharField(required=False, max_length=2000)
    image = serializers.FileField(required=False)
    image_id = serializers.UUIDField(required=False)
    k = serializers.IntegerField(min_value=1, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    job_id = serializers.UUIDField(required=False)
    min_score = serializers.FloatField(required=False, min_value=-1.0, max_value=1.0)
    include = IncludeField()
    vector_format = serializers.ChoiceField(choices=["float", "base64"], default="float")


#: ``min_score`` of a search (embeddings/services/lifecycle/cutoff.py): hits scoring below it are dropped.
MIN_SCORE_HELP = ("cosine in [-1, 1]; hits scoring below it are dropped. Default: the searched space's "
                  "calibrated cutoff for the query kind (text, or image / image_id); 0 switches the cutoff off")


class ImageSerializer(serializers.ModelSerializer):
    """Read-only image representation."""

    thumbnail_url = serializers.SerializerMethodField(
        help_text="JPEG thumbnail (256 px on the long side) once the image is embedded; null before")
    duplicate_of = serializers.SerializerMethodField(
        help_text="a skipped upload: the id of the caller's image with the same bytes, whose vector it shares")

    pending_external_id = serializers.SerializerMethodField(
        help_text="an external_id another of your images holds, which this one takes once its bytes are "
                  "fetched (the same bytes leave it where it is); null when none")
    vector = ImageVectorField()
    vector_model_id = VectorModelIdField()

    class Meta:
        model = Image
        fields = ("id", "status", "reason", "reason_detail", "sha256", "size_bytes", "width", "height", "format",
                  "original_name", "lane", "job", "duplicate_of", "created_at", "embedded_at", "thumbnail_url",
                  "external_id", "pending_external_id", "metadata", "origin", "row", "vector", "vector_model_id")
        read_only_fields = fields
        extra_kwargs = {"external_id": {"help_text": "your id for this image (unique among your images); \"\" when none"},
                        "metadata": {"help_text": "your attributes: a JSON object (string, number, boolean, date values)"},
                        "origin": {"help_text": "the URL or s3:// object its bytes were fetched from; \"\" for uploads"},
                        "row": {"help_text": "the manifest row (1-based, header not counted) that made it"}}

    def get_pending_external_id(self, im: Image) -> str | None:
        """The id this row claims (``Image.claimed_external_id``), None when none."""
        return im.claimed_external_id or None

    def get_duplicate_of(self, im: Image) -> uuid.UUID | None:
        """The user's row of the original: a skipped upload made after a model switch can share the
        point of a re-embedded copy (``Image.source``), whose id users never see."""
        if im.duplicate_of_id is None:
            return None
        original = im.duplicate_of
        return original.source_id or original.id

    def get_thumbnail_url(self, im: Image) -> str | None:
        """``/api/images/{id}/thumbnail/`` for an embedded (or skipped duplicate) image, else None."""
        return f"/api/images/{im.id}/thumbnail/" if im.status in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED) else None


class JobSerializer(serializers.ModelSerializer):
    """Read-only job representation (progress is added by the view)."""

    class Meta:
        model = Job
        fields = ("id", "name", "kind", "status", "priority", "deadline", "model_id", "chunk_size", "total",
                  "created_at", "started_at", "finished_at", "source", "reading")
        read_only_fields = fields
        extra_kwargs = {"source": {"help_text": "a manifest or prefix job's source: kind, format, key or uri, "
                                                "rows_read, and error (code, message) when it could not be read"},
                        "reading": {"help_text": "its manifest or prefix is still being read: total still grows"}}


class ImagePatchSerializer(serializers.Serializer):
    """``PATCH /api/images/{id}/``: the caller's id and metadata, changed without re-embedding."""

    external_id = serializers.CharField(required=False, allow_blank=True, allow_null=True, max_length=256,
                                        help_text="your id; \"\" or null removes it")
    metadata = JSONField(required=False, help_text="replaces the whole metadata object")


# --- Request bodies as the schema shows them (the views read the multipart parts themselves) -------
# Limits come from the settings the views enforce, so the schema cannot drift from the service.

class ImageUploadSerializer(UploadQuerySerializer):
    """``POST /api/images/`` (multipart): 1..``INTERACTIVE_MAX_FILES`` image files in ``files``."""

    files = serializers.ListField(
        child=serializers.FileField(), min_length=1, max_length=settings.INTERACTIVE_MAX_FILES,
        help_text=f"image files, one part each (at most INTERACTIVE_MAX_FILES = {settings.INTERACTIVE_MAX_FILES})")
    # not positive: 400 invalid_deadline (services.requests.deadline_for); longer than the default: the default
    deadline = serializers.FloatField(required=False, min_value=0.001,
                                      help_text="seconds; may shorten the default, not lengthen it")
    external_id = serializers.CharField(max_length=256, allow_blank=True, required=False,
                                        help_text="your id of the file, unique among your images; one part per file, "
                                                  "in order, for several (\"\": that file has none); not starting "
                                                  "with { or [")
    metadata = serializers.DictField(required=False,
                                     help_text="a JSON object for every file (its JSON text); repeat the part once "
                                               "per file, in order, to give each its own")


class JobSubmitSerializer(JobCreateSerializer):
    """``POST /api/jobs/`` (multipart): image files, zip archives, or (staff) a server folder; at
    least one of the three."""

    files = serializers.ListField(
        child=serializers.FileField(), required=False, max_length=settings.DATA_UPLOAD_MAX_NUMBER_FILES,
        help_text=f"image files (at most UPLOAD_MAX_FILES = {settings.DATA_UPLOAD_MAX_NUMBER_FILES} parts)")
    zip = serializers.ListField(
        child=serializers.FileField(), required=False, max_length=settings.DATA_UPLOAD_MAX_NUMBER_FILES,
        help_text=f"zip archives of images (at most ZIP_MAX_ENTRIES = {settings.ZIP_MAX_ENTRIES} entries each)")
    manifest = serializers.FileField(required=False, help_text="a manifest (CSV, JSON Lines or Parquet): one row "
                                     "per image, url or key, optional external_id, other columns metadata")
    external_id = serializers.CharField(max_length=256, allow_blank=True, required=False,
                                        help_text="with files: your id of the file; one part per file, in order, "
                                                  "for several (\"\": that file has none); not starting with { or [")
    metadata = serializers.DictField(required=False,
                                     help_text="with files: a JSON object for every file (its JSON text); repeat the "
                                               "part once per file, in order, to give each its own")


#: A text query: not blank, no NUL character (a CharField refuses both).
TEXT_QUERY = RegexValidator(r"^[^\x00]*[^\s\x00][^\x00]*$", "text must not be blank or hold NUL characters")


#: The metadata filter of a search (``workers.vector_store.filters``), applied inside the vector query.
FILTER_HELP = ('metadata filter: {"field": "category", "eq": "shoes"}, {"field": f, "in": [...]}, '
               '{"field": "price", "gte": 10, "lt": 50} (numbers or ISO dates), {"field": f, "exists": true}, '
               'combined with {"and": [...]}, {"or": [...]}, {"not": {...}}; field "external_id" is your id. '
               'In a multipart search: its JSON text. Applied inside the vector query: k results whenever k '
               'images match')


@extend_schema_field({"$ref": "#/components/schemas/MetadataFilter"})
class MetadataFilterField(JSONField):
    """A search's metadata filter (``workers.vector_store.filters``): typed in the schema as the
    ``MetadataFilter`` component (added by ``embeddings.api.schema.postprocess``)."""


#: ``diversity`` of a search (``workers.vector_store.VectorStore.search``).
DIVERSITY_HELP = ("maximal marginal relevance in [0, 1]: 0 (the default) is the plain top-k; above 0 the k are "
                  "picked one by one from the `candidates` best matches, each maximising (1 − diversity)·relevance "
                  "− diversity·(its highest cosine to the hits picked before); 1 picks, after the best match, the "
                  "candidates least like the hits already picked. Scores stay cosines to the query (to the examples' "
                  "average vector in a multi-example search)")
CANDIDATES_HELP = (f"with diversity > 0: the pool of best matches (after every filter) that MMR re-ranks; default "
                   f"max(100, 10·k), at most MAX_CANDIDATES = {MAX_CANDIDATES}, never fewer than k")


class _SearchScope(serializers.Serializer):
    """What every search takes besides its query: how many hits, and an optional job filter."""

    diversity = serializers.FloatField(min_value=0.0, max_value=1.0, default=0.0, help_text=DIVERSITY_HELP)
    candidates = serializers.IntegerField(min_value=1, max_value=MAX_CANDIDATES, required=False,
                                          help_text=CANDIDATES_HELP)

    k = serializers.IntegerField(min_value=1, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    job_id = serializers.UUIDField(required=False, help_text="only images of this job (one of the caller's)")
    min_score = serializers.FloatField(required=False, min_value=-1.0, max_value=1.0, help_text=MIN_SCORE_HELP)
    filter = MetadataFilterField(required=False, help_text=FILTER_HELP)
    include = serializers.CharField(required=False, allow_blank=True, max_length=200,
                                    help_text=INCLUDE_HELP.replace("the active", "the searched"))
    vector_format = serializers.ChoiceField(choices=["float", "base64"], default="float", help_text=VECTOR_FORMAT_HELP)


class SearchTextSerializer(_SearchScope):
    """``POST /api/search/`` by text (JSON)."""

    text = serializers.CharField(max_length=2000, validators=[TEXT_QUERY])


class SearchImageIdSerializer(_SearchScope):
    """``POST /api/search/`` by a stored image (JSON): embedded, one of the caller's (staff: any)."""

    image_id = serializers.UUIDField()


class SearchExampleSerializer(serializers.Serializer):
    """One example of a multi-example search (JSON): exactly one of ``image_id`` or ``text``."""

    image_id = serializers.UUIDField(required=False, help_text="one of your embedded images (left out of the hits)")
    text = serializers.CharField(required=False, max_length=2000, validators=[TEXT_QUERY])


STRATEGY_HELP = ("how the examples score a point, Qdrant's strategies: best_score (default): its best cosine to a "
                 "positive when that beats its best cosine to a negative, mapped into (0, 1) as (x/(1+|x|)+1)/2, "
                 "else minus that of its best negative cosine; sum_scores: Σ cosines to the positives − Σ cosines "
                 "to the negatives; average_vector: the cosine to 2·mean(positives) − mean(negatives)")
EXAMPLES_HELP = f"at most MAX_EXAMPLES = {MAX_EXAMPLES} examples, positive and negative together"


class SearchExamplesSerializer(_SearchScope):
    """``POST /api/search/`` by positive and negative examples (JSON): stored images and texts."""

    positive = SearchExampleSerializer(many=True, help_text=f"at least one; {EXAMPLES_HELP}")
    negative = SearchExampleSerializer(many=True, required=False, help_text="pushed away (default: none)")
    strategy = serializers.ChoiceField(choices=STRATEGIES, default=DEFAULT_STRATEGY, help_text=STRATEGY_HELP)


class SearchImageSerializer(_SearchScope):
    """``POST /api/search/`` as a form (multipart): by an uploaded ``image``, or by examples, some of
    them uploaded images (``positive_image`` / ``negative_image`` parts). Exactly one of the two:
    both, or neither, is 400 ``invalid_query``. One object rather than a ``oneOf``, so that clients
    generated from the schema send its file parts as files."""

    image = serializers.FileField(required=False, help_text="the query image (a search by one image)")
    positive = serializers.CharField(required=False, help_text="JSON text of a list of examples ({\"image_id\"} or "
                                                               "{\"text\"}); the positive_image files join them")
    negative = serializers.CharField(required=False, help_text="JSON text of a list of examples, as positive")
    positive_image = serializers.ListField(child=serializers.FileField(), required=False,
                                           help_text="uploaded positive examples, one part each")
    negative_image = serializers.ListField(child=serializers.FileField(), required=False,
                                           help_text="uploaded negative examples, one part each")
    # no default here: a client generated from the schema sends every default, and a strategy on a
    # search by one image is refused (invalid_query); the view applies DEFAULT_STRATEGY
    strategy = serializers.ChoiceField(choices=STRATEGIES, required=False, help_text=STRATEGY_HELP)


#: Exactly one of ``text`` or ``image_id`` in a JSON search (both, or neither: 400 ``invalid_query``),
#: or ``positive`` / ``negative`` examples.
SearchQuerySerializer = PolymorphicProxySerializer(
    component_name="SearchQuery", serializers=[SearchTextSerializer, SearchImageIdSerializer, SearchExamplesSerializer],
    resource_type_field_name=None)

#: A multipart search: an uploaded ``image``, or examples with uploaded images.
SearchFormSerializer = SearchImageSerializer


# --- Responses ------------------------------------------------------------------------------------

class ErrorSerializer(serializers.Serializer):
    """The one error shape (``embeddings.api.errors``): a stable ``code`` and facts in ``extra``."""

    message = serializers.CharField()
    code = serializers.CharField(help_text="stable reason code: not_found, invalid, overloaded, ...")
    extra = serializers.DictField(help_text="facts of the refusal (limit names and values, fields)")


@extend_schema_field({"oneOf": VECTOR_SCHEMA["oneOf"],
                      "description": "a search with include=vector: the hit's stored vector in the searched "
                                     "space (the answer's model_id): a list of numbers, or base64 of "
                                     "little-endian float32 (vector_format=base64)"})
class SearchVectorField(serializers.JSONField):
    """``vector`` of a search hit, shown only with ``include=vector`` (the view writes it)."""

    def __init__(self, **kwargs):
        super().__init__(required=False, **kwargs)


class NeighbourSerializer(serializers.Serializer):
    """One search hit (``embeddings.selectors``): cosine score in [-1, 1]."""

    image_id = serializers.UUIDField()
    score = serializers.FloatField()
    sha256 = serializers.CharField()
    original_name = serializers.CharField(allow_blank=True)
    job_id = serializers.UUIDField(allow_null=True)
    thumbnail_url = serializers.CharField(allow_null=True)
    external_id = serializers.CharField(allow_null=True, required=False, help_text="your id for it")
    metadata = serializers.DictField(required=False, help_text="your attributes")
    vector = SearchVectorField()


class UploadedImageSerializer(serializers.Serializer):
    """One entry of an upload's answer (``services.requests.image_view``)."""

    id = serializers.UUIDField()
    status = serializers.ChoiceField(choices=ImageStatus.choices)
    reason = serializers.CharField(allow_null=True, help_text="reason code when refused (workers/errors.py)")
    detail = serializers.CharField(allow_null=True)
    sha256 = serializers.CharField()
    width = serializers.IntegerField(allow_null=True)
    height = serializers.IntegerField(allow_null=True)
    original_name = serializers.CharField(allow_blank=True)
    raw_name = serializers.CharField(required=False, help_text="the file name as sent, when it was replaced")
    job_id = serializers.UUIDField(allow_null=True)
    url = serializers.CharField(help_text="GET it for the status")
    thumbnail_url = serializers.CharField(allow_null=True)
    neighbours = NeighbourSerializer(many=True, required=False,
                                     help_text="top-k among the caller's images; absent when not embedded in time")


class UploadResponseSerializer(serializers.Serializer):
    """``POST /api/images/``: one entry per file part, in order."""

    images = UploadedImageSerializer(many=True)
    deadline_s = serializers.FloatField(help_text="the deadline applied, seconds")


class RenamedSerializer(serializers.Serializer):
    """A file whose name was replaced (``upload-N`` / ``entry-N``), with the name as sent."""

    name = serializers.CharField()
    raw_name = serializers.CharField(allow_blank=True)


class JobCreatedSerializer(serializers.Serializer):
    """``POST /api/jobs/`` (202): follow ``url``."""

    id = serializers.UUIDField()
    total = serializers.IntegerField(min_value=0, help_text="images so far (0 for a manifest or prefix: it grows "
                                                             "while `reading`)")
    url = serializers.CharField()
    renamed = RenamedSerializer(many=True, help_text="files whose name was replaced")
    reading = serializers.BooleanField(required=False, help_text="a manifest or prefix job: read by the fetch worker")
    webhooks = WebhookCreatedSerializer(many=True, required=False,
                                        help_text="the job's own webhook endpoints (`callback_url`), with their "
                                                  "secrets: shown this once")


class FailureSerializer(serializers.Serializer):
    """A failed image of a job, with its reason code (``workers/errors.py``)."""

    id = serializers.UUIDField()
    original_name = serializers.CharField(allow_blank=True)
    reason = serializers.CharField(allow_blank=True)
    reason_detail = serializers.CharField(allow_blank=True)
    row = serializers.IntegerField(allow_null=True, help_text="its manifest row, when a manifest made it")
    origin = serializers.CharField(allow_blank=True, help_text="the URL or object it was fetched from")


class JobProgressSerializer(JobSerializer):
    """``GET /api/jobs/{id}/`` (``services.jobs.job_progress``)."""

    counts = serializers.DictField(child=serializers.IntegerField(), help_text="images per status")
    embedded = serializers.IntegerField()
    skipped = serializers.IntegerField()
    failed = serializers.IntegerField()
    finished = serializers.IntegerField()
    elapsed_s = serializers.FloatField()
    throughput_images_per_s = serializers.FloatField(allow_null=True, help_text="images/s")
    eta = serializers.DateTimeField(allow_null=True)
    at_risk = serializers.BooleanField(help_text="the ETA is past the deadline")
    failures = FailureSerializer(many=True)
    failure_reasons = serializers.DictField(child=serializers.IntegerField(),
                                            help_text="failed images per reason code (fetch_timeout, not_an_image, ...)")
    timings_ms = serializers.DictField(help_text="per stage: min / avg / max / p95 / per_image_avg, ms")
    batches = serializers.IntegerField()
    utilisation = serializers.DictField(help_text="CPU % / GPU % / GPU MiB while its chunks ran")
    pipeline = serializers.DictField(help_text="the settings it ran with")
    webhooks = WebhookSerializer(many=True, required=False, help_text="the job's own webhook endpoints "
                                 "(`callback_url`; account endpoints hear it too: `GET /api/webhooks/`)")

    class Meta(JobSerializer.Meta):
        fields = JobSerializer.Meta.fields + (
            "counts", "embedded", "skipped", "failed", "finished", "elapsed_s", "throughput_images_per_s", "eta",
            "at_risk", "failures", "failure_reasons", "timings_ms", "batches", "utilisation", "pipeline", "webhooks")
        read_only_fields = fields


class SearchResponseSerializer(serializers.Serializer):
    """``POST /api/search/``: at most ``k`` hits, best first."""

    results = NeighbourSerializer(many=True)
    k = serializers.IntegerField()
    model_id = serializers.CharField(help_text="the embedding space searched (its scores and cutoffs are its own)")
    min_score = serializers.FloatField(allow_null=True, help_text="the cutoff applied; null: none")
    min_score_source = serializers.ChoiceField(
        choices=["calibrated", "request", "uncalibrated"],
        help_text="calibrated: the space's cutoff for this query kind; request: the caller's min_score "
                  "(0: off); uncalibrated: the space has no cutoff yet, nothing was cut")
    message = serializers.CharField(required=False, help_text='"no match above the cutoff" when the cutoff left '
                                                              'no hit (still 200, results empty)')
    strategy = serializers.ChoiceField(choices=STRATEGIES, required=False,
                                       help_text="a search by examples: the strategy that scored it (its scores are "
                                                 "that strategy's; only a min_score you give cuts them)")


class StatsSerializer(serializers.Serializer):
    """``GET /api/stats/`` (staff); the store adds its own facts next to ``points``."""

    images = serializers.DictField(child=serializers.IntegerField(), help_text="images per status")
    distinct_embedded = serializers.IntegerField()
    collection = serializers.CharField(help_text="the active embedding space's vector store collection")
    points = serializers.IntegerField(help_text="points in the collection")
    model_id = serializers.CharField(help_text="the active embedding space")
    spaces = serializers.ListField(child=serializers.DictField(), help_text="every embedding space: model_id, state, "
                                   "collection, embedded_rows (its rows, migration copies included)")
    lanes = serializers.DictField(help_text="per lane: stage min / avg / max / p95 over its last batches")
