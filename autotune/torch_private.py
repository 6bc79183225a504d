"""The private torch APIs autotune calls, in one place, each behind a wrapper that says what it is for.

torch keeps no promise for these: a release may rename or remove any of them. They were checked on torch 2.11
(CUDA) and torch 2.13 (CPU); where a name moved between versions, the wrapper reads both. When torch changes
one, this module is the one to change, and its tests (tests/test_torch_private.py) the ones to run.

Left at their call sites, because they run per step or per dispatched op, where another call would cost:
`torch._foreach_mul_` (parallel/reduce.py, the all-reduced gradients scaled), `torch._foreach_copy_`
(training/buffers.py, the buffers saved and put back) and a DTensor's `_local_tensor` inside the memory
ceiling's dispatch hook (devices/ceiling.py); the FSDP2 internals one `reset_fsdp_iter_state` and
parallel/oom.py's collectives wrapper touch are read on the state objects these wrappers return.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

coalescing_manager: Callable[..., Any] | None
try:  # one collective for a bucket of tensors (parallel/reduce.py)
    from torch.distributed.distributed_c10d import _coalescing_manager as coalescing_manager
except ImportError:  # pragma: no cover - a torch without it: one all-reduce per tensor
    coalescing_manager = None

__all__ = ["DispatchMode", "TorchDispatchMode", "allocator_setter", "coalescing_manager", "default_store",
           "dispatch_mode_blocks_compile", "dynamo_config", "empty_host_cache", "in_selective_recompute",
           "innermost_mode_aside",
           "foreach_devices", "fsdp_param_groups", "fsdp_state", "fsdp_training_state", "fused_adam", "has_triton",
           "is_traceable_wrapper_subclass", "local_tensor", "maybe_mark_dynamic", "tree_leaves"]


class DispatchMode(TorchDispatchMode):
    """torch's `TorchDispatchMode`, its handler kept out of Dynamo from the first op after Dynamo is loaded.

    torch wraps every mode's `__torch_dispatch__` in Dynamo's `disable` (`_should_skip_dynamo`), which imports
    torch._dynamo at the mode's first op: more than a second of CPU that a process which never compiles (a
    plan-cache hit's loss check, a CPU trial in eager mode) pays for nothing, since while torch._dynamo is not
    loaded no frame can be compiled. Subclasses run their handler as written until then, and through the same
    `disable` torch applies once it is loaded, a compiled function then running inside the mode.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch leaves the handler unwrapped; `__init_subclass__` wraps it lazily instead

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is not None and not isinstance(handler, classmethod):
            cls.__torch_dispatch__ = _outside_dynamo_once_loaded(cls, handler)  # type: ignore[method-assign]


def _outside_dynamo_once_loaded(cls: type, handler: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch(self: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if "torch._dynamo" in sys.modules:  # from now on, as torch would have wrapped it; later ops go straight there
            disabled = torch._disable_dynamo(handler, recursive=True)
            cls.__torch_dispatch__ = disabled  # type: ignore[attr-defined]
            return disabled(self, func, types, args, kwargs)
        return handler(self, func, types, args, kwargs)

    return dispatch


def default_store() -> Any:
    """The process group's key-value store (torchrun's rendezvous store), or None where there is none."""
    import torch.distributed as dist

    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:  # noqa: BLE001 - no default group, or one without a store
        return None


def in_selective_recompute() -> bool:
    """Whether the innermost dispatch mode is a selective checkpoint's recompute (its cached-op replay)."""
    from torch.utils import checkpoint
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = getattr(checkpoint, "_CachedTorchDispatchMode", None)
    return mode is not None and isinstance(_get_current_dispatch_mode(), mode)


def dispatch_mode_blocks_compile() -> bool:
    """Whether Dynamo, reaching a frame now, would run it eagerly for a dispatch mode (a FLOP counter, a memory
    ceiling, a mode of the user's) and mark its code skipped for good: a compiled call first reached under a mode
    would stay eager for the rest of the process. The check is Dynamo's own (`convert_frame.py`): this thread's
    mode stack where `inline_torch_dispatch_torch_compile` is on, else torch's process-wide flag, which modes
    entered and left on two threads at once can leave set with no mode on either stack."""
    from torch.utils import _python_dispatch as dispatch

    on_stack = getattr(dispatch, "any_torch_dispatch_mode_on_stack", None)
    flagged = getattr(dispatch, "is_in_any_mode_without_ignore_compile_internals", None)
    inline = getattr(dynamo_config(), "inline_torch_dispatch_torch_compile", on_stack is not None and flagged is None)
    check = on_stack if inline else flagged
    if check is None:  # pragma: no cover - a torch with neither: any mode on this thread's stack
        return bool(torch._C._len_torch_dispatch_stack())
    return bool(check())


def innermost_mode_aside() -> Any:
    """A context in which the innermost dispatch mode is set aside (the modes outside it still see the ops)."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    return _pop_mode_temporarily()


def allocator_setter() -> Callable[[str], None]:
    """The CUDA caching allocator's settings setter: the accelerator-wide one where torch has it (the CUDA one is
    deprecated there), else the CUDA one."""
    setter: Callable[[str], None] = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                                     or torch.cuda.memory._set_allocator_settings)
    return setter


def empty_host_cache() -> None:
    """Give the pinned host blocks torch's host allocator caches back to the system (a no-op where torch lacks it)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def foreach_devices() -> list[str]:
    """The device types torch's optimizers step with foreach kernels when the user names no form."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return list(_get_foreach_kernels_supported_devices())


def has_triton() -> bool | None:
    """Whether Triton is installed for this GPU; None where this torch has no such check."""
    try:
        from torch.utils._triton import has_triton as check
    except ImportError:  # pragma: no cover - a torch without the check
        return None
    return bool(check())


def dynamo_config() -> Any:
    """torch.compile's configuration module (its recompile limits are raised for the search's many shapes)."""
    return torch._dynamo.config


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Hint to torch.compile that `dim` of `tensor` varies, without an error where the graph fixes it anyway."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def fused_adam(decoupled: bool) -> Callable[..., Any]:
    """torch's fused Adam kernel over lists of tensors: AdamW's (`decoupled` weight decay) or Adam's."""
    kernel: Callable[..., Any] = torch._fused_adamw_ if decoupled else torch._fused_adam_
    return kernel


def fsdp_state(unit: Any) -> Any:
    """An FSDP2 module's state (its parameter groups, communication context, training state)."""
    return unit._get_fsdp_state()


def fsdp_param_groups(state: object) -> list[Any]:
    """An FSDP2 state's parameter groups: `_fsdp_param_groups`, or torch <2.9's one `_fsdp_param_group`."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def fsdp_training_state() -> Any:
    """FSDP2's training-state enum (its IDLE is what a reset leaves every state and group in)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return TrainingState


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard without dispatching an op (`to_local()` would); any other object as it is."""
    return getattr(tensor, "_local_tensor", tensor)
