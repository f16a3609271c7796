"""Schema-valid requests are accepted: every request the served schema allows, generated in-process
by Schemathesis (positive data only), gets an answer other than a refusal of its input, as a user and
as staff.

A refusal (400, 413, 415, 422) of a request the schema allows means the schema is more permissive
than the service: a generated client would send it and be refused. The exceptions are the rules
OpenAPI 3.0 cannot state, each listed in docs/embeddings-api.md "What the schema cannot say" and in
:data:`CANNOT_SAY` by operation and reason code; the test fails on any other refusal, listing each
(operation, status, code, request) once.

In-process (Django's WSGI app, eager Celery, random weights): the same views and serializers the
real stack serves, without processes; tests/e2e/test_schema_fuzz.py is the same check from outside.
"""
from __future__ import annotations

import json

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck
from schemathesis.generation import GenerationMode


#: Examples per operation: enough that each optional field and each ``oneOf`` branch appears (the
#: generation is derandomised: the same requests each run).
EXAMPLES = 30
#: Statuses that refuse a request's input (the others answer about state: 401/403/404/409/429).
REFUSALS = {400, 413, 415, 422}
#: What the service may refuse in a schema-valid request, by operation id: the rules OpenAPI 3.0 (or
#: the tools that read the schema) cannot state, each in docs/embeddings-api.md "What the schema
#: cannot say". An entry is a reason code; ``invalid:<field>`` a serializer's refusal of that field;
#: ``per_input`` an answer that refuses each input for what its bytes turned out to be.
#: Where several operations share a rule, it is listed for each.
BYTES = {"per_input", "not_an_image", "zip_invalid", "invalid:image"}  # what a file's or input's bytes are
IDENTITIES = {"metadata_invalid", "external_id_invalid", "external_id_count"}  # key names, printable, counts
MANIFEST = {"manifest_format", "manifest_header", "manifest_encoding"}  # an uploaded manifest's bytes
ADDRESS = {"fetch_refused_address"}  # a URL's address in a refused network (DNS, FETCH_ALLOW_NETWORKS)
CANNOT_SAY: dict[str, set[str]] = {
    "auth_token": {"invalid:non_field_errors"},  # a username and password that name no user
    "images_upload": BYTES | IDENTITIES,
    # a multipart body: files or inputs (no oneOf over file parts), inputs as JSON text; with store
    # only: external_id and metadata; no body at all (the body is optional in the schema)
    "embeddings_create": BYTES | IDENTITIES | ADDRESS | {"no_inputs", "invalid_input"},
    "openai_embeddings_create": BYTES | ADDRESS,
    # a multipart body: one source (no oneOf over file parts); a folder that is not there
    # and what an uploaded manifest's bytes are (CSV, JSON Lines or Parquet; its header; UTF-8)
    "jobs_create": BYTES | IDENTITIES | ADDRESS | MANIFEST | {"no_files", "mixed_sources", "folder_missing"},
    # a multipart body: an image or examples, positive ones among them (no oneOf over file parts),
    # examples as JSON text; no body at all (optional in the schema)
    "search": BYTES | {"invalid_query", "positive_required", "invalid:positive", "invalid:negative"},
    # a batch input file's lines (JSON requests) and its line count are its content
    "openai_files_create": {"empty_file", "too_many_lines"},
    "webhooks_create": ADDRESS | {"invalid_events"},  # migration.* events: staff accounts only
    "keys_create": {"invalid_expiry"},  # expires_at in the future: relative to the moment it arrives
    "webhooks_partial_update": ADDRESS | {"invalid_events"},
    # two dates' order and distance (no rule relates two parameters); a calendar date (format: date
    # is a pattern to the generator: 2026-02-30 passes it)
    "usage": {"usage_range_inverted", "usage_range_too_long", "invalid_date"},
}


def _code(status: int, body) -> list[str]:
    """What refused the request: its reason code, ``invalid:<field>`` for each field a serializer
    refused, or ``per_input`` for an answer listing each input's own refusal."""
    if not isinstance(body, dict):
        return [""]
    error = body.get("error", body)
    code = str(error.get("code", "")) if isinstance(error, dict) else ""
    if code == "invalid" and isinstance(error.get("extra", {}).get("fields"), dict):
        return [f"invalid:{field}" for field in sorted(error["extra"]["fields"])]
    if not code and any(isinstance(body.get(k), list) for k in ("data", "images")):
        return ["per_input"]
    return [code]


def _refusal(case, response) -> tuple[str, int, str, str] | None:
    if response.status_code not in REFUSALS:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    operation = case.operation.definition.raw.get("operationId", case.operation.label)
    codes = _code(response.status_code, body)
    if all(c in CANNOT_SAY.get(operation, set()) for c in codes):
        return None
    request = {k: v for k, v in (("query", case.query), ("body", case.body)) if v}
    return (operation, response.status_code, ",".join(codes),
            repr(request)[:300] + " → " + response.content[:300].decode("utf-8", "replace"))


@pytest.mark.parametrize("role", ["user", "staff"])
def test_schema_valid_requests_are_accepted(service, user, staff, role):
    from project.wsgi import application

    caller = user if role == "user" else staff
    from rest_framework.authtoken.models import Token

    key = Token.objects.get_or_create(user=caller)[0].key
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", application)
    refusals: list[tuple[str, int, str, str]] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() == "DELETE":
            continue
        strategy = operation.as_strategy(GenerationMode.POSITIVE)

        @hypothesis.settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                             suppress_health_check=list(HealthCheck))
        @hypothesis.given(case=strategy)
        def run(case):
            response = case.call(headers={"Authorization": f"Token {key}"})
            found = _refusal(case, response)
            if found:
                refusals.append(found)

        run()
    assert not refusals, "\n".join(f"{op} {status} {code}: {detail}" for op, status, code, detail in
                                   sorted(set(refusals)))
