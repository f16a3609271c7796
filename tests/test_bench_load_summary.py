"""The load benchmark's judgement of a 429 (``benchmarks.load.summarise``): each one's
``wait_ahead_s`` (and its first estimate, before it was learnt) against the median wait of the
requests admitted within ±0.5 s of it, and the lane's own drift (that wait 1 s earlier); and its
offline replay (``benchmarks.load_replay``, queueing alone, no Django)."""
from __future__ import annotations

import threading
import time

import pytest

from benchmarks.load_judge import actual_wait_near
from benchmarks.load import (QueueSampler, bulk_chunks_computing, bulk_job_paused, info, phase_cpu,
                             summarise, verdict)


def admitted(sent: float) -> dict:
    return {"sent": sent, "status": 200, "ms": 500.0 if sent < 2 else 1000.0}


def refused(sent: float, *, wait_ahead: float, first: float) -> dict:
    return {"sent": sent, "status": 429, "ms": 5.0, "code": "overloaded", "retry_after": "2",
            "wait_ahead_s": wait_ahead, "predicted_wait_s": 3.0, "model": {"first_wait_ahead_s": first}}


def test_each_429_is_judged_against_the_requests_admitted_around_it():
    # admitted every 0.25 s: 0.5 s waits before t = 2 s, 1 s waits from then on
    answers = [admitted(i / 4) for i in range(17)]
    answers += [refused(1.0, wait_ahead=0.5, first=0.8),   # around: 0.5 s; 1 s before: 0.5 s
                refused(2.6, wait_ahead=1.0, first=0.5),   # around: 1.0 s; 1 s before: 0.5 s (0.5, 0.5, 0.5, 1.0)
                refused(3.5, wait_ahead=0.6, first=1.0)]   # around: 1.0 s; 1 s before: 1.0 s
    assert [actual_wait_near(answers, t) for t in (1.0, 1.6, 2.6, 3.5)] == [0.5, 0.5, 1.0, 1.0]
    p = summarise(answers, rate=5.0, duration=4.0, deadline_s=2.0, capacity=4.0, web_records=[])
    assert p["retry_after_checked"] == 3 and p["by_status"] == {"200": 17, "429": 3}
    assert p["unrounded_within_30pct_share"] == pytest.approx(2 / 3, abs=1e-4)  # 0.6 is not within ±30 % of 1.0
    assert p["first_within_30pct_share"] == pytest.approx(1 / 3, abs=1e-4)      # only the last
    assert p["drift_within_30pct_share"] == pytest.approx(2 / 3, abs=1e-4)      # not at 2.6 s, where the wait doubled
    assert p["retry_after_not_early_share"] == 1.0 and p["retry_after_within_30pct_share"] == 0.0
    assert p["goodput_per_s"] == pytest.approx(17 / 4)


def test_a_bulk_phase_whose_job_ran_out_fails_its_verdict():
    answers = [admitted(i / 4) for i in range(8)]
    p = summarise(answers, rate=4.0, duration=2.0, deadline_s=2.0, capacity=4.0, web_records=[])
    assert not any("bulk job" in name for name in verdict(p, retry_after_share=0.95))  # no bulk job: not judged
    for queued, ok in ((64, True), (0, False)):
        p["bulk"] = {"images": 3000, "counts_at_end": {"queued": queued, "embedded": 3000 - queued}}
        (name, value), = [(k, v) for k, v in verdict(p, retry_after_share=0.95).items() if "bulk job" in k]
        assert value is ok and name.startswith("2 s + bulk: ")


def test_a_bulk_phase_reports_the_images_its_job_embedded_during_it():
    p = summarise([admitted(i / 4) for i in range(8)], rate=4.0, duration=2.0, deadline_s=2.0, capacity=4.0,
                  web_records=[])
    assert not any("bulk images" in k for k in info(p))
    p["bulk"] = {"images": 3000, "counts_at_start": {"queued": 2936, "embedded": 64},
                 "counts_at_end": {"queued": 2808, "embedded": 192}}
    assert info(p)["2 s + bulk: bulk images embedded during the phase"] == "128 (64.00/s)"


class JobApi:
    """The benchmark's client for ``POST /api/jobs/{id}/{action}/`` and ``GET /api/jobs/{id}/``,
    with a bulk worker behind it: a chunk computing (``lane_control.keys.BULK_ACTIVITY_KEY`` field)
    finishes 0.3 s after the pause; after the resume the next starts at 0.3 s and is written (64
    images embedded) at 0.6 s."""

    def __init__(self, redis_client) -> None:
        self.redis, self.events, self.timers, self.embedded = redis_client, [], [], 100

    def _written(self) -> None:
        self.events.append("chunk written")
        self.embedded += 64

    def job(self, job_id: str) -> dict:
        return {"id": job_id, "counts": {"embedded": self.embedded}}

    def _after(self, delay_s: float, action) -> None:
        self.timers.append(threading.Timer(delay_s, action))
        self.timers[-1].start()

    def settle(self) -> None:
        """Wait for the worker's pending steps (before the test's Redis stops)."""
        for t in self.timers:
            t.join()

    def job_action(self, job_id: str, action: str) -> dict:
        self.events.append(f"{action} {job_id}")
        key = QueueSampler.KEYS["bulk"]
        if action == "pause":
            self._after(0.3, lambda: (self.events.append("chunk finished"), self.redis.hdel(key, "bulk-1")))
        else:
            self._after(0.3, lambda: (self.events.append("chunk started"), self.redis.hset(key, "bulk-1", time.time())))
            self._after(0.6, self._written)
        return {"id": job_id, "status": "paused" if action == "pause" else "queued"}  # JobSerializer: no counts


def test_a_bulk_rounds_capacity_is_measured_with_its_job_paused_and_its_running_chunk_finished(private_redis):
    """The scan of a bulk round runs once the job is paused and the chunk computing has finished;
    the job is resumed after it, and the phase starts once the job has embedded a chunk more and
    a chunk computes."""
    url, r = private_redis
    r.hset(QueueSampler.KEYS["bulk"], "bulk-1", time.time())
    api = JobApi(r)
    with bulk_job_paused(api, "j1", url, timeout_s=5) as pause:
        api.events.append(f"scan ({bulk_chunks_computing(r)} computing)")
    api.events.append("phase starts")
    api.settle()
    assert api.events == ["pause j1", "chunk finished", "scan (0 computing)", "resume j1", "chunk started",
                          "chunk written", "phase starts"]
    assert 0.2 <= pause["settled_s"] < 5 and bulk_chunks_computing(r) == 1


def test_a_bulk_round_resumes_its_job_when_the_scan_fails(private_redis):
    url, r = private_redis
    api = JobApi(r)
    with pytest.raises(RuntimeError), bulk_job_paused(api, "j1", url, timeout_s=5):
        raise RuntimeError("scan failed")
    api.settle()
    assert api.events[0] == "pause j1" and "resume j1" in api.events


def test_a_phase_reports_the_cores_each_process_used_in_its_window_alone():
    """Cumulative CPU seconds sampled once a second: the interactive worker uses one core throughout,
    the bulk worker two cores before the phase, then waits (0.05 of a core) inside it."""
    samples = [{"unix": 1000.0 + i, "worker-interactive:cpu_s": 1.0 * i,
                "worker-bulk:cpu_s": 2.0 * min(i, 10) + 0.05 * max(0, i - 10)} for i in range(31)]
    assert phase_cpu(samples, 1010.0, 1030.0, ["worker-interactive", "worker-bulk"]) == \
        {"worker-interactive": 1.0, "worker-bulk": 0.05}
    assert phase_cpu(samples, 1000.0, 1010.0, ["worker-bulk"]) == {"worker-bulk": 2.0}
    assert phase_cpu(samples, 1030.0, 1040.0, ["worker-bulk"]) == {}  # one sample: no rate


@pytest.fixture
def clamp_at_1_5(monkeypatch):
    """``wait_ahead.CLAMP`` at 1.5: at the shipped 1.3 no fit can move a right first estimate out
    of ±30 % (first / 1.3 is within it), so a fit learnt elsewhere could not be seen to miss."""
    from queueing import wait_ahead

    monkeypatch.setattr(wait_ahead, "CLAMP", 1.5)


def test_the_replay_of_what_429s_say_learns_per_deadline_band(clamp_at_1_5):
    """``benchmarks.load_replay.replay_wait_ahead`` on two phases: at 2 s the first estimate says
    0.45-0.55 s whatever the lane holds while the requests admitted around each 429 waited 0.15 s +
    0.1 s per image in flight; then at 5 s the first estimate is right (3 s). Learnt from every
    refusal, the 2 s phase's fit (the first estimate has little weight in it) carries into the 5 s
    one and misses there; per deadline band the 5 s phase's 429s say the first estimate until their
    own band has labels, which say it too (``clamp_at_1_5``)."""
    from benchmarks.load_replay import replay_wait_ahead

    def phase(deadline: float, start: float, n: int, *, first, wait) -> dict:
        answers, records = [], []
        for i in range(n):
            t, inflight, first_s = start + 0.7 * i, 1 + i % 8, first(i)
            answers.append({"sent": t, "status": 429, "ms": 5.0, "wait_ahead_s": first_s,
                            "model": {"first_wait_ahead_s": first_s, "inflight_images": inflight,
                                      "running_pass_left_s": 0.05 * (i % 5), "running_pass_images": 1 + i % 7,
                                      "queued_messages": 0}})
            answers.append({"sent": t + 0.1, "status": 200, "ms": 1000 * wait(inflight)})
            records.append({"admitted": t + 0.1, "answered": t + 0.1 + wait(inflight), "status": 200})
        return {"deadline_s": deadline, "answers": answers, "web_records": records}

    phases = [phase(2.0, 0.0, 48, first=lambda i: 0.45 + 0.05 * (i % 3), wait=lambda n: 0.15 + 0.1 * n),
              phase(5.0, 40.0, 48, first=lambda i: 3.0, wait=lambda n: 3.0)]
    every = replay_wait_ahead(phases, by_deadline=False)
    banded = replay_wait_ahead(phases, by_deadline=True)
    assert [p["name"] for p in banded] == ["2 s", "5 s"] and [p["checked"] for p in banded] == [48, 48]
    assert banded[0] == every[0]  # one band so far: the same fits
    truth = [0.15 + 0.1 * (1 + i % 8) for i in range(48)]
    assert banded[0]["first"] == pytest.approx(sum(abs(0.45 + 0.05 * (i % 3) - w) <= 0.3 * w
                                                   for i, w in enumerate(truth)) / 48, abs=1e-4)
    assert banded[0]["replayed"] > banded[0]["first"]  # learnt what the first estimate misses
    assert banded[1]["first"] == banded[1]["replayed"] == banded[1]["said"] == 1.0
    assert every[1]["replayed"] < banded[1]["replayed"]  # the 2 s phase's fit, said at 5 s: some miss


def test_the_replay_of_what_429s_say_starts_a_phase_from_what_the_web_learnt_before_it(clamp_at_1_5):
    """A phase's saved ``before`` (the web's refusals and answers of the minute before it: its
    capacity scan's) is learnt from and not judged: there the requests admitted around each refusal
    waited half the first estimate, in the phase they wait it. Without ``before`` every 429 of the
    phase says the first estimate and is right; with it the first ones say what the scan taught
    (``clamp_at_1_5``)."""
    from benchmarks.load_replay import replay_wait_ahead

    features = {"inflight_images": 2.0, "running_pass_left_s": 0.1, "running_pass_images": 4.0,
                "queued_messages": 1.0}
    answers, records = [], []
    for i in range(40):
        t = 100.0 + 0.5 * i
        answers.append({"sent": t, "status": 429, "ms": 5.0, "wait_ahead_s": 1.0,
                        "model": {"first_wait_ahead_s": 1.0, **features}})
        answers.append({"sent": t + 0.1, "status": 200, "ms": 1000.0})
        records.append({"admitted": t + 0.1, "answered": t + 1.1, "status": 200})
    scan = {"refusals": [{"t": 60.0 + 0.5 * i, "deadline_s": 2.0, "wait_ahead_s": 1.0, **features} for i in range(60)],
            "web_records": [{"admitted": 60.1 + 0.5 * i, "answered": 60.6 + 0.5 * i, "status": 200} for i in range(60)]}
    phase = {"deadline_s": 2.0, "answers": answers, "web_records": records, "window": [100.0, 121.0]}
    fresh = replay_wait_ahead([phase], by_deadline=True)[0]
    assert fresh["checked"] == 40 and fresh["first"] == fresh["replayed"] == 1.0
    taught = replay_wait_ahead([{**phase, "before": scan}], by_deadline=True)[0]
    assert taught["checked"] == 40 and taught["first"] == 1.0 and taught["replayed"] < 0.9


def test_the_replay_can_say_the_admission_edge_for_runs_made_before_it():
    """``load_replay.edge_first`` (``--first-edge``): from a 429's body, the edge at its learnt margin
    (2 − 0.5 = 1.5 s at a 2 s deadline, the margin's floor 0.2 and cap 0.4: queueing's defaults), or
    the drain to it where the predicted wait is more than twice that."""
    from benchmarks.load_replay import edge_first

    assert edge_first({"learnt_margin_s": 0.5}, deadline_s=2.0, predicted_wait_s=2.2) == pytest.approx(1.5)
    assert edge_first({"learnt_margin_s": 0.5}, deadline_s=2.0, predicted_wait_s=4.0) == pytest.approx(2.5)
    assert edge_first({"learnt_margin_s": 0.0}, deadline_s=2.0, predicted_wait_s=None) == pytest.approx(2 / 1.2)
    # another policy (``--min-margin-share 0.5 --max-margin-share 1``): the floor binds at 2 / 1.5
    assert edge_first({"learnt_margin_s": 0.0}, deadline_s=2.0, predicted_wait_s=None, min_share=0.5,
                      max_share=1.0) == pytest.approx(2 / 1.5)


def test_the_load_replay_predicts_a_steady_lane_and_counts_what_the_margin_misses():
    """``benchmarks.load_replay.replay`` on the web's records of a lane whose wait is exactly
    0.2 s + its work: every request after the first few is predicted within ±30 %, none waits past
    predicted + margin. Make one in ten 1 s late: those are outside ±30 %, and the first of them
    are short of predicted + margin, but not all: the margin learns the lateness from them."""
    from benchmarks.load_replay import replay

    def records(late_every: int = 0) -> list[dict]:
        out = []
        for i in range(100):
            work = 0.3 + 0.01 * (i % 40)
            wait = 0.2 + work + (1.0 if late_every and i % late_every == late_every - 1 else 0.0)
            out.append({"admitted": i * 0.2, "answered": i * 0.2 + wait, "work_s": work, "status": 200,
                        "predicted_s": 0.2 + work})
        return out

    steady = replay(records(), half_life_answers=16, half_life_s=10)
    assert steady["requests"] >= 90 and steady["within_30pct"] == 1.0 and steady["short"] == 0.0
    assert abs(steady["error_s"][1]) < 0.01
    late = replay(records(late_every=10), half_life_answers=16, half_life_s=10)
    assert late["requests"] == steady["requests"]
    # the late ones are 1 s over a wait of ~0.7 s: outside ±30 %; short until the margin has seen them
    assert late["within_30pct"] <= 0.91 and 0.01 <= late["short"] < 0.09
    assert replay(records()[:4], half_life_answers=16, half_life_s=10)["error_s"] is None  # too few


def test_the_load_benchmark_waits_for_the_first_calibrations_text_vectors(private_redis):
    """``benchmarks.load.first_calibration`` watches the key under which the cutoff calibration keeps
    its prompts' text vectors (``cutoff.PROMPT_VECTORS_KEY``): not there, it gives up after its
    timeout (``None``); there, it answers at once."""
    import fnmatch

    from benchmarks import load
    from embeddings.services.lifecycle import cutoff

    url, client = private_redis
    key = "clip:" + cutoff.PROMPT_VECTORS_KEY.format(model_id="ViT-B-32/random", prompts_sha256="ab" * 32)  # the deployment prefix
    assert fnmatch.fnmatchcase(key, load.PROMPT_VECTORS_PATTERN)
    assert load.first_calibration(url, timeout_s=1.5, quiet_s=0) is None
    client.set(key, "{}")
    assert load.first_calibration(url, timeout_s=1.5, quiet_s=0) == 0.0



def test_the_load_replay_runs_without_django_or_celery():
    """The replay judges a recorded run with ``queueing`` and ``benchmarks.load_judge`` alone: in a
    fresh interpreter with no settings module, neither Django nor Celery is imported."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    probe = ("import sys, benchmarks.load_replay, benchmarks.load_judge, queueing.wait_ahead\n"
             "print(sorted(m for m in ('django', 'celery', 'kombu', 'redis', 'embeddings', 'project') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
