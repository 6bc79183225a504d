"""How long a trial runs and what its clean-up walks: two measured steps where they are steady, the count asked
for otherwise, and a tune's garbage collections over the objects the tune made, not the whole heap."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import autotune
from autotune.search import heap
from autotune.search.trial import steady_steps


def _scripted(totals: list[float]):
    calls: list[int] = []

    def step() -> tuple[float, float]:
        calls.append(1)
        return totals[len(calls) - 1], 0.0

    return step, calls


def test_two_steady_steps_end_a_trial_at_the_default_count():
    step, calls = _scripted([1.00, 1.01, 1.5])
    assert steady_steps(step, 3, early=True) == [(1.00, 0.0), (1.01, 0.0)]
    assert len(calls) == 2


def test_unsteady_steps_or_a_count_asked_for_run_in_full():
    step, calls = _scripted([1.00, 1.10, 1.05])
    assert len(steady_steps(step, 3, early=True)) == 3 and len(calls) == 3
    step, calls = _scripted([1.0] * 6)
    assert len(steady_steps(step, 6, early=False)) == 6 and len(calls) == 6


@pytest.fixture(scope="module", autouse=True)
def heap_frozen_before_each_module() -> None:
    """Here the heap is as a process finds it, with nothing frozen (conftest freezes it for every other module):
    these tests are about who freezes what."""
    gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_tune_sets_the_heap_aside_and_still_collects_what_it_made():
    before = _Cycle()
    with heap.set_aside():
        assert gc.get_freeze_count() > 0
        made = _Cycle()
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None  # a cycle made inside is still collected
        kept = weakref.ref(before)
    assert gc.get_freeze_count() == 0 and kept() is before


def test_a_process_that_froze_its_own_objects_keeps_them_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with heap.set_aside():
            pass
        # Still frozen (an unfreeze would leave 0); a thread of another test may free a few frozen objects.
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


def test_fit_leaves_no_object_frozen():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    batch = {"x": torch.randn(8, 8), "y": torch.randint(0, 2, (8,))}
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b["x"]), b["y"])  # noqa: E731
    plan = autotune.fit(model, batch, loss_fn=loss, memory_budget="1GiB", cache=False)
    assert plan.micro_batch_size >= 1 and gc.get_freeze_count() == 0
