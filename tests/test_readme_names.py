"""Every error and warning the README's error table lists is importable from `autotune` itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import autotune

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _error_table_names() -> list[str]:
    section = README.split("## Errors", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)`", section, flags=re.MULTILINE)


def test_the_readme_error_table_lists_the_four_kinds() -> None:
    assert _error_table_names() == ["InvalidSetting", "NoFeasiblePlan", "DeviceError", "CacheWarning"]


def test_every_name_in_the_readme_error_table_imports_from_autotune() -> None:
    missing = [name for name in _error_table_names() if name not in autotune.__all__ or not hasattr(autotune, name)]
    assert not missing, f"the README lists these but `autotune` does not export them: {missing}"


def test_a_corrupt_cache_warns_with_the_cache_warning_autotune_exports(tmp_path: Path) -> None:
    corrupt = tmp_path / "plans.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    with pytest.warns(autotune.CacheWarning):
        autotune.PlanCache(corrupt).list()
