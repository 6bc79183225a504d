"""The README's Python quick start runs as written: the block under its marker, extracted and run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- python-quickstart -->"


def quickstart_block() -> str:
    """The Python code block right after the quick start's marker in README.md."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, f"README.md lost the {MARKER} marker before its Python quick start"
    return text.split(MARKER, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_quick_start_block_defines_what_it_uses_and_links_the_runnable_example() -> None:
    block = quickstart_block()
    for name in ("model =", "example_batch =", "dataset =", "optimizer =", "autotune.fit("):
        assert name in block, f"the quick start uses {name.rstrip(' =(')} without defining it"
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start in Python", 1)[1].split(MARKER, 1)[0]
    assert "](examples/fit_gpt.py)" in section


@pytest.mark.slow  # seconds: starts processes that import torch
def test_the_readme_python_quick_start_runs_as_written_on_the_cpu(tmp_path: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_block())
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "AUTOTUNE_CACHE": str(tmp_path / "plans.db"),
           "AUTOTUNE_PROGRESS": "off"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "= 64;" in lines[0] and "of 2.00 GiB" in lines[0], done.stdout  # the summary, under the CPU budget
    assert lines[-1].startswith("trained 16 steps, last loss "), done.stdout
