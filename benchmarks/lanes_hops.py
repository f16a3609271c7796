"""Where an idle interactive request's time goes, hop by hop (issue 58): the analysis of
``python -m benchmarks.lanes --hops`` (the run itself is ``benchmarks.lanes.hops_main``).

That run starts the stack as ``benchmarks.lanes`` does, with ``HOP_TRACE=1`` (``embeddings.lane_control.hops``:
each side of a request writes a record of its moments to Redis), warms it, then sends ``--requests``
uploads of one distinct photo (k = 5 neighbours) and as many text searches (k = 5), one at a time,
``1 / --rate`` s apart (an idle stack: no request overlaps another). Each request's client wall time
is split by its records into the hops below; every hop is given as p50 / p95 over the requests (the
hops' p50s need not add up to the total's). The issue's figure is the last column of the summary:
**beyond the model** = client total − forward pass − batcher queue delay (ms), targets p50 ≤ 15 ms,
p95 ≤ 30 ms.

Writes ``hops.json`` (every request's hops) and ``hops.md`` (the tables) to ``--out``.
"""
from __future__ import annotations

import numpy as np

from benchmarks._common import REDIS_PREFIX

HOPS_KEY = f"{REDIS_PREFIX}lanes:interactive:hops"  # embeddings.lane_control.keys.HOPS_KEY
#: Targets of issue 58 for the time beyond the forward pass and the queue delay (ms).
TARGET_P50_MS, TARGET_P95_MS = 15.0, 30.0

#: Texts of the search requests (a few, taken in turn; the text tower's cost barely depends on them).
TEXTS = ("a dog on a beach", "a red car parked in a street", "mountains at sunset", "a bowl of fruit on a table")


def _ms(a: float, b: float) -> float:
    return (b - a) * 1000.0


def _web_before(total_ms: float, web: dict) -> dict:
    """An upload's hops (ms) from the client to the moment the web sent its work to the broker."""
    notes = web.get("notes", {})
    return {
        "client ↔ Django (HTTP, auth, parsing)": total_ms - _ms(web["start"], web["end"]),
        "web: admission": notes.get("admission_ms", 0.0),
        "web: blob + rows": notes.get("rows_ms", 0.0),
        "web: send (to the broker)": notes.get("send_ms", 0.0),
        "web: rest before the wait (auth, parsing)": _ms(web["start"], web["sent"])
        - sum(notes.get(k, 0.0) for k in ("admission_ms", "rows_ms", "send_ms")),
    }


def _embed_hops(web: dict, start: float, embedded_at: float, *, prep: float, queue: float, forward: float,
                embed_ms: float) -> dict:
    """An upload's hops (ms) in the interactive worker, from the broker to the end of its embedding
    (``start`` → ``embedded_at``, Unix s): its stages and the batcher's queue delay and forward pass."""
    return {
        "broker → interactive worker": _ms(web["sent"], start),
        "interactive: read + decode + preprocess": prep,
        "interactive: batcher queue delay": queue,
        "interactive: forward pass": forward,
        "interactive: batcher hand-off": embed_ms - queue - forward,
        "interactive: rows, thumbnail, rest": _ms(start, embedded_at) - prep - embed_ms,
    }


def _row(hops: dict, total_ms: float, forward: float, queue: float) -> dict:
    """One request's row: its hops, and its time beyond the model (client total − forward pass −
    batcher queue delay)."""
    return {"hops": hops, "total_ms": total_ms, "forward_ms": forward, "queue_delay_ms": queue,
            "beyond_ms": total_ms - forward - queue}


def upload_hops(total_ms: float, web: dict, embed: dict, index: dict) -> dict:
    """One upload's hops (ms) from its client time and its three hop records."""
    t, en, ix = embed.get("timings") or {}, embed["notes"], index["notes"]
    prep = sum(t.get(k, 0.0) for k in ("load", "decode", "decode_wait", "preprocess"))
    queue, forward = en.get("queue_delay_ms", 0.0), en.get("forward_ms", 0.0)
    embed_ms = t.get("embed", 0.0)
    ix_body = _ms(index["start"], ix["returned_at"])
    hops = {
        **_web_before(total_ms, web),
        **_embed_hops(web, embed["start"], en["returned_at"], prep=prep, queue=queue, forward=forward,
                      embed_ms=embed_ms),
        "interactive: after return (reports, result, next message)": _ms(en["returned_at"], embed["end"]),
        "broker → vectors worker": _ms(embed["end"], index["start"]),
        "vectors: database writes": ix.get("write_ms", 0.0),
        "vectors: store upsert": ix.get("upsert_ms", 0.0),
        "vectors: search + results": ix.get("search_ms", 0.0),
        "vectors: rest": ix_body - ix.get("write_ms", 0.0) - ix.get("upsert_ms", 0.0) - ix.get("search_ms", 0.0),
        "result backend → web": _ms(ix["returned_at"], web["got"]),
        "web after the wait (rows, render)": _ms(web["got"], web["end"]),
    }
    return _row(hops, total_ms, forward, queue)


def _web_before_search(total_ms: float, web: dict) -> dict:
    """A text search's hops (ms) from the client to the moment the web sent its work to the broker."""
    admission = web.get("notes", {}).get("admission_ms", 0.0)
    return {"client ↔ Django (HTTP, auth, parsing)": total_ms - _ms(web["start"], web["end"]),
            "web: admission": admission,
            "web: rest before the wait (auth, parsing, scope, send)": _ms(web["start"], web["sent"]) - admission}


def search_hops(total_ms: float, web: dict, encode: dict, search: dict) -> dict:
    """One text search's hops (ms) from its client time and its three hop records (the text tower
    runs without the batcher: no queue delay)."""
    forward = encode["notes"].get("forward_ms", 0.0)
    hops = {
        **_web_before_search(total_ms, web),
        "broker → interactive worker": _ms(web["sent"], encode["start"]),
        "interactive: text forward pass": forward,
        "interactive: rest (result, next message)": _ms(encode["start"], encode["end"]) - forward,
        "broker → vectors worker": _ms(encode["end"], search["start"]),
        "vectors: search task": _ms(search["start"], search["end"]),
        "result backend → web": _ms(search["end"], web["got"]),
        "web after the wait (render)": _ms(web["got"], web["end"]),
    }
    return _row(hops, total_ms, forward, 0.0)


def upload_hops_one_task(total_ms: float, web: dict, task: dict) -> dict:
    """One upload's hops (ms) where one task embeds, writes and searches it (``embed_index_interactive``:
    the interactive worker owns the store, ``STORE_OWNER=interactive``): its client time, the web's
    record and the task's."""
    n = task["notes"]
    queue, forward = n.get("queue_delay_ms", 0.0), n.get("forward_ms", 0.0)
    stored = n.get("write_ms", 0.0) + n.get("upsert_ms", 0.0) + n.get("search_ms", 0.0)
    hops = {
        **_web_before(total_ms, web),
        **_embed_hops(web, task["start"], n["embedded_at"], prep=n.get("prep_ms", 0.0), queue=queue,
                      forward=forward, embed_ms=n.get("embed_ms", 0.0)),
        "interactive: database writes": n.get("write_ms", 0.0),
        "interactive: store upsert": n.get("upsert_ms", 0.0),
        "interactive: search + results": n.get("search_ms", 0.0),
        "interactive: rest (store turn, statistics)": _ms(n["embedded_at"], n["returned_at"]) - stored,
        "result backend → web": _ms(n["returned_at"], web["got"]),
        "web after the wait (rows, render)": _ms(web["got"], web["end"]),
    }
    return _row(hops, total_ms, forward, queue)


def search_hops_one_task(total_ms: float, web: dict, task: dict) -> dict:
    """One text search's hops (ms) where one task embeds and searches it (``embed_search``)."""
    n, forward = task["notes"], task["notes"].get("forward_ms", 0.0)
    hops = {
        **_web_before_search(total_ms, web),
        "broker → interactive worker": _ms(web["sent"], task["start"]),
        "interactive: text forward pass": forward,
        "interactive: rest before the search": _ms(task["start"], n["embedded_at"]) - forward,
        "interactive: search (store turn, query, results)": _ms(n["embedded_at"], n["returned_at"]),
        "result backend → web": _ms(n["returned_at"], web["got"]),
        "web after the wait (render)": _ms(web["got"], web["end"]),
    }
    return _row(hops, total_ms, forward, 0.0)


def join(samples: list[dict], records: list[dict]) -> list[dict]:
    """Each sample (``kind``, ``sent``, ``latency_ms``) with its records: the web record that began
    inside its client time, and that request's task records (by root task id)."""
    webs = [r for r in records if r["side"] == "web"]
    tasks: dict[str, dict[str, dict]] = {}
    for r in records:
        if r["side"] == "task":
            tasks.setdefault(r["id"], {})[r["task"]] = r
    out = []
    for s in samples:
        end = s["sent"] + s["latency_ms"] / 1000
        web = next((w for w in webs if s["sent"] - 0.05 <= w["start"] <= end), None)
        if web is None:
            continue
        t = tasks.get(web["id"], {})
        if s["kind"] == "upload" and {"embed_interactive", "index_interactive"} <= t.keys():
            out.append({**s, **upload_hops(s["latency_ms"], web, t["embed_interactive"], t["index_interactive"])})
        elif s["kind"] == "text_search" and {"encode_text", "search_vector"} <= t.keys():
            out.append({**s, **search_hops(s["latency_ms"], web, t["encode_text"], t["search_vector"])})
        elif s["kind"] == "upload" and "embed_index_interactive" in t:
            out.append({**s, **upload_hops_one_task(s["latency_ms"], web, t["embed_index_interactive"])})
        elif s["kind"] == "text_search" and "embed_search" in t:
            out.append({**s, **search_hops_one_task(s["latency_ms"], web, t["embed_search"])})
    return out


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def tables(rows: list[dict], *, label: str) -> tuple[str, list[dict]]:
    """The per-hop tables (one per kind) and the summary with the PASS/FAIL lines."""
    lines, verdicts = [], []
    for kind in ("upload", "text_search"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        lines += [f"**{kind.replace('_', ' ')}** ({len(rs)} requests, {label})", "",
                  "| hop | p50 ms | p95 ms | mean ms |", "| --- | --- | --- | --- |"]
        for hop in rs[0]["hops"]:
            v = [r["hops"][hop] for r in rs]
            lines.append(f"| {hop} | {pct(v, 50):.1f} | {pct(v, 95):.1f} | {np.mean(v):.1f} |")
        lines.append("")
    lines += ["| request | n | total p50 / p95 ms | forward p50 ms | queue delay p50 ms | "
              "beyond the model p50 / p95 ms |", "| --- | --- | --- | --- | --- | --- |"]
    for kind in ("upload", "text_search"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        tot, fw, qd, bey = ([r[k] for r in rs] for k in ("total_ms", "forward_ms", "queue_delay_ms", "beyond_ms"))
        lines.append(f"| {kind.replace('_', ' ')} | {len(rs)} | {pct(tot, 50):.1f} / {pct(tot, 95):.1f} | "
                     f"{pct(fw, 50):.1f} | {pct(qd, 50):.1f} | {pct(bey, 50):.1f} / {pct(bey, 95):.1f} |")
        verdicts += [{"kind": kind, "name": f"{kind} beyond the model p50 ≤ {TARGET_P50_MS:.0f} ms",
                      "value": pct(bey, 50), "pass": pct(bey, 50) <= TARGET_P50_MS},
                     {"kind": kind, "name": f"{kind} beyond the model p95 ≤ {TARGET_P95_MS:.0f} ms",
                      "value": pct(bey, 95), "pass": pct(bey, 95) <= TARGET_P95_MS}]
    lines.append("")
    lines += [f"- {'PASS' if v['pass'] else 'FAIL'}: {v['name']}: {v['value']:.1f} ms" for v in verdicts]
    return "\n".join(lines), verdicts


def owners_table(runs: list[dict]) -> str:
    """``--compare-owners``: each run's STORE_OWNER, total, forward pass and beyond-the-model p50 /
    p95 per request kind, in the order run, then the PASS/FAIL lines of the interactive owner's runs."""
    lines = [("| run | STORE_OWNER | request | total p50 / p95 ms | forward p50 ms | queue delay p50 ms | "
              "beyond the model p50 / p95 ms | load average before |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, run in enumerate(runs, 1):
        for kind in ("upload", "text_search"):
            rs = [r for r in run["rows"] if r["kind"] == kind]
            if not rs:
                continue
            tot, fw, qd, bey = ([r[k] for r in rs] for k in ("total_ms", "forward_ms", "queue_delay_ms", "beyond_ms"))
            lines.append(f"| {i} | {run['owner']} | {kind.replace('_', ' ')} | {pct(tot, 50):.1f} / {pct(tot, 95):.1f} | "
                         f"{pct(fw, 50):.1f} | {pct(qd, 50):.1f} | **{pct(bey, 50):.1f} / {pct(bey, 95):.1f}** | "
                         f"{run['load_before'][0]:.2f} |")
    lines.append("")
    for i, run in enumerate(runs, 1):
        lines += [f"- run {i} ({run['owner']}): {'PASS' if v['pass'] else 'FAIL'}: {v['name']}: {v['value']:.1f} ms"
                  for v in run["verdicts"]]
    return "\n".join(lines)
