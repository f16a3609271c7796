"""The pure parts of ``benchmarks/ingest.py``: the manifest it sends, its rates, memory growth,
timestamps and verdict. No stack, no timing."""
from __future__ import annotations

import csv
import datetime as dt
import io

import pytest

from benchmarks import ingest


def test_manifest_lines_are_a_csv_of_distinct_urls_and_ids():
    text = "".join(ingest.manifest_lines(500, "http://127.0.0.1:8000", seed=3, categories=7, first=10))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == ["url", "external_id", "category", "price"]
    assert len(rows) == 500
    assert rows[0]["url"] == "http://127.0.0.1:8000/img/10.jpg" and rows[0]["external_id"] == "ext-10"
    assert rows[-1]["url"] == "http://127.0.0.1:8000/img/509.jpg"
    assert len({r["url"] for r in rows}) == 500 and len({r["external_id"] for r in rows}) == 500
    assert {r["category"] for r in rows} <= {f"c{k}" for k in range(7)}
    assert all(0 <= float(r["price"]) <= 1000 for r in rows)
    # the same seed, the same manifest
    assert text == "".join(ingest.manifest_lines(500, "http://127.0.0.1:8000", seed=3, categories=7, first=10))


def test_write_manifest_returns_its_size(tmp_path):
    path = tmp_path / "m.csv"
    size = ingest.write_manifest(path, 3, "http://h")
    assert size == path.stat().st_size == len("".join(ingest.manifest_lines(3, "http://h")).encode())
    assert path.read_text().count("\n") == 4


def test_to_unix_reads_sqlite_text_and_aware_datetimes():
    assert ingest.to_unix(None) is None
    assert ingest.to_unix("1970-01-01 00:00:10.500000") == 10.5
    assert ingest.to_unix(dt.datetime(1970, 1, 1, 1, 0, 20, tzinfo=dt.timezone(dt.timedelta(hours=1)))) == 20.0


def samples(values, t0=100.0, step=1.0):
    return [{"t": t0 + step * (i + 1), "made": v} for i, v in enumerate(values)]


def test_rate_summary():
    s = samples([0, 0, 100, 300, 500, 700, 900, 1100, 1100])  # t = 101 .. 109
    r = ingest.rate_summary(s, "made", 100.0)
    assert r["count"] == 1100
    assert r["first_s"] == 3.0  # t = 103
    assert r["per_s"] == pytest.approx(1100 / 9)
    assert r["active_per_s"] == pytest.approx(1100 / 6)  # from the zero sample before (t = 102) to t = 108
    assert r["peak_per_s"] == pytest.approx(200.0)  # e.g. 100 → 1100 between t = 103 and t = 108


def test_rate_summary_without_growth_or_samples():
    assert ingest.rate_summary([], "made", 0.0) == {"count": 0, "first_s": None, "per_s": None,
                                                    "active_per_s": None, "peak_per_s": None}
    r = ingest.rate_summary(samples([0, 0, 0]), "made", 100.0)
    assert (r["count"], r["first_s"], r["active_per_s"], r["peak_per_s"]) == (0, None, None, None)


def test_rate_summary_of_a_count_done_before_the_first_sample():
    r = ingest.rate_summary(samples([1000, 1000, 1000], t0=10.0, step=0.5), "made", 10.0)
    assert r["first_s"] == 0.5 and r["active_per_s"] == pytest.approx(2000.0)  # from t0 to t = 10.5
    assert r["per_s"] == pytest.approx(1000 / 1.5) and r["peak_per_s"] is None


def test_memory_growth_against_the_baseline_before_the_start():
    mib = 1e6 / 2**20  # so that the figures come out in whole MB
    s = [{"unix": t, "web": v * mib, "web:anon": a * mib} for t, v, a in
         [(7.0, 500, 50), (8.5, 100, 40), (9.5, 110, 60), (10.5, 150, 65), (12.0, 130, 70), (20.0, 999, 99)]]
    g = ingest.memory_growth(s, "web", start=10.0, end=15.0)
    assert g == {"before_mb": 105.0, "max_mb": 150.0, "growth_mb": 45.0, "anon_growth_mb": 20.0}
    with pytest.raises(ValueError):
        ingest.memory_growth(s, "web", start=0.0, end=5.0)


def test_fewest_waiting_counts_rows_fetched_and_not_settled_from_a_time_on():
    s = [{"t": t, "fetched": f, "embedded": e, "skipped": k} for t, f, e, k in
         [(1.0, 64, 0, 0), (2.0, 640, 0, 0), (3.0, 1024, 64, 0), (4.0, 1088, 512, 64), (5.0, 1200, 600, 64)]]
    assert ingest.fewest_waiting(s, 3.0, rows=100_000) == 512  # t = 4: 1088 − 512 − 64
    assert ingest.fewest_waiting(s, 0.0, rows=100_000) == 64
    assert ingest.fewest_waiting(s, 9.0, rows=100_000) is None
    # once every row is fetched the source is exhausted, not the fetcher slow: those samples do not count
    assert ingest.fewest_waiting(s, 3.0, rows=1088) == 960  # t = 3 only: 1024 − 64
    assert ingest.fewest_waiting(s, 4.0, rows=1088) is None


def phase(**over):
    p = {"status": 202, "answer_s": 0.2, "memory": {"web": {"growth_mb": 12.0}}, "first_embedded_s": 3.0,
         "fewest_waiting": 900}
    return {**p, **over}


def test_verdict_judges_each_target_measured():
    result = {"fetch_alone": {"per_s": 800.0, "failed": 0}, "manifest": phase(),
              "prefix": phase(answer_s=11.0, first_embedded_s=None, fewest_waiting=None),
              "manifest_unbounded": phase(answer_s=99.0),  # reported, not judged
              "store": {"p95_ms": 25.0, "matching_pct": 1.1}}
    checks = ingest.verdict(result)
    assert checks == {
        "fetch alone >= 500 images/s": True,
        "manifest: answered within 10 s": True,
        "manifest: web memory growth <= 100 MB": True,
        "manifest: first image embedded within 10 s": True,
        "manifest: fetching never caps the model (>= 192 rows waiting for it after the first image)": True,
        "prefix: answered within 10 s": False,
        "prefix: web memory growth <= 100 MB": True,
        "prefix: first image embedded within 10 s": False,
        "prefix: fetching never caps the model (>= 192 rows waiting for it after the first image)": False,
        "filtered search (1.1 % of points) p95 <= 20 ms": False,
    }
    assert ingest.verdict({"fetch_alone": {"per_s": 499.0, "failed": 0}}) == {"fetch alone >= 500 images/s": False}
    assert ingest.verdict({}) == {}
    # every row fetched before the first image: fetching cannot have made the model wait
    assert ingest.verdict({"manifest": phase(fewest_waiting=None)})[
        "manifest: fetching never caps the model (>= 192 rows waiting for it after the first image)"] is True
