"""``benchmarks.lanes_hops``: an idle request's hop records joined into hops, for the chain through
the vectors worker and for the one task of an interactive worker that owns the store
(``STORE_OWNER=interactive``): exact milliseconds from synthetic records, every hop summing to
the client's time."""
from __future__ import annotations

import pytest

from benchmarks.lanes_hops import join, owners_table, tables

T = 1_000.0  # a Unix second: every moment below is T + ms / 1000


def at(ms: float) -> float:
    return T + ms / 1000


def web_record(trace: str, *, sent: float, got: float, end: float, start: float = 0, **notes) -> dict:
    return {"side": "web", "id": trace, "start": at(start), "sent": at(sent), "got": at(got), "end": at(end),
            "notes": notes}


def task_record(trace: str, name: str, *, start: float, end: float, timings=None, **notes) -> dict:
    notes = {k: (at(v) if k.endswith("_at") else v) for k, v in notes.items()}
    return {"side": "task", "id": trace, "task": name, "start": at(start), "end": at(end), "notes": notes,
            "timings": timings}


def sample(kind: str, latency_ms: float) -> dict:
    return {"kind": kind, "sent": at(-1), "latency_ms": latency_ms}


def test_one_task_upload_hops_sum_to_the_client_time():
    records = [web_record("u", sent=10, got=70, end=72, admission_ms=1, rows_ms=4, send_ms=2),
               task_record("u", "embed_index_interactive", start=12, end=69, queue_delay_ms=0.5, forward_ms=30,
                           prep_ms=3, embed_ms=31, embedded_at=40, write_ms=5, upsert_ms=1, search_ms=4,
                           returned_at=52)]
    (row,) = join([sample("upload", 75)], records)
    h = row["hops"]
    assert h["client ↔ Django (HTTP, auth, parsing)"] == pytest.approx(3)
    assert h["web: rest before the wait (auth, parsing)"] == pytest.approx(3)
    assert h["broker → interactive worker"] == pytest.approx(2)
    assert h["interactive: batcher hand-off"] == pytest.approx(0.5)
    assert h["interactive: rows, thumbnail, rest"] == pytest.approx(28 - 3 - 31)
    assert h["interactive: rest (store turn, statistics)"] == pytest.approx(12 - 10)
    assert h["result backend → web"] == pytest.approx(18)
    assert sum(h.values()) == pytest.approx(75)
    assert (row["forward_ms"], row["queue_delay_ms"], row["beyond_ms"]) == (30, 0.5, pytest.approx(44.5))


def test_one_task_text_search_hops_sum_to_the_client_time_and_the_chain_still_joins():
    records = [web_record("t", sent=8, got=60, end=61, admission_ms=1),
               task_record("t", "embed_search", start=9, end=59, forward_ms=40, embedded_at=45, returned_at=48),
               web_record("c", start=1000, sent=1008, got=1070, end=1071, admission_ms=1),
               task_record("c", "encode_text", start=1009, end=1052, forward_ms=40),
               task_record("c", "search_vector", start=1054, end=1060)]
    one, chain = join([sample("text_search", 63), {**sample("text_search", 73), "sent": at(999)}], records)
    assert one["hops"]["interactive: search (store turn, query, results)"] == pytest.approx(3)
    assert one["hops"]["interactive: rest before the search"] == pytest.approx(36 - 40)
    assert sum(one["hops"].values()) == pytest.approx(63) and one["beyond_ms"] == pytest.approx(23)
    assert chain["hops"]["broker → vectors worker"] == pytest.approx(2)
    assert sum(chain["hops"].values()) == pytest.approx(73) and chain["beyond_ms"] == pytest.approx(33)


def test_the_owners_table_names_each_run_and_its_verdicts():
    records = [web_record("t", sent=8, got=60, end=61, admission_ms=1),
               task_record("t", "embed_search", start=9, end=59, forward_ms=40, embedded_at=45, returned_at=48)]
    rows = join([sample("text_search", 52)], records)
    _, verdicts = tables(rows, label="")
    runs = [{"owner": o, "rows": rows, "verdicts": verdicts, "load_before": (0.5, 0, 0)} for o in ("vectors",
                                                                                                "interactive")]
    text = owners_table(runs)
    assert "| 1 | vectors | text search | 52.0 / 52.0 | 40.0 | 0.0 | **12.0 / 12.0** | 0.50 |" in text
    assert "- run 2 (interactive): PASS: text_search beyond the model p50 ≤ 15 ms: 12.0 ms" in text
