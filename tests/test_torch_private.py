"""The private torch APIs autotune calls resolve on the installed torch: a rename in a new torch fails here, by
name, rather than deep inside a search or a training step."""

from __future__ import annotations

import torch

from autotune import torch_private


def test_every_wrapper_reaches_its_torch_api():
    assert callable(torch_private.allocator_setter())  # read, not called: it would change this process's allocator
    torch_private.empty_host_cache()
    assert "cuda" in torch_private.foreach_devices()
    assert torch_private.has_triton() in (True, False, None)
    config = torch_private.dynamo_config()
    assert hasattr(config, "cache_size_limit") or hasattr(config, "recompile_limit")
    torch_private.maybe_mark_dynamic(torch.zeros(4, 3), 0)
    assert callable(torch_private.fused_adam(True)) and callable(torch_private.fused_adam(False))
    assert torch_private.fused_adam(True) is not torch_private.fused_adam(False)
    assert torch_private.coalescing_manager is not None
    assert torch_private.fsdp_training_state().IDLE is not None


def test_a_plain_tensor_is_its_own_local_tensor_and_a_stateless_object_has_no_fsdp_groups():
    t = torch.zeros(2)
    assert torch_private.local_tensor(t) is t
    assert torch_private.fsdp_param_groups(object()) == []


def test_the_dispatch_and_pytree_names_are_torchs_own():
    assert issubclass(torch_private.TorchDispatchMode, object)
    assert torch_private.tree_leaves({"a": [1, (2, 3)]}) == [1, 2, 3]
    assert not torch_private.is_traceable_wrapper_subclass(torch.zeros(1))


def test_a_dispatch_modes_handler_goes_through_dynamos_disable_once_dynamo_is_loaded():
    # Dynamo is loaded in this process (other tests compiled): the first op switches the handler to torch's own
    # Dynamo-disabled wrapper of it, and a compiled function run inside the mode is seen op by op as in eager.
    # tests/test_cache.py checks the other side: a process that never loads Dynamo runs the handler as written.
    import torch._dynamo  # loaded, as by any compile

    class Counting(torch_private.DispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    written = Counting.__dict__["__torch_dispatch__"]
    x = torch.randn(3)
    with Counting() as eager:
        (x * 2 + 1).sum()
    handler = Counting.__dict__["__torch_dispatch__"]
    assert written.__qualname__.startswith("_outside_dynamo_once_loaded")  # as the class was made: the lazy one
    assert handler is not written  # torch's Dynamo-disabled wrapper of the handler as written
    assert handler.__wrapped__.__qualname__.endswith("Counting.__torch_dispatch__")
    compiled = torch.compile(lambda t: (t * 2 + 1).sum(), backend="eager")
    with Counting() as inside:
        compiled(x)
    assert inside.ops == eager.ops == 3
