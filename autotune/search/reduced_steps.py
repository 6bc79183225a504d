"""The all-reduced steps a trial on replicated ranks times, and the gate every rank meets before them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import parallel as distributed
from ..devices.placement import Placement, now
from ..errors import is_oom
from ..techniques import AppliedRung
from ..techniques.sharding import is_sharded
from ..workload.accumulation import LossWeights


class ReduceGate:
    """Replicated on several ranks, a trial also times one step whose gradients are all-reduced during its
    backward, as the last micro-batch's are in training (`distributed.OverlappedReduce`); what that adds is a
    cost once per global step, like the optimizer's. Without it the estimate leaves the all-reduce out and
    promises more than the plan trains.

    The ranks must all start that step or none: a rank whose trial ran out of memory before it would leave
    the others waiting in the all-reduce. So every rank meets the others once, at `open` (measured steps
    done) or at `fail` (the trial's OOM or compile error), and the step runs only where no rank failed.
    One process, or a sharded model (FSDP reduces inside backward, so its steps already pay for it): no gate.
    """

    def __init__(self, model: nn.Module) -> None:
        self.active = distributed.active() and not is_sharded(model)
        self.met = False
        self.opened = False  # every rank measured its steps: the all-reduced steps ran (or were started)

    def open(self) -> bool:
        """True on every rank when every rank measured its steps: time the all-reduced step."""
        if not self.active or self.met:
            return False
        self.met = True
        self.opened = not distributed.agree_oom(False)
        return self.opened

    def fail(self) -> None:
        """This rank's trial failed before `open`: tell the others, where they wait for it."""
        if self.active and not self.met:
            self.met = True
            distributed.agree_oom(True)


def abba(pairs: int) -> list[bool]:
    """`pairs` all-reduced steps each way (True: in buckets during backward; False: in one after it), in the
    order ABBA... so a drift of the machine's speed falls on both alike."""
    return [overlap for i in range(pairs) for overlap in ((True, False) if i % 2 == 0 else (False, True))]


def reduced_steps(reduced: Callable[[bool], float], order: list[bool]) -> tuple[list[float], list[float]]:
    """Seconds of all-reduced steps in buckets and in one after backward, one step for each of `order`.

    One step's reading of the all-reduce's cost is noisy (a few percent either way, enough to rank two close
    plans the wrong way round). A trial of several times the measured steps takes as many readings of it
    (`trial._run_steps`).

    The ranks agree after each step whether any ran out of memory in it: a rank that did raises, the others
    stop too (their trial is the OOM once agreed), so no rank starts a step's collectives alone."""
    bucketed: list[float] = []
    after: list[float] = []
    for overlap in order:
        seconds, failure = 0.0, None
        try:
            seconds = reduced(overlap)
        except Exception as exc:  # an OOM is agreed first; anything else propagates
            if not is_oom(exc):
                raise
            failure = exc
        if distributed.agree_oom(failure is not None):
            if failure is not None:
                raise failure
            return bucketed or [0.0], after or [0.0]
        (bucketed if overlap else after).append(seconds)
    return bucketed, after


def reduced_step(applied: AppliedRung, model: nn.Module, placement: Placement, forward: Callable[[LossWeights], Any],
                 *, samples: int, tokens: float | None, overlap: bool = True) -> float:
    """Seconds of one forward+backward whose gradients are all-reduced in buckets during the backward (or,
    `overlap` False, in one bucket after it). `forward` computes the micro-batch's loss (`samples` samples,
    `tokens` labelled tokens) with the weights it is given, as the trial's timed steps do.

    A rank that runs out of memory here still joins every all-reduce (`OverlappedReduce` starts the buckets
    it did not reach), then raises; `agree_trial` makes that the trial's outcome on every rank.
    """
    t0 = now(placement)
    weights = LossWeights(samples, 1, total=tokens)
    loss, failure = None, None
    try:
        loss = forward(weights)
    except Exception as exc:  # an OOM is held until the ranks' all-reduces are done
        if not is_oom(exc):
            raise
        failure = exc
    if weights.loss_total is None:  # its forward failed: it joins the others' collectives with nothing
        weights.loss_total = torch.zeros((), dtype=torch.float64)
    with distributed.OverlappedReduce(model, weights, overlap=overlap) as reduction:
        if loss is not None:
            try:
                applied.backward(loss)
            except Exception as exc:  # as above
                if not is_oom(exc):
                    raise
                failure = exc
    del loss
    reduction.wait(weights)
    seconds = now(placement) - t0
    applied.zero_grad()
    if failure is not None:
        raise failure
    return seconds
