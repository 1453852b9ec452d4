"""Plan-time checks on the Keras model: what the rewrites would refuse, found before the slow work
or before a plan is returned, each in one line (issue 17).

* :func:`check_model`: a model class that overrides ``train_step`` / ``compute_loss`` /
  ``test_step`` (the rewrites run their own step, which would silently train another loss), and
  layers the rewrites cannot rebuild from their config (they rebuild every layer with the
  rewrite's own ``_fresh_copy``, called here on every layer: one home for the condition).
* :func:`join_neighbours`: layers that emit no ops have no edge in the traced graph, so a solver
  places them anywhere; each joins the device (or stage) of the layer feeding it in the Keras
  graph, else of the layer it feeds.
* :func:`check_applyable`: a plan that trains in stages is split into stages by the pipeline
  rewrite's own code (``passes.rewrite.pipeline._split``, the one home of what it
  refuses: a subclassed model, a nested model over several devices, devices that feed each other
  in a cycle, a stage order other than the plan's) before the plan is returned.
* :func:`inexact_layers`: the layers, nested ones too, that are not exact when the batch is split
  (micro-batches or replicas), by :func:`partitioner.core.microbatch.inexact_reason`.
* :func:`check_batch_split`: a plan that splits each batch (replicas, micro-batches) on a model
  with a sparse or ragged input, which the rewrites split as dense tensors only.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import keras

from partitioner.core.errors import RewriteError
from partitioner.core.ir import Graph
from partitioner.core.microbatch import InexactKind, InexactLayer, LayerFacts, inexact_reason
from partitioner.plan.model import Plan
from passes.trace import OWN_STEPS, Unit, fixed_batch, input_names, placement_units

__all__ = [
    "OWN_STEPS",
    "batch_split_refusal",
    "check_applyable",
    "check_batch_split",
    "check_model",
    "fixed_batch",
    "in_place_reason",
    "inexact_layers",
    "join_neighbours",
    "layer_facts",
    "masks_steps",
    "opless_layers",
    "rebuild_refusal",
]

_LABEL = TypeVar("_LABEL")


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line: Keras's own reason when it wraps one, else the whole
    message with its line breaks folded; past ``limit`` characters, cut after its last whole
    sentence that fits (else its last whole word), never inside a word."""
    text = str(exc)
    if "Exception encountered:" in text:
        text = text.rsplit("Exception encountered:", 1)[1]
    flat = " ".join(text.split()) or type(exc).__name__
    if len(flat) <= limit:
        return flat
    head = flat[: limit - 4]
    ends = [m.end() for m in re.finditer(r"[.!?](?= )", head)]
    if ends and ends[-1] >= limit // 3:
        return f"{head[: ends[-1]]} ..."
    return f"{head.rsplit(' ', 1)[0] if ' ' in head else head}..."


def rebuild_refusal(model: Any, exc: BaseException) -> RewriteError:
    """The one-line error of a subclassed ``model`` that Keras cannot rebuild from its config
    (``exc``: why), for ``Plan.apply`` and emitted code alike."""
    return RewriteError(
        f"subclassed model {type(model).__name__} cannot be rebuilt from its config "
        f"({type(exc).__name__}: {one_line(exc)}); give its __init__ serialisable arguments, "
        "pass **kwargs to super().__init__ and implement get_config/from_config"
    )


def check_own_steps(model: Any) -> None:
    """RewriteError when ``model``'s class, or the model object itself, overrides a step of
    :data:`OWN_STEPS`."""
    cls = type(model)
    own = vars(model) if hasattr(model, "__dict__") else {}
    if own.get("_partitioner_in_place") is not None:  # its methods are a placement's wrappers
        own = {}
    for name in OWN_STEPS:
        if name in own:
            who = f"model {getattr(model, 'name', '?')!r} has its own {name} (set on the object)"
        elif getattr(cls, name, None) is not getattr(keras.Model, name, None):
            owner = next((c for c in cls.__mro__ if name in vars(c)), cls)
            who = f"model class {owner.__name__} overrides {name}"
        else:
            continue
        raise RewriteError(
            f"{who}: partitioner's copies run their own steps (gradients colocated with their "
            "layers, micro-batches, replicas), which would silently replace yours"
        )


def check_rebuildable(model: Any) -> None:
    """RewriteError naming the first layer (or the subclassed model) that the rewrites cannot
    rebuild from its config, and why: the rewrite's own rebuild (``_fresh_copy``) of every layer
    of a Sequential or Functional model, of the model itself when it is subclassed."""
    from passes.rewrite.device_placement import _fresh_copy, _is_graph_model

    if _is_graph_model(model):
        targets = [
            (u.name, u.operation)
            for u in placement_units(model)
            if isinstance(u.operation, keras.Layer)
        ]
        targets[:0] = _nested_subclassed(model)
    else:
        targets = [(getattr(model, "name", "model"), model)]
    for name, layer in targets:
        try:
            fresh = _fresh_copy(layer)
        except Exception as exc:
            raise RewriteError(
                f"layer {name!r} ({type(layer).__name__}) cannot be rebuilt from its config, "
                f"which copying it onto a device needs ({type(exc).__name__}: {one_line(exc)}); "
                f"{_rebuild_advice(layer)}, or plan a model without it"
            ) from None
        dropped = _dropped_by_config(layer, fresh)
        if dropped is not None:
            raise RewriteError(
                f"layer {name!r} ({type(layer).__name__}) cannot be rebuilt from its config, "
                f"which copying it onto a device needs (rebuilt, it has {dropped}: its "
                "get_config leaves that argument out); add it to get_config, or plan a model "
                "without it"
            )


def _nested_subclassed(model: Any) -> list[tuple[str, Any]]:
    """The outermost subclassed models nested in the graph model ``model`` (through nested
    Functional and Sequential models): copying rebuilds each of them whole from its config."""
    from passes.rewrite.device_placement import _is_graph_model

    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        for layer in stack.pop().layers:
            if id(layer) in seen or not isinstance(layer, keras.Model):
                continue
            seen.add(id(layer))
            if _is_graph_model(layer):
                stack.append(layer)
            else:
                found.append((layer.name, layer))
    return found


_PLAIN = (int, float, str, bool, type(None))


def _dropped_by_config(layer: Any, fresh: Any) -> str | None:
    """For a layer of the user's own class: the first plain attribute named as a constructor
    argument (a number, a string, a tuple of them) that its rebuild from ``get_config``
    (``fresh``) holds at another value, as
    ``alpha=1.0 where the layer has alpha=3.0`` (a config that leaves a constructor argument
    out rebuilt the layer with its default, and the copy computed another function without a
    word, campaign 34ak); None when they agree. Keras's own layers are left out: their
    configs are whole, and some settle attributes in ``build``."""
    if type(layer).__module__.split(".")[0] == "keras":
        return None
    try:
        arguments = set(inspect.signature(type(layer).__init__).parameters) - {"self"}
    except (TypeError, ValueError):  # no signature to read: nothing to compare by
        return None
    mine, theirs = vars(layer), vars(fresh)
    for key, value in mine.items():  # the constructor's own arguments, kept under their names
        if key not in arguments or key not in theirs or not _plain(value):
            continue
        if _plain(theirs[key]) and theirs[key] != value:
            return f"{key}={theirs[key]!r} where the layer has {key}={value!r}"
    return None


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _rebuild_advice(layer: Any) -> str:
    """What makes ``layer`` rebuildable from its config: a plain function in it (a ``Lambda``'s,
    an ``activation`` or ``kernel_regularizer`` of a Keras layer) found again by name (a Python
    lambda has none); for a custom layer, its config; for Keras's own, its arguments."""
    register = "@keras.saving.register_keras_serializable()"
    try:
        names = _unregistered_functions(layer.get_config())
    except Exception:  # the config itself fails: the generic advice below
        names = []
    if isinstance(layer, keras.layers.Lambda) and not names:
        names = [getattr(getattr(layer, "function", None), "__name__", "<lambda>")]
    if names:
        head = "Keras finds a function in a layer's config again by its registered name"
        if "<lambda>" in names:
            head += ", and a Python lambda has none: make it a named function decorated with "
            head += register
        else:
            head += f": decorate {', '.join(names)} with {register}"
        alternative = "write a custom layer (a keras.layers.Layer subclass with get_config)"
        return f"{head}, or {alternative}"
    if type(layer).__module__.split(".")[0] == "keras":
        return (
            "it is Keras's own layer, so one of its arguments is what cannot be rebuilt: give it "
            "arguments Keras serialises (a built-in name, or a registered function or class)"
        )
    return (
        "pass **kwargs to super().__init__ and implement get_config (and from_config for "
        "layer arguments)"
    )


def _unregistered_functions(config: Any) -> list[str]:
    """The names of the plain functions ``config`` holds (``{"class_name": "function",
    "registered_name": "function", "config": "my_l2", ...}``: Keras saved a function it has no
    registered name for), in order, each once."""
    found: list[str] = []
    stack = [config]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if value.get("class_name") == "function" and value.get("registered_name") == "function":
                name = str(value.get("config"))
                found += [name] * (name not in found)
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return found


def check_model(model: Any) -> None:
    """What the copying rewrites refuse in ``model`` (its own training step, a layer that cannot
    be rebuilt from its config): such a model is placed in place instead
    (:func:`in_place_reason`, :mod:`passes.rewrite.in_place`)."""
    check_own_steps(model)
    check_rebuildable(model)


def in_place_reason(model: Any) -> str | None:
    """Why ``model`` is placed in place (``Plan.apply`` changes the model itself) rather than
    copied: what the copying rewrites refuse in it (:func:`check_model`), the clause before its
    advice; None for a model they copy."""
    try:
        check_model(model)
    except RewriteError as exc:
        return str(exc).split(": partitioner's copies", 1)[0].split(", which copying it", 1)[0]
    return None


# -- layers that emit no ops -------------------------------------------------------------------


def opless_layers(graph: Graph) -> frozenset[str]:
    """The layers of ``graph`` that own no op (identity-like layers, reshapes folded away)."""
    owning = {op.layer for op in graph.ops}
    return frozenset(layer.name for layer in graph.layers if layer.name not in owning)


def _source(tensor: Any, unit_of: Mapping[int, str], outer: Mapping[int, Any]) -> str | None:
    """The placement unit that produces ``tensor`` (through nested models), or None for a
    model input."""
    for _ in range(1000):
        history = getattr(tensor, "_keras_history", None)
        if history is None:
            return None
        op, _node, index = history
        if id(op) in unit_of:
            return unit_of[id(op)]
        if isinstance(op, keras.Model) and getattr(op, "outputs", None):
            tensor = keras.tree.flatten(op.outputs)[index]
        elif id(tensor) in outer:
            tensor = outer[id(tensor)]
        else:
            return None
    return None


def _producers(model: Any, units: Sequence[Unit]) -> dict[str, list[str]]:
    """Each unit's producing units in the Keras graph (empty for a subclassed model)."""
    unit_of = {id(u.operation): u.name for u in units}
    outer: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.Model) and getattr(layer, "inputs", None):
            for node in layer._inbound_nodes[:1]:
                for inner, given in zip(keras.tree.flatten(layer.inputs), node.input_tensors):
                    outer.setdefault(id(inner), given)
    producers: dict[str, list[str]] = {}
    for unit in units:
        found: list[str] = []
        for node in getattr(unit.operation, "_inbound_nodes", []) or []:
            for tensor in node.input_tensors:
                name = _source(tensor, unit_of, outer)
                if name is not None and name != unit.name and name not in found:
                    found.append(name)
        producers[unit.name] = found
    return producers


def join_neighbours(
    model: Any, labels: Mapping[str, _LABEL], opless: frozenset[str]
) -> dict[str, _LABEL]:
    """``labels`` (layer -> device or stage) with every layer of ``opless`` moved to the label of
    the first layer feeding it in the Keras graph, else of the first layer it feeds."""
    out = dict(labels)
    if not opless:
        return out
    units = placement_units(model)
    producers = _producers(model, units)
    consumers: dict[str, list[str]] = {u.name: [] for u in units}
    for name, feeding in producers.items():
        for p in feeding:
            consumers[p].append(name)
    joined: set[str] = set()
    for unit in units:  # producers first, in order, so a chain of op-less layers follows along
        fed = [p for p in producers[unit.name] if p not in opless or p in joined]
        if unit.name in opless and fed:
            out[unit.name] = out[fed[0]]
            joined.add(unit.name)
    for unit in reversed(units):  # then, fed by model inputs only: the layer it feeds
        fed_to = [c for c in consumers[unit.name] if c not in opless or c in joined]
        if unit.name in opless and unit.name not in joined and fed_to:
            out[unit.name] = out[fed_to[0]]
            joined.add(unit.name)
    return out


# -- is the plan applyable ---------------------------------------------------------------------


def _batch_shares(plan: Plan) -> str | None:
    """How ``plan`` splits each batch ("2 replicas", "4 micro-batches"), or None."""
    strategy = plan.strategy
    replicas = strategy.replicas if strategy is not None else 1
    micro = max(
        strategy.num_microbatches if strategy is not None else 1,
        plan.pipeline.num_microbatches if plan.pipeline is not None else 1,
    )
    parts = [f"{replicas} replicas"] * (replicas > 1) + [f"{micro} micro-batches"] * (micro > 1)
    return " x ".join(parts) or None


def batch_split_refusal(model: Any, shares: str, micro_batches: bool = True) -> str | None:
    """Why ``model``'s batch cannot be split into ``shares`` ("2 replicas"), or None: a fixed
    batch (each share would be another batch), a sparse or ragged input (the rewrites cut a
    batch's rows with ``tf.split`` and slices, which take dense tensors only), a model placed in
    place (:func:`in_place_reason`) when ``micro_batches`` (pipelines run a step of partitioner's
    own; such a model keeps its own, so it takes whole batches or data-parallel replicas)."""
    in_place = in_place_reason(model) if micro_batches else None
    if in_place is not None:
        return (
            f"{in_place}: Plan.apply places such a model itself (in place), on whole batches "
            f"or as data-parallel replicas, and the plan splits each batch into {shares}, "
            "which partitioner runs on copies of the layers in a training step of its own; "
            "plan with strategy='placed', strategy='single' or strategy='data_parallel'"
        )
    fixed = fixed_batch(model)
    if fixed is not None:
        return (
            f"model {model.name!r} has a fixed batch of {fixed} (keras.Input(batch_shape=...), "
            f"as a stateful layer needs), and the plan splits each batch into {shares}, each "
            "share another batch; plan with strategy='placed' or strategy='single', which run "
            "whole batches"
        )
    try:
        inputs = list(model.inputs or [])
    except Exception:  # a subclassed model never called: no declared inputs, all dense
        return None
    odd = [
        f"{name!r} ({'sparse' if getattr(t, 'sparse', False) else 'ragged'})"
        for name, t in zip(input_names(model), inputs)
        if getattr(t, "sparse", False) or getattr(t, "ragged", False)
    ]
    if not odd:
        return None
    return (
        f"model {model.name!r} takes input {', '.join(odd)}, and the plan splits each batch "
        f"into {shares}, which the rewrites do for dense inputs only; plan with "
        "strategy='placed' or strategy='single', or feed the input dense"
    )


def check_batch_split(model: Any, plan: Plan) -> None:
    """RewriteError (one line) when ``plan`` splits each batch into shares (replicas,
    micro-batches) that ``model`` cannot take (:func:`batch_split_refusal`)."""
    shares = _batch_shares(plan)
    strategy = plan.strategy
    micro = plan.pipeline is not None or (
        strategy is not None and (strategy.num_microbatches > 1 or strategy.stages > 1)
    )
    why = None if shares is None else batch_split_refusal(model, shares, micro)
    if why is not None:
        raise RewriteError(why)


def check_applyable(model: Any, plan: Plan) -> None:
    """RewriteError (one line) when the rewrite would refuse ``plan`` on ``model``: a plan that
    splits the batch of a sparse input (:func:`check_batch_split`); a pipelined plan is split
    into stages by the pipeline rewrite's own code (``_split``), and a one-replica pipeline's
    stage order must be the plan's, as ``pipeline_model`` requires."""
    from passes.rewrite.pipeline import _split

    check_batch_split(model, plan)
    strategy = plan.strategy
    replicated = strategy is not None and strategy.replicas > 1 and strategy.stages > 1
    if replicated and strategy is not None and strategy.num_microbatches == 1:
        raise RewriteError(
            f"the plan runs {strategy.describe()}: replicas of a plain split are not supported "
            "by the rewrite; plan with strategy='pipeline' or strategy='data_parallel'"
        )
    if plan.pipeline is not None:
        labels = dict(zip(plan.layer_order, plan.device_of_layer))
        expected: list[int] | None = list(plan.pipeline.stage_devices)
    elif replicated and strategy is not None:
        labels, expected = dict(zip(plan.layer_order, strategy.stage_of_layer)), None
    else:
        return
    by_unit = {
        id(u.operation): f"device {labels[u.name]}"
        for u in placement_units(model)
        if u.name in labels
    }
    try:
        prefer = [f"device {d}" for d in expected or ()]
        order = [stage.device for stage in _split(model, by_unit, prefer).stages]
    except RewriteError as exc:
        raise RewriteError(f"the plan cannot be pipelined: {one_line(exc, 400)}") from None
    if expected is not None and order != [f"device {d}" for d in expected]:
        raise RewriteError(
            f"the plan's stage order {expected} is not the dataflow order of {model.name!r}'s "
            f"layers on those devices {order}; plan with pipeline=False or another solver"
        )


# -- layers not exact under a split batch ------------------------------------------------------


def layer_facts(layer: Any) -> LayerFacts:
    """What :func:`~partitioner.core.microbatch.inexact_reason` needs to know about ``layer``."""
    rates = tuple(
        float(getattr(layer, a))
        for a in ("rate", "dropout", "recurrent_dropout", "stddev")
        if isinstance(getattr(layer, a, None), (int, float))
        and not isinstance(getattr(layer, a), bool)
    )
    return LayerFacts(
        class_names=tuple(c.__name__ for c in type(layer).__mro__),
        rates=rates,
        trainable=bool(getattr(layer, "trainable", True)),
        draws_randomness=getattr(layer, "seed_generator", None) is not None,
        masks=masks_steps(layer),
    )


def masks_steps(layer: Any) -> bool:
    """Whether ``layer`` makes a mask of time steps: a ``Masking`` layer, an ``Embedding``
    with ``mask_zero=True`` (:class:`~partitioner.core.microbatch.InexactKind` ``MASKED_LOSS``)."""
    return isinstance(layer, keras.layers.Masking) or bool(getattr(layer, "mask_zero", False))


def inexact_layers(
    model: Any, units: Sequence[Unit] | None = None
) -> tuple[tuple[InexactLayer, str], ...]:
    """``(why, layer name)`` of every layer of ``model`` (nested ones too: blocks, nested models,
    named ``unit/inner``) that is not exact when the batch is split, in layer order."""
    found: list[tuple[InexactLayer, str]] = []
    seen: set[int] = set()
    for unit in units if units is not None else placement_units(model):
        op = unit.operation
        layers = (
            op._flatten_layers(include_self=True, recursive=True)
            if hasattr(op, "_flatten_layers")
            else [op]
        )
        for layer in layers:
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            why = inexact_reason(layer_facts(layer))
            if why is not None:
                found.append((why, unit.name if layer is op else f"{unit.name}/{layer.name}"))
    return (*found, *_own_step(model))


_OWN_LOSS_STEPS = ("train_step", "compute_loss")


def _own_step(model: Any) -> tuple[tuple[InexactLayer, str], ...]:
    """``model`` as an inexact entry when its class computes its training loss its own way
    (``train_step``, ``compute_loss``): each replica runs it on its share, and a loss coupling
    the samples of a batch (a contrastive loss's in-batch negatives) sees 1/R of them (a
    SimCLR-style step: weights off by 50-100% after one step on 2 replicas, campaign 34z)."""
    cls = type(model)
    owned = [n for n in _OWN_LOSS_STEPS if getattr(cls, n, None) is not getattr(keras.Model, n)]
    if not owned:
        return ()
    why = (
        f"computes its loss in its own {owned[0]}, which runs on each part of the batch: a loss "
        "that couples a batch's samples (in-batch negatives, a contrastive loss) sees only the "
        "part's, so its gradient differs from one device's; a mean of per-sample losses is exact"
    )
    return ((InexactLayer(cls.__name__, InexactKind.OWN_STEP, why), str(model.name)),)
