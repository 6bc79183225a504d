"""`plan.apply()` under torch.distributed (gloo, CPU processes): data-parallel steps that equal one full-batch
step on one process, token counts summed over ranks, and an OOM on one rank recovered on every rank.

The ranks are spawned once per world size and run every scenario in turn (starting processes dominates the
cost); each scenario checks itself on every rank in float64 against a single-process full-batch step of
SGD (Adam would hide a mis-weighted gradient: see test_step.py) and reports to a JSON file. A spawn that does
not finish in time is killed and fails the tests: nothing waits forever in a collective.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytestmark = pytest.mark.slow  # two and four spawned ranks: about 45 s on a 2-core machine

SCENARIOS = ("mean-uneven", "tokens-uneven", "parts-uneven", "oom-on-one-rank", "oom-at-last-micro-batch",
             "longer-input-on-one-rank", "oom-in-last-backward", "sharded-mean-uneven", "sharded-tokens-uneven",
             "partitioned-oom-on-one-rank")
# Gradient clipping over the global batch (test_clipping.py has one process): two ranks only.
CLIP_SCENARIOS = ("clip-mean-uneven", "clip-tokens-uneven", "sharded-clip-mean-uneven", "sharded-clip-tokens-uneven")
# `plan.reduce_overlap` False: the gradients in one all-reduce after backward (search/reduce_timing.py)
AFTER_SCENARIOS = ("after-mean-uneven", "after-oom-in-last-backward")
CLIP_NORM = 0.05  # well under these batches' gradient norms: the clipping is real
TIMEOUT_S = 180


# -- what runs on each rank ---------------------------------------------------------------------------------

def _shares(world: int, seed: int, t_of=lambda r: 6, n_of=lambda r: r + 2):
    """Each rank's batch: rank r holds r + 2 samples, so the shares are uneven."""
    from test_step import seq_batch

    return [seq_batch(n_of(r), t_of(r), seed=seed + r) for r in range(world)]


def _reference(model, shares, loss_fn=None, max_norm=None):
    """One SGD step over the union of every rank's share, in one process: the full-batch yardstick (clipped
    with torch's clip_grad_norm_ when `max_norm` is given); the model, the loss and the norm."""
    from test_step import sgd

    m = copy.deepcopy(model)
    opt = sgd(m.parameters())
    if loss_fn is None:  # a mean over samples: each share's mean weighted by its samples
        n = sum(len(b[0]) for b in shares)
        loss = sum(m(*b) * len(b[0]) for b in shares) / n
    else:  # tokens: every share's sum over the total count (and named parts each by its own kind)
        outs = [loss_fn(m, b) for b in shares]
        if isinstance(outs[0], dict):  # test_loss_parts.parts_loss: a token part and a per-sample mean
            n = sum(len(b["x"]) for b in shares)
            loss = (sum(o["tokens"][0] for o in outs) / sum(o["tokens"][1] for o in outs)
                    + sum(o["regularizer"] * len(b["x"]) for o, b in zip(outs, shares)) / n)
        else:
            loss = sum(o[0] for o in outs) / sum(o[1] for o in outs)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)) if max_norm is not None else None
    opt.step()
    return m, float(loss.detach()), norm


def _train(plan, model, batch, loss_fn=None, sharded=False, max_norm=None):
    from test_step import sgd

    from autotune.techniques.sharding import shard
    from autotune.training.step import TrainingStep

    m = copy.deepcopy(model)
    if sharded:
        shard(m, precision=plan.precision)  # FSDP2 in place; the optimizer comes after
    step = TrainingStep(plan, m, sgd(m.parameters()), loss_fn=loss_fn, max_grad_norm=max_norm)
    loss = step(batch)
    if sharded:  # the full parameters, gathered from every rank's shard, in a plain copy of the model
        full = copy.deepcopy(model)
        with torch.no_grad():
            for p, q in zip(full.parameters(), m.parameters()):
                p.copy_(q.full_tensor())
        m = full
    return m, step, loss


def _token_net(model):
    """The same model, whose forward takes (x, y, lengths) and returns test_step.token_loss's (loss_sum, count)."""
    from test_step import Net, token_loss

    class TokenNet(Net):
        def forward(self, x, y, lengths=None):
            return super().forward(x, y) if lengths is None else token_loss(_Predict(self), (x, y, lengths))

    net = TokenNet().to(torch.float64)
    net.load_state_dict(model.state_dict())
    return net


class _Predict:
    """Hands token_loss the model's predict without going through forward again."""

    def __init__(self, net) -> None:
        self.predict = net.predict


def _together(rank: int, world: int) -> dict:
    """A bucket of gradients of three sizes summed over ranks as one collective (`all_reduce_together`)."""
    from autotune.parallel import reduce as distributed

    tensors = [torch.full((n,), float(rank + 1), dtype=torch.float64) for n in (1, 7, 3000)]
    work = distributed.all_reduce_together(tensors)
    work.wait()
    return {"sums": [t.tolist() for t in tensors], "one_collective": not isinstance(work, distributed._Works)}


def _scenario(name: str, rank: int, world: int) -> dict:
    import math

    if name == "together":
        return _together(rank, world)

    from test_step import HUGE, assert_same_training, make_plan, new_model, padded_batch, peak_of, token_loss

    model = new_model()
    loss_fn = None
    budget = HUGE
    sharded = name.startswith("sharded-")
    name = name.removeprefix("sharded-")
    # optimizer offload with nothing on the host: each rank steps its part of the parameters, sends the weights
    partitioned = name.startswith("partitioned-")
    name = name.removeprefix("partitioned-")
    after = name.startswith("after-")  # one bucket, all-reduced after backward
    name = name.removeprefix("after-")
    max_norm = CLIP_NORM if name.startswith("clip-") else None
    name = name.removeprefix("clip-")
    if name == "mean-uneven":
        # FSDP runs collectives in every micro-step: its ranks need equal shares (3 samples: micro 2 + 1)
        shares = _shares(world, seed=10, **({"n_of": lambda r: 3} if sharded or after else {}))
    elif name == "tokens-uneven":
        lengths = [[0, 3], [9, 1, 4], [2, 12, 5, 7], [1, 1, 1, 1, 11]]
        if sharded:
            lengths = [[0, 3, 5], [9, 1, 4], [2, 12, 7], [1, 1, 11]]
            model = _token_net(model)  # FSDP gathers the root's parameters in forward: the loss must call it
        shares = [padded_batch(lengths[r], t=12, seed=20 + r) for r in range(world)]
        loss_fn = token_loss
    elif name == "parts-uneven":
        # a token part and a per-sample regularizer, each weighted by its own share of the global batch
        from test_loss_parts import labelled_batch, parts_loss

        lengths = [[0, 3], [9, 1, 4], [2, 12, 5, 7], [1, 1, 1, 1, 11]]
        shares = [labelled_batch(lengths[r], seed=50 + r) for r in range(world)]
        loss_fn = parts_loss
    elif name in ("oom-on-one-rank", "oom-at-last-micro-batch"):
        # a plan of `world` ranks (what a partitioned one must be) needs equal shares
        shares = _shares(world, seed=30, **({"n_of": lambda r: 3} if partitioned else {}))
        calls = {"n": 0}
        # rank 1 runs out of memory at its first micro-batch, or at its last one; only in the first attempt
        at = 1 if name == "oom-on-one-rank" else math.ceil(len(shares[1][0]) / 2)

        def loss_fn(m, b):  # the scenario's loss
            calls["n"] += 1
            if rank == 1 and calls["n"] == at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1)")
            return m(*b)
    elif name == "oom-in-last-backward":
        # Buckets of 2 KB (several per block), and a hook on the first layer's output in the last micro-batch of
        # the first attempt: when backward reaches it, later layers' buckets are being all-reduced already (the
        # overlap); rank 1 runs out of memory right there and must still start the buckets it has not.
        from autotune.parallel import reduce as distributed

        shares = _shares(world, seed=70, **({"n_of": lambda r: 3} if after else {}))
        calls = {"n": 0}
        overlap = {"started": [], "at_bottom": -1}
        start = distributed.OverlappedReduce._start
        distributed.BUCKET_BYTES = 2048

        def counted(self):
            overlap["started"].append(self.started)
            start(self)

        distributed.OverlappedReduce._start = counted

        def at_bottom(grad):
            overlap["at_bottom"] = len(overlap["started"])
            if rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected in backward)")
            return grad

        def loss_fn(m, b):  # the scenario's loss: m(*b), with a hook on the first layer's output
            calls["n"] += 1
            x, y = b
            h = m.inp(x)
            if calls["n"] == math.ceil(len(shares[rank][0]) / 2):
                h.register_hook(at_bottom)
            for block in m.blocks:
                h = block(h)
            return ((m.head(h).squeeze(-1) - y) ** 2).mean()
    elif name == "longer-input-on-one-rank":
        # rank 1's sequences are 8x longer: micro-batch 2 runs out of memory there under the simulated
        # ceiling, and fits everywhere at micro-batch 1
        shares = _shares(world, seed=40, t_of=lambda r: 48 if r == 1 else 6)
        long = shares[1]
        fits = peak_of(make_plan(1, len(long[0])), model, long)
        too_big = peak_of(make_plan(2, len(long[0])), model, long)
        assert fits < too_big, (fits, too_big)
        budget = (fits + too_big) // 2
    else:
        raise ValueError(name)

    plan = make_plan(2, sum(len(b["x"] if isinstance(b, dict) else b[0]) for b in shares), budget=budget)
    if partitioned:
        plan = make_plan(2, len(shares[rank][0]), budget=budget).with_config(
            sharding="optimizer_state", world_size=world, global_batch_size=plan.global_batch_size)
    if after:  # a plan of `world` ranks (what reduce_overlap is a setting of) needs equal shares
        plan = make_plan(2, len(shares[rank][0]), budget=budget).with_config(world_size=world,
                                   global_batch_size=plan.global_batch_size, reduce_overlap=False)
    train_loss = (lambda m, b: m(*b)) if sharded and loss_fn is token_loss else loss_fn
    try:
        got, step, loss = _train(plan, model, shares[rank], train_loss, sharded=sharded, max_norm=max_norm)
    finally:
        if name == "oom-in-last-backward":
            distributed.OverlappedReduce._start, distributed.BUCKET_BYTES = start, 25 * 2**20
    if name == "oom-in-last-backward" and after:
        # one bucket in each attempt, started by nothing before backward had made every gradient: not when
        # backward reached the first layer (rank 0), and on rank 1 only by the exit after its OOM
        assert overlap["started"] == [0, 0] and overlap["at_bottom"] == 0, overlap
    elif name == "oom-in-last-backward":
        buckets = max(overlap["started"]) + 1
        assert buckets > 4 and overlap["started"].count(0) == 2, overlap  # every bucket, in both attempts
        if rank == 0:  # backward had started buckets before it reached the first layer
            assert 0 < overlap["at_bottom"] < buckets, overlap
    want, want_loss, want_norm = _reference(model, shares, None if loss_fn is None or name.startswith("oom")
                                            else loss_fn, max_norm)
    assert_same_training(model, got, want)
    assert step.plan.reduce_overlap is (False if after else None), step.plan  # kept through recovery
    if partitioned:
        # kept through recovery
        assert step.plan.sharding == "optimizer_state" and step.plan.partitioned_state, step.plan
    assert math.isclose(loss, want_loss, rel_tol=1e-10), (loss, want_loss)
    if max_norm is not None:
        assert want_norm > max_norm, want_norm  # the clipping is real
        assert math.isclose(step.last_grad_norm, want_norm, rel_tol=1e-10), (step.last_grad_norm, want_norm)
    return {"micro": step.plan.micro_batch_size, "loss": loss,
            "recoveries": [{"micro_step": r.micro_step, "failed": r.failed, "now": r.now} for r in step.recoveries],
            "params": [float(p.double().sum()) for p in got.parameters()]}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, scenarios: tuple[str, ...]) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import run_scenarios

    run_scenarios(rank, world, init_file, out_dir, scenarios, _scenario)


def _spawn(world: int, scenarios: tuple[str, ...] = SCENARIOS) -> list[dict]:
    from ranks import spawn

    return spawn(_rank_main, world, TIMEOUT_S, scenarios)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return _spawn(2, SCENARIOS + CLIP_SCENARIOS + AFTER_SCENARIOS + ("together",))


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return _spawn(4)


def _check(ranks: list[dict], name: str) -> list[dict]:
    results = [r[name] for r in ranks]
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
    assert all(r["params"] == results[0]["params"] for r in results), "ranks hold different parameters"
    assert all(r["loss"] == results[0]["loss"] for r in results), "ranks report different losses"
    return results


@pytest.mark.parametrize("name", ["mean-uneven", "tokens-uneven", "parts-uneven"])
def test_step_on_two_ranks_equals_one_full_batch_step(two_ranks, name):
    results = _check(two_ranks, name)
    assert all(r["micro"] == 2 and not r["recoveries"] for r in results)


@pytest.mark.parametrize("name", ["oom-on-one-rank", "oom-at-last-micro-batch", "longer-input-on-one-rank",
                                  "oom-in-last-backward"])
def test_oom_on_one_rank_is_recovered_on_every_rank(two_ranks, name):
    results = _check(two_ranks, name)
    # every rank re-ran the same batch at the smaller micro-batch; only rank 1 saw the OOM itself
    assert [r["micro"] for r in results] == [1, 1]
    assert [len(r["recoveries"]) for r in results] == [1, 1]
    assert results[0]["recoveries"][0]["micro_step"] == -1  # "another rank ran out of memory"
    assert results[1]["recoveries"][0]["micro_step"] >= 0
    assert results[0]["recoveries"][0]["now"] == results[1]["recoveries"][0]["now"] == "fp32 at micro-batch 1"


def test_oom_on_one_rank_under_the_partitioned_optimizer_state_is_recovered_exactly(two_ranks):
    # `plan.sharding` "optimizer_state": each rank steps its part and sends its weights; the
    # recovered step equals the full-batch one (float64, checked on every rank) and the plan stays partitioned
    results = _check(two_ranks, "partitioned-oom-on-one-rank")
    assert [r["micro"] for r in results] == [1, 1] and [len(r["recoveries"]) for r in results] == [1, 1]
    assert [r["recoveries"][0]["micro_step"] >= 0 for r in results] == [False, True]
    assert all(r["recoveries"][0]["now"].startswith("fp32, optimizer state sharded over the ranks")
               for r in results), results


def test_one_all_reduce_after_backward_steps_exactly_and_recovers_an_oom_in_the_last_backward(two_ranks):
    # plan.reduce_overlap False: the same full-batch step (float64), and the OOM in the last backward on rank 1
    # recovered on both ranks, one bucket started in each attempt (checked in the scenario)
    plain = _check(two_ranks, "after-mean-uneven")
    assert all(r["micro"] == 2 and not r["recoveries"] for r in plain)
    recovered = _check(two_ranks, "after-oom-in-last-backward")
    assert [r["micro"] for r in recovered] == [1, 1] and [len(r["recoveries"]) for r in recovered] == [1, 1]


@pytest.mark.parametrize("name", ["sharded-mean-uneven", "sharded-tokens-uneven"])
def test_fsdp2_sharded_step_equals_one_full_batch_step(two_ranks, name):
    results = _check(two_ranks, name)
    assert all(r["micro"] == 2 and not r["recoveries"] for r in results)


@pytest.mark.parametrize("name", CLIP_SCENARIOS)
def test_clipping_over_ranks_equals_clip_grad_norm_on_one_full_batch_step(two_ranks, name):
    # Replicated: the norm of the summed gradient; sharded (FSDP2): the squares of every shard summed over ranks.
    results = _check(two_ranks, name)
    assert all(r["micro"] == 2 and not r["recoveries"] for r in results)


@pytest.mark.parametrize("name", SCENARIOS)
def test_four_ranks(four_ranks, name):
    results = _check(four_ranks, name)
    recovered = name not in ("mean-uneven", "tokens-uneven", "parts-uneven", "sharded-mean-uneven",
                             "sharded-tokens-uneven")
    assert all(r["micro"] == (1 if recovered else 2) for r in results)
    assert all(len(r["recoveries"]) == int(recovered) for r in results)


def test_a_bucket_of_gradients_is_summed_over_ranks_as_one_collective(two_ranks):
    for rank, res in enumerate(r["together"] for r in two_ranks):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
        assert res["sums"] == [[3.0] * n for n in (1, 7, 3000)]  # 1 + 2 on every element, every tensor
        assert res["one_collective"]  # torch's coalescing manager, not one all-reduce per gradient
