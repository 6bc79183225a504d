"""Saved-activation offload (`techniques/offload/activations.py`) on the CPU, where its copies are plain: the
gradients are those of no offload, weights and small tensors stay on the device, and the host bytes it holds
are its two staging slots and the blocks it stored."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT, GPTConfig, random_batch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from autotune.configuration import Rung
from autotune.devices.placement import Placement, resolve_device
from autotune.search.anchors import anchors
from autotune.search.trial import TrialRunner, Workload
from autotune.techniques import find_blocks
from autotune.techniques.offload import host_buffers
from autotune.techniques.offload.activations import install, offloaded
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec

CPU = torch.device("cpu")
SMALL = 1024  # bytes: the tiny models' activations are a few KiB, so they are offloaded above this


def _llama(batch: int = 2) -> tuple[nn.Module, list[nn.Module], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).double().train()
    ids = torch.randint(0, 64, (batch, 16))
    return model, list(model.model.layers), {"input_ids": ids, "labels": ids}


def _gpt2() -> tuple[nn.Module, list[nn.Module], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64)  # dropout 0.1: masks saved
    model = GPT2LMHeadModel(cfg).double().train()
    ids = torch.randint(0, 64, (2, 16))
    return model, list(model.transformer.h), {"input_ids": ids, "labels": ids}


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.norm(self.conv1(x))))


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*[_Residual(8) for _ in range(3)])
        self.head = nn.Linear(8, 5)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pooled = self.blocks(self.stem(images)).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.head(pooled), labels)


def _cnn() -> tuple[nn.Module, list[nn.Module], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _CNN().double().train()
    return model, list(model.blocks), {"images": torch.randn(4, 3, 8, 8, dtype=torch.float64),
                                       "labels": torch.randint(0, 5, (4,))}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def _gradients(model: nn.Module, batch: dict[str, torch.Tensor], seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks with and without offload
    _loss(model, batch).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("worker", [False, True], ids=["in-line", "worker"])
@pytest.mark.parametrize("build", [_llama, _gpt2, _cnn], ids=["llama", "gpt2", "cnn"])
def test_gradients_equal_no_offload_in_float64(build, worker):
    model, blocks, batch = build()
    twin, twin_blocks = copy.deepcopy((model, blocks))  # the blocks, as modules of the twin
    # `worker`: the host copies on the worker thread, ordered by its futures, as on CUDA
    with offloaded(twin_blocks, CPU, min_bytes=SMALL, worker=worker) as offload:
        moved = []
        for step in range(3):  # the first forward offloads every block; later ones keep the last on the device
            expected = _gradients(model, batch, seed=step)
            got = _gradients(twin, batch, seed=step)
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
            moved.append(offload.moved.tensors)
    assert moved[0] > 0
    assert moved[1] == moved[2] == moved[0] * 2 // 3  # of 3 blocks, the last kept its tensors from step 2 on


def test_retained_graph_brings_the_blocks_back_again():
    model, _, batch = _llama()
    twin = copy.deepcopy(model)
    expected = _gradients(model, batch, seed=0)
    with offloaded(list(twin.model.layers), CPU, min_bytes=SMALL):
        twin.zero_grad(set_to_none=True)
        loss = _loss(twin, batch)
        loss.backward(retain_graph=True)
        loss.backward()  # every saved tensor unpacked a second time
    for p, e in zip((p for p in twin.parameters() if p.grad is not None), expected):
        torch.testing.assert_close(p.grad, 2 * e, rtol=0, atol=1e-12)


def test_weights_and_small_tensors_stay_on_the_device():
    model, blocks, batch = _llama(batch=3)  # 48 tokens: no activation is shaped as a weight
    model.float()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {s for p in model.parameters() for s in (p.shape, p.shape[::-1])}
    with offloaded(blocks, CPU, min_bytes=SMALL) as offload:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # matmuls save bf16 copies of the weights
            loss = _loss(model, batch)
        moved = offload.moved
        loss.backward()
    assert moved.tensors > 0
    assert not moved.storages & weights
    assert not [s for s, _ in moved.shapes if s in shapes]  # no weight, nor its autocast copy or transpose
    assert all(s.numel() * d.itemsize >= SMALL for s, d in moved.shapes)
    assert {torch.bfloat16, torch.float32} <= {d for _, d in moved.shapes}  # matmul inputs and norm inputs


def test_host_bytes_are_the_staging_pool_and_the_stored_blocks():
    model, blocks, batch = _llama()
    with host_buffers.reusing():
        offload, remove = install(blocks, CPU, min_bytes=SMALL)
        _gradients(model, batch, seed=0)
        per_block = offload.moved.bytes // len(blocks)  # blocks alike: each holds as much
        pinned, stored = offload.pinned_bytes, offload.stored_bytes
        for step in range(2):
            _gradients(model, batch, seed=step)
        assert (offload.pinned_bytes, offload.stored_bytes) == (pinned, stored)  # reused from step to step
        remove()
        host_buffers.reclaim()
        # A tune's next trial is lent the same staging buffers, and its host peak counts them: the pool's bytes.
        offload, remove = install(blocks, CPU, min_bytes=SMALL)
        _gradients(model, batch, seed=0)
        again = offload.pinned_bytes
        remove()
        counted = host_buffers.reclaim()
    assert pinned == 2 * per_block  # two slots, one block each
    assert stored == len(blocks) * per_block  # every block between its forward and its backward
    assert counted == again == pinned


def test_a_trial_of_the_plan_option_holds_less_on_the_device():
    cfg = GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = random_batch(cfg, 8)
    work = Workload(model=model, batch=batch, loss_fn=resolve(None), spec=OptimizerSpec.from_user(None, model),
                    placement=resolve_device("cpu"), budget_bytes=2**40, limit_bytes=2**40, per_rank=8,
                    blocks=find_blocks(model), measured_steps=1)
    runner = TrialRunner(work)
    plain, streamed = runner(Rung(), 8), runner(Rung(offload="saved_activations"), 8)
    assert streamed.fits and streamed.rung.name == "bf16+saved activations offload"
    assert streamed.peak_bytes < 0.8 * plain.peak_bytes, (streamed.peak_bytes, plain.peak_bytes)


def test_the_search_measures_it_beside_the_recomputing_offload_on_cuda():
    cfg = GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=64)
    blocks = find_blocks(GPT(cfg))
    allowed = frozenset({"bf16", "checkpointing", "offload", "saved_activations"})
    on_gpu, _ = anchors(allowed, Placement(kind="cuda", name="H100", total_bytes=80 << 30), blocks)
    on_cpu, _ = anchors(allowed, resolve_device("cpu"), blocks)
    precision = on_gpu[0].precision  # what this machine's CUDA check gives a device it cannot see
    assert [r for r in on_gpu if r.offload == "saved_activations"] == [
        Rung(precision=precision, offload="saved_activations")]  # no block recomputed: the other offload's corner
    assert Rung(precision=precision, checkpointing="full", checkpointed_blocks=4, offload="activations") in on_gpu
    # the CPU device's copies are plain, in the step's time: nothing there for a side stream to hide them behind
    assert not [r for r in on_cpu if r.offload == "saved_activations"]
    # opt-in: the default techniques do not spend trials on it
    assert not [r for r in anchors(allowed - {"saved_activations"}, Placement(kind="cuda"), blocks)[0]
                if r.offload == "saved_activations"]
