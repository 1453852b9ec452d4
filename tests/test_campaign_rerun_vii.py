"""Issue 34, what the sixth rerun of the hostile-input campaign (34f) found still open: outputs
that hold binary data anywhere are never replaced, files the model's code reads are protected
as they were when read."""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.core.errors import OutputError
from partitioner.core.files import MAX_REPLACEABLE_BYTES, binary_offset, check_replaceable


@pytest.mark.parametrize(
    ("content", "offset"),
    [
        (b"#!/bin/sh\n" + b"echo text\n" * 1000 + b"\x00\x01payload", 10010),  # past 4 KiB (c61)
        (b"a" * (2**20 - 1) + "é".encode(), None),  # a character across a chunk boundary is text
        (b"a" * 5000 + b"\xff\xfe", 5000),
        (b"plain text\n", None),
        (b"ends inside a character \xc3", 24),
    ],
    ids=["binary-after-4KiB", "char-across-chunks", "invalid-utf8", "text", "cut-character"],
)
def test_binary_offset_reads_the_whole_file(
    content: bytes, offset: int | None, tmp_path: Path
) -> None:
    path = tmp_path / "f"
    path.write_bytes(content)
    assert binary_offset(path) == offset


def test_a_file_binary_only_past_its_first_4_kib_is_not_replaced(tmp_path: Path) -> None:
    """A 26 KB self-extracting installer (a shell script, then an archive) named as ``--out``
    was replaced: the guard read 4 KiB only (c61)."""
    installer = tmp_path / "installer.run"
    installer.write_bytes(b"#!/bin/sh\n" + b"# text\n" * 1000 + bytes(range(256)) * 80)
    with pytest.raises(OutputError, match=r"^--out installer.run exists and holds binary data"):
        check_replaceable(installer, "--out installer.run")
    text = tmp_path / "plan.json"
    text.write_text('{"a": 1}\n' * 10000)
    check_replaceable(text, "--out plan.json")  # a text file is replaced whole (row 46)
    check_replaceable(tmp_path / "new.json", "--out new.json")  # nothing there yet


def test_a_file_larger_than_anything_partitioner_writes_is_not_replaced(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_REPLACEABLE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(OutputError, match=r"is larger \(\d+ bytes\) than any file partitioner"):
        check_replaceable(big, "--report big.json")
