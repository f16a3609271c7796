"""The usage page: the caller's usage per day (``services.usage.report``, as ``GET /api/usage/``
reads it), a bar chart of the images embedded each day drawn on the server as SVG (no script, no
external file), and a table per day with its cost.

``GET /usage/?start=YYYY-MM-DD&end=YYYY-MM-DD`` (a plain form; defaults as the API's: the last 30
days); staff may add ``owner=<user id>`` or ``owner=all``. A refused range is the page again with
the refusal in words and the status the API answers (400, 403, 404).
"""
from __future__ import annotations

import dataclasses
import datetime as dt

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.http import require_GET

from embeddings.errors import ApplicationError
from embeddings.services.usage import report
from embeddings.site.words import reason_words

#: The chart's drawing box (SVG user units; the page scales it to its width).
CHART_WIDTH, CHART_HEIGHT = 720, 160


@dataclasses.dataclass(frozen=True)
class Bar:
    """One day's bar: its box in the chart (SVG units), the day and its images."""

    x: float
    y: float
    width: float
    height: float
    day: str
    images: int


def day_bars(rows: list[dict], *, start: dt.date, end: dt.date, width: float = CHART_WIDTH,
             height: float = CHART_HEIGHT) -> list[Bar]:
    """A bar per day from ``start`` to ``end`` (days without usage too, at zero height), its height
    the day's images over the busiest day's; ``rows``: a report's ``data`` grouped by ``day``."""
    images = {r["day"]: r["images"] for r in rows}
    days = [start + dt.timedelta(days=n) for n in range((end - start).days + 1)]
    top = max([images.get(d.isoformat(), 0) for d in days] + [1])
    slot = width / len(days)
    bars = []
    for n, d in enumerate(days):
        value = images.get(d.isoformat(), 0)
        h = height * value / top
        bars.append(Bar(x=round(n * slot + slot * 0.1, 2), y=round(height - h, 2), width=round(slot * 0.8, 2),
                        height=round(h, 2), day=d.isoformat(), images=value))
    return bars


@login_required
@require_GET
def usage(request):
    """``/usage/``: the caller's usage per day, a chart and a table (docs/usage.md)."""
    start, end, owner = request.GET.get("start", ""), request.GET.get("end", ""), request.GET.get("owner", "")
    context: dict = {"start": start, "end": end, "owner": owner}
    try:
        query = report.usage_query(user=request.user, start=start or None, end=end or None, group_by="day",
                                   owner=owner or None)
    except ApplicationError as e:
        context["error"] = {"message": e.message, "code": e.code, "words": reason_words(e.code)}
        return render(request, "site/usage.html", context, status=e.status)
    got = report.usage_report(query)
    context.update(report=got, start=got["start"], end=got["end"], width=CHART_WIDTH, height=CHART_HEIGHT,
                   bars=day_bars(got["data"], start=query.start, end=query.end),
                   top=max([r["images"] for r in got["data"]] + [0]))
    return render(request, "site/usage.html", context)
