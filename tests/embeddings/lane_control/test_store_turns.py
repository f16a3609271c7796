"""``lane_control.store_turns``: where the interactive worker owns the embedded store, its threads
take turns at it: one holder at a time, interactive work before background work, a bulk write
lets waiting interactive work through between slices, and vectors-queue tasks take their turn
around the whole task (Celery's ``task_prerun`` / ``task_postrun``)."""
from __future__ import annotations

import threading
import time
import types

import pytest

from embeddings.lane_control import store_turns as st
from project import lanes


def _start(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _until(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_interactive_work_goes_before_background_work_waiting_longer():
    """While a holder works, a background waiter arrives first and an interactive one second: the
    interactive one is next."""
    turn, order = st.StoreTurn(), []
    release = threading.Event()

    def holder():
        with turn.hold(interactive=False):
            order.append("holder")
            release.wait(5)

    def waiter(name, interactive):
        with turn.hold(interactive=interactive):
            order.append(name)

    threads = [_start(holder)]
    _until(lambda: order == ["holder"])
    threads.append(_start(lambda: waiter("background", False)))
    time.sleep(0.05)
    threads.append(_start(lambda: waiter("interactive", True)))
    _until(lambda: turn.interactive_waiting() == 1)
    release.set()
    for t in threads:
        t.join(5)
    assert order == ["holder", "interactive", "background"]


def test_a_background_holder_lets_interactive_work_through_between_slices_and_goes_on():
    """A bulk write's slices: between two, the interactive request waiting takes the turn, and the
    write takes it back once none waits; with nobody waiting it is not given up."""
    turn, order = st.StoreTurn(), []
    waiting = threading.Event()

    def interactive():
        waiting.set()
        with turn.hold(interactive=True):
            order.append("interactive")

    with turn.hold(interactive=False):
        assert turn.let_interactive_through() == 0.0  # nobody waits: kept
        order.append("slice 1")
        t = _start(interactive)
        _until(lambda: turn.interactive_waiting() == 1)
        away = turn.let_interactive_through()
        order.append("slice 2")
        t.join(5)
    assert order == ["slice 1", "interactive", "slice 2"] and away > 0
    assert turn.let_interactive_through() == 0.0  # not held by this thread: nothing to hand over


def test_the_turn_is_reentrant_and_given_back_when_the_block_raises():
    turn = st.StoreTurn()
    with pytest.raises(RuntimeError), turn.hold(interactive=False), turn.hold(interactive=True):  # re-entrant
        raise RuntimeError("a write that fails")
    got = []

    def other():
        with turn.hold(interactive=False):
            got.append(True)

    t = _start(other)
    t.join(5)
    assert got == [True]


def _task(routing_key: str, priority: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(request=types.SimpleNamespace(delivery_info={"routing_key": routing_key,
                                                                              "priority": priority}))


def test_vectors_queue_tasks_take_their_turn_only_where_the_interactive_worker_owns_the_store(settings, monkeypatch):
    """``task_prerun`` takes a vectors-queue task's turn (interactive priority: an interactive
    turn) and ``task_postrun`` gives it back; other queues' tasks, and every task where the solo
    vectors worker owns the store or a server is used, take none."""
    turn = st.StoreTurn()
    monkeypatch.setattr(st, "store_turn", lambda: turn)
    settings.STORE_OWNER, settings.VECTOR_STORE = "interactive", "edge"
    assert st.owner_runs_threads()

    st.task_turn_start(task=_task(lanes.VECTORS, lanes.PRIORITY_BULK_BACKGROUND))
    assert turn._holder == threading.get_ident()
    got = []

    def interactive():
        with turn.hold(interactive=True):
            got.append(turn._holder == threading.get_ident())

    waiter = _start(interactive)
    _until(lambda: turn.interactive_waiting() == 1)
    assert got == []
    st.task_turn_end()  # handed on at the task's end
    waiter.join(5)
    assert got == [True] and turn._holder is None

    turn2 = st.StoreTurn()
    monkeypatch.setattr(st, "store_turn", lambda: turn2)
    st.task_turn_start(task=_task(lanes.INTERACTIVE, lanes.PRIORITY_INTERACTIVE))
    assert turn2._holder is None
    st.task_turn_end()
    for owner, store in (("vectors", "edge"), ("interactive", "server")):
        settings.STORE_OWNER, settings.VECTOR_STORE = owner, store
        assert not st.owner_runs_threads()
        st.task_turn_start(task=_task(lanes.VECTORS, lanes.PRIORITY_INTERACTIVE))
        assert turn2._holder is None
        st.task_turn_end()
