"""Every route of the URL configuration × methods × hostile variants × users, in one process (issue
44, item 4): no answer is a 5xx, and each has its area's documented shape.

Routes come from ``django.urls.get_resolver()`` walked recursively (the API under ``/api/`` and
``/v1/``, the schema and docs, the site, the admin, ``/metrics``, ``/healthz``, ``/readyz``); each
path converter is filled with the ids of real objects made here (an uploaded image, a job, a webhook
and one of its deliveries, the active embedding space, a user, a group, a batch record, an OpenAI
batch input file and batch) and with unknown and malformed ids. A route the walk cannot fill fails
the test (:func:`route_template`), so a new route is swept or the sweep is told about it.

Users: ``anonymous``, ``user-token`` and ``user-session`` (one normal user, by token and by Django
session), ``staff`` (a token for the API, a session for the site and the admin).

The shapes (:func:`judge`):

- everywhere: no 5xx; a body sent as JSON parses; a 4xx is at most :data:`MAX_ERROR_BYTES`;
- under ``/api/``: every 4xx is ``{"message": str, "code": snake_case, "extra": {...}}`` as JSON; a
  redirect of a method other than GET/HEAD keeps the method (307/308);
- under ``/v1/``: every 4xx is OpenAI's ``{"error": {"message", "type", "param", "code"}}``;
- the site and the admin: every 4xx is a page of theirs (``text/html``, a whole document with its
  stylesheet), never an empty, plain-text or bare server page;
- ``/healthz``, ``/readyz``, ``/metrics``, ``/favicon.ico``: nothing more (``/readyz`` answers 503 when
  not ready, with the checks that failed: its answer, not a failure).

The sweep is a deterministic product (no random draw): the same cases, in the same order, every run.
Each part collects every failing case as one line ``METHOD URL [variant] as USER -> STATUS: what``
and asserts once at the end. Destructive cases (``DELETE``, the delete pages) run after the others
of their part, in a database of the test's own. What needs a real server (chunked bodies, request
lines at gunicorn's limit) is in ``tests/e2e/test_url_sweep_server.py``.

Cost: about 9,900 requests in four parts (2,700 methods × users, 1,900 query parameters, 2,300
bodies, 3,000 headers and paths), about 33 s of one core on this project's 2-core machine, the
query part (admin change lists, text searches) the largest; plus the fixtures (the model loads
once per session).
"""
from __future__ import annotations

import base64
import contextlib
import inspect
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlsplit

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.signals import got_request_exception
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.converters import (
    IntConverter,
    PathConverter,
    StringConverter,
    UUIDConverter,
)

from tests.embeddings.conftest import jpeg_bytes, upload

pytestmark = pytest.mark.django_db(transaction=True)

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
USERS = ("anonymous", "user-token", "user-session", "staff")
#: An id of no object (a valid uuid4).
UNKNOWN_UUID = "00000000-0000-4000-8000-000000000000"
#: Answers of errors larger than this are refused: an error names the problem, it does not echo the
#: request (the 20,000-part body once answered 1.98 MB).
MAX_ERROR_BYTES = 64 * 1024
SNAKE = re.compile(r"[a-z][a-z0-9_]*\Z")

# --- the routes -------------------------------------------------------------------------------------

CONVERTERS = {UUIDConverter: "uuid", IntConverter: "int", StringConverter: "str", PathConverter: "path"}


@dataclass(frozen=True)
class Route:
    """One route: ``template`` is its path with ``{name}`` for each parameter (the schema's form);
    ``params`` maps each name to its kind: a converter (``uuid``, ``int``, ``str``, ``path``),
    ``choice:a|b`` (a regex alternative) or ``any`` (a regex ``.*``)."""

    template: str
    params: tuple[tuple[str, str], ...]
    name: str | None
    callback: object = field(compare=False, repr=False)


def route_template(pattern) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(template, params)`` of one ``RoutePattern`` or ``RegexPattern``.

    Raises:
        AssertionError: a converter or a regex this sweep cannot fill (tell the sweep about it).
    """
    if hasattr(pattern, "_route"):
        params = []

        def sub(m):
            conv = pattern.converters[m["name"]]
            kind = CONVERTERS.get(type(conv))
            assert kind is not None, f"route {pattern._route!r}: converter {type(conv).__name__} is not swept"
            params.append((m["name"], kind))
            return "{" + m["name"] + "}"

        return re.sub(r"<(?:[^>:]+:)?(?P<name>[^>]+)>", sub, pattern._route), tuple(params)
    regex, params = pattern._regex.removeprefix("^").removesuffix("$"), []

    def group(m):
        body = m["body"]
        if body == ".*":
            params.append((m["name"], "any"))
        else:
            assert re.fullmatch(r"\w+(\|\w+)*", body), f"regex route {pattern._regex!r} is not swept"
            params.append((m["name"], "choice:" + body))
        return "{" + m["name"] + "}"

    template = re.sub(r"\(\?P<(?P<name>\w+)>(?P<body>[^)]*)\)", group, regex)
    assert not re.search(r"[\\^$*+?()\[\]|]", template), f"regex route {pattern._regex!r} is not swept"
    return template, tuple(params)


def routes() -> list[Route]:
    """Every route of the URL configuration, in its order."""
    out = []

    def walk(patterns, prefix, params):
        for p in patterns:
            t, ps = route_template(p.pattern)
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + t, params + ps)
            else:
                assert isinstance(p, URLPattern)
                out.append(Route("/" + prefix + t, params + ps, p.name, p.callback))

    walk(get_resolver().url_patterns, "", ())
    return out


def area(path: str) -> str:
    """``api``, ``v1``, ``ops`` (health, metrics, favicon), ``admin`` or ``site``."""
    if path.startswith("/api/"):
        return "api"
    if path.startswith("/v1/"):
        return "v1"
    if path in ("/healthz", "/readyz", "/metrics", "/favicon.ico"):
        return "ops"
    return "admin" if path.startswith("/admin/") else "site"


def primary_user(template: str) -> str:
    """The user a route is for: the one whose requests reach its view's work."""
    if template.startswith(("/admin/", "/api/stats/", "/api/migrations/")):
        return "staff"
    if template.startswith(("/api/schema/", "/api/docs/", "/api/auth/token/", "/healthz", "/readyz", "/metrics",
                            "/favicon.ico", "/login/")):
        return "anonymous"
    if template.startswith(("/api/", "/v1/")):
        return "user-token"
    return "user-session"


# --- the objects the ids come from --------------------------------------------------------------------

@dataclass
class World:
    """The clients by user, and the real objects whose ids fill the routes."""

    clients: dict[str, Client]
    users: dict[str, object]
    ids: dict[str, str]  # parameter name → a real id (``image_id``, ``job_id``, ...)
    admin_pks: dict[str, str]  # "app_label.model_name" → a real pk shown by the admin
    content_type_id: str


class SweepClient(Client):
    """Django's test client without what the sweep does not read: it keeps no copy of every
    template's context (``store_rendered_templates``: most of an admin page's cost). The exception a
    view raised is kept in ``response.exc_info``, never raised (a 5xx is a finding, not an error)."""

    def request(self, **request):
        environ = self._base_environ(**request)
        uid = f"sweep-exception-{id(request)}"
        got_request_exception.connect(self.store_exc_info, dispatch_uid=uid)
        try:
            response = self.handler(environ)
        finally:
            got_request_exception.disconnect(dispatch_uid=uid)
        response.exc_info, self.exc_info = self.exc_info, None
        if response.cookies:
            self.cookies.update(response.cookies)
        return response


def _client(**defaults) -> Client:
    return SweepClient(raise_request_exception=False, **defaults)


def make_world(user, staff) -> World:
    """An embedded image and a finished job of ``user``, a webhook endpoint of theirs with a
    delivery, the active space, a group and a batch record, a duplicate scan, group and "not
    duplicates" pair of theirs, a batch input file and a batch of it (``/v1``); the four clients."""
    from django.contrib.auth.models import Group
    from django.contrib.contenttypes.models import ContentType
    from rest_framework.authtoken.models import Token

    from embeddings import spaces
    from embeddings.models import (BatchStat, DuplicateGroup, DuplicateMember, DuplicateScan, Image, NotDuplicate,
                                   UsageRecord, WebhookDelivery, WebhookEndpoint)

    token = Token.objects.get_or_create(user=user)[0].key
    staff_token = Token.objects.get_or_create(user=staff)[0].key
    clients = {"anonymous": _client(), "user-token": _client(HTTP_AUTHORIZATION=f"Token {token}"),
               "user-session": _client(), "staff": _client(HTTP_AUTHORIZATION=f"Token {staff_token}")}
    clients["user-session"].force_login(user)
    clients["staff"].force_login(staff)
    api = clients["user-token"]
    r = api.post("/api/images/", {"files": [upload("a.jpg", jpeg_bytes(1))], "k": 0})
    assert r.status_code == 200, r.content
    image = json.loads(r.content)["images"][0]
    r = api.post("/api/jobs/", {"files": [upload("b.jpg", jpeg_bytes(2))]})
    assert r.status_code == 202, r.content
    job = json.loads(r.content)["id"]
    endpoint = WebhookEndpoint.objects.create(owner=user, url="http://127.0.0.1:9/hook", secret="whsec_" + "A" * 32)
    delivery = WebhookDelivery.objects.create(endpoint=endpoint, event="job.done", key=f"job.done:{job}",
                                              message_id="msg_sweep", payload={"type": "job.done", "data": {}},
                                              status="delivered", attempts=1)
    space = spaces.active()
    group = Group.objects.create(name="sweepers")
    stat = BatchStat.objects.order_by("id").first()
    assert stat is not None  # the upload's batch
    scan = DuplicateScan.objects.create(owner=user, model_id=space.model_id, state="done", threshold=0.9)
    dup = DuplicateGroup.objects.create(owner=user, model_id=space.model_id, kind="near", threshold=0.9)
    second = Image.objects.filter(job_id=job).first()
    for im in (image["id"], second.id):
        DuplicateMember.objects.create(group=dup, image_id=im, score=1.0, representative=im == image["id"])
    pair = NotDuplicate.objects.create(owner=user, sha_a="a" * 64, sha_b="b" * 64)
    from embeddings.services.access.keys import key_create

    api_key = key_create(owner=user, name="sweep", scopes=["all"]).key  # /api/keys/{id}/, /keys/{id}/revoke/
    # OpenAI's Batch API (/v1/files, /v1/batches): an input file and a batch of it (run to its end
    # by eager Celery)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "ViT-B-32", "input": "a"}}
    r = api.post("/v1/files", {"file": SimpleUploadedFile("in.jsonl", json.dumps(line).encode() + b"\n"),
                               "purpose": "batch"})
    assert r.status_code == 200, r.content
    batch_file = json.loads(r.content)["id"]
    r = api.post("/v1/batches", {"input_file_id": batch_file, "endpoint": "/v1/embeddings",
                                 "completion_window": "24h"}, content_type="application/json")
    assert r.status_code == 200, r.content
    ids = {"image_id": image["id"], "job_id": job, "webhook_id": str(endpoint.id), "delivery_id": str(delivery.id),
           "space_id": str(space.pk), "id": str(user.pk), "group_id": str(dup.id), "file_id": batch_file,
           "batch_id": json.loads(r.content)["id"], "key_id": str(api_key.pk)}
    admin_pks = {"embeddings.image": image["id"], "embeddings.job": job, "embeddings.batchstat": str(stat.pk),
                 "embeddings.embeddingspace": str(space.pk), "embeddings.webhookendpoint": str(endpoint.id),
                 "embeddings.webhookdelivery": str(delivery.id), "auth.user": str(user.pk),
                 "auth.group": str(group.pk), "authtoken.tokenproxy": str(user.pk),  # TokenAdmin: the user's pk
                 "embeddings.duplicatescan": str(scan.pk), "embeddings.duplicategroup": str(dup.id),
                 "embeddings.notduplicate": str(pair.pk), "embeddings.batchfile": batch_file,
                 "embeddings.batch": ids["batch_id"], "embeddings.apikey": str(api_key.pk),
                 # the upload's image, metered (docs/usage.md)
                 "embeddings.usagerecord": str(UsageRecord.objects.order_by("id").first().pk)}
    assert Image.objects.filter(id=image["id"], status="embedded").exists()
    return World(clients, {"user": user, "staff": staff}, ids, admin_pks,
                 str(ContentType.objects.get_for_model(Image).pk))


@pytest.fixture
def world(service, user, staff, private_redis, settings, monkeypatch) -> World:
    """The app (eager Celery, embedded store, the session's model: ``service``) with a Redis of the
    test's own, declared metadata fields, and :func:`make_world`'s objects and clients."""
    from embeddings.services.lifecycle import cutoff

    prompts = cutoff.prompts()
    settings.REDIS_URL = private_redis[0]  # admission and lane reports in a Redis of the test's own
    settings.METADATA_INDEXES = "category:keyword,price:float,added:datetime,sale:bool"  # the site's filter inputs
    settings.MIGRATION_GATE_SAMPLE = 8
    # the quality gate (POST /api/migrations/{id}/gate/) calibrates on every call under eager Celery:
    # four prompts through the text tower instead of the file's hundreds (the sweep is about the request)
    monkeypatch.setattr(cutoff, "prompts", lambda: prompts[:4])
    return make_world(user, staff)


# --- filling the routes ---------------------------------------------------------------------------------

#: Values of no object, per kind, for each parameter (the others real); those that no converter
#: matches reach the 404 handler.
UNKNOWN = {
    "uuid": [UNKNOWN_UUID, "not-a-uuid"],
    "int": ["999999999", str(10 ** 30), "-1"],
    "str": ["nope", "%00", "%E2%80%AE%F0%9F%98%80"],
    "path": ["999999999", "nope", "%00", str(10 ** 30), "%F0%9F%98%80"],
    "any": ["nope/"],
}


def _real_values(route: Route, name: str, kind: str, w: World) -> list[str]:
    if kind.startswith("choice:"):
        return kind.removeprefix("choice:").split("|")
    if kind == "any":
        return ["nope/"]
    if name == "action":  # each action the view knows (JobActionView.targets, MigrationActionView.actions)
        view = route.callback.view_class
        return sorted(getattr(view, "targets", None) or view.actions)
    if name == "fmt":
        from embeddings.services.exports.formats import FORMATS

        return sorted(FORMATS)
    if route.template.startswith("/admin/r/"):  # view on site: a content type and an object of it
        return [w.content_type_id if name == "content_type_id" else w.ids["image_id"]]
    if name == "object_id":
        app, model = re.match(r"/admin/(\w+)/(\w+)/", route.template).groups()
        return [w.admin_pks[f"{app}.{model}"]]
    return [w.ids[name]]


def instances(route: Route, w: World) -> list[tuple[str, str]]:
    """``(url, fill)`` of a route: each combination of real values (``fill`` ``real``), then each
    unknown or malformed value of one parameter with the others real (``fill`` ``name=value``)."""
    if not route.params:
        return [(route.template, "real")]
    reals = {name: _real_values(route, name, kind, w) for name, kind in route.params}
    combos = [{}]
    for name, values in reals.items():
        combos = [{**c, name: v} for c in combos for v in values]
    out = [(route.template.format(**c), "real") for c in combos]
    for name, kind in route.params:
        others = {n: v[0] for n, v in reals.items()}
        for bad in (["nope"] if kind.startswith("choice:") else UNKNOWN.get(kind, [])):
            if bad not in reals[name]:
                out.append((route.template.format(**{**others, name: bad}), f"{name}={bad}"))
    return out


#: The action a route's hostile variants use: one that reads the request and changes nothing
#: that later cases need (``pause`` a finished job: 409; ``promote`` the active space: 409).
VARIANT_ACTION = {"job-action": "pause", "migration-action": "promote"}


def real_url(route: Route, w: World) -> str:
    """The route filled with real ids: the URL its hostile variants are sent to."""
    urls = [url for url, fill in instances(route, w) if fill == "real"]
    action = VARIANT_ACTION.get(route.name)
    return next(u for u in urls if u.endswith(f"/{action}/")) if action else urls[0]


# --- the query parameters each view reads -----------------------------------------------------------

#: Names read in a view's source: ``request.query_params.get("x")``, ``request.GET["x"]``,
#: ``"x" in request.query_params``, ``source.get("x")`` (the site reads GET or POST as ``source``).
READS = re.compile(r"""(?:query_params|GET|POST|source)\s*(?:\.get(?:list)?\(\s*|\[\s*)["']([\w-]+)["']"""
                   r"""|["']([\w-]+)["']\s+(?:not\s+)?in\s+request\.(?:query_params|GET)""")
TEMPLATES = Path(__file__).resolve().parents[2] / "embeddings" / "templates"


def _view_object(callback):
    view = getattr(callback, "view_class", None) or getattr(callback, "cls", None)
    return view or inspect.unwrap(callback)


def code_params(route: Route) -> set[str]:
    """The query names a route's view reads, found in its source and its templates' ``request.GET.x``."""
    try:
        source = inspect.getsource(_view_object(route.callback))
    except (TypeError, OSError):
        return set()
    names = {a or b for a, b in READS.findall(source)}
    for template in re.findall(r"""["'](site/[\w-]+\.html)["']""", source):
        names |= set(re.findall(r"request\.GET\.(\w+)", (TEMPLATES / template).read_text()))
    view = _view_object(route.callback)
    if hasattr(view, "redirect_field_name"):  # Django's LoginView / LogoutView: ?next=
        names.add(view.redirect_field_name)
    return names


def schema_params() -> dict[str, set[str]]:
    """``{path template: query parameter names}`` of the served OpenAPI schema (every operation)."""
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    return {path: {p["name"] for op in ops.values() if isinstance(op, dict) for p in op.get("parameters", [])
                   if p.get("in") == "query"} for path, ops in schema["paths"].items()}


#: The admin's generic query names (popups, to-field, the change list's carried filters, paging)
#: are one code path for every model: swept on this model's pages; each change list's own filters,
#: search and ordering on every model.
ADMIN_REFERENCE = "/admin/embeddings/image/"


def admin_params(route: Route, w: World) -> set[str]:
    """The admin's own query names (``django.contrib.admin.views.main``), and on a change list the
    filter names its page links to (``?status__exact=...``), with its search and ordering."""
    from django.contrib.admin.views import main

    if route.name == "autocomplete":
        return {"app_label", "model_name", "field_name", "term", "page"}
    if route.name in ("login", "logout"):
        return {"next"}
    generic = {main.IS_POPUP_VAR, main.TO_FIELD_VAR, "_changelist_filters"} \
        if route.template.startswith(ADMIN_REFERENCE) else set()
    if not (route.name or "").endswith("_changelist"):
        return generic
    page = w.clients["staff"].get(route.template)
    linked = {k for href in re.findall(r'href="(\?[^"]*)"', page.content.decode())
              for k, _ in parse_qsl(href[1:].replace("&amp;", "&"), keep_blank_values=True)}
    if generic:
        generic |= {main.ALL_VAR, main.PAGE_VAR, main.ERROR_FLAG, main.IS_FACETS_VAR}
    else:
        linked.discard(main.IS_FACETS_VAR)  # "show counts": generic
    return generic | linked | {main.ORDER_VAR, main.SEARCH_VAR}


def site_form_fields(route: Route) -> set[str]:
    """The form fields a site page reads besides those in its source: the search page's filter
    inputs (``m-<field>...``, ``site.fields.FilterForm``), the jobs page's two job forms, the
    sign-in form."""
    from django.contrib.auth.forms import AuthenticationForm

    from embeddings.services.catalogue import reading
    from embeddings.site import views
    from embeddings.site.fields import FilterForm

    if route.name == "site-search":
        return set(FilterForm(reading.declared_types()).fields)
    if route.name == "site-jobs":
        return {name for form in views.JOB_FORMS.values() for name in form.base_fields}
    if route.name == "login":
        return set(AuthenticationForm.base_fields)
    return set()


#: Hostile values for every query parameter (raw query-string text, percent-encoded where needed).
QUERY_VALUES = {
    "crlf": "a%0D%0Ab", "nul": "a%00b", "unicode": "%C3%A9%E2%98%83%F0%9F%98%80%E2%80%AE",
    "bad-utf8": "%FF%FE", "huge-int": str(10 ** 30), "inf": "1e309", "negative": "-1", "empty": "",
    "long": "x" * 5000, "quotes": "%22%27%3C%3E%5C",
}


def b64(text: bytes) -> str:
    return quote(base64.b64encode(text).decode(), safe="")


#: Tampered pagination cursors (DRF ``CursorPagination``: base64 of ``o``, ``r``, ``p``).
CURSORS = {
    "p=garbage": b64(b"p=garbage"), "r=1&p=NUL": b64(b"r=1&p=\x00"), "o=huge": b64(b"o=" + str(10 ** 30).encode()),
    "o=-1": b64(b"o=-1"), "p=date": b64(b"p=2020-01-01+00%3A00%3A00%2B00%3A00"),
    "p=uuid": b64(b"p=" + UNKNOWN_UUID.encode()),
    "not-base64": "%21%21%21", "not-ascii": b64(b"\xff\xfe\x00"), "r=junk": b64(b"r=junk&p=1"),
    "p=1e309": b64(b"p=1e309"),
}

# --- bodies and headers ----------------------------------------------------------------------------------

DEEP = 10_000


def huge_json() -> bytes:
    """12.8 MB of JSON (a list of short strings), over UPLOAD_MAX_FORM_BYTES (10 MiB)."""
    return b"[" + b'"xxxxxxxxxxxxxxxxxxxxxxxxxxxxx",' * 400_000 + b'"x"]'


#: ``variant: (Content-Type, body)``; ``huge-json`` (:func:`huge_json`) is added by the test that sends it.
BODIES = {
    "deep-json-array": ("application/json", ("[" * DEEP + "]" * DEEP).encode()),
    "deep-json-field": ("application/json", ('{"text": ' + "[" * DEEP + "]" * DEEP + ', "input": '
                                             + "[" * DEEP + "]" * DEEP + ', "k": 3}').encode()),
    "deep-json-object": ("application/json", ('{"a":' * DEEP + "1" + "}" * DEEP).encode()),
    "json-null": ("application/json", b"null"),
    "json-list": ("application/json", b"[]"),
    "json-number": ("application/json", b"1e309"),
    "json-nan": ("application/json", b'{"text": "a", "k": NaN, "input": "a", "url": "http://x/"}'),
    "json-bad-utf8": ("application/json", b'{"text": "\xff\xfe", "input": "\xff"}'),
    "json-truncated": ("application/json", b'{"text": "a'),
    "json-big-int": ("application/json", b'{"k": 1' + b"0" * 5000 + b"}"),
    "json-empty": ("application/json", b""),
    "json-bad-charset": ("application/json; charset=x-no-such-charset", b'{"text": "a"}'),
    "text-plain": ("text/plain", b"hello"),
    "xml": ("application/xml", b"<a>1</a>"),
    "multipart-no-boundary": ("multipart/form-data", b"garbage"),
    "multipart-garbage": ("multipart/form-data; boundary=zz", b"--zz\r\ngarbage"),
    "form-hostile": ("application/x-www-form-urlencoded",
                     b"text=%00&k=1e309&name=a%0D%0Ab&q=%00&url=%FF&source=manifest&prefix=%00&deadline=-1&post=yes"),
    "no-content-type": ("", b"abc"),
}

#: Field values for a JSON object with every field of the operation's request body set to one of them.
FIELD_VALUES = {"fields=huge-int": 10 ** 30, "fields=nul": "a\x00b", "fields=negative": -1,
                "fields=unicode": "\u202e\U0001F600"}

ACCEPTS = {
    "accept=html": "text/html",
    "accept=browser": "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8",
    "accept=xml": "application/xml",
    "accept=junk-q": "*/*;q=junk",
    "accept=empty": "",
    "accept=nothing-served": "image/png",
}

# --- sending and judging --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    method: str
    url: str
    variant: str
    user: str
    content_type: str | None = None
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    def line(self, status, what: str) -> str:
        url = self.url if len(self.url) <= 140 else self.url[:120] + f"...({len(self.url)} chars)"
        return f"{self.method} {url} [{self.variant}] as {self.user} -> {status}: {what}"


def destructive(case: Case) -> bool:
    """Cases that remove or change the real objects the others use: run last."""
    return case.method == "DELETE" or "/delete/" in case.url or "/logout/" in case.url or (
        case.method != "GET" and re.search(r"/(cancel|promote|rollback|rotate|password|revoke)/", case.url) is not None)


def _page(text: str) -> bool:
    """A whole HTML document with a stylesheet: the site's layout or the admin's, not a server's
    bare page (Django's default error pages and gunicorn's link none)."""
    low = text.lower()
    return "<html" in low and "</html>" in low and 'rel="stylesheet"' in low


def judge(case: Case, status: int, ctype: str, body: bytes, exc: str | None = None) -> list[str]:
    """What is wrong with an answer (``status``, ``Content-Type``, ``body``; ``exc``: the exception
    the view raised, if any) to ``case``: empty when nothing."""
    if status == 503 and urlsplit(case.url).path == "/readyz" and exc is None:
        # not ready is /readyz's answer, not a failure of it: a body naming the checks that failed
        if case.method == "HEAD":
            return []
        data = json.loads(body) if ctype.startswith("application/json") and body else {}
        return [] if data.get("ready") is False and data.get("failed") else [f"a 503 without its checks: {body[:160]!r}"]
    if status >= 500:
        return [f"5xx ({exc or body[:160].decode(errors='replace')})"]
    out = []
    where = area(urlsplit(case.url).path or "/")
    if where in ("api", "v1") and 300 <= status < 400 and case.method not in ("GET", "HEAD") \
            and status not in (304, 307, 308):
        out.append(f"a {case.method} redirected with {status}: the client repeats it as a GET")
    if not 400 <= status < 500 or case.method == "HEAD":
        if ctype.startswith("application/json") and body:
            try:
                json.loads(body)
            except ValueError:
                out.append("Content-Type JSON, body not JSON")
        return out
    if len(body) > MAX_ERROR_BYTES:
        out.append(f"an error answer of {len(body)} bytes")
    if where in ("api", "v1"):
        if not ctype.startswith("application/json"):
            return out + [f"not JSON ({ctype or 'no Content-Type'}): {body[:80]!r}"]
        try:
            data = json.loads(body)
        except ValueError:
            return out + [f"not JSON: {body[:80]!r}"]
        if where == "api" and not (isinstance(data, dict) and set(data) == {"message", "code", "extra"}
                                   and isinstance(data["message"], str) and isinstance(data["code"], str)
                                   and SNAKE.match(data["code"]) and isinstance(data["extra"], dict)):
            out.append(f"not the error shape: {body[:120]!r}")
        elif where == "v1" and not (isinstance(data, dict) and set(data) == {"error"} and isinstance(data["error"], dict)
                  and set(data["error"]) == {"message", "type", "param", "code"}):
            out.append(f"not OpenAI's error shape: {body[:120]!r}")
    elif where in ("site", "admin") and not (ctype.startswith("text/html") and _page(body.decode(errors="replace"))):
        out.append(f"not a page of the site or the admin ({ctype or 'no Content-Type'}, {len(body)} bytes): "
                   f"{body[:60]!r}")
    return out


def problems(case: Case, r) -> list[str]:
    """:func:`judge` of a test client's answer (a streamed body is read whole)."""
    exc = getattr(r, "exc_info", None)
    body = b"" if case.method == "HEAD" else (b"".join(r.streaming_content) if r.streaming else r.content)
    return judge(case, r.status_code, r.get("Content-Type", ""), body,
                 f"{exc[0].__name__}: {str(exc[1])[:160]}" if exc else None)


@contextlib.contextmanager
def quiet():
    """No log records while sweeping: a 5xx is reported by the sweep itself, with its exception."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def send(w: World, case: Case):
    extra = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in case.headers}
    if case.content_type is not None:
        extra["CONTENT_TYPE"] = case.content_type
    client = w.clients[case.user]
    return client.generic(case.method, case.url, data=case.body, content_type=case.content_type or "", **extra)


def sweep(w: World, cases: list[Case]) -> list[str]:
    """Send every case (destructive ones last), and the lines of those that fail."""
    failures = []
    ordered = sorted(cases, key=destructive)
    with quiet():
        for case in ordered:
            try:
                r = send(w, case)
                found = problems(case, r)
            except Exception as e:  # noqa: BLE001 - raised outside the handler (a streamed body): a finding too
                found, r = [f"raised {type(e).__name__}: {str(e)[:160]}"], None
            failures += [case.line(r.status_code if r is not None else "-", p) for p in found]
            if case.user in ("user-session", "staff") and "logout" in case.url:  # signed out: sign in again
                u = w.users["staff" if case.user == "staff" else "user"]
                if type(u).objects.filter(pk=u.pk).exists():  # unless a delete page removed the user
                    w.clients[case.user].force_login(u)
    return failures


def report(failures: list[str], n: int) -> str:
    return f"{len(failures)} failing of {n} cases:\n" + "\n".join(failures)


# --- the parts ---------------------------------------------------------------------------------------------

def test_every_route_method_and_user(world):
    """Every route filled with real ids × every method × every user; filled with unknown and
    malformed ids × every method as the route's own user (the others are refused before any lookup).
    The admin answers every method but POST as GET, and sends everyone but staff to sign in whatever
    the method: there, GET and POST for those cases. Plain requests."""
    cases = []
    for route in routes():
        own = primary_user(route.template)
        for url, fill in instances(route, world):
            for user in (USERS if fill == "real" else (own,)):
                methods = ("GET", "POST") if area(url) == "admin" and (fill != "real" or user != "staff") else METHODS
                cases += [Case(method, url, fill, user) for method in methods]
    failures = sweep(world, cases)
    assert not failures, report(failures, len(cases))


def query_names(route: Route, w: World, declared: dict[str, set[str]]) -> set[str]:
    """The query (and, on the site, form) names a route's view reads: the schema's, those in its
    source and templates, DRF's ``format`` on the API, the admin's own and its pages' links."""
    where = area(route.template)
    names = set(declared.get(route.template, ())) | code_params(route) | site_form_fields(route)
    if where == "admin":
        names |= admin_params(route, w)
    if where in ("api", "v1"):
        names.add("format")  # DRF's URL_FORMAT_OVERRIDE: every API view reads it
    if route.template == "/api/schema/":
        names |= {"version", "lang"}  # drf-spectacular's SpectacularAPIView reads them
    return names


def test_hostile_query_parameters(world):
    """Every query parameter each route's view reads (:func:`query_names`) × hostile values (CR/LF,
    NUL, odd Unicode, bad UTF-8, huge and non-finite numbers, -1, empty, 5,000 characters, quotes,
    given twice), GET as the route's own user; on the site pages that take a POST, the same names
    as form fields; tampered pagination cursors on every list; a 64 KB query string."""
    declared = schema_params()
    cases = []
    for route in routes():
        url = real_url(route, world)
        user = primary_user(route.template)
        names = sorted(query_names(route, world, declared))
        posts = area(url) == "site" and route.name in ("site-search", "site-jobs", "login")
        for name in names:
            for variant, value in QUERY_VALUES.items():
                cases.append(Case("GET", f"{url}?{quote(name)}={value}", f"{name}={variant}", user))
                if posts:
                    cases.append(Case("POST", url, f"form {name}={variant}", user,
                                      "application/x-www-form-urlencoded", f"{quote(name)}={value}".encode()))
            cases.append(Case("GET", f"{url}?{quote(name)}=a&{quote(name)}=b", f"{name}=twice", user))
        if "cursor" in names:
            cases += [Case("GET", f"{url}?cursor={cursor}", f"cursor={variant}", user)
                      for variant, cursor in CURSORS.items()]
        cases.append(Case("GET", f"{url}?{'&'.join(f'p{i}=' + 'x' * 60 for i in range(1000))}", "query=64KB", user))
    failures = sweep(world, cases)
    assert not failures, report(failures, len(cases))


def _request_fields() -> dict[str, set[str]]:
    """``{path template: names of its request bodies' fields}`` from the served schema."""
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    comps = schema.get("components", {}).get("schemas", {})
    out: dict[str, set[str]] = {}
    for path, ops in schema["paths"].items():
        for op in ops.values():
            for media in (op.get("requestBody") or {}).get("content", {}).values():
                ref = media.get("schema", {}).get("$ref", "")
                out.setdefault(path, set()).update(comps.get(ref.rpartition("/")[2], {}).get("properties", {}))
    return out


#: The bodies the site's and the admin's views can tell apart: they read forms (a POST; their
#: other methods answer as GET or 405, swept in the first part).
PAGE_BODIES = ("form-hostile", "multipart-no-boundary", "multipart-garbage", "json-bad-charset", "no-content-type",
               "deep-json-array", "text-plain")


def test_hostile_bodies(world):
    """API routes × POST, PUT, PATCH × every body of :data:`BODIES` (deep and huge JSON, JSON that
    is not an object, wrong and unparseable Content-Types) and a JSON object with every field of
    the operation's request body set to a huge integer, NUL text, -1 or odd Unicode, as the route's
    own user; the same POSTs as anonymous (refused before the body is read, unless the route is
    public); the huge body once per route. Site and admin routes × POST × the bodies a form view
    can tell apart, as their own user."""
    fields = _request_fields()
    bodies = {**BODIES, "huge-json": ("application/json", huge_json())}
    cases = []
    for route in routes():
        url = real_url(route, world)
        own = primary_user(route.template)
        if area(url) not in ("api", "v1"):
            cases += [Case("POST", url, variant, own, *BODIES[variant]) for variant in PAGE_BODIES]
            continue
        for user in dict.fromkeys((own, "anonymous")):
            for method in (("POST", "PUT", "PATCH") if user == own else ("POST",)):
                cases += [Case(method, url, variant, user, ctype, body) for variant, (ctype, body) in bodies.items()
                          if variant != "huge-json" or (user == own and method == "POST")]
                names = sorted(fields.get(route.template) or ())
                cases += [Case(method, url, variant, user, "application/json",
                               json.dumps({n: value for n in names}).encode())
                          for variant, value in FIELD_VALUES.items() if names]
    failures = sweep(world, cases)
    assert not failures, report(failures, len(cases))


#: The admin renders HTML whatever is asked: these show that no ``Accept`` breaks it.
ADMIN_ACCEPTS = ("accept=xml", "accept=junk-q", "accept=empty")


def test_hostile_headers_and_paths(world):
    """Odd and browser ``Accept`` headers × GET, POST, OPTIONS as anonymous and the route's own user
    (the admin, which answers HTML whatever is asked: :data:`ADMIN_ACCEPTS`, GET as staff); the
    path without its trailing slash (or with one added) × every method; a path segment of 8 KB and
    one of 2,000 RTL marks; unsafe methods from a session without a CSRF token."""
    cases = []
    for route in routes():
        url = real_url(route, world)
        own = primary_user(route.template)
        admin = area(url) == "admin"
        for user in ((own,) if admin else dict.fromkeys((own, "anonymous"))):
            cases += [Case(method, url, variant, user, headers=(("Accept", accept),))
                      for variant, accept in ACCEPTS.items() if not admin or variant in ADMIN_ACCEPTS
                      for method in (("GET",) if admin else ("GET", "POST", "OPTIONS"))]
        other = url[:-1] if url.endswith("/") else url + "/"
        if other:
            cases += [Case(method, other, "slash", own) for method in METHODS]
        cases.append(Case("GET", url + "x" * 8192, "path=8KB", own))
        cases.append(Case("GET", url.rstrip("/") + "/" + "%E2%80%AE" * 2000 + "/", "path=unicode", own))
    failures = sweep(world, cases)
    # a session without a CSRF token: refused, in the area's shape
    strict = {"user-session": _client(enforce_csrf_checks=True), "staff": _client(enforce_csrf_checks=True)}
    strict["user-session"].force_login(world.users["user"])
    strict["staff"].force_login(world.users["staff"])
    csrf = [Case(method, real_url(route, world), "no-csrf-token", user)
            for route in routes() for user in ("user-session", "staff")
            for method in ("POST", "PUT", "PATCH", "DELETE")]
    w = World({**world.clients, **strict}, world.users, world.ids, world.admin_pks, world.content_type_id)
    failures += sweep(w, csrf)
    assert not failures, report(failures, len(cases) + len(csrf))


def test_the_admin_reads_ids_its_keys_cannot_hold_and_an_empty_to_field(staff):
    """Two 500s of Django's admin the sweep found: "view on site" with an id a uuid key cannot hold
    (``embeddings.admin.view_on_site``: 404), and ``?_to_field=`` given empty on an object's page
    (``CheckedActionsMixin.get_object``: the primary key, as when absent)."""
    from django.contrib.auth.models import Group
    from django.contrib.contenttypes.models import ContentType

    from embeddings.models import Image

    client = Client()
    client.force_login(staff)
    image_type = ContentType.objects.get_for_model(Image).pk
    for object_id in ("nope", "999999999", "%F0%9F%98%80"):
        r = client.get(f"/admin/r/{image_type}/{object_id}/")
        assert (r.status_code, r["Content-Type"]) == (404, "text/html; charset=utf-8"), object_id
    group = Group.objects.create(name="sweepers")
    for page in ("change", "delete"):
        r = client.get(f"/admin/auth/group/{group.pk}/{page}/?_to_field=")
        assert r.status_code == 200 and "sweepers" in r.content.decode(), page
