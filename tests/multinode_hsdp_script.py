"""One rank of a simulated job for tests/test_multinode_hsdp.py, started by torchrun: on two nodes of two ranks
(two torchrun invocations, `--nnodes 2`) it trains under hybrid sharding, checkpoints, resumes, and at last one
rank dies; on one node of two ranks it resumes the two-node checkpoint.

Modes (argv[1]):
- "two-nodes": scenario "exact" (one hybrid-sharded step equals the single-process float64 step on the whole
  global batch), "checkpoint" (saved with torch.distributed.checkpoint after SAVED_AT steps, trained on to
  STEPS; a new model loads it and trains on to STEPS), then "death" (rank 3 kills itself in fit's first forward;
  the others report what they raised).
- "one-node": scenario "resume-elsewhere" (the two-node checkpoint loaded under flat FSDP2 on two ranks of one
  node, trained on to STEPS; the two-node hybrid plan applied here, refused).

Each scenario writes OUT_DIR/<scenario>.rank<N>.json: {"ok": ..., ...} or the traceback.

Usage: torchrun ... multinode_hsdp_script.py MODE OUT_DIR
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

PER_RANK, LENGTH, STEPS, SAVED_AT = 4, 6, 4, 2
SHARES = 4  # the global batch is four ranks' shares, however many ranks train it


def main(mode: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # four ranks on two cores (tests/ranks.py says why)
    os.environ["AUTOTUNE_CACHE"] = "off"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    scenarios = {"two-nodes": (("exact", _exact), ("checkpoint", _checkpoint), ("death", _death)),
                 "one-node": (("resume-elsewhere", _resume_elsewhere),)}[mode]
    failed = False
    for name, run in scenarios:
        try:
            result = {"ok": True, **run(rank, dist.get_world_size(), out_dir)}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails or checks it
            failed = True
            result = {"ok": False, "error": traceback.format_exc(), "type": type(exc).__name__, "message": str(exc)}
        path = os.path.join(out_dir, f"{name}.rank{rank}.json")
        with open(path + ".part", "w") as f:
            json.dump(result, f)
        os.replace(path + ".part", path)
        if name != "death":
            dist.barrier()  # the next scenario starts together
        else:
            _wait_for_node(out_dir, name)
    sys.stdout.flush()
    # Past a death the group is broken: leave at once, with a failure torchrun reports (a success would wait in
    # torchrun's exit barrier for the dead rank's node).
    os._exit(1 if failed else 0)  # skip the interpreter's teardown, where gloo's threads can abort the process


def _wait_for_node(out_dir: str, name: str) -> None:
    """Past a death, wait (a while) for this node's other ranks to write theirs: torchrun stops every rank of a
    node once one of them exits with a failure, and the test reads every report of node 0."""
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    first = int(os.environ["GROUP_RANK"]) * local
    paths = [os.path.join(out_dir, f"{name}.rank{r}.json") for r in range(first, first + local)]
    deadline = time.monotonic() + 20
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)


def _plan(world: int, nodes: int, micro: int = 2):
    """fp32 on float64 weights, the global batch of SHARES shares in micro-batches of `micro`, sharded over
    `nodes` nodes: hybrid on two, flat FSDP2 on one."""
    from test_step import make_plan

    n = SHARES * PER_RANK
    per_rank = n // world
    return make_plan(micro, per_rank).with_config(world_size=world, global_batch_size=n,
                                                   sharding="hsdp" if nodes > 1 else "fsdp2", nodes=nodes)


def _shares(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step `step`'s global batch: the SHARES shares dealt out evenly over the ranks."""
    from test_step import seq_batch

    shares = [seq_batch(PER_RANK, LENGTH, seed=100 * step + s) for s in range(SHARES)]
    mine = shares[rank * SHARES // world:(rank + 1) * SHARES // world]
    return torch.cat([x for x, _ in mine]), torch.cat([y for _, y in mine])


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters, gathered from every rank's shard (a collective)."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _exact(rank: int, world: int, out_dir: str) -> dict:
    """One step of the hybrid plan through `plan.apply` equals one SGD step on the whole global batch in one
    process (float64): the loss and the updated weights to 1e-9."""
    from test_step import new_model, sgd

    model = new_model()
    want = copy.deepcopy(model)
    opt = sgd(want.parameters())
    shares = [_shares(r, SHARES, 0) for r in range(SHARES)]
    want_loss = sum(want(x, y) for x, y in shares) / SHARES  # equal shares: the mean of their means
    want_loss.backward()
    want_loss = want_loss.detach()
    opt.step()

    m = copy.deepcopy(model)
    step = _plan(world, nodes=2).apply(m, sgd(m.parameters()))
    mesh = next(p for p in m.parameters()).device_mesh
    loss = step(_shares(rank, world, 0))
    got = _full(m)
    for (name, p0), q in zip(model.named_parameters(), want.parameters()):
        p = got[name]
        assert (p - q).norm() <= 1e-9 * q.norm(), f"{name}: weights differ by {float((p - q).norm())}"
        assert ((p - p0) - (q - p0)).norm() <= 1e-9 * (q - p0).norm(), f"{name}: updates differ"
    assert abs(loss - float(want_loss)) <= 1e-9 * abs(float(want_loss)), (loss, float(want_loss))
    return {"loss": loss, "want_loss": float(want_loss), "mesh": list(mesh.shape),
            "mesh_dims": list(mesh.mesh_dim_names)}


def _train(rank: int, world: int, nodes: int, seed: int, start: int, checkpoint: str | None = None,
           save_at: int | None = None) -> dict[str, torch.Tensor]:
    """AdamW under the plan for `nodes` nodes from step `start` to STEPS (loading `checkpoint` first, saving
    one at `save_at`); the final whole weights."""
    import torch.distributed.checkpoint as dcp
    from test_step import adamw, new_model

    model = new_model(seed=seed)
    opt = adamw(model.parameters())
    step = _plan(world, nodes).apply(model, opt)
    if checkpoint is not None:
        state = _state(model, opt)
        dcp.load(state, checkpoint_id=checkpoint)
        _set_state(model, opt, state)
    for k in range(start, STEPS):
        if k == save_at:
            dcp.save(_state(model, opt), checkpoint_id=os.environ["CHECKPOINT"])
        step(_shares(rank, world, k))
    return _full(model)


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, opt)  # this rank's shards, as DTensors
    return {"model": model_state, "optimizer": optimizer_state}


def _set_state(model, opt, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _checkpoint(rank: int, world: int, out_dir: str) -> dict:
    """Saved on 2 x 2 with torch.distributed.checkpoint and resumed on 2 x 2 by a model that started elsewhere:
    bitwise the uninterrupted run."""
    os.environ["CHECKPOINT"] = os.path.join(out_dir, "hsdp-checkpoint")
    whole = _train(rank, world, nodes=2, seed=0, start=0, save_at=SAVED_AT)
    resumed = _train(rank, world, nodes=2, seed=1, start=SAVED_AT, checkpoint=os.environ["CHECKPOINT"])
    differ = [name for name in whole if not torch.equal(whole[name], resumed[name])]
    assert not differ, f"{len(differ)} of {len(whole)} tensors differ after resuming, e.g. {differ[:3]}"
    if rank == 0:
        torch.save(whole, os.path.join(out_dir, "whole.pt"))  # the yardstick for a resume on another topology
    return {"tensors": len(whole)}


def _resume_elsewhere(rank: int, world: int, out_dir: str) -> dict:
    """The 2 x 2 checkpoint resumed on one node of two ranks (flat FSDP2): torch reshards it; the result equals
    the uninterrupted two-node run to float64 rounding. The two-node hybrid plan itself is refused here."""
    from test_step import new_model

    want = torch.load(os.path.join(out_dir, "whole.pt"))
    got = _train(rank, world, nodes=1, seed=1, start=SAVED_AT, checkpoint=os.path.join(out_dir, "hsdp-checkpoint"))
    for name, q in want.items():
        assert (got[name] - q).norm() <= 1e-9 * q.norm(), f"{name}: differs by {float((got[name] - q).norm())}"
    refusal = ""
    try:
        _plan(world, nodes=2).apply(new_model(), None)
    except Exception as exc:  # noqa: BLE001 - checked by the test
        refusal = f"{type(exc).__name__}: {exc}"
    return {"refusal": refusal}


def _death(rank: int, world: int, out_dir: str) -> dict:
    """fit on every rank; the last rank (node 1, local rank 1) kills itself in fit's first forward."""
    from test_step import new_model, seq_batch

    import autotune

    model = new_model()
    if rank == world - 1:
        model.blocks[1].register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    autotune.fit(model, seq_batch(PER_RANK, LENGTH, seed=rank), global_batch_size=PER_RANK * world,
                 memory_budget="1GiB", device="cpu", cache=False, trial_steps=1, techniques=(), progress=False)
    return {}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
