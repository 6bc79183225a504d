"""One size formatter everywhere: MiB below a GiB, and no module formats bytes by hand."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import autotune
from autotune.sizes import format_bytes, format_share

PACKAGE = Path(autotune.__file__).resolve().parent
# A share formatted to whole percents by hand, e.g. f"{fraction:.0%}": a share of 0.09% would read "0%".
HAND_MADE_SHARE = re.compile(r"\{[^}]*(fraction|share|smaller)[^}]*:\.0%\}")
# A byte count divided into GiB or MiB inside an f-string, e.g. f"{n / 2**30:.2f} GiB": the hand-made kind.
HAND_MADE = re.compile(r"/\s*(2\s*\*\*\s*(20|30)|GIB|MIB|1024\s*\*\*\s*[23])\s*:[^}]*}\s*(GiB|MiB)")


def test_sizes_read_mib_below_a_gib_and_gib_from_there() -> None:
    assert format_bytes(40 * 2**20) == "40.0 MiB"
    assert format_bytes(int(0.04 * 2**30)) == "41.0 MiB"
    assert format_bytes(24 * 2**30) == "24.00 GiB"
    assert format_bytes(3 * 2**10) == "3 KiB"


def test_no_module_formats_sizes_by_hand() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in PACKAGE.rglob("*.py") if path.name != "sizes.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if HAND_MADE.search(line)]
    assert not found, "format sizes with autotune.sizes.format_bytes:\n" + "\n".join(found)


def test_the_pattern_catches_the_hand_made_kind() -> None:
    assert HAND_MADE.search('f"peak {peak / 2**30:.2f} GiB is above"')
    assert not HAND_MADE.search('f"peak {format_bytes(peak)} is above"')


def test_a_small_plan_and_its_trials_speak_mib() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    plan = autotune.fit(model, torch.randn(8, 64), global_batch_size=8, device="cpu", memory_budget="8MiB",
                        cache=False, trial_steps=1, loss_fn=lambda m, b: m(b).square().mean())
    assert "MiB" in plan.summary() and "GiB" not in plan.summary(), plan.summary()
    assert "0.0" not in plan.summary().split("peak")[1]



def test_a_partial_share_never_reads_as_none_or_all() -> None:
    assert [format_share(f) for f in (0.0, 0.00004, 0.0009, 0.004, 0.37, 0.995, 0.99995, 1.0)] == [
        "0%", "<0.01%", "0.09%", "0.40%", "37%", "99.50%", ">99.99%", "100%"]


def test_a_plan_with_a_tiny_host_share_says_how_small() -> None:
    plan = autotune.Plan.of(precision="bf16", offload="optimizer", offload_fraction=0.0009, micro_batch_size=4,
                            accumulation_steps=2, world_size=1, global_batch_size=8, last_micro_batch_size=4,
                            peak_memory_bytes=2**20, memory_budget_bytes=2**21, margin=0.1, samples_per_second=1.0,
                            device="cpu")
    assert "optimizer offload of 0.09% of the parameters" in plan.summary(), plan.summary()


def test_no_module_formats_shares_by_hand() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in PACKAGE.rglob("*.py") if path.name != "sizes.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if HAND_MADE_SHARE.search(line)]
    assert not found, "format shares with autotune.sizes.format_share:\n" + "\n".join(found)
    assert HAND_MADE_SHARE.search('f"offload of {fraction:.0%} of the parameters"')
