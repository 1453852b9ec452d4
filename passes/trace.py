"""Trace a Keras 3 model into the IR: the forward and backward ops of one training step.

How the op-to-layer map is made exact
-------------------------------------
Name scopes do not identify layers (a shared layer's second call, or a layer built under another
name, gets irregular suffixes such as ``dense_1_2``). Instead, while the training step is traced
into a ``tf.function`` graph, :class:`_CallRecorder` wraps ``keras.Operation.__call__`` (which
every Keras layer and functional-API op goes through) and records, for every op the graph
creates, which *placement unit* was innermost on the call stack at the time. Backward ops are built
with ``tf.gradients``, which colocates every gradient op with its forward op (its ``_class``
attribute reads ``loc:@<forward op>``), so a backward op's owner is its forward op's owner.
Layers still unbuilt (a subclassed model built with ``model.build(shape)``) are built first, by
one symbolic call outside the step (:func:`build_sublayers`): built inside it, their variables
would be made there and TensorFlow would trace the step twice.

Placement units are the leaves of the model's container structure: the layers (and functional-API
ops) of Sequential and Functional models, recursing into nested models, and the tracked sublayers
of subclassed models. A unit's own sublayers (say, the projections inside MultiHeadAttention) stay
inside the unit. Ops created outside every unit (inputs, the loss, ops in a subclassed model's own
``call``) are glue: the IR leaves their ``layer`` empty and the layer view merges them into a
neighbour.

FLOPs come from TensorFlow's own profiler (``tf.compat.v1.profiler``) run over the traced graph.

Threads: the wrap of ``__call__`` is process-wide, so a process traces one model at a time
(:data:`KERAS_CALL_LOCK`); concurrent ``partition()`` calls wait for each other's trace only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import keras
import networkx as nx
import tensorflow as tf

from partitioner.core.batching import TRACED_AT
from partitioner.core.errors import TraceError, error_line, message_of, quoting, unwrapped
from partitioner.core.ir import Edge, Graph, LayerInfo, Op, Phase, SparseGradient
from passes import blocks, weightless

logger = logging.getLogger(__name__)

ShapeArg: TypeAlias = Sequence[int] | Mapping[str, Sequence[int]]
"""An ``input_shape``: one shape after the batch (a single-input model), or input name -> shape
(:class:`partitioner.core.options.TargetOptions` normalises either to tuples)."""

__all__ = [
    "KERAS_CALL_LOCK",
    "OWN_STEPS",
    "ShapeArg",
    "TraceResult",
    "Unit",
    "build_sublayers",
    "error_line",
    "fixed_batch",
    "forward_signature",
    "input_names",
    "input_specs",
    "integer_input_bounds",
    "model_input",
    "placement_units",
    "sample_batch_size",
    "trace_model",
    "unbuilt_layers",
]


KERAS_CALL_LOCK = threading.RLock()
"""Held while Keras's ``Layer.__call__`` and ``Operation.__call__`` are wrapped, and while
:func:`trace_model` traces a step. The wrapper is a class attribute, so it is seen by every
thread of the process: two threads wrapping at once would each save the other's wrapper as the
original and restore them out of order, and a trace would lose its op-to-layer record midway
(ops charged to glue or to the wrong layer, edges dropped). Traces therefore run one thread at
a time (the others wait; the solve and the simulation after the trace stay concurrent), and
any other code that wraps ``__call__`` takes this lock too. Re-entrant: the wrap happens inside
the trace, on the tracing thread."""


@dataclass(frozen=True)
class Unit:
    """A placement unit: a name unique within the model and the Keras object behind it."""

    name: str
    operation: Any
    path: tuple[str, ...]


@dataclass(frozen=True)
class TraceResult:
    """The IR of a training step and the facts about the trace."""

    graph: Graph
    units: tuple[Unit, ...]
    trace_time_s: float
    flops_time_s: float
    step_function: Any = None
    """The traced step as a ``tf.types.experimental.ConcreteFunction`` (inputs: the traced specs;
    outputs: the loss and the gradients), so a profiler can run exactly the graph that was traced
    and match its ops by name. None for a weightless model (there is nothing to run it on)."""
    weightless: bool = False
    """True when the model had no weights (:mod:`passes.weightless`): its variables were the
    traced function's arguments, and nothing was allocated."""
    tf32_enabled: bool = True
    """TensorFlow's TF32 setting when the step was traced
    (``tf.config.experimental.tensor_float_32_execution_enabled()``): float32 matmuls and
    convolutions run on TF32 tensor cores where the GPU has them. The model's Keras dtype policy
    needs no field: the traced ops carry its dtypes
    (:func:`cost_models.estimate.precision.traced_precision`)."""
    input_bounds: tuple[int | None, ...] = ()
    """Per input (``model.inputs`` order): the exclusive bound of valid integer values (token
    ids: the embedding's table size), None where unknown (:func:`integer_input_bounds`)."""


def _is_container(obj: Any) -> bool:
    return isinstance(obj, keras.Model)


def _children(model: keras.Model) -> list[Any]:
    """The direct children of a container, in call order where Keras knows it."""
    if isinstance(model, keras.Sequential):
        return _sequential_children(model)
    operations = getattr(model, "operations", None)
    if getattr(model, "_is_graph_network", False) or hasattr(model, "_operations_by_depth"):
        if operations is not None:
            return [op for op in operations if not isinstance(op, keras.layers.InputLayer)]
    return list(model.layers)


def _sequential_children(model: keras.Sequential) -> list[Any]:
    """A built Sequential runs the functional graph Keras made of it, which also holds the ops
    its layers' masks were computed with (``Masking`` adds ``not_equal`` and ``any``): those
    are units too, as in a functional model. Unbuilt, or without such ops: its layers."""
    layers = list(model.layers)
    functional = getattr(model, "_functional", None)
    operations = getattr(functional, "operations", None) or []
    graph = [op for op in operations if not isinstance(op, keras.layers.InputLayer)]
    if len(graph) > len(layers) and {id(x) for x in layers} <= {id(op) for op in graph}:
        return graph
    return layers


def unbuilt_layers(model: keras.Model) -> list[str]:
    """The names of the layers inside ``model``, at any depth, that are not built yet.

    ``model.build(shape)`` on a subclassed model whose ``build`` does not build the layers its
    ``__init__`` made marks the model built and leaves those layers unbuilt (Keras warns); Keras
    then builds each on the model's first call, which inside a traced step creates variables
    there (TensorFlow traces the step again) and charges their initializers to the layer.
    """
    return [layer.name for layer in model._flatten_layers(include_self=False) if not layer.built]


def _own_specs(model: keras.Model) -> list[tf.TensorSpec] | None:
    """Specs of the model's own inputs, the batch left unknown (None when it has none)."""
    inputs = _declared_inputs(model)
    if inputs:
        return [tf.TensorSpec(tuple(t.shape), str(t.dtype)) for t in inputs]
    try:
        shapes = _built_shapes(model)
    except TraceError:  # a dict of inputs: the trace refuses it in its own words
        return None
    return None if shapes is None else [tf.TensorSpec((None, *s[1:]), "float32") for s in shapes]


def build_sublayers(
    model: keras.Model,
    specs: Sequence[tf.TensorSpec] | None = None,
    given: ShapeArg | None = None,
) -> keras.Model:
    """``model`` with its unbuilt layers (:func:`unbuilt_layers`) built by one symbolic call
    (``model(x, training=True)`` in Keras's scratch graph, as Keras builds a layer it cannot
    build otherwise), outside any trace, on inputs of ``specs`` (default: the model's own input
    shapes, batch unknown). Nothing is computed; variables made for a model without weights
    (:mod:`passes.weightless`) stay without values. Where the symbolic call fails, the layers
    are left as they are: the trace calls the model again and reports what fails.
    """
    _build_sequential(model, specs, given)
    unbuilt = unbuilt_layers(model)
    specs = _own_specs(model) if specs is None and unbuilt else specs
    if not unbuilt or not specs:
        return model
    try:
        _call_symbolically(model, specs)
    except TraceError:
        raise
    except Exception as exc:  # the user's call() failed symbolically: the trace says why
        logger.debug("building %s of %s symbolically failed: %s", unbuilt, model.name, exc)
        return model
    logger.debug("built %d unbuilt layers of %s before its trace", len(unbuilt), model.name)
    return model


def _call_symbolically(model: keras.Model, specs: Sequence[tf.TensorSpec]) -> list[Any]:
    """``model(x, training=True)`` on symbolic inputs of ``specs`` in Keras's scratch graph
    (nothing computed; a model without weights keeps its variables without values): the ops
    that call made there, in creation order."""
    from keras.src import backend

    symbolic = [keras.KerasTensor(tuple(s.shape), dtype=s.dtype.name) for s in specs]
    deferred = weightless.is_weightless(model)
    scope = weightless.without_weights() if deferred else contextlib.nullcontext()
    made: list[Any] = []

    def call(x: Any) -> Any:
        outputs = model(x, training=True)
        made.extend(tf.compat.v1.get_default_graph().get_operations())
        return outputs

    with scope:
        backend.compute_output_spec(call, model_input(model, symbolic))
    return made


def forward_signature(
    model: keras.Model, *, batch_size: int | None, input_shape: ShapeArg | None = None
) -> str | None:
    """The SHA-256 of the ops the model's forward pass (``training=True``) makes at
    ``batch_size`` on symbolic inputs (each op's type and output shapes, in creation order; a
    fifth of a trace's time), None where that call fails. ``batch_size=None``: at a batch left
    unknown, one call that stands for every batch (a model that fixes its batch fails it).
    A trace cache entry is checked
    against it: a model whose structure changed through something its key cannot see (a file
    read through TensorFlow's own file layer, a subprocess, a directory listing) is traced
    again. None too for a model with a custom gradient (``tf.custom_gradient``): its backward
    ops are not in the forward pass, so such a model is never served from the cache."""
    with KERAS_CALL_LOCK:
        try:
            specs = input_specs(model, batch_size or 1, input_shape)
            if batch_size is None:
                specs = [tf.TensorSpec((None, *s.shape[1:]), s.dtype, s.name) for s in specs]
            ops = _call_symbolically(model, specs)
        except Exception as exc:  # the trace says what and where
            logger.debug("%s does not run symbolically at %s: %s", model.name, batch_size, exc)
            return None
    if any("_gradient_op_type" in op.node_def.attr for op in ops):
        return None  # a custom gradient: its ops are not in the forward pass to compare
    digest = hashlib.sha256()
    for op in ops:  # a layer computing in another dtype at the same shapes is another model
        outputs = [f"{t.shape}:{t.dtype.name}" for t in op.outputs]
        digest.update(f"{op.type}{outputs};".encode())
    return digest.hexdigest()


def _build_sequential(
    model: keras.Model, specs: Sequence[tf.TensorSpec] | None, given: ShapeArg | None = None
) -> None:
    """An unbuilt ``keras.Sequential`` (no ``keras.Input``) built on ``specs``' one input shape
    with the batch unknown, as ``keras.Input(shape=...)`` declares it. Keras builds one on its
    first call at that call's whole shape, batch included, as if the model fixed its batch
    (``keras.Input(batch_shape=...)``): the trace's batch then refused the replica and
    micro-batch rewrites, though the model runs any batch."""
    if not isinstance(model, keras.Sequential) or model.built or not specs or len(specs) != 1:
        return
    scope = weightless.without_weights() if weightless.is_weightless(model) else None
    try:
        with scope or contextlib.nullcontext():
            model.build((None, *tuple(specs[0].shape)[1:]))
    except TraceError:
        raise
    except Exception as exc:  # a layer refuses the shape
        said = error_line(exc)
        layer = _failing_layer(exc, model)
        who = f"model {model.name!r}"
        if layer is not None:
            who = f"layer {layer.name!r} ({type(layer).__name__}) of {who}"
        raise quoting(
            TraceError(
                f"{who} raised {type(unwrapped(exc)).__name__} while built: "
                f"{said}; {_traced_at(model, specs, given)}"
            ),
            said,
        ) from None


def _failing_layer(exc: BaseException, model: keras.Model) -> Any:
    """The innermost of ``model``'s own layers whose method (``build``, ``call``) the traceback
    of ``exc`` (or of what it wraps) ran through, or None."""
    layers = {id(layer): layer for layer in model._flatten_layers(include_self=False)}
    found = None
    for error in (exc, exc.__cause__, exc.__context__):
        tb = error.__traceback__ if error is not None else None
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in layers:
                found = layers[id(owner)]
            tb = tb.tb_next
        if found is not None:
            return found
    return None


def placement_units(model: keras.Model) -> tuple[Unit, ...]:
    """The placement units of ``model`` in a deterministic order (see the module docstring).

    Names are the Keras names; where two units share a name (layers of two nested models named
    alike), the later one is qualified with its container path (``inner/dense``).
    """
    units: list[Unit] = []
    seen: set[int] = set()
    names: set[str] = set()

    def visit(container: keras.Model, path: tuple[str, ...]) -> None:
        for child in _children(container):
            if id(child) in seen or isinstance(child, keras.layers.InputLayer):
                continue
            seen.add(id(child))
            if _is_container(child):
                visit(child, (*path, child.name))
                continue
            name = child.name
            if name in names:
                name = "/".join((*path, child.name))
                k = 2
                while name in names:
                    name = "/".join((*path, f"{child.name}#{k}"))
                    k += 1
            names.add(name)
            units.append(Unit(name=name, operation=child, path=path))

    visit(model, (model.name,))
    return tuple(units)


class _CallRecorder:
    """Records which unit is innermost while each graph op is created."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self.units = tuple(units)
        self._unit_by_id = {id(u.operation): u.name for u in units}
        self._stack: list[str | None] = [None]
        # (number of ops in the graph when the segment starts, owner of the segment)
        self.segments: list[tuple[int, str | None]] = [(0, None)]
        self._graph: Any = None
        self.failed_in: str | None = None
        """The innermost unit whose call raised an exception that was not handled (yet)."""

    def _mark(self) -> None:
        n = len(self._graph.get_operations())
        owner = self._stack[-1]
        if self.segments[-1][0] == n:
            self.segments[-1] = (n, owner)
        else:
            self.segments.append((n, owner))

    @contextlib.contextmanager
    def recording(self, graph: Any) -> Iterator[None]:
        """Wrap ``Layer.__call__`` and ``Operation.__call__`` while the model is called.

        Both are wrapped: ``Layer.__call__`` creates ops (casts, masks) before it reaches
        ``Operation.__call__``, and functional-API ops that are not layers only pass the latter.

        A new ``graph`` starts the record afresh: TensorFlow traces a step again when its first
        trace created variables (a layer built inside the step), and the op positions of the
        discarded first graph would otherwise be read against the second.
        """
        from keras.src.layers.layer import Layer
        from keras.src.ops.operation import Operation

        if graph is not self._graph:
            self._stack = [None]
            self.segments = [(0, None)]
            self.failed_in = None
        with KERAS_CALL_LOCK:
            with self._wrapped(graph, (Layer, Operation)):
                yield

    @contextlib.contextmanager
    def _wrapped(self, graph: Any, classes: tuple[Any, ...]) -> Iterator[None]:
        """``classes``' ``__call__`` wrapped to record into ``self`` (under
        :data:`KERAS_CALL_LOCK`)."""
        recorder = self
        self._graph = graph
        originals = {cls: cls.__dict__["__call__"] for cls in classes}

        def wrap(original: Any) -> Any:
            def recording_call(op_self: Any, *args: Any, **kwargs: Any) -> Any:
                unit = recorder._unit_by_id.get(id(op_self))
                if unit is None or tf.compat.v1.get_default_graph() is not recorder._graph:
                    return original(op_self, *args, **kwargs)
                recorder._stack.append(unit)
                recorder._mark()
                try:
                    result = original(op_self, *args, **kwargs)
                except BaseException:
                    recorder.failed_in = recorder.failed_in or unit
                    raise
                finally:
                    recorder._stack.pop()
                    recorder._mark()
                recorder.failed_in = None  # what failed inside was handled
                return result

            return recording_call

        for cls, original in originals.items():
            cls.__call__ = wrap(original)
        try:
            yield
        finally:
            for cls, original in originals.items():
                cls.__call__ = original

    def owner_of(self, op_position: int) -> str | None:
        lo, hi = 0, len(self.segments) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.segments[mid][0] <= op_position:
                lo = mid
            else:
                hi = mid - 1
        return self.segments[lo][1]


def _declared_inputs(model: keras.Model) -> list[Any]:
    """The model's symbolic inputs (Keras's flat order), or [] when it has none yet."""
    try:
        return list(model.inputs or [])
    except Exception:  # Keras raises on models that were never called on an input
        return []


def input_names(model: keras.Model) -> list[str]:
    """Each input's name, in the order of ``model.inputs`` (that of :func:`input_specs`): its key
    where the model takes a dict, else its ``keras.Input`` name (``input_{k}`` when it has none).
    ``input_shape`` is keyed by these names."""
    inputs = _declared_inputs(model)
    struct = getattr(model, "_inputs_struct", None)
    key_of = {id(v): str(k) for k, v in struct.items()} if isinstance(struct, Mapping) else {}
    if not inputs:
        return [f"input_{k}" for k in range(len(_built_shapes(model) or [()]))]
    return [
        key_of.get(id(t)) or str(getattr(t, "name", "") or f"input_{k}")
        for k, t in enumerate(inputs)
    ]


def model_input(model: keras.Model, flat: Sequence[Any]) -> Any:
    """What ``model`` is called on for ``flat`` (one value per input, in ``model.inputs`` order):
    the model's own structure when it takes a dict or a nested structure, else the one value or
    the list of them."""
    from keras.src import tree

    struct = getattr(model, "_inputs_struct", None)
    nested = isinstance(struct, Mapping) or (
        isinstance(struct, (list, tuple))
        and any(isinstance(s, (list, tuple, Mapping)) for s in struct)
    )
    if nested and len(tree.flatten(struct)) == len(flat):
        return tree.pack_sequence_as(struct, list(flat))
    return flat[0] if len(flat) == 1 else list(flat)


def _built_shapes(model: keras.Model) -> list[tuple[Any, ...]] | None:
    """A built subclassed model's input shapes from its build config (None if unknown)."""
    build_config = model.get_build_config() if model.built else None
    shape = (build_config or {}).get("input_shape")
    if shape is None:
        return None
    if isinstance(shape, Mapping):  # Keras records a dict's shapes, not its dtypes
        listed = {str(k): tuple(v)[1:] for k, v in shape.items()}
        raise TraceError(
            f"subclassed model {model.name!r} takes a dict of inputs {listed} whose dtypes Keras "
            f"does not record; {_functional_advice(model)}"
        )
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
        return [tuple(s) for s in shape]
    return [tuple(shape)]


OWN_STEPS = (
    "train_step",
    "compute_loss",
    "test_step",
    "predict_step",
    "compute_metrics",
    "get_metrics_result",
    "compile",
)
"""The methods of ``keras.Model`` a model may override (in its class, or on the model object
itself: ``model.train_step = types.MethodType(...)``) that the copies replace (a ``compile``
forcing its loss too, campaign 34y)."""


def _functional_advice(model: keras.Model) -> str:
    """How to give a subclassed model's inputs: a functional wrapper, or, for a class with its
    own steps (which a wrapper of class ``keras.Model`` would not keep: it trained with Keras's
    default step, campaign 34ab), a functional model of its own class."""
    cls = type(model)
    own = [m for m in OWN_STEPS if getattr(cls, m, None) is not getattr(keras.Model, m, None)]
    if not own:
        return (
            "wrap it in a functional model, one keras.Input(shape=..., dtype=..., name=KEY) "
            "per key, and plan that"
        )
    return (
        f"its class has its own {own[0]}, which a functional wrapper would not keep: build it "
        f"as a functional model of its own class, {cls.__name__}(inputs={{KEY: "
        "keras.Input(shape=..., dtype=..., name=KEY)}, outputs=...), as keras.io's models "
        "with their own train_step do, and plan that"
    )


def _check_unbuilt_names(model: keras.Model, input_shape: Mapping[str, Any]) -> None:
    """TraceError when ``input_shape`` names inputs of a subclassed model that was never built:
    Keras knows no input names before a call, so its one input is ``input_0`` and names that
    are not it are a dict's keys, whose dtypes Keras would not record even once built (as
    :func:`_built_shapes` says): the advice is the functional wrapper, or one shape."""
    keys = [str(k) for k in input_shape]
    if keys == ["input_0"]:
        return
    shown = {k: tuple(input_shape[k]) for k in input_shape}
    one = next(iter(shown.values()), (128,))
    raise TraceError(
        f"input_shape={shown}: subclassed model {model.name!r} was never built, so Keras knows "
        f"no names or dtypes for its inputs; if its call takes a dict "
        f"({', '.join(map(repr, keys))}), {_functional_advice(model)}; if it takes one "
        f"tensor, give its shape alone, e.g. input_shape={one}"
    )


def _example_shape(shape: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(128 if d is None else int(d) for d in shape[1:])


def _shape_overrides(
    model: keras.Model,
    names: Sequence[str],
    shapes: list[tuple[Any, ...]],
    input_shape: ShapeArg,
) -> list[tuple[Any, ...]]:
    """``shapes`` with ``input_shape`` (one shape, or one per input name) put in."""
    if isinstance(input_shape, Mapping):
        unknown = sorted(set(input_shape) - set(names))
        if unknown:  # written as the argument, so the CLI shows it as --input-shape NAME=SHAPE
            shown = {str(k): tuple(input_shape[k]) for k in unknown}
            example = {n: _example_shape(s) for n, s in zip(names, shapes)}
            raise TraceError(
                f"input_shape={shown}: model {model.name!r} has no input named "
                f"{', '.join(map(repr, unknown))} (its inputs are {list(names)}); key the "
                f"shapes by those names, e.g. input_shape={example}"
            )
        given = {n: tuple(int(d) for d in input_shape[n]) for n in input_shape}
    elif len(shapes) != 1:
        example = {n: _example_shape(s) for n, s in zip(names, shapes)}
        raise TraceError(
            f"input_shape={tuple(input_shape)} gives one shape but model {model.name!r} has "
            f"{len(shapes)} inputs; give one per input, e.g. input_shape={example}"
        )
    else:
        given = {names[0]: tuple(int(d) for d in input_shape)}
    out = []
    for name, shape in zip(names, shapes):
        dims = given.get(name)
        if dims is not None:
            _check_given(model, names, name, shape, dims)
        out.append(shape if dims is None else (None, *dims))
    return out


def _check_given(
    model: keras.Model,
    names: Sequence[str],
    name: str,
    shape: tuple[Any, ...],
    dims: tuple[int, ...],
) -> None:
    """TraceError unless ``dims`` (given for input ``name``) are positive and of its rank."""

    def spelled(d: tuple[int, ...]) -> Any:  # as the user passes it: a tuple, or name -> tuple
        return d if len(names) == 1 else {name: d}

    if any(d < 1 for d in dims):
        raise TraceError(f"input_shape={spelled(dims)} of model {model.name!r}: dims must be >= 1")
    if _known_rank(model) and len(shape) - 1 != len(dims):
        raise TraceError(
            f"input_shape={spelled(dims)} gives input {name!r} of model {model.name!r} "
            f"{len(dims)} dims but it has {len(shape) - 1} after the batch "
            f"{tuple(shape)}; e.g. input_shape={spelled(_example_shape(shape))}"
        )


def _known_rank(model: keras.Model) -> bool:
    return bool(_declared_inputs(model))


def _unknown_dims_error(
    model: keras.Model,
    names: Sequence[str],
    shapes: Sequence[tuple[Any, ...]],
    dtypes: Sequence[str],
) -> TraceError:
    """One line listing each input (name, dtype, known shape) and the argument to pass."""
    unknown = [(n, s) for n, s in zip(names, shapes) if any(d is None for d in s[1:])]
    listed = ", ".join(
        f"{n} {dt} {tuple(s)}".replace("None", "?") for n, s, dt in zip(names, shapes, dtypes)
    )
    if len(names) == 1:
        example: Any = _example_shape(shapes[0])
    else:
        example = {n: _example_shape(s) for n, s in unknown}
    return TraceError(
        f"model {model.name!r} leaves input dimensions unknown (inputs: {listed}); give every "
        f"dimension after the batch, e.g. input_shape={example}"
    )


def fixed_batch(model: Any) -> int | None:
    """The batch ``model``'s inputs fix (``keras.Input(batch_shape=(4, ...))``, as a stateful
    RNN needs), or None."""
    try:
        inputs = list(model.inputs or [])
    except Exception:  # a subclassed model never called: no declared inputs
        return None
    fixed = [int(t.shape[0]) for t in inputs if t.shape and t.shape[0] is not None]
    return fixed[0] if fixed else None


def sample_batch_size(model: Any, share: int = 1) -> int:
    """The batch a rewritten copy of ``model`` is built on (``Plan.apply``, an emitted module's
    ``SAMPLE_INPUTS``): the batch ``model``'s inputs fix (a stateful layer's state is made at the
    batch it is built on, and takes no other), else ``share``: the plan's own share of the
    batch, which the model was traced at (a layer may refuse a batch of one)."""
    return fixed_batch(model) or share


def input_specs(
    model: keras.Model, batch_size: int, input_shape: ShapeArg | None = None
) -> list[tf.TensorSpec]:
    """Concrete input specs for tracing, one per model input (``model.inputs`` order): batch size
    first, other dims from the model.

    ``input_shape`` (without the batch dimension) overrides the model's shapes: one shape for a
    single-input model, or a mapping of input name (:func:`input_names`) -> shape; it is required
    where the model leaves a non-batch dimension unknown.
    """
    if batch_size < 1:
        raise TraceError(f"batch_size={batch_size} must be >= 1")
    inputs = _declared_inputs(model)
    if inputs:
        shapes = [tuple(t.shape) for t in inputs]
        dtypes = [str(t.dtype) for t in inputs]
    else:
        built = _built_shapes(model)
        if built is None and isinstance(input_shape, Mapping):
            _check_unbuilt_names(model, input_shape)
        if built is None and isinstance(model, keras.Sequential) and not model.layers:
            # not "a subclassed model never built": its advice led to Keras's own refusal
            raise TraceError(f"model {model.name!r} has no layers to place")
        if built is None and input_shape is None:
            raise TraceError(
                f"model {model.name!r} has no known input shape (a subclassed model that was never "
                "built); give the shape after the batch, e.g. input_shape=(784,) or "
                "input_shape=(32, 32, 3)"
            )
        shapes = built if built is not None else [(None, None)]
        dtypes = ["float32"] * len(shapes)
    names = input_names(model)
    if input_shape is not None:
        shapes = _shape_overrides(model, names, shapes, input_shape)
    if any(d is None for s in shapes for d in s[1:]):
        raise _unknown_dims_error(model, names, shapes, dtypes)
    _check_tensor_sizes(names, shapes, batch_size)
    return [
        tf.TensorSpec((batch_size, *shape[1:]), dtype=dtype, name=f"input_{k}")
        for k, (shape, dtype) in enumerate(zip(shapes, dtypes))
    ]


MAX_TENSOR_VALUES = 2**31 - 1
"""The most values one tensor of a traced step may hold: TensorFlow computes shapes in 32-bit
integers there (a batch of 16 samples of 2**27 values failed as "Invalid value in tensor used
for shape: -2147483648")."""


def _check_tensor_sizes(
    names: Sequence[str], shapes: Sequence[tuple[Any, ...]], batch_size: int
) -> None:
    """TraceError naming the input, its values per sample and the largest batch that fits when
    a batch of its samples would hold more than :data:`MAX_TENSOR_VALUES` values."""
    for name, shape in zip(names, shapes):
        per_sample = math.prod(int(d) for d in shape[1:])
        if per_sample * batch_size > MAX_TENSOR_VALUES:
            most = MAX_TENSOR_VALUES // max(per_sample, 1)
            fix = f"batch_size={most} or less, or a smaller " if most >= 1 else "a smaller "
            raise TraceError(
                f"input {name!r}: batch_size={batch_size} samples of {per_sample} values each "
                f"make a tensor of {per_sample * batch_size} values, more than the "
                f"{MAX_TENSOR_VALUES} TensorFlow's shapes can count; plan {fix}input_shape="
            )


_EMBEDDING_SIZE_ATTRS = ("input_dim", "vocabulary_size")


def _lookup_size(layer: Any) -> int | None:
    """The smallest table size of the embeddings in ``layer`` (itself or its sublayers)."""
    sizes = []
    for sub in [layer, *getattr(layer, "_flatten_layers", lambda: [])()]:
        if isinstance(sub, keras.layers.Embedding) or type(sub).__name__.endswith("Embedding"):
            for attr in _EMBEDDING_SIZE_ATTRS:
                value = getattr(sub, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    sizes.append(value)
    return min(sizes) if sizes else None


def integer_input_bounds(model: keras.Model) -> tuple[int | None, ...]:
    """For each model input (``model.inputs`` order), the exclusive upper bound of valid integer
    values: the smallest table of the embeddings that read it (through weightless ops such as
    casts), or None where none is found. Random token ids below it are in range for every lookup.
    """
    inputs = _declared_inputs(model)
    consumers: dict[int, list[Any]] = {}
    for op in getattr(model, "operations", []) or []:
        for node in getattr(op, "_inbound_nodes", []):
            for t in node.input_tensors:
                consumers.setdefault(id(t), []).append((op, node))
    bounds: list[int | None] = []
    for t in inputs:
        found: list[int] = []
        frontier, seen = [t], {id(t)}
        while frontier:
            tensor = frontier.pop()
            for op, node in consumers.get(id(tensor), []):
                size = _lookup_size(op)
                if size is not None:
                    found.append(size)
                elif not getattr(op, "weights", None):
                    fresh = [o for o in node.output_tensors if id(o) not in seen]
                    seen.update(id(o) for o in fresh)
                    frontier.extend(fresh)
        bounds.append(min(found) if found else None)
    return tuple(bounds)


_TARGETS_SCOPE = "partitioner_targets"
"""The name scope of :func:`_synthetic_loss`'s ops, by which :func:`_target_bytes` finds them."""


def _synthetic_loss(outputs: Any) -> tf.Tensor:
    """A scalar that depends on every float output, so the backward pass covers the model. Its
    ``Square`` ops (one per output, in :data:`_TARGETS_SCOPE`) stand where a loss would compare
    each output with its target."""
    with tf.name_scope(_TARGETS_SCOPE):
        terms = [
            tf.reduce_mean(tf.square(tf.cast(t, tf.float32)))
            for t in tf.nest.flatten(outputs)
            if tf.is_tensor(t) and t.dtype.is_floating
        ]
    if not terms:
        raise TraceError(
            f"the model has no floating-point output to train on ({_outputs_shown(outputs)}); "
            "plan a model that returns float values (e.g. the scores before an argmax or a cast "
            "to int) and compute the integer output from them after it"
        )
    return tf.add_n(terms) if len(terms) > 1 else terms[0]


def _outputs_shown(outputs: Any) -> str:
    """``its output: int64 from op 'argmax/am/ArgMax'``: the dtype and the op of up to three of
    ``outputs``."""
    flat = [t for t in tf.nest.flatten(outputs) if tf.is_tensor(t)]
    if not flat:
        return "it returns no tensor"
    shown = [
        f"{t.dtype.name} from op {getattr(getattr(t, 'op', None), 'name', '?')!r}" for t in flat[:3]
    ]
    more = f" and {len(flat) - 3} more" if len(flat) > 3 else ""
    return f"its output{'s' if len(flat) > 1 else ''}: {', '.join(shown)}{more}"


def _target_bytes(tf_ops: Sequence[Any]) -> int:
    """Bytes of the targets a step feeds (:attr:`Graph.target_bytes`): float32 of each output's
    size, read off :func:`_synthetic_loss`'s ``Square`` ops (an output of unknown size adds 0)."""
    total = 0
    for op in tf_ops:
        if op.type == "Square" and op.name.split("/")[0].startswith(_TARGETS_SCOPE):
            count = op.outputs[0].shape.num_elements()
            total += 4 * count if count is not None else 0
    return total


def _tensor_bytes(t: Any) -> tuple[tuple[int, ...], str, int]:
    dtype = t.dtype
    shape = t.shape
    if shape.rank is None:
        return ((), dtype.name, 0)
    dims = tuple(-1 if d is None else int(d) for d in shape.as_list())
    if any(d < 0 for d in dims) or dtype in (tf.resource, tf.variant, tf.string):
        return (dims, dtype.name, 0)
    return (dims, dtype.name, math.prod(dims) * dtype.size)


_LOOP_OPS = frozenset({"While", "StatelessWhile"})
_GRADIENT_SUM = re.compile(r"(^|/)gradients(_\d+)?/AddN(_\d+)?$")
"""The ops ``tf.gradients`` adds to sum a tensor's gradients from its consumers."""


def _trip_count(op: Any) -> int:
    """A while loop's iterations, when the graph states them: the length of the tensor lists it
    reserves or unstacks (how Keras's RNN layers loop over time). 0 when unknown."""
    trips = 0
    for t in op.inputs:
        src = t.op
        if src.type == "TensorListReserve" and len(src.inputs) > 1:
            value = tf.get_static_value(src.inputs[1])
            if value is not None and int(value) > 0:
                trips = max(trips, int(value))
        elif src.type == "TensorListFromTensor":
            shape = src.inputs[0].shape
            if shape.rank and shape[0] is not None:
                trips = max(trips, int(shape[0]))
    return trips


_LIST_WRITES = {"TensorListPushBack": 1, "TensorListSetItem": 2}
"""Tensor-list writes and the input that holds the element written."""


def _loop_list_bytes(op: Any) -> dict[int, int]:
    """Bytes of the tensor lists a while loop fills, by output index (pure graph inspection).

    A ``tf.while_loop`` that keeps per-iteration tensors (a Keras RNN's outputs, and the
    activations its gradient needs) returns them as ``variant`` tensor lists, whose size the
    graph does not state: it is the element written in the body (``TensorListPushBack`` /
    ``TensorListSetItem``) times the trip count. Lists of weight reads (a Keras cell reads its
    kernel every step) share the variable's buffer and count 0; outputs whose size cannot be
    found are left out.
    """
    trips = _trip_count(op)
    if not trips:
        return {}
    try:
        body = op.graph._get_function(op.get_attr("body").name).graph
    except (AttributeError, KeyError, ValueError, TypeError):
        return {}
    out: dict[int, int] = {}
    for i, t in enumerate(body.outputs):
        if i >= len(op.outputs) or op.outputs[i].dtype != tf.variant:
            continue
        index = _LIST_WRITES.get(t.op.type)
        if index is None or len(t.op.inputs) <= index:
            continue
        element = t.op.inputs[index]
        if element.op.type == "ReadVariableOp":
            continue  # a weight read shares the variable's buffer: pushing it copies nothing
        size = _tensor_bytes(element)[2]
        if size:
            out[i] = size * trips
    return out


_TRANSPOSE_ATTRS = (("transpose_a", "transpose_b"), ("adj_x", "adj_y"))


def _transposed_bytes(op: Any) -> int:
    """Bytes of a matmul's operands it reads transposed (attributes ``transpose_a/b`` or
    ``adj_x/y``); 0 for other ops."""
    if len(op.inputs) < 2:
        return 0
    for names in _TRANSPOSE_ATTRS:
        try:
            flags = [bool(op.get_attr(n)) for n in names]
        except (ValueError, TypeError):
            continue
        return sum(_tensor_bytes(t)[2] for t, f in zip(op.inputs[:2], flags) if f)
    return 0


def _einsum_flops(op: Any) -> int:
    """FLOPs of an ``Einsum`` (TF's profiler has no figure for it; Keras's attention uses it).

    With one operand, one operation per element of its index space; with two, a multiply and an
    add per point of the joint index space (every label's size multiplied together). 0 when the
    equation has an ellipsis or a shape is not fully known.
    """
    try:
        equation = op.get_attr("equation")
    except (ValueError, TypeError):
        return 0
    if isinstance(equation, bytes):
        equation = equation.decode()
    lhs = equation.replace(" ", "").split("->")[0]
    operands = lhs.split(",")
    if "." in lhs or len(operands) != len(op.inputs) or len(operands) not in (1, 2):
        return 0
    sizes: dict[str, int] = {}
    for labels, t in zip(operands, op.inputs):
        dims = t.shape.as_list() if t.shape.rank is not None else None
        if dims is None or len(dims) != len(labels) or any(d is None for d in dims):
            return 0
        for label, d in zip(labels, dims):
            sizes[label] = max(sizes.get(label, 1), int(d))
    points = math.prod(sizes.values())
    return points if len(operands) == 1 else 2 * points


_BATCH_MATMULS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
_DEPTHWISE_GRADIENTS = frozenset(
    {"DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"}
)


def _known(shape: Any) -> list[int] | None:
    dims = shape.as_list() if shape.rank is not None else None
    return None if dims is None or any(d is None for d in dims) else [int(d) for d in dims]


def _batch_matmul_flops(op: Any) -> int:
    """A batch matmul's multiply-adds, ``2 * output elements * k``, with ``k`` read where
    ``adj_x`` puts it. TensorFlow's registered count (``flops_registry.py``,
    ``_calc_batch_mat_mul_flops``) reads ``transpose_a``, which BatchMatMul does not have, so it
    takes ``a.shape[-1]`` for an adjoint ``a`` too: a dense layer's weight gradient ``x^T dy``
    over a 3-D input counts ``d_model / seq`` times its work. 0 when a shape is unknown."""
    a, out = _known(op.inputs[0].shape), _known(op.outputs[0].shape)
    if a is None or out is None or len(a) < 2:
        return 0
    try:
        adjoint = bool(op.get_attr("adj_x"))
    except (ValueError, TypeError):
        adjoint = False
    return 2 * math.prod(out) * (a[-2] if adjoint else a[-1])


def _depthwise_gradient_flops(op: Any) -> int:
    """A depthwise convolution's gradient (input or filter) does the forward's multiply-adds,
    ``2 * kh * kw`` per element of the forward's output (``out_backprop``); TensorFlow
    registers no count for either. 0 when a shape is unknown."""
    grad = _known(op.inputs[2].shape)
    kernel = _known(op.inputs[1].shape if "Input" in op.type else op.outputs[0].shape)
    if grad is None or kernel is None or len(kernel) != 4:
        return 0
    return 2 * kernel[0] * kernel[1] * math.prod(grad)


def _own_count(op: Any) -> int | None:
    """Our FLOP count where TensorFlow's profiler has none or a wrong one, else None."""
    if op.type in _BATCH_MATMULS:
        return _batch_matmul_flops(op) or None
    if op.type in _DEPTHWISE_GRADIENTS:
        return _depthwise_gradient_flops(op) or None
    return None


def _count_flops(graph: Any) -> dict[str, int]:
    """FLOPs per op from TensorFlow's profiler; a while loop gets its body's FLOPs times its trip
    count (the profiler itself gives loops 0), recursively for nested loops; an ``Einsum`` gets
    :func:`_einsum_flops` where the profiler has no figure; batch matmuls and depthwise
    gradients our own count (:func:`_own_count`: the profiler's is wrong or missing)."""
    flops = _profiled_flops(graph)
    for op in graph.get_operations():
        own = _own_count(op)
        if own is not None:
            flops[op.name] = own
        if op.type == "Einsum" and not flops.get(op.name):
            counted = _einsum_flops(op)
            if counted:
                flops[op.name] = counted
        if op.type not in _LOOP_OPS:
            continue
        trips = _trip_count(op)
        try:
            body = graph._get_function(op.get_attr("body").name).graph
        except (AttributeError, KeyError, ValueError, TypeError):
            body = None
        if not trips or body is None:
            logger.debug("loop %s: trip count or body unknown; its FLOPs stay 0", op.name)
            continue
        flops[op.name] = flops.get(op.name, 0) + trips * sum(_count_flops(body).values())
    return flops


def _profiled_flops(graph: Any) -> dict[str, int]:
    from tensorflow.python.profiler import option_builder

    opts = (
        option_builder.ProfileOptionBuilder(option_builder.ProfileOptionBuilder.float_operation())
        .with_empty_output()
        .build()
    )
    root = tf.compat.v1.profiler.profile(graph=graph, options=opts)
    flops: dict[str, int] = {}
    stack = list(root.children)
    while stack:
        node = stack.pop()
        if node.float_ops:
            flops[node.name] = int(node.float_ops)
        stack.extend(node.children)
    return flops


def _sparse_gradients(variables: Sequence[Any], grads: Sequence[Any]) -> dict[int, SparseGradient]:
    """``id(variable)`` -> its gradient as ``tf.IndexedSlices`` (a gathered variable's: the
    looked-up rows and their indices), for each of ``variables`` whose gradient TensorFlow left
    sparse. ``tf.gradients`` adds a variable's gradients from several reads as Keras's
    ``GradientTape`` does (``AggregateIndexedSlicesGradients``): slices from several gathers are
    concatenated, and any dense read (a tied output projection) makes the sum dense, so a
    variable read densely anywhere has no record. Rows unknown in the trace count as dense."""
    found: dict[int, SparseGradient] = {}
    for variable, grad in zip(variables, grads):
        if not isinstance(grad, tf.IndexedSlices):
            continue
        rows = grad.indices.shape[0] if grad.indices.shape.rank == 1 else None
        row_shape = grad.values.shape[1:]
        if rows is None or not row_shape.is_fully_defined():
            logger.debug("%s: sparse gradient of unknown rows, counted dense", variable.path)
            continue
        dense = math.prod(int(d) for d in variable.shape) * tf.as_dtype(variable.dtype).size
        found[id(variable)] = SparseGradient(
            variable=str(getattr(variable, "path", None) or variable.name),
            rows_per_step=int(rows),
            row_bytes=math.prod(int(d) for d in row_shape) * grad.values.dtype.size,
            index_bytes=grad.indices.dtype.size,
            dense_bytes=dense,
        )
    return found


def _sparse_by_unit(
    units: Sequence[Unit], sparse: Mapping[int, SparseGradient]
) -> dict[str, tuple[SparseGradient, ...]]:
    """Each unit's sparse gradients: those of the variables it holds first
    (:func:`passes.weightless.variable_owners`, as its read op's layer)."""
    by_unit: dict[str, list[SparseGradient]] = {}
    for var_id, unit in weightless.variable_owners(units).items():
        if var_id in sparse:
            by_unit.setdefault(unit, []).append(sparse[var_id])
    return {unit: tuple(found) for unit, found in by_unit.items()}


def _layer_info(unit: Unit, sparse: tuple[SparseGradient, ...] = ()) -> LayerInfo:
    weights = list(getattr(unit.operation, "weights", []) or [])
    trainable_ids = {id(w) for w in getattr(unit.operation, "trainable_weights", []) or []}
    num = trainable = nbytes = tbytes = tensors = 0
    for w in weights:
        count = math.prod(int(d) for d in w.shape)
        size = count * tf.as_dtype(w.dtype).size
        num += count
        nbytes += size
        if id(w) in trainable_ids:
            trainable += count
            tbytes += size
            tensors += 1
    return LayerInfo(
        name=unit.name,
        class_name=type(unit.operation).__name__,
        num_params=num,
        trainable_params=trainable,
        param_bytes=nbytes,
        trainable_param_bytes=tbytes,
        sparse_gradients=sparse,
        trainable_tensors=tensors,
    )


def _topological(ops: list[Op], edges: list[Edge]) -> tuple[Op, ...]:
    """``ops`` in a topological order, as close to creation order as the edges allow.

    Creation order is usually topological, but not always: the gradient of a ``while_v2`` loop
    (an LSTM) adds accumulator inputs, created during the backward pass, to the forward ``While``.
    """
    position = {op.id: i for i, op in enumerate(ops)}
    if all(position[e.src] < position[e.dst] for e in edges):
        return tuple(ops)
    graph: nx.DiGraph[int] = nx.DiGraph()
    graph.add_nodes_from(range(len(ops)))
    graph.add_edges_from((position[e.src], position[e.dst]) for e in edges)
    try:  # Kahn's algorithm taking the earliest-created ready op first
        order = list(nx.lexicographical_topological_sort(graph))
    except nx.NetworkXUnfeasible:  # a cycle: leave it to Graph's validation to report
        return tuple(ops)
    return tuple(ops[i] for i in order)


def _trace_step(
    model: keras.Model,
    specs: Sequence[tf.TensorSpec],
    recorder: _CallRecorder,
    *,
    given: ShapeArg | None,
) -> tuple[Any, int | None, dict[int, SparseGradient]]:
    """The concrete function of one training step (forward with ``recorder`` on, a synthetic
    loss, ``tf.gradients``), the number of ops before the gradients (None if unknown), and the
    variables whose gradients are ``tf.IndexedSlices`` (:func:`_sparse_gradients`). ``given``:
    the ``input_shape`` the specs were made with, which a failure names."""
    boundary: list[int] = []

    def step(*inputs: tf.Tensor) -> Any:
        graph = tf.compat.v1.get_default_graph()
        sparse.clear()  # a retrace (see _CallRecorder.recording) starts over
        with recorder.recording(graph):
            outputs = model(model_input(model, inputs), training=True)
        loss = _synthetic_loss(outputs)
        boundary.append(len(graph.get_operations()))
        variables = [v.value for v in model.trainable_variables]
        grads = tf.gradients(loss, variables) if variables else []
        sparse.update(_sparse_gradients(model.trainable_variables, grads))
        return loss, [g for g in grads if g is not None]

    sparse: dict[int, SparseGradient] = {}
    try:
        concrete = tf.function(step, autograph=False).get_concrete_function(*specs)
    except TraceError:
        raise
    except Exception as exc:
        raise _trace_failure(model, specs, exc, recorder, given) from exc
    return concrete, boundary[-1] if boundary else None, sparse


def _weightless_step(
    model: keras.Model,
    specs: Sequence[tf.TensorSpec],
    recorder: _CallRecorder,
    given: ShapeArg | None,
    repeat: blocks.Repeat | None = None,
) -> tuple[Any, int | None, tuple[dict[str, tuple[str, str]], dict[int, SparseGradient]]]:
    """:func:`_trace_step` for a weightless model (:mod:`passes.weightless`; ``given`` likewise):
    each variable a ``tf.TensorSpec`` argument, mapped onto it by a ``StatelessScope`` while the
    forward runs, the gradients taken with respect to them. Also returns each variable argument's
    op name -> its unit, and the sparse gradients. With ``repeat``, the blocks past the second are
    skipped (:func:`passes.blocks.reduced_call`), and so are their variables' arguments."""
    skipped = blocks.skipped_variables(model, repeat) if repeat is not None else set()
    trainable = [v for v in model.trainable_variables if id(v) not in skipped]
    frozen = [v for v in model.non_trainable_variables if id(v) not in skipped]
    variables = trainable + frozen
    forward = blocks.reduced_call(model, repeat) if repeat is not None else None
    var_specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    boundary: list[int] = []
    assigns: dict[str, Any] = {}
    sparse: dict[int, SparseGradient] = {}

    def step(inputs: list[tf.Tensor], values: list[tf.Tensor]) -> Any:
        graph = tf.compat.v1.get_default_graph()
        assigns.clear()  # a retrace (see _CallRecorder.recording) starts over
        sparse.clear()
        mapping = list(zip(variables, values))
        with keras.StatelessScope(mapping, initialize_variables=False) as scope:
            with recorder.recording(graph):
                batch = model_input(model, inputs)
                outputs = forward(batch) if forward else model(batch, training=True)
        for variable, value in mapping:  # what the step assigns (a seed, BatchNorm statistics)
            update = scope.state_mapping.get(id(variable))
            if update is not None and update is not value:
                assigns[tf.identity(update).op.name] = variable
        loss = _synthetic_loss(outputs)
        boundary.append(len(graph.get_operations()))
        grads = tf.gradients(loss, values[: len(trainable)]) if trainable else []
        sparse.update(_sparse_gradients(trainable, grads))
        return loss, [g for g in grads if g is not None]

    try:
        concrete = tf.function(step, autograph=False).get_concrete_function(list(specs), var_specs)
    except TraceError:
        raise
    except Exception as exc:
        raise _trace_failure(model, specs, exc, recorder, given) from exc
    owner_of_var = weightless.variable_owners(recorder.units)
    arguments = concrete.graph.inputs[len(specs) : len(specs) + len(variables)]
    owners = {
        t.op.name: (owner_of_var[id(v)], "ReadVariableOp")
        for t, v in zip(arguments, variables)
        if id(v) in owner_of_var
    }
    owners.update(
        (name, (owner_of_var[id(v)], "AssignVariableOp"))
        for name, v in assigns.items()
        if id(v) in owner_of_var
    )
    return concrete, boundary[-1] if boundary else None, (owners, sparse)


def _trace_failure(
    model: keras.Model,
    specs: Sequence[tf.TensorSpec],
    exc: Exception,
    recorder: _CallRecorder,
    given: ShapeArg | None,
) -> TraceError:
    """One line for a model TensorFlow could not trace: the layer that raised, Keras's own
    message, and the batch and input shapes of the trace beside the model's own (the arguments
    to change; ``given``: the ``input_shape`` the specs were made with)."""
    bad_scope = re.search(r"'([^']*)' is not a valid scope name", message_of(exc))
    if bad_scope:
        return TraceError(
            f"layer name {bad_scope.group(1)!r} of model {model.name!r} is not a valid "
            "TensorFlow scope name (letters, digits and _ . / > - only); rename the layer"
        )
    where = f"model {model.name!r}"
    kinds = {u.name: type(u.operation).__name__ for u in recorder.units}
    if recorder.failed_in is not None:
        where = f"layer {recorder.failed_in!r} ({kinds[recorder.failed_in]}) of {where}"
    said = error_line(exc)
    return quoting(
        TraceError(
            f"{where} raised {type(unwrapped(exc)).__name__} while traced: {said}; "
            f"{_traced_at(model, specs, given)}"
        ),
        said,
    )


def _traced_at(model: keras.Model, specs: Sequence[tf.TensorSpec], given: ShapeArg | None) -> str:
    """The batch (and the input shapes, where they are not the model's own) a failed trace ran
    at, as arguments (``batch_size=64``, ``input_shape=(10,)``), beside the model's own input
    shapes and its fixed batch, if it has one (``keras.Input(batch_shape=...)``, as a stateful
    RNN needs). A model that declares no inputs (a subclassed one) has no shape of its own to
    show: the ``input_shape`` given (``given``), when one was, is named as the one traced.
    :func:`partitioner.core.batching.at_share` says which share of the batch the batch was."""
    batch = int(specs[0].shape[0])
    text = f"{TRACED_AT}batch_size={batch}"
    own = [tuple(t.shape) for t in _declared_inputs(model)]
    if not own and given is not None:
        return text + f" with input_shape={_given_shapes(model, specs, given)!r}"
    if len(own) != len(specs):
        return text
    names = input_names(model)
    traced = [tuple(s.shape)[1:] for s in specs]
    differ = [k for k, (o, t) in enumerate(zip(own, traced)) if tuple(o[1:]) != t]
    if differ:
        shown: Any = traced[0] if len(specs) == 1 else {names[k]: traced[k] for k in differ}
        owned: Any = own[0][1:] if len(specs) == 1 else {names[k]: own[k][1:] for k in differ}
        text += f" with input_shape={shown!r}; the model's own input is {owned!r}"
    fixed = sorted({int(o[0]) for o in own if o[0] is not None})
    if fixed and fixed != [batch]:
        text += (
            f"; the model's input has a fixed batch of {fixed[0]} (keras.Input(batch_shape=...), "
            f"as a stateful layer needs): plan it at batch_size={fixed[0]}"
        )
    return text


def _given_shapes(model: keras.Model, specs: Sequence[tf.TensorSpec], given: ShapeArg) -> Any:
    """The shapes ``given`` put in the specs, spelled as the argument: one shape, or input name
    -> shape for the names it keyed."""
    traced = [tuple(int(d) for d in s.shape[1:]) for s in specs]
    if not isinstance(given, Mapping):
        return traced[0]
    return {n: t for n, t in zip(input_names(model), traced) if n in given}


def _tensor_reader(tf_ops: Sequence[Any]) -> Callable[[Any], tuple[tuple[int, ...], str, int]]:
    """``tensor_bytes(t)``: a tensor's dimensions, dtype and bytes (a loop's tensor lists at
    their reserved size), read once per tensor (reading a shape is slow)."""
    list_bytes: dict[tuple[str, int], int] = {
        (op.name, i): size
        for op in tf_ops
        if op.type in _LOOP_OPS
        for i, size in _loop_list_bytes(op).items()
    }
    seen: dict[tuple[str, int], tuple[tuple[int, ...], str, int]] = {}

    def tensor_bytes(t: Any) -> tuple[tuple[int, ...], str, int]:
        key = (t.op.name, t.value_index)
        if key not in seen:
            dims, dtype, size = _tensor_bytes(t)
            seen[key] = (dims, dtype, list_bytes.get(key, size))
        return seen[key]

    return tensor_bytes


def _ops_and_edges(
    tf_ops: Sequence[Any],
    forward_end: int,
    recorder: _CallRecorder,
    flops: dict[str, int],
    fixed_owners: Mapping[str, tuple[str, str]],
) -> tuple[list[Op], list[Edge]]:
    """The IR's ops (with their owning layer and phase) and edges, in creation order;
    ``fixed_owners`` names the layer and the op type of the stand-ins made outside every layer
    call (a weightless trace's variable arguments and update assignments)."""
    tensor_bytes = _tensor_reader(tf_ops)
    owner: dict[str, str | None] = {}
    ops: list[Op] = []
    edges: list[Edge] = []
    for pos, op in enumerate(tf_ops):
        if pos < forward_end:
            phase = Phase.FORWARD
            stand_in = fixed_owners.get(op.name)
            layer = stand_in[0] if stand_in else recorder.owner_of(pos)
        else:
            phase = Phase.BACKWARD
            layer = _backward_owner(op, owner)
        owner[op.name] = layer
        outputs = [tensor_bytes(out) for out in op.outputs]
        # a weightless trace's stand-ins: an argument for a variable's read, an identity for
        # the assignment of its update (which outputs nothing)
        op_type = fixed_owners[op.name][1] if op.name in fixed_owners else op.type
        if op_type == "ReadVariableOp" and op.name in fixed_owners:
            _resource_handle(op.name, layer, phase, ops, edges)
        ops.append(
            Op(
                id=op.name,
                op_type=op_type,
                layer=layer,
                phase=phase,
                output_shapes=tuple(o[0] for o in outputs),
                output_dtypes=tuple(o[1] for o in outputs),
                output_bytes=0 if op_type == "AssignVariableOp" else sum(o[2] for o in outputs),
                flops=flops.get(op.name, 0),
                transposed_bytes=_transposed_bytes(op) if "MatMul" in op.type else 0,
            )
        )
        for t in op.inputs:
            edges.append(
                Edge(
                    src=t.op.name, dst=op.name, bytes=tensor_bytes(t)[2], output_index=t.value_index
                )
            )
    return ops, edges


def _resource_handle(
    read: str, layer: str | None, phase: Phase, ops: list[Op], edges: list[Edge]
) -> None:
    """The resource handle a weightless trace's stand-in ``read`` stands in for, as the step
    with weights has it (a ``Placeholder`` of the layer, feeding the read): each op is priced a
    dispatch on a CPU, and the same model planned with and without its weights had other step
    times (4%, campaign 34ah)."""
    handle = f"{read}/resource"
    ops.append(
        Op(id=handle, op_type="Placeholder", layer=layer, phase=phase,
           output_shapes=((),), output_dtypes=("resource",))
    )  # fmt: skip
    edges.append(Edge(src=handle, dst=read, bytes=0, output_index=0))


def _backward_owner(op: Any, owner: Mapping[str, str | None]) -> str | None:
    """The layer of a backward op: that of the forward op it is colocated with, if any.

    tf.gradients' sum of a tensor's gradients from its several consumers is colocated with one
    of them, which may sit far downstream (MobileNet's residuals: a later block's conv). Left as
    glue, the layer view merges it into the earliest consumer, so gradients keep flowing back
    along the layer order.
    """
    groups = () if _GRADIENT_SUM.search(op.name) else op.colocation_groups()
    for group in groups:
        target = group.decode()[len("loc:@") :] if group.startswith(b"loc:@") else ""
        if target and target != op.name and target in owner:
            return owner[target]
    return None


def _graph_of(
    model: keras.Model, batch_size: int, concrete: Any, forward_end: int | None, parts: Any
) -> tuple[Graph, float]:
    """The IR of the traced ``concrete`` step, and the seconds its FLOP count took; ``parts``
    is (recorder, units, (the variable arguments' owners, the sparse gradients))."""
    recorder, units, (fixed_owners, sparse) = parts
    sparse_of = _sparse_by_unit(units, sparse)
    tf_ops = concrete.graph.get_operations()
    t1 = time.perf_counter()
    flops = _count_flops(concrete.graph)
    flops_time_s = time.perf_counter() - t1
    end = len(tf_ops) if forward_end is None else forward_end
    ops, edges = _ops_and_edges(tf_ops, end, recorder, flops, fixed_owners)
    if fixed_owners and not any(op.op_type == "NoOp" for op in ops):
        # a step with weights ends in the NoOp its updates' control dependencies gather on
        ops.append(Op(id="NoOp", op_type="NoOp", layer=None, phase=Phase.BACKWARD))
    graph = Graph(
        name=model.name,
        ops=_topological(ops, edges),
        edges=tuple(edges),
        layers=tuple(_layer_info(u, sparse_of.get(u.name, ())) for u in units),
        batch_size=batch_size,
        target_bytes=_target_bytes(tf_ops[:end]),
    )
    return graph, flops_time_s


def _skipped_sparse(graph: Graph, repeat: blocks.Repeat) -> Graph:
    """``graph`` (a repeat expanded from two traced blocks) with each skipped block's layers
    given the sparse gradients of their counterparts in block 1 (whose variables were not
    arguments of the trace, so TensorFlow made no gradient for them)."""
    layers = list(graph.layers)
    for k, info in enumerate(layers):
        block = repeat.block_of(k)
        if block is None or block < 2:
            continue
        twin = layers[k - (block - 1) * repeat.period]
        if twin.sparse_gradients and not info.sparse_gradients:
            renamed = tuple(
                replace(g, variable=g.variable.replace(twin.name, info.name, 1))
                for g in twin.sparse_gradients
            )
            layers[k] = replace(info, sparse_gradients=renamed)
    if layers == list(graph.layers):
        return graph
    return replace(graph, layers=tuple(layers))


def _weightless_graph(
    model: keras.Model,
    specs: Sequence[tf.TensorSpec],
    units: Sequence[Unit],
    batch_size: int,
    given: ShapeArg | None,
) -> tuple[Graph, float]:
    """The IR of a weightless model's step, and the seconds its FLOP count took. A run of
    repeated blocks (:mod:`passes.blocks`) is traced two blocks deep and the other blocks are
    written from the second; where that is not exact, the whole model is traced. ``given``: the
    ``input_shape`` the specs were made with."""
    repeat = blocks.find_repeat(model, [u.name for u in units])
    if repeat is not None and blocks.worth_reducing(repeat, [_layer_count(u) for u in units]):
        recorder = _CallRecorder(units)
        concrete, end, owners = _weightless_step(model, specs, recorder, given, repeat)
        reduced, flops_s = _graph_of(model, batch_size, concrete, end, (recorder, units, owners))
        full = blocks.expand_repeat(reduced, repeat)
        if full is not None:
            logger.debug("traced 2 of %d blocks of %d layers", repeat.count, repeat.period)
            return _skipped_sparse(full, repeat), flops_s
        logger.debug("the %d repeated blocks differ in their ops: tracing all", repeat.count)
    recorder = _CallRecorder(units)
    concrete, end, owners = _weightless_step(model, specs, recorder, given)
    return _graph_of(model, batch_size, concrete, end, (recorder, units, owners))


def _layer_count(unit: Unit) -> int:
    """How many Keras layers ``unit`` is, its sublayers included (an op of the functional API:
    one)."""
    flatten = getattr(unit.operation, "_flatten_layers", None)
    return max(1, len(list(flatten()))) if callable(flatten) else 1


def trace_model(
    model: keras.Model, *, batch_size: int, input_shape: ShapeArg | None = None
) -> TraceResult:
    """Trace one training step of ``model`` (forward, synthetic loss, backward) into a Graph."""
    with KERAS_CALL_LOCK:  # one trace at a time in a process (see KERAS_CALL_LOCK)
        locked = bool(getattr(getattr(model, "_tracker", None), "locked", False))
        try:
            return _trace_model(model, batch_size, input_shape)
        finally:
            if not locked and getattr(model, "_tracker", None) is not None:
                model._tracker.unlock()  # built here, not by the user: its code may still add
                # state as to an unbuilt model (keras.io's GAN, in its compile: campaign 34ab)


def _trace_model(model: keras.Model, batch_size: int, input_shape: ShapeArg | None) -> TraceResult:
    t0 = time.perf_counter()
    specs = input_specs(model, batch_size, input_shape)
    build_sublayers(model, specs, given=input_shape)  # not inside the step: see unbuilt_layers
    units = placement_units(model)
    if not units:
        raise TraceError(f"model {model.name!r} has no layers to place")
    without_weights = weightless.is_weightless(model)
    concrete = None
    if without_weights:
        graph, flops_time_s = _weightless_graph(model, specs, units, batch_size, input_shape)
    else:
        recorder = _CallRecorder(units)
        concrete, forward_end, sparse = _trace_step(model, specs, recorder, given=input_shape)
        parts: tuple[Any, ...] = (recorder, units, ({}, sparse))
        graph, flops_time_s = _graph_of(model, batch_size, concrete, forward_end, parts)
    trace_time_s = time.perf_counter() - t0 - flops_time_s
    logger.debug(
        "traced %s: %d ops, %d edges, %d layers in %.2fs (+%.2fs FLOPs)",
        model.name,
        len(graph.ops),
        len(graph.edges),
        len(units),
        trace_time_s,
        flops_time_s,
    )
    return TraceResult(
        graph=graph,
        units=units,
        trace_time_s=trace_time_s,
        flops_time_s=flops_time_s,
        step_function=concrete,
        weightless=without_weights,
        tf32_enabled=bool(tf.config.experimental.tensor_float_32_execution_enabled()),
        input_bounds=integer_input_bounds(model),
    )
