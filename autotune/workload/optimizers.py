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

from .. import torch_private
from ..devices.shards import is_shard
from ..errors import InvalidSetting

# Classes whose CPU implementation takes `fused=True` (a single vectorised kernel).
_FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")
# Classes stepped fused over FSDP2 shards when the user left the form to torch (`step_fused_on_shards`).
_FUSED_ON_SHARDS = (torch.optim.Adam, torch.optim.AdamW)


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
        optimizer = self.build_groups(groups)
        if not host:
            step_fused_on_shards(optimizer)
        return optimizer

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


def step_fused_on_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Step an Adam or AdamW over FSDP2 shards with torch's fused kernel, in the groups where the user left
    both `fused` and `foreach` unset and torch would pick foreach (CUDA). Returns whether a group changed.

    Torch's foreach step takes the square root of every `exp_avg_sq` of a group in one call, a temporary as
    large as one optimizer state tensor of the rank (3.1 GB for GPT-2 XL over two ranks), held at the step's
    peak; the fused kernel steps each tensor in place. It is the same algorithm with the same hyperparameters,
    the form torch itself recommends for speed; updates may differ in their last bits, as between any two of
    torch's forms. A group that names its form keeps it.
    """
    if type(optimizer) not in _FUSED_ON_SHARDS:  # torch's own classes: a subclass may step otherwise
        return False
    changed = False
    for group in optimizer.param_groups:
        params = group["params"]
        if not params or not _all_shards(params) or not _left_to_torch(group, params[0].device.type):
            continue
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:  # the fused kernel reads `step` on the parameter's device
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)
        changed = True
    if changed:  # as torch's own constructor sets it with fused=True: a GradScaler hands it the scale
        optimizer.defaults.update(fused=True, foreach=False)
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    return changed


def foreach_stepped(spec: OptimizerSpec, params: Sequence[torch.Tensor], device_type: str) -> list[int]:
    """Indices of `params` whose group the device optimizer `spec` builds steps with foreach on `device_type`:
    named so, or left to torch where torch picks foreach there and `step_fused_on_shards` does not fuse it.
    Such a step holds one state-sized temporary of the whole group at once (Adam's square root of
    `exp_avg_sq`, Adagrad's and RMSprop's alike); none for a factory, whose form is unknown."""
    if spec.cls_name not in _STATE_TENSORS:
        return []
    fused = set(fused_on_shards(spec, params, device_type))
    return [i for ids, hyper in spec.groups
            if hyper.get("foreach") or _left_to_torch({**hyper, "params": ids}, device_type)
            for i in ids if i not in fused]


def fused_on_shards(spec: OptimizerSpec, params: Sequence[torch.Tensor], device_type: str) -> list[int]:
    """Indices of `params` that `step_fused_on_shards` steps fused in the optimizer `spec` builds."""
    if spec.cls_name not in {c.__name__ for c in _FUSED_ON_SHARDS}:
        return []
    return [i for ids, hyper in spec.groups
            if _left_to_torch({**hyper, "params": ids}, device_type) and _all_shards([params[i] for i in ids])
            for i in ids]


def _left_to_torch(group: dict[str, Any], device_type: str) -> bool:
    """Whether torch steps this group with foreach on `device_type` because the user named no form."""
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
        return False
    return bool(group["params"]) and device_type in torch_private.foreach_devices()


def _all_shards(params: Sequence[torch.Tensor]) -> bool:
    return all(is_shard(p) and torch.is_floating_point(p) for p in params)


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
