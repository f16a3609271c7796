"""A chunk cut into forward passes (``workers.passes``): fixed passes, or passes that grow while the
last pass's time per image (decode and forward) keeps one under the budget, never below the first
pass's size."""
from __future__ import annotations

import pytest

from workers.passes import Passes

KEYS = [f"k{i:03d}" for i in range(512)]


def cut(passes: Passes, ms_per_image: float) -> list[int]:
    """The pass sizes when every pass takes ``ms_per_image`` per image."""
    for batch in passes:
        passes.record(len(batch), ms_per_image * len(batch))
    return passes.sizes


def test_without_a_budget_every_pass_holds_the_first_size_and_every_key_once():
    passes = Passes(KEYS, 4)
    seen = [k for batch in passes for k in batch]
    assert seen == KEYS and passes.sizes == [4] * 128
    assert cut(Passes(KEYS[:10], 4, budget_ms=0), 1.0) == [4, 4, 2]  # 0: fixed passes


@pytest.mark.parametrize("ms_per_image,sizes", [
    (29.0, [4] * 128),  # a CPU model: 4 images already over 100 ms: unchanged
    (0.5, [4, 200, 200, 108]),  # a GPU: 200 images fit in 100 ms
    (0.0, [4, 508]),  # a model that costs nothing: the rest in one pass
    (12.5, [4] + [8] * 63 + [4]),  # 8 images fit exactly
])
def test_passes_grow_to_what_the_budget_fits(ms_per_image, sizes):
    passes = Passes(KEYS, 4, budget_ms=100.0)
    assert cut(passes, ms_per_image) == sizes and sum(sizes) == len(KEYS)


def test_a_slow_pass_brings_the_next_one_back_down_but_never_below_the_first_size():
    passes, sizes = Passes(KEYS[:300], 4, budget_ms=100.0), []
    for i, batch in enumerate(passes):
        sizes.append(len(batch))
        passes.record(len(batch), len(batch) * (0.5 if i == 0 else 50.0))  # the second pass ran slow
    assert sizes[:3] == [4, 200, 4] and sum(sizes) == 300


def test_nothing_recorded_for_an_empty_pass_and_bad_arguments_refused():
    passes = Passes(KEYS[:12], 4, budget_ms=100.0)
    it = iter(passes)
    next(it)
    passes.record(0, 5.0)  # every image of the pass failed to decode: no time per image learnt
    assert len(next(it)) == 4
    with pytest.raises(ValueError, match="first must be >= 1"):
        Passes(KEYS, 0)
    with pytest.raises(ValueError, match="budget_ms must be >= 0"):
        Passes(KEYS, 4, budget_ms=-1)
