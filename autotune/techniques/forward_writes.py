"""The state a module's forward writes: what a recompute of that forward must put back, and what makes a
module unsafe to recompute.

`ForwardWrites` (checkpointing, for each recomputed block) learns which of the block's buffers its forward
writes, keeps their values from before each forward, and around the recompute in backward puts back the
values the forward saw and then the values as they are. `WriteWatch` (the blocks' profile) sees what a
forward writes that a recompute could not put back: a parameter in place, or a buffer of a module outside
the one recomputed. `refuse` / `refusal` remember such modules for the rest of the process.

How a write is seen: an in-place write (`add_`, `copy_`, `out=`, a compiled graph's write-back) moves the
tensor's version counter; a reassignment (`self.steps = self.steps + 1`) changes the tensor the module holds;
a write through `.data` moves neither and is seen by value, on the block's first forward only. A norm
layer's kernels update running statistics without moving the version counter, so those are known by type
(`tracks_statistics`). What none of these sees: state kept outside buffers (a Python number, a tensor held
in a plain attribute), and a `.data` write that the first forward did not make.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger(__name__)

# The modules found unsafe to recompute, and why; weak keys: the user's model is not kept alive by them.
_REFUSED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def refuse(module: nn.Module, why: str) -> None:
    """Remember that `module` must not be recomputed, and why (its forward writes state that a recompute
    would write again and that cannot be put back)."""
    _REFUSED[module] = why


def refusal(module: nn.Module) -> str:
    """Why `module` must not be recomputed; "" when it may be."""
    return _REFUSED.get(module, "")


def tracks_statistics(module: nn.Module) -> bool:
    """A normalization layer whose forward in training updates running statistics in place."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats


@dataclass(kw_only=True, slots=True)
class Record:
    """One forward of a block, for its recompute: the block's buffers as the forward found them (`tensors`,
    `versions`, by slot), copies of the values the recompute needs (`saved`), the slots the forward wrote."""

    tensors: list[torch.Tensor | None]
    versions: list[int]
    saved: dict[int, torch.Tensor]
    params: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)  # on a block's first forward
    written: list[int] = field(default_factory=list)
    reassigned: set[int] = field(default_factory=set)

    def before(self, slot: int) -> torch.Tensor | None:
        """The slot's value before the forward; None where it was not kept."""
        if slot in self.saved:
            return self.saved[slot]
        old = self.tensors[slot]
        intact = slot in self.reassigned and old is not None and old._version == self.versions[slot]
        return old if intact else None  # a reassigned buffer whose old tensor was left as it was


class ForwardWrites:
    """The buffers a block's forward writes, and how a recompute of that forward is given what it saw.

    A slot is a (module, buffer name) of a module in the block. On the block's first forward every buffer
    is copied and the written ones are learned (version counter, identity, value); later forwards copy only
    those. A norm layer's running statistics are written in every training forward and never read by it:
    they are kept only at the recompute, to be put back after it.
    """

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.slots = [(m, name) for m in block.modules() for name, b in m._buffers.items() if b is not None]
        self.norms = {i for i, (m, _) in enumerate(self.slots) if tracks_statistics(m)}
        self.learned: set[int] | None = None  # slots whose pre-forward values a recompute needs; None: not yet seen
        self.late: set[int] = set()  # slots first written after the first forward (warned about once)

    @property
    def idle(self) -> bool:
        """A block with no buffer, after its first forward: nothing to watch."""
        return not self.slots and self.learned is not None

    def before(self) -> Record:
        """Before the forward: what the recompute may need."""
        tensors = [m._buffers.get(name) for m, name in self.slots]
        keep = range(len(tensors)) if self.learned is None else self.learned
        with torch.no_grad():
            saved = {i: t.clone() for i in keep if i not in self.norms and (t := tensors[i]) is not None}
        params: list[tuple[str, torch.Tensor, int]] = (
            [(n, p, p._version) for n, p in self.block.named_parameters()] if self.learned is None else [])
        return Record(tensors=tensors, versions=[-1 if t is None else t._version for t in tensors], saved=saved,
                       params=params)

    def after(self, record: Record) -> str | None:
        """After the forward: the slots it wrote, kept for the recompute; why the block cannot be recomputed
        (a parameter it writes), or None."""
        first, seen = self.learned is None, set()
        for i, ((module, name), old) in enumerate(zip(self.slots, record.tensors)):
            now = module._buffers.get(name)
            if now is None or id(now) in seen:  # a buffer shared by two modules is one slot, its first
                continue
            seen.add(id(now))
            moved = now is not old or now._version != record.versions[i]
            if not moved and i in record.saved:
                # A write through `.data` moves no version counter: seen by value on the first forward, and a
                # slot learned is replayed on every forward after it.
                moved = not first or not (now.shape == record.saved[i].shape and torch.equal(now, record.saved[i]))
            if moved or (i in self.norms and module.training):
                record.written.append(i)
                if now is not old:
                    record.reassigned.add(i)
        wrote = {i for i in record.written if i not in self.norms}
        new = wrote - set(record.saved) - record.reassigned - self.late
        if new and not first:
            self.late |= new
            log.warning("autotune: a recomputed block (%s) wrote %s in a forward after its first, which did not; "
                        "this forward's recompute sees the value it wrote (kept for every later forward)",
                        type(self.block).__name__, ", ".join(self._name(i) for i in sorted(new)))
        self.learned = (self.learned or set()) | wrote
        record.saved = {i: v for i, v in record.saved.items() if i in wrote}
        record.tensors = [t if i in record.reassigned else None for i, t in enumerate(record.tensors)]
        moved_params = [n for n, p, v in record.params if p._version != v]
        record.params = []
        if moved_params:
            return f"its forward writes parameter {moved_params[0]} in place"
        return None

    @contextmanager
    def replayed(self, record: Record,
                 aside: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext) -> Iterator[None]:
        """Around a recompute: each written buffer as the forward found it, then as it is now (the forward
        and any later ones have written it since); the copies run under `aside` (a selective checkpoint's
        recompute sees only the forward's own operators)."""
        back: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]] = []
        try:
            with torch.no_grad(), aside():
                for i in record.written:
                    module, name = self.slots[i]
                    now, old = module._buffers.get(name), record.before(i)
                    if now is None:
                        continue
                    if i in record.reassigned and old is not None:
                        back.append((module, name, now, None))  # the recompute assigns another tensor
                        module._buffers[name] = old.clone()
                        continue
                    back.append((module, name, now, now.clone()))
                    if old is not None and old.shape == now.shape:
                        now.copy_(old)
            yield
        finally:
            with torch.no_grad(), aside():
                for module, name, now, value in reversed(back):
                    module._buffers[name] = now
                    if value is not None:
                        now.copy_(value)

    def _name(self, slot: int) -> str:
        module, name = self.slots[slot]
        path = next((p for p, m in self.block.named_modules() if m is module), "")
        return f"{path}.{name}" if path else name


class WriteWatch:
    """What each profiled module's forward writes that its recompute could not put back: a parameter in place,
    or a buffer (in place or reassigned) of a module outside it. Seen by version counters and identity, from
    the module's forward pre-hook to its forward hook; `why` holds a reason for each module found so."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.named_parameters())
        self.slots = [(f"{path}.{name}" if path else name, m, name)
                      for path, m in model.named_modules() for name, b in m._buffers.items() if b is not None]
        self.open: dict[int, list[tuple[list[int], list[tuple[int, int]]]]] = defaultdict(list)
        self.why: dict[nn.Module, str] = {}

    def _state(self) -> tuple[list[int], list[tuple[int, int]]]:
        buffers = [m._buffers.get(name) for _, m, name in self.slots]
        return ([p._version for _, p in self.params],
                [(-1, -1) if b is None else (id(b), b._version) for b in buffers])

    def enter(self, module: nn.Module) -> None:
        self.open[id(module)].append(self._state())

    def leave(self, module: nn.Module) -> None:
        if not self.open[id(module)]:
            return
        params, buffers = self.open[id(module)].pop()
        now_params, now_buffers = self._state()
        inside = {id(m) for m in module.modules()}
        param = next((n for (n, _), a, b in zip(self.params, params, now_params) if a != b), None)
        outside = next((path for (path, m, _), a, b in zip(self.slots, buffers, now_buffers)
                        if a != b and id(m) not in inside), None)
        if param is not None:
            what = f"parameter {param} in place"
        elif outside is not None:
            what = f"buffer {outside}, which is outside it"
        else:
            return
        self.why.setdefault(module, f"its forward writes {what}")
