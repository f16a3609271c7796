"""The site's pages. Each view checks the session, calls one service or selector, renders a template.

Uploads, job progress and job actions run in the browser against the REST API itself (session
authentication with Django's CSRF token, ``static/site/*.js``). Catalogue jobs (a manifest or a
prefix) and the search page's metadata filter are plain forms (``site.fields``) whose views call
the same services as the API's views, with the same refusals. Permissions are the API's:
``images_visible_to`` / ``jobs_visible_to`` (a user sees their own, staff see all), an id the user
may not see is a 404.
"""
from __future__ import annotations

import json
import uuid
from urllib.parse import urlencode

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework.utils.encoders import JSONEncoder

from embeddings import spaces
from embeddings.api.jobs import JobSerializer
from embeddings.api.search import parse_examples
from embeddings.errors import ApplicationError
from embeddings.models import EmbeddingSpace
from embeddings.selectors import images_visible_to, jobs_visible_to
from embeddings.services.catalogue import jobs as job_services
from embeddings.services.catalogue import reading
from embeddings.services.catalogue.images import image_delete
from embeddings.services.catalogue.sources import from_uploads
from embeddings.services.interactive import examples as example_services
from embeddings.services.interactive import search as search_services
from embeddings.services.interactive import upload as request_services
from embeddings.services.lifecycle import cutoff
from embeddings.site.fields import (
    DIVERSE,
    FilterForm,
    ManifestJobForm,
    PrefixJobForm,
    SearchOptionsForm,
    diversity_text,
    form_error,
    metadata_pairs,
    search_maxlengths,
)
from embeddings.site.words import REASON_WORDS, reason_words
from workers.thumbnail import LONG_SIDE, thumbnail_size

#: Results on the search page: a 50-image grid is the size the page is measured at (docs/ui.md).
SEARCH_K = 50
#: Neighbours shown on an image's page.
NEIGHBOURS_K = 12
#: Metadata pairs shown on a result card (the rest are in its tooltip and on the image's page).
CARD_PAIRS = 3


def home(request):
    """``/``: the search page for a signed-in user, the sign-in page otherwise."""
    return redirect("site-search" if request.user.is_authenticated else "login")


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _error(err: ApplicationError) -> dict:
    return {"message": err.message, "code": err.code, "words": reason_words(err.code)}


def _cards(results: list[dict]) -> list[dict]:
    """Search hits with their metadata for a card: ``meta_pairs`` (the first :data:`CARD_PAIRS`),
    ``meta_more`` (how many more) and ``meta_title`` (all of them, for the tooltip)."""
    out = []
    for r in results:
        pairs = metadata_pairs(r.get("metadata"), first=list(reading.declared_types()))
        out.append({**r, "meta_pairs": pairs[:CARD_PAIRS], "meta_more": max(0, len(pairs) - CARD_PAIRS),
                    "meta_title": "; ".join(f"{k}: {v}" for k, v in pairs)})
    return out


#: The inputs of the search page's examples form, by side: texts, then stored images' ids.
EXAMPLE_INPUTS = {"positive": ("positive_text", "positive"), "negative": ("negative_text", "negative")}
#: Those of them that hold an image's id (the results' ticks and crosses post these names).
IMAGE_INPUTS = ("positive", "negative")


def _posted_examples(data) -> tuple[dict[str, list[dict]], list[tuple[str, str]]]:
    """The examples an examples form posts: per side its texts (``positive_text`` /
    ``negative_text``) then its image ids (``positive`` / ``negative``: the kept examples' hidden
    inputs and the results ticked or crossed), each in order without repeats, less the one its
    "remove" button names (``remove``: ``"<input name>:<value>"``).

    Returns:
        ``({"positive": [{"text"} | {"image_id"}], "negative": [...]}, [(input name, value)])``:
        the examples as the API's ``positive`` / ``negative`` lists (not yet checked), and the same
        as the form's inputs, in that order.
    """
    removed = tuple(data.get("remove", "").partition(":")[::2])
    sides: dict[str, list[dict]] = {}
    inputs: list[tuple[str, str]] = []
    for side, names in EXAMPLE_INPUTS.items():
        sides[side] = []
        for name in names:
            for value in dict.fromkeys(v.strip() for v in data.getlist(name) if v.strip()):
                if (name, value) != removed:
                    sides[side].append({"image_id" if name in IMAGE_INPUTS else "text": value})
                    inputs.append((name, value))
    return sides, inputs


def _example_chips(user, inputs: list[tuple[str, str]]) -> list[dict]:
    """The examples above the results, as the template shows them: ``{"name", "value", "side",
    "text" | "image"}``; ``image`` is None for an id the user may not see (or not an id), so the
    chip names nothing of another user's image."""
    ids = [v for name, v in inputs if name in IMAGE_INPUTS and _is_uuid(v)]
    found = images_visible_to(user).filter(id__in=ids).only("id", "original_name", "status")
    visible = {str(im.id): im for im in found}
    chips = []
    for name, value in inputs:
        side = "negative" if name.startswith("negative") else "positive"
        chip = {"name": name, "value": value, "side": side}
        if name in IMAGE_INPUTS:
            chip["image"] = visible.get(value)
        else:
            chip["text"] = value
        chips.append(chip)
    return chips


@login_required
@require_http_methods(["GET", "POST"])
def search(request):
    """``/search/``: GET ``q`` (text) or ``like`` (an image id: "more like this"), or POST an
    ``image`` file (multipart, CSRF), or POST ``by=examples`` (CSRF): a search by examples, the
    API's ``positive`` / ``negative`` lists from :func:`_posted_examples` (results ticked ✓ or
    crossed ✗, the examples kept from the search before, the query's text or image) and a
    ``strategy``. Every kind takes ``diversity`` (the "diverse results" toggle: :data:`DIVERSE`;
    ``fields.SearchOptionsForm``), an optional ``job`` filter and ``m-<field>...`` inputs on the
    declared metadata fields (``fields.FilterForm``: combined with AND into the search's ``where``).
    Results: a grid of thumbnails with each image's external id and metadata, each with a tick and
    a cross for the examples form. A refusal is shown in words with the API's code and message,
    and the page answers the API's status."""
    jobs = list(jobs_visible_to(request.user).only("id", "name", "created_at")[:100])
    source = request.POST if request.method == "POST" else request.GET
    q, like, job = source.get("q", "").strip(), source.get("like", "").strip(), source.get("job", "").strip() or None
    by_examples = request.method == "POST" and source.get("by") == "examples"
    query = {"text": q} if q else {"image_id": like} if like else {}
    if request.method == "POST" and request.FILES.get("image") and not by_examples:
        query = {"image": from_uploads([request.FILES["image"]])[0]}
    declared = reading.declared_types()
    filters = FilterForm(declared, source if any(k.startswith("m-") for k in source) else None)
    used = filters.used()
    options = SearchOptionsForm(source)
    valid = options.is_valid()  # refused with the search below (options.options)
    diversity = (options.cleaned_data["diversity"] or 0.0) if valid else 0.0
    ctx = {"q": q, "like": like, "job": job, "jobs": jobs, "results": None, "error": None, "status": 200,
           "filters": filters, "filters_used": used, "filter_qs": urlencode(used),
           "q_maxlength": search_maxlengths(declared)["q"], "by_examples": by_examples,
           "diversity": diversity_text(diversity), "diverse_value": diversity_text(diversity or DIVERSE),
           "strategies": options.fields["strategy"].choices,
           "strategy": options.cleaned_data["strategy"] if valid else ""}
    examples, inputs = _posted_examples(source) if by_examples else ({}, [])
    if not all(_is_uuid(x) for x in (like, job) if x):
        ctx["error"], ctx["status"] = {"message": "that is not an image or job id", "code": "invalid", "words": ""}, 400
    elif query or by_examples:
        try:

            opts = options.options()
            where = filters.where()
            scope = {"user": request.user, "k": SEARCH_K, "job_id": job, "where": where, "diversity": opts["diversity"]}
            if by_examples:  # the API's checks, in its order: each list, then the service's
                found = example_services.search_examples(positive=parse_examples(examples["positive"], "positive"),
                                                         negative=parse_examples(examples["negative"], "negative"),
                                                         strategy=opts["strategy"], **scope)
                ctx["results"] = _cards(found)  # a strategy's scores are not cosines: no cutoff (docs/search.md)
            else:
                space = spaces.active()  # the space searched: its calibrated cutoff applies (issue 13)
                found = search_services.search(**query, **scope)
                # ``all=1`` ("show the closest anyway"): min_score 0, the cutoff off
                ctx["cutoff"] = cutoff.apply_min_score(
                    found, space=space, kind=cutoff.TEXT if q and "image" not in query else cutoff.IMAGE,
                    requested=0.0 if source.get("all") == "1" else None)
                ctx["results"] = _cards(ctx["cutoff"]["results"])
        except ApplicationError as e:
            ctx["error"], ctx["status"] = _error(e), e.status
        if like and ctx["results"] is not None and not by_examples:
            ctx["like_image"] = images_visible_to(request.user).filter(id=like).first()
    if not by_examples and ctx["results"] is not None:  # the query is the examples form's first positive
        inputs = [("positive_text", q)] if q and "image" not in query else [("positive", like)] if like else []
    ctx["examples"] = _example_chips(request.user, inputs)
    return render(request, "site/search.html", ctx, status=ctx["status"])


@login_required
def upload(request):
    """``/upload/``: drop files here; the page's script sends them to the API (``upload.js``)."""
    return render(request, "site/upload.html", {
        "interactive_max_files": settings.INTERACTIVE_MAX_FILES,
        "reason_words": REASON_WORDS,
    })


#: The job forms of the jobs page, by the ``source`` value each posts.
JOB_FORMS = {"manifest": ManifestJobForm, "prefix": PrefixJobForm}


def _job_from(form: ManifestJobForm | PrefixJobForm, owner):
    """The job a valid form describes (``reading.job_create_from_manifest`` / ``_from_prefix``).

    Raises:
        ApplicationError: the form's first problem (400 ``invalid`` / ``mixed_sources``), or the
            service's refusal (``manifest_format`` 415, ``manifest_header``, ``source_not_allowed`` 403, ...).
    """
    if not form.is_valid():
        raise form_error(form)
    v = form.cleaned_data
    if isinstance(form, ManifestJobForm):
        return reading.job_create_from_manifest(owner=owner, upload=v["manifest"] or None,
                                                key=v["manifest_key"].strip() or None,
                                                bucket=v["bucket"].strip() or None, **form.job_options())
    return reading.job_create_from_prefix(owner=owner, uri=v["prefix"].strip(), extensions=v["extensions"],
                                          **form.job_options())


@login_required
@require_http_methods(["GET", "POST"])
def job_list(request):
    """``/jobs/``: the user's jobs (staff: everyone's, migration jobs included, and the embedding
    spaces with their state), newest first, with their counts; and two forms that start a catalogue
    job. POST (CSRF) ``source=manifest`` (a ``manifest`` file or a ``manifest_key`` s3:// address,
    optional ``bucket``) or ``source=prefix`` (``prefix``, optional ``extensions``), each with optional
    ``name``, ``priority``, ``deadline``: a redirect to the new job's page, or this page again with
    the refusal in words and the status the API answers (400, 403, 415)."""
    forms_ = {source: form() for source, form in JOB_FORMS.items()}
    error, posted, status = None, None, 200
    if request.method == "POST":
        posted = request.POST.get("source", "")
        try:
            if posted not in JOB_FORMS:
                raise ApplicationError("choose a manifest or a prefix", code="invalid", status=400)
            forms_[posted] = JOB_FORMS[posted](request.POST, request.FILES)
            job = _job_from(forms_[posted], request.user)
            return redirect("site-job", job_id=job.id)
        except ApplicationError as e:
            error, status = _error(e), e.status
    jobs = list(jobs_visible_to(request.user).select_related("owner")[:200])
    rows = [(job, job_services.job_counts(job)) for job in jobs]
    spaces = None
    if request.user.is_staff:  # the embedding spaces and their roles (issue 13: changing the model)

        spaces = list(EmbeddingSpace.objects.select_related("job"))
    buckets = [f"s3://{b}/{p}" for b, p in reading.allowed().rules]
    return render(request, "site/jobs.html", {"rows": rows, "spaces": spaces, "forms": forms_, "error": error,
                                              "posted": posted, "buckets": buckets}, status=status)


@login_required
def job_detail(request, job_id):
    """``/jobs/{id}/``: progress, images/s, ETA, at-risk, actions, stage timings; a catalogue job's
    source (its manifest or prefix, rows read, still reading, why it could not be read); failures
    counted by reason and listed with their manifest row, origin and reason. The page's script
    refreshes it from ``GET /api/jobs/{id}/`` once a second (``job.js``)."""


    job = get_object_or_404(jobs_visible_to(request.user), id=job_id)
    data = json.loads(json.dumps({**JobSerializer(job).data, **job_services.job_progress(job)}, cls=JSONEncoder))
    reasons = [{"code": code, "count": n, "words": reason_words(code)} for code, n in data["failure_reasons"].items()]
    source = data.get("source") or {}
    return render(request, "site/job.html", {
        "job": job, "data": data, "reason_words": REASON_WORDS, "source": source, "reasons": reasons,
        "source_error_words": reason_words((source.get("error") or {}).get("code")),
    })


@login_required
def image_detail(request, image_id):
    """``/images/{id}/``: the thumbnail, the image's facts (its external id, the one it waits to
    take, where it was fetched from, its manifest row), its metadata, its nearest neighbours, delete."""
    image = get_object_or_404(images_visible_to(request.user).select_related("job", "owner"), id=image_id)
    neighbours, error = None, None
    if image.status in ("embedded", "skipped"):
        try:
            hits = search_services.search(user=request.user, k=NEIGHBOURS_K + 1, image_id=str(image.id))
            neighbours = _cards([h for h in hits if h["image_id"] != str(image.id)][:NEIGHBOURS_K])
        except ApplicationError as e:
            error = _error(e)
    view = request_services.image_view(image)
    thumb_size = thumbnail_size(image.width, image.height) if image.width and image.height else (LONG_SIDE, LONG_SIDE)
    return render(request, "site/image.html", {
        "image": image, "view": view, "neighbours": neighbours, "error": error, "reason": reason_words(image.reason),
        "thumb_size": thumb_size, "metadata": metadata_pairs(image.metadata, cut=None, first=list(reading.declared_types())),
        "origin_is_web": image.origin.startswith(("http://", "https://")),  # a link; s3:// is shown as text
    })


@login_required
@require_POST
def image_remove(request, image_id):
    """``POST /images/{id}/delete/`` (CSRF): delete the image and its vector, back to the search page."""
    image = get_object_or_404(images_visible_to(request.user), id=image_id)
    image_delete(image=image)
    return redirect("site-search")
