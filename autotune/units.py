"""Sizes as people read them: the one formatter every message, reason and table uses.

A floor module (no imports from the package, no torch), so `plan.py` and the CLI can use it as cheaply as
the search: a budget of 40 MiB reads "40.0 MiB", never "0.04 GiB".
"""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """"12 KiB" below a MiB, "512.0 MiB" below a GiB, "23.50 GiB" from there."""
    if n < 2**20:
        return f"{n / 2**10:,.0f} KiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
