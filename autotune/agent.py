"""The in-process side of `autotune run`: reporting the plan in force to the supervisor.

`report_plan` is a no-op unless the supervisor asked for a result file (AUTOTUNE_RESULT_FILE).
"""

from __future__ import annotations

import json
import os
import tempfile

from .plan import Plan

RESULT_FILE_ENV = "AUTOTUNE_RESULT_FILE"


def report_plan(plan: Plan) -> None:
    """Write `plan` atomically to $AUTOTUNE_RESULT_FILE, if set, so `autotune run` knows the plan in force."""
    path = os.environ.get(RESULT_FILE_ENV)
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".plan-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"plan": plan.to_dict()}, f)
    os.replace(tmp, path)
