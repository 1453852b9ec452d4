"""The one error family of `partitioner`.

Every error a user can cause is a :class:`PartitionError`; the CLI prints its message on one line
and exits non-zero. Messages carry the offending value and the next step, and name an option as
the Python API spells it (``batch_size=32``, ``pipeline=True``, ``device_type='cpu'``); the CLI
rewrites those to its flags (``--batch-size 32``; ``partitioner.cli.main.FLAGS``).
"""

from __future__ import annotations


class PartitionError(Exception):
    """Base class of every error `partitioner` raises on purpose."""

    exit_code: int = 2


class InvalidGraphError(PartitionError):
    """The IR is malformed (a cycle, a duplicate id, an edge to an unknown op)."""


class ModelLoadError(PartitionError):
    """The model file could not be imported or holds no usable model."""


class TraceError(PartitionError):
    """The model could not be traced (unknown shapes, unsupported inputs)."""


class UnknownDeviceError(PartitionError):
    """A device type that the catalog does not know."""


class CatalogError(PartitionError):
    """The device catalog or a topology description is malformed."""


class InfeasibleError(PartitionError):
    """No placement satisfies the constraints (memory, device count)."""


class SolverError(PartitionError):
    """A solver failed or was asked for with bad options."""


class PlanError(PartitionError):
    """A plan file is corrupt, of another schema version, or made for another model."""


class RewriteError(PartitionError):
    """A plan could not be applied to a model."""


class OutputError(PartitionError):
    """An output file could not be written."""


class UsageError(PartitionError):
    """An option has a bad value (``gpus=0``, an unknown name)."""


def escape_control(text: str) -> str:
    """``text`` with every character that is not printable (control and format characters such
    as ESC or U+202E, lone surrogates, line breaks) written as its escape (``\\x1b``,
    ``\\u202e``), so that printing it can neither drive the terminal nor fail to encode nor span
    two lines. For names from models and plan files, and for error messages."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
