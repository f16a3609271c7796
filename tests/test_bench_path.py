"""``benchmarks/bulk_path.py``'s verdicts: a ratio gets no PASS on a bound measured on shared cores,
the writer's points/s is its index_chunk points over their wall time, the load is flagged."""
from __future__ import annotations

from benchmarks import bulk_path


def load(l1: float) -> dict:
    return {"load_1m": l1, "per_core": l1 / 2, "quiet": l1 / 2 <= bulk_path.QUIET_LOAD_PER_CORE}


def phase(images_per_s: float, l1: float, index: tuple[int, float] | None = None) -> dict:
    out = {"images_per_s": images_per_s, "embedded": 100, "total": 100, "load_before": load(l1), "load_after": load(l1)}
    if index:
        out["sql"] = {"index_chunk": {"images_total": index[0], "wall_s_total": index[1], "statements_max": 10}}
    return out


def results(bound_load: float) -> dict:
    bound = lambda v: {"images_per_s": v, "load_before": load(bound_load), "load_after": load(bound_load),  # noqa: E731
                       "quiet": load(bound_load)["quiet"]}
    return {"decode_bound": bound(100.0), "preview_bound": bound(1000.0), "store_upsert": {"points_per_s": 8000.0},
            "first_originals": phase(90.0, 0.4), "first_catalogue": phase(200.0, 0.4, (6400, 1.0)),
            "reembed": phase(900.0, 0.4, (10240, 2.5))}


def test_ratios_pass_only_on_a_quiet_bound():
    quiet = {t["name"]: t for t in bulk_path.targets(results(0.6))}
    shared = {t["name"]: t for t in bulk_path.targets(results(1.4))}
    ratio = f"re-embedding from previews >= {bulk_path.TARGET_REEMBED_RATIO} x the previews' read + preprocess bound"
    first = f"first embedding of the originals >= {bulk_path.TARGET_FIRST_RATIO} x their decode + preprocess bound"
    assert quiet[ratio]["pass"] and quiet[first]["pass"]  # 0.90 x and 0.90 x
    assert not shared[ratio]["pass"] and not shared[first]["pass"]
    assert "WARNING" in shared[ratio]["detail"] and "WARNING" not in quiet[ratio]["detail"]


def test_writer_rate_is_points_over_busy_seconds():
    res = results(0.6)
    assert bulk_path.writer_rate(res["reembed"]) == 4096.0
    assert bulk_path.writer_rate(res["first_catalogue"]) == 6400.0
    assert bulk_path.writer_rate(res["first_originals"]) is None
    verdicts = {t["name"]: t["pass"] for t in bulk_path.targets(res)}
    assert verdicts["vectors writer >= 5,000 points/s while busy (re-embed)"] is False
    assert verdicts["vectors writer >= 5,000 points/s while busy (first embedding)"] is True

