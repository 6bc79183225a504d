"""How autotune builds optimizers: from the user's factory, the user's optimizer, or AdamW by default.

Trials never step the user's own optimizer: they build a fresh one of the same kind over the same
parameters (same class, same hyperparameters per parameter group), so the user's state stays untouched
and an OOM half-way through a first `step()` cannot leave it half-built.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import InvalidSetting

# Classes whose CPU implementation takes `fused=True` (a single vectorised kernel).
_FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """A recipe for an optimizer over a given list of parameters (or parameter-group dicts)."""

    build_groups: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    groups: tuple[tuple[tuple[int, ...], dict[str, Any]], ...]  # (indices into params, hyperparameters)
    cls_name: str

    @classmethod
    def from_user(cls, optimizer: Any, model: torch.nn.Module) -> OptimizerSpec:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise InvalidSetting("model has no parameter with requires_grad=True; there is nothing to train")
        check_optimizer(optimizer, model)
        index = {id(p): i for i, p in enumerate(params)}
        if optimizer is None:
            return cls(_class_builder(torch.optim.AdamW, {}), (((tuple(range(len(params)))), {}),), "AdamW")
        if isinstance(optimizer, torch.optim.Optimizer):
            groups = []
            for group in optimizer.param_groups:
                ids = tuple(index[id(p)] for p in group["params"] if id(p) in index)
                hyper = {k: v for k, v in group.items() if k != "params"}
                groups.append((ids, hyper))
            return cls(_class_builder(type(optimizer), {}), tuple(groups), type(optimizer).__name__)
        if callable(optimizer):
            return cls(_factory_builder(optimizer), ((tuple(range(len(params))), {}),), "factory")
        raise InvalidSetting(
            f"optimizer must be None (AdamW), a torch.optim.Optimizer, or a factory params -> Optimizer; "
            f"got {type(optimizer).__name__}")

    def build(self, params: Sequence[torch.Tensor], *, host: bool = False,
              only: Collection[int] | None = None) -> torch.optim.Optimizer:
        """An optimizer over `params` (in `model.parameters()` order, trainable only).

        `host=True` asks for the CPU flavour used by optimizer offload: fused where torch has it.
        `only` keeps the parameters at these indices (partial offload steps a share on the host and the
        rest on the device, each with the groups and hyperparameters the user gave); groups left empty
        are dropped, as `group_indices(only)` lists.
        """
        keep = (lambda i: True) if only is None else set(only).__contains__
        groups = [{"params": [params[i] for i in ids if keep(i)], **hyper} for ids, hyper in self.groups]
        groups = [g for g in groups if g["params"]]
        if host and self.cls_name in _FUSED_ON_CPU:
            for g in groups:
                g.pop("foreach", None)
                g["fused"] = True
        elif not host:
            for g in groups:
                if g.get("fused") and params and params[0].device.type == "cpu":
                    g["fused"] = False  # a CUDA-fused optimizer moved to the CPU simulation
        return self.build_groups(groups)

    def group_indices(self, only: Collection[int] | None = None) -> list[int]:
        """Which of `groups` hold a parameter of `only` (all indices when None): the groups `build` keeps."""
        keep = (lambda i: True) if only is None else set(only).__contains__
        return [j for j, (ids, _) in enumerate(self.groups) if any(keep(i) for i in ids)]

    def held(self) -> list[int]:
        """Trainable-parameter indices some group holds, in model order: what the optimizer trains. One outside
        every group (left out of a fine-tune's optimizer, `requires_grad` still on) is trained by nobody, as in
        plain PyTorch: optimizer offload gives it no master and no state."""
        return sorted({i for ids, _ in self.groups for i in ids})

    def over_held(self) -> OptimizerSpec:
        """This spec over the held parameters alone: index k is the k-th of `held()`."""
        where = {i: k for k, i in enumerate(self.held())}
        groups = tuple((tuple(where[i] for i in ids), hyper) for ids, hyper in self.groups)
        return replace(self, groups=groups)

    def order(self) -> list[int]:
        """Trainable-parameter indices in the order of the groups: position k of an optimizer state dict."""
        return [i for ids, _ in self.groups for i in ids]


def check_optimizer(optimizer: Any, model: torch.nn.Module) -> None:
    """Refuse a `torch.optim.Optimizer` that holds none of the model's trainable parameters: one built over
    another model (or only frozen ones) would tune and train nothing of this one."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not trainable or any(id(p) in trainable for p in held):
        return
    mine = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in mine for p in held)
    what = (f"all {len(held)} of its parameters belong to another model" if foreign == len(held)
            else f"{len(held) - foreign} of its {len(held)} parameters are the model's but frozen")
    raise InvalidSetting(f"optimizer holds none of the model's trainable parameters ({what}); build it over this "
                         f"model, e.g. {type(optimizer).__name__}(model.parameters(), ...), or pass optimizer=None "
                         "for AdamW")


# State tensors the size of each parameter that an optimizer keeps, at least (SGD's momentum buffer exists
# only with momentum, so it counts 0): a lower bound, for ruling out rungs that cannot fit at any batch size.
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "RMSprop": 1}


def state_tensors_per_parameter(spec: OptimizerSpec) -> int:
    """Parameter-sized state tensors the optimizer surely keeps (0 for a factory or an unknown class)."""
    return _STATE_TENSORS.get(spec.cls_name, 0)


def _class_builder(klass: type, extra: dict[str, Any]) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return klass(groups, **extra)

    return build


def _factory_builder(
        factory: Callable[[Iterable[Any]], Any]) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        flat = [p for g in groups for p in g["params"]]
        try:
            opt = factory(flat)
        except TypeError as exc:
            raise InvalidSetting(f"optimizer factory must take the parameters as its one argument: {exc}") from exc
        if not isinstance(opt, torch.optim.Optimizer):
            raise InvalidSetting(f"optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        # A factory knows nothing of `fused`; honour a host request where the class supports it.
        if any(g.get("fused") for g in groups) and type(opt).__name__ in _FUSED_ON_CPU:
            for g in opt.param_groups:
                g["fused"] = True
                g["foreach"] = False
        return opt

    return build
