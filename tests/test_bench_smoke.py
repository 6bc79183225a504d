"""The peer benchmark end to end on the CPU (--smoke: tiny models under the simulated ceiling), and its
renderer on hand-made records: JSON lines in, a RESULTS.md section and a plot out."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

# The benchmarks run in this process, which has imported torch already (a process of their own spends seconds of
# CPU importing it again); bench_peers.py still starts a fresh process for each method and answer, as it is built to.
import bench_head_loss  # noqa: E402
import bench_lengths  # noqa: E402
import bench_moe  # noqa: E402
import bench_peers  # noqa: E402
import render  # noqa: E402
import workloads  # noqa: E402

from autotune.plan import Rung  # noqa: E402


def test_a_recorded_configuration_keeps_every_knob_the_plan_has() -> None:
    """The verification trains what was recorded: a record that kept only precision, checkpointing and offload
    trained W2's compiled plan without compile (and ran out of memory) and W3's 11 blocks as every other one."""
    rung = Rung(checkpointing="selective", checkpointed_blocks=11, offload="optimizer", compile=True)
    config = json.loads(json.dumps(workloads.config_of(rung, 7, 64, offload_fraction=0.89)))
    assert workloads.config_rung(config) == rung and config["offload_fraction"] == 0.89
    assert (config["accumulation_steps"], config["last_micro_batch_size"]) == (10, 1)
    eager = workloads.config_of(Rung(checkpointing="selective", checkpointed_blocks=11, offload="optimizer"), 7, 64,
                                0.89)
    assert render.config_key(config) != render.config_key(eager)
    assert render.config_key(config) != render.config_key(workloads.config_of(rung, 7, 64, offload_fraction=1.0))
    older = {"rung": {"precision": "bf16", "checkpointing": "full", "offload": "none"}, "micro_batch_size": 4}
    assert render.rung_name(older["rung"]) == "bf16+full ckpt" and render.config_key(older)[-1] == 4


@pytest.fixture
def no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks run without the $AUTOTUNE_* settings of the environment, as from a clean shell."""
    for name in [k for k in os.environ if k.startswith("AUTOTUNE_")]:
        monkeypatch.delenv(name)


def _bench(tmp_path, *args: str) -> list[dict]:
    """bench_peers.py's driver, in this process; it strips $AUTOTUNE_* from the processes it starts."""
    out = tmp_path / "peers.jsonl"
    assert bench_peers.main(["--smoke", "--workload", "W1", "--out", str(out), *args]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _render(tmp_path, *files: str) -> str:
    results = tmp_path / "RESULTS.md"
    assert render.main([*files, "--results", str(results), "--plot", str(tmp_path / "peers.png")]) == 0
    return results.read_text()


@pytest.mark.slow  # about a minute on a CPU: every trial is real, under the simulated ceiling
def test_autotune_and_grid_smoke_end_to_end(tmp_path):
    records = _bench(tmp_path, "--methods", "autotune-cold,grid", "--steps", "1", "--grid-micro", "8,16")
    tune = {r["method"]: r for r in records if r["kind"] == "tune"}
    assert set(tune) == {"autotune-cold", "grid"}, records
    assert not [r for r in records if r["kind"] == "error"], records
    fit, grid = tune["autotune-cold"], tune["grid"]
    assert fit["trials"] >= 1 and fit["config"]["micro_batch_size"] >= 1 and fit["tune_seconds"] > 0
    assert fit["source"] == "tuned"
    assert grid["complete"] and grid["config"] and {t["micro_batch_size"] for t in grid["grid"]} <= {8, 16}
    for r in records:  # one run, every record self-describing
        assert r["run_id"] == records[0]["run_id"] and r["device"].startswith("cpu") and r["smoke"]
        assert r["command"].startswith("python benchmarks/bench_peers.py --smoke")
    verified = [r for r in records if r["kind"] == "verify"]
    answers = {render.config_key(r["config"]) for r in tune.values()}
    assert {render.config_key(v["config"]) for v in verified} == answers  # each distinct answer once
    for v in verified:
        assert v["train"]["steps_requested"] == 1
        assert v["train"]["oom"] or v["train"]["steps_done"] == 1
        if not v["train"]["oom"]:  # the loss trained is recorded, and is a number (NaN once hid a broken plan)
            assert math.isfinite(v["train"]["loss_last"]), v["train"]

    (tmp_path / "RESULTS.md").write_text("# Results\n\nAnother section, left alone.\n")
    text = _render(tmp_path, str(tmp_path / "peers.jsonl"))
    assert text.startswith("# Results\n\nAnother section, left alone.\n")
    assert text.count(render.BEGIN) == 1 and text.count(render.END) == 1
    assert "| Method | Trials | OOMs tuning |" in text and "autotune, cold cache" in text
    assert "Where autotune is behind" in text and "peers.jsonl:1" in text
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "peers.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not (importlib.util.find_spec("accelerate") and importlib.util.find_spec("lightning")),
                    reason="needs accelerate and lightning (pip install accelerate lightning)")
def test_peers_smoke_trigger_their_own_oom_handling(tmp_path):
    records = _bench(tmp_path, "--methods", "accelerate,lightning-power", "--steps", "1")
    tune = {r["method"]: r for r in records if r["kind"] == "tune"}
    assert set(tune) == {"accelerate", "lightning-power"}, records
    acc, lit = tune["accelerate"], tune["lightning-power"]
    # Accelerate starts at 128 and shrinks x0.9 per OOM: the simulated ceiling must read as a CUDA OOM to it.
    assert acc["tries"][0]["micro_batch_size"] == 128 and acc["ooms"] >= 1
    assert [t["micro_batch_size"] for t in acc["tries"][:3]] == [128, 115, 103]
    # Lightning doubles from 2 until an OOM, then answers the last size that ran.
    assert [t["micro_batch_size"] for t in lit["tries"][:2]] == [2, 4] and lit["ooms"] == 1
    for r in (acc, lit):
        assert r["answer"] and workloads.config_rung(r["config"]) == Rung()
        assert r["config"]["micro_batch_size"] == min(r["answer"], r["spec"]["global_batch_size"])
    verified = {render.config_key(r["config"]) for r in tune.values()}
    assert len([r for r in records if r["kind"] == "verify"]) == len(verified)


# -- the renderer on hand-made records (fast) ---------------------------------------------------------
SPEC = {"name": "W1", "title": "test", "model": "m", "budget": "24GiB", "global_batch_size": 64, "seq": 1024,
        "image": 0, "unit": "tok/s", "per_sample": 1024, "trial_steps": 3}
BASE = {"run_id": "r", "command": "python benchmarks/bench_peers.py --workload W1", "smoke": False, "workload": "W1",
        "spec": SPEC, "device": "NVIDIA H200", "torch": "2.x", "cuda": "12", "versions": {}, "date": "2026-01-01"}


def _config(ckpt: str, offload: str, micro: int) -> dict:
    name = "+".join(["bf16"] + ([f"{ckpt} ckpt"] if ckpt != "none" else [])
                    + ([f"{offload} offload"] if offload != "none" else []))
    return {"rung": {"precision": "bf16", "checkpointing": ckpt, "offload": offload}, "name": name,
            "micro_batch_size": micro, "accumulation_steps": 64 // micro, "last_micro_batch_size": micro}


def _records() -> list[dict]:
    best, peer = _config("full", "optimizer", 16), _config("none", "none", 4)
    grid = [{"rung": best["rung"], "micro_batch_size": 16, "outcome": "ok", "samples_per_second": 26.0,
             "peak_bytes": 1}, {"rung": peer["rung"], "micro_batch_size": 4, "outcome": "oom",
                                "samples_per_second": 0.0, "peak_bytes": 1}]
    train = {"steps_requested": 100, "steps_done": 100, "oom": False, "oom_at_step": None, "error": "", "stopped": "",
             "median_step_seconds": 2.4, "samples_per_second": 26.0, "peak_bytes": 1}
    return [
        {**BASE, "kind": "tune", "method": "autotune-cold", "trials": 15, "ooms": 0, "tune_seconds": 36.0,
         "config": best, "source": "tuned"},
        {**BASE, "kind": "tune", "method": "accelerate", "trials": 27, "ooms": 26, "tune_seconds": 9.2, "config": peer,
         "answer": 4, "error": "", "tries": []},
        {**BASE, "kind": "tune", "method": "lightning-power", "trials": 2, "ooms": 2, "tune_seconds": 3.0,
         "config": None, "answer": None, "error": "ValueError: batch_size should be a positive integer value"},
        {**BASE, "kind": "tune", "method": "grid", "trials": 2, "ooms": 1, "tune_seconds": 100.0, "config": best,
         "grid": grid, "complete": True, "estimated_samples_per_second": 26.0},
        {**BASE, "kind": "verify", "config": best, "methods": ["autotune-cold", "grid"],
         "trial": {"outcome": "ok", "samples_per_second": 25.0}, "train": train},
        {**BASE, "kind": "verify", "config": peer, "methods": ["accelerate"], "trial": {"outcome": "oom",
         "samples_per_second": 0.0}, "train": {**train, "steps_done": 1, "oom": True, "oom_at_step": 1,
                                                "error": "OutOfMemoryError: CUDA out of memory.",
                                                "samples_per_second": 0.0}},
    ]


def test_render_says_plainly_where_autotune_is_behind(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    text = _render(tmp_path, str(path))
    section = text[text.index(render.BEGIN):]
    assert "Tuning time: autotune (cold) took 36.0 s, Accelerate 9.2 s [r.jsonl:1, r.jsonl:2]." in section
    assert "Trials: autotune (cold) ran 15, Lightning power (which then found no configuration) 2" in section
    assert "Trials: autotune (cold) ran 15, the grid 2" in section
    assert "OOMs while tuning" not in section  # autotune had none
    assert "26,624 | 1.00×" in section  # 26 samples/s x 1024 tokens, the grid's best itself
    assert "**no**: OOM in step 2 of 100" in section
    assert "none: gave up (ValueError: batch_size should be a positive integer value)" in section


def test_render_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Results\n\n{render.BEGIN}\nold\n{render.END}\n\n## Another section\n\nkept\n")
    text = _render(tmp_path, str(path))
    assert "\nold\n" not in text and text.endswith("## Another section\n\nkept\n")
    again = _render(tmp_path, str(path))
    assert again == text  # idempotent


@pytest.mark.slow  # seconds: a reference, a search and two steps under the simulated ceiling
@pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="bench_moe.py builds a transformers Mixtral")
def test_bench_moe_tiny_trains_a_split_plan_beside_its_reference(tmp_path, capsys, no_user_settings):
    assert bench_moe.main(["--device", "cpu", "--tiny", "--steps", "2", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    assert "autotune" in stdout and "reference" in stdout  # the table
    record = json.loads((tmp_path / "bench_moe.json").read_text())
    tuned, reference = record["autotune"], record["reference"]
    assert tuned["accumulation_steps"] >= 2 and record["budget_bytes"] < reference["peak_bytes"]
    assert len(tuned["losses"]) == len(reference["losses"]) == 2 and not tuned["recoveries"]
    for a, r in zip(tuned["losses"], reference["losses"]):
        assert math.isclose(a, r, rel_tol=1e-3), (tuned["losses"], reference["losses"])
    assert record["model"]["experts"] == 8 and record["model"]["top_k"] == 2
    assert record["host"]["rss_bytes"] > 0 and "Mem:" in record["host"]["free_g"]
    assert "micro-batch" in tuned["plan"] and tuned["plan_record"]["config"]


def test_one_length_batches_are_unpadded_and_unmasked_with_lengths_drawn_batch_by_batch() -> None:
    data = bench_lengths.batches(12, 4, 8, 32, 50, "cpu", one_length=True)
    lengths = {b["input_ids"].shape[1] for b in data}
    assert len(lengths) > 1 and all(8 <= n <= 32 for n in lengths)
    assert all(set(b) == {"input_ids", "labels"} and b["labels"].equal(b["input_ids"]) for b in data)


def test_bench_head_loss_times_the_padded_and_unpadded_head_to_the_same_loss(capsys) -> None:
    rows = bench_head_loss.main(["--device", "cpu", "--vocab", "101", "--hidden", "16", "--tokens", "40",
                                 "--repeats", "1"])
    assert [r["variant"] for r in rows] == ["chunked, vocabulary padded to 64", "chunked, unpadded",
                                            "unchunked (the model's own)"]
    assert all(r["ms"] > 0 for r in rows)
    assert max(r["loss"] for r in rows) - min(r["loss"] for r in rows) < 1e-2  # bf16 autocast: one loss
    assert len(capsys.readouterr().out.splitlines()) == 3


def _lengths_row(tmp_path, budget: str, *more: str) -> dict:
    """bench_lengths' CPU dry run (a tiny GPT, lengths 8-32, global batch 8) under `budget`, with `more`
    arguments: the JSON row it appends."""
    out = tmp_path / "lengths.jsonl"
    bench_lengths.main(["--model", "tiny-gpt", "--device", "cpu", "--budget", budget, "--min-length", "8",
                        "--max-length", "32", "--global-batch-size", "8", *more, "--out", str(out)])
    return json.loads(out.read_text().splitlines()[-1])


@pytest.mark.slow  # seconds: a search and four steps under the simulated ceiling
def test_bench_lengths_dry_run_trains_padded_batches_of_every_length(tmp_path, no_user_settings):
    row = _lengths_row(tmp_path, "64MiB", "--steps", "4")
    assert row["lengths"] == [8, 32] and 8 <= row["mean_length"] <= 32
    assert row["recoveries"] == 0 and row["trained_tokens_per_s"] > 0 and row["estimate_tokens_per_s"] > 0


@pytest.mark.slow  # seconds: a search and four steps of 8 micro-steps under the simulated ceiling
def test_bench_lengths_splits_each_step_into_its_micro_steps(tmp_path, no_user_settings):
    row = _lengths_row(tmp_path, "1280KiB", "--steps", "4")
    accumulation = int(re.search(r"x (\d+) accumulation", row["plan"]).group(1))
    assert accumulation > 1, row["plan"]  # the budget leaves no micro-batch of the whole batch
    assert len(row["micro_step_seconds"]) == len(row["last_micro_step_seconds"]) == 4
    for before, last, whole in zip(row["micro_step_seconds"], row["last_micro_step_seconds"], row["step_seconds"]):
        assert len(before) == accumulation - 1 and min(before) > 0 and last > 0
        assert sum(before) + last <= whole * 1.01  # within the step's wall time


@pytest.mark.slow  # seconds: a search, the typical-length trial and five steps under the simulated ceiling
def test_bench_lengths_trains_a_length_plan_in_its_order(tmp_path, no_user_settings):
    row = _lengths_row(tmp_path, "64MiB", "--one-length", "--example", "typical", "--length-plan", "20x2,32x1,12x2")
    assert row["steps"] == 5 and row["padded_lengths"] == [20, 20, 32, 12, 12]  # unpadded on the CPU
    assert len(row["step_seconds"]) == len(row["last_micro_step_seconds"]) == 5
    with pytest.raises(SystemExit):  # a plan of one-length batches only
        bench_lengths.main(["--device", "cpu", "--length-plan", "20x2", "--out", str(tmp_path / "refused.jsonl")])


@pytest.mark.slow  # seconds: a search, the typical-length trial and four steps under the simulated ceiling
def test_bench_lengths_one_length_with_a_typical_example_estimates_at_the_middle_length(tmp_path, no_user_settings):
    row = _lengths_row(tmp_path, "64MiB", "--steps", "4", "--one-length", "--example", "typical")
    assert row["one_length"] and row["example"] == "typical"
    assert row["estimate_at_length"] == 20  # the middle of 8-32: the trials ran at 32, the estimate is at 20
    assert "figures at the example's length, 20 tokens" in row["reason"]  # said, however many notes come before
    assert row["recoveries"] == 0 and row["trained_tokens_per_s"] > 0
    assert row["failed_trials"] == []  # no configuration lost to an error
