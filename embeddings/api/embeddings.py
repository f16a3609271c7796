"""Embeddings on demand: ``POST /api/embeddings/`` (this API's shapes, per-input errors, optional
storing) and ``POST /v1/embeddings`` (OpenAI's shapes and errors, for OpenAI clients). Both validate,
call ``services.interactive.embed.embeddings_create`` and serialise (docs/embeddings-api.md).
"""
from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiResponse, PolymorphicProxySerializer, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.parsers import FormParser
from rest_framework.response import Response
from rest_framework.views import APIView

from embeddings.api import json_input
from embeddings.api.access import images_taken, scope_check
from embeddings.api.catalogue_fields import ExternalIdField, with_identities
from embeddings.api.errors import ErrorSerializer, exception_handler
from embeddings.api.form_input import FormSerializer, StrictBooleanField
from embeddings.api.parsers import DrfMultiPartParser as MultiPartParser
from embeddings.api.parsers import JSONParser
from embeddings.api.request_body import check_parts, parsed, uploaded_files
from embeddings.api.schema import ERROR_STATUS, RETRY_AFTER, errors
from embeddings.errors import ApplicationError
from embeddings.messages import decode_vector
from embeddings.services.catalogue.sources import SourceFile, from_uploads
from embeddings.services.interactive import embed as embed_services
from embeddings.services.interactive.upload import deadline_for
from embeddings.services.usage.keys import key_prefix_of

ENCODINGS = ("float", "base64")


# --- shapes ---------------------------------------------------------------------------------------

@extend_schema_field({"oneOf": [{"type": "array", "items": {"type": "number", "format": "float"}},
                                {"type": "string", "format": "byte"}],
                      "description": "encoding_format float: the numbers; base64: the base64 text of the "
                                     "little-endian float32 values (4 bytes each). L2-normalised (unit length)"})
class VectorField(serializers.Field):
    """A vector as its encoding gives it (schema only: views answer plain dicts)."""

    def to_representation(self, value):
        return value

    def to_internal_value(self, data):
        return data


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})
class StringOrListField(serializers.Field):
    """One string or a list of strings, taken as sent (the view checks each entry)."""

    def to_representation(self, value):
        return value

    def to_internal_value(self, data):
        return data


class EmbeddingInputSerializer(serializers.Serializer):
    """One input of ``POST /api/embeddings/``: exactly one of ``text``, ``image``, ``image_url``."""

    text = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False,
                                 help_text=f"a text; the first {embed_services.MAX_TEXT_CHARS} characters are read "
                                           f"(the model reads at most its context length, 77 tokens for CLIP); "
                                           f"an empty one is refused with reason empty")
    image = serializers.CharField(required=False, help_text="an image file's bytes as base64, or a data URL "
                                                            "(data:image/png;base64,...)")
    image_url = serializers.CharField(required=False, max_length=8192,
                                      help_text="an http(s) URL fetched under the FETCH_* rules (timeouts within the "
                                                "deadline, size cap, private and link-local addresses refused), or a "
                                                "data URL")
    external_id = ExternalIdField(required=False, max_length=256,
                                  help_text="with store: your id of this image (as POST /api/images/)")
    metadata = serializers.DictField(required=False, help_text="with store: this image's attributes")


class EmbeddingsOptionsSerializer(FormSerializer):
    """Options of ``POST /api/embeddings/`` (JSON body fields, or form fields beside the files)."""

    encoding_format = serializers.ChoiceField(choices=ENCODINGS, default="float")
    store = StrictBooleanField(default=False, help_text="the images become your images (as POST /api/images/: "
                                                              "ids, external_id, metadata); texts are never stored")
    # not positive: 400 invalid_deadline (upload.deadline_for); longer than the default: the default
    deadline = serializers.FloatField(required=False, min_value=0.001,
                                      help_text="seconds; may shorten the default, not lengthen it")


class EmbeddingsRequestSerializer(EmbeddingsOptionsSerializer):
    """``POST /api/embeddings/`` as JSON."""

    inputs = EmbeddingInputSerializer(many=True, min_length=1, max_length=settings.EMBEDDINGS_MAX_INPUTS,
                                      help_text="1..EMBEDDINGS_MAX_INPUTS inputs; one vector each, in this order")


class EmbeddingsUploadSerializer(EmbeddingsOptionsSerializer):
    """``POST /api/embeddings/`` as multipart: image files, and/or ``inputs`` (the JSON array of the
    JSON body, as text). Files come first, in the order of their parts, then ``inputs``."""

    files = serializers.ListField(child=serializers.FileField(), required=False,
                                  help_text="image files, one part each; inputs 0..F-1 in part order")
    inputs = serializers.CharField(required=False, help_text="a JSON array of inputs (EmbeddingInput), after the files")
    external_id = ExternalIdField(max_length=256, allow_blank=True, required=False,
                                  help_text="with store: one part per file, in order, as POST /api/images/")
    metadata = serializers.DictField(required=False, help_text="with store: a JSON object for every file, or one "
                                                               "part per file, as POST /api/images/")


class EmbeddingSpaceSerializer(serializers.Serializer):
    """The embedding space of the vectors: only vectors of one space compare."""

    id = serializers.CharField(help_text="the space's model id (model/weights/precision): OpenAI's `model`")
    model = serializers.CharField(help_text="the open_clip architecture, e.g. ViT-B-32")
    pretrained = serializers.CharField()
    dimension = serializers.IntegerField()
    precision = serializers.CharField()


class EmbeddingItemSerializer(serializers.Serializer):
    """One input's answer: its vector, or why it has none (``reason``, ``detail``)."""

    index = serializers.IntegerField(help_text="the input's position (0-based)")
    kind = serializers.ChoiceField(choices=("image", "text"))
    embedding = VectorField(required=False)
    tokens = serializers.IntegerField(required=False, help_text="a text: tokens the text tower read")
    reason = serializers.CharField(required=False, help_text="a refused input's stable reason code (invalid_base64, "
                                                             "not_an_image, too_large, empty, fetch_timeout, ...)")
    detail = serializers.CharField(required=False)
    image_id = serializers.UUIDField(required=False, help_text="with store: the image made of it")
    status = serializers.CharField(required=False, help_text="with store: that image's status")


class EmbeddingsResponseSerializer(serializers.Serializer):
    """``POST /api/embeddings/``'s answer: one entry per input, in order."""

    data = EmbeddingItemSerializer(many=True)
    space = EmbeddingSpaceSerializer()
    encoding_format = serializers.ChoiceField(choices=ENCODINGS)
    deadline_s = serializers.FloatField()


#: A 400/413/415/422 of ``POST /api/embeddings/``: every input refused (the answer's own shape), or the
#: request refused as a whole (the error shape).
EMBEDDINGS_REFUSAL = PolymorphicProxySerializer(
    component_name="EmbeddingsRefusal", serializers=[EmbeddingsResponseSerializer, ErrorSerializer],
    resource_type_field_name=None)


class OpenAIEmbeddingRequestSerializer(serializers.Serializer):
    """``POST /v1/embeddings`` (OpenAI's request)."""

    input = StringOrListField(help_text="a string or 1..EMBEDDINGS_MAX_INPUTS strings. A data URL "
                                        "(data:<type>/<subtype>[;...],...) is an image, and so is an http(s) URL "
                                        "with no whitespace; anything else is a text (see modality)")
    model = serializers.CharField(help_text="an embedding space's model id, or its architecture (ViT-B-32)")
    encoding_format = serializers.ChoiceField(choices=ENCODINGS, default="float")
    dimensions = serializers.IntegerField(required=False, min_value=1, help_text="only the space's own dimension")
    user = serializers.CharField(required=False, allow_blank=True, help_text="accepted and ignored")
    modality = serializers.ChoiceField(choices=("auto", "text", "image"), default="auto",
                                       help_text="this service's extension: text reads every string as a text, "
                                                 "image every one as an image (a data URL, a URL, or bare base64)")


class OpenAIEmbeddingSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=("embedding",))
    index = serializers.IntegerField()
    embedding = VectorField()


class OpenAIUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField(help_text="text tokens read plus a fixed count per image (the image "
                                                       "tower's positions: 50 for ViT-B/32)")
    total_tokens = serializers.IntegerField()


class OpenAIEmbeddingListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=("list",))
    data = OpenAIEmbeddingSerializer(many=True)
    model = serializers.CharField()
    usage = OpenAIUsageSerializer()


class OpenAIErrorBodySerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField(help_text="invalid_request_error, authentication_error, permission_error, "
                                           "not_found_error, rate_limit_error, server_error")
    param = serializers.CharField(allow_null=True, help_text="the field at fault (input[3]: the fourth input)")
    code = serializers.CharField(allow_null=True, help_text="this service's stable code (too_many_inputs, "
                                                            "not_an_image, model_not_found, overloaded, ...)")


class OpenAIErrorSerializer(serializers.Serializer):
    """OpenAI's error shape: every error of ``POST /v1/embeddings``."""

    error = OpenAIErrorBodySerializer()


# --- helpers --------------------------------------------------------------------------------------

_count_check = embed_services.inputs_count_check


def _embedding(vector_b64: str, encoding: str):
    return vector_b64 if encoding == "base64" else decode_vector(vector_b64).tolist()


# --- POST /api/embeddings/ ------------------------------------------------------------------------

def _entries(raw, offset: int) -> list[dict]:
    """The ``inputs`` array's entries, checked for shape (each exactly one of text / image / image_url).

    Raises:
        ApplicationError: ``invalid_input`` (400, ``extra.index``: the input's position).
    """
    if raw is None:
        return []
    if isinstance(raw, str):
        try:
            raw = json_input.loads(raw, field="inputs")
        except ValueError as e:
            raise ApplicationError(f"inputs is not JSON: {e}", code="invalid_input", extra={"index": None}) from e
    if not isinstance(raw, list):
        raise ApplicationError("inputs must be an array", code="invalid_input", extra={"index": None})
    out = []
    for j, entry in enumerate(raw):
        i = offset + j
        if not isinstance(entry, dict):
            raise ApplicationError(f"input {i}: an object with text, image or image_url", code="invalid_input",
                                   extra={"index": i})
        kinds = [k for k in ("text", "image", "image_url") if k in entry]  # a null one is given too: refused
        unknown = sorted(set(entry) - set(EmbeddingInputSerializer().fields))
        if len(kinds) != 1 or unknown or not all(isinstance(entry[k], str) for k in kinds):
            why = f"unknown fields {', '.join(unknown)}" if unknown else "exactly one of text, image or image_url, " \
                                                                         "a string"
            raise ApplicationError(f"input {i}: {why}", code="invalid_input", extra={"index": i})
        if kinds[0] == "text" and ("external_id" in entry or "metadata" in entry):
            raise ApplicationError(f"input {i}: a text has no external_id or metadata (texts are never stored)",
                                   code="invalid_input", extra={"index": i})
        out.append(entry)
    return out


def _identities(entries: list[dict], offset: int) -> list[dict]:
    """The image entries' ``external_id`` / ``metadata`` validated as the upload form's
    (``catalogue_fields.with_identities``); ``{}`` for a text. Raises its ApplicationErrors with
    ``extra.index`` the input's position."""
    images = [j for j, e in enumerate(entries) if "text" not in e or e.get("text") is None]
    if not any("external_id" in entries[j] or "metadata" in entries[j] for j in images):
        return [{} for _ in entries]
    form = {"external_id": [entries[j].get("external_id") or "" for j in images],
            "metadata": [entries[j].get("metadata") or {} for j in images]}
    blanks = [SourceFile(name="", size=0, open=lambda: None) for _ in images]
    try:
        checked = with_identities(form, blanks)
    except ApplicationError as e:
        if isinstance(e.extra.get("index"), int):
            e.extra["index"] = offset + images[e.extra["index"]]
        raise
    out = [{} for _ in entries]
    for j, src in zip(images, checked):
        out[j] = {"external_id": src.external_id, "metadata": src.metadata or None}
    return out


class EmbeddingsView(APIView):
    """``POST /api/embeddings/``: vectors of texts and images, in input order."""

    required_scope = "embeddings"

    parser_classes = (JSONParser, MultiPartParser, FormParser)

    @extend_schema(
        operation_id="embeddings_create",
        request={"application/json": EmbeddingsRequestSerializer, "multipart/form-data": EmbeddingsUploadSerializer},
        parameters=[RETRY_AFTER],
        description="One vector per input (texts; images as files, base64, data URLs or http(s) URLs), in input "
                    "order, computed on the interactive lane within the deadline. A refused input answers its "
                    "reason in its entry; when every input is refused the status follows the reasons (400/413/415/422) "
                    "in the same shape. With store the images become your images (their ids in the answer; 202 if "
                    "the deadline passes: they continue). Without store nothing is kept. docs/embeddings-api.md.",
        responses={200: EmbeddingsResponseSerializer,
                   202: OpenApiResponse(EmbeddingsResponseSerializer,
                                        description="store: the deadline passed; the images continue (their ids "
                                                    "given, their vectors at /api/images/{id}/)"),
                   400: OpenApiResponse(EMBEDDINGS_REFUSAL, description="every input refused (in this "
                                        "shape), or: " + ERROR_STATUS[400] + ", no_inputs, too_many_inputs, "
                                        "invalid_input"),
                   413: OpenApiResponse(EMBEDDINGS_REFUSAL, description="every input refused as too "
                                        "large (in this shape), or: " + ERROR_STATUS[413]),
                   415: OpenApiResponse(EMBEDDINGS_REFUSAL, description="every input refused as not an "
                                        "image (in this shape), or: " + ERROR_STATUS[415]),
                   422: OpenApiResponse(EMBEDDINGS_REFUSAL, description="every input refused in this shape: "
                                        + ERROR_STATUS[422]),
                   **errors(429, 503, 504)})
    def post(self, request):
        data, files = parsed(request)
        check_parts(data, files, file_fields=("files",))
        uploads = uploaded_files(files, "files")
        raw = data.get("inputs") if hasattr(data, "get") else None
        if raw is not None and not isinstance(raw, (list, str)):
            raise ApplicationError("inputs must be an array", code="invalid_input", extra={"index": None})
        n_raw = len(raw) if isinstance(raw, list) else None
        if n_raw is not None:  # count before validating 10,000 entries
            _count_check(len(uploads) + n_raw)
        entries = _entries(raw, len(uploads))
        _count_check(len(uploads) + len(entries))
        options = EmbeddingsOptionsSerializer(data=data)
        options.is_valid(raise_exception=True)
        v = options.validated_data
        deadline_s = deadline_for(v.get("deadline"))
        files_in = from_uploads(uploads)
        if v["store"]:
            files_in = with_identities(data, files_in)
            ids = _identities(entries, len(uploads))
        else:
            given = hasattr(data, "getlist") and (data.getlist("external_id") or data.getlist("metadata"))
            if given or any("external_id" in e or "metadata" in e for e in entries):
                raise ApplicationError("external_id and metadata are kept only with store=true", code="invalid_input",
                                       extra={"index": None})
            ids = [{} for _ in entries]
        inputs = [embed_services.EmbedInput(file=f) for f in files_in]
        inputs += [embed_services.EmbedInput(text=e.get("text"), image=e.get("image"), image_url=e.get("image_url"),
                                             **ident) for e, ident in zip(entries, ids)]
        if v["store"]:  # the images become the caller's images: an upload
            scope_check(request, "images:write")
        images_taken(request, sum(i.text is None for i in inputs))
        key_prefix = key_prefix_of(request)
        outcome = embed_services.embeddings_create(user=request.user, inputs=inputs, deadline_s=deadline_s,
                                                   store=v["store"], key_prefix=key_prefix)
        embed_services.embeddings_metered(user=request.user, outcome=outcome, key_prefix=key_prefix)
        encoding = v["encoding_format"]
        items = []
        for it in outcome.items:
            out = {k: val for k, val in it.items() if k != "vector"}
            if "vector" in it:
                out["embedding"] = _embedding(it["vector"], encoding)
            items.append(out)
        return Response({"data": items, "space": embed_services.space_view(outcome.space),
                         "encoding_format": encoding, "deadline_s": deadline_s}, status=outcome.status)


# --- POST /v1/embeddings (OpenAI) -----------------------------------------------------------------

#: OpenAI's ``error.type`` by HTTP status (its clients raise by status: BadRequestError, ...).
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error"}

def openai_exception_handler(exc, context):
    """The API's errors (``embeddings.api.errors``) in OpenAI's shape ``{"error": {"message",
    "type", "param", "code"}}``, status and headers (``Retry-After``) kept."""
    response = exception_handler(exc, context)
    if response is None:
        return None
    body = response.data if isinstance(response.data, dict) else {}
    extra = body.get("extra") or {}
    param = extra.get("param")
    if param is None and isinstance(extra.get("fields"), dict) and extra["fields"]:
        param = next(iter(extra["fields"]))
    message = body.get("message", "")
    if body.get("code") == "invalid" and isinstance(extra.get("fields"), dict):
        message = "; ".join(f"{k}: {' '.join(map(str, v)) if isinstance(v, list) else v}"
                            for k, v in extra["fields"].items()) or message
    response.data = {"error": {"message": message, "param": param, "code": body.get("code"),
                               "type": OPENAI_TYPES.get(response.status_code, "server_error"
                                                        if response.status_code >= 500 else "invalid_request_error")}}
    return response


def openai_errors(*statuses: int) -> dict[int, OpenApiResponse]:
    """``{status: OpenApiResponse(OpenAIError)}`` for ``extend_schema(responses=...)``."""
    return {s: OpenApiResponse(OpenAIErrorSerializer, description=ERROR_STATUS.get(s, "")) for s in statuses}


_openai_inputs = embed_services.openai_inputs


class OpenAIEmbeddingsView(APIView):
    """``POST /v1/embeddings``: OpenAI's embeddings endpoint over this service's spaces; every error
    in OpenAI's shape; any refused input fails the whole request (OpenAI answers all or nothing)."""

    required_scope = "embeddings"

    parser_classes = (JSONParser,)

    def get_exception_handler(self):
        return openai_exception_handler

    @extend_schema(
        operation_id="openai_embeddings_create", request=OpenAIEmbeddingRequestSerializer,
        parameters=[RETRY_AFTER],
        description="OpenAI-compatible embeddings (the official clients work with base_url=<service>/v1 and a "
                    "token as api_key). Strings that are data URLs or http(s) URLs are images. Errors are OpenAI's "
                    "shape; a refused input fails the request naming it (param input[i], code its reason).",
        responses={200: OpenAIEmbeddingListSerializer, **openai_errors(400, 401, 404, 413, 415, 429, 503, 504)})
    # 413: a body over DATA_UPLOAD_MAX_MEMORY_SIZE; 415: a Content-Type other than JSON
    def post(self, request):
        data, _ = parsed(request)
        if not isinstance(data, dict):
            raise ApplicationError("the body must be a JSON object", code="invalid_input", extra={"param": None})
        if "input" not in data:
            raise ApplicationError("input is required", code="invalid_input", extra={"param": "input"})
        raw_input = data.get("input")
        if isinstance(raw_input, list):  # count before validating 10,000 entries
            _count_check(len(raw_input))
        s = OpenAIEmbeddingRequestSerializer(data=data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        inputs = _openai_inputs(raw_input, v["modality"])
        try:
            space = embed_services.space_for_model(v["model"])
        except ApplicationError as e:
            e.extra = {**e.extra, "param": "model"}
            raise
        if v.get("dimensions") is not None and v["dimensions"] != space.dim:
            raise ApplicationError(f"dimensions {v['dimensions']}: {space.model_id} has {space.dim} (vectors are not "
                                   f"shortened)", code="invalid_dimensions", extra={"param": "dimensions"})
        images_taken(request, sum(i.text is None for i in inputs))
        key_prefix = key_prefix_of(request)
        outcome = embed_services.embeddings_create(user=request.user, inputs=inputs,
                                                   deadline_s=deadline_for(None), space=space, key_prefix=key_prefix)
        refused = [it for it in outcome.items if "vector" not in it]
        if refused:
            first = refused[0]
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            # OpenAI answers a bad input 400 whatever was wrong with it; its clients raise BadRequestError
            raise ApplicationError(f"input[{first['index']}] ({first['kind']}): {first['reason']}: {first['detail']}"
                                   f"{more}", code=first["reason"], status=400,
                                   extra={"param": f"input[{first['index']}]"})
        embed_services.embeddings_metered(user=request.user, outcome=outcome, key_prefix=key_prefix)  # all answered
        encoding = v["encoding_format"]
        tokens = sum(it.get("tokens", 0) if it["kind"] == "text" else outcome.image_tokens for it in outcome.items)
        return Response({
            "object": "list", "model": space.model_id,
            "data": [{"object": "embedding", "index": it["index"], "embedding": _embedding(it["vector"], encoding)}
                     for it in outcome.items],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })
