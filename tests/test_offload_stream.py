"""The host share of optimizer offload stepped on the device, its state streamed (techniques/offload/streamed.py).

On the CPU test device the "device" is the CPU, so the streamed step runs the very kernel the CPU step runs
(torch's fused AdamW) on the same FP32 gradient: the parameters and the optimizer state must be bitwise the
CPU step's, serial or overlapped, whole or partial share, clipped or not, and after an aborted backward.
$AUTOTUNE_OFFLOAD_STREAM=1 turns it on here (on CUDA it is on by default).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_offload import Net, Wide, adamw, assert_bitwise, batches, make_plan, run_benchmark, second_step_peak

import autotune
from autotune.techniques.offload import StreamedEngine
from autotune.techniques.offload import pipeline as offload_pipeline
from autotune.techniques.offload import streamed as offload_stream
from autotune.training.step import TrainingStep


@pytest.fixture(autouse=True)
def small_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(offload_pipeline, "CHUNK_ELEMENTS", 200)
    monkeypatch.setattr(offload_stream, "SEGMENT", 64)  # the largest tensors (768 elements) go in 12 segments
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "plans.db"))
    monkeypatch.delenv("AUTOTUNE_TECHNIQUES", raising=False)


def train(plan, data, monkeypatch, *, stream: bool, overlap: bool, make_opt=adamw, **kwargs):
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1" if stream else "0")
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "1" if overlap else "0")
    plan = plan.with_config(offload_overlap=True if overlap else None)  # as fit decides it
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(model.parameters())
    step = TrainingStep(plan, model, opt, **kwargs)
    assert isinstance(step.optimizer, StreamedEngine) == stream
    for b in data:
        step(b)
    return model, step, opt


def assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        assert float(sa[k]["step"]) == float(sb[k]["step"])
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) and torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap-asked"])
@pytest.mark.parametrize("fraction,clip", [(None, None), (None, 0.05), (0.5, None)], ids=["whole", "clipped", "half"])
def test_the_streamed_step_gives_the_cpu_steps_parameters_and_state(monkeypatch, overlap, fraction, clip):
    plan = make_plan(3, 8, fraction=fraction)  # 3 + 3 + 2: an uneven micro-batch
    data = batches(8, 4)
    cpu, c_step, c_opt = train(plan, data, monkeypatch, stream=False, overlap=False, max_grad_norm=clip)
    streamed, s_step, s_opt = train(plan, data, monkeypatch, stream=True, overlap=overlap, max_grad_norm=clip)
    host = s_step.optimizer
    assert isinstance(host, StreamedEngine) and host.shares.host_index  # the device steps all of it
    assert_bitwise(streamed, cpu)
    assert not hasattr(host, "pipeline")  # streamed, the stepper overlaps on its own
    # overlapped, segments were stepped during the last backward; clipped, the factor comes after it: none
    assert (s_step.optimizer.stepper.early > 0) == (overlap and clip is None), s_step.optimizer.stepper.early
    c_step.close()
    s_step.close()
    assert_bitwise(streamed, cpu)  # FP32 weights back from the same masters
    assert_same_state(s_opt, c_opt)


def serial_and_streamed(monkeypatch, overlap):
    """A seeded `Net`, its copy, one batch, the copy's serial CPU-stepped engine and the model's streamed one
    (overlapped or not): the pair the abort and rung-switch tests compare bitwise."""
    from test_offload import host_optimizer

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    batch = batches(4, 1)[0]
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "0")
    serial = host_optimizer(ref, overlap=False)
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1")
    host = host_optimizer(model, overlap=overlap)
    assert isinstance(host, StreamedEngine) and host.overlap == overlap
    return model, ref, batch, serial, host


def test_an_overlapped_backward_that_fails_leaves_no_trace_and_the_rerun_is_exact(monkeypatch):
    # What TrainingStep does when the last backward runs out of memory after segments were stepped from its
    # hooks: abort(), drop the gradients, re-run, step. The aborted attempt wrote new weights on the device
    # and new masters and moments into the spare buffers: abort puts the old weights back and nothing else
    # changed, so the re-run's step is the serial CPU step's, bitwise, each parameter stepped once.
    from test_offload import backward, rerun_matches_serial

    model, ref, batch, serial, host = serial_and_streamed(monkeypatch, overlap=True)
    assert not hasattr(host, "pipeline")
    assert host.stepper._spare is not None  # reserved when built, not in the first (timed) step
    masters = [m.clone() for m in host.shares.masters]
    host.arm()
    old = [p.detach().clone() for p in model.parameters()]
    backward(model, batch)
    assert host.stepper.early > 0 and not all(torch.equal(p, q) for p, q in zip(model.parameters(), old))
    host.abort()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), old))  # the old weights are back
    assert all(torch.equal(m, q) for m, q in zip(host.shares.masters, masters))  # the masters untouched
    rerun_matches_serial(host, serial, model, ref, batch)
    assert_same_state(host.shares.optimizer, serial.shares.optimizer)
    host.restore()
    serial.restore()
    assert_bitwise(model, ref)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_positions_an_aborted_attempt_stepped_are_not_streamed_again(monkeypatch, overlap):
    # After a rung switch the positions an aborted attempt stepped keep that update (`keep_stepped`): the
    # streamed step leaves them as they are and streams the rest, as the CPU step does (after backward, also
    # where the plan overlaps: an overlapped step writes every segment of the share anew).
    from test_offload import backward

    model, ref, batch, serial, host = serial_and_streamed(monkeypatch, overlap=overlap)
    kept = set(host.shares.host_index[:2])
    assert host.keep_stepped(kept) == kept and serial.keep_stepped(kept) == kept
    before = [p.detach().clone() for p in model.parameters()]
    host.arm()
    backward(model, batch)
    assert not host.stepper.armed
    host.step()
    backward(ref, batch)
    serial.step()
    assert_bitwise(model, ref)
    params = list(model.parameters())
    assert all(torch.equal(params[i], before[i]) for i in kept)
    assert not any(torch.equal(params[i], before[i]) for i in set(host.shares.host_index) - kept)
    assert not any(host.shares.optimizer.state.get(host.shares.master[i]) for i in kept)  # never stepped
    assert_same_state(host, serial)  # in the user's layout
    host.restore()
    serial.restore()
    assert_bitwise(model, ref)


def test_a_grad_scaler_or_another_optimizer_keeps_the_cpu_step(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1")
    steps = []
    for precision, make_opt in (("bf16", adamw), ("fp16", adamw),
                                ("bf16", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))):
        model = Net()
        steps.append(TrainingStep(make_plan(4, 8, precision=precision), model, make_opt(model.parameters())))
    streamed, fp16, sgd = (isinstance(s.optimizer, StreamedEngine) for s in steps)
    assert streamed  # the control: AdamW under bf16 streams
    assert not fp16  # a GradScaler's unscale and inf check run on the host gradients
    assert not sgd
    assert "SGD" in offload_stream.streamable(torch.optim.SGD(Net().parameters(), lr=0.1))
    assert "amsgrad" in offload_stream.streamable(torch.optim.Adam(Net().parameters(), amsgrad=True))
    for s in steps:
        s.close()


def test_a_loaded_state_is_streamed_from_where_it_was_left(monkeypatch):
    # A user's checkpoint loaded into the offloaded optimizer, then more steps: as the CPU step would.
    plan = make_plan(4, 8)
    data = batches(8, 3)
    results = []
    for stream in (False, True):
        monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1" if stream else "0")
        torch.manual_seed(0)
        model = Net()
        first = TrainingStep(plan, model, adamw(model.parameters()))
        first(data[0])
        saved = copy.deepcopy(first.optimizer.state_dict())
        first.close()
        opt = adamw(model.parameters())
        opt.load_state_dict(saved)
        second = TrainingStep(plan, model, opt)
        assert isinstance(second.optimizer, StreamedEngine) == stream
        for b in data[1:]:
            second(b)
        second.close()
        results.append(model)
    assert_bitwise(results[1], results[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_on_cuda_the_streamed_step_matches_the_cpu_step_within_fp32_rounding(monkeypatch, overlap):
    # Different kernels (CUDA and CPU fused AdamW): equal up to FP32 rounding, not bitwise. One step from the
    # same weights and batch (so the same gradients): after more, a 16-bit weight rounded the other way
    # changes the next gradient, and Adam's normalised update can turn that into a full lr.
    monkeypatch.setattr(offload_stream, "SEGMENT", 4096)
    batch = tuple(t.cuda() for t in batches(8, 1)[0])

    def run(stream: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
        monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1" if stream else "0")
        monkeypatch.setenv("AUTOTUNE_OFFLOAD_OVERLAP", "1" if overlap else "0")
        torch.manual_seed(0)
        model = Net(width=256).cuda()
        before = copy.deepcopy(model)
        plan = make_plan(3, 8).with_config(offload_overlap=True if overlap else None).with_provenance(device="cuda")
        step = TrainingStep(plan, model, adamw(model.parameters()))
        assert isinstance(step.optimizer, StreamedEngine) == stream
        step(batch)
        if stream:  # overlapped: segments issued from the last backward's hooks, on the GPU's streams
            assert (step.optimizer.stepper.early > 0) == overlap, step.optimizer.stepper.early
        step.close()  # FP32 weights back from the masters
        return before, model

    before, cpu = run(False)
    _, streamed = run(True)
    for p0, p, q in zip(before.parameters(), cpu.parameters(), streamed.parameters()):
        assert not torch.equal(p, p0)  # the step moved it (by about lr = 1e-2 per element)
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_step_counts_are_not_overwritten_by_work_queued_for_their_memory(monkeypatch):
    """The stepper's step counts live in blocks the allocator may hand out while kernels queued for their last
    tenant have yet to run. Here the current stream sleeps, then zeroes small tensors that are freed at once;
    the counts made next take their blocks. Filled on the step's stream without waiting, they were zeroed
    after their fill, and a count of 0 divides Adam's bias correction by zero: NaN weights (seen on GPT-2
    medium and large, 2026-11-27)."""
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1")
    torch.manual_seed(0)
    model = Net(width=64).cuda()
    plan = make_plan(4, 4).with_config(offload_overlap=True).with_provenance(device="cuda")
    step = TrainingStep(plan, model, adamw(model.parameters()))
    host = step.optimizer
    assert isinstance(host, StreamedEngine) and host.stepper is not None and host.overlap
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of the current stream's queue ahead of what follows
    junk = [torch.empty((), device="cuda") for _ in range(4 * len(host.shares.host_index))]
    for t in junk:
        t.zero_()  # queued behind the sleep
    del junk  # freed now, written later: their blocks go to the next small tensors, the counts
    host.arm()
    host.step()
    torch.cuda.synchronize()
    counts = [float(t) for t in host.stepper._steps.values()]
    assert counts == [1.0] * len(counts), counts
    assert all(torch.isfinite(p).all() for p in model.parameters())
    step.close()


def test_a_streamed_search_measures_the_overlap_and_says_which_it_chose(monkeypatch):
    # Streamed, the overlap trial issues the segments from the last backward's hooks; fit measures it beside
    # the serial one and the plan keeps the faster, named as streamed in the reason.
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "1")
    # Wide's 55,872 parameters in 28 segments rather than 873 (each costs Python work), still several per step.
    monkeypatch.setattr(offload_stream, "SEGMENT", 2048)
    torch.manual_seed(0)
    model = Wide()
    batch = torch.randn(4, 96)
    on_host = second_step_peak(make_plan(4, 4), model, batch)
    plain = make_plan(1, 4).with_config(offload="none", offload_fraction=None)
    on_device = second_step_peak(plain, model, batch)
    budget = int((on_host + on_device) / 2 / 0.9)  # no offload is over the limit, optimizer offload under it
    # One measured step a trial: what the search measures and says is under test, not which mode wins.
    kw = dict(global_batch_size=4, memory_budget=budget, device="cpu", cache=False, techniques=("bf16", "offload"),
              max_trials=8, trial_steps=1)
    plan = autotune.fit(copy.deepcopy(model), batch, **kw)
    assert plan.offload == "optimizer" and plan.offload_overlap is not None, plan.reason
    assert "streamed optimizer offload" in plan.reason
    overlapped = [t for t in plan.trials if "overlapped" in t.note]
    assert overlapped, plan.reason
    # a step overlapping backward adds its temporaries to backward's peak (the CPU kernel's, here): a trial
    # over the limit keeps the serial step
    assert plan.offload_overlap is False or all(t.fits for t in overlapped), plan.reason
    monkeypatch.setenv("AUTOTUNE_OFFLOAD_STREAM", "0")  # the control: the CPU step is measured both ways too
    plan = autotune.fit(copy.deepcopy(model), batch, **kw)
    assert plan.offload == "optimizer" and plan.offload_overlap is not None and "streamed" not in plan.reason


def test_bench_host_step_runs_on_the_cpu(tmp_path, monkeypatch):
    import json

    out = tmp_path / "host_step.jsonl"
    run_benchmark(monkeypatch, "bench_host_step.py", "--params", "3e6", "--device", "cpu", "--repeat", "1",
                  "--out", str(out))
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["setup"]["params"] == 3_000_000 and rows["setup"]["chunks"] == 1
    assert 0 < rows["cpu_adamw_only"]["seconds"] and 0 < rows["cpu"]["seconds"]
    assert "stream" not in rows  # the CPU has no link to stream over
