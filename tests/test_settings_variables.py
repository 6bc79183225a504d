"""Every `AUTOTUNE_*` variable is read in one place (`autotune.settings`) and listed in the README."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from autotune import settings

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autotune"
READERS = {PACKAGE / "settings.py"}
NAMED_BELOW = {PACKAGE / "devices" / "peaks.py"}  # names its variable below settings; settings reads it


def _environ_reads(tree: ast.AST) -> list[ast.Call | ast.Subscript]:
    """`os.environ.get(...)`, `os.getenv(...)` and `os.environ[...]` loads in a module."""
    found: list[ast.Call | ast.Subscript] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get"):
                found.append(node)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ast.unparse(node.value) in (
                "os.environ", "environ"):
            found.append(node)
    return found


def _names_a_variable(node: ast.Call | ast.Subscript) -> bool:
    arg = node.args[0] if isinstance(node, ast.Call) and node.args else getattr(node, "slice", None)
    if arg is None:
        return False
    text = ast.unparse(arg)
    return "AUTOTUNE_" in text or text.endswith("_ENV") or "ENV[" in text


def test_only_settings_reads_autotunes_variables() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in READERS:
            continue
        for node in _environ_reads(ast.parse(path.read_text())):
            if _names_a_variable(node):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "read AUTOTUNE_* variables through autotune.settings (read/switch):\n" + "\n".join(offenders)


def test_every_variable_named_in_the_package_is_one_settings_knows() -> None:
    named = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        named |= {m for m in re.findall(r"AUTOTUNE_[A-Z0-9_]+", path.read_text()) if not m.endswith("_")}
    assert named <= set(settings.VARIABLES), sorted(named - set(settings.VARIABLES))


def test_the_readme_lists_every_variable() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in settings.VARIABLES if f"`{name}`" not in readme]
    assert not missing, f"README.md does not list {missing}"


def test_read_refuses_a_name_settings_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.OFFLOAD_OVERLAP_ENV, " off ")
    assert settings.switch(settings.OFFLOAD_OVERLAP_ENV) is False
    monkeypatch.setenv(settings.OFFLOAD_OVERLAP_ENV, "")
    assert settings.switch(settings.OFFLOAD_OVERLAP_ENV) is True  # empty is unset: the default
    with pytest.raises(KeyError, match="AUTOTUNE_NOT_A_SETTING"):
        settings.read("AUTOTUNE_NOT_A_SETTING")
