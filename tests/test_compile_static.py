"""Training compiles the plan's shape once more, static, and every other shape runs the dynamic graph the trials
compiled (CPU, Inductor; the search leaves compile out on the simulated device, so the knob is put on directly)."""

from __future__ import annotations

import pytest
import torch
from test_compile_regions import compiled_pair

from autotune import Plan
from autotune.techniques import compile as compiling
from autotune.techniques import find_blocks

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _frames() -> int:
    from torch._dynamo.utils import counters
    return int(counters["frames"]["ok"])


def _ids(rows: int, length: int) -> torch.Tensor:
    return torch.randint(0, 97, (rows, length), generator=torch.Generator().manual_seed(rows * 100 + length))


def _same_loss(model: torch.nn.Module, eager: torch.nn.Module, rows: int, length: int) -> None:
    ids = _ids(rows, length)
    got, want = model(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-4)


@pytest.mark.parametrize(("static", "family"), [(True, _gpt2), (False, _gpt2), (True, _llama)])
def test_the_plans_micro_batch_compiles_once_static_and_other_shapes_reuse_the_dynamic_graph(
        monkeypatch: pytest.MonkeyPatch, static: bool, family) -> None:
    """GPT-2, and a Llama, whose blocks also take the rotary tables the model computes once per forward."""
    monkeypatch.setenv("AUTOTUNE_COMPILE_STATIC", "1" if static else "0")
    torch._dynamo.reset()
    model, eager = family(), family()
    undo = compiling.install(model, find_blocks(model), 0)
    try:
        _same_loss(model, eager, 2, 12)  # a trial: the dynamic graph, for every size and length
        before = _frames()
        with compiling.static_at(4):
            # the plan's micro-batch twice, then an uneven last micro-batch, a new length, a smaller micro-batch
            for rows, length in ((4, 16), (4, 16), (3, 16), (4, 9), (2, 12), (4, 16)):
                _same_loss(model, eager, rows, length)
        # static: one graph more, for (4, 16) alone; off: every shape on the trial's graph
        assert _frames() - before == (1 if static else 0)
        with compiling.static_at(None):  # outside training: the dynamic graph, at the plan's shape too
            _same_loss(model, eager, 4, 16)
        assert _frames() - before == (1 if static else 0)
    finally:
        undo()


def test_a_compiled_plans_micro_steps_run_with_its_micro_batch_static() -> None:
    """Through `plan.apply`: every forward of a compiled plan's step runs with the plan's micro-batch as the static
    one; a plan without compile runs none static. (On the simulated device the memory ceiling's dispatch mode keeps
    dynamo from tracing, so the graphs themselves are counted above, with the knob put on directly.)"""
    seen: dict[bool, list[int | None]] = {True: [], False: []}
    for compiled in (True, False):
        model = _gpt2()
        model.register_forward_pre_hook(lambda *_, c=compiled: seen[c].append(compiling._SEQUENCE.static_rows))
        plan = Plan.of(precision="fp32", compile=compiled, micro_batch_size=2, global_batch_size=5,
                       memory_budget_bytes=1 << 40, device="cpu")
        with plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.0)) as step:
            ids = _ids(5, 12)
            step({"input_ids": ids, "labels": ids})
        assert compiling._SEQUENCE.static_rows is None  # left with the step
    # the step's micro-batches of 1, 2 and 2 at the plan's 2; the loss checks before the first step, outside it
    assert seen[True].count(2) == 3 and set(seen[True]) == {2, None}
    assert set(seen[False]) == {None}


@pytest.mark.parametrize("mode", ["loss check", "flop count"])
def test_a_block_first_called_under_a_dispatch_mode_still_compiles_after(mode: str) -> None:
    """A compiled model's first forward inside a dispatch mode (a plan applied from the cache checks the loss under
    `evaluating`'s mode before its first step; a FLOP count) runs eager, and the next forward outside compiles: Dynamo,
    reaching the block's frame under the mode, would mark its code skipped, and every block would run eager after."""
    from torch.utils.flop_counter import FlopCounterMode

    from autotune.workload.evaluation import evaluating

    torch._dynamo.reset()
    model, eager = _gpt2(), _gpt2()
    undo = compiling.install(model, find_blocks(model), 0)
    try:
        before = _frames()
        ids = _ids(2, 12)
        with evaluating(model) if mode == "loss check" else FlopCounterMode(display=False):
            got = model(input_ids=ids, labels=ids).loss
        assert _frames() == before  # nothing compiled under the mode
        eager.eval()
        assert got.item() == pytest.approx(eager(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
        _same_loss(model, eager, 2, 12)
        assert _frames() - before == 1  # the blocks' one graph, compiled on the first forward outside the mode
    finally:
        undo()


def test_modes_left_on_two_threads_at_once_do_not_keep_the_blocks_eager() -> None:
    """A mode entered on a worker thread while the main thread's is open, and left after it (the host optimizer's
    worker under the simulated ceiling does so), leaves torch's process-wide "in a mode" flag set with no mode on
    either stack. Where Dynamo reads the stack, compiled blocks still compile; reading the flag would run them
    eager for the rest of the process."""
    import threading

    from torch.utils import _python_dispatch as dispatch

    if not getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False):
        pytest.skip("this torch's Dynamo reads the process-wide flag itself")

    class Passing(dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    flag = dispatch.is_in_any_mode_without_ignore_compile_internals()
    entered, release = threading.Event(), threading.Event()

    def worker() -> None:
        with Passing():
            entered.set()
            release.wait()

    thread = threading.Thread(target=worker)
    with Passing():
        thread.start()
        entered.wait()
    release.set()
    thread.join()
    torch._dynamo.reset()
    model, eager = _gpt2(), _gpt2()
    undo = compiling.install(model, find_blocks(model), 0)
    try:
        assert dispatch.is_in_any_mode_without_ignore_compile_internals()  # set, with no mode on this stack
        before = _frames()
        _same_loss(model, eager, 2, 12)
        assert _frames() - before == 1
    finally:
        undo()
        dispatch._is_in_any_mode_without_ignore_compile_internals = flag  # as the process had it
        dispatch.set_is_in_mode_without_ignore_compile_internals(flag)


@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_a_compiled_plan_trains_its_shape_static_and_a_new_length_on_the_dynamic_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `plan.apply` on CUDA, where dynamo traces: two steps at the plan's shape compile the static graph
    once, a step at another length the dynamic one. With $AUTOTUNE_COMPILE_STATIC=0 the dynamic graph serves the
    first length, and a second distinct length compiles it once more: from then on attention pads every length to
    its bucket (`attention_lengths`, on CUDA), a branch the first graph guards. The losses are the eager model's
    either way."""
    counts, seen = {}, {}  # the graphs compiled each way, and dynamo's counters (the failure's message)
    for static in ("1", "0"):
        monkeypatch.setenv("AUTOTUNE_COMPILE_STATIC", static)
        torch._dynamo.reset()
        model, eager = _gpt2().cuda(), _gpt2().cuda()
        plan = Plan.of(precision="fp32", compile=True, micro_batch_size=2, global_batch_size=4,
                       memory_budget_bytes=8 << 30, device="cuda")
        before = _frames()
        with plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.0)) as step:
            for length in (12, 12, 10):
                ids = _ids(4, length).cuda()
                loss = step({"input_ids": ids, "labels": ids})
                assert loss == pytest.approx(eager(input_ids=ids, labels=ids).loss.item(), rel=1e-3)
        counts[static] = _frames() - before
        from torch._dynamo.utils import counters
        seen[static] = {k: dict(v) for k, v in counters.items() if k in ("frames", "recompiles", "stats")}
    assert counts == {"1": 2, "0": 2}, seen


def test_a_recomputed_block_runs_one_graph_in_its_forward_and_its_recompute() -> None:
    """Compile with 2 of 4 blocks recomputed, as `apply_rung` puts them together, in training (`static_at`): the
    recomputed blocks run their static graph inside the checkpoint, in forward and again in backward, and the
    gradients are those of the compiled model without recompute, dropout included; an uneven micro-batch runs the
    dynamic graph in both, with the same gradients as that model's."""
    plain, recomputing, _, undo = compiled_pair(2)

    def grads(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    try:
        grads(recomputing, _ids(5, 12))  # a trial at another size: the dynamic graphs
        grads(plain, _ids(5, 12))
        before = _frames()
        compiled = []
        with compiling.static_at(3):
            for rows in (3, 2, 3):  # the plan's micro-batch, an uneven one, the plan's again
                ids = _ids(rows, 12)
                assert torch.equal(grads(recomputing, ids), grads(plain, ids)), rows
                compiled.append(_frames() - before)
        assert compiled[0] >= 1 and compiled[-1] == compiled[0]  # static graphs at 3 once; 2 on the trial's
    finally:
        for fn in reversed(undo):
            fn()
