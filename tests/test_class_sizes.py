"""The package's classes, counted: none over MAX_METHODS methods or MAX_ATTRIBUTES attributes without a reason.

A class's methods are the functions defined in its body and in the bodies of the classes of the package it
inherits from (mixins included), each name once. Its attributes are the instance attributes assigned as
`self.x = ...` anywhere in it or in those bases, and the annotated fields of the dataclasses among them, each
name once. A class over either limit says why it stays one class in its docstring, in a paragraph that starts
"Large: ", as a module over the line limit says why in a "Long: " paragraph (tests/test_layers.py). And no class
stands in for another class's method with a bare annotation or a `...` body: it inherits the method, or types
`self` by a Protocol of what it needs.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autotune"

MAX_METHODS = 25
MAX_ATTRIBUTES = 15
LARGE_REASON = re.compile(r"^\s*Large: \S+(\s+\S+){2,}", re.MULTILINE)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@dataclass(frozen=True)
class Defined:
    """One class of the package: where it stands and its definition."""

    module: str
    node: ast.ClassDef
    path: Path

    @property
    def name(self) -> str:
        return f"{self.module}.{self.node.name}"


def _classes(tree: ast.Module) -> Iterator[ast.ClassDef]:
    """Every class of a module, nested ones too (those inside functions as well)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            yield node


def _imported_names(module: str, path: Path, tree: ast.Module) -> dict[str, str]:
    """Each name the module imports from the package, as the dotted name it stands for."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base.split(".")[0] == "autotune":
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _load() -> tuple[dict[str, Defined], dict[str, dict[str, str]]]:
    classes: dict[str, Defined] = {}
    scopes: dict[str, dict[str, str]] = {}  # per module: a name there -> the dotted class it means
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        scope = _imported_names(module, path, tree)
        for node in _classes(tree):
            found = Defined(module, node, path)
            classes.setdefault(found.name, found)
            scope[node.name] = found.name
        scopes[module] = scope
    return classes, scopes


CLASSES, SCOPES = _load()


def _reexported(dotted: str) -> str | None:
    """`dotted` as a class of the package, following a package's re-export (`from .x import Name`) once or more."""
    seen: set[str] = set()
    while dotted not in CLASSES and dotted not in seen:
        seen.add(dotted)
        module, _, name = dotted.rpartition(".")
        if module not in SCOPES or name not in SCOPES[module]:
            return None
        dotted = SCOPES[module][name]
    return dotted if dotted in CLASSES else None


def bases_of(found: Defined) -> list[Defined]:
    """The classes of the package `found` inherits from, directly or not, itself first."""
    order: list[Defined] = []
    pending = [found]
    while pending:
        current = pending.pop(0)
        if any(current.name == done.name for done in order):
            continue
        order.append(current)
        for base in current.node.bases:
            if isinstance(base, ast.Subscript):  # Generic[T], SomeBase[int]
                base = base.value
            dotted: str | None = None
            if isinstance(base, ast.Name):
                dotted = SCOPES[current.module].get(base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                module = SCOPES[current.module].get(base.value.id)
                dotted = f"{module}.{base.attr}" if module else None
            resolved = _reexported(dotted) if dotted else None
            if resolved is not None:
                pending.append(CLASSES[resolved])
    return order


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Everything inside the class's body except nested classes (their `self` is another object)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            continue
        yield child
        yield from _own_nodes(child)


def _self_targets(target: ast.expr) -> Iterator[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _self_targets(element)
    elif isinstance(target, ast.Starred):
        yield from _self_targets(target.value)
    elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        yield target.attr


def own_methods(node: ast.ClassDef) -> set[str]:
    return {child.name for child in node.body if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))}


def own_attributes(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    if _is_dataclass(node):
        for child in node.body:
            if isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name) \
                    and "ClassVar" not in ast.unparse(child.annotation):
                names.add(child.target.id)
    for child in _own_nodes(node):
        if isinstance(child, ast.Assign):
            for target in child.targets:
                names.update(_self_targets(target))
        elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
            names.update(_self_targets(child.target))
    return names


def counts(found: Defined) -> tuple[int, int]:
    """(methods, attributes) of the class with those it inherits from the package, each name once."""
    lineage = bases_of(found)
    methods = set().union(*(own_methods(d.node) for d in lineage))
    attributes = set().union(*(own_attributes(d.node) for d in lineage))
    return len(methods), len(attributes)


def test_no_class_over_the_size_limits_without_a_reason() -> None:
    large = []
    for found in CLASSES.values():
        methods, attributes = counts(found)
        if methods <= MAX_METHODS and attributes <= MAX_ATTRIBUTES:
            continue
        if not LARGE_REASON.search(ast.get_docstring(found.node) or ""):
            large.append(f"{found.path.relative_to(ROOT)}:{found.node.lineno}: {found.name}: "
                         f"{methods} methods, {attributes} attributes")
    assert not large, (f"classes over {MAX_METHODS} methods or {MAX_ATTRIBUTES} attributes (counted with what "
                       "they inherit from the package): split each, or give its docstring a paragraph "
                       "'Large: <why it stays one class>':\n" + "\n".join(large))


SAMPLE = '''
from dataclasses import dataclass
from typing import ClassVar

class Mixin:
    def shared(self): self.mixed = 1
    def both(self): ...

class Whole(Mixin):
    def __init__(self):
        self.a, (self.b, *self.c) = 1, (2, 3)
        self.d: int = 4
        self.d += 1
        other.e = 5
    def both(self): ...
    @property
    def value(self): return self.a
    class Inner:
        def __init__(self): self.hidden = 0

@dataclass(frozen=True, kw_only=True)
class Record(Whole):
    x: int
    y: str = ""
    kind: ClassVar[str] = "record"
'''


def test_the_counts_take_bases_fields_and_self_assignments_once_each(tmp_path: Path) -> None:
    tree = ast.parse(SAMPLE)
    nodes = {node.name: node for node in _classes(tree)}
    scope = {name: f"autotune.sample.{name}" for name in nodes}
    found = {name: Defined("autotune.sample", node, tmp_path) for name, node in nodes.items()}
    CLASSES.update({f.name: f for f in found.values()})
    SCOPES["autotune.sample"] = scope
    try:
        assert [d.node.name for d in bases_of(found["Record"])] == ["Record", "Whole", "Mixin"]
        assert own_attributes(nodes["Whole"]) == {"a", "b", "c", "d"}
        assert counts(found["Whole"]) == (4, 5)  # shared, both, __init__, value; a, b, c, d, mixed
        assert counts(found["Record"]) == (4, 7)  # with its fields x and y, not the ClassVar
    finally:
        for f in found.values():
            CLASSES.pop(f.name)
        SCOPES.pop("autotune.sample")


@pytest.mark.parametrize(("doc", "passes"), [
    ("One thing.\n\nLarge: one field per setting, no behaviour to split.", True),
    ("One thing.\n\nLarge.", False),
    ("One thing, large: too many.", False),
])
def test_the_reason_is_a_paragraph_that_starts_large(doc: str, passes: bool) -> None:
    assert bool(LARGE_REASON.search(doc)) is passes


def test_the_counts_see_a_classs_mixins() -> None:
    """A class of the package whose methods live in its bases' files too: the count must include them."""
    mixed = [found for found in CLASSES.values() if len(bases_of(found)) > 1]
    assert mixed, "no class of the package inherits from another: the check below checks nothing"
    assert any(counts(found)[0] > len(own_methods(found.node)) for found in mixed)


def _is_record(node: ast.ClassDef) -> bool:
    """A dataclass, a Protocol, a NamedTuple or a TypedDict: its bare annotations are its fields."""
    bases = {ast.unparse(base).rpartition(".")[2].partition("[")[0] for base in node.bases}
    return _is_dataclass(node) or bool(bases & {"Protocol", "NamedTuple", "TypedDict"})


def _stub(node: ast.stmt) -> Iterator[str]:
    """The name `node` declares as a method without defining it: `name: Callable[...]`, or a `def` whose body is
    only `...` (an `@overload` or `@abstractmethod` is a declaration of its own, not a stand-in)."""
    if isinstance(node, ast.AnnAssign) and node.value is None and isinstance(node.target, ast.Name) \
            and ast.unparse(node.annotation).startswith(("Callable", "collections.abc.Callable")):
        yield node.target.id
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not any(
            ast.unparse(d).rpartition(".")[2] in {"overload", "abstractmethod"} for d in node.decorator_list):
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and body[0].value.value is Ellipsis:
            yield node.name


def test_no_annotation_stands_in_for_another_classs_method() -> None:
    """A part of a class that calls a method defined in another part inherits it or names what it needs in a
    Protocol; a bare `name: Callable[...]` in its body would only quiet the type checker."""
    stubs = [f"{found.path.relative_to(ROOT)}:{child.lineno}: {found.name}.{name}"
             for found in CLASSES.values() if not _is_record(found.node)
             for child in found.node.body for name in _stub(child)]
    assert not stubs, "annotation-only methods in a class body (inherit them, or type `self` by a Protocol):\n" + (
        "\n".join(stubs))


def test_the_stub_check_finds_stand_ins_and_leaves_declarations_alone() -> None:
    source = ("class Part:\n    f: Callable[[], int]\n    n: int\n    def g(self) -> int: ...\n"
              "    def h(self):\n        '''Said elsewhere.'''\n        ...\n"
              "    @overload\n    def k(self): ...\n    def defined(self): return 1\n")
    part = ast.parse(source).body[0]
    assert isinstance(part, ast.ClassDef)
    assert [name for child in part.body for name in _stub(child)] == ["f", "g", "h"]
