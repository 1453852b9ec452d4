"""The command lines' parser: a bad command line is one line, for every ``partition`` command,
and help that cannot be printed says so."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line on one line (no usage block), pointing at
    ``--help``; status 2, as argparse's own."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """The help on stdout, flushed: a stdout that fails (``--help > /dev/full``) is one line
        and status 2, as ``partition show`` and ``devices`` say it (argparse ignored the failure
        and exited 0 with the help lost); a reader that closed the pipe (``--help | head -1``)
        took what it wanted."""
        if file is not None or sys.stdout is None:
            super().print_help(file)
            return
        try:
            sys.stdout.write(self.format_help())
            sys.stdout.flush()
        except BrokenPipeError:
            _drop_stdout()
        except (OSError, ValueError) as exc:
            reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            _drop_stdout()
            sys.stderr.write(f"{self.prog}: error: cannot print the help on stdout ({reason})\n")
            raise SystemExit(2) from None


def _drop_stdout() -> None:
    """Stdout's file descriptor at /dev/null, so the help it still holds goes nowhere instead
    of failing again when the interpreter exits."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
        sys.stdout.flush()
