"""``benchmarks/bulk_path.py``'s verdicts: a ratio gets no PASS on a bound measured while other work
held the cores, the writer's points/s is its index_chunk points over their wall time, other work is
read from the kernel's counters (not the lagging load average) and flagged."""
from __future__ import annotations

import time

from benchmarks import bulk_path


def load(l1: float) -> dict:
    return {"load_1m": l1, "per_core": l1 / 2}


def phase(images_per_s: float, other: float, index: tuple[int, float] | None = None) -> dict:
    out = {"images_per_s": images_per_s, "embedded": 100, "total": 100, "load_before": load(1.9), "load_after": load(2.0),
           "other_cores": other, "quiet": other <= bulk_path.QUIET_OTHER_CORES}
    if index:
        out["sql"] = {"index_chunk": {"images_total": index[0], "wall_s_total": index[1], "statements_max": 10}}
    return out


def results(bound_other: float) -> dict:
    # the load average says 1.4 either way (the benchmark's own previous phase): it decides nothing
    bound = lambda v: {"images_per_s": v, "load_before": load(1.4), "load_after": load(1.4),  # noqa: E731
                       "other_cores": bound_other, "quiet": bound_other <= bulk_path.QUIET_OTHER_CORES}
    return {"decode_bound": bound(100.0), "preview_bound": bound(1000.0), "store_upsert": {"points_per_s": 8000.0},
            "first_originals": phase(90.0, 0.05), "first_catalogue": phase(200.0, 0.05, (6400, 1.0)),
            "reembed": phase(900.0, 0.05, (10240, 2.5))}


def test_ratios_pass_only_on_a_quiet_bound():
    quiet = {t["name"]: t for t in bulk_path.targets(results(0.05))}
    shared = {t["name"]: t for t in bulk_path.targets(results(0.6))}
    ratio = f"re-embedding from previews >= {bulk_path.TARGET_REEMBED_RATIO} x the previews' read + preprocess bound"
    first = f"first embedding of the originals >= {bulk_path.TARGET_FIRST_RATIO} x their decode + preprocess bound"
    assert quiet[ratio]["pass"] and quiet[first]["pass"]  # 0.90 x and 0.90 x
    assert not shared[ratio]["pass"] and not shared[first]["pass"]
    assert "WARNING" in shared[ratio]["detail"] and "WARNING" not in quiet[ratio]["detail"]


def test_writer_rate_is_points_over_busy_seconds():
    res = results(0.05)
    assert bulk_path.writer_rate(res["reembed"]) == 4096.0
    assert bulk_path.writer_rate(res["first_catalogue"]) == 6400.0
    assert bulk_path.writer_rate(res["first_originals"]) is None
    verdicts = {t["name"]: t["pass"] for t in bulk_path.targets(res)}
    assert verdicts["vectors writer >= 5,000 points/s while busy (re-embed)"] is False
    assert verdicts["vectors writer >= 5,000 points/s while busy (first embedding)"] is True




def test_other_work_counts_the_machine_but_not_this_process_tree(tmp_path):
    """A descendant's CPU seconds are this tree's own (alive or exited); a process outside the tree
    shows in the machine's busy seconds only. Each spinner burns 0.5 s of its own CPU time, so the
    figures hold however busy the machine is."""
    import subprocess
    import sys

    def spin(done: str) -> list[str]:
        return [sys.executable, "-c", "import time, pathlib\nwhile time.process_time() < 0.5: pass\n"
                f"pathlib.Path({done!r}).write_text('done')"]

    own0, busy0 = bulk_path._own_s(), bulk_path._busy_s()
    subprocess.run(spin(str(tmp_path / "child")), check=True)  # a descendant, exited and waited for
    own1, busy1 = bulk_path._own_s(), bulk_path._busy_s()
    assert own1 - own0 >= 0.45 and busy1 - busy0 >= 0.45
    # setsid --fork: the spinner is re-parented away from this tree at once
    subprocess.run(["setsid", "--fork", *spin(str(tmp_path / "outsider"))], check=True)
    deadline = time.time() + 30
    while not (tmp_path / "outsider").exists() and time.time() < deadline:
        time.sleep(0.05)
    own2, busy2 = bulk_path._own_s(), bulk_path._busy_s()
    assert own2 - own1 < 0.3 and busy2 - busy1 >= 0.45
