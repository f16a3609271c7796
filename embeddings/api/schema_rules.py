"""The rules the service enforces on request bodies, stated in the OpenAPI schema, so that a client
generated from it refuses what the service refuses (issue 53: a schema more permissive than the
service).

:func:`postprocess` (a drf-spectacular postprocessing hook after ``embeddings.api.schema``'s) adds
to the request components what the serializers cannot say themselves: each rule names the code that
enforces it, and uses the same constant where there is one. The rules OpenAPI 3.0 cannot state, or
the tools that read the schema cannot follow, are listed in docs/embeddings-api.md "What the schema
cannot say"; ``tests/embeddings/api/test_schema_positive.py`` sends schema-valid requests and fails
on any other refusal.
"""
from __future__ import annotations

from django.conf import settings

from embeddings import spaces
from embeddings.api.vector_fields import INCLUDE_CHOICES
from embeddings.models import PRESETS, SCOPES, WebhookEvent
from embeddings.objects import S3_URI_PATTERN
from embeddings.services.webhooks.endpoints import CALLBACK_URL_PATTERN, MAX_JOB_CALLBACKS

#: No NUL character: DRF's ``CharField`` refuses one (``ProhibitNullCharactersValidator``: 400
#: ``invalid``), and PostgreSQL's text cannot hold one.
NO_NUL = "^[^\\u0000]*$"
#: ``include``: comma-separated names of ``INCLUDE_CHOICES``, blanks ignored
#: (``vector_fields.IncludeField``).
INCLUDE_PATTERN = "^\\s*(" + "|".join(INCLUDE_CHOICES) + ")?\\s*(,\\s*(" + "|".join(INCLUDE_CHOICES) + ")?\\s*)*$"
#: Components whose strings a view reads itself rather than through a ``CharField`` (a NUL there is
#: text like any other: an embeddings input's text, an OpenAI request's inputs): the properties so
#: read, or ``None`` for the whole component. Its other strings are ``CharField``s (OpenAI's ``model``).
OWN_STRINGS: dict[str, frozenset[str] | None] = {"EmbeddingInputRequest": None,
                                                  "OpenAIEmbeddingRequestRequest": frozenset({"input"})}
#: The events a job's own callback URLs can hear (``webhooks.endpoints.events_check``, ``migrations=False``).
JOB_EVENTS = [e for e in WebhookEvent.values if not e.startswith("migration.")]


def postprocess(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: the rules of this module's docstring on ``result``'s
    request components (``*Request``); returns ``result``."""
    schemas = result.get("components", {}).get("schemas", {})
    forms = _form_only_components(result)
    for name, schema in schemas.items():
        if not name.endswith("Request"):
            continue
        own = OWN_STRINGS.get(name, frozenset())
        if own is not None:  # the same property objects, less those the view reads itself
            props = {k: v for k, v in schema.get("properties", {}).items() if k not in own}
            _walk_strings({**schema, "properties": props}, schemas)
        if name in forms:  # a form field cannot be null: an empty part is an empty string
            for prop in schema.get("properties", {}).values():
                prop.pop("nullable", None)
        props = schema.get("properties", {})
        if "include" in props:
            props["include"]["pattern"] = INCLUDE_PATTERN
    _callback_urls(schemas)
    _embeddings(schemas)
    if "SearchExampleRequest" in schemas:  # api.search: 400 invalid_example unless exactly one of the two
        schemas["SearchExampleRequest"].update(oneOf=[{"required": ["image_id"]}, {"required": ["text"]}],
                                               additionalProperties=False)
    if "MigrationCreateRequest" in schemas:
        _configured_models(schemas["MigrationCreateRequest"])
    scopes = schemas.get("ApiKeyCreateRequest", {}).get("properties", {}).get("scopes")
    if scopes:  # services.access.scopes.scopes_resolve: another name is 400 unknown_scope
        scopes["items"] = {"type": "string", "enum": [*SCOPES, *PRESETS]}
    for path_item in result.get("paths", {}).values():
        for op in path_item.values():
            for parameter in op.get("parameters", []) if isinstance(op, dict) else ():
                if parameter.get("name") == "include" and parameter.get("in") == "query":
                    parameter["schema"]["pattern"] = INCLUDE_PATTERN
    return result


def _walk_strings(schema: dict, schemas: dict) -> None:
    """:data:`NO_NUL` on every string of ``schema`` without a format, pattern or enum."""
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "string" and not ({"format", "pattern", "enum"} & set(schema)):
        schema["pattern"] = NO_NUL
    for key in ("properties",):
        for sub in schema.get(key, {}).values():
            _walk_strings(sub, schemas)
    for key in ("items", "additionalProperties"):
        _walk_strings(schema.get(key), schemas)
    for key in ("oneOf", "anyOf", "allOf"):
        for sub in schema.get(key, []):
            _walk_strings(sub, schemas)


def _form_only_components(result: dict) -> set[str]:
    """Names of the components that only form bodies (multipart, urlencoded) refer to."""
    form, other = set(), set()
    for path_item in result.get("paths", {}).values():
        for op in path_item.values():
            if not isinstance(op, dict):
                continue
            for media, content in op.get("requestBody", {}).get("content", {}).items():
                ref = content.get("schema", {}).get("$ref", "")
                name = ref.rpartition("/")[2]
                (form if media.startswith(("multipart/", "application/x-www-form-urlencoded")) else other).add(name)
    return form - other


def _callback_urls(schemas: dict) -> None:
    """Webhook URLs and job callback URLs: :data:`CALLBACK_URL_PATTERN` (``callback_url_check``);
    a job's callback events: :data:`JOB_EVENTS`; its object-storage URIs: ``S3_URI_PATTERN``."""
    url = {"type": "string", "pattern": CALLBACK_URL_PATTERN, "maxLength": 2048}
    for name in ("WebhookCreateRequest", "PatchedWebhookUpdateRequest"):
        if name in schemas:
            schemas[name]["properties"]["url"].update(pattern=CALLBACK_URL_PATTERN)
    for name in ("JobCreateRequest", "JobSubmitRequest"):
        props = schemas.get(name, {}).get("properties", {})
        if "callback_url" in props:
            props["callback_url"]["oneOf"] = [url, {"type": "array", "items": url, "maxItems": MAX_JOB_CALLBACKS}]
        if "callback_events" in props:
            props["callback_events"]["items"] = {"type": "string", "enum": JOB_EVENTS}
        for field in ("manifest_key", "prefix", "bucket"):  # objects.parse_s3_uri: 400 source_uri_invalid
            if field in props:
                props[field]["pattern"] = S3_URI_PATTERN


def _embeddings(schemas: dict) -> None:
    """``POST /api/embeddings/``'s inputs (``api.embeddings._entries``): exactly one of text, image
    and image_url, a string; no other field; a text has no external_id or metadata. ``POST
    /v1/embeddings``: 1..``EMBEDDINGS_MAX_INPUTS`` strings."""
    entry = schemas.get("EmbeddingInputRequest")
    if entry:
        props = entry.pop("properties")
        entry.pop("required", None)
        identity = {k: props[k] for k in ("external_id", "metadata") if k in props}
        entry["oneOf"] = [
            {"type": "object", "required": ["text"], "properties": {"text": props["text"]}, "additionalProperties": False},
            {"type": "object", "required": ["image"], "properties": {"image": props["image"], **identity},
             "additionalProperties": False},
            {"type": "object", "required": ["image_url"], "properties": {"image_url": props["image_url"], **identity},
             "additionalProperties": False},
        ]
    openai = schemas.get("OpenAIEmbeddingRequestRequest", {}).get("properties", {}).get("input")
    if openai:
        for option in openai.get("oneOf", []):
            if option.get("type") == "array":
                option.update(minItems=1, maxItems=settings.EMBEDDINGS_MAX_INPUTS)


def _configured_models(schema: dict) -> None:
    """``POST /api/migrations/``: one of the models the workers are configured for
    (``spaces.configured_configs``; ``lifecycle.model_migrations.migration_start`` refuses any other
    with 400 ``model_not_configured``), one ``oneOf`` branch each; a field left out takes its
    default (pretrained ``random``, ``CLIP_PRECISION``, ``CLIP_SEED``), so a branch requires only the
    fields whose value differs from it."""
    base = settings.PIPELINE
    try:
        configs = list(spaces.configured_configs().values())
    except (ValueError, FileNotFoundError):  # a CLIP_MODELS this process cannot read: the service refuses all
        return
    defaults = {"pretrained": "random", "precision": base.precision, "seed": base.seed}
    branches = []
    for cfg in configs:
        values = {"model": cfg.model_name, "pretrained": cfg.pretrained, "precision": cfg.precision, "seed": cfg.seed}
        branches.append({"properties": {k: {"enum": [v]} for k, v in values.items()},
                         "required": [k for k, v in values.items() if k == "model" or v != defaults[k]]})
    schema["oneOf"] = branches
