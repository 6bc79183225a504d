"""The `autotune` command line: a click group (`main.py`) and one module per command (run, cache, doctor).

Each command parses its options, makes one library call, and maps the library's errors to exit codes.
"""

from .main import main

__all__ = ["main"]
