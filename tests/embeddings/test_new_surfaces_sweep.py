"""Issue 53's new surfaces × hostile and careless variants, in one process, built as
``test_url_sweep``: a deterministic product (no random draw), every failing case collected as one
line ``METHOD URL [variant] as USER -> STATUS: what`` and asserted once at the end of its part,
each answer judged by its area's error shape (:func:`tests.embeddings.test_url_sweep.judge`: no
5xx, ``{"message", "code", "extra"}`` under ``/api/``, OpenAI's shape under ``/v1/``).

The parts (counts are cases, one request each unless said):

- :func:`test_manifests` (no model, 61 cases: 3 formats × 10 row variants, 9 whole-file variants of
  CSV and of JSON Lines, 13 of Parquet): CSV, JSON Lines and Parquet manifests sent to
  ``POST /api/jobs/``: oversized cells and rows, many columns, null rows, wrong column types, nested
  values, control characters, look-alike ids, empty files, a file of another format than its name,
  BOMs (UTF-8, UTF-16), mixed encodings; for Parquet also a dictionary-encoded column of 2 MiB
  values, a row group declaring more rows than allowed, struct and list columns, a binary column.
  An accepted manifest's job is read back (``GET /api/jobs/{id}/``): every failure carries its row
  and a snake-case reason code, and the rows the case names fail with the code it names. Every row
  URL's host is a name the fake resolver maps to a private address, so the job's fetches are
  refused and no model is needed.
- :func:`test_refusals` (no model, 42 cases): URL inputs whose host resolves to private, loopback,
  link-local and IPv4-mapped addresses (7 names × 3 URL spellings) through ``POST /api/embeddings/``
  and ``POST /v1/embeddings``: refused with ``fetch_refused_address``, no answer body holds the
  address (manifests send the same names in every case of the first part, judged the same way).
- :func:`test_external_ids` (``model``, 74 cases: 16 spellings × 3 writing requests, then 26
  lookups of the 10 accepted ones): NFC, NFD, compatibility look-alikes, control and format
  characters, outer whitespace, ids at and over 256 characters after NFC typed in NFD, through the
  multipart upload, ``POST /api/embeddings/`` with ``store`` and ``PATCH /api/images/{id}/``; both
  storing doors accept or refuse a spelling alike and store it in NFC, a second store of an id is a
  re-import (one image holds it after), a PATCH of another image to a held id is refused (409), a
  refused spelling is 400 everywhere; then each spelling (as typed, NFC, NFD) finds exactly that one
  image by ``GET /api/images/?external_id=`` and the NFD spelling by a search filter
  (``{"field": "external_id", "eq": ...}``). ``/v1/embeddings`` takes no ids (it stores nothing).
- :func:`test_patch_metadata` (``model``, 30 bodies, each sent twice): JSON Merge Patch bodies of
  ``PATCH /api/images/{id}/``: ``null``, ``{}``, nested nulls, non-object metadata and bodies, deep
  nesting, over-size, keys that break the key pattern, arrays; a refused body gets the same code both
  times and leaves the row as it was; an accepted one leaves the stored metadata equal to RFC 7396's
  result (:func:`rfc7396`) applied to the row before, then cleaned as ``metadata.validate``
  documents (a ``null`` inside a list is dropped: the one place the stored row differs from the RFC,
  which keeps it as a list value).

207 cases in all (about 470 requests with the jobs read back, the PATCH part's resets and reads);
about 21 s of one core on this project's 2-core machine, the model's load (``service``, about 6 s)
included. Only the two ``model`` parts embed (their images); the others run without the model.
The sweep found one bug, fixed: ``PATCH`` counted an id's 256 characters as typed (DRF's
``max_length`` before NFC), refusing an id the other doors take (``at-limit-nfd``;
``catalogue_fields.ExternalIdField``).
"""
from __future__ import annotations

import base64
import io
import json
import socket
import unicodedata
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.authtoken.models import Token

from embeddings import runtime
from embeddings.services.catalogue import manifests
from embeddings.services.catalogue.metadata import MAX_EXTERNAL_ID_CHARS
from tests.embeddings.conftest import clear_runtime, jpeg_bytes, upload
from tests.embeddings.test_url_sweep import (
    SNAKE,
    Case,
    SweepClient,
    problems,
    quiet,
    report,
)

pytestmark = pytest.mark.django_db(transaction=True)

#: Names the fake resolver answers, and what: private, loopback, link-local, IPv6 unique-local and
#: an IPv4-mapped private address. No answer may hold any of these addresses.
RESOLVED = {"intranet.test": "10.20.30.40", "loop.test": "127.0.0.5", "meta.test": "169.254.169.254",
            "corp.test": "192.168.77.9", "shared.test": "100.64.3.4", "ula.test": "fd00:53::1",
            "mapped.test": "::ffff:10.20.30.41"}
#: The address spellings looked for in every answer body (IPv6 as text and the mapped form's hex).
HIDDEN = [*RESOLVED.values(), "10.20.30", "169.254", "192.168.77", "fd00:53", "0a14:1e29", "0a14:1e28"]
HOST = "intranet.test"


def row_url(i: int, host: str = HOST) -> str:
    return f"http://{host}/p/{i}.jpg"


def leaks(body: bytes) -> list[str]:
    text = body.decode(errors="replace").lower()
    return [a for a in HIDDEN if a in text]


@pytest.fixture
def resolver(monkeypatch):
    """Each name of :data:`RESOLVED` resolves to its address; every other name as the machine's."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        return real(RESOLVED.get(str(host).rstrip(".").lower(), host), port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def light(settings, tmp_path, resolver):
    """The app as ``service`` wires it (temp folders, embedded store, eager Celery) without the
    model: what these parts send is refused or failed before anything is embedded."""
    import embeddings.tasks  # noqa: F401 - eager calls need the tasks registered
    from project.celery import app

    settings.VAR_DIR = tmp_path
    settings.BLOB_ROOT = tmp_path / "blobs"
    settings.QDRANT_PATH = str(tmp_path / "qdrant")
    settings.QDRANT_URL = ""
    settings.FETCH_ALLOW_NETWORKS = []
    settings.FETCH_RETRIES = 0
    settings.MANIFEST_MAX_ROWS = 400
    settings.METADATA_INDEXES = "category:keyword,price:float"
    clear_runtime()
    runtime.fetcher.cache_clear()
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    yield settings
    app.conf.task_always_eager = False
    runtime.fetcher.cache_clear()
    clear_runtime()


def token_client(u) -> SweepClient:
    return SweepClient(raise_request_exception=False,
                       HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=u)[0].key}")


# --- manifests ------------------------------------------------------------------------------------------

def csv_bytes(rows: list[dict]) -> bytes:
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v):
        if v is None:
            return ""
        s = v if isinstance(v, str) else json.dumps(v)
        return '"' + s.replace('"', '""') + '"' if any(c in s for c in ',"\n\r') else s

    return ("\n".join([",".join(cols)] + [",".join(cell(r.get(c)) for c in cols) for r in rows]) + "\n").encode()


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def parquet_of(table: pa.Table, **options) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, **options)
    return out.getvalue()


def parquet_bytes(rows: list[dict]) -> bytes:
    """Rows as Parquet; a column of mixed Python types is written as its JSON text (Arrow types a
    column), nested values as Arrow infers them."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    data = {}
    for c in cols:
        values = [r.get(c) for r in rows]
        try:
            data[c] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            data[c] = pa.array([None if v is None else json.dumps(v) for v in values])
    return parquet_of(pa.table(data))


WRITERS = {"csv": csv_bytes, "jsonl": jsonl_bytes, "parquet": parquet_bytes}
NAMES = {"csv": "catalogue.csv", "jsonl": "catalogue.jsonl", "parquet": "catalogue.parquet"}
OK = {"url": row_url(0), "external_id": "SKU-0", "category": "shoes"}

#: Row variants, written in each format: ``(rows, expected)`` where ``expected`` is a set of
#: ``(row, reason)`` the job's failures must include (a row's own check, not the refused fetch).
ROWS = {
    "plain": ([OK, {"url": row_url(1), "external_id": "SKU-1", "price": 9.5}], {(1, "fetch_refused_address")}),
    "cell-over-a-line": ([{"url": row_url(1) + "?" + "q" * (manifests.MAX_LINE_BYTES + 10), "external_id": "L"}, OK],
                         {(1, "row_too_long")}),
    "metadata-string-over-limit": ([{**OK, "category": "x" * 5000}], {(1, "metadata_too_large")}),
    "id-over-limit": ([{**OK, "external_id": "A" * (MAX_EXTERNAL_ID_CHARS + 1)}], {(1, "external_id_invalid")}),
    "many-columns": ([{**OK, **{f"c{i}": "v" for i in range(300)}}], set()),
    "null-row": ([{"url": None, "external_id": None, "category": None}, OK], {(2, "fetch_refused_address")}),
    "wrong-types": ([{"url": 12345, "external_id": "W1"}, {"url": row_url(2), "external_id": True},
                     {"url": row_url(3), "external_id": 4.5}],
                    {(1, "url_invalid"), (2, "external_id_invalid"), (3, "external_id_invalid")}),
    "nested": ([{"url": {"href": row_url(1)}, "external_id": "N1"},
                {"url": row_url(2), "external_id": ["N2"]},
                {"url": row_url(3), "external_id": "N3", "spec": {"a": {"b": [1, 2]}}}],
               {(1, "url_invalid"), (2, "external_id_invalid")}),
    "control-characters": ([{"url": row_url(1), "external_id": "SKU\u202e1"},
                            {"url": row_url(2), "external_id": "SKU\x072"},
                            {"url": row_url(3) + "\x00", "external_id": "SKU-3"}],
                           {(1, "external_id_invalid"), (2, "external_id_invalid")}),
    "look-alike-ids": ([{"url": row_url(1), "external_id": "caf\u00e9"},
                        {"url": row_url(2), "external_id": "cafe\u0301"}], set()),
}


def raw_variants(fmt: str) -> dict[str, tuple[str, bytes, set]]:
    """Whole-file variants of a format: ``{variant: (file name, bytes, expected)}``."""
    text = csv_bytes([OK, {"url": row_url(1), "external_id": "caf\u00e9"}]) if fmt == "csv" else jsonl_bytes(
        [OK, {"url": row_url(1), "external_id": "caf\u00e9"}])
    others = {"csv": jsonl_bytes([OK]), "jsonl": csv_bytes([OK]), "parquet": csv_bytes([OK])}
    out = {
        "empty": (NAMES[fmt], b"", set()),
        "another-format": (NAMES[fmt], others[fmt], set()),
        "parquet-named-so": (NAMES[fmt], parquet_bytes([OK]), set()) if fmt != "parquet"
        else ("catalogue.csv", parquet_bytes([OK]), set()),
        "truncated": (NAMES[fmt], WRITERS[fmt]([OK, OK])[:-7], set()),
    }
    if fmt != "parquet":
        latin = text.replace("caf\u00e9".encode(), "caf\u00e9".encode("latin-1"))
        out |= {
            "bom-utf8": (NAMES[fmt], b"\xef\xbb\xbf" + text, set()),
            "bom-utf16": (NAMES[fmt], text.decode().encode("utf-16"), set()),
            "mixed-encodings": (NAMES[fmt], latin, {(2, "row_encoding")}),
            "crlf-and-blank-lines": (NAMES[fmt], text.replace(b"\n", b"\r\n\r\n"), set()),
            "no-final-newline-huge-line": (NAMES[fmt], text + b"x" * (manifests.MAX_LINE_BYTES + 5), set()),
        }
    else:
        huge = "h" * (2 << 20)
        dict_col = pa.DictionaryArray.from_arrays(pa.array([0] * 50, pa.int32()), pa.array([huge]))
        urls = pa.array([row_url(i) for i in range(50)])
        many = pa.table({"url": pa.nulls(manifests.MAX_ROW_GROUP_ROWS + 1, pa.string())})
        out |= {
            "dictionary-of-huge-values": ("catalogue.parquet", parquet_of(pa.table({"url": urls, "category": dict_col})),
                                          {(1, "row_too_long"), (50, "row_too_long")}),
            "dictionary-of-huge-urls": ("catalogue.parquet", parquet_of(pa.table({"url": dict_col})),
                                        {(1, "row_too_long")}),
            "row-group-of-many-rows": ("catalogue.parquet",
                                       parquet_of(many, row_group_size=manifests.MAX_ROW_GROUP_ROWS + 1), set()),
            "struct-column": ("catalogue.parquet", parquet_of(pa.table({
                "url": pa.array([{"a": row_url(1)}, None]), "external_id": pa.array(["S1", "S2"])})), set()),
            "list-column": ("catalogue.parquet", parquet_of(pa.table({
                "url": pa.array([row_url(1), row_url(2)]), "external_id": pa.array([["L1"], []])})),
                            {(1, "external_id_invalid")}),
            "binary-column": ("catalogue.parquet", parquet_of(pa.table({
                "url": pa.array([row_url(1).encode(), b"\xff\xfe"], pa.binary()),
                "external_id": pa.array(["B1", "B2"])})), set()),
            "integer-url-column": ("catalogue.parquet", parquet_of(pa.table({"url": pa.array([1, 2], pa.int64())})),
                                   set()),
            "float-id-column": ("catalogue.parquet", parquet_of(pa.table({
                "url": pa.array([row_url(1), row_url(2)]), "external_id": pa.array([1.5, float("nan")])})), set()),
            "no-rows": ("catalogue.parquet", parquet_of(pa.table({"url": pa.array([], pa.string())})), set()),
        }
    return out


#: Row variants whose expectations hold in JSON Lines only: CSV cells are text (``true`` and ``4.5``
#: are valid ids there), and Parquet types a column (its own typed variants are in :func:`raw_variants`).
JSONL_ONLY = {"wrong-types"}


def manifest_cases() -> list[tuple[str, str, bytes, set]]:
    """``(variant, file name, bytes, expected)`` of every format × variant."""
    out = []
    for fmt in ("csv", "jsonl", "parquet"):
        for name, (rows, expected) in ROWS.items():
            expected = expected if fmt == "jsonl" or name not in JSONL_ONLY else set()
            out.append((f"{fmt}:{name}", NAMES[fmt], WRITERS[fmt](rows), expected))
        out += [(f"{fmt}:{name}", *v) for name, v in raw_variants(fmt).items()]
    return out


def judge_job(case: Case, r, client, expected: set) -> list[str]:
    """The job an accepted manifest made: read back, every failure with its row and a reason code,
    the ``expected`` ``(row, reason)`` among them, no resolved address anywhere."""
    job = client.get(f"/api/jobs/{json.loads(r.content)['id']}/")
    found = problems(replace(case, method="GET"), job) + [f"the job's answer holds {a}" for a in leaks(job.content)]
    if job.status_code != 200:
        return found + [f"GET of its job answered {job.status_code}"]
    data = json.loads(job.content)
    got = set()
    for f in data["failures"]:
        if not (isinstance(f["row"], int) and f["row"] >= 1 and SNAKE.match(f["reason"] or "")):
            found.append(f"a failure without its row or reason code: {json.dumps(f)[:160]}")
        got.add((f["row"], f["reason"]))
    found += [f"row {row} did not fail {reason} (failures: {sorted(got)[:6]})" for row, reason in sorted(expected - got)]
    return found


def test_manifests(light, user):
    client = token_client(user)
    cases, failures = manifest_cases(), []
    with quiet():
        for variant, name, data, expected in cases:
            case = Case("POST", "/api/jobs/", variant, "user-token")
            part = SimpleUploadedFile(name, data, content_type="application/octet-stream")
            r = client.post("/api/jobs/", {"manifest": part})
            found = problems(case, r) + [f"the answer holds {a}" for a in leaks(r.content)]
            if r.status_code == 202 and not found:
                found += judge_job(case, r, client, expected)
            elif r.status_code != 202 and expected:
                found.append(f"refused whole ({r.content[:100]!r}); rows {sorted(expected)} expected")
            failures += [case.line(r.status_code, p) for p in found]
    assert len(cases) == 61
    assert not failures, report(failures, len(cases))


# --- refusals ---------------------------------------------------------------------------------------------

def refusal_urls() -> list[tuple[str, str]]:
    """``(variant, url)``: each name of :data:`RESOLVED` as written, with a port, query and fragment, and in
    capitals with a trailing dot."""
    out = []
    for name in RESOLVED:
        out += [(name, f"http://{name}/cat.jpg"), (f"{name}:port+query", f"https://{name}:8443/a?b=1#c"),
                (f"{name}:CAPS.", f"http://{name.upper()}./cat.jpg")]
    return out


def test_refusals(light, user):
    client = token_client(user)
    cases, failures = [], []
    with quiet():
        for variant, url in refusal_urls():
            for path, body in (("/api/embeddings/", {"inputs": [{"image_url": url}]}),
                               ("/v1/embeddings", {"model": "ViT-B-32", "input": [url]})):
                case = Case("POST", path, variant, "user-token", "application/json", json.dumps(body).encode())
                cases.append(case)
                r = client.post(path, case.body, content_type="application/json")
                found = [f"the answer holds {a}" for a in leaks(r.content)]
                if path == "/api/embeddings/" and r.status_code == 400 and set(json.loads(r.content)) >= {"data"}:
                    # the per-item refusal documented for /api/embeddings/: each item its reason
                    items = json.loads(r.content)["data"]
                    if not all(SNAKE.match(i.get("reason") or "") and i.get("index") == n for n, i in enumerate(items)):
                        found.append(f"an item without its index or reason: {r.content[:160]!r}")
                else:
                    found += problems(case, r)
                if r.status_code != 400:
                    found.append("not refused 400")
                elif b"fetch_refused_address" not in r.content:
                    found.append(f"not fetch_refused_address: {r.content[:160]!r}")
                failures += [case.line(r.status_code, p) for p in found]
    assert len(cases) == 42
    assert not failures, report(failures, len(cases))


# --- external ids (the model embeds what the writing doors store) ---------------------------------------------

NFD = unicodedata.normalize("NFD", "\u00c5ngstr\u00f6m-\u00e9t\u00e9")
#: ``{variant: id as typed}``; ``nfc``/``nfd`` pairs are one id in two spellings.
IDS = {
    "ascii": "SKU-42",
    "nfc": unicodedata.normalize("NFC", NFD),
    "nfd": NFD,
    "hangul-nfd": unicodedata.normalize("NFD", "\ud55c\uad6d-1"),
    "singleton-ohm": "\u2126-7",  # NFC maps OHM SIGN to GREEK CAPITAL OMEGA
    "compat-ligature": "\ufb01le-1",  # "fi" ligature: NFKC would fold it, NFC keeps it
    "fullwidth": "\uff33\uff2b\uff35-1",
    "outer-whitespace": "  SKU-ws \t",
    "at-limit-nfd": "e\u0301" * MAX_EXTERNAL_ID_CHARS,  # 512 code points typed, 256 after NFC
    "over-limit-nfd": "e\u0301" * (MAX_EXTERNAL_ID_CHARS + 1),
    "at-limit": "z" * MAX_EXTERNAL_ID_CHARS,
    "nul": "SKU\x00-1",
    "bidi-override": "SKU\u202e-1",
    "zero-width": "SKU\u200b-1",
    "newline": "SKU\n-1",
    "json-looking": "{\"id\": 1}",
}
#: Ids refused at every door (``external_id_invalid`` or the serializer's ``invalid``).
REFUSED = {"over-limit-nfd", "nul", "bidi-override", "zero-width", "newline", "json-looking"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def store(client, door: str, ext: str, seed: int):
    """One image stored through a writing door with ``ext``."""
    if door == "upload":
        return client.post("/api/images/", {"files": [upload(f"{seed}.jpg", jpeg_bytes(seed))], "external_id": ext})
    body = {"inputs": [{"image": b64(jpeg_bytes(seed)), "external_id": ext}], "store": True}
    return client.post("/api/embeddings/", json.dumps(body), content_type="application/json")


def code_of(r) -> str:
    """``ok`` for 2xx, else the answer's code (the first item's reason for a per-item refusal)."""
    if r.status_code < 300:
        return "ok"
    data = json.loads(r.content)
    if isinstance(data.get("extra"), dict) and data["extra"].get("fields"):
        fields = data["extra"]["fields"]
        first = next(iter(fields.values())) if isinstance(fields, dict) else fields
        return f"{r.status_code}:{data['code']}:{json.dumps(first)[:60]}"
    return f"{r.status_code}:{data.get('code')}"


@pytest.fixture
def stored(service, user, settings):
    """A user with one embedded image (``SKU-base``, metadata of a few kinds), and their client."""
    settings.METADATA_INDEXES = "category:keyword,price:float"
    client = token_client(user)
    r = client.post("/api/images/", {"files": [upload("base.jpg", jpeg_bytes(1))], "external_id": "SKU-base",
                                     "metadata": json.dumps(BASE)})
    assert r.status_code == 200, r.content
    return client, json.loads(r.content)["images"][0]["id"]


def test_external_ids(stored):
    client, base_id = stored
    cases, failures, seed = [], [], 100
    with quiet():
        for variant, ext in IDS.items():
            want = unicodedata.normalize("NFC", ext.strip())
            codes = {}
            for door in ("upload", "embeddings"):
                seed += 1
                case = Case("POST", "/api/images/" if door == "upload" else "/api/embeddings/", f"{variant}@{door}",
                            "user-token")
                cases.append(case)
                r = store(client, door, ext, seed)
                codes[door] = code_of(r)
                found = problems(case, r)
                if variant in REFUSED and r.status_code < 300:
                    found.append("accepted an id that is refused")
                if variant not in REFUSED and r.status_code != 200:
                    found.append(f"refused ({r.content[:160]!r})")
                if door == "upload" and r.status_code == 200:
                    got = json.loads(r.content)["images"][0].get("external_id")
                    if got != want:
                        found.append(f"stored as {got!r}, not {want!r}")
                failures += [case.line(r.status_code, p) for p in found]
            # the second door stores the same id again: a re-import, the id moves to the new image
            # (one image holds it: the lookups below); a refused id is refused by both doors
            if variant in REFUSED and (codes["upload"] == "ok") != (codes["embeddings"] == "ok"):
                failures.append(cases[-1].line("-", f"the doors disagree: {codes}"))
            # PATCH the base image to this spelling (a held id: 409; a refused one: 400; else it moves)
            case = Case("PATCH", f"/api/images/{base_id}/", variant, "user-token")
            cases.append(case)
            r = client.patch(case.url, json.dumps({"external_id": ext}), content_type="application/json")
            found = problems(case, r)
            if variant in REFUSED and r.status_code != 400:
                found.append("not refused 400")
            if variant not in REFUSED and r.status_code != 409:
                found.append(f"a held id not refused 409 ({r.content[:100]!r})")
            failures += [case.line(r.status_code, p) for p in found]
            # lookups in each spelling: as typed, NFC, NFD
            if variant in REFUSED:
                continue
            for spelling in sorted({ext, want, unicodedata.normalize("NFD", want)}):
                case = Case("GET", "/api/images/", f"{variant}:lookup", "user-token")
                cases.append(case)
                r = client.get("/api/images/", {"external_id": spelling})
                found = problems(case, r)
                if r.status_code == 200:
                    hits = [im["external_id"] for im in json.loads(r.content)["results"]]
                    if hits != [want]:
                        found.append(f"{spelling!r} found {hits}, not [{want!r}]")
                failures += [case.line(r.status_code, p) for p in found]
            spelling = unicodedata.normalize("NFD", want)
            case = Case("POST", "/api/search/", f"{variant}:filter", "user-token")
            cases.append(case)
            r = client.post("/api/search/", json.dumps({"text": "a photo", "k": 5, "filter": {
                "field": "external_id", "eq": spelling}}), content_type="application/json")
            found = problems(case, r)
            if r.status_code == 200:
                hits = [h["external_id"] for h in json.loads(r.content)["results"]]
                if hits != [want]:
                    found.append(f"filter on {spelling!r} found {hits}, not [{want!r}]")
            failures += [case.line(r.status_code, p) for p in found]
    assert len(cases) == 74
    assert not failures, report(failures, len(cases))


# --- PATCH metadata -------------------------------------------------------------------------------------------

BASE = {"category": "shoes", "price": 9.5, "spec": {"size": 42, "colour": "red", "deep": {"x": 1}}, "tags": ["a"]}


def rfc7396(target, patch):
    """RFC 7396's MergePatch(Target, Patch), as the RFC's pseudocode writes it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = rfc7396(out.get(k), v)
    return out


def without_nulls(value):
    """``metadata.validate``'s documented cleaning: ``None`` dropped in objects and in lists."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value if v is not None]
    return value


def deep(n: int) -> dict:
    d = {"leaf": 1}
    for _ in range(n):
        d = {"n": d}
    return d


#: ``{variant: request body}`` (a body of bytes is sent as is).
PATCHES = {
    "metadata-null": {"metadata": None},
    "metadata-empty": {"metadata": {}},
    "remove-a-key": {"metadata": {"category": None}},
    "remove-absent-key": {"metadata": {"nothing": None}},
    "nested-null": {"metadata": {"spec": {"colour": None}}},
    "nested-merge": {"metadata": {"spec": {"deep": {"y": 2}}}},
    "nested-null-under-new-key": {"metadata": {"fresh": {"gone": None, "kept": 1}}},
    "object-replaces-scalar": {"metadata": {"category": {"main": "shoes"}}},
    "scalar-replaces-object": {"metadata": {"spec": "plain"}},
    "array-replaces": {"metadata": {"tags": ["b", "c"]}},
    "array-of-objects": {"metadata": {"tags": [{"a": 1}]}},
    "array-with-null": {"metadata": {"tags": ["a", None]}},
    "metadata-string": {"metadata": "shoes"},
    "metadata-array": {"metadata": [{"category": "x"}]},
    "metadata-number": {"metadata": 5},
    "metadata-true": {"metadata": True},
    "deep-nesting": {"metadata": deep(40)},
    "over-size": {"metadata": {f"k{i}": "v" * 1000 for i in range(200)}},
    "string-over-limit": {"metadata": {"category": "x" * 5000}},
    "key-with-space": {"metadata": {"bad key": 1}},
    "key-leading-digit": {"metadata": {"1abc": 1}},
    "key-empty": {"metadata": {"": 1}},
    "key-non-ascii": {"metadata": {"caf\u00e9": 1}},
    "key-too-long": {"metadata": {"k" * 65: 1}},
    "key-reserved": {"metadata": {"external_id": "x"}},
    "nested-bad-key": {"metadata": {"spec": {"a.b": 1}}},
    "unknown-field": {"metadata": {}, "colour": "red"},
    "body-empty-object": {},
    "body-null": b"null",
    "body-array": b"[{\"metadata\": {}}]",
}


def stored_metadata(client, image_id):
    r = client.get(f"/api/images/{image_id}/")
    assert r.status_code == 200, r.content
    return json.loads(r.content)["metadata"] or {}


def test_patch_metadata(stored):
    client, image_id = stored
    url = f"/api/images/{image_id}/"
    cases, failures = [], []
    with quiet():
        for variant, body in PATCHES.items():
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            case = Case("PATCH", url, variant, "user-token", "application/json", data)
            cases.append(case)
            reset = client.patch(url, json.dumps({"metadata": None}), content_type="application/json")
            reset = reset.status_code == 200 and client.patch(url, json.dumps({"metadata": BASE}),
                                                               content_type="application/json").status_code == 200
            assert reset, "the row could not be put back to BASE"
            before = stored_metadata(client, image_id)
            answers = [client.patch(url, data, content_type="application/json") for _ in range(2)]
            r = answers[0]
            found = problems(case, r)
            after = stored_metadata(client, image_id)
            if r.status_code >= 400:
                if code_of(answers[1]) != code_of(r):
                    found.append(f"the code changed: {code_of(r)} then {code_of(answers[1])}")
                if after != before:
                    found.append(f"a refused patch changed the row: {after}")
            elif r.status_code == 200:
                patch = body.get("metadata", {}) if isinstance(body, dict) else {}
                # RFC 7396's result, then the service's documented cleaning of stored metadata (a
                # null inside a list is dropped, where the RFC keeps it as a list value)
                want = without_nulls(rfc7396(before, patch)) if patch is not None else {}
                if after != want:
                    found.append(f"stored {json.dumps(after)[:160]}, RFC 7396 gives {json.dumps(want)[:160]}")
            failures += [case.line(r.status_code, p) for p in found]
    assert len(cases) == 30
    assert not failures, report(failures, len(cases))
