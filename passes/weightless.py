"""Models whose weights do not exist yet: build, trace and later materialise them.

Planning needs a model's shapes, FLOPs and op graph, never its weight values. A 7 B-parameter
decoder needs 28 GB for its float32 weights alone, more than the planning machine may have.
Keras 3 defers a variable's initialisation while a ``keras.StatelessScope`` is active: the
variable records its shape, dtype and initializer, and holds no value
(``StatelessScope(initialize_variables=False)`` keeps it that way when the scope exits).
:func:`without_weights` is that scope. A model built inside it is *weightless*:

- :mod:`passes.trace` traces its training step as a function of its variables (each a
  ``tf.TensorSpec`` argument of the ``tf.function``; the forward runs inside a
  ``StatelessScope`` that maps every variable to its argument), so the concrete function is
  built and never run and no weight is ever allocated;
- :func:`materialize` creates the values later, each variable under the device its layer is
  placed on (``device_of``), so weights are born on their devices, never first on one host
  device and copied. ``plan.apply(model)`` calls it.

A layer that needs real weight values while it is built (it assigns to a variable in ``build``
and reads the result) cannot be built without weights: :func:`build_without_weights` names the
layer in its error so the caller can fall back to an ordinary build.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import keras

from partitioner.core.errors import TraceError

__all__ = [
    "WeightlessBuildError",
    "build_without_weights",
    "deferred_variables",
    "is_weightless",
    "materialize",
    "variable_owners",
    "without_weights",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WeightlessBuildError(TraceError):
    """A model could not be built without its weights (see :func:`build_without_weights`)."""

    def __init__(self, message: str, layer: str | None) -> None:
        super().__init__(message)
        self.layer = layer
        """The name of the layer whose build failed, when known."""


@contextlib.contextmanager
def without_weights() -> Iterator[None]:
    """Build Keras models inside this block without allocating their weights::

        with partitioner.without_weights():
            model = build_llama_7b()
        plan = partitioner.partition(model, gpus=8, device_type="a100-80gb")
        model = plan.apply(model)  # weights created now, each on its layer's device

    Variables created inside keep their shape, dtype and initializer and hold no value until
    :func:`materialize` (or ``plan.apply``) creates them.
    """
    with keras.StatelessScope(initialize_variables=False) as scope:
        yield
    if scope.state_mapping:  # a build assigned to a variable: the value would be lost
        paths = [
            str(getattr(v, "path", v.name)) for v in _pending() if id(v) in scope.state_mapping
        ]
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise WeightlessBuildError(
            f"the model assigns to {shown or 'a variable'} while it is built, so it cannot be "
            "built without its weights (the assigned value would be lost); build it with weights",
            paths[0].split("/")[0] if paths else None,
        )


def _pending() -> list[Any]:
    """Keras's list of variables created in a stateless scope and not yet initialised."""
    from keras.src.backend.common import global_state

    return list(global_state.get_global_attribute("uninitialized_variables") or [])


def _is_deferred(variable: Any) -> bool:
    """True for a Keras variable created in a stateless scope and not initialised since."""
    return getattr(variable, "_value", 0) is None and hasattr(variable, "_deferred_initialize")


def deferred_variables(model: Any) -> tuple[Any, ...]:
    """The variables of ``model`` that hold no value yet."""
    return tuple(v for v in getattr(model, "variables", ()) if _is_deferred(v))


def is_weightless(model: Any) -> bool:
    """True when some variable of ``model`` has no value (it was built in :func:`without_weights`)."""
    return bool(deferred_variables(model))


def variable_owners(units: Sequence[Any]) -> dict[int, str]:
    """``id(variable)`` -> the name of the first placement unit (``passes.trace.Unit``) whose
    layer holds it (a shared variable belongs to its first holder, as its read op does in an
    ordinary trace)."""
    owners: dict[int, str] = {}
    for unit in units:
        for w in getattr(unit.operation, "weights", ()) or ():
            owners.setdefault(id(w), unit.name)
    return owners


def materialize(model: Any, device_of: Mapping[int, str] | None = None) -> int:
    """Create the value of every deferred variable of ``model``; returns how many.

    ``device_of`` maps ``id(variable)`` to the TensorFlow device to create it on (its layer's
    device); a variable not in it is created under the caller's device scope.
    """
    import tensorflow as tf

    pending = deferred_variables(model)
    for variable in pending:
        device = (device_of or {}).get(id(variable))
        scope = tf.device(device) if device else contextlib.nullcontext()
        with scope:
            variable._deferred_initialize()
    _forget_pending(pending)
    if pending:
        logger.debug("materialised %d variables of %s", len(pending), getattr(model, "name", ""))
    return len(pending)


def _forget_pending(done: Sequence[Any]) -> None:
    """Drop ``done`` from Keras's list of variables awaiting initialisation, so a later
    ``initialize_all_variables`` does not initialise them twice."""
    from keras.src.backend.common import global_state

    pending = global_state.get_global_attribute("uninitialized_variables")
    if pending:
        ids = {id(v) for v in done}
        pending[:] = [v for v in pending if id(v) not in ids]


def _failing_layer(tb: TracebackType | None) -> Any:
    """The innermost Keras layer (a frame's ``self``) on the traceback ``tb``, or None."""
    layer = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, keras.layers.Layer):
            layer = candidate
        tb = tb.tb_next
    return layer


def build_without_weights(build: Callable[[], T], what: str = "the model") -> T:
    """``build()`` inside :func:`without_weights`.

    Raises :class:`WeightlessBuildError` naming the layer when the build needs real weight
    values (a layer that assigns to or computes with a variable in ``build``).
    """
    try:
        with without_weights():
            return build()
    except WeightlessBuildError:
        raise
    except Exception as exc:  # any failure of user code inside the scope
        layer = _failing_layer(sys.exc_info()[2])
        name = f"{layer.name!r} ({type(layer).__name__})" if layer is not None else None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"layer {name}" if name else what
        raise WeightlessBuildError(
            f"{where} cannot be built without its weights ({type(exc).__name__}: {first[:200]})",
            layer.name if layer is not None else None,
        ) from exc
