"""The served OpenAPI schema against the running service, from outside: Schemathesis generates
requests from ``/api/schema/`` (valid and invalid ones) and checks every answer against it.

Real processes (web, one worker per queue, private Redis, embedded Qdrant, random-weights CLIP),
the session's shared stack. Each test runs as the three kinds of caller (``ROLES``): anonymous (no
token: every secured operation must answer 401 in the error shape), a user's token, and a staff
token (the staff-only operations: model migrations, stats, other users' images). Every check, a
fixed seed, a bounded number of examples per operation and role (``EXAMPLES``), no example
database (nothing written into the repository). DELETE is left out: it would delete the images
other generated requests are about, and as staff other modules' too (it has its own tests).

Staff on the shared stack: the migration operations cannot switch the model under the modules that
follow. The stack configures one model (no ``CLIP_MODELS``), so ``migrations_create`` can only be
refused (400 ``model_not_configured``, 409 ``already_active``); ``promote`` and ``rollback`` on the
one space, the active one, answer 409; ``gate`` re-runs the quality gate on it (202: background
work, nothing switched). The staff run asserts afterwards that the active space is the one it
found and that no other space exists.

Where the service's answer depends on what no OpenAPI 3.0 schema can say (what a file's bytes are,
metadata key names (a batch's metadata too), a batch input file that is empty or over its line
limit, server state, a URL's address; the list and the codes are in
docs/embeddings-api.md "What the schema cannot say"), the check that valid data is accepted is told
the statuses the schema documents for that case (see ``CONFIG``); which codes come with them is
checked in-process, request by request (tests/embeddings/api/test_schema_positive.py).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.e2e

SEED = 14
#: The callers each test runs as.
ROLES = ("anonymous", "user", "staff")
#: Examples per operation in the fuzzing phase (and the stateful phase's budget) where a role's run
#: spends its effort: the user on every operation but the staff-only ones, staff on the staff-only
#: ones. The coverage phase (every boundary case the schema defines, whatever this number) runs
#: there alone; elsewhere :data:`GLANCE` examples and no coverage phase. What an operation answers
#: a caller who may not use it (401, 403) does not depend on the input, so a glance shows all there
#: is to see, and the three runs together take about the time of the one user run they replace.
EXAMPLES = 12
GLANCE = 3

# Statuses valid (schema-conforming) data may get besides Schemathesis' defaults, per operation:
# the rules the schema cannot state (docs/embeddings-api.md "What the schema cannot say"; the codes
# are checked one by one in-process, tests/embeddings/api/test_schema_positive.py). Everywhere:
# 411, for the client may send a body chunked (an empty form body too), which the service refuses
# before any view (embeddings.transport); the export: 400 for a vector_format its file format
# cannot hold (npz and Parquet hold float32 only).
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "411", "429", "5xx"]

[[operations]]
include-operation-id = "vectors_export"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "411", "401", "403", "404", "409", "429", "5xx"]

[[operations]]
include-operation-id = "images_upload"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "411", "401", "403", "404", "409", "413", "415", "429", "5xx"]

[[operations]]
include-operation-id = "jobs_create"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "411", "401", "403", "404", "409", "413", "415", "429", "5xx"]

[[operations]]
include-operation-id = "search"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "411", "401", "403", "404", "409", "413", "415", "429", "5xx"]

[[operations]]
include-operation-id = "images_partial_update"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "411", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "embeddings_create"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "411", "401", "403", "404", "409", "413", "415", "429", "5xx"]
[[operations]]
include-operation-id = "openai_embeddings_create"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "411", "401", "403", "404", "409", "413", "415", "429", "5xx"]
[[operations]]
include-operation-id = "webhooks_create"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "411", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "webhooks_partial_update"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "411", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "auth_token"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "411"]
[[operations]]
include-operation-id = "openai_files_create"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "411", "401", "403", "404", "409", "413", "415", "429", "5xx"]
[[operations]]
include-operation-id = "openai_batches_create"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "411", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "keys_create"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "411", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "usage"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "411", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "migrations_create"
checks.positive_data_acceptance.expected-statuses = ["2xx", "411", "401", "403", "404", "409", "429", "5xx"]
"""


def role_config(role: str, staff_only: list[str]) -> str:
    """:data:`CONFIG` plus where ``role``'s run spends its examples: the operations it may use
    (anonymous: none) get :data:`EXAMPLES` and the coverage phase, the others :data:`GLANCE` and none.
    ``staff_only``: the operation ids the schema marks ``x-staff-only``."""
    ids = "|".join(re.escape(i) for i in staff_only)
    glance = f"""
[[operations]]
{{select}}
generation.max-examples = {GLANCE}
phases.coverage.enabled = false
"""
    select = {"anonymous": 'include-operation-id-regex = ".*"',
              "user": f'include-operation-id-regex = "^({ids})$"',
              "staff": f'exclude-operation-id-regex = "^({ids})$"'}[role]
    return f"[generation]\nmax-examples = {EXAMPLES}\n" + CONFIG + glance.format(select=select)


@pytest.fixture(scope="module")
def staff_only(stack) -> list[str]:
    """The operation ids the served schema marks ``x-staff-only``."""
    r = requests.get(f"{stack.web_url}/api/schema/", params={"format": "json"}, timeout=60)
    assert r.status_code == 200, r.text
    ids = [op["operationId"] for item in r.json()["paths"].values() for op in item.values()
           if isinstance(op, dict) and op.get("x-staff-only")]
    assert {"stats", "migrations_list", "migrations_create", "migrations_action"} <= set(ids), ids
    return ids


@pytest.fixture(scope="module")
def tokens(stack) -> dict[str, str | None]:
    """Each role's token (``None``: anonymous)."""
    return {"anonymous": None, "user": stack.manage("apiuser", "fuzz").strip(),
            "staff": stack.manage("apiuser", "fuzz-staff", "--staff").strip()}


@pytest.fixture
def spaces_kept(stack, tokens, request):
    """After a staff run: the embedding spaces are the ones it found (same ids, same active one)."""
    if request.node.callspec.params["role"] != "staff":
        yield
        return
    before = _spaces(stack, tokens["staff"])
    yield
    assert _spaces(stack, tokens["staff"]) == before


def _spaces(stack, token: str) -> list[tuple[int, str, str]]:
    r = requests.get(f"{stack.web_url}/api/migrations/", headers={"Authorization": f"Token {token}"}, timeout=60)
    assert r.status_code == 200, r.text
    return [(s["id"], s["model_id"], s["state"]) for s in r.json()]


def _st(stack, tokens, role: str, staff_only: list[str], tmp_path, name: str, *args: str) -> str:
    """Run ``st run`` on the served schema as ``role`` (:func:`role_config`); its output (the test
    fails unless it found nothing)."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(role_config(role, staff_only))
    st = Path(sys.executable).with_name("st")
    token = tokens[role]
    auth = ["--header", f"Authorization: Token {token}"] if token else []
    cmd = [str(st), "--config-file", str(config), "run", f"{stack.web_url}/api/schema/", *auth,
           "--checks", "all", "--exclude-method", "DELETE",
           "--seed", str(SEED), "--generation-database", "none",
           # one worker: hypothesis reads lambda sources with ast.parse, which CPython 3.11 cannot
           # run on two threads at once ("AST constructor recursion depth mismatch")
           "--workers", "1", "--request-timeout", "60", "--no-color",
           "--report", "junit", "--report-junit-path", str(tmp_path / f"{name}.xml"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("role", ROLES)
def test_each_operation_answers_as_its_schema_says(stack, tokens, staff_only, tmp_path, role, spaces_kept):
    # valid and invalid requests per operation: the schema's examples, its boundaries, random data
    out = _st(stack, tokens, role, staff_only, tmp_path, "operations", "--phases", "examples,coverage,fuzzing")
    selected = re.search(r"Operations:\s+(\d+) selected", out)
    assert selected and int(selected.group(1)) >= 11, out[-3000:]  # every operation but DELETE, none dropped
    assert f"Tested: {selected.group(1)}" in out and "Failures:" not in out and "Errors:" not in out, out[-3000:]


@pytest.mark.parametrize("role", ("user", "staff"))  # anonymous: every answer a 401, no link to follow
def test_linked_operations_answer_as_the_schema_says(stack, tokens, staff_only, tmp_path, role, spaces_kept):
    # sequences following the links Schemathesis infers (an upload's ids into search, retrieve...);
    # valid data only: in negative mode a link can fill the field a generated invalid body lacked,
    # and the request the server receives is then valid (the check reports "accepted")
    out = _st(stack, tokens, role, staff_only, tmp_path, "stateful", "--phases", "stateful", "--mode", "positive")
    assert "Scenarios:" in out and "Failures:" not in out and "Errors:" not in out, out[-3000:]
