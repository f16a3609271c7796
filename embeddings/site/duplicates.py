"""The duplicates page (issue 45): the caller's near-duplicate scan, its groups to review, and three
plain forms that call the review services (``services.duplicates``) then redirect back with a message.

``GET /duplicates/`` shows the scan (threshold and how it was set, calibration, last run) and the
open groups of one kind (``kind=near|exact``), largest first, :data:`GROUPS_PER_PAGE` a page;
``status=reviewed`` lists the resolved and dismissed ones instead. Permissions are the API's
(``review.groups_visible_to``: a user sees their own groups, staff everyone's); a group the user may
not see is refused by the service (``not_found``), shown as a message like any other refusal.
"""
from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from embeddings import spaces
from embeddings.errors import ApplicationError
from embeddings.models import DuplicateKind, GroupStatus, ImageStatus, ScanState
from embeddings.services.duplicates import review
from embeddings.services.duplicates.scan import scan_start

#: Groups on one page: each is a row of thumbnails, so 20 keeps a page about as heavy as a
#: 50-result search grid (docs/ui.md).
GROUPS_PER_PAGE = 20
#: The page's tabs: open groups of each ``kind``, and ``status=reviewed`` (resolved or dismissed).
KINDS = (DuplicateKind.NEAR, DuplicateKind.EXACT)
REVIEWED = "reviewed"
#: Scan states during which the page refreshes its scan box (``static/site/duplicates.js``).
RUNNING = (ScanState.CALIBRATING, ScanState.SCANNING)


def _view_of(data) -> dict:
    """The list a query (or a form's hidden inputs) asks for: ``{"kind": "near" | "exact",
    "status": "open" | "reviewed", "page": str}``; anything else falls back to the open near groups."""
    kind, status = data.get("kind", ""), data.get("status", "")
    return {"kind": kind if kind in KINDS else DuplicateKind.NEAR,
            "status": REVIEWED if status == REVIEWED else GroupStatus.OPEN,
            "page": data.get("page", "1")}


def _back(request) -> str:
    """The page a form was posted from: its ``kind``, ``status`` and ``page`` (hidden inputs),
    checked as :func:`_view_of` checks them, so a redirect never leaves the page."""
    view = _view_of(request.POST)
    query = {"kind": view["kind"], "status": view["status"]}
    if view["page"].isdigit() and view["page"] != "1":
        query["page"] = view["page"]
    return f"{reverse('site-duplicates')}?{urlencode(query)}"


def _refused(request, err: ApplicationError) -> None:
    messages.error(request, f"{err.message} ({err.code})")


def _calibration(scan) -> dict | None:
    """The scan's threshold as the page words it: ``{"source": "calibrated" | "default" | "given",
    "recall", "above", "sample"}`` (percentages of the calibration's copies at or above the
    threshold and of sampled images whose nearest other image is), None before a threshold exists."""
    if scan is None or scan.threshold is None:
        return None
    c = scan.calibration or {}

    def pct(share: float | None) -> float | None:
        return None if share is None else round(100 * share, 1)

    return {"source": c.get("source", "given"), "recall": pct(c.get("recall_copies")),
            "above": pct(c.get("neighbours_above")), "sample": c.get("sample"), "copies": c.get("copies")}


def _members(group) -> list[dict]:
    """A group's members for the page, representative first: ``{"image", "score", "representative",
    "thumbnail_url"}`` (no thumbnail for an image that was never decoded)."""
    out = []
    for m in group.members.all():
        im = m.image
        decoded = im.status in (ImageStatus.EMBEDDED, ImageStatus.SKIPPED)
        out.append({"image": im, "score": m.score, "representative": m.representative,
                    "thumbnail_url": f"/api/images/{im.id}/thumbnail/" if decoded else None})
    return out


@login_required
@require_GET
def duplicates(request):
    """``/duplicates/``: the caller's scan (state, threshold and how it was set, points scanned,
    groups, last run) with the "Scan for duplicates" form, and one list of groups: the open near
    groups (``kind=near``, the default), the open exact ones (``kind=exact``) or the reviewed ones
    (``status=reviewed``), largest first, :data:`GROUPS_PER_PAGE` a page (``page``). Each open group:
    its members' thumbnails with their cosine to the representative, a radio to choose the one to
    keep (the representative by default), "Keep selected, delete the rest" and, for a near group,
    "Not duplicates"."""
    view = _view_of(request.GET)
    scan = review.scan_of(request.user)
    review.refresh(request.user)
    counts = {k: review.groups_visible_to(request.user, kind=k).count() for k in KINDS}
    if view["status"] == REVIEWED:
        groups = review.groups_visible_to(request.user, status=None).exclude(status=GroupStatus.OPEN)
        groups = groups.order_by("-reviewed_at", "-size", "id")
    else:
        groups = review.groups_visible_to(request.user, kind=view["kind"])
    page = Paginator(groups.select_related("owner", "kept"), GROUPS_PER_PAGE).get_page(view["page"])
    rows = [{"group": g, "members": _members(g)} for g in page.object_list]
    return render(request, "site/duplicates.html", {
        "scan": scan, "running": scan is not None and scan.state in RUNNING, "calibration": _calibration(scan),
        "model_id": scan.model_id if scan else spaces.active().model_id,
        "view": view, "counts": counts, "page": page, "rows": rows, "reviewed": view["status"] == REVIEWED,
        "back": {"kind": view["kind"], "status": view["status"], "page": page.number},
    })


@login_required
@require_POST
def duplicates_scan(request):
    """``POST /duplicates/scan/`` (CSRF): start (or restart) the caller's scan (``scan_start``),
    with an optional ``threshold`` (a cosine in (0, 1]; empty: calibrate it); back to the page."""
    raw = request.POST.get("threshold", "").strip()
    try:
        try:
            threshold = float(raw) if raw else None
        except ValueError:
            raise ApplicationError(f"threshold must be a number in (0, 1], got {raw!r}", code="invalid") from None
        scan = scan_start(owner=request.user, threshold=threshold)
    except ApplicationError as e:
        _refused(request, e)
    else:
        if scan.state == ScanState.DONE:
            messages.success(request, f"Scan finished: {scan.groups} group(s) of near copies.")
        elif scan.state == ScanState.FAILED:
            messages.error(request, f"The scan failed: {scan.error}")
        else:
            messages.success(request, "Scan started: this page shows its progress, and the groups once it is done.")
    return redirect(_back(request))


@login_required
@require_POST
def duplicates_keep(request, group_id):
    """``POST /duplicates/{id}/keep/`` (CSRF): keep the ``image_id`` chosen and delete the group's
    other images (``review.keep_one``); back to the page with what was deleted, or the refusal
    (``not_found``, ``not_a_member``, ``already_reviewed``)."""
    try:
        before = len(review.group_of(request.user, group_id).members.all())
        group = review.keep_one(request.user, group_id, request.POST.get("image_id", ""))
    except ApplicationError as e:
        _refused(request, e)
    else:
        name = (group.kept.original_name if group.kept else "") or "the image"
        deleted = before - 1
        messages.success(request, f"Kept {name}; deleted {deleted} other image{'' if deleted == 1 else 's'}.")
    return redirect(_back(request))


@login_required
@require_POST
def duplicates_dismiss(request, group_id):
    """``POST /duplicates/{id}/not-duplicates/`` (CSRF): these images are not copies of each other
    (``review.not_duplicates``: never grouped again); back to the page, or the refusal
    (``not_found``, ``already_reviewed``, ``exact_copies``)."""
    try:
        group = review.not_duplicates(request.user, group_id)
    except ApplicationError as e:
        _refused(request, e)
    else:
        messages.success(request, f"Marked {len(group.members.all())} images as not duplicates: "
                                  "they will not be grouped again.")
    return redirect(_back(request))
