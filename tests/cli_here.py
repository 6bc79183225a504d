"""`autotune run ARGS...` inside the test process, with the exit code and output a subprocess would give.

What the command writes through click, plus what its jobs write to the descriptors they inherit (read by
capfd). Not a subprocess of its own: that would import torch once more for the supervisor. The jobs it
launches are real processes, as in use; a test whose point is a signal to the supervisor starts one instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence

import pytest
from click.testing import CliRunner

from autotune.cli import main

RunHere = Callable[..., subprocess.CompletedProcess[str]]


def run_here(capfd: pytest.CaptureFixture[str], args: Sequence[str], *, env: dict[str, str],
             timeout: float) -> subprocess.CompletedProcess[str]:
    capfd.readouterr()
    # The run forwards a SIGTERM to its job and exits 143, so a hung job fails the test instead of holding it.
    deadline = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGTERM))
    deadline.start()
    try:
        result = CliRunner().invoke(main, ["run", *args], env=env, catch_exceptions=False)
    finally:
        deadline.cancel()
    inherited = capfd.readouterr()
    return subprocess.CompletedProcess(["autotune", "run", *args], result.exit_code,
                                      result.stdout + inherited.out, result.stderr + inherited.err)
