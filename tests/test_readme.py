"""The README stands on its own in a fresh clone: every file it points to is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Markdown links and images to local files, and backticked paths to Markdown or image files.
LINKS = re.compile(r"\]\(([^)#\s]+)[^)]*\)")
PATHS = re.compile(r"`([\w./-]+\.(?:md|png|svg|jsonl))`")


def test_every_local_file_the_readme_names_is_in_the_repository() -> None:
    named = {m for m in LINKS.findall(README) if "://" not in m} | set(PATHS.findall(README))
    missing = sorted(n for n in named if not (ROOT / n).exists() and not (ROOT / "benchmarks" / n).exists())
    assert not missing, f"README.md names files a clone does not have: {missing}"


def test_the_readme_never_points_outside_the_repository() -> None:
    assert "../" not in README and "/work/" not in README and "shared/" not in README


def test_the_w1_picture_and_mfu_in_the_readme_come_from_the_gpu_runs_record(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from autotune.cli.main import main

    record = ROOT / "benchmarks" / "data" / "lattice" / "w1.jsonl"
    first = record.read_text().splitlines()[0]
    plan = json.loads(first)["run"]["plan"]
    assert f"**MFU {plan['mfu']:.1%}**" in README and f"{plan['tokens_per_second']:,.0f} tokens/s" in README
    assert "](benchmarks/data/lattice/w1_search.png)" in README
    (tmp_path / "w1.jsonl").write_text(first + "\n")
    out = tmp_path / "w1.png"
    drawn = CliRunner().invoke(main, ["plot", "--plan", str(tmp_path / "w1.jsonl"), "-o", str(out)])
    assert drawn.exit_code == 0 and f"{len(plan['trials'])} trials" in drawn.output, drawn.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
