"""Sizes and durations for messages, and --memory-limit parsing."""

from __future__ import annotations

import pytest

from partitioner.core.units import format_bytes, format_seconds, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("16GiB", 16 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("2e9", 2 * 10**9), ("100", 100)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "16XB", "GiB", "-1GiB", "0"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_format() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(2048, exact=True) == "2.00 KiB (2048 B)"
    assert format_seconds(2.5) == "2.500 s"
    assert format_seconds(0.0123) == "12.300 ms"
    assert format_seconds(5e-6) == "5.0 us"
