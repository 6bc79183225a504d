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


def test_the_readme_error_table_lists_the_five_kinds() -> None:
    assert _error_table_names() == ["InvalidSetting", "NoFeasiblePlan", "DeviceError", "RankDied", "CacheWarning"]


def test_every_name_in_the_readme_error_table_imports_from_autotune() -> None:
    missing = [name for name in _error_table_names() if name not in autotune.__all__ or not hasattr(autotune, name)]
    assert not missing, f"the README lists these but `autotune` does not export them: {missing}"


def test_a_corrupt_cache_warns_with_the_cache_warning_autotune_exports(tmp_path: Path) -> None:
    corrupt = tmp_path / "plans.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    with pytest.warns(autotune.CacheWarning):
        autotune.PlanCache(corrupt).list()


def test_every_doc_is_linked_from_the_readme() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs"
    unlinked = sorted(p.name for p in docs.glob("*.md") if f"](docs/{p.name}" not in README)
    assert not unlinked, f"docs the README links nowhere: {unlinked}"


def test_the_readme_says_how_long_the_tests_take() -> None:
    after = README.split("<!-- test-command -->", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"about \d+ minutes", after) and '-m "not slow"' in after
