"""The site's forms for catalogue jobs and metadata (issue 41): a job from a manifest or a prefix,
the search page's filter on the declared metadata fields, and metadata shown compactly.

Django forms check what a person typed (numbers, dates, one source per job); the services check the
rest and refuse with an ``ApplicationError`` that the page shows. The filter form turns its inputs
into the API's filter JSON (``workers.vector_store.filters``), so the page and the API search the
same way.
"""
from __future__ import annotations

import datetime as dt
import functools
import json
import re
import uuid
from typing import Any, Sequence
from urllib.parse import urlencode

from django import forms
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import DisallowedRedirect
from django.urls import reverse

from embeddings.api.catalogue_fields import search_filter
from embeddings.errors import ApplicationError
from embeddings.models import JobPriority
from project.processes import REQUEST_LINE_BYTES
from workers.vector_store import DEFAULT_STRATEGY, STRATEGIES
from workers.vector_store.filters import MAX_STRING

#: Name endings a manifest file chooser offers (``manifests.sniff_format`` reads the bytes anyway).
MANIFEST_ACCEPT = ".csv,.tsv,.txt,.jsonl,.ndjson,.json,.parquet,text/csv,application/x-ndjson,application/json"
#: Characters of a metadata value shown on a result card or in a list before it is cut with "…".
VALUE_CHARS = 60
#: Prefix of the search page's filter inputs: ``m-<field>``, ``m-<field>-min`` ... ``-`` cannot be
#: part of a field name (``filters.check_field``), so no two fields' inputs share a name.
FILTER_PREFIX = "m-"
#: The id of the search page's text search form, which the filter inputs belong to.
TEXT_FORM = "text-search"
#: Bool inputs' answers.
_YES_NO = (("", "any"), ("yes", "yes"), ("no", "no"))
#: Characters of a search text on its own (the API's ``SearchSerializer.text``); the page's form may
#: allow fewer (:func:`search_maxlengths`).
SEARCH_TEXT_CHARS = 2000
#: Characters of a number input: ``-9223372036854775808`` is 20, a float's shortest form at most 24
#: (``-1.7976931348623157e+308``). Number inputs are text inputs (``inputmode``): ``maxlength`` does not
#: apply to ``type="number"``, whose value may be any number of digits.
NUMBER_CHARS = 24
#: The character that makes a URL longest per ``maxlength`` unit: 3 UTF-8 bytes, each percent-encoded
#: (9 bytes in the search URL, 15 once that URL is the ``next`` of the sign-in URL).
_WIDEST = "\u4e2d"
#: The longest value a browser's date input sends (year 275760, the end of ECMAScript's time range).
LONGEST_DATE = "275760-09-13"
#: The diversity the search page's "diverse results" toggle sends (MMR's 1 − lambda, docs/search.md):
#: halfway between the plain top-k (0) and the candidates least like the hits picked before (1).
DIVERSE = 0.5
#: The longest ``format(x, "g")`` of a float in [0, 1] (a subnormal): the page writes a diversity so
#: in its links and its toggle (:func:`diversity_text`).
LONGEST_DIVERSITY = "4.94066e-324"
#: The search by examples' strategies in words, in ``workers.vector_store.STRATEGIES`` order.
STRATEGY_WORDS = {"best_score": "best score", "sum_scores": "sum of scores", "average_vector": "average vector"}


class _JobFields(forms.Form):
    """What every catalogue job takes besides its source (the API's ``JobCreateSerializer``).
    Each form's element ids start with its ``source`` (both forms are on one page)."""

    source: str = ""

    name = forms.CharField(required=False, max_length=200, label="Name (optional)")
    priority = forms.ChoiceField(choices=JobPriority.choices, initial=JobPriority.BACKGROUND, required=False)
    deadline = forms.DateTimeField(required=False, label="Deadline (UTC, optional)",
                                   widget=forms.DateTimeInput(attrs={"type": "datetime-local"},
                                                              format="%Y-%m-%dT%H:%M"))

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("auto_id", f"{self.source}-%s")
        super().__init__(*args, **kwargs)

    def job_options(self) -> dict:
        """``name``, ``priority``, ``deadline`` for ``reading.job_create_from_*`` (after ``is_valid``)."""
        v = self.cleaned_data
        return {"name": v["name"], "priority": v["priority"] or JobPriority.BACKGROUND, "deadline": v["deadline"]}


class ManifestJobForm(_JobFields):
    """A job from a manifest: an uploaded file, or ``s3://bucket/key`` in an allowed bucket;
    ``bucket`` for the manifest's bare keys."""

    source = "manifest"
    manifest = forms.FileField(required=False, label="Manifest file",
                               widget=forms.FileInput(attrs={"accept": MANIFEST_ACCEPT}))
    manifest_key = forms.CharField(required=False, max_length=2048, label="or its address in a bucket",
                                   widget=forms.TextInput(attrs={"placeholder": "s3://bucket/catalogue.csv",
                                                                 "spellcheck": "false"}))
    bucket = forms.CharField(required=False, max_length=2048, label="Bucket of bare keys (optional)",
                             widget=forms.TextInput(attrs={"placeholder": "s3://bucket", "spellcheck": "false"}))

    field_order = ("manifest", "manifest_key", "bucket", "name", "priority", "deadline")

    def clean(self):
        data = super().clean()
        given = bool(data.get("manifest")) + bool((data.get("manifest_key") or "").strip())
        if given != 1:
            raise forms.ValidationError("Choose a manifest file or give its s3:// address (one of the two).",
                                        code="mixed_sources" if given else "invalid")
        return data


class PrefixJobForm(_JobFields):
    """A job from every object under ``s3://bucket/prefix``, optionally only some name endings."""

    source = "prefix"

    prefix = forms.CharField(max_length=2048, label="Bucket and folder",
                             widget=forms.TextInput(attrs={"placeholder": "s3://bucket/photos/",
                                                           "spellcheck": "false"}))
    extensions = forms.CharField(required=False, max_length=256, label="Only these endings (optional)",
                                 widget=forms.TextInput(attrs={"placeholder": "jpg, png", "spellcheck": "false"}))

    field_order = ("prefix", "extensions", "name", "priority", "deadline")

    def clean_extensions(self) -> list[str]:
        """``"jpg, .PNG webp"`` → ``["jpg", ".PNG", "webp"]`` (the service adds dots, lower-cases)."""
        return [e for e in re.split(r"[\s,;]+", self.cleaned_data.get("extensions") or "") if e]


class SearchOptionsForm(forms.Form):
    """What every search on the search page takes besides its query (the API's ``SearchSerializer``):
    ``diversity`` in [0, 1] (absent or empty: 0, the plain top-k; the page's toggle sends
    :data:`DIVERSE`) and, for a search by examples, ``strategy`` (absent: ``best_score``).
    NaN and infinity are refused ("Enter a number."), as the API refuses them."""

    diversity = forms.FloatField(required=False, min_value=0, max_value=1)
    strategy = forms.ChoiceField(required=False, choices=[(s, STRATEGY_WORDS[s]) for s in STRATEGIES])

    def options(self) -> dict:
        """``{"diversity": float, "strategy": str}`` of a valid form.

        Raises:
            ApplicationError: ``invalid`` (400) naming the field (:func:`form_error`).
        """
        if not self.is_valid():
            raise form_error(self)
        v = self.cleaned_data
        return {"diversity": v["diversity"] or 0.0, "strategy": v["strategy"] or DEFAULT_STRATEGY}


def diversity_text(diversity: float) -> str:
    """``diversity`` as the page writes it into links and its toggle: ``format(x, "g")`` ("0.5"),
    "" for 0 (the plain top-k: nothing to carry)."""
    return format(diversity, "g") if diversity else ""


def form_error(form: forms.Form) -> ApplicationError:
    """A form's first problem as the application's error (400), so pages show every refusal one way.

    The code is ``mixed_sources`` for a job given two sources, ``invalid`` otherwise; the message
    names the field.
    """
    for field, errors in form.errors.as_data().items():
        e = errors[0]
        message = " ".join(e.messages)
        label = form[field].label if field in form.fields else None
        return ApplicationError(f"{label}: {message}" if label else message,
                                code="mixed_sources" if e.code == "mixed_sources" else "invalid", status=400)
    return ApplicationError("the form is not valid", code="invalid", status=400)


class FilterForm(forms.Form):
    """The search page's filter: inputs for each declared metadata field (``{field: type}``,
    ``reading.declared_types()``), all optional and combined with AND.

    Inputs per type: keyword, a text that the value equals (``m-<field>``); integer and float, a
    least and a most value (``m-<field>-min`` / ``-max``, both included); datetime, a first and a
    last day (``-from`` / ``-to``, UTC, both days included); bool, any / yes / no.
    """

    def __init__(self, declared: dict[str, str], data=None) -> None:
        super().__init__(data=data)
        self.declared = dict(declared)
        maxlengths = search_maxlengths(self.declared)
        for field, kind in self.declared.items():
            for suffix, form_field in _inputs(field, kind):
                name = FILTER_PREFIX + field + suffix
                if name in maxlengths:  # what the browser lets a person type; the server checks its own limits
                    form_field.widget.attrs["maxlength"] = str(maxlengths[name])
                self.fields[name] = form_field

    def groups(self) -> list[dict]:
        """For the template, one entry per declared field: ``{"field", "type", "inputs": [(label,
        bound field)]}`` (one input for keyword and bool, two for the others)."""
        out = []
        for field, kind in self.declared.items():
            inputs = [(f.label, self[FILTER_PREFIX + field + suffix]) for suffix, f in _inputs(field, kind)]
            out.append({"field": field, "type": kind, "inputs": inputs})
        return out

    def used(self) -> dict[str, str]:
        """The filled inputs by name, as submitted (to carry the filter into links and other forms)."""
        if not self.is_bound:
            return {}
        return {name: str(self.data.get(name)).strip() for name in self.fields
                if str(self.data.get(name) or "").strip()}

    def where(self) -> dict | None:
        """The filter JSON of the filled inputs (validated by ``search_filter``), None when none.

        Raises:
            ApplicationError: ``invalid`` (400) for a value that is not a number or a date;
                ``invalid_filter`` (400) for one the filter grammar refuses (a text over
                ``filters.MAX_STRING`` characters).
        """
        if not self.is_bound:
            return None
        if not self.is_valid():
            name, errors = next(iter(self.errors.as_data().items()))
            field, _, end = name.removeprefix(FILTER_PREFIX).rpartition("-")  # "price-min" (no "-" in fields)
            label = f"{field} ({end})" if field else end
            raise ApplicationError(f"{label}: {' '.join(errors[0].messages)}", code="invalid", status=400)
        v = self.cleaned_data
        conditions: list[dict] = []
        for field, kind in self.declared.items():
            name = FILTER_PREFIX + field
            if kind == "keyword":
                if v[name]:
                    conditions.append({"field": field, "eq": v[name]})
            elif kind == "bool":
                if v[name]:
                    conditions.append({"field": field, "eq": v[name] == "yes"})
            elif kind in ("integer", "float"):
                bounds = {op: v[name + s] for op, s in (("gte", "-min"), ("lte", "-max")) if v[name + s] is not None}
                if bounds:
                    conditions.append({"field": field, **bounds})
            else:  # datetime: whole days, the last one included (before the next day begins)
                bounds = {}
                if v[name + "-from"]:
                    bounds["gte"] = v[name + "-from"].isoformat()
                if v[name + "-to"]:
                    bounds["lt"] = (v[name + "-to"] + dt.timedelta(days=1)).isoformat()
                if bounds:
                    conditions.append({"field": field, **bounds})
        if not conditions:
            return None
        return search_filter(conditions[0] if len(conditions) == 1 else {"and": conditions})


def _inputs(field: str, kind: str) -> list[tuple[str, forms.Field]]:
    """``[(name suffix, form field)]`` of one declared field's inputs (:class:`FilterForm`). Each
    input belongs to the text search's form (``form="text-search"``) wherever the page puts it."""
    attrs = {"form": TEXT_FORM}
    if kind == "keyword":
        return [("", forms.CharField(required=False, max_length=MAX_STRING, label=field,
                                     widget=forms.TextInput(attrs={**attrs, "spellcheck": "false"})))]
    if kind == "bool":
        return [("", forms.ChoiceField(required=False, choices=_YES_NO, label=field, widget=forms.Select(attrs=attrs)))]
    if kind == "integer":
        return [(s, forms.IntegerField(required=False, label=label, min_value=-(2**63), max_value=2**63 - 1,
                                       widget=forms.TextInput(attrs={**attrs, "inputmode": "numeric"})))
                for s, label in (("-min", "min"), ("-max", "max"))]
    if kind == "float":
        return [(s, forms.FloatField(required=False, label=label,
                                     widget=forms.TextInput(attrs={**attrs, "inputmode": "decimal"})))
                for s, label in (("-min", "min"), ("-max", "max"))]
    if kind == "datetime":
        return [(s, forms.DateField(required=False, label=label,
                                    widget=forms.DateInput(attrs={**attrs, "type": "date"}, format="%Y-%m-%d")))
                for s, label in (("-from", "from"), ("-to", "to"))]
    raise ValueError(f"metadata field {field!r}: unknown type {kind!r}")


def search_maxlengths(declared: dict[str, str]) -> dict[str, int]:
    """``{input name: maxlength}`` of the search page's text form: ``q`` and the filter inputs a person
    types into (a keyword, a number), so that the longest URL the form can send, and the sign-in URL
    that carries it in ``next`` once the session has ended, fit gunicorn's request line
    (``project.processes.REQUEST_LINE_BYTES``); a longer one gets gunicorn's bare 414 page. Numbers
    keep :data:`NUMBER_CHARS`; ``q`` and the keywords share the rest in proportion to what each takes
    on its own (:data:`SEARCH_TEXT_CHARS`, ``filters.MAX_STRING``): about 530 characters for ``q``
    with no filter field declared, more than the model's 77 tokens read. ``declared``: ``{field: type}``."""
    return dict(_search_maxlengths(tuple(declared.items())))


@functools.lru_cache(maxsize=8)
def _search_maxlengths(declared: tuple[tuple[str, str], ...]) -> tuple[tuple[str, int], ...]:
    an_id = str(uuid.UUID(int=0))
    # the page's own links add like / all to the form's fields; the toggle or a link, a diversity
    fixed = {"like": an_id, "job": an_id, "all": "1", "diversity": LONGEST_DIVERSITY}
    numbers, shared = {}, {"q": SEARCH_TEXT_CHARS}
    for field, kind in declared:
        for suffix, _ in _inputs(field, kind):
            name = FILTER_PREFIX + field + suffix
            if kind == "keyword":
                shared[name] = MAX_STRING
            elif kind in ("integer", "float"):
                numbers[name] = NUMBER_CHARS
            else:
                fixed[name] = LONGEST_DATE if kind == "datetime" else "yes"
    room = REQUEST_LINE_BYTES - len("GET  HTTP/1.1")

    def sizes(per_mille: int) -> dict[str, int]:
        return {**numbers, **{name: max(1, n * per_mille // 1000) for name, n in shared.items()}}

    def longest(per_mille: int) -> int:
        url = reverse("site-search") + "?" + urlencode(
            {**fixed, **{name: _WIDEST * n for name, n in sizes(per_mille).items()}})
        try:
            return max(len(url), len(redirect_to_login(url)["Location"]))
        except DisallowedRedirect:  # Django's own bound on a Location (16,384 characters): far too long
            return len(url) * 2

    low, high = 0, 1000  # the largest share that fits (the longest URL grows with it)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if longest(mid) <= room else (low, mid - 1)
    return tuple(sizes(low).items())


def metadata_pairs(metadata: dict | None, *, cut: int | None = VALUE_CHARS,
                   first: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``metadata`` as ``[(dotted key, value as text)]`` for people: the fields named in ``first``
    (the declared ones, in their order) before the others, each group by key, nested objects
    flattened to the dotted paths a filter names (``size.width``), lists joined with ", ",
    booleans as true / false, each value cut to ``cut`` characters ending in "…" (None: whole).

    The order is the page's own: a stored object's key order is the database's (PostgreSQL's
    ``jsonb`` sorts keys by length), never the order they were sent in."""
    out: list[tuple[str, str]] = []
    rank = {name: i for i, name in enumerate(first)}

    def walk(obj: dict, path: str) -> None:
        for key, value in obj.items():
            dotted = f"{path}.{key}" if path else str(key)
            if isinstance(value, dict) and value:
                walk(value, dotted)
            else:
                text = _text(value)
                out.append((dotted, text if cut is None or len(text) <= cut else text[: cut - 1] + "…"))

    walk(metadata or {}, "")
    return sorted(out, key=lambda kv: (rank.get(kv[0].split(".")[0], len(rank)), kv[0]))


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return str(value)
