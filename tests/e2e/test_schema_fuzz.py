"""The served OpenAPI schema against the running service, from outside: Schemathesis generates
requests from ``/api/schema/`` (valid and invalid ones) and checks every answer against it.

Real processes (web, one worker per queue, private Redis, embedded Qdrant, random-weights CLIP);
a non-staff user's token, as an API user would have. Every check, a fixed seed, a bounded number
of examples per operation, no example database (nothing written into the repository). DELETE is
left out: it would delete the images other generated requests are about (it has its own tests).

Where the service's answer depends on what a request's bytes are, and no schema can say it, the
check that valid data is accepted is told the statuses the schema documents for that case (see
``CONFIG``): an image file part that does not decode (400/413/415 by reason), a zip that is not
one, a username and password that name no user, a metadata object whose key names, depth or size
break the metadata rules (OpenAPI 3.0 cannot constrain an object's key names), an embeddings input
whose text, base64, data URL or URL turns out not to be an image (or an empty text), a callback URL
whose address is refused.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SEED = 14
MAX_EXAMPLES = 12

# Statuses valid (schema-conforming) data may get besides Schemathesis' defaults, per operation:
# the content of a file part decides them (the schema documents each with its reason).
CONFIG = """
[[operations]]
include-operation-id = "images_upload"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "401", "403", "404", "409", "413", "415", "429", "5xx"]

[[operations]]
include-operation-id = "jobs_create"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "401", "403", "404", "409", "413", "415", "429", "5xx"]

[[operations]]
include-operation-id = "search"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "401", "403", "404", "409", "413", "415", "429", "5xx"]

[[operations]]
include-operation-id = "images_partial_update"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "embeddings_create"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "401", "403", "404", "409", "413", "415", "429", "5xx"]
[[operations]]
include-operation-id = "openai_embeddings_create"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "400", "401", "403", "404", "409", "413", "415", "429", "5xx"]
[[operations]]
include-operation-id = "webhooks_create"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "webhooks_partial_update"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]
[[operations]]
include-operation-id = "auth_token"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400"]
"""


@pytest.fixture(scope="module")
def token(stack):
    return stack.manage("apiuser", "fuzz").strip()


def _st(stack, token, tmp_path, name: str, *args: str) -> str:
    """Run ``st run`` on the served schema; its output (the test fails unless it found nothing)."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "--config-file", str(config), "run", f"{stack.web_url}/api/schema/",
           "--header", f"Authorization: Token {token}", "--checks", "all", "--exclude-method", "DELETE",
           "--seed", str(SEED), "--max-examples", str(MAX_EXAMPLES), "--generation-database", "none",
           # one worker: hypothesis reads lambda sources with ast.parse, which CPython 3.11 cannot
           # run on two threads at once ("AST constructor recursion depth mismatch")
           "--workers", "1", "--request-timeout", "60", "--no-color",
           "--report", "junit", "--report-junit-path", str(tmp_path / f"{name}.xml"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-3000:]
    return r.stdout


def test_each_operation_answers_as_its_schema_says(stack, token, tmp_path):
    # valid and invalid requests per operation: the schema's examples, its boundaries, random data
    out = _st(stack, token, tmp_path, "operations", "--phases", "examples,coverage,fuzzing")
    selected = re.search(r"Operations:\s+(\d+) selected", out)
    assert selected and int(selected.group(1)) >= 11, out[-3000:]  # every operation but DELETE, none dropped
    assert f"Tested: {selected.group(1)}" in out and "Failures:" not in out and "Errors:" not in out, out[-3000:]


def test_linked_operations_answer_as_the_schema_says(stack, token, tmp_path):
    # sequences following the links Schemathesis infers (an upload's ids into search, retrieve...);
    # valid data only: in negative mode a link can fill the field a generated invalid body lacked,
    # and the request the server receives is then valid (the check reports "accepted")
    out = _st(stack, token, tmp_path, "stateful", "--phases", "stateful", "--mode", "positive")
    assert "Scenarios:" in out and "Failures:" not in out and "Errors:" not in out, out[-3000:]
