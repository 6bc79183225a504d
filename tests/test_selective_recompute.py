"""Selective recompute: a recomputed block keeps its matmuls' and attention's outputs (`recompute_policy`) and
reruns only the cheap operators. The loss and gradients are those of no recompute (float64, dropout on), the
matmuls are not run again in backward, its memory line predicts its peak, the search measures it beside whole
blocks and picks it where it is the fastest that fits, and a bad value is refused naming the setting."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from gpt import GPT, GPTConfig, random_batch
from test_recompute_buffers import SpectralStatefulBlock, assert_same, new, train
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import autotune
from autotune.configuration import RECOMPUTE_POLICIES, Configuration, Rung
from autotune.devices.placement import resolve_device
from autotune.errors import InvalidSetting
from autotune.evidence import Trial
from autotune.plan import Plan
from autotune.search.anchors import anchors
from autotune.search.controller import Controller, Lattice
from autotune.search.lines import bytes_per_sample, resident_floor, rung_state
from autotune.search.measure import measure
from autotune.search.trial import TrialRunner, Workload
from autotune.settings import DEFAULT_MARGIN
from autotune.techniques import apply_rung, find_blocks, ladder
from autotune.training.recovery import after_oom
from autotune.workload.batching import global_step_seconds
from autotune.workload.losses import resolve
from autotune.workload.optimizers import OptimizerSpec

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py

TOL = 1e-12
CPU = resolve_device("cpu")
SELECTIVE = ("save_matmuls", "save_half_matmuls")
GiB = 2**30


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).double()


def tiny_gpt2() -> nn.Module:
    """GPT-2 with dropout on everywhere: embeddings, attention probabilities, residuals."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.2,
                     embd_pdrop=0.2, attn_pdrop=0.2, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg).double().train()


def step(model: nn.Module, rung: Rung | None, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    """One forward and backward of `model` under `rung` (None: no recompute at all), dropout seeded alike; the
    loss, the gradients, and the FLOPs backward ran (the recompute's included)."""
    applied = None
    if rung is not None:
        applied = apply_rung(model, rung, OptimizerSpec.from_user(None, model), CPU, find_blocks(model))
    try:
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        with FlopCounterMode(display=False) as flops:
            loss.backward()
    finally:
        if applied is not None:
            applied.remove()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], flops.get_total_flops()


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2_dropout"])
def test_selective_recompute_equals_no_recompute_and_reruns_no_matmul(make):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plain_loss, plain_grads, plain_flops = step(make(), None, ids)
    _, _, whole_flops = step(make(), Rung(precision="fp32", checkpointing="full"), ids)
    assert whole_flops > plain_flops  # the premise: whole blocks rerun their matmuls in backward
    for policy in SELECTIVE:
        loss, grads, flops = step(make(), Rung(precision="fp32", checkpointing="full", recompute_policy=policy), ids)
        torch.testing.assert_close(loss, plain_loss, rtol=TOL, atol=TOL)
        for got, want in zip(grads, plain_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
        if policy == "save_matmuls":
            assert flops == plain_flops  # every matmul and attention kept: none run again
        else:
            assert plain_flops < flops < whole_flops  # half the matmuls run again


@pytest.mark.parametrize("offload", ["none", "activations"])
def test_blocks_writing_state_in_forward_keep_their_guards_under_a_selective_policy(offload):
    # spectral norm's power iteration, an EMA, a counter, a reassigned buffer: written once per forward, and the
    # recompute computes with the state the forward saw, under activation offload too
    plain, recomputed = new(SpectralStatefulBlock), new(SpectralStatefulBlock)
    want_grads, plain_runs = train(plain, "none")
    got_grads, recomputed_runs = train(recomputed, "full", offload=offload, recompute_policy="save_half_matmuls")
    assert recomputed_runs == 2 * plain_runs  # every block ran again in backward, its cheap operators
    assert [int(b.steps) for b in recomputed.blocks] == [9] * 4  # 3 micro-batches in each of 3 steps
    assert_same(recomputed, plain, got_grads, want_grads)


CFG = GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=64)


def gpt_runner() -> tuple[nn.Module, TrialRunner]:
    torch.manual_seed(0)
    model = GPT(CFG)
    work = Workload(model=model, batch=random_batch(CFG, 8), loss_fn=resolve(None),
                    spec=OptimizerSpec.from_user(None, model), placement=CPU, budget_bytes=2**40,
                    limit_bytes=2**40, per_rank=8, blocks=find_blocks(model), measured_steps=1)
    return model, TrialRunner(work)


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_the_policys_memory_line_predicts_its_peak_within_the_margin():
    _, runner = gpt_runner()
    controller = Controller(runner, per_rank=8, limit_bytes=2**40)
    kept, whole, plain = (Rung(checkpointing="full", recompute_policy="save_matmuls"), Rung(checkpointing="full"),
                          Rung())
    for rung in (kept, whole, plain):
        state = rung_state(controller.ledger, rung)
        for micro in (2, 4):
            measure(controller.ledger, state, micro)
    slope, floor = bytes_per_sample(controller.ledger, kept), resident_floor(controller.ledger, kept)
    assert slope is not None and floor is not None
    # its own line: what each sample keeps lies between whole-block recompute's and no recompute's
    assert bytes_per_sample(controller.ledger, whole) < slope < bytes_per_sample(controller.ledger, plain)
    measured = runner(kept, 8).peak_bytes
    predicted = floor + 8 * slope
    assert abs(predicted - measured) <= DEFAULT_MARGIN * measured, (predicted, measured)


@dataclasses.dataclass
class ScriptedGPU:
    """peak = floor + m x bytes/sample, bytes/sample falling with each block recomputed by what its policy frees;
    micro-step time rising by a third of a block's forward for each whole block, by 3% for a block keeping its
    matmuls."""

    n: int
    per_rank: int = 16
    budget: float = 24 * GiB
    floor: float = 4 * GiB
    s0: float = 2 * GiB  # bytes per sample with no block recomputed
    freed: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"whole_block": 1.5 * GiB, "save_matmuls": 1.0 * GiB, "save_half_matmuls": 1.2 * GiB})

    def __call__(self, rung: Rung, micro: int) -> Trial:
        frac = (rung.checkpointed_blocks or 0) / self.n
        floor = self.floor / 4 if rung.offload == "optimizer" else self.floor
        peak = int(floor + micro * (self.s0 - frac * self.freed[rung.recompute_policy]))
        if peak > self.budget:
            return Trial(rung=rung, micro_batch_size=micro, outcome="oom", peak_bytes=int(self.budget))
        extra = 0.33 if rung.recompute_policy == "whole_block" else 0.03
        seconds = 0.1 + micro * 0.05 * (1 + extra * frac)
        opt = 0.4 if rung.offload == "optimizer" else 0.05
        rate = self.per_rank / global_step_seconds(seconds, opt, self.per_rank, micro)
        return Trial(rung=rung, micro_batch_size=micro, outcome="ok" if peak <= 0.9 * self.budget else "over_budget",
                     peak_bytes=peak, step_seconds=seconds, optimizer_seconds=opt, samples_per_second=rate)


def test_the_search_picks_blocks_keeping_their_matmuls_where_that_is_the_fastest_that_fits():
    # No recompute fits 8 samples (two micro-steps); all 16 fit with all four blocks recomputed whole (a third
    # more time per sample) or keeping their matmuls (3% more); three whole blocks do not fit 16.
    blocks = find_blocks(GPT(CFG))
    rungs, _ = anchors(frozenset({"bf16", "checkpointing", "offload", "selective_recompute"}), CPU, blocks)
    gpu = ScriptedGPU(n=len(blocks.blocks))
    controller = Controller(gpu, per_rank=gpu.per_rank, limit_bytes=int(0.9 * gpu.budget))
    result = controller.search(rungs, Lattice(blocks=gpu.n))
    assert result.picked().rung.recompute_policy == "save_matmuls"
    assert result.picked().micro_batch_size == 16
    assert "keeping matmuls" in result.head
    # measured beside whole blocks: those, and keeping half the matmuls, were then ruled out by the time model
    # (the pick already trains the whole batch in one micro-step, for less recompute)
    measured = {t.rung.recompute_policy for t in result.trials if t.rung.checkpointed_blocks}
    ruled_out = {r.recompute_policy for r in controller.skipped if r.checkpointed_blocks}
    assert measured | ruled_out == set(RECOMPUTE_POLICIES)
    assert ruled_out == {"whole_block", "save_half_matmuls"}


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_fit_measures_blocks_keeping_their_matmuls_beside_whole_blocks():
    torch.manual_seed(0)
    model, batch = GPT(CFG), random_batch(CFG, 4)
    _, runner = gpt_runner()
    # a budget where no recompute fits 8 samples but blocks keeping their matmuls do (the limit is 90% of it)
    plain, kept = runner(Rung(), 8).peak_bytes, runner(Rung(checkpointing="full", recompute_policy="save_matmuls"),
                                                         8).peak_bytes
    assert kept < plain
    plan = autotune.fit(model, batch, global_batch_size=8, memory_budget=int((kept + plain) / 2 / 0.9), device="cpu",
                        cache=False, trial_steps=1, techniques=("bf16", "checkpointing", "selective_recompute"))
    fitted = [t for t in plan.trials if t.fits]
    reach = max(t.micro_batch_size for t in fitted if t.rung.checkpointing == "none")
    # a candidate of its own: measured, it fitted more samples than no recompute could; or, where the time model
    # bounded it below what no recompute measured (a loaded machine's readings), skipped and said so
    kept = [t for t in fitted if t.rung.recompute_policy == "save_matmuls" and t.rung.checkpointing == "full"]
    skipped = re.search(r"skipped \w+\+full ckpt keeping matmuls: at best [\d.,]+ samples/s", plan.reason)
    assert (kept and max(t.micro_batch_size for t in kept) > reach) or skipped, (plan.trials, plan.reason)


def test_the_policy_is_in_the_plans_dict_and_summary():
    plan = Plan.of(checkpointing="full", recompute_policy="save_half_matmuls", micro_batch_size=4,
                   global_batch_size=8, memory_budget_bytes=GiB)
    assert plan.recompute_policy == "save_half_matmuls"
    assert plan.to_dict()["config"]["rung"]["recompute_policy"] == "save_half_matmuls"
    assert Configuration.from_dict(plan.config.to_dict()) == plan.config
    assert "keeping half the matmuls" in plan.summary()
    assert plan.config.replace(checkpointing="none").recompute_policy == "whole_block"


def test_a_bad_policy_is_refused_naming_the_setting():
    with pytest.raises(InvalidSetting, match=r"recompute_policy must be one of whole_block, save_matmuls, "
                                             r"save_half_matmuls; got 'everything'"):
        Configuration.of(checkpointing="full", recompute_policy="everything", micro_batch_size=1,
                         accumulation_steps=1, world_size=1, global_batch_size=1, last_micro_batch_size=1,
                         memory_budget_bytes=GiB, margin=0.1)
    with pytest.raises(InvalidSetting, match=r"recompute_policy 'save_matmuls' .* checkpointing is 'none'"):
        Rung(recompute_policy="save_matmuls")
    with pytest.raises(InvalidSetting, match=r"recompute_policy 'save_matmuls' .* under compile"):
        Rung(checkpointing="full", recompute_policy="save_matmuls", compile=True)


def test_recovery_from_blocks_keeping_their_matmuls_recomputes_them_whole_first():
    blocks = find_blocks(GPT(CFG))
    rungs, _ = ladder(frozenset({"bf16", "checkpointing", "offload"}), CPU, blocks)
    n = len(blocks.blocks)
    plan = Plan.of(checkpointing="full", checkpointed_blocks=n, recompute_policy="save_matmuls", micro_batch_size=1,
                   global_batch_size=8, memory_budget_bytes=GiB)
    recovered = after_oom(plan, rungs)  # an OOM at micro-batch 1: the next rung up
    assert recovered.rung == Rung(checkpointing="full", checkpointed_blocks=n)  # recompute_policy "whole_block"
