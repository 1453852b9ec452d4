"""Files: every file the library writes goes through :func:`write_atomic` (whole, or the old one
untouched)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from partitioner.core.errors import OutputError

__all__ = ["write_atomic"]


def _umask() -> int:
    """The process's umask (read from /proc where possible, so it is never changed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise OutputError(f"cannot write {target}: it is a directory; give a file path")
    if not directory.is_dir():
        raise OutputError(f"cannot write {target}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:
        # mkstemp makes the file 0600; give it the mode a plain open() would (or the mode of
        # the file it replaces).
        mode = target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~_umask()
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
