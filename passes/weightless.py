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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import keras

from partitioner.core.errors import TraceError

__all__ = [
    "Deferred",
    "WeightlessBuildError",
    "available_memory_bytes",
    "build_without_weights",
    "deferred_variables",
    "is_deferred",
    "is_weightless",
    "materialize",
    "variable_owners",
    "weight_bytes",
    "without_weights",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WeightlessBuildError(TraceError):
    """A model could not be built without its weights (see :func:`build_without_weights`)."""

    def __init__(self, reason: str, layer: str | None, weight_bytes: int = 0) -> None:
        super().__init__(f"{reason}; build it outside without_weights()")
        self.reason = reason
        """What failed, without the next step."""
        self.layer = layer
        """The name of the layer whose build failed, when known."""
        self.weight_bytes = weight_bytes
        """The bytes of the weights the build had created when it failed (at least what an
        ordinary build needs)."""


@dataclass
class Deferred:
    """What a :func:`without_weights` block made: its deferred variables (filled as it exits)."""

    variables: list[Any] = field(default_factory=list)


@contextlib.contextmanager
def without_weights() -> Iterator[Deferred]:
    """Build Keras models inside this block without allocating their weights::

        with partitioner.without_weights():
            model = build_llama_7b()
        plan = partitioner.partition(model, gpus=8, device_type="a100-80gb")
        model = plan.apply(model)  # weights created now, each on its layer's device

    Variables created inside keep their shape, dtype and initializer and hold no value until
    :func:`materialize` (or ``plan.apply``) creates them. They are taken off Keras's list of
    variables to initialise, so nothing Keras does later (a symbolic build ends by initialising
    that list) allocates them on the host behind the caller's back.
    """
    made = Deferred()
    pending = _pending()
    start = len(pending)
    try:
        with keras.StatelessScope(initialize_variables=False) as scope, _values_deferred():
            yield made
    finally:
        made.variables[:] = pending[start:]
        del pending[start:]
    if scope.state_mapping:  # a build assigned to a variable: the value would be lost
        raise _assigned(made.variables, scope.state_mapping)


class _Value:
    """An initializer that gives back a value: a variable created from a value (an optimizer's
    learning rate in a model file that compiles its model) is deferred like the others."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        return keras.ops.cast(keras.ops.reshape(self.value, shape), dtype or self.value.dtype)


@contextlib.contextmanager
def _values_deferred() -> Iterator[None]:
    """Keras refuses a variable made from a value in a stateless scope; while this is active,
    such a value becomes a :class:`_Value` initializer of its shape and dtype instead."""
    from keras.src.backend.common.variables import Variable

    original = Variable.__init__

    def init(
        self: Any, initializer: Any, shape: Any = None, dtype: Any = None, *a: Any, **k: Any
    ) -> None:
        if (
            initializer is not None
            and not callable(initializer)
            and not isinstance(initializer, str)
        ):
            value = keras.ops.convert_to_tensor(initializer, dtype=dtype)
            initializer, shape, dtype = _Value(value), tuple(value.shape), value.dtype
        original(self, initializer, shape, dtype, *a, **k)

    Variable.__init__ = init
    try:
        yield
    finally:
        Variable.__init__ = original


def _assigned(variables: Sequence[Any], assigned: Mapping[int, Any]) -> WeightlessBuildError:
    paths = [str(getattr(v, "path", v.name)) for v in variables if id(v) in assigned]
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    layer = paths[0].split("/")[0] if paths else None
    return WeightlessBuildError(
        f"{f'layer {layer!r}' if layer else 'the model'} assigns to {shown or 'a variable'} "
        "while it is built, so it cannot be built without its weights (the assigned value "
        "would be lost)",
        layer,
    )


def _pending() -> list[Any]:
    """Keras's own list of variables created in a stateless scope and not yet initialised."""
    from keras.src.backend.common import global_state

    pending: list[Any] = global_state.get_global_attribute(
        "uninitialized_variables", [], set_to_default=True
    )
    return pending


def is_deferred(variable: Any) -> bool:
    """True for a Keras variable created in a stateless scope and not initialised since."""
    return getattr(variable, "_value", 0) is None and hasattr(variable, "_deferred_initialize")


def deferred_variables(model: Any) -> tuple[Any, ...]:
    """The variables of ``model`` that hold no value yet."""
    return tuple(v for v in getattr(model, "variables", ()) if is_deferred(v))


def is_weightless(model: Any) -> bool:
    """True when some variable of ``model`` has no value (it was built in :func:`without_weights`)."""
    return bool(deferred_variables(model))


def variable_owners(units: Sequence[Any]) -> dict[int, str]:
    """``id(variable)`` -> the name of the first placement unit (``passes.trace.Unit``) whose
    layer holds it (a shared variable belongs to its first holder, as its read op does in an
    ordinary trace)."""
    owners: dict[int, str] = {}
    for unit in units:  # ``variables``: the weights and the state of its random seeds
        for w in getattr(unit.operation, "variables", ()) or ():
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
    if pending:
        logger.debug("materialised %d variables of %s", len(pending), getattr(model, "name", ""))
    return len(pending)


def available_memory_bytes() -> int | None:
    """The memory this machine can give a new allocation now (Linux ``MemAvailable``), or None
    where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def weight_bytes(variables: Sequence[Any]) -> int:
    """The bytes the values of ``variables`` take."""
    import numpy as np

    return sum(
        int(np.prod(v.shape, dtype=np.int64)) * np.dtype(str(v.dtype)).itemsize for v in variables
    )


def _failing_layer(exc: BaseException) -> Any:
    """The innermost Keras layer (a frame's ``self``) on the traceback of ``exc`` or of the
    exceptions it was raised from (a loader wraps the user's error in its own), or None."""
    layer = None
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb: TracebackType | None = error.__traceback__
        while tb is not None:
            candidate = tb.tb_frame.f_locals.get("self")
            if isinstance(candidate, keras.layers.Layer):
                layer = candidate
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return layer


def _failure(exc: Exception, what: str, made: Sequence[Any]) -> WeightlessBuildError:
    """``exc`` (raised while ``what`` was built without weights, after creating the variables
    ``made``) as a WeightlessBuildError that names the layer and the bytes built so far."""
    if isinstance(exc, WeightlessBuildError):
        message, name = exc.reason, exc.layer
    else:
        layer = _failing_layer(exc)
        name = getattr(layer, "name", None)  # None too for a layer whose __init__ raised
        where = f"layer {name!r} ({type(layer).__name__})" if name is not None else what
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = (
            f"{where} cannot be built without its weights ({type(exc).__name__}: {first[:200]})"
        )
    return WeightlessBuildError(message, name, weight_bytes(made))


def build_without_weights(build: Callable[[], T], what: str = "the model") -> T:
    """``build()`` inside :func:`without_weights`.

    Raises :class:`WeightlessBuildError` naming the layer (and the bytes of the weights created
    before it failed) when the build fails or needs real weight values (a layer that assigns to
    a variable while it is built).
    """
    made = Deferred()
    try:
        with without_weights() as made:
            return build()
    except Exception as exc:  # any failure of user code inside the scope
        raise _failure(exc, what, made.variables) from exc
