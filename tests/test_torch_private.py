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
