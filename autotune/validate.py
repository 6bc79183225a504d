"""Checks the configuration records run on themselves: each raises `ValueError` naming the field at fault."""

from __future__ import annotations

import dataclasses
from typing import Any


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def check_non_negative_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")


def check_known_fields(kind: str, d: dict[str, Any], cls: type, local: tuple[str, ...] = ()) -> None:
    known = {f.name for f in dataclasses.fields(cls)} - set(local)  # a row never names a local field
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {kind} field(s): {', '.join(unknown)}")


def dict_field(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    return value
