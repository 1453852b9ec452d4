"""Human-readable quantities for messages and reports (pure functions, no dependencies)."""

from __future__ import annotations

import re

__all__ = ["MAX_SIZE_BYTES", "format_bytes", "format_seconds", "parse_bytes"]

MAX_SIZE_BYTES = 1 << 60
"""The largest size :func:`parse_bytes` accepts: 1 EiB, far above any device's memory and well
inside the 64-bit integers the solvers keep memory in."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "eb": 10**18,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "eib": 2**60,
}


def format_bytes(num_bytes: int, *, exact: bool = False) -> str:
    """Bytes in binary units, e.g. ``'1.50 GiB'``; ``exact`` appends the count in bytes."""
    value = float(num_bytes)
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value /= 1024
        unit = bigger
    if unit == "B":
        return f"{num_bytes} B"
    text = f"{value:.2f} {unit}"
    return f"{text} ({num_bytes} B)" if exact else text


def format_seconds(seconds: float) -> str:
    """Seconds with a unit that keeps three or four significant digits."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def parse_bytes(text: str) -> int:
    """``'16GiB'`` -> 17179869184; ``'1.5GB'``, ``'512MiB'``, ``'2e9'`` work too.

    Raises ``ValueError`` with the accepted forms when ``text`` is not a positive size, and
    naming the limit when it is more than :data:`MAX_SIZE_BYTES` (``1e400`` is infinite).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size like 16GiB, 512MiB, 1.5GB or 2e9")
    digits = match.group(1)
    # exact where it is an integer (a float rounds past 2**53: 2**60 + 1 became 2**60)
    exact = digits.isdigit() and len(digits) <= 40
    number: float | int = (int(digits) if exact else float(digits)) * _UNITS[unit]
    if not number <= MAX_SIZE_BYTES:  # also inf
        raise ValueError(
            f"{text!r} is more than 1 EiB ({MAX_SIZE_BYTES} B), the largest size taken; give "
            "a device's memory such as 80GiB"
        )
    value = int(number)
    if value <= 0:
        what = "less than one byte" if number > 0 else "not a positive size"
        raise ValueError(f"{text!r} is {what}; give a size such as 16GiB or 512MiB")
    return value
