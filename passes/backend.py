"""Keras's backend: everything in ``passes`` traces and rewrites through TensorFlow, so Keras must
run on its TensorFlow backend.

Keras picks its backend when it is first imported: ``KERAS_BACKEND`` if set, else the
``"backend"`` of ``keras.json`` in ``$KERAS_HOME`` (default ``~/.keras``). Another backend
(``jax``, ``torch``, ``numpy``) fails at that import when its package is missing, and otherwise
makes every Keras layer call a backend ``partitioner`` cannot trace. :func:`check_keras_backend`
says which setting chose it, in one line, before anything else imports Keras. This module
imports Keras only inside that function, so it can report an import that fails.
"""

from __future__ import annotations

import importlib.machinery
import os

from partitioner.core.errors import UsageError
from partitioner.core.files import keras_config_file  # one home; the CLI reads it from here

__all__ = ["check_keras_backend", "keras_config_file"]


def check_keras_backend() -> None:
    """Import Keras; UsageError naming the setting that chose a backend other than TensorFlow
    (the environment variable or the config file), and what to set instead."""
    try:
        import keras
    except ImportError as exc:  # the chosen backend's package is not installed
        hiding, first = _hiding_file(), (str(exc).splitlines() or [""])[0][:120]
        if hiding is not None:  # an emitted or user file named like the package, first on the path
            raise UsageError(
                f"the file {hiding} hides the package of the same name that partitioner and the "
                f"model import ({first}): rename or move it"
            ) from None
        raise UsageError(_message(f"{exc}")) from None
    if not hasattr(keras, "__path__"):  # a module named keras, not the package
        raise UsageError(
            f"the file {getattr(keras, '__file__', None) or 'keras'} hides the package keras that "
            "partitioner and the model import: rename or move it"
        )
    chosen = keras.backend.backend()
    if chosen != "tensorflow":
        raise UsageError(_message(f"Keras runs on {chosen!r}"))


def _hiding_file() -> str | None:
    """The file found first on the import path for Keras, NumPy or TensorFlow when it is no
    package (a ``keras.py`` in the model's directory); None if they are packages."""
    for name in ("keras", "numpy", "tensorflow"):
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is not None and spec.origin and spec.submodule_search_locations is None:
            return spec.origin
    return None


def _message(detail: str) -> str:
    given = os.environ.get("KERAS_BACKEND")
    if given is not None:
        source = f"KERAS_BACKEND={given[:40]!r} selects another"
        fix = "unset KERAS_BACKEND or set KERAS_BACKEND=tensorflow"
    else:
        source = f"the \"backend\" of {keras_config_file()} selects another"
        fix = "set KERAS_BACKEND=tensorflow, or make that file's backend \"tensorflow\""
    return (
        f"partitioner traces through Keras's TensorFlow backend, and {source} ({detail[:120]}); "
        f"{fix}"
    )
