"""`fit(host_memory_budget=...)`: configurations whose host memory is over it are never run, the plan says
what it allocates on the host, and a plan tuned with more host room is not served where there is less.

The model's FP32 weights, gradients and AdamW state alone overflow the device limit, so only optimizer
offload can fit the device; its host need (masters, gradients, moments, fit's copy of the model) decides.
"""

from __future__ import annotations

import logging

import psutil
import pytest
import torch
from gpt import GPT, GPTConfig, random_batch

import autotune
from autotune.configuration import Rung
from autotune.devices import ceiling
from autotune.search import host_budget
from autotune.search.floors import resident_floor
from autotune.techniques.host_need import model_bytes
from autotune.workload.optimizers import OptimizerSpec

CFG = GPTConfig(vocab_size=128, n_layer=4, n_embd=64, n_head=4, seq_len=64)
OFFLOAD = Rung(checkpointing="full", offload="optimizer")


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(CFG), random_batch(CFG, 4)


def _fit(model, batch, **kw):
    floor = resident_floor(Rung(), model, state_tensors=2)  # the device limit (90% of it) under the plain floor
    return autotune.fit(model, batch, global_batch_size=8, memory_budget=int(floor), device="cpu", trial_steps=1,
                        techniques=("bf16", "checkpointing", "offload"), **kw)


def _need(model, fraction: float = 1.0) -> int:
    return host_budget.need(OFFLOAD, model, OptimizerSpec.from_user(None, model), "cpu", fraction=fraction).total


def test_a_host_budget_under_offloads_least_share_names_the_host(gpt):
    model, batch = gpt
    least = _need(model, host_budget.MIN_HOST_SHARE)
    with pytest.raises(autotune.NoFeasiblePlan, match=r"nothing fits in host memory.*host budget of") as err:
        _fit(model, batch, host_memory_budget=least - 1, cache=False)
    assert "host_memory_budget" in str(err.value) and "--host-budget" in str(err.value)


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_a_host_budget_that_holds_offload_gives_a_plan_under_it(gpt, tmp_path):
    model, batch = gpt
    need = _need(model)
    cache = str(tmp_path / "plans.db")
    plan = _fit(model, batch, host_memory_budget=need + 2**20, cache=cache)
    assert plan.offload == "optimizer" and plan.source == "tuned"
    # what the plan allocates on the host, without fit's copy of the model: under the budget
    assert 0 < plan.host_peak_bytes <= need + 2**20
    assert " on the host" in plan.summary()
    again = _fit(model, batch, host_memory_budget=need + 2**20, cache=cache)
    assert again.source == "cache" and again.host_peak_bytes == plan.host_peak_bytes  # through the cache
    # A host with less room than the plan allocates: not served from the cache; tuned, at a smaller host share.
    smaller = _fit(model, batch, host_memory_budget=plan.host_peak_bytes - 1, cache=cache)
    assert smaller.source == "tuned" and smaller.host_peak_bytes <= plan.host_peak_bytes - 1
    assert smaller.offload_fraction is not None and smaller.offload_fraction < 1, smaller.reason


def test_the_host_is_in_the_cache_key_where_offload_may_spend_it(gpt):
    from autotune.cache.key import key_parts, plan_key
    from autotune.devices import host
    from autotune.devices.placement import resolve_device

    # (`fit` under another explicit host budget tunes again: the test above.)
    model, batch = gpt
    common = dict(model=model, batch=batch, global_batch_size=8, world_size=1, placement=resolve_device("cpu"),
                  budget_bytes=2**30, margin=0.1)
    offload = key_parts(techniques=frozenset({"bf16", "offload"}), **common)
    assert offload["host"] == {"total_gib": host.total_bytes() // 2**30, "budget_bytes": None}
    assert host.total_bytes() <= psutil.virtual_memory().total
    # Without offload the host does not change the plan, and a plan serves every host.
    plain = key_parts(techniques=frozenset({"bf16"}), **common)
    assert plain["host"] is None
    bigger = key_parts(techniques=frozenset({"bf16", "offload"}), host_budget_bytes=2**34, **common)
    assert plan_key(bigger) != plan_key(offload)


def test_rungs_over_the_host_budget_are_skipped_with_both_figures(gpt):
    model, batch = gpt
    need = _need(model)
    plain = host_budget.need(Rung(), model, OptimizerSpec.from_user(None, model), "cpu").total
    assert plain < need  # without offload the host holds only fit's copy of the model
    spec = OptimizerSpec.from_user(None, model)
    least = _need(model, host_budget.MIN_HOST_SHARE)
    rungs, notes, shares = host_budget.keep_within([Rung(), OFFLOAD], model, spec, "cpu", least - 1)
    assert rungs == [Rung()] and shares == {}
    assert "bf16+full ckpt+optimizer offload skipped: host memory" in notes[0] and "over the host budget" in notes[0]
    # Just under the whole optimizer's need: kept, at the largest host share that fits.
    rungs, notes, shares = host_budget.keep_within([Rung(), OFFLOAD], model, spec, "cpu", need - 1)
    assert rungs == [Rung(), OFFLOAD] and 0.9 < shares[OFFLOAD] < 1
    assert _need(model, shares[OFFLOAD]) <= need - 1
    assert "at a host share of" in notes[0] and "over the host budget" in notes[0]
    # fit's copy of the model in a file (a large model on a GPU): the same budget holds the whole optimizer
    on_disk = host_budget.need(OFFLOAD, model, spec, "cpu", snapshot=False).total
    assert on_disk == need - model_bytes(model)
    rungs, notes, shares = host_budget.keep_within([Rung(), OFFLOAD], model, spec, "cpu", need - 1, snapshot=False)
    assert rungs == [Rung(), OFFLOAD] and shares == {} and notes == []


def test_a_host_budget_under_the_whole_optimizer_splits_it_between_host_and_device(gpt):
    # The 8B case in small: the state fits neither the device (its limit is under the plain floor) nor the
    # host alone; the plan keeps as much on the host as the host budget holds and steps the rest on the device.
    model, batch = gpt
    full, least = _need(model), _need(model, host_budget.MIN_HOST_SHARE)
    budget = (full + least) // 2
    with ceiling.host_ledger() as ledger:
        plan = _fit(model, batch, host_memory_budget=budget, cache=False)
    assert plan.offload == "optimizer" and plan.offload_fraction is not None, plan.reason
    assert host_budget.MIN_HOST_SHARE <= plan.offload_fraction < 1, plan.reason
    assert plan.host_peak_bytes <= budget
    # No trial allocated past it on the host: the simulated ceiling's host ledger (counted as device bytes are,
    # on the worker thread of the overlapped step too), beside fit's copy of the model, which the budget holds.
    counted = ledger.peak_bytes
    assert 0.9 * plan.host_peak_bytes <= counted and counted + model_bytes(model) <= budget, (counted, budget)
    assert "at a host share of" in plan.reason
    # Every trial of optimizer offload ran at that share, never at the whole optimizer the host cannot hold.
    offloaded = [t for t in plan.trials if t.rung.offload == "optimizer"]
    assert offloaded and all("offload fraction" in t.note for t in offloaded), [t.note for t in offloaded]


def test_a_bad_host_budget_is_refused_naming_the_setting(gpt):
    model, batch = gpt
    for bad in ("lots", float("nan"), -5):
        with pytest.raises(autotune.InvalidSetting, match="host_memory_budget"):
            _fit(model, batch, host_memory_budget=bad, cache=False)


@pytest.mark.slow  # seconds: searches that run real trial steps
def test_apply_warns_when_the_host_has_less_free_than_the_plan_allocates(gpt, caplog):

    model, batch = gpt
    plan = _fit(model, batch, host_memory_budget=_need(model) + 2**20, cache=False)
    greedy = plan.with_evidence(host_peak_bytes=2**60)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        step = greedy.apply(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step.close()
    assert any("of host memory" in r.getMessage() and "available now" in r.getMessage() for r in caplog.records)


def test_autotune_run_passes_the_host_budget_to_the_job_and_refuses_a_bad_one(tmp_path):
    from click.testing import CliRunner

    from autotune.cli import main as cli
    from autotune.supervisor.runner import RunOptions, _cooperative_env

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    env = _cooperative_env(RunOptions(script=str(script), host_budget="96GiB"))
    assert env["AUTOTUNE_HOST_BUDGET"] == "96GiB"  # the job's fit reads it (FitSettings.resolve)
    result = CliRunner().invoke(cli, ["run", "--host-budget", "lots", str(script)])
    assert result.exit_code == 2 and "--host-budget" in result.output and "Traceback" not in result.output


@pytest.mark.slow  # `autotune run` and two launches of a torch job
def test_autotune_run_tells_a_host_memory_kill_and_restarts_with_a_smaller_host_budget(tmp_path):
    import os
    import re
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "scripts", "host_hog.py")
    env = {**os.environ, "AUTOTUNE_CACHE": "off"}
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--host-budget", "400MiB", "--max-restarts", "1",
                           script, "380"], capture_output=True, text=True, env=env, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out  # killed again after the restart: nothing fits
    assert "killed by SIGKILL while host memory was near exhausted" in out
    given = re.findall(r"host budget given: (\S+)", out)
    assert given[0] == "400MiB" and len(given) == 2
    from autotune.sizes import parse_bytes

    reached = parse_bytes(re.search(r"the job reached ([\d.]+ \w+) resident", out).group(1).replace(" ", ""))
    assert reached >= 380 * 2**20 and int(given[1]) < reached  # the restart's host budget: under what it reached
    assert "Traceback" not in out
