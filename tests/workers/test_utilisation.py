"""The utilisation sampler: CPU every interval, GPU fields only where NVML sees a device."""
from __future__ import annotations

import time

from workers.utilisation import Gpu, Sample, Sampler, merge_rows, summarise


def test_sampler_reads_cpu_every_interval_and_gpu_only_with_nvml():
    seen = []
    sampler = Sampler(interval_s=0.05)
    sampler.on_sample(seen.append)
    with sampler:
        deadline = time.monotonic() + 5
        x = 0
        while len(sampler.samples()) < 4 and time.monotonic() < deadline:
            x += 1  # keep a core busy
    samples = sampler.samples()
    assert len(samples) >= 4 and seen[: len(samples)] == samples[: len(seen)]
    assert all(0.0 <= s.cpu_percent <= 100.0 for s in samples)
    assert [s.t for s in samples] == sorted(s.t for s in samples)
    if Gpu().available:
        assert all(s.gpu_percent is not None and s.gpu_memory_mib > 0 for s in samples)
    else:
        assert all(s.gpu_percent is None and s.gpu_memory_mib is None for s in samples)


def test_take_new_hands_each_sample_to_a_job_once():
    sampler = Sampler(interval_s=3600)  # never ticks by itself: samples taken by hand
    a = sampler.sample_now()
    b = sampler.sample_now()
    assert sampler.take_new("job1", since=a.t - 1) == [a, b]
    assert sampler.take_new("job1", since=a.t - 1) == []
    c = sampler.sample_now()
    assert sampler.take_new("job1", since=0) == [c]
    assert sampler.take_new("job2", since=b.t) == [c]  # another job: its own window


def test_merge_rows_keeps_one_row_per_second_sorted():
    rows, interval = merge_rows([[10.5, 1.0, None, None]],
                                [Sample(9.1, 5.0), Sample(10.9, 7.0), Sample(11.0, 8.0, 50.0, 1024.0)])
    assert (rows, interval) == ([[9.1, 5.0, None, None], [10.5, 1.0, None, None], [11.0, 8.0, 50.0, 1024.0]], 1.0)
    assert Sample.from_row(rows[-1]) == Sample(11.0, 8.0, 50.0, 1024.0)


def test_merge_rows_past_max_rows_doubles_the_interval_and_keeps_the_whole_span():
    # 10 seconds, CPU = the second's number, GPU memory peaking at second 3
    new = [Sample(100.0 + i, float(i), 10.0, 500.0 if i == 3 else 100.0) for i in range(10)]
    rows, interval = merge_rows([], new, max_rows=4)
    assert interval == 4.0  # 10 rows > 4 → 2 s buckets (5 rows) > 4 → 4 s buckets: 100, 104, 108
    assert rows == [[100.0, 1.5, 10.0, 500.0, 4], [104.0, 5.5, 10.0, 100.0, 4], [108.0, 8.5, 10.0, 100.0, 2]]
    # later samples join their bucket, weighted by the samples it holds
    rows, interval = merge_rows(rows, [Sample(110.2, 20.0, None, None), Sample(111.5, 30.0)], interval_s=interval,
                                max_rows=4)
    assert interval == 4.0 and rows[-1] == [108.0, 16.8, 10.0, 100.0, 4]  # (8 + 9 + 20 + 30) / 4 = 16.75
    assert sum(r[4] for r in rows) == 12


def test_a_day_of_samples_stays_within_max_job_rows():
    from workers.utilisation import MAX_JOB_ROWS

    rows, interval = [], 1.0
    for hour in range(24):  # one merge per hour of one-second samples, as chunks would append them
        rows, interval = merge_rows(rows, [Sample(hour * 3600.0 + i, 50.0) for i in range(3600)], interval_s=interval)
    assert len(rows) <= MAX_JOB_ROWS and interval == 128.0
    assert sum(r[4] for r in rows) == 86_400 and {r[1] for r in rows} == {50.0}


def test_summarise():
    s = summarise([Sample(1, 10.0), Sample(2, 30.0, 90.0, 100.0), Sample(3, 20.0)])
    assert s["samples"] == 3
    assert s["cpu_percent"] == {"min": 10.0, "avg": 20.0, "p95": 30.0, "max": 30.0}
    assert s["gpu_percent"]["avg"] == 90.0 and s["gpu_memory_mib"]["max"] == 100.0
    assert summarise([])["cpu_percent"] is None
