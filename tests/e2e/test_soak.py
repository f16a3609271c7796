"""A reduced soak in CI: 200 images through both lanes, two faults at random times (a bulk pool
child SIGKILLed mid-chunk, the Redis restarted empty). ``make soak`` runs the full size (5,000
images, every kind of fault); see scripts/soak.py and docs/operations.md."""
from __future__ import annotations

import json

import pytest

from scripts.soak import Soak, soak_env
from scripts.stack import Stack

pytestmark = pytest.mark.e2e


def test_reduced_soak_loses_and_duplicates_nothing(tmp_path, database_url):
    with Stack(tmp_path, soak_env(DATABASE_URL=database_url), private_redis=True, log=lambda *a: None) as stack:
        stack.supervise()  # as the process manager does in production: a worker may exit when Redis goes
        soak = Soak(stack, images=200, interactive_share=0.1, faults=2, seed=7, jobs=2,
                    fault_kinds=("kill-bulk-child", "restart-redis"), min_gap_s=2, max_gap_s=6, log=lambda *a: None)
        report = soak.run(timeout_s=600)
    assert report["ok"], json.dumps(report, indent=1)
    assert len(report["faults"]) == 2
    assert report["points"] == report["distinct_good_inputs"] == 200
