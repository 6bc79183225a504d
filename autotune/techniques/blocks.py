"""The model's repeated blocks: which modules checkpointing may recompute, and in which order.

A block is a module that is called as a unit and holds activations of its own: a transformer layer, a
ResNet bottleneck, a T5 block. Blocks are found as two or more same-class children of one module, whether
they sit in a `ModuleList`/`Sequential` (`self.layers`) or are plain attributes (`self.b1 ... self.b4`).
Leaf modules (a `Linear`, a norm) are never blocks: checkpointing one keeps its input, which is all it
saves anyway. `ModuleList`/`ModuleDict` are never blocks either: they are never called.

A model with no such children may call one module at every depth instead (ALBERT's shared layer, called
N times): the profile counts calls, and then each call is a block of its own (`path#i`, call i of N), so k of
the N calls are recomputed, as k of N distinct blocks would be. Those are found only by the profile (one
forward), so only a plan from `fit` names them (`Plan.block_paths`).

Every group is a candidate (a T5 encoder's blocks and its decoder's), and the knob counts across all of
them: N is every block of every group. When groups nest (a ResNet's stages, each a `Sequential` of
bottlenecks; a T5 model's encoder and decoder stacks, each holding blocks), the finer groups replace the
outer one when they hold most of its activations: the recompute then re-materializes one small block at
a time rather than a whole stage, and the count has finer steps.

Which groups and which order is decided by the activation memory the blocks hold, measured by
`profile_blocks` in one forward pass on a small batch (the bytes autograd saves inside each block, the
block's own input left out since a checkpointed block keeps it): not by parameters, which rank a
ResNet's last stage first although its first stage holds 8x the activations per sample. Blocks that hold
nothing (never called, or frozen with no gradient flowing through) are dropped. When k < N blocks are
recomputed, those holding the most are recomputed first: each recompute costs about one forward of the
block, so the fewest recomputes free the most memory (ResNet keeps FLOPs per stage about constant while
its early stages hold the most activations). Within a group blocks hold the same, and the chosen ones are
spread evenly over its depth. The order is kept in `Plan.block_paths`, so training recomputes the very
blocks the trials measured. Without a profile (a plan built by hand) the groups are taken as found, the
counts interleaved over groups in proportion to their sizes.

A model whose library already checkpoints (Hugging Face `gradient_checkpointing_enable()`, timm
`set_grad_checkpointing()`, torch's `checkpoint_wrapper`) gets no block from autotune: `library` says
what is on, and the plan's reason reports it, so nothing is recomputed twice.

A block whose forward writes state that its recompute would write a second time and that checkpointing
cannot put back is never a block: a parameter written in place (a max-norm constraint applied in forward),
or a buffer of a module outside the block (a model-wide step counter the block updates). The profile sees
those writes by the tensors' version counters, leaves the block out with a note in `refused` (the plan's
reason), and remembers the module (`refusal`), so no later install for it recomputes it. What a block
writes of its own buffers, checkpointing puts back (`forward_writes.ForwardWrites`).
"""

from __future__ import annotations

import gc
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..devices.placement import Placement
from ..errors import is_oom
from ..workload import batch as batches
from .forward_writes import WriteWatch, refusal, refuse

log = logging.getLogger(__name__)

SHARED = "#"  # `path#i`: call i of a module called at several depths
FINER_SHARE = 0.75  # inner groups replace an outer one when their blocks hold at least this share of its bytes
PROFILE_SAMPLES = 2  # two, not one: batch norm in training mode refuses a batch of one
_NEVER_BLOCKS = (nn.ModuleList, nn.ModuleDict)  # holders, never called

@dataclass(kw_only=True, slots=True)
class BlockGroup:
    """The repeated blocks of a model, every group together, in the order checkpointing recomputes them.

    `blocks[i]` lives at `paths[i]`; the first k are the ones recomputed when k are. A module called at
    several depths appears once per call, its paths `module.path#i` for call i (`calls`). `held[i]` is the bytes
    the block holds for autograd per profiled sample (empty when not profiled). `library` is non-empty
    when the model's own library checkpoints already; then `blocks` is empty. `refused` says which blocks
    the profile left out because recomputing them would write state twice (`blocks` may then be empty).
    """

    path: str  # the groups' paths, e.g. "encoder.block, decoder.block"
    blocks: list[nn.Module] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    library: str = ""
    refused: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return ", ".join(dict.fromkeys(type(b).__name__ for b in self.blocks))

    def calls(self, count: int) -> dict[nn.Module, tuple[frozenset[int], int] | None]:
        """Each distinct module among the first `count` blocks: None when its every call is recomputed (a
        block of its own), else (the calls recomputed, of how many per forward) for a module called at
        several depths."""
        out: dict[nn.Module, tuple[frozenset[int], int] | None] = {}
        for block, path in zip(self.blocks[:max(0, count)], self.paths):
            if SHARED not in path:
                out[block] = None
                continue
            picked, n = out.get(block) or (frozenset(), sum(b is block for b in self.blocks))
            out[block] = (picked | {int(path.rsplit(SHARED, 1)[1])}, n)
        return out

    def modules(self) -> list[nn.Module]:
        """The distinct modules, in order (a module called at several depths is one)."""
        return list(dict.fromkeys(self.blocks))

    def shares(self) -> tuple[float, ...] | None:
        """Share of all the blocks' bytes freed by recomputing the first k, for k = 0..N; None unprofiled."""
        total = sum(self.held)
        if len(self.held) != len(self.blocks) or total <= 0:
            return None
        out, running = [0.0], 0
        for h in self.held:
            running += h
            out.append(running / total)
        return tuple(out)


@dataclass(kw_only=True, slots=True)
class _Group:
    path: str
    members: list[tuple[str, nn.Module]]  # (path, block), in the order the parent holds them


def find_blocks(model: nn.Module, paths: tuple[str, ...] | list[str] = ()) -> BlockGroup | None:
    """The model's repeated blocks, or None when it has none (then checkpointing cannot apply).

    `paths` (a plan's `block_paths`) names the blocks and their order, as the tuning measured them; when
    one no longer resolves (a differently wrapped model) the blocks are found again, with a warning.
    """
    library = library_checkpointing(model)
    if library:
        return BlockGroup(path="", library=library)
    if paths:
        named = dict(model.named_modules())
        modules = [p.split(SHARED, 1)[0] for p in paths]
        missing = [p for p in modules if p not in named]
        if not missing:
            return BlockGroup(path=_label(p.rsplit(".", 1)[0] if "." in p else "" for p in modules),
                              blocks=[named[p] for p in modules], paths=list(paths))
        log.warning("the plan's block_paths name %s, which this model does not have (wrapped differently "
                    "than when tuned?); finding its repeated blocks again", missing[0])
    groups = _groups_under(model, "", None)
    return _structural(groups) if groups else None


def profile_blocks(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
                   placement: Placement) -> BlockGroup | None:
    """`find_blocks`, with groups chosen and ordered by the activation memory each block holds.

    One forward of `PROFILE_SAMPLES` samples of `batch` (already on the device) in training mode; the
    caller restores weights, buffers and RNG (a snapshot: dropout draws, batch norm statistics). Falls
    back to the structural order when the forward runs out of memory.
    """
    found = find_blocks(model)
    if found is not None and found.library:
        return found
    # Without repeated children, every module that could be a block is watched for calls at several depths.
    candidates = _all_candidates(model) if found is not None else _inner_modules(model)
    n = min(PROFILE_SAMPLES, batches.batch_size(batch))
    part = batches.unwrap(batches.resize(batch, n))  # as the model gets it: `Shared` tensors plain
    held: dict[int, int] | None = None
    calls: dict[int, int] = {}
    writes = WriteWatch(model)
    try:
        held = _held_bytes(model, [m for _, m in candidates], part, n, loss_fn, calls, writes)
    except Exception as exc:  # an OOM only leaves the order structural; anything else is the model's
        if not is_oom(exc):
            raise
        log.info("profiling the blocks' activations ran out of memory; blocks recomputed in structural order")
    del part
    gc.collect()
    if not placement.simulated and torch.cuda.is_available():
        torch.cuda.synchronize(placement.index)
        torch.cuda.empty_cache()  # the profile's tensors must not stay reserved: trials read reserved memory
    for module, why in writes.why.items():
        refuse(module, why)
    if found is None:
        return _vetted(_shared(candidates, held or {}, calls))
    if not held:
        return _vetted(found)
    groups = [g for g in _groups_under(model, "", held) if sum(held.get(id(b), 0) for _, b in g.members) > 0]
    # No group holding anything: the profile could not see them (blocks called as `block.forward(x)` run no
    # hook); the checkpoint wrappers still work there, so the groups are kept as found.
    return _vetted(_by_activations(groups, held) if groups else found)


def _vetted(group: BlockGroup | None) -> BlockGroup | None:
    """`group` without the blocks refused for recompute, which one note in `refused` names."""
    if group is None or not any(refusal(b) for b in group.blocks):
        return group
    keep = [i for i, b in enumerate(group.blocks) if not refusal(b)]
    left = {p.split(SHARED, 1)[0]: b for p, b in zip(group.paths, group.blocks) if refusal(b)}
    names = sorted(left, key=lambda p: [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in p.split(".")])
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    kinds = ", ".join(dict.fromkeys(type(b).__name__ for b in left.values()))
    note = (f"checkpointing leaves out {shown} ({kinds}): a recompute in backward would write a second time what "
            f"the forward writes and cannot be put back ({names[0]}: {refusal(left[names[0]])})")
    held = [group.held[i] for i in keep] if len(group.held) == len(group.blocks) else []
    return BlockGroup(path=group.path, blocks=[group.blocks[i] for i in keep], paths=[group.paths[i] for i in keep],
                      held=held, refused=[note])


def library_checkpointing(model: nn.Module) -> str:
    """What already checkpoints the model's blocks, in words; "" when nothing does."""
    for path, module in model.named_modules():
        where = path or "model"
        if getattr(module, "gradient_checkpointing", False) is True:  # Hugging Face, set per layer or stack
            return (f"the model's own Hugging Face gradient checkpointing is on ({where}.gradient_checkpointing; "
                    "model.is_gradient_checkpointing)")
        if getattr(module, "grad_checkpointing", False) is True:  # timm's set_grad_checkpointing()
            return f"the model's own timm gradient checkpointing is on ({where}.grad_checkpointing)"
        if type(module).__name__ == "CheckpointWrapper":  # torch.distributed's checkpoint_wrapper
            return f"the model already wraps {where} in torch's checkpoint_wrapper"
    return ""


# -- discovery ------------------------------------------------------------------------------------------
def _groups_under(module: nn.Module, prefix: str, held: dict[int, int] | None) -> list[_Group]:
    """The groups of blocks in `module`'s subtree, none nested in another."""
    children = list(module.named_children())
    level = _repeated(children, prefix)
    grouped = {id(b) for g in level for _, b in g.members}
    out: list[_Group] = []
    for name, child in children:
        if id(child) not in grouped:
            out += _groups_under(child, _join(prefix, name), held)
    for group in level:
        inner = [_groups_under(block, path, held) for path, block in group.members]
        out += [g for gs in inner for g in gs] if _finer(group, inner, held) else [group]
    return out


def _repeated(children: list[tuple[str, nn.Module]], prefix: str) -> list[_Group]:
    """Same-class children that can be blocks, two or more of a class."""
    by_class: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, child in children:
        if not isinstance(child, _NEVER_BLOCKS) and next(child.children(), None) is not None:
            by_class[type(child)].append((_join(prefix, name), child))
    return [_Group(path=_common(prefix, [p for p, _ in members]), members=members)
            for members in by_class.values() if len(members) >= 2]


def _finer(outer: _Group, inner: list[list[_Group]], held: dict[int, int] | None) -> bool:
    """Whether the groups inside `outer`'s blocks should be the blocks instead: every block holds some,
    and (when profiled) they hold most of the outer blocks' activations."""
    if not all(inner):
        return False
    if held is None:
        return True
    outer_bytes = sum(held.get(id(b), 0) for _, b in outer.members)
    inner_bytes = sum(held.get(id(b), 0) for gs in inner for g in gs for _, b in g.members)
    return inner_bytes >= FINER_SHARE * outer_bytes


def _all_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module that could be a block at any level of nesting: what the profile measures."""
    out: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        children = list(module.named_children())
        for group in _repeated(children, prefix):
            out.extend(group.members)
        for name, child in children:
            walk(child, _join(prefix, name))

    walk(model, "")
    return out


def _inner_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module below the root with children of its own (a leaf keeps only its input: nothing to free)."""
    return [(p, m) for p, m in model.named_modules() if p and not isinstance(m, _NEVER_BLOCKS)
            and next(m.children(), None) is not None]


def _shared(candidates: list[tuple[str, nn.Module]], held: dict[int, int], calls: dict[int, int]) -> BlockGroup | None:
    """Modules called at several depths in the profile's forward, each call a block (`path#i`), those holding
    the most per call first; a module inside one called several times is left to it. None when there are none."""
    several = {p for p, m in candidates if calls.get(id(m), 0) >= 2}
    groups, per_call = [], {}
    for path, module in candidates:
        outer = any(path.startswith(f"{other}.") for other in several)
        if path in several and not outer and held.get(id(module), 0) > 0:
            count = calls[id(module)]
            per_call[id(module)] = held[id(module)] // count
            groups.append(_Group(path=f"{path} (each of {count} calls)",
                                 members=[(f"{path}{SHARED}{i}", module) for i in range(count)]))
    return _by_activations(groups, per_call) if groups else None


# -- order ----------------------------------------------------------------------------------------------
def _by_activations(groups: list[_Group], held: dict[int, int]) -> BlockGroup:
    """Groups by the bytes their blocks hold each (most first); within a group, spread over the depth."""
    def per_block(g: _Group) -> float:
        return sum(held.get(id(b), 0) for _, b in g.members) / len(g.members)

    members = [m for g in sorted(groups, key=per_block, reverse=True) for m in _spread(g.members)]
    return BlockGroup(path=_label([g.path for g in groups]), blocks=[b for _, b in members],
                      paths=[p for p, _ in members], held=[held.get(id(b), 0) for _, b in members])


def _structural(groups: list[_Group]) -> BlockGroup:
    """Unprofiled: every group's blocks spread over its depth, the groups interleaved by their sizes, so
    any k recomputes about the same share of each group."""
    spread = [_spread(g.members) for g in groups]
    keyed = [((i + 0.5) / len(s), gi, m) for gi, s in enumerate(spread) for i, m in enumerate(s)]
    members = [m for _, _, m in sorted(keyed, key=lambda x: (x[0], x[1]))]
    return BlockGroup(path=_label([g.path for g in groups]), blocks=[b for _, b in members],
                      paths=[p for p, _ in members])


def _spread(members: list[Any]) -> list[Any]:
    """The members reordered so that any first k of them are spread evenly over the depth: for 8 blocks
    0, 4, 2, 6, 1, 5, 3, 7 (bit-reversal order); the first half is every other block."""
    n = len(members)
    bits = max(1, (n - 1).bit_length())
    order = sorted(range(n), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))
    return [members[i] for i in order]


# -- the profile ----------------------------------------------------------------------------------------
def _held_bytes(model: nn.Module, modules: list[nn.Module], batch: Any, n: int,
                loss_fn: Callable[[nn.Module, Any], Any], calls: dict[int, int], writes: WriteWatch) -> dict[int, int]:
    """Bytes autograd saves inside each of `modules` in one forward of `n` samples, per sample: every
    storage counted once per module (over all its calls), the module's inputs and the model's parameters
    and buffers left out. `calls` is filled with how many times each module was called, `writes` with what
    each call wrote that a recompute could not put back."""
    fixed = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    active: list[nn.Module] = []
    seen: dict[int, set[int]] = defaultdict(set)
    held: dict[int, int] = defaultdict(int)

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        active.append(module)
        calls[id(module)] = calls.get(id(module), 0) + 1
        writes.enter(module)
        seen[id(module)].update(t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)))

    def leave(module: nn.Module, *_: Any) -> None:
        writes.leave(module)
        if active and active[-1] is module:
            active.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without one storage (sparse, nested): not counted
            return t
        ptr = storage.data_ptr()
        if ptr not in fixed and storage.nbytes():
            for module in active:
                if ptr not in seen[id(module)]:
                    seen[id(module)].add(ptr)
                    held[id(module)] += storage.nbytes()
        # Detached: a saved output returned as itself would point back at its own grad_fn, a cycle that
        # keeps the whole graph alive after the forward (measured: every activation of the profile leaked).
        return t.detach()

    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter, with_kwargs=True),
                                            m.register_forward_hook(leave, always_call=True))]
    was_training = model.training
    try:
        model.train()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = loss_fn(model, batch)
        del out
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {k: v // n for k, v in held.items()}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _common(prefix: str, paths: list[str]) -> str:
    """A group's path: its container's ("transformer.h"), or its parent's with the names ("model.{b1,b2}")."""
    parents = {p.rsplit(".", 1)[0] if "." in p else "" for p in paths}
    names = [p.rsplit(".", 1)[-1] for p in paths]
    if all(n.isdigit() for n in names) and len(parents) == 1:
        return parents.pop()
    return _join(prefix, "{" + ",".join(names) + "}")


def _label(paths: Any) -> str:
    return ", ".join(dict.fromkeys(p or "model" for p in paths))
