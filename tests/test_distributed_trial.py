"""A trial on replicated ranks prices the gradient all-reduce (gloo, CPU processes): the all-reduced step runs on
every rank or on none, so a rank whose trial ran out of memory leaves nobody waiting in it."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ranks import run_scenarios, spawn

WORLD = 2
MiB = 2**20


def _work(budget: int, *, wide: bool = False):
    """An embedding-heavy model (25.6 MB of gradients, little compute: its all-reduce stands well above a loaded
    machine's timing noise), or four equal layers (`wide`: the partition gives each rank half of the elements),
    as a trial's workload of 8 samples a rank."""
    import torch
    from torch import nn

    from autotune.devices.placement import resolve_device
    from autotune.search.trial import Workload
    from autotune.workload.optimizers import OptimizerSpec

    torch.manual_seed(0)
    if wide:
        model, batch = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]), torch.randn(8, 512)
    else:
        model, batch = nn.Sequential(nn.Embedding(200_000, 32), nn.Linear(32, 1)), torch.randint(0, 200_000, (8, 16))
    return Workload(model=model, batch=batch, loss_fn=lambda m, b: m(b).square().mean(),
                    spec=OptimizerSpec.from_user(None, model), placement=resolve_device("cpu"),
                    budget_bytes=budget, limit_bytes=int(0.9 * budget), per_rank=8, world_size=WORLD)


def _trial(rank: int, budget: int, rung=None, *, wide: bool = False, **kwargs) -> dict:
    """One trial of `_work`'s model on this rank's ceiling."""
    from autotune import parallel as distributed
    from autotune.configuration import Rung
    from autotune.search.trial import TrialRunner

    work = _work(budget, wide=wide)
    trial = TrialRunner(work, agree=distributed.agree_trial)(rung or Rung(precision="fp32"), 4, **kwargs)
    return {"trial": {**trial.to_dict(), "note": ""}, "note": trial.note,
            "params": sum(p.numel() for p in work.model.parameters())}


def _phase(rank: int) -> dict:
    """`fit`'s partitioned-state step (search/partitioned_state.py) after a BF16 search, with real trials."""
    from autotune import parallel as distributed
    from autotune.configuration import Rung
    from autotune.search.controller import AfterPick, Controller
    from autotune.search.partitioned_state import partitioned
    from autotune.search.trial import TrialRunner

    work = _work(512 * MiB, wide=True)
    runner = TrialRunner(work, agree=distributed.agree_trial)
    controller = Controller(runner, per_rank=8, limit_bytes=work.limit_bytes, world_size=WORLD)
    result = controller.search([Rung()])
    searched, pick = len(result.trials), result.picked()
    result.after = AfterPick(run=runner, work=work, sharded=False, allowed=frozenset({"bf16", "offload"}))
    best = partitioned(result).picked()
    return {"pick": pick.to_dict(), "searched": searched, "best": best.to_dict(), "fraction": result.fraction,
            "trials": [{**t.to_dict(), "note": ""} for t in result.trials], "notes": [t.note for t in result.trials],
            "last_note": result.notes[-1], "params": sum(p.numel() for p in work.model.parameters())}


def _counted(rank: int, oom_at: int | None = None, **kwargs) -> dict:
    """A trial that counts its forwards (1 warm-up, the measured steps, then the all-reduced steps); with `oom_at`,
    rank 1 runs out of memory in that forward. `kwargs` go to the trial runner."""
    import torch

    from autotune import parallel as distributed
    from autotune.configuration import Rung
    from autotune.search.trial import TrialRunner

    work = _work(512 * MiB)
    calls = {"n": 0}
    loss = work.loss_fn

    def counted(m, b):
        calls["n"] += 1
        if rank == 1 and calls["n"] == oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1)")
        return loss(m, b)

    work.loss_fn = counted
    trial = TrialRunner(work, agree=distributed.agree_trial)(Rung(precision="fp32"), 4, **kwargs)
    return {"trial": {**trial.to_dict(), "note": ""}, "note": trial.note, "forwards": calls["n"]}


def _both_ways(rank: int, oom_at: int | None = None) -> dict:
    """A trial that times the all-reduced step both ways (fit's `_reduce_timing`)."""
    from autotune.search import reduce_timing

    return _counted(rank, oom_at, reduce_pairs=reduce_timing.PAIRS)


def _scenario(name: str, rank: int, world: int) -> dict:
    if name == "roomy":
        return _trial(rank, 512 * MiB)
    if name == "both_ways":
        return _both_ways(rank)
    if name == "both_ways_short":  # rank 1 runs out of memory in its third all-reduced step (the second pair's)
        return _both_ways(rank, oom_at=1 + 3 + 3)
    if name == "counted":
        return _counted(rank)
    if name == "longer":  # 4x the measured steps (fit's partitioned-state phase): 4 readings of the all-reduce
        return _counted(rank, measured_steps=12)
    if name == "longer_short":  # rank 1 runs out of memory in the second of them
        return _counted(rank, oom_at=1 + 12 + 2, measured_steps=12)
    if name == "one_rank_short":  # rank 1 cannot hold the AdamW state: it runs out of memory in its warm-up step
        return _trial(rank, 512 * MiB if rank == 0 else 12 * MiB)
    from autotune.configuration import Rung

    if name == "bf16":
        return _trial(rank, 512 * MiB, Rung(), wide=True)
    if name == "partitioned":  # the optimizer state split over the ranks, as a plan names it
        return _trial(rank, 512 * MiB, Rung(), wide=True, sharding="optimizer_state")
    if name == "phase":
        return _phase(rank)
    raise ValueError(name)


SCENARIOS = ["roomy", "one_rank_short", "bf16", "partitioned", "phase", "both_ways", "both_ways_short", "counted",
             "longer", "longer_short"]


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    run_scenarios(rank, world, init_file, out_dir, SCENARIOS, _scenario)


@pytest.mark.slow  # two spawned ranks: about 20 s on a 2-core machine
def test_a_replicated_trial_prices_the_all_reduce_and_no_rank_waits_for_a_failed_one():
    results = spawn(_rank_main, WORLD, 240)
    for name in SCENARIOS:
        assert all(r[name]["ok"] for r in results), [r[name].get("error", "")[-2000:] for r in results]
    roomy = [r["roomy"]["trial"] for r in results]
    assert roomy[0] == roomy[1]  # one agreed trial on every rank
    assert roomy[0]["outcome"] == "ok" and roomy[0]["reduce_seconds"] > 0
    # A cost once per global step, charged with the optimizer's
    assert roomy[0]["optimizer_seconds"] >= roomy[0]["reduce_seconds"]
    short = [r["one_rank_short"]["trial"] for r in results]
    assert [t["outcome"] for t in short] == ["oom", "oom"] and all(t["reduce_seconds"] == 0 for t in short)

    # The optimizer state partitioned over the ranks (search/partitioned_state.py): replicated BF16 holds FP32
    # weights, gradients and AdamW's two moments on every rank (16 bytes a parameter); partitioned, 16-bit
    # weights and gradients and half the FP32 masters and moments (10 in backward; 12 in the step, with the
    # FP32 gradients of this rank's half): at least 4 bytes a parameter freed, agreed by both ranks.
    plain, split = ([r[name]["trial"] for r in results] for name in ("bf16", "partitioned"))
    assert plain[0] == plain[1] and split[0] == split[1]
    assert plain[0]["outcome"] == split[0]["outcome"] == "ok"
    assert plain[0]["peak_bytes"] - split[0]["peak_bytes"] >= 4 * results[0]["partitioned"]["params"], (plain, split)
    assert split[0]["sharding"] == "optimizer_state" and split[0]["rung"]["offload"] == "none", split[0]

    # fit's phase on real ranks: the pick partitioned first (the room it frees, measured), the pick again last
    # (as long), the same trials and decision on both ranks, and the plan partitioned only if that measured faster
    phase = [r["phase"] for r in results]
    assert phase[0]["trials"] == phase[1]["trials"] and phase[0]["best"]["sharding"] == phase[1]["best"]["sharding"]
    assert phase[0]["fraction"] is None  # no host share: the state partitioned is a sharding, not an offload
    first, last = phase[0]["trials"][phase[0]["searched"]], phase[0]["trials"][-1]
    pick = phase[0]["pick"]
    assert first["sharding"] == "optimizer_state" and first["rung"]["offload"] == "none"
    assert first["micro_batch_size"] == pick["micro_batch_size"]
    assert pick["peak_bytes"] - first["peak_bytes"] >= 4 * phase[0]["params"]
    assert (last["rung"], last["micro_batch_size"]) == (pick["rung"], pick["micro_batch_size"])
    assert phase[0]["last_note"].startswith("optimizer state partitioned over 2 ranks, none on the host (")
    kept = phase[0]["best"]["sharding"] == "optimizer_state"
    assert kept == phase[0]["last_note"].endswith(": kept")

    # The all-reduced step timed both ways (fit's `_reduce_timing`): one agreed trial with both costs, 4 + 2 x PAIRS
    # forwards on each rank; an OOM on one rank in the middle of them stops both, with no rank left in a collective
    both = [r["both_ways"] for r in results]
    assert both[0]["trial"] == both[1]["trial"] and both[0]["trial"]["outcome"] == "ok"
    assert both[0]["trial"]["reduce_seconds"] > 0 and both[0]["trial"]["reduce_after_seconds"] > 0, both
    assert [b["forwards"] for b in both] == [4 + 2 * 4] * 2
    assert "gradient all-reduce timed in buckets during backward and in one after it" in both[0]["note"]
    short = [r["both_ways_short"] for r in results]
    assert [s["trial"]["outcome"] for s in short] == ["oom", "oom"]
    assert [s["forwards"] for s in short] == [4 + 3] * 2  # rank 0 ran its third and stopped after the agreement
    assert all(s["trial"]["reduce_after_seconds"] == 0 for s in short)

    # A trial of 4x the measured steps reads the all-reduced step 4 times (one reading was noisy on the GPU), and
    # an OOM on one rank in the second stops both there
    longer = [r["longer"] for r in results]
    assert longer[0]["trial"] == longer[1]["trial"] and longer[0]["trial"]["outcome"] == "ok"
    assert longer[0]["trial"]["reduce_seconds"] > 0
    assert [x["forwards"] for x in longer] == [1 + 12 + 4] * 2
    assert [r["counted"]["forwards"] for r in results] == [1 + 3 + 1] * 2  # the search's own trials: one reading
    cut = [r["longer_short"] for r in results]
    assert [c["trial"]["outcome"] for c in cut] == ["oom", "oom"]
    assert [c["forwards"] for c in cut] == [1 + 12 + 2] * 2
