"""The payload of each point: what the vector store keeps beside a vector, read from the rows that
share its bytes in one space (owners, jobs, and one item per user row with its id, job, external id
and metadata). On PostgreSQL the server builds every payload as JSON in one statement
(:func:`_point_payloads_json`); elsewhere the rows are read and the payloads built here
(:func:`_point_payloads_rows`); a test holds the two equal. Written by the vectors worker
(``services.queues.store_writes``) and by a metadata change's refresh (``catalogue.identity``).
"""
from __future__ import annotations

import json
from typing import Iterable

from django.db import connection
from django.db.models import Q
from django.db.models.functions import Coalesce

from embeddings.lookups import pg_array  # also registers field__any_of
from embeddings.models import Image, ImageStatus


def point_payloads(*, model_id: str, shas: Iterable[str], including: Iterable[str] = (),
                   point_ids: Iterable[str] | None = None, queued: set[str] | None = None) -> dict[str, dict]:
    """Qdrant payload per sha256, recomputed from the database: ``{"sha256", "owner_ids", "job_ids",
    "items"}``.

    Owners and jobs come from every embedded row with those bytes under ``model_id``, plus the rows
    in ``including`` (being embedded now), so a shared point lists every owner that may see it. A
    row re-embedded for another space (``source`` set: a migration or dual-embedding copy) lists
    its user row's job, so a ``job_id`` filter finds the user's images after a model switch.

    ``items`` holds one entry per such row, as its user row: ``{"image": user row id, "owner",
    "job" (absent when none), "external_id" (absent when none), "m": metadata}`` — what a metadata
    filter reads inside the vector query (``workers.vector_store.filters``: one item must satisfy
    owner, job and filter together), so a point shared by two owners never lets one owner's
    metadata match the other's search (issue 41).

    ``point_ids``: the points being written (every row of one model and bytes shares one). Give
    them on a hot path: the ``point_id`` index then finds the rows, where ``model_id`` + ``sha256``
    alone has no index of its own (the one on them starts with ``owner``) and scans the whole table
    per call (measured: 2.2 s per chunk at 100,000 images on SQLite, docs/scaling.md).

    ``queued``: a set to fill, for a writer about to write the points of ``including`` (one read
    where it took two, ``queues.vectors.chunk_index``): a row of ``including`` then counts only while it
    is still ``queued`` or ``embedded`` (one cancelled or expired meanwhile is not written), and the
    ids of those still queued are added to the set. Those rows must share the points' model, bytes
    and ``point_ids``, as every row being written does.

    On PostgreSQL the server builds the payloads in one statement (:func:`_point_payloads_json`);
    elsewhere the rows are read and the payloads built here (:func:`_point_payloads_rows`).
    """
    shas = set(shas)
    point_ids = None if point_ids is None else list(point_ids)
    read = _point_payloads_json if connection.vendor == "postgresql" else _point_payloads_rows
    return read(model_id=model_id, shas=shas, including=list(including), point_ids=point_ids, queued=queued)


def _point_payloads_rows(*, model_id: str, shas: set[str], including: list[str], point_ids: list[str] | None,
                         queued: set[str] | None) -> dict[str, dict]:
    """:func:`point_payloads` through the ORM, row by row in Python (SQLite; on PostgreSQL the
    reference the JSON read is tested against)."""
    payloads = {s: {"sha256": s, "owner_ids": set(), "job_ids": set(), "items": {}} for s in shas}
    # any_of: one array parameter per list on PostgreSQL (embeddings/lookups.py)
    rows = Image.objects.filter(model_id=model_id, sha256__any_of=shas)
    if point_ids is not None:
        rows = rows.filter(point_id__any_of=point_ids)
    rows = rows.filter(
        Q(status=ImageStatus.EMBEDDED) | Q(id__any_of=including) if including else Q(status=ImageStatus.EMBEDDED)
    ).values_list("sha256", "owner_id", Coalesce("source__job_id", "job_id"), "id", "status",  # a copy: its user row's
                  Coalesce("source_id", "id"), "external_id", "metadata", "source__external_id", "source__metadata")
    for sha, owner_id, job_id, image_id, status, user_id, ext, meta, source_ext, source_meta in rows:
        if queued is not None and status != ImageStatus.EMBEDDED:
            if status != ImageStatus.QUEUED:  # a row of ``including`` decided meanwhile
                continue
            queued.add(str(image_id))
        p = payloads[sha]
        p["owner_ids"].add(owner_id)
        if job_id:
            p["job_ids"].add(str(job_id))
        if user_id != image_id:  # a copy in another space speaks for its user row
            ext, meta = source_ext, source_meta
        item = {"image": str(user_id), "owner": owner_id, "m": meta or {}}
        if job_id:
            item["job"] = str(job_id)
        if ext:
            item["external_id"] = ext
        p["items"][str(user_id)] = item
    return {s: {"sha256": s, "owner_ids": sorted(p["owner_ids"]), "job_ids": sorted(p["job_ids"]),
                "items": [p["items"][k] for k in sorted(p["items"])]}
            for s, p in payloads.items()}


#: :func:`point_payloads` on PostgreSQL: every payload built by the server as JSON text, one row per
#: sha256 (``{rows}``: the rows counted; ``{where}``: their filter). A copy's job, external id and
#: metadata are its user row's; an item's ``job`` and ``external_id`` are absent when empty and its
#: ``m`` is ``{{}}`` when the metadata is empty or falsy, as the Python loop writes them; one item per
#: user row (``first``); owners, jobs and items sorted as the loop sorts them (a uuid's order is its
#: lowercase text's). One scan and one grouping, no join of aggregates: with no statistics yet (a new
#: table) the planner would nest such a join, quadratic in the rows (measured: 480 ms for 512).
#: ``json``, not ``jsonb``, for what is built here: text put together, where ``jsonb`` parses and
#: normalises every step (measured: 4.7 against 7.1 ms of server time for 512 payloads).
_PAYLOADS_SQL = """SELECT sha, json_build_object(
           'sha256', sha,
           'owner_ids', json_agg(DISTINCT owner ORDER BY owner),
           'job_ids', COALESCE(json_agg(DISTINCT job::text ORDER BY job::text) FILTER (WHERE job IS NOT NULL),
                               '[]'::json),
           'items', json_agg(item ORDER BY usr) FILTER (WHERE first))::text,
       array_agg(id::text) FILTER (WHERE status = %s)
FROM (
    SELECT sha, owner, job, id, status, usr, row_number() OVER (PARTITION BY sha, usr) = 1 AS first,
           CASE WHEN job IS NULL AND ext = '' THEN json_build_object('image', usr::text, 'owner', owner, 'm', m)
                WHEN job IS NULL THEN json_build_object('image', usr::text, 'owner', owner, 'm', m, 'external_id', ext)
                WHEN ext = '' THEN json_build_object('image', usr::text, 'owner', owner, 'm', m, 'job', job::text)
                ELSE json_build_object('image', usr::text, 'owner', owner, 'm', m, 'job', job::text, 'external_id', ext)
           END AS item
    FROM (
        SELECT i.{sha} AS sha, i.{owner} AS owner, COALESCE(s.{job}, i.{job}) AS job, i.{id} AS id,
               i.{status} AS status, COALESCE(i.{source}, i.{id}) AS usr,
               COALESCE(CASE WHEN i.{source} IS NULL OR i.{source} = i.{id} THEN i.{ext} ELSE s.{ext} END, '')
               AS ext,
               CASE WHEN m.m IS NULL OR m.m IN ('null', 'false', '0', '""', '[]', '{{}}') THEN '{{}}'::jsonb
                    ELSE m.m END AS m
        FROM {rows} i LEFT OUTER JOIN {rows} s ON s.{id} = i.{source},
             LATERAL (SELECT CASE WHEN i.{source} IS NULL OR i.{source} = i.{id} THEN i.{meta} ELSE s.{meta} END
                      AS m) m
        WHERE {where}
    ) r
) r
GROUP BY sha
"""


def _point_payloads_json(*, model_id: str, shas: set[str], including: list[str], point_ids: list[str] | None,
                         queued: set[str] | None) -> dict[str, dict]:
    """:func:`point_payloads` on PostgreSQL, same arguments and result: one statement whose rows are
    the payloads as JSON text (:data:`_PAYLOADS_SQL`), parsed here by ``json.loads``; the bytes,
    points and ids go as one array literal each (:func:`pg_array`) whatever their number.

    Why: the same read as the Python loop, without building a model row, a ``UUID`` and a dict per
    row in Python (the writer reads 512 payloads twice per chunk: docs/scaling.md, "The vectors
    writer and the bounds").
    """
    meta = Image._meta
    qn = connection.ops.quote_name
    col = {name: qn(meta.get_field(f).column) for name, f in (
        ("sha", "sha256"), ("owner", "owner"), ("job", "job"), ("id", "id"), ("status", "status"),
        ("source", "source"), ("ext", "external_id"), ("meta", "metadata"))}
    where = [f"i.{qn(meta.get_field('model_id').column)} = %s", f"i.{col['sha']} = ANY(%s::text[])"]
    params: list = [model_id, pg_array(shas)]
    if point_ids is not None:
        where.append(f"i.{qn(meta.get_field('point_id').column)} = ANY(%s::uuid[])")
        params.append(pg_array(str(p) for p in point_ids))
    if including:
        # a writer (``queued`` given) counts a row of ``including`` only while queued or embedded
        where.append(f"(i.{col['status']} = %s OR (i.{col['id']} = ANY(%s::uuid[])"
                     + (f" AND i.{col['status']} = %s))" if queued is not None else "))"))
        params += [ImageStatus.EMBEDDED.value, pg_array(str(i) for i in including)]
        if queued is not None:
            params.append(ImageStatus.QUEUED.value)
    else:
        where.append(f"i.{col['status']} = %s")
        params.append(ImageStatus.EMBEDDED.value)
    sql = _PAYLOADS_SQL.format(rows=qn(meta.db_table), where=" AND ".join(where), **col)
    out = {s: {"sha256": s, "owner_ids": [], "job_ids": [], "items": []} for s in shas}
    if not shas:
        return out
    with connection.cursor() as cursor:
        cursor.execute(sql, [ImageStatus.QUEUED.value, *params])
        for sha, text, ids in cursor.fetchall():
            out[sha] = json.loads(text)
            if queued is not None and ids:
                queued.update(ids)
    return out
