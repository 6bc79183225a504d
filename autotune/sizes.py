"""Byte sizes, read and written one way everywhere: `parse_bytes("24GiB")`, `format_bytes(n)`.

It sits on the floor of the package (beside `plan.py` and `errors.py`) so that every part, the plan's
summary included, prints sizes alike: "40.0 MiB" below a GiB, "23.50 GiB" from there, never "0.04 GiB".
Shares print alike too (`format_share`): a partial share never reads as "0%" or "100%".
Beside them, the lengths of what is printed: `brief` for a value in an error, `shorten` for a note.
"""

from __future__ import annotations

import re

from .errors import InvalidSetting

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}

# The largest size accepted (1 EiB): beyond any device, and still exact as a float and an int64.
MAX_BYTES = 2**60
# A string without a unit under this many bytes is refused: "40" is a budget whose unit was left out.
UNITLESS_MIN = 2**20
# A plain number under this many bytes is refused too: `memory_budget=40` is 40 GiB with its unit left out, and
# nothing trains in 64 KiB, while simulated ceilings of a few hundred KiB stay expressible as integers.
BARE_NUMBER_MIN = 2**16


def format_bytes(n: int | float) -> str:
    """"12 KiB" below a MiB, "512.0 MiB" below a GiB, "23.50 GiB" from there."""
    if n < 2**20:
        return f"{n / 2**10:,.0f} KiB"
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_share(fraction: float) -> str:
    """A share as a percentage, e.g. "37%": with two decimals within 1% of either end ("0.09%", "99.50%"),
    and "<0.01%" / ">99.99%" beyond, so a share strictly between 0 and 1 never prints as "0%" or "100%"."""
    if fraction <= 0 or fraction >= 1:
        return f"{fraction:.0%}"
    if fraction < 1e-4:
        return "<0.01%"
    if fraction > 1 - 1e-4:
        return ">99.99%"
    return f"{fraction:.0%}" if 0.01 <= fraction <= 0.99 else f"{fraction:.2%}"


def parse_bytes(value: int | float | str, setting: str = "memory_budget") -> int:
    """Bytes from an int or a string such as "24GiB", "16 GB", "512MiB" or "1.5g" (k/m/g/t are binary)."""
    if isinstance(value, bool):
        raise InvalidSetting(f"{setting} must be bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise InvalidSetting(f"{setting} must be positive, got {value!r}")
        if value < BARE_NUMBER_MIN:
            raise InvalidSetting(f"{setting}={value!r} is a number without a unit, so it reads as {value:g} bytes: "
                                 f"did you mean '{value:g}GiB'? Write a unit ('24GiB', '512MiB'); a plain number "
                                 f"is bytes and must be at least {BARE_NUMBER_MIN} (64 KiB).")
        return _bounded(value, value, setting)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if not match.group(2) and 0 < number < UNITLESS_MIN:
                raise InvalidSetting(f"{setting}={value!r} has no unit, so it reads as {number:g} bytes: did you "
                                     f"mean '{match.group(1).lstrip('+')}GiB'? Write a unit ('24GiB', '512MiB'), or "
                                     "bytes as an integer.")
            if number >= 1:
                return _bounded(number, value, setting)
            raise InvalidSetting(f"{setting}={value!r} is {'negative' if number < 0 else 'under one byte'}: "
                                 "a budget must be positive, e.g. '24GiB'.")
    raise InvalidSetting(
        f"{setting}={value!r} is not a size autotune understands; write bytes as an integer or a number "
        "with a unit, e.g. '24GiB', '16GB', '512MiB' or 25769803776.")


def _bounded(number: int | float, value: object, setting: str) -> int:
    """`number` as whole bytes, refused when it is NaN, infinite or larger than any memory (`MAX_BYTES`)."""
    if not number <= MAX_BYTES:  # NaN fails every comparison, so it lands here too
        raise InvalidSetting(f"{setting}={brief(value)} is not a memory size: at most 1 EiB ({MAX_BYTES} bytes); "
                             "pass the memory one GPU may use, e.g. '24GiB'.")
    return int(number)


def brief(value: object) -> str:
    """`repr(value)` cut to a readable length, for an error message; an integer too long to print is named by
    its magnitude (Python refuses to print one of more than 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:
        return f"{'-' if value < 0 else ''}about 2**{abs(value).bit_length() - 1}"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def shorten(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: cut at the last word boundary that fits, and marked with "..."."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 3]
    space = cut.rfind(" ")
    if space > limit // 2:  # a word boundary late enough to keep most of the text
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "..."
