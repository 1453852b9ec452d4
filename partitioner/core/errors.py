"""The one error family of `partitioner`.

Every error a user can cause is a :class:`PartitionError`; the CLI prints its message on one line
and exits non-zero. Messages carry the offending value and the next step, and name an option as
the Python API spells it (``batch_size=32``, ``pipeline=True``, ``device_type='cpu'``); the CLI
rewrites those to its flags (``--batch-size 32``; ``partitioner.cli.main.FLAGS``).
"""

from __future__ import annotations

import re
from typing import TypeVar


class PartitionError(Exception):
    """Base class of every error `partitioner` raises on purpose.

    ``quoted`` holds the parts of the message quoted from the user's own code (Keras's message
    for a layer of the model): the command line spells the library's arguments as its flags
    everywhere else, never inside them (:func:`quoting`)."""

    exit_code: int = 2
    quoted: tuple[str, ...] = ()


_E = TypeVar("_E", bound=PartitionError)


def quoting(error: _E, *texts: str) -> _E:
    """``error`` with ``texts`` (parts of its message) marked as quoted from the user's code."""
    error.quoted = tuple(t for t in texts if t)
    return error


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


_KERAS_CALL_CONTEXT = re.compile(
    r"Exception encountered when calling (?P<call>[^\n]*?)\.?\n\s*(?:\x1b\[1m)?"
)
"""What Keras puts before a layer call's error message (then the message in bold)."""


MAX_MESSAGE_CHARS = 1000
"""The longest line an error of the user's code is reported with (a builder's
``ValueError('x' * 5_000_000)`` was one 5 MB line on stderr)."""


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or ``""`` when its ``__str__`` itself raises (the user's code may). A
    ``KeyError``'s message is its key's text, not the key's repr (``str(KeyError("a\nb"))`` is
    ``"'a\\nb'"``: Keras's wrapped message would lose its lines and show its escapes)."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    try:
        return str(exc)
    except Exception:  # an exception's own __str__ failing: report its type instead
        return ""


def _bounded(line: str) -> str:
    if len(line) <= MAX_MESSAGE_CHARS:
        return line
    return f"{line[:MAX_MESSAGE_CHARS]}... ({len(line) - MAX_MESSAGE_CHARS} more characters)"


def error_line(exc: BaseException, empty: str | None = None) -> str:
    """The first line of ``exc``'s message (at most :data:`MAX_MESSAGE_CHARS` of it), of
    Keras's own message where Keras wrapped it in the layer call's context ("Exception
    encountered when calling Dense.call()."), and of the error it wrapped when that is at hand
    (:func:`unwrapped`: Keras keeps only its first argument, an ``OSError``'s errno ``2``);
    ``empty`` (default: the exception's type) when there is none, or when the message cannot
    be made."""
    own = unwrapped(exc)
    text = message_of(own).strip()
    context = _KERAS_CALL_CONTEXT.match(text)
    if context is not None:
        text = text[context.end() :].split("\x1b[0m", 1)[0].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__ if empty is None else empty
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:  # "... Error encountered:" then the reason
        first = f"{first} {lines[1]}"
    return _bounded(first)


def unwrapped(exc: BaseException) -> BaseException:
    """The error Keras wrapped in a layer call's context ("Exception encountered when calling
    Dense.call()."), where it is at hand and says more: Keras's wrapper keeps only its first
    argument (an ``OSError``'s errno, ``2``) and is a ``RuntimeError`` where the error's class
    takes other arguments (``CalledProcessError``); else ``exc``."""
    inner = exc.__cause__ or exc.__context__
    if inner is None or _KERAS_CALL_CONTEXT.match(message_of(exc).strip()) is None:
        return exc
    if type(inner) is not type(exc) and type(exc) is not RuntimeError:
        return exc
    return inner if message_of(inner).strip() else exc


def keras_call(exc: BaseException) -> str | None:
    """The layer call Keras names in ``exc``'s context (``Reshape.call()``), or None."""
    context = _KERAS_CALL_CONTEXT.match(message_of(exc).strip())
    return None if context is None else context.group("call").strip()
