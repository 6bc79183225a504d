"""`Learned`: what `fit` hands the training step beside the plan's fields: the loss it tuned with and where a
recovery in training is recorded.

`fit` keeps it on the plan object it returns (`Plan.learned`); `plan.apply` reads it there. It is never part
of a plan's equality, dict form or cache row: a plan read from the cache or JSON, or built by hand, has none,
and trains with the loss given to `apply` (else the model's own) and records no recovery. Pickled or
deep-copied, a plan keeps it only where the copy shares this process's objects (a deep copy), never in bytes.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from ..workload.losses import LossFn

if TYPE_CHECKING:  # plan.py sits above training/ and imports it
    from ..plan import Plan

# (old plan, new plan or None, note, shapes): called after each recovery, on the writing rank
Reporter = Callable[["Plan", "Plan | None", str, dict[str, list[int]]], None]


def _no_loss() -> LossFn | None:
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Learned:
    """The loss `fit` was given (None: the model's own) and the callback recoveries are reported to (None: none)."""

    held_loss: Callable[[], LossFn | None] = _no_loss  # `loss_fn`, as `of` holds it
    report: Reporter | None = None

    @classmethod
    def of(cls, *, loss_fn: LossFn | None, report: Reporter | None) -> Learned:
        """What `fit` hands over. A loss_fn that is a model's own bound method is held weakly: the plan never
        keeps the model alive; any other loss_fn lives as long as the plan object."""
        if inspect.ismethod(loss_fn) and isinstance(loss_fn.__self__, nn.Module):
            return cls(held_loss=weakref.WeakMethod(loss_fn), report=report)
        return cls(held_loss=(lambda: loss_fn) if loss_fn is not None else _no_loss, report=report)

    @property
    def loss_fn(self) -> LossFn | None:
        return self.held_loss()

    def __reduce__(self) -> tuple[type[Learned], tuple[()]]:
        # A pickled plan carries no callables of this process (a recorder closes over an open cache)
        return Learned, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Learned:
        return self  # the same loss and recorder: a copy of the plan trains and records as the plan does


NOTHING = Learned()  # a plan's when `fit` did not make it
