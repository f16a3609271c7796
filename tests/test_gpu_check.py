"""``benchmarks/gpu_check.sh --dry-run``: the GPU check's CPU-side logic without a GPU and without
running its steps (each step's command and time limit within the budget, the wheels it would
install, the summary and the files it collects), so the script that runs once on a lent GPU
machine is known to parse, budget and collect before it gets there (issue 58)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

STEPS = ["precision and preprocessing tests", "routing tests", "bulk gpu_decode fp16", "previews re-embed",
         "bulk, CPU decode, 4 processes", "experiment matrix"]


def dry_run(tmp_path, **env) -> str:
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, text=True,
                         capture_output=True, timeout=600,
                         env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_ASSUME_CUDA": "0",
                              **env})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


def test_the_dry_run_lists_every_step_within_the_budget_and_collects(tmp_path):
    text = dry_run(tmp_path, GPU_CHECK_BUDGET_S="510")
    limits = dict(re.findall(r"^== (.+?) \(limit (-?\d+) s, \d+ s so far\)$", text, re.M))
    assert list(limits) == STEPS
    assert all(15 <= int(v) <= 150 for v in limits.values()), limits
    assert len(re.findall(r"^would run: ", text, re.M)) == 6 and "skipped" not in text
    # without CUDA: the CPU rehearsal, the previews through the device route on the CPU
    assert "no GPU: CPU rehearsal" in text
    assert re.search(r"would run: \S+ -m benchmarks.previews_gpu --quick --jpeg-device cpu ", text)
    assert "previews: no result" in text  # the summary reads what the steps would have written
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.log", "gpu_check.md",
                                                                   "utilisation.md"]


def test_the_dry_run_shows_the_gpu_machines_commands(tmp_path):
    text = dry_run(tmp_path, GPU_CHECK_ASSUME_CUDA="1")
    assert "CPU rehearsal" not in text and "--quick" not in text
    assert re.search(r"would run: \S+ -m benchmarks.previews_gpu --preprocess gpu_decode ", text)
    assert re.search(r"would run: \S+ -m benchmarks.bulk .*--preprocess gpu_decode ", text)


def test_a_spent_budget_skips_the_steps_instead_of_running_past_it(tmp_path):
    text = dry_run(tmp_path, GPU_CHECK_BUDGET_S="20")
    assert text.count(": skipped (the budget of 20 s is spent)") == 6
