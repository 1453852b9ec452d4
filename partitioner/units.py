"""Human-readable quantities for messages and reports (pure functions, no dependencies)."""

from __future__ import annotations

__all__ = ["format_bytes", "format_seconds"]


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
