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
        raise UsageError(_message(f"{exc}")) from None
    chosen = keras.backend.backend()
    if chosen != "tensorflow":
        raise UsageError(_message(f"Keras runs on {chosen!r}"))


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
