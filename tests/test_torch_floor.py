"""The torch range the package declares is the range tested, and the README states the same floor."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTED = (2, 11)  # the oldest torch a CI job runs (the GPU image's)


def _declared_floor() -> tuple[int, int]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirement = next(line.strip() for line in config["options"]["install_requires"].splitlines()
                       if line.strip().startswith("torch"))
    major, minor = re.fullmatch(r"torch>=(\d+)\.(\d+)", requirement).groups()
    return int(major), int(minor)


def test_the_declared_torch_floor_is_the_oldest_tested_version() -> None:
    assert _declared_floor() == TESTED


def test_the_readme_states_the_declared_floor() -> None:
    major, minor = _declared_floor()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"torch {major}.{minor} or later, the oldest version tested" in readme
