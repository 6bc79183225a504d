"""The environment a test hands a process it starts: the caller's, with `changes` applied and `folders` put on
PYTHONPATH ahead of the caller's own path, which is kept: where the dependencies were installed into a folder on
PYTHONPATH (`pip install --target`), a process started without it would not find them."""

from __future__ import annotations

import os
from collections.abc import Mapping


def with_path(*folders: object, base: Mapping[str, str] | None = None, **changes: str) -> dict[str, str]:
    """`base` (default: this process's environment) with `changes`, and PYTHONPATH `folders` then base's own."""
    env = dict(os.environ if base is None else base)
    path = os.pathsep.join(str(p) for p in (*folders, env.get("PYTHONPATH")) if p)
    return {**env, **changes, "PYTHONPATH": path}
