"""`autotune plot` and `autotune run --plot`: a valid PNG of the search, the right marks on it, and a clean
failure (exit 4, the install command) where matplotlib is missing, shown in a process that really lacks it."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cache_samples import sample
from click.testing import CliRunner
from subprocess_env import with_path

from autotune.cache.store import PlanCache
from autotune.cli.main import main
from autotune.configuration import Rung
from autotune.evidence import Trial
from autotune.plan import Plan
from autotune.plotting import draw_search, search_figure

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def w1_like(mfu: float | None = 0.38) -> Plan:
    """A search shaped like W1's: bf16 runs out of memory at 4 and 8, full checkpointing fits 8, over the limit
    at 16."""
    bf16, full = Rung(), Rung(checkpointing="full")

    def trial(rung: Rung, micro: int, outcome: str, peak_gib: float, rate: float) -> Trial:
        return Trial(rung=rung, micro_batch_size=micro, outcome=outcome, peak_bytes=int(peak_gib * GIB), seconds=3.0,
                     samples_per_second=rate, note="" if outcome == "ok" else outcome)

    trials = (trial(bf16, 1, "ok", 12.0, 20.0), trial(bf16, 2, "ok", 16.5, 26.0), trial(bf16, 8, "oom", 0, 0.0),
              trial(bf16, 4, "oom", 23.9, 0.0), trial(full, 4, "ok", 14.0, 24.0), trial(full, 8, "ok", 18.6, 28.5),
              trial(full, 16, "over_budget", 22.5, 29.0))
    return Plan.of(precision="bf16", checkpointing="full", offload="none", micro_batch_size=8, accumulation_steps=8,
                world_size=1, global_batch_size=64, last_micro_batch_size=8, peak_memory_bytes=int(18.6 * GIB),
                memory_budget_bytes=24 * GIB, margin=0.1, samples_per_second=28.5, tokens_per_second=28.5 * 1024,
                device="cuda", device_name="NVIDIA H100 80GB HBM3", reason="synthetic", trials=trials,
                flops_per_sample=4.7e12 if mfu else None, mfu=mfu)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND", f"{path} is truncated"
    return struct.unpack(">II", data[16:24])


def plot(*args: str) -> object:
    return CliRunner().invoke(main, ["plot", *args], catch_exceptions=False)


def test_plot_writes_a_png_of_the_newest_cached_plan(tmp_path: Path) -> None:
    store = PlanCache(tmp_path / "plans.db")
    for i in range(2):
        store.put(*sample(i))
    out = tmp_path / "search.png"
    result = plot("--cache", str(tmp_path / "plans.db"), "--output", str(out))
    assert result.exit_code == 0, result.output
    width, height = png_size(out)
    assert width > 600 and height > 300
    assert "2 trials" in result.output and sample(1)[0].summary() in result.output  # sample(1) was put last


def test_plot_takes_a_key_prefix_and_says_when_nothing_matches(tmp_path: Path) -> None:
    store = PlanCache(tmp_path / "plans.db")
    first, parts = sample(0)
    store.put(first, parts)
    store.put(*sample(1))
    out = tmp_path / "first.png"
    assert plot("--cache", str(tmp_path / "plans.db"), first.key[:10], "-o", str(out)).exit_code == 0
    assert png_size(out)
    missing = plot("--cache", str(tmp_path / "plans.db"), "zzzz", "-o", str(tmp_path / "none.png"))
    assert missing.exit_code == 1 and "no readable cached plan with a key starting with 'zzzz'" in missing.output
    assert not (tmp_path / "none.png").exists()


def test_plot_reads_a_plan_from_run_json_or_a_benchmark_log(tmp_path: Path) -> None:
    plan = w1_like()
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))  # autotune run --json
    record = {"run": {"method": "autotune", "plan": plan.to_dict()}, "workload": {"model": "gpt2-large"}}
    (tmp_path / "w1.jsonl").write_text(json.dumps({"run": {"method": "grid"}}) + "\n" + json.dumps(record) + "\n")
    for source in ("plan.json", "w1.jsonl"):
        out = tmp_path / f"{source}.png"
        result = plot("--plan", str(tmp_path / source), "--title", "W1", "-o", str(out))
        assert result.exit_code == 0, result.output
        assert png_size(out) and "MFU 38.0%" in result.output
    (tmp_path / "empty.jsonl").write_text(json.dumps({"run": {"method": "grid"}}) + "\n")
    assert "no plan in" in plot("--plan", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "x.png")).output


def test_the_picture_marks_the_choice_the_ooms_and_the_limit() -> None:
    plan = w1_like()
    speed, memory = search_figure(plan).axes[:2]

    def points(ax: object, marker: str) -> set[tuple[float, float]]:
        return {(float(x), round(float(y), 2)) for line in ax.get_lines() if line.get_marker() == marker
                for x, y in zip(line.get_xdata(), line.get_ydata())}

    assert points(speed, "*") == {(8.0, round(28.5 * 1024, 2))}  # the chosen plan, in tokens/s
    assert points(memory, "*") == {(8.0, 18.6)}
    assert points(speed, "x") == {(4.0, 0.0), (8.0, 0.0)}  # OOMs measured no throughput
    assert points(memory, "x") == {(4.0, 23.9), (8.0, 24.0)}  # the peak seen, else the budget
    dashed = [line for line in memory.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and dashed[0].get_ydata()[0] == pytest.approx(24 * 0.9)  # budget less margin
    hollow = [line for line in speed.get_lines() if line.get_markerfacecolor() == "none"]
    assert [list(line.get_xdata()) for line in hollow] == [[16]]  # over the limit
    assert "MFU 38.0%" in search_figure(plan)._suptitle.get_text()


def test_offload_trials_draw_the_host_memory_they_raised() -> None:
    plan = w1_like()
    offload = Rung(checkpointing="full", offload="optimizer")
    host = tuple(Trial(rung=offload, micro_batch_size=m, outcome="ok", peak_bytes=10 * GIB, seconds=3.0,
                       samples_per_second=20.0 + m, host_peak_bytes=(30 + m) * GIB) for m in (8, 16))
    plan = plan.with_evidence(trials=plan.trials + host)
    memory = search_figure(plan).axes[1]
    squares = [line for line in memory.get_lines() if line.get_marker() == "s"]
    assert len(squares) == 1 and squares[0].get_linestyle() == ":"
    assert list(squares[0].get_xdata()) == [8, 16] and list(squares[0].get_ydata()) == [38.0, 46.0]
    assert memory.get_ylim()[1] >= 46.0  # the host line is inside the axes


def test_a_plan_without_trials_is_refused_with_a_reason(tmp_path: Path) -> None:
    bare = sample(0)[0].with_evidence(trials=())
    with pytest.raises(ValueError, match="no trials"):
        draw_search(bare, tmp_path / "x.png")


BLOCKER = textwrap.dedent("""
    import sys

    class NoMatplotlib:  # as if it were not installed: the import system finds no such module
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoMatplotlib())
    sys.argv = ["autotune", *sys.argv[1:]]
    from autotune.cli.main import main
    main()
""")


def without_matplotlib(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = with_path(ROOT, AUTOTUNE_CACHE=str(tmp_path / "plans.db"))
    return subprocess.run([sys.executable, "-c", BLOCKER, *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_without_matplotlib_plot_fails_cleanly_naming_the_extra(tmp_path: Path) -> None:
    PlanCache(tmp_path / "plans.db").put(*sample(0))
    done = without_matplotlib(tmp_path, "plot", "-o", "search.png")
    assert done.returncode == 4, done.stderr
    assert "pip install matplotlib" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "search.png").exists()


def test_without_matplotlib_run_plot_fails_before_running_anything(tmp_path: Path) -> None:
    script = tmp_path / "touch.py"
    script.write_text("open('ran', 'w').close()\n")
    done = without_matplotlib(tmp_path, "run", "--plot", "search.png", str(script))
    assert done.returncode == 4 and "pip install matplotlib" in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow  # seconds: starts processes that import torch
def test_run_plot_draws_the_search_after_tuning_and_json_keeps_stdout_for_the_plan(tmp_path: Path) -> None:
    """The zero-change script of test_runner, tuned under an 8 MiB ceiling and not trained (--tune-only)."""
    out = tmp_path / "search.png"
    env = with_path(ROOT, AUTOTUNE_CACHE=str(tmp_path / "plans.db"))
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--global-batch-size", "32", "--budget", "8MiB",
                           "--trial-steps", "2", "--json", "--tune-only", "--plot", str(out),
                           "--map", "micro_batch=--per_device_train_batch_size",
                           "--map", "accumulation=--gradient_accumulation_steps",
                           str(ROOT / "tests" / "scripts" / "zero_change_oom.py"), str(tmp_path / "final")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)  # the plan alone on stdout
    assert png_size(out) and f"({len(plan['evidence']['trials'])} trials) to {out}" in done.stderr
