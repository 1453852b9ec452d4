"""Which of the run's existing output files anything opened while the model's code ran.

The loader's audit hook (:func:`partitioner.cli.loader.recording_files_read`) sees the files
Python opens. TensorFlow reads through its own C++ file layer, which no audit hook sees:
``tf.io.gfile.GFile``, ``tf.io.read_file``, ``tf.data.TextLineDataset``, a ``StringLookup``'s
vocabulary file (campaign 34i: each replaced by ``--out`` or ``--report``, exit 0, the
vocabulary of the next build gone). The outputs are known before the model's code runs, so
:func:`watching_opens` asks the kernel (Linux inotify, ``inotify(7)``) to note every open of
each output that already exists, by any library or process, while inside. Where inotify is not
there (another OS, no watches left), it watches nothing and the audit hook is what remains.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import struct
from collections.abc import Iterable, Iterator

__all__ = ["watching_opens"]

_IN_ACCESS = 0x00000001
_IN_OPEN = 0x00000020
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")
"""``struct inotify_event``: wd, mask, cookie, len (then ``len`` bytes of name)."""


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1  # noqa: B018  (absent outside Linux)
    except (OSError, AttributeError):
        return None
    return libc


def _watches(libc: ctypes.CDLL, fd: int, paths: Iterable[str]) -> dict[int, str]:
    """A watch of opens and reads on each path that is an existing regular file."""
    watched: dict[int, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.isfile(real):
            continue
        wd = libc.inotify_add_watch(fd, os.fsencode(real), _IN_OPEN | _IN_ACCESS)
        if wd >= 0:
            watched[wd] = real
    return watched


def _opened(fd: int, watched: dict[int, str]) -> set[str]:
    """The watched paths with at least one event queued on ``fd``."""
    seen: set[str] = set()
    while True:
        try:
            data = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            return seen
        if not data:
            return seen
        at = 0
        while at + _EVENT.size <= len(data):
            wd, _mask, _cookie, length = _EVENT.unpack_from(data, at)
            if wd in watched:
                seen.add(watched[wd])
            at += _EVENT.size + length


@contextlib.contextmanager
def watching_opens(paths: Iterable[str], into: set[str]) -> Iterator[None]:
    """Add to ``into`` the real path of every file of ``paths`` (those that exist) that was
    opened or read while inside, by TensorFlow's C++ readers as by Python (module docstring)."""
    from partitioner.cli.quiet import descriptors_closed, kept_copy

    libc = _libc()
    made = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC) if libc is not None else -1
    if libc is None or made < 0:
        yield
        return
    fd = kept_copy(made)  # high: the model's code may close the low ones
    os.close(made)
    try:
        watched = _watches(libc, fd, paths)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        try:
            into.update(_opened(fd, watched))
        except OSError as exc:  # closed by the model's code: what it opened is unknown
            raise descriptors_closed(exc) from None
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
