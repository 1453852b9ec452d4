"""Ctrl-C before the CLI is loaded: one line and status 130, never a traceback.

The ``partition`` script's first import is :mod:`partitioner.cli` (its ``main``), and ``python -m
partitioner`` runs ``partitioner/__main__.py``; both install :func:`interrupt_exits` from here
before the CLI's imports, which take a while (rich, jsonschema; a run then imports TensorFlow).
Only ``os``, ``signal`` (and ``functools``) are imported, so the window before it is Python's own start-up.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Any

INTERRUPTED_EARLY = "interrupted; nothing was written"
"""The line of a Ctrl-C before anything could be written."""

__all__ = ["INTERRUPTED_EARLY", "interrupt_exits", "is_console_script", "set_sigint"]


def set_sigint(handler: Any) -> None:
    """SIGINT handled by ``handler`` from now on, unless it is ignored (``SIG_IGN``: the shell
    starts a script's background jobs so, and Python leaves it so)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, handler)


def interrupt_exits(note: str) -> None:
    """From now on Ctrl-C (SIGINT) prints ``partition: NOTE`` and ends the process at once with
    status 130: for the moments no file is being written (start-up, the command line, the
    ending), where unwinding could only end in a traceback. A SIGINT ignored from the start
    stays ignored (:func:`set_sigint`)."""
    line = f"partition: {note}\n".encode()
    err = _stderr_fd()

    def exit_now(signum: int, frame: object) -> None:
        try:
            os.write(err, line)
        except OSError:
            pass
        os._exit(130)

    exit_now.ends_run = True  # type: ignore[attr-defined]  # files being written are undone
    set_sigint(exit_now)


@functools.cache
def _stderr_fd() -> int:
    """A copy of file descriptor 2 as the process started with it: the line of a Ctrl-C
    reaches the terminal while TensorFlow's start-up noise has fd 2 pointed at /dev/null."""
    try:
        return os.dup(2)
    except OSError:
        return 2


def is_console_script() -> bool:
    """Whether this process is the ``partition`` command: its console script, or ``python -m
    partitioner`` (whose ``__main__`` imports this package, and with it the CLI's slow imports,
    before it could install the handler itself), not a program importing the library, whose
    Ctrl-C stays its own."""
    path = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    command = os.path.join("partitioner", "__main__.py")
    return os.path.basename(path) == "partition" or path.endswith(os.sep + command)
