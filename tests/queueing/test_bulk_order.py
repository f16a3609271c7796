"""The bulk lane's order (``queueing.bulk_order``), driven by a fake lane with a fake clock: exact
pick orders for each rule, and the outlook (ETA, position, share) the API shows."""
from __future__ import annotations

import dataclasses

import pytest

from queueing import bulk_order
from queueing.bulk_order import DEADLINE, JobView, choose, deadline_split, fair_finish, outlook, tags_prune


class FakeLane:
    """A lane of ``slots`` workers, ``per_slot`` images/s each, and a window of ``window`` chunks in
    flight (sent, waiting or computing, served in the order sent). Jobs arrive at given times;
    :meth:`run` picks a chunk with :func:`choose` whenever the window has room, and advances the
    fake clock from one chunk's end to the next."""

    def __init__(self, *, slots: int = 1, per_slot: float = 64.0, window: int = 2, chunk: int = 64):
        self.slots, self.per_slot, self.window, self.chunk = slots, per_slot, window, chunk
        self.now = 0.0
        self.jobs: dict[str, JobView] = {}
        self.arrivals: list[tuple[float, JobView]] = []
        self.tags: dict[str, float] = {}
        self.sent: list[tuple[str, int]] = []  # (job, images) in the order sent
        self.computing: list[tuple[float, str, int]] = []  # (ends at, job, images)
        self.picks: list[str] = []
        self.rules: list[str] = []
        self.finished: dict[str, float] = {}
        self.infeasible: set[str] = set()

    def add(self, at: float, job_id: str, owner: str, images: int, **kw) -> None:
        self.arrivals.append((at, JobView(job_id=job_id, owner=owner, pending=images, created=at,
                                          next_chunk=self.chunk, **kw)))

    def _arrive(self) -> None:
        for at, job in list(self.arrivals):
            if at <= self.now + 1e-9:
                self.jobs[job.job_id] = job
                self.arrivals.remove((at, job))

    def _fill(self) -> None:
        while len(self.sent) + len(self.computing) < self.window:
            pick = choose(list(self.jobs.values()), now=self.now, rate=self.slots * self.per_slot, tags=self.tags)
            if pick is None:
                return
            self.tags.update(pick.tags)
            self.infeasible |= set(pick.infeasible)
            j = self.jobs[pick.job_id]
            n = min(self.chunk, j.pending)
            self.jobs[j.job_id] = dataclasses.replace(j, pending=j.pending - n, in_flight=j.in_flight + n)
            self.sent.append((j.job_id, n))
            self.picks.append(j.job_id)
            self.rules.append(pick.rule)

    def _start(self) -> None:
        while self.sent and len(self.computing) < self.slots:
            job_id, n = self.sent.pop(0)
            self.computing.append((self.now + n / self.per_slot, job_id, n))

    def run(self, until: float = 1e9) -> "FakeLane":
        while self.now < until:
            self._arrive()
            self._fill()
            self._start()
            if not self.computing:
                if not self.arrivals:
                    return self
                self.now = min(at for at, _ in self.arrivals)
                continue
            nxt = min(self.computing)
            upcoming = [at for at, _ in self.arrivals if at < nxt[0]]
            if upcoming:  # a job arrives while chunks compute: it joins at once
                self.now = min(upcoming)
                continue
            self.computing.remove(nxt)
            self.now, job_id, n = nxt
            j = self.jobs[job_id]
            j = dataclasses.replace(j, in_flight=j.in_flight - n)
            self.jobs[job_id] = j
            if j.remaining == 0:
                self.finished[job_id] = self.now
                del self.jobs[job_id]
        return self


def test_a_small_job_of_another_owner_goes_next_instead_of_after_the_big_one():
    lane = FakeLane(window=2)
    lane.add(0.0, "big", "a", 64 * 10)
    lane.add(2.5, "small", "b", 64)
    lane.run()
    # two big chunks were in the window when the small job came; it is the next one sent
    assert lane.picks == ["big"] * 4 + ["small"] + ["big"] * 6
    assert lane.finished["small"] == 5.0  # waited for two chunks (the window), ran one: 2.5 s, not 8.5
    assert lane.finished["big"] == 11.0


def test_equal_tags_go_to_the_owner_with_the_fewest_images_left():
    lane = FakeLane(window=2)
    lane.add(0.0, "big", "a", 64 * 10)
    lane.add(2.5, "small", "b", 64 * 3)
    lane.run()
    # after its first chunk the small job ties with the big one and goes again; then they alternate
    assert lane.picks == ["big"] * 4 + ["small", "small", "big", "small"] + ["big"] * 5
    assert lane.finished == {"small": 8.0, "big": 13.0}
    tie = [JobView("x", "a", pending=64, created=0.0), JobView("y", "b", pending=64, created=1.0)]
    assert choose(tie, now=0.0, rate=None, tags={}).job_id == "x"  # equal work too: the oldest


def test_urgent_chunks_go_before_background_ones_whatever_the_tags():
    lane = FakeLane(window=1)
    lane.add(0.0, "bg", "a", 64 * 3)
    lane.add(0.5, "up", "b", 64 * 2, urgent=True)
    lane.run()
    assert lane.picks == ["bg", "up", "up", "bg", "bg"]
    assert lane.rules[1:3] == ["urgent", "urgent"]


def test_equal_owners_alternate_and_an_idle_owner_earns_no_credit():
    lane = FakeLane(window=1)
    lane.add(0.0, "a1", "a", 64 * 6)
    lane.add(3.0, "b1", "b", 64 * 4)  # a was served alone meanwhile: b gets its half from now on, not 3 in a row
    lane.run()
    assert lane.picks == ["a1", "a1", "a1", "b1", "a1", "b1", "a1", "b1", "a1", "b1"]


def test_weights_two_to_one_to_one_give_half_a_quarter_and_a_quarter():
    lane = FakeLane(window=1)
    for owner, weight in (("a", 2.0), ("b", 1.0), ("c", 1.0)):
        lane.add(0.0, owner, owner, 64 * 100, weight=weight)
    lane.run(until=40.0)
    first = lane.picks[:40]
    assert (first.count("a"), first.count("b"), first.count("c")) == (20, 10, 10)
    assert first[:8] == ["a", "b", "c", "a", "a", "b", "c", "a"]


def test_one_owners_jobs_share_its_half_and_the_other_owner_keeps_its_half():
    lane = FakeLane(window=1)
    lane.add(0.0, "a1", "a", 64 * 4)
    lane.add(0.0, "a2", "a", 64 * 4)
    lane.add(0.0, "b1", "b", 64 * 8)
    lane.run(until=8.0)
    assert lane.picks[:8] == ["a1", "b1", "a2", "b1", "a1", "b1", "a2", "b1"]


def test_edf_takes_over_only_when_the_fair_order_would_miss_a_deadline():
    # 64 images/s. a: 640 images, no deadline. b: 320 images due at 7 s: its fair half (32/s) ends
    # at 10 s, served first it ends at 5 s: EDF serves b until fair shares would make it.
    lane = FakeLane(window=1)
    lane.add(0.0, "a", "a", 640)
    lane.add(0.0, "b", "b", 320, deadline=7.0)
    lane.run()
    assert lane.finished["b"] <= 7.0
    assert lane.picks[:7] == ["b", "b", "b", "a", "b", "a", "b"]
    assert lane.rules[:3] == [DEADLINE, DEADLINE, DEADLINE]
    assert lane.rules[3] == "fair"  # from there the fair order makes it: a gets its turn
    assert not lane.infeasible


def test_a_deadline_that_cannot_be_met_is_flagged_and_falls_back_to_its_fair_share():
    lane = FakeLane(window=1)
    lane.add(0.0, "a", "a", 64 * 4)
    lane.add(0.0, "late", "b", 64 * 8, deadline=2.0)  # 8 s of work due in 2 s: no order makes it
    lane.add(0.0, "ok", "c", 64 * 2, deadline=6.5)  # a third of the lane makes it, just; chunks are coarser
    lane.run()
    assert lane.infeasible == {"late"}
    # the infeasible job takes its fair turns (it neither starves the others nor is starved), and
    # the fair order (ties to the fewest images left) meets "ok" without EDF
    assert lane.picks == ["ok", "a", "late", "ok", "a", "late", "a", "late", "a"] + ["late"] * 5
    assert DEADLINE not in lane.rules
    assert lane.finished == {"ok": 4.0, "a": 9.0, "late": 14.0}


def test_a_mix_of_feasible_deadlines_is_met_where_fair_shares_alone_miss_one():
    jobs = [("x", "a", 64 * 6, None), ("d1", "b", 64 * 3, 5.0), ("d2", "c", 64 * 2, 8.0)]
    fair = FakeLane(window=1)
    fair.add(0.0, "x", "a", 64 * 6)
    for job_id, owner, n, d in jobs[1:]:
        fair.add(0.0, job_id, owner, n, deadline=d)
    fair.run()
    assert fair.finished["d1"] <= 5.0 and fair.finished["d2"] <= 8.0
    # the same jobs in fifo order (x first) miss both
    assert 6 + 3 > 5.0 and 6 + 3 + 2 > 8.0


def test_without_a_rate_deadlines_are_left_to_fair_shares():
    jobs = [JobView("a", "a", pending=640), JobView("b", "b", pending=6400, deadline=0.1)]
    pick = choose(jobs, now=0.0, rate=None, tags={})
    assert pick.rule == "fair" and pick.job_id == "a"  # a tie on tags: the fewest images left


def test_no_unsent_chunk_means_no_pick():
    assert choose([JobView("a", "a", pending=0, in_flight=64)], now=0.0, rate=10.0, tags={}) is None
    assert choose([], now=0.0, rate=10.0, tags={}) is None


def test_fair_finish_is_the_fluid_share_by_weight_then_by_job():
    jobs = [JobView("a1", "a", weight=2.0, pending=100), JobView("a2", "a", weight=2.0, pending=300),
            JobView("b", "b", pending=200)]
    finish, shares = fair_finish(jobs, rate=30.0, start=100.0)
    # a gets 20/s (10 each), b 10/s: a1 done at 110; a2 keeps a's 20/s, so b is done at 120
    assert shares == pytest.approx({"a1": 1 / 3, "a2": 1 / 3, "b": 1 / 3})
    assert finish["a1"] == pytest.approx(110.0)
    assert finish["b"] == pytest.approx(110.0 + 100 / 10.0)
    assert max(finish.values()) == pytest.approx(100.0 + 600 / 30.0)  # work-conserving
    with pytest.raises(ValueError, match="rate must be > 0"):
        fair_finish(jobs, rate=0.0, start=0.0)


def test_deadline_split_drops_the_job_that_cannot_make_it_and_charges_nothing_for_it():
    jobs = [JobView("d1", "a", pending=100, deadline=10.0), JobView("d2", "b", pending=1000, deadline=20.0),
            JobView("d3", "c", pending=100, deadline=30.0)]
    feasible, late = deadline_split(jobs, rate=10.0, start=0.0)
    assert [j.job_id for j in feasible] == ["d1", "d3"] and [j.job_id for j in late] == ["d2"]


def test_outlook_gives_eta_position_share_and_risk():
    jobs = [JobView("big", "a", pending=600, created=0.0), JobView("small", "b", pending=60, created=1.0),
            JobView("hurry", "c", pending=60, urgent=True, created=2.0, deadline=100.0)]
    out = outlook(jobs, now=0.0, rate=60.0)
    assert out["hurry"].eta == pytest.approx(1.0) and out["hurry"].share == 1.0 and out["hurry"].position == 0
    assert out["small"].eta == pytest.approx(1.0 + 120 / 60.0) and out["small"].position == 1
    assert out["big"].eta == pytest.approx(1.0 + 660 / 60.0) and out["big"].position == 2
    assert out["big"].share == 0.0  # an urgent job has the lane now
    assert not any(o.at_risk for o in out.values()) and out["big"].jobs == 3
    late = outlook([JobView("x", "a", pending=600, deadline=5.0)], now=0.0, rate=60.0)["x"]
    assert late.at_risk and late.infeasible and late.eta == pytest.approx(10.0)


def test_tags_of_finished_jobs_and_idle_owners_are_pruned():
    tags = {"v": 50.0, "o:a": 80.0, "o:b": 40.0, "o:c": 90.0, "v:b": 3.0, "j:gone": 7.0, "j:x": 1.0, "v:a": 1.0}
    keep = [JobView("x", "a", pending=1)]
    assert sorted(tags_prune(tags, keep)) == ["j:gone", "o:b", "v:b"]  # c's tag is ahead of v: it still counts
    assert bulk_order.LANE_V == "v"
