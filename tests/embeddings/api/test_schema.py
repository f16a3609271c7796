"""The OpenAPI schema: versioned in docs/openapi.yaml (``make schema``) and describing the service:
typed bodies, limits, error statuses in one component, Retry-After, pagination, staff-only marks."""
from __future__ import annotations

import dataclasses

import pytest
import yaml
from django.conf import settings
from django.test import override_settings

from tests.conftest import ROOT

pytestmark = pytest.mark.django_db

SCHEMA_FILE = ROOT / "docs" / "openapi.yaml"


#: The deployment docs/openapi.yaml describes (``make schema`` sets the same): the served schema names
#: the configured model's precision, and ``CLIP_PRECISION=auto`` resolves it by the machine's CPU.
REFERENCE = {"precision": "fp32", "device": "cpu"}


@pytest.fixture(scope="module")
def served(django_db_blocker):
    from rest_framework.test import APIClient

    with django_db_blocker.unblock(), override_settings(PIPELINE=dataclasses.replace(settings.PIPELINE, **REFERENCE)):
        r = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi")
    assert r.status_code == 200
    return yaml.safe_load(r.content)


def _op(schema, path, method):
    return schema["paths"][path][method]


def _ref(schema, ref: str) -> dict:
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_the_served_schema_is_the_versioned_file(served):
    # An API change shows up in review: regenerate with `make schema` and commit docs/openapi.yaml.
    assert served == yaml.safe_load(SCHEMA_FILE.read_text()), "docs/openapi.yaml is stale: run `make schema`"


def test_lists_are_cursor_paginated_objects(served):
    for path, item, params in (("/api/images/", "Image", ["cursor", "external_id", "include", "vector_format"]),
                               ("/api/jobs/", "Job", ["cursor"])):
        op = _op(served, path, "get")
        assert [p["name"] for p in op["parameters"]] == params
        page = _ref(served, op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"])
        assert page["type"] == "object" and page["required"] == ["results"]
        assert set(page["properties"]) == {"next", "previous", "results"}
        assert page["properties"]["results"]["items"]["$ref"] == f"#/components/schemas/{item}"


def test_upload_fields_types_and_limits(served):
    body = _op(served, "/api/images/", "post")["requestBody"]["content"]["multipart/form-data"]["schema"]
    upload = _ref(served, body["$ref"])
    assert upload["required"] == ["files"]
    files = upload["properties"]["files"]
    assert (files["minItems"], files["maxItems"]) == (1, settings.INTERACTIVE_MAX_FILES)
    assert files["items"] == {"type": "string", "format": "binary"}
    assert (upload["properties"]["k"]["minimum"], upload["properties"]["k"]["maximum"]) == (0, settings.SEARCH_MAX_K)
    assert upload["properties"]["deadline"]["minimum"] == 0.001


def test_each_error_status_uses_the_error_component_and_retry_after(served):
    error = served["components"]["schemas"]["Error"]
    assert error["required"] == ["code", "extra", "message"]
    responses = _op(served, "/api/search/", "post")["responses"]
    assert sorted(responses) == ["200", "400", "401", "403", "404", "406", "409", "411", "413", "415", "422", "429",
                                 "503", "504"]
    for status in ("401", "404", "409", "429", "503", "504"):
        assert responses[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    for status in ("429", "503"):
        assert responses[status]["headers"]["Retry-After"]["schema"] == {"type": "integer"}
    upload = _op(served, "/api/images/", "post")["responses"]
    assert sorted(upload) == ["200", "202", "400", "401", "403", "406", "411", "413", "415", "422", "429", "503"]
    refusal = _ref(served, upload["415"]["content"]["application/json"]["schema"]["$ref"])
    assert refusal == {"oneOf": [{"$ref": "#/components/schemas/UploadResponse"},
                                 {"$ref": "#/components/schemas/Error"}]}


def test_every_secured_operation_documents_401_and_every_id_404(served):
    ops = [(path, method, op) for path, item in served["paths"].items() for method, op in item.items()]
    # 13 + /api/migrations/ (list, create, retrieve, destroy, action): issue 13; PATCH image: 41;
    # issue 42: /api/embeddings/, /v1/embeddings, the export, webhooks (list, create, retrieve, update,
    # destroy, rotate, deliveries, redeliver); issue 45: duplicates (list, retrieve, keep,
    # not-duplicates, scan retrieve and start); issue 56: /v1/files (create, list, retrieve, delete,
    # content), /v1/batches (create, list, retrieve, cancel); issue 55: /api/keys/ (list, create, retrieve,
    # partial update, revoke), /api/usage/
    assert len(ops) == 51
    for path, method, op in ops:
        secured = op.get("security") and all(op["security"])
        assert ("401" in op["responses"]) == bool(secured), (path, method)
        # a key's scope and limits (docs/api-keys.md): every secured operation names its scope
        assert bool(secured) == ("x-required-scope" in op), (path, method)
        if secured:
            assert "403" in op["responses"] and "429" in op["responses"], (path, method)
            assert f"Scope: `{op['x-required-scope']}`" in op["description"], (path, method)
        if "{" in path:
            assert "404" in op["responses"], (path, method)
        # refused before any view (embeddings.transport): control characters, a body without a length
        assert "400" in op["responses"] and "406" in op["responses"], (path, method)
        assert ("411" in op["responses"]) == (method in ("post", "put", "patch", "delete")), (path, method)
        for parameter in op.get("parameters", []):
            if parameter["in"] == "query" and parameter["schema"].get("type") == "string" \
                    and not {"format", "enum"} & set(parameter["schema"]):
                assert "pattern" in parameter["schema"], (path, method, parameter["name"])
    assert "security" not in _op(served, "/api/auth/token/", "post")  # no authentication: no 401


def test_search_json_is_exactly_one_of_text_or_image_id_or_examples(served):
    content = _op(served, "/api/search/", "post")["requestBody"]["content"]
    one_of = _ref(served, content["application/json"]["schema"]["$ref"])["oneOf"]
    required = [_ref(served, s["$ref"])["required"] for s in one_of]
    assert required == [["text"], ["image_id"], ["positive"]]
    # the form is one object (a generated client then sends its files as file parts): the image, or
    # examples with uploaded ones; none required, and no strategy sent unless asked for
    form = _ref(served, content["multipart/form-data"]["schema"]["$ref"])
    assert "oneOf" not in form and form.get("required", []) == []
    assert {"image", "positive", "negative", "positive_image", "negative_image", "strategy"} <= set(form["properties"])
    assert "default" not in form["properties"]["strategy"]


def test_stats_is_marked_staff_only(served):
    op = _op(served, "/api/stats/", "get")
    assert op["x-staff-only"] is True and "403" in op["responses"]
    staff = [(p, m) for p, item in served["paths"].items() for m, op in item.items() if op.get("x-staff-only")]
    assert sorted(staff) == [("/api/migrations/", "get"), ("/api/migrations/", "post"),
                     ("/api/migrations/{space_id}/", "delete"), ("/api/migrations/{space_id}/", "get"),
                     ("/api/migrations/{space_id}/{action}/", "post"), ("/api/stats/", "get")]


def test_a_migrations_source_may_be_null_and_every_action_may_refuse_its_body(served):
    # the space a deployment started with has no source: the schema must allow the null it answers
    for name in ("Space", "Migration"):
        source = served["components"]["schemas"][name]["properties"]["source"]
        assert (source["type"], source.get("nullable")) == ("string", True)
    action = _op(served, "/api/migrations/{space_id}/{action}/", "post")
    assert "400" in action["responses"]  # force that is not a boolean, for gate and rollback too


def test_job_actions_are_an_enum(served):
    params = {p["name"]: p for p in _op(served, "/api/jobs/{job_id}/{action}/", "post")["parameters"]}
    assert params["action"]["schema"]["enum"] == ["cancel", "pause", "resume"]


class _Revoked:
    """An AsyncResult whose task Celery revoked: ``get`` raises as Celery's does."""

    def __init__(self, why: str) -> None:
        self.why = why

    def get(self, **kw):
        from celery.exceptions import TaskRevokedError

        raise TaskRevokedError(self.why)


def test_an_expired_message_is_a_passed_deadline_and_other_failures_say_retry_after():
    # Found by the fuzzer: an upload with deadline 0.001 s answered an undocumented 503 without
    # Retry-After when its message expired in the broker; the deadline passed, so it is a 202.
    import time

    from embeddings.errors import ApplicationError
    from embeddings.services.interactive.waiting import wait_for as _wait

    assert _wait(_Revoked("expired"), time.time() + 1) is None
    with pytest.raises(ApplicationError) as e:
        _wait(_Revoked("revoked"), time.time() + 1)
    assert (e.value.status, e.value.code, e.value.headers) == (503, "worker_error", {"Retry-After": "5"})





@pytest.mark.django_db(transaction=True)
def test_openapi_schema_renders(service, api):
    r = api.get("/api/schema/")
    assert r.status_code == 200 and b"/api/images/" in r.content
