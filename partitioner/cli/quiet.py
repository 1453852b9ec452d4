"""Importing TensorFlow without its native start-up lines on the terminal."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import resource
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from partitioner.core.errors import ModelLoadError

__all__ = ["HeldLines", "descriptors_closed", "hold_native_lines", "import_quietly", "kept_copy"]


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


def kept_copy(fd: int) -> int:
    """A copy of ``fd`` (not inheritable) at a high descriptor number, where the model's code
    closing the descriptors it was given (``os.closerange(3, 256)``, as daemonising code does)
    leaves it alone: the CLI's copies of stdout and stderr (which show its own lines while the
    model's code has fds 1 and 2 at /dev/null) and its record of the files the model read."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    floor = min(limit - 64, 4096)
    if floor > 256:
        with contextlib.suppress(OSError):
            return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
    return os.dup(fd)


def descriptors_closed(exc: OSError) -> ModelLoadError:
    """The error of a run whose kept descriptors (:func:`kept_copy`) the model's code closed
    all the same (``os.closerange`` past them): what it read is then unknown, so nothing is
    written."""
    return ModelLoadError(
        "the model's code closed file descriptors this run keeps open (as os.closerange does: "
        f"{exc.strerror or exc}), so the files it read are unknown and no output may replace "
        "them; nothing was written: close only the model's own files"
    )
