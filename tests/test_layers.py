"""The package's shape, checked: its import floors, its module sizes, and code that speaks as a product.

FLOORS below is the one statement of the layering (CONTRIBUTING.md explains it): every module under
`autotune/` belongs to a part (its top-level module or folder), each part sits on a floor, and a module imports
only from its own floor or lower; no two parts and no two modules import each other in a circle. Every import
counts, those inside functions too (a lazy import is still a dependency); only imports under
`if TYPE_CHECKING:` are exempt, as they never run.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from subprocess_env import with_path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autotune"

# Bottom to top. `autotune` is the package's `__init__` (the public names, above everything); `plotting` and
# `__main__` serve the CLI; `step` is the training step's old import path.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "sizes", "validate", "torch_private"),
    ("devices", "workload"),
    ("settings",),
    ("configuration", "evidence"),
    ("parallel",),
    ("techniques",),
    ("training", "step"),
    ("plan",),
    ("cache", "search"),
    ("api",),
    ("supervisor",),
    ("cli", "plotting", "__main__"),
    ("autotune",),
)
# Parts on one floor that still must not import one another (importer, imported).
FORBIDDEN: tuple[tuple[str, str], ...] = (("search", "cache"),)

MAX_LINES = 400
# A module longer than MAX_LINES says why in its docstring, in a paragraph that starts "Long: ".
LONG_REASON = re.compile(r"^\s*Long: \S+(\s+\S+){2,}", re.MULTILINE)

FLOOR_OF = {part: level for level, parts in enumerate(FLOORS) for part in parts}


@dataclass(frozen=True)
class Import:
    """One import statement's target inside the package, with where it stands."""

    source: str  # the importing module, dotted ("autotune.plan")
    target: str  # the imported module, dotted
    path: Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "autotune"


def floor_name(part: str) -> str:
    level = FLOOR_OF[part]
    return f"floor {level} ({', '.join(FLOORS[level])})"


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under `node`, at any depth, except the branch under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if _type_checking_block(child):
            assert isinstance(child, ast.If)
            for other in child.orelse:
                yield from _import_nodes(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _known(dotted: str) -> str | None:
    """The longest prefix of `dotted` that is a module of the package."""
    pieces = dotted.split(".")
    while pieces:
        if ".".join(pieces) in MODULES:
            return ".".join(pieces)
        pieces.pop()
    return None


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from X import name`: the submodule X.name when there is one, else X itself; the package's
            # version is metadata every submodule already had its package load first, not a dependency.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
                       if not (base == "autotune" and a.name == "__version__")]
        for target in dict.fromkeys(targets):  # `from X import a, b` is one import of X
            known = _known(target)
            if known is not None and known != module:
                found.append(Import(module, known, path, node.lineno))
    return found


EDGES: list[Import] = [edge for module in MODULES for edge in imports_of(module)]


def _strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def _shortest_cycle(start: str, members: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest path start -> ... -> start inside one component (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for nxt in sorted(edges.get(node, set()) & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start]


def _cycles(key: Callable[[str], str]) -> list[str]:
    """Each circle among the nodes `key` maps modules to, as 'a -> b -> a' with the import behind each arrow."""
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], Import] = {}
    for edge in EDGES:
        a, b = key(edge.source), key(edge.target)
        if a != b:
            edges.setdefault(a, set()).add(b)
            where.setdefault((a, b), edge)
    messages = []
    for component in _strongly_connected(set(edges) | {b for bs in edges.values() for b in bs}, edges):
        shown: set[str] = set()
        for start in component:  # one shortest circle through each node not on a circle shown yet
            if start in shown:
                continue
            path = _shortest_cycle(start, set(component), edges)
            shown.update(path)
            steps = "; ".join(f"{where[a, b].where} ({a} imports {where[a, b].target})"
                              for a, b in zip(path, path[1:]))
            messages.append(f"{' -> '.join(path)}\n    {steps}")
    return messages


def test_every_part_has_a_floor() -> None:
    missing = sorted({part_of(m) for m in MODULES} - set(FLOOR_OF))
    assert not missing, f"parts with no floor in tests/test_layers.py FLOORS: {missing}; add each where it belongs"


def test_no_module_imports_from_a_higher_floor() -> None:
    upward = []
    for edge in EDGES:
        mine, theirs = part_of(edge.source), part_of(edge.target)
        if mine not in FLOOR_OF or theirs not in FLOOR_OF:
            continue  # test_every_part_has_a_floor names it
        if FLOOR_OF[theirs] > FLOOR_OF[mine] or (mine, theirs) in FORBIDDEN:
            rule = "a forbidden pair" if (mine, theirs) in FORBIDDEN else "a higher floor"
            upward.append(f"{edge.where}: {edge.source} ({mine}, {floor_name(mine)}) imports {edge.target} "
                          f"({theirs}, {floor_name(theirs)}): {rule}")
    assert not upward, "imports against the floors (a module imports only its own floor or lower):\n" + "\n".join(
        upward)


def test_no_circle_between_parts() -> None:
    circles = _cycles(part_of)
    assert not circles, "parts that import each other in a circle:\n" + "\n".join(circles)


def test_no_circle_between_modules() -> None:
    circles = _cycles(lambda module: module)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(circles)


def test_the_layering_check_sees_lazy_imports_and_skips_type_checking_ones() -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plan import Plan\n"
              "def f():\n    from .cache import store\n    import autotune.api\n")
    found = list(_import_nodes(ast.parse(source)))
    assert [getattr(n, "module", None) or n.names[0].name for n in found] == ["typing", "cache", "autotune.api"]


def test_no_module_over_the_line_limit_without_a_reason() -> None:
    long = []
    for path in MODULES.values():
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and not LONG_REASON.search(doc):
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, (f"modules over {MAX_LINES} lines: split each, or give its docstring a paragraph "
                      "'Long: <why it stays one module>':\n" + "\n".join(long))


# Development history that belongs to git and benchmarks/RESULTS.md, not to the code or the README: a numbered
# round, run or call used as a label ("in run 12", "call 2 fit"; a count such as "run 3 optimizer steps",
# "runs 3 trials" or "2 calls" is prose), a commit hash (7-12 lowercase hex characters with a digit and a
# letter), a date, a line number in a Markdown file, a Markdown file that is not in the repository, and an
# issue of the tracker by number (what a module does is said in the module; the tracker is not shipped).
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
HISTORY = {
    "an issue by number": ISSUE,
    "a numbered round, run or call": re.compile(
        r"\brounds? #?\d+\b|\b(?:run|call) #?\d+\b(?!\s+(?:[A-Za-z-]+\s+)?[A-Za-z-]+s\b)", re.IGNORECASE),
    "a commit hash": re.compile(r"(?<![#\w])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b"),
    "a date": re.compile(r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    "a line of a Markdown file": re.compile(r"\.md,? lines? \d+"),
}
MARKDOWN = re.compile(r"(?<![\w/.-])([\w/.-]+\.md)\b")
IN_REPOSITORY = {p.name for p in ROOT.rglob("*.md")
                 if not any(q.startswith(".") or q == "shared" for q in p.relative_to(ROOT).parts)}


def history_in(text: str) -> Iterator[tuple[int, str, str]]:
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY.items():
            for match in pattern.finditer(line):
                yield number, what, match.group(0)
        for name in MARKDOWN.findall(line):
            if Path(name).name not in IN_REPOSITORY:
                yield number, "a Markdown file the repository does not have", name


def test_no_development_history_in_the_package_or_the_readme() -> None:
    files = [*MODULES.values(), ROOT / "README.md"]
    found = [f"{path.relative_to(ROOT)}:{number}: {what}: {text!r}"
             for path in files for number, what, text in history_in(path.read_text())]
    assert not found, ("development history in code or README (say what and why; history lives in git and "
                       "benchmarks/RESULTS.md):\n" + "\n".join(found))


def test_no_issue_numbers_in_the_tests_benchmarks_or_docs() -> None:
    files = [p for folder in ("tests", "benchmarks", "docs", "examples") for p in (ROOT / folder).rglob("*")
             if p.suffix in {".py", ".sh", ".md"}]
    found = [f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}" for path in files
             for number, line in enumerate(path.read_text().splitlines(), 1) for match in ISSUE.finditer(line)
             if path.name != "test_layers.py"]
    assert not found, "say what a test or benchmark checks, not the tracker's number:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "measured in round 3", "as issue 16 found", "(issues 17, 21)",
    "in run 12 the step", "(call 1, a host share)", "see a8acd7b", "on 2026-11-27",
    "as NOTES.md says", "rounds 4-6", "benchmarks/RESULTS.md line 1367",
])
def test_the_history_check_finds(text: str) -> None:
    assert list(history_in(text))


@pytest.mark.parametrize("text", [
    "each trial runs 3 optimizer steps", "run 2 more steps", "2 calls to fit", "colour #1f77b4ff",
    "version 2.13.0", "rank 0 of 2", "25769803776 bytes", "float8_e4m3fn", "0x7fffffff", "a run that failed",
    "call it twice", "deadbeefcafe", "see README.md and benchmarks/RESULTS.md",
])
def test_the_history_check_leaves_prose_alone(text: str) -> None:
    assert not list(history_in(text))


@pytest.mark.slow  # seconds: starts processes that import torch
def test_starting_autotune_does_not_import_dtensors_module() -> None:
    """`torch.distributed.tensor` brings sympy and takes about half a second: `autotune run` and each trial it
    starts import autotune, and only FSDP2 needs that module (devices/shards.py asks without it)."""
    code = ("import sys, autotune, autotune.cli.main, autotune.supervisor.bootstrap; "
            "print('torch.distributed.tensor' in sys.modules, 'torch' in sys.modules)")
    env = with_path(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
