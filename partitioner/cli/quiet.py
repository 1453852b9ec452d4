"""Importing TensorFlow without its native start-up lines on the terminal."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["HeldLines", "hold_native_lines", "import_quietly"]


def import_quietly(*modules: str) -> None:
    """Import ``modules`` (each imports TensorFlow) with file descriptor 2 pointed at
    ``/dev/null``: TensorFlow's native start-up lines go straight to it, so a command that
    fails on its arguments still answers with one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            for name in modules:
                importlib.import_module(name)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass
class HeldLines:
    """What :func:`hold_native_lines` does with the lines it held: shown when ``keep``."""

    keep: bool = False


@contextlib.contextmanager
def hold_native_lines() -> Iterator[HeldLines]:
    """Within the block, native code's lines to file descriptor 2 (gRPC's ``Failed to add port
    to server`` before TensorFlow raises) go to a temporary file; after it they are written to
    stderr if the caller set ``keep`` (the block succeeded), else dropped: a failure is said in
    the command's own one line."""
    held = HeldLines()
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield held
            finally:
                os.dup2(saved, 2)
                if held.keep:
                    sink.seek(0)
                    os.write(2, sink.read())
    finally:
        os.close(saved)
