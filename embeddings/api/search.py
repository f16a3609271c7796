"""``POST /api/search/``: top-k of the caller's images (staff: all) by a text, an uploaded image, a
stored image's id, or by positive and negative examples of those kinds, with a metadata filter and
optional diversity (docs/search.md); its request and answer shapes."""
from __future__ import annotations

import math
import uuid as _uuid
from collections.abc import Mapping

from django.conf import settings
from django.core.validators import RegexValidator
from drf_spectacular.utils import (
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_field,
)
from rest_framework import serializers
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings import spaces
from embeddings.api.catalogue_fields import search_filter
from embeddings.api.form_input import FormSerializer
from embeddings.api.json_input import JSONField
from embeddings.api.parsers import DrfMultiPartParser as MultiPartParser
from embeddings.api.parsers import JSONParser
from embeddings.api.request_body import check_parts, parsed, uploaded_files
from embeddings.api.schema import RETRY_AFTER, errors
from embeddings.api.vector_fields import (
    INCLUDE_HELP,
    VECTOR_FORMAT_HELP,
    VECTOR_SCHEMA,
    IncludeField,
)
from embeddings.errors import ApplicationError
from embeddings.messages import decode_vector
from embeddings.services.catalogue.sources import from_uploads
from embeddings.services.interactive import examples as example_services
from embeddings.services.interactive import search as search_services
from embeddings.services.interactive.examples import MAX_EXAMPLES
from embeddings.services.interactive.search import MAX_CANDIDATES
from embeddings.services.lifecycle import cutoff
from embeddings.services.usage.keys import key_prefix_of
from workers.vector_store import DEFAULT_STRATEGY, STRATEGIES


class SearchSerializer(FormSerializer):
    """``POST /api/search/``: exactly one of ``text``, ``image`` (file) or ``image_id``, or
    ``positive`` (and ``negative``) examples (lists in JSON, their JSON text in a form; checked by
    the view: :func:`parse_examples`); ``filter`` (an object in JSON, its JSON text in a form) is
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


#: The file parts a search reads: the query image, or uploaded examples.
SEARCH_FILES = ("image", "positive_image", "negative_image")


def parse_examples(value, side: str) -> list[dict]:
    """A search's ``positive`` / ``negative`` list (JSON, or its JSON text in a form, parsed by the
    serializer) → ``[{"image_id": str} | {"text": str}]``.

    Raises:
        ApplicationError: ``too_many_examples`` (400: more than ``MAX_EXAMPLES``, before any item
            is read), ``invalid_example`` (400, ``extra.example``: ``"positive[3]"``): not a list,
            or an item that is not an object with exactly one of ``image_id`` (a UUID) or ``text``
            (not blank, at most 2,000 characters, no NUL).
    """

    if value is None:
        return []
    if not isinstance(value, list):
        raise ApplicationError(f"{side} must be a list of examples", code="invalid_example", extra={"example": side})
    if len(value) > example_services.MAX_EXAMPLES:
        raise ApplicationError(f"{len(value)} {side} examples; at most MAX_EXAMPLES = {example_services.MAX_EXAMPLES}",
                               code="too_many_examples", extra={"limit": "MAX_EXAMPLES",
                                                                "value": example_services.MAX_EXAMPLES})
    out = []
    for i, item in enumerate(value):
        where = f"{side}[{i}]"
        if not isinstance(item, dict) or len(item) != 1 or not ({"image_id", "text"} & set(item)):
            raise ApplicationError(f"{where}: an object with exactly one of image_id or text", code="invalid_example",
                                   extra={"example": where})
        if "image_id" in item:
            try:
                out.append({"image_id": str(_uuid.UUID(str(item["image_id"])))})
            except (ValueError, TypeError, AttributeError):
                raise ApplicationError(f"{where}: image_id is not a UUID", code="invalid_example",
                                       extra={"example": where}) from None
            continue
        text = item["text"]
        if not isinstance(text, str) or not text.strip() or "\x00" in text or len(text) > 2000:
            raise ApplicationError(f"{where}: text must be a non-blank string of at most 2000 characters, no NUL",
                                   code="invalid_example", extra={"example": where})
        out.append({"text": text})
    return out


class SearchView(APIView):
    """``POST /api/search/``: by text, by an uploaded image, by a stored image's id, or by positive
    and negative examples of those kinds."""

    required_scope = "search"

    parser_classes = (MultiPartParser, FormParser, JSONParser)

    @extend_schema(
        operation_id="search",
        request={"application/json": SearchQuerySerializer, "multipart/form-data": SearchFormSerializer},
        parameters=[RETRY_AFTER],
        description="Top-k of the caller's images (staff: all) by exactly one of a text, an uploaded image "
                    "(multipart) or a stored image's id; or by `positive` (and `negative`) examples, each a stored "
                    "image's id, a text or (multipart) an uploaded image, scored by `strategy`. Any search may ask "
                    "for diverse results (`diversity`, `candidates`). docs/search.md.",
        responses={200: SearchResponseSerializer, **errors(400, 404, 409, 413, 415, 422, 429, 503, 504)})
    def post(self, request):
        data, files = parsed(request)
        check_parts({}, files, file_fields=SEARCH_FILES)
        # multipart is the image's form (the schema's SearchForm): a text or an id alone goes as JSON
        multipart = request.content_type.startswith("multipart/")
        # a JSON body that is not an object (null, a number, a list) is the serializer's 400 below
        by_examples = (isinstance(data, Mapping) and any(f in data for f in ("positive", "negative"))) or any(
            f in files for f in ("positive_image", "negative_image"))
        if multipart and "image" not in files and not by_examples:
            raise ApplicationError("a multipart search carries the image file part 'image' (or examples); search by "
                                   "text or image_id with a JSON body", code="invalid_query", status=400,
                                   extra={"fields": ["image"]})
        s = SearchSerializer(data=data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        single = [f for f in ("text", "image_id") if v.get(f) is not None] + (["image"] if "image" in files else [])
        if by_examples and single:
            raise ApplicationError("give either text, image or image_id, or positive/negative examples, not both",
                                   code="invalid_query", extra={"fields": single + ["positive"]})
        if not by_examples and v.get("strategy") is not None:
            raise ApplicationError("strategy applies to a search by positive/negative examples",
                                   code="invalid_query", extra={"fields": ["strategy"]})
        if by_examples:
            positive = parse_examples(v.get("positive"), "positive")
            negative = parse_examples(v.get("negative"), "negative")
            uploads = {side: uploaded_files(files, f"{side}_image") for side in ("positive", "negative")}
            total = len(positive) + len(negative) + sum(len(u) for u in uploads.values())
            if total > example_services.MAX_EXAMPLES:
                raise ApplicationError(f"{total} examples; at most MAX_EXAMPLES = {example_services.MAX_EXAMPLES}",
                                       code="too_many_examples", extra={"limit": "MAX_EXAMPLES",
                                                                        "value": example_services.MAX_EXAMPLES})
        where = search_filter(data.get("filter") if hasattr(data, "get") else None)  # refused before any bytes are kept

        space = spaces.active()  # the space this search reads (cached: the one search() uses)
        with_vectors = "vector" in v.get("include", set())
        scope = dict(user=request.user, k=v["k"], job_id=str(v["job_id"]) if v.get("job_id") else None, where=where,
                     with_vectors=with_vectors, diversity=v["diversity"], candidates=v.get("candidates"),
                     key_prefix=key_prefix_of(request))
        if by_examples:
            for side, found in uploads.items():
                (positive if side == "positive" else negative).extend({"image": src} for src in from_uploads(found))
            strategy = v.get("strategy") or DEFAULT_STRATEGY
            results = example_services.search_examples(positive=positive, negative=negative, strategy=strategy,
                                                       **scope)
        else:
            image = from_uploads([v["image"]])[0] if v.get("image") else None
            results = search_services.search(
                text=v.get("text"), image=image, image_id=str(v["image_id"]) if v.get("image_id") else None, **scope)
        if with_vectors and v["vector_format"] == "float":  # the store answers base64

            results = [{**r, "vector": decode_vector(r["vector"]).tolist()} if "vector" in r else r for r in results]
        if by_examples:  # scores of a strategy are not cosines: only a requested min_score cuts
            kept = results if not v.get("min_score") else [r for r in results if r["score"] >= v["min_score"]]
            answer = {"results": kept, "model_id": space.model_id, "min_score": v.get("min_score") or None,
                      "min_score_source": cutoff.REQUEST, "strategy": strategy}
        else:
            answer = cutoff.apply_min_score(results, space=space, kind=cutoff.TEXT if v.get("text") is not None
                                            else cutoff.IMAGE, requested=v.get("min_score"))
        return Response({**answer, "k": v["k"]})
