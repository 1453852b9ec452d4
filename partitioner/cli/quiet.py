"""Importing TensorFlow without its native start-up lines on the terminal."""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["import_quietly"]


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
