"""``embeddings/metric_files.py``: a process killed with SIGKILL (as the OOM killer does) leaves the
scrape's gauges and its files are settled, while what it counted is still added up. Real child
processes write the project's own metrics (``embeddings.metrics``) into a folder of the test's own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from embeddings import metric_files
from tests.conftest import ROOT

#: A worker child: sets the CPU gauge to argv[1], counts argv[2] embedded images and one decode stage
#: of 12 ms, says so, then waits to be killed.
CHILD = """
import sys, time
import django
django.setup()
from embeddings import metrics
metrics.CPU_PERCENT.set(float(sys.argv[1]))
metrics.count_images(lane="bulk", status="embedded", n=int(sys.argv[2]))
metrics.observe_stages(lane="bulk", stages_ms={"decode": 12.0})
print("ready", flush=True)
time.sleep(600)
"""


def start_child(folder, cpu: float, images: int) -> subprocess.Popen:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "METRICS_DIR": str(folder)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # settings.py derives it from METRICS_DIR
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(cpu), str(images)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def scrape(folder) -> dict[str, float]:
    """``{sample line's name and labels: value}`` of one scrape of ``folder``."""
    registry = CollectorRegistry()
    metric_files.LiveProcessCollector(registry, path=str(folder))
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def kept(samples: dict[str, float]) -> dict[str, float]:
    """The samples that outlive their processes: counters and histograms."""
    return {k: v for k, v in samples.items() if k.startswith(("clip_images_processed", "clip_stage_seconds"))}


def killed(p: subprocess.Popen, *, reap: bool) -> None:
    """SIGKILL ``p``; ``reap``: wait for it, else leave it a zombie its parent has not reaped yet."""
    p.kill()
    if reap:
        p.wait()
        return
    for _ in range(200):
        with open(f"/proc/{p.pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[0] == b"Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"{p.pid} did not become a zombie")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_killed_processs_gauge_leaves_the_scrape_its_files_go_and_its_counts_stay(tmp_path):
    first = start_child(tmp_path, 11.0, 3)
    second = start_child(tmp_path, 22.0, 4)  # the most recent CPU sample
    try:
        both = scrape(tmp_path)
        assert both["clip_cpu_percent"] == 22.0
        assert both['clip_images_processed_total{lane="bulk",status="embedded"}'] == 7.0
        assert both['clip_stage_seconds_count{lane="bulk",stage="decode"}'] == 2.0
        assert both['clip_stage_seconds_bucket{lane="bulk",le="0.025",stage="decode"}'] == 2.0
        assert both['clip_stage_seconds_sum{lane="bulk",stage="decode"}'] == pytest.approx(0.024)

        killed(second, reap=False)  # its parent has not reaped it yet: dead all the same
        one = scrape(tmp_path)
        assert one["clip_cpu_percent"] == 11.0  # the live process's sample, not the dead one's, newer
        assert kept(one) == kept(both)
        assert not [f for f in os.listdir(tmp_path) if f.endswith(f"_{second.pid}.db")]

        killed(first, reap=True)
        none = scrape(tmp_path)
        assert "clip_cpu_percent" not in none and "clip_gpu_utilisation_percent" not in none
        assert kept(none) == kept(both)  # counters never go back
        assert sorted(os.listdir(tmp_path)) == [".settle.lock", "counter_dead.db", "histogram_dead.db"]
        assert scrape(tmp_path) == none  # settling again changes nothing
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


def test_only_processes_that_are_not_alive_are_settled(tmp_path):
    from prometheus_client.mmap_dict import MmapedDict

    for name in ("counter_101.db", "gauge_livemostrecent_101.db", "gauge_all_202.db", "counter_202.db",
                 "counter_dead.db"):
        MmapedDict(str(tmp_path / name)).close()  # an empty metrics file, as a process starts one
    assert metric_files.files_by_pid(str(tmp_path)).keys() == {101, 202}
    assert metric_files.settle_dead(str(tmp_path), alive=lambda pid: pid == 101) == [202]
    assert sorted(os.listdir(tmp_path)) == ["counter_101.db", "counter_dead.db", "gauge_livemostrecent_101.db"]
    assert metric_files.pid_alive(os.getpid()) is True
