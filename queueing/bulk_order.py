"""The bulk lane's order: which job's chunk enters the broker next, and what each job can expect.

Pure (no Django, no Redis): a snapshot of the lane's jobs (:class:`JobView`), the fairness tags kept
between picks (``tags``), a clock (``now``, Unix s) and the lane's rate (images/s) in; a decision out.
Tests drive it with a fake clock and assert exact orders; the app's scheduler
(``embeddings.bulk_schedule``) calls :func:`choose` each time a chunk leaves the window, and the
API's ETA, share and queue position replay the same rules (:func:`outlook`). The rules, in order
(docs/lanes.md, "The bulk lane's order"):

1. **urgent before background**: while an urgent job has unsent chunks, no background chunk is sent.
2. **deadlines**: among the class being served, if the fair order (rule 3, as a fluid share of the
   lane's rate: :func:`fair_finish`) would make a job with a deadline miss it while serving the
   deadline jobs earliest-deadline-first would not (:func:`deadline_split`), the earliest-deadline
   job that can still make it goes next. A job whose deadline cannot be met any more, even served
   first, is **infeasible**: flagged, and it falls back to its fair share instead of starving
   everyone.
3. **fair shares**: start-time fair queueing (Goyal, Vin and Cheng, SIGCOMM 1996) in images, across
   owners by weight, then across one owner's jobs equally. Each owner carries a finish tag; an owner
   that was idle starts at the lane's virtual time ``v`` (the start tag of the last pick), so it
   neither collects credit while idle nor waits behind everyone's history. The lowest start tag
   goes next; on equal tags the owner (job) with the fewest images left, which finishes a short job
   sooner and changes no one's share over time. The tags are soft state: losing them (a Redis restart) restarts fairness from equal
   footing, never loses work.

Units: images, seconds, images/s. A tag is images divided by weight.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

#: Tag keys: ``v`` the lane's virtual time (owner level), ``v:<owner>`` that owner's (job level),
#: ``o:<owner>`` an owner's finish tag, ``j:<job id>`` a job's finish tag inside its owner.
LANE_V = "v"

#: What a pick followed: :data:`URGENT_FAIR` / :data:`BACKGROUND_FAIR` (rule 3 in that class) or
#: :data:`DEADLINE` (rule 2).
DEADLINE = "deadline"
URGENT_FAIR = "urgent"
BACKGROUND_FAIR = "fair"


@dataclasses.dataclass(frozen=True)
class JobView:
    """One job of the lane as the scheduler sees it.

    Attributes:
        job_id: its id.
        owner: who it counts against for fair shares (a user's name; the model lifecycle's
            re-embeds are one owner of their own).
        weight: that owner's weight (> 0); every job of one owner carries the same.
        urgent: its class (``urgent`` before ``background``).
        deadline: Unix s, or None.
        created: Unix s; the tie-break, oldest first.
        pending: images not yet sent to the broker (the database holds them).
        in_flight: images sent and not finished (in the broker or computing).
        next_chunk: images of its next chunk (what a pick sends).
    """

    job_id: str
    owner: str
    weight: float = 1.0
    urgent: bool = False
    deadline: float | None = None
    created: float = 0.0
    pending: int = 0
    in_flight: int = 0
    next_chunk: int = 64

    @property
    def remaining(self) -> int:
        """Images not finished: unsent plus in flight."""
        return self.pending + self.in_flight


@dataclasses.dataclass(frozen=True)
class Pick:
    """The next chunk's job, why, and the tags to store for the next pick.

    Attributes:
        job_id: whose next chunk is sent.
        rule: :data:`URGENT_FAIR`, :data:`BACKGROUND_FAIR` or :data:`DEADLINE`.
        tags: tag entries that changed (``{key: value}``), to merge into the stored tags.
        infeasible: jobs whose deadline cannot be met any more (rule 2), flagged.
    """

    job_id: str
    rule: str
    tags: dict[str, float]
    infeasible: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What a job can expect in the lane as it is now (the API's ``lane`` block).

    Attributes:
        eta: Unix s when its last image is done under the rules (fluid shares; None without a rate).
        position: jobs of the lane expected to finish before it (0: it is next to finish).
        share: the fraction of the lane's images/s it gets now (0 while a class above it has work).
        at_risk: it has a deadline and ``eta`` is past it.
        infeasible: its deadline cannot be met even served first.
        jobs: jobs in the lane.
    """

    eta: float | None
    position: int
    share: float
    at_risk: bool
    infeasible: bool
    jobs: int


def fair_finish(jobs: Sequence[JobView], *, rate: float, start: float) -> tuple[dict[str, float], dict[str, float]]:
    """Finish times under fair shares alone, as a fluid: from ``start`` (Unix s) the lane's
    ``rate`` (images/s) is split across the owners with work by weight, and an owner's share
    equally across its jobs with work, until each job's ``remaining`` is done.

    Returns:
        ``({job id: finish (Unix s)}, {job id: share of the rate at start})``; a job with nothing
        remaining finishes at ``start`` with share 0.

    Raises:
        ValueError: ``rate`` is not positive.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 images/s, not {rate}")
    left = {j.job_id: float(j.remaining) for j in jobs if j.remaining > 0}
    by_id = {j.job_id: j for j in jobs}
    finish = {j.job_id: start for j in jobs if j.remaining <= 0}
    shares: dict[str, float] = {j.job_id: 0.0 for j in jobs}
    t, first = start, True
    while left:
        owners: dict[str, list[str]] = {}
        for jid in left:
            owners.setdefault(by_id[jid].owner, []).append(jid)
        total_w = sum(by_id[ids[0]].weight for ids in owners.values())
        speed = {jid: rate * by_id[ids[0]].weight / total_w / len(ids) for ids in owners.values() for jid in ids}
        if first:
            shares.update({jid: s / rate for jid, s in speed.items()})
            first = False
        step = min(left[jid] / speed[jid] for jid in left)
        t += step
        for jid in list(left):
            left[jid] -= speed[jid] * step
            if left[jid] <= 1e-9 * max(1.0, speed[jid]):
                finish[jid] = t
                del left[jid]
    return finish, shares


def deadline_split(jobs: Sequence[JobView], *, rate: float, start: float) -> tuple[list[JobView], list[JobView]]:
    """Earliest deadline first over the jobs with a deadline, from ``start`` at the whole ``rate``:
    ``(feasible, infeasible)``, each in deadline order. A job that would finish after its deadline
    even so is infeasible and takes no time from the others (it falls back to its fair share)."""
    feasible, infeasible = [], []
    t = start
    for j in sorted((j for j in jobs if j.deadline is not None and j.remaining > 0),
                    key=lambda j: (j.deadline, j.created, j.job_id)):
        done = t + j.remaining / rate
        if done <= j.deadline:
            feasible.append(j)
            t = done
        else:
            infeasible.append(j)
    return feasible, infeasible


def _class_start(jobs: Sequence[JobView], cls: list[JobView], *, now: float, rate: float) -> float:
    """When the class ``cls`` gets the lane: after every urgent image when it is the background."""
    if cls and cls[0].urgent:
        return now
    return now + sum(j.remaining for j in jobs if j.urgent) / rate


def choose(jobs: Sequence[JobView], *, now: float, rate: float | None, tags: Mapping[str, float],
           slack_s: float = 0.0) -> Pick | None:
    """The job whose next chunk goes to the broker now, or None when no job has an unsent chunk.

    Args:
        jobs: every job of the lane with work (unsent or in flight); order does not matter.
        now: Unix s.
        rate: the lane's images/s; None (not measured yet) leaves rule 2 out.
        tags: the fairness tags stored after earlier picks (``{}`` at first).
        slack_s: seconds taken off every deadline in rule 2 (what the broker's window already holds
            ahead of the next chunk).
    """
    ready = [j for j in jobs if j.pending > 0]
    if not ready:
        return None
    urgent = [j for j in ready if j.urgent]
    cls = urgent or ready
    rule = URGENT_FAIR if urgent else BACKGROUND_FAIR
    infeasible: tuple[str, ...] = ()
    chosen: JobView | None = None
    if rate and rate > 0:
        members = [j for j in jobs if j.urgent == cls[0].urgent and j.remaining > 0]
        start = _class_start(jobs, cls, now=now, rate=rate)
        shifted = [dataclasses.replace(j, deadline=j.deadline - slack_s) if j.deadline is not None else j
                   for j in members]
        feasible, late = deadline_split(shifted, rate=rate, start=start)
        infeasible = tuple(j.job_id for j in late)
        if feasible:
            finish, _ = fair_finish(shifted, rate=rate, start=start)
            if any(finish[j.job_id] > j.deadline for j in feasible):
                chosen = next((j for j in feasible if j.pending > 0), None)
                rule = DEADLINE if chosen is not None else rule
    owner_tags, job_tags = _sfq_start(cls, tags)
    if chosen is None:  # equal start tags: the owner (job) with the fewest images left first, then the oldest
        owner = min({j.owner for j in cls}, key=lambda o: (owner_tags[o], _left(cls, o), _oldest(cls, o), o))
        chosen = min((j for j in cls if j.owner == owner),
                     key=lambda j: (job_tags[j.job_id], j.remaining, j.created, j.job_id))
    return Pick(job_id=chosen.job_id, rule=rule, tags=_advance(chosen, owner_tags, job_tags), infeasible=infeasible)


def _left(jobs: Iterable[JobView], owner: str) -> int:
    return sum(j.remaining for j in jobs if j.owner == owner)


def _oldest(jobs: Iterable[JobView], owner: str) -> float:
    return min(j.created for j in jobs if j.owner == owner)


def _sfq_start(jobs: Sequence[JobView], tags: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Start tags ``({owner: tag}, {job id: tag})``: an owner's (job's) finish tag, or the lane's
    (owner's) virtual time if that is later: time spent idle earns nothing."""
    v = tags.get(LANE_V, 0.0)
    owners = {j.owner for j in jobs}
    owner_tags = {o: max(tags.get(f"o:{o}", v), v) for o in owners}
    job_tags = {j.job_id: max(tags.get(f"j:{j.job_id}", tags.get(f"v:{j.owner}", 0.0)), tags.get(f"v:{j.owner}", 0.0))
                for j in jobs}
    return owner_tags, job_tags


def _advance(job: JobView, owner_tags: Mapping[str, float], job_tags: Mapping[str, float]) -> dict[str, float]:
    """The tags a pick of ``job``'s next chunk writes: the lane's and the owner's virtual times move
    to the pick's start tags; the owner's finish tag grows by the chunk's images over its weight,
    the job's by its images (one owner's jobs share equally)."""
    size = max(1, min(job.next_chunk, job.pending))
    o_start, j_start = owner_tags[job.owner], job_tags[job.job_id]
    return {LANE_V: o_start, f"o:{job.owner}": o_start + size / job.weight,
            f"v:{job.owner}": j_start, f"j:{job.job_id}": j_start + size}


def tags_prune(tags: Mapping[str, float], jobs: Iterable[JobView]) -> list[str]:
    """Tag keys that no longer matter: jobs not in the lane, and owners with no job in it whose
    finish tag the lane's virtual time has passed (they would start at ``v`` anyway)."""
    jobs = list(jobs)
    ids, owners = {j.job_id for j in jobs}, {j.owner for j in jobs}
    v = tags.get(LANE_V, 0.0)
    out = []
    for key, value in tags.items():
        kind, _, name = key.partition(":")
        if kind == "j" and name not in ids:
            out.append(key)
        elif kind == "o" and name not in owners and value <= v:
            out.append(key)
        elif kind == "v" and name and name not in owners:
            out.append(key)
    return out


def outlook(jobs: Sequence[JobView], *, now: float, rate: float | None) -> dict[str, Outlook]:
    """Each job's expectation under the rules: urgent jobs share the lane first, then the
    background; inside a class, fair shares, except that deadline jobs the fair order would make
    miss are served earliest-deadline-first (those finish at their EDF time, the rest share what is
    left). ``rate`` None or 0: no ETA, shares only.

    Returns:
        ``{job id: Outlook}`` for every job with work.
    """
    live = [j for j in jobs if j.remaining > 0]
    out: dict[str, Outlook] = {}
    if not live:
        return out
    eta: dict[str, float] = {}
    share: dict[str, float] = {}
    infeasible: set[str] = set()
    urgent = [j for j in live if j.urgent]
    background = [j for j in live if not j.urgent]
    for cls in (urgent, background):
        if not cls:
            continue
        if not rate or rate <= 0:
            owners: dict[str, list[JobView]] = {}
            for j in cls:
                owners.setdefault(j.owner, []).append(j)
            total_w = sum(js[0].weight for js in owners.values())
            share.update({j.job_id: js[0].weight / total_w / len(js) for js in owners.values() for j in js})
        else:
            start = _class_start(live, cls, now=now, rate=rate)
            feasible, late = deadline_split(cls, rate=rate, start=start)
            infeasible |= {j.job_id for j in late}
            finish, shares = fair_finish(cls, rate=rate, start=start)
            if feasible and any(finish[j.job_id] > j.deadline for j in feasible):
                t = start
                for j in feasible:  # served first, one after another, at the whole rate
                    t += j.remaining / rate
                    eta[j.job_id] = t
                rest = [j for j in cls if j.job_id not in eta]
                rest_finish, _ = fair_finish(rest, rate=rate, start=t) if rest else ({}, {})
                eta.update(rest_finish)
                first = feasible[0].job_id
                share.update({j.job_id: (1.0 if j.job_id == first else 0.0) for j in cls})
            else:
                eta.update(finish)
                share.update(shares)
        if cls is background and urgent:
            share.update({j.job_id: 0.0 for j in cls})
    order = sorted(live, key=lambda j: (eta.get(j.job_id, float("inf")), not j.urgent, j.created, j.job_id))
    for position, j in enumerate(order):
        e = eta.get(j.job_id)
        out[j.job_id] = Outlook(eta=e, position=position, share=round(share.get(j.job_id, 0.0), 4),
                                at_risk=bool(j.deadline is not None and e is not None and e > j.deadline),
                                infeasible=j.job_id in infeasible, jobs=len(live))
    return out
