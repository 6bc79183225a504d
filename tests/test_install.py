"""Every install line a user is shown installs this project, or a package it names, never another project.

The name `autotune` on PyPI belongs to an unrelated project, and this one is not published: an install line
that names the project does so by path (`pip install -e ".[plot]"` in the checkout), with extras it has.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "torch-autotune-plan"
# A `pip install ...` command as the README, a docstring or an error message writes it: up to the end of the
# line, a backtick, a closing parenthesis or another shell command.
INSTALL = re.compile(r"pip install ([^`\n)&;#]+)")
# An option, a path or a requirement (name, extras, version): what may follow `pip install`.
REQUIREMENT = re.compile(r"-[-\w]*|[\w./\-]+(\[[\w,\-]+\])?([<>=!~]=?[\w.*+]+)?")


def _setup() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _install_lines() -> list[tuple[str, str]]:
    """(file, arguments) of every `pip install` in the README, the package and the examples."""
    files = [ROOT / "README.md", *sorted((ROOT / "autotune").rglob("*.py")), *sorted((ROOT / "examples").glob("*.py"))]
    return [(str(f.relative_to(ROOT)), m.group(1).strip()) for f in files for m in INSTALL.finditer(f.read_text())]


def _requirements(arguments: str) -> list[str]:
    """The requirements and paths of one command's arguments, up to the prose that follows them."""
    found = []
    for token in re.findall(r"\"[^\"]*\"|'[^']*'|\S+", arguments):
        word = token.strip("\"'")  # a quote may be the end of the string the command sits in
        sentence_goes_on = word != "." and word.endswith((",", ".", ":"))
        word = word.rstrip(",.:") if sentence_goes_on else word
        if not REQUIREMENT.fullmatch(word):
            break  # prose: "(what the 'plot' extra installs)"
        if not word.startswith("-"):
            found.append(word)
        if sentence_goes_on:
            break
    return found


def test_the_distribution_has_a_name_of_its_own_and_the_import_name_stays_autotune() -> None:
    config = _setup()
    assert config["metadata"]["name"] == DISTRIBUTION
    assert config["options.packages.find"]["include"].split(",")[0].strip() == "autotune"
    assert "autotune = autotune.cli:main" in config["options.entry_points"]["console_scripts"]


def test_every_install_line_names_this_project_by_path_with_extras_it_has() -> None:
    setup = _setup()
    extras = set(setup["options.extras_require"])
    listed = " ".join([setup["options"]["install_requires"], *setup["options.extras_require"].values()])
    # Packages the hints may name: this project's dependencies and extras' packages, and torch's compiler.
    known = {re.match(r"[\w.\-]+", r).group(0).lower() for r in listed.split()} | {"triton"}
    lines = _install_lines()
    assert len(lines) >= 6, lines  # the README's commands and extras, and the error messages' hints
    for where, arguments in lines:
        for requirement in _requirements(arguments):
            name = re.match(r"[A-Za-z0-9_.\-]*", requirement).group(0).lower().replace("_", "-")
            assert name not in ("autotune", DISTRIBUTION), (
                f"{where}: `pip install {arguments}` fetches a package from the index by this project's name; "
                "install the checkout by path instead (pip install -e \".[plot]\")")
            if requirement.startswith((".", "/")):
                wanted = set(re.findall(r"\[([^]]*)\]", requirement)[0].split(",")) if "[" in requirement else set()
                assert wanted <= extras, f"{where}: `pip install {arguments}` asks for extras {wanted - extras}"
            else:
                assert name in known, f"{where}: `pip install {arguments}` names {name}, which setup.cfg does not"


def test_numpy_is_a_dependency_so_torch_does_not_warn_on_the_first_run() -> None:
    """torch warns "Failed to initialize NumPy" whenever autotune imports torch.utils.checkpoint without it."""
    requires = _setup()["options"]["install_requires"].split()
    assert "numpy" in requires
