"""Input validation for the API (views validate, call one service, serialise the result)."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.core.validators import RegexValidator
from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema_field
from rest_framework import serializers

from embeddings.models import Image, ImageStatus, Job, JobPriority


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


class SearchSerializer(FormSerializer):
    """``POST /api/search/``: exactly one of ``text``, ``image`` (file) or ``image_id``; ``filter``
    (an object in JSON, its JSON text in a form) is validated by the view (``invalid_filter``)."""

    filter = serializers.JSONField(required=False)

    text = serializers.CharField(required=False, max_length=2000)
    image = serializers.FileField(required=False)
    image_id = serializers.UUIDField(required=False)
    k = serializers.IntegerField(min_value=1, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    job_id = serializers.UUIDField(required=False)
    min_score = serializers.FloatField(required=False, min_value=-1.0, max_value=1.0)


#: ``min_score`` of a search (embeddings/services/lifecycle/cutoff.py): hits scoring below it are dropped.
MIN_SCORE_HELP = ("cosine in [-1, 1]; hits scoring below it are dropped. Default: the searched space's "
                  "calibrated cutoff for the query kind (text, or image / image_id); 0 switches the cutoff off")


class ImageSerializer(serializers.ModelSerializer):
    """Read-only image representation."""

    thumbnail_url = serializers.SerializerMethodField(
        help_text="WebP thumbnail (256 px on the long side) once the image is embedded; null before")
    duplicate_of = serializers.SerializerMethodField(
        help_text="a skipped upload: the id of the caller's image with the same bytes, whose vector it shares")

    pending_external_id = serializers.SerializerMethodField(
        help_text="an external_id another of your images holds, which this one takes once its bytes are "
                  "fetched (the same bytes leave it where it is); null when none")

    class Meta:
        model = Image
        fields = ("id", "status", "reason", "reason_detail", "sha256", "size_bytes", "width", "height", "format",
                  "original_name", "lane", "job", "duplicate_of", "created_at", "embedded_at", "thumbnail_url",
                  "external_id", "pending_external_id", "metadata", "origin", "row")
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
    metadata = serializers.JSONField(required=False, help_text="replaces the whole metadata object")


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
class MetadataFilterField(serializers.JSONField):
    """A search's metadata filter (``workers.vector_store.filters``): typed in the schema as the
    ``MetadataFilter`` component (added by ``embeddings.api.schema.postprocess``)."""


class _SearchScope(serializers.Serializer):
    """What every search takes besides its query: how many hits, and an optional job filter."""

    k = serializers.IntegerField(min_value=1, max_value=settings.SEARCH_MAX_K, default=settings.SEARCH_DEFAULT_K)
    job_id = serializers.UUIDField(required=False, help_text="only images of this job (one of the caller's)")
    min_score = serializers.FloatField(required=False, min_value=-1.0, max_value=1.0, help_text=MIN_SCORE_HELP)
    filter = MetadataFilterField(required=False, help_text=FILTER_HELP)


class SearchTextSerializer(_SearchScope):
    """``POST /api/search/`` by text (JSON)."""

    text = serializers.CharField(max_length=2000, validators=[TEXT_QUERY])


class SearchImageIdSerializer(_SearchScope):
    """``POST /api/search/`` by a stored image (JSON): embedded, one of the caller's (staff: any)."""

    image_id = serializers.UUIDField()


class SearchImageSerializer(_SearchScope):
    """``POST /api/search/`` by an uploaded image (multipart)."""

    image = serializers.FileField()


#: Exactly one of ``text`` or ``image_id`` in a JSON search (both, or neither: 400 ``invalid_query``).
SearchQuerySerializer = PolymorphicProxySerializer(
    component_name="SearchQuery", serializers=[SearchTextSerializer, SearchImageIdSerializer],
    resource_type_field_name=None)


# --- Responses ------------------------------------------------------------------------------------

class ErrorSerializer(serializers.Serializer):
    """The one error shape (``embeddings.api.errors``): a stable ``code`` and facts in ``extra``."""

    message = serializers.CharField()
    code = serializers.CharField(help_text="stable reason code: not_found, invalid, overloaded, ...")
    extra = serializers.DictField(help_text="facts of the refusal (limit names and values, fields)")


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

    class Meta(JobSerializer.Meta):
        fields = JobSerializer.Meta.fields + (
            "counts", "embedded", "skipped", "failed", "finished", "elapsed_s", "throughput_images_per_s", "eta",
            "at_risk", "failures", "failure_reasons", "timings_ms", "batches", "utilisation", "pipeline")
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
