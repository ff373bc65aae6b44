"""Argument checks shared across the package: each raises `ValueError` naming the argument."""

from __future__ import annotations

import math


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    """Raises `ValueError` naming `name` unless `value` is an integer > 0 (or None if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")


def check_positive_number(name: str, value) -> None:
    """Raises `ValueError` naming `name` unless `value` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be a finite number > 0. Received: {name}={value!r}")


def check_fraction(name: str, value, allow_zero: bool = False) -> None:
    """Raises `ValueError` naming `name` unless `value` is in (0, 1] (or [0, 1])."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (0 <= value <= 1 if allow_zero else 0 < value <= 1)
    if not ok:
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"`{name}` must be a number in {interval}. Received: {name}={value!r}")
