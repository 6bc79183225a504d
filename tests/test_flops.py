"""FLOPs per sample, counted with FlopCounterMode, against the textbook formulas; MFU from the GPU peak table."""

from __future__ import annotations

import pytest
import torch
from cache_samples import sample
from click.testing import CliRunner
from gpt import GPT, GPTConfig, random_batch
from torch import nn

import autotune
from autotune import settings
from autotune.cache.store import PlanCache
from autotune.cli.main import main
from autotune.cli.run import format_trials
from autotune.devices.peaks import PEAK_ENV, device_peak
from autotune.devices.placement import resolve_device
from autotune.search.flops import count_flops, utilization
from autotune.workload.losses import resolve

CPU = resolve_device("cpu")


@pytest.fixture(autouse=True)
def no_peak_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)


def _matmul_params(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def test_mlp_flops_per_sample_are_six_times_its_matmul_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 64))
    batch = torch.randn(8, 64)
    counted = count_flops(model, batch, lambda m, x: m(x).square().mean(), CPU).per_sample
    expected = 6 * _matmul_params(model)  # 2N forward, 4N backward (input and weight gradients)
    assert counted == pytest.approx(expected, rel=0.2)
    assert all(p.grad is None for p in model.parameters())  # the count leaves no gradient behind


def test_transformer_flops_per_sample_match_6n_plus_attention() -> None:
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    counted = count_flops(model, random_batch(cfg, 4), resolve(None), CPU).per_sample
    n = _matmul_params(model)  # embeddings are lookups, not matmuls
    # Per token: 6N, plus 12 x layers x width x sequence for QK^T and AV forward and backward (PaLM, app. B).
    per_token = 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
    assert counted == pytest.approx(per_token * cfg.seq_len, rel=0.2)


def test_an_oom_while_counting_leaves_the_flops_unknown() -> None:
    class Hungry(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert count_flops(Hungry(), torch.zeros(2, 4), lambda m, x: m(x).sum(), CPU).per_sample is None


def test_a_count_whose_backward_runs_out_of_memory_triples_the_forward() -> None:
    """A model whose weights and gradients do not fit together (offload's models) still gets a count."""

    class NoRoomForGradients(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return self.net(x)

    model = NoRoomForGradients()
    counted = count_flops(model, torch.randn(8, 64), lambda m, x: m(x).square().mean(), CPU).per_sample
    assert counted == pytest.approx(6 * _matmul_params(model), rel=0.2)


def test_peak_table_tells_the_h100_variants_apart() -> None:
    sxm, pcie = device_peak("NVIDIA H100 80GB HBM3"), device_peak("NVIDIA H100 PCIe")
    assert sxm.flops("bf16") == pytest.approx(989e12) and pcie.flops("bf16") == pytest.approx(756e12)
    assert device_peak("NVIDIA H200").flops("bf16") == pytest.approx(989e12)
    assert device_peak("NVIDIA A100-SXM4-80GB").flops("fp32") == pytest.approx(19.5e12)
    assert device_peak("NVIDIA GeForce RTX 4090").flops("bf16") == pytest.approx(165.2e12)
    assert device_peak("NVIDIA L4").flops("bf16") == pytest.approx(121e12)
    assert device_peak("NVIDIA L40S").flops("bf16") == pytest.approx(362e12)
    assert device_peak("Some Future GPU").flops("bf16") is None
    assert device_peak("cpu (simulated ceiling)", "cpu").flops("bf16") is None


def test_peak_override_and_its_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "100")
    assert device_peak("Some Future GPU", override=settings.read(PEAK_ENV)).flops("bf16") == pytest.approx(100e12)
    # no speed to compare on the CPU
    assert device_peak("cpu (simulated ceiling)", "cpu", override=settings.read(PEAK_ENV)).flops("bf16") is None
    monkeypatch.setenv(PEAK_ENV, "fast")
    with pytest.raises(autotune.InvalidSetting, match=PEAK_ENV):
        device_peak("NVIDIA H100 PCIe", override=settings.read(PEAK_ENV))


def test_utilization_is_per_gpu() -> None:
    peak = device_peak("NVIDIA H100 80GB HBM3")
    # 1e12 FLOPs a sample at 989 samples/s over two GPUs: half the peak each.
    assert utilization(1e12, 989.0, 2, peak, "bf16") == pytest.approx(0.5)
    assert utilization(None, 989.0, 1, peak, "bf16") is None


def test_fit_on_the_cpu_counts_flops_but_has_no_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "100")
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = autotune.fit(model, random_batch(cfg, 8), global_batch_size=8, device="cpu", memory_budget="64MiB",
                        cache=False, trial_steps=1, max_trials=3)
    counted = count_flops(model, random_batch(cfg, 2), resolve(None), CPU).per_sample
    assert plan.flops_per_sample == pytest.approx(counted)
    assert plan.mfu is None and "MFU" not in plan.summary()


def test_mfu_shows_in_the_summary_the_trial_table_and_cache_list(tmp_path) -> None:
    plan, parts = sample(0)
    plan = plan.with_evidence(flops_per_sample=1e9, mfu=0.4)
    assert plan.summary().endswith("MFU 40.0%")
    table = format_trials(plan.trials, plan).splitlines()
    assert table[0].split()[-2:] == ["MFU", "note"]
    assert table[1].split()[-1] == "40.0%" and table[2].split()[-4:] == ["-", "-", "simulated", "OOM"]
    assert "MFU" not in format_trials(plan.trials, plan.with_evidence(mfu=None))
    store = PlanCache(tmp_path / "plans.db")
    store.put(plan, parts)
    listed = CliRunner().invoke(main, ["cache", "--cache", str(tmp_path / "plans.db"), "list"])
    assert listed.exit_code == 0 and "MFU" in listed.output and "40.0%" in listed.output
    shown = CliRunner().invoke(main, ["cache", "--cache", str(tmp_path / "plans.db"), "show", plan.key[:8]])
    assert "1.0 GFLOPs per sample" in shown.output and "MFU 40.0%" in shown.output


def _sdpa_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: bool) -> int:
    from torch.nn.functional import scaled_dot_product_attention
    from torch.utils.flop_counter import FlopCounterMode

    from autotune.search.attention_flops import ATTENTION_FORMULAS

    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS)
    with counter:
        scaled_dot_product_attention(q, k, v, **kwargs).sum().backward()
    return counter.get_total_flops()


def test_grouped_query_attention_counts_as_attention_over_every_query_head() -> None:
    b, h_q, h_kv, s, d = 2, 8, 2, 32, 16
    q = torch.randn(b, h_q, s, d, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, requires_grad=True) for _ in range(2))
    grouped = _sdpa_flops(q, k, v, enable_gqa=True)
    expanded = _sdpa_flops(q, *(t.detach().repeat_interleave(h_q // h_kv, dim=1).requires_grad_() for t in (k, v)))
    # forward QK^T and PV (2 matmuls), backward the scores again and four gradients (5): 2*b*h*s*s*d each
    assert grouped == expanded == 7 * 2 * b * h_q * s * s * d


def test_a_llama_with_grouped_query_attention_under_sdpa_counts_its_attention() -> None:
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=256, vocab_size=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    counted = count_flops(model, batch, resolve(None), CPU).per_sample
    assert counted is not None
    plain = FlopCounterMode(display=False)  # torch's own table: the matmuls, and no CPU attention kernel
    with plain:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    seq, head_dim = ids.shape[1], cfg.hidden_size // cfg.num_attention_heads
    attention = cfg.num_hidden_layers * 7 * 2 * cfg.num_attention_heads * seq * seq * head_dim
    assert counted == pytest.approx(plain.get_total_flops() / 2 + attention, rel=1e-9)


def test_a_gpu_plan_without_mfu_says_why() -> None:
    from autotune.search.flops import FlopCount
    from autotune.search.tune import _why_no_mfu

    h100 = device_peak("NVIDIA H100 80GB HBM3")
    uncounted = FlopCount(None, "counting FLOPs at micro-batch 2 ran out of memory, even without gradients")
    assert _why_no_mfu(uncounted, h100, "bf16", "cuda") == [f"no MFU: {uncounted.why_not}"]
    unknown = device_peak("Some Future GPU")
    assert "AUTOTUNE_PEAK_TFLOPS" in _why_no_mfu(FlopCount(1e9), unknown, "bf16", "cuda")[0]
    assert _why_no_mfu(FlopCount(1e9), h100, "bf16", "cuda") == []
    assert _why_no_mfu(uncounted, device_peak("cpu", "cpu"), "bf16", "cpu") == []  # the CPU test device: no MFU
