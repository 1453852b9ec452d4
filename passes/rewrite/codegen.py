"""Emitted code: a readable Python module that rebuilds a model with its layers on their devices.

``emit_placed_module(model, layer_devices)`` returns the source of a module that a user can read,
edit and import; ``write_placed_module(path, source)`` writes it atomically once it compiles.
Importing the module and calling its ``build_model()`` gives a model whose weight order is the
original's, so ``load_original_weights(model, original)`` (``set_weights(original.get_weights())``)
makes it compute what the original computes.

What the module holds
---------------------
* **Sequential and Functional models** (nested ones included) become a ``keras.Model`` subclass,
  ``PlacedModel``, whose ``call`` replays the original graph node by node in topological order,
  each step inside ``with tf.device(DEVICES["<layer>"]):``. The layers are made in ``make_layers()``
  from their class and config, written as Python literals with default arguments left out
  (``keras.layers.Dense(name="dense_in", units=512, activation="relu")``), in the original's weight
  order. Nested models are inlined (their layers keep their names and weight order); a shared layer
  is made once and called once per use; functional-API ops (``keras.ops.add``) are written as the
  ``keras.ops`` call where that is exact, else made from their class and config.

  Why not functional-API code: in Keras 3 a ``tf.device`` scope around a *symbolic* functional-API
  call places nothing at run time (the functional model later runs its layers outside the scope),
  so the scope has to be entered by a ``call`` that runs on every step.
* **Subclassed models** cannot be written out layer by layer: the module imports the user's file
  (its path in ``MODEL_SOURCE``, which the user can edit), rebuilds the model from its class and
  config, and pins each sublayer's ``build`` and ``call`` under ``tf.device`` of its entry in
  ``DEVICES``. Ops in the model's own ``call`` outside every sublayer stay unplaced.

Inputs from other devices: every placed layer's ``call`` runs through the emitted ``on_device``,
which first copies each input tensor made on another device onto the layer's device (the emitted
``received``, a copy of ``passes.rewrite.device_placement.received_on``: the module imports
nothing of partitioner). Without it a loop (an LSTM's ``initial_state`` from another device)
fetches that tensor again on every iteration.

Variables: ``build_model()`` runs the layers once, eagerly, on zeros, so each layer creates its
variables inside its device scope. (Keras's own build traces ``call`` symbolically and creates the
variables afterwards, outside every scope.)

Pipelines: when ``stages`` are given the module lists them (``STAGES``) and marks them in ``call``;
the module itself runs the stages one after another (no micro-batching).

Strategies: ``emit_plan_module`` of a plan whose strategy has replicas writes a module that
trains that way. Data parallel (R replicas of one stage): ``ReplicaModel`` replays the graph with
no device scopes (a subclassed model is rebuilt from its config). On devices of one process,
``make_strategy()`` is ``tf.distribute.MirroredStrategy(devices=REPLICA_DEVICES)``, and the model
is built, given the original's weights and compiled inside ``strategy.scope()`` and trained by
``fit`` (``train()``, or ``python module.py ORIGINAL.keras DATA.npz``). On a cluster's tasks (a
job in the replica devices' strings, on one host or many, or devices on several hosts) it is a
``MultiWorkerMirroredStrategy`` program, run once per task with its ``TF_CONFIG`` (the docstring
gives each task's command): ``main`` makes the strategy first, before TensorFlow runs anything
(loading the model does), and ``train()`` is a loop of its own, since Keras 3's ``fit`` does not
run under that strategy (tensorflow#72388): ``strategy.run`` of the forward pass under a
``GradientTape`` and ``optimizer.apply_gradients``, each worker reading its replicas' shares of
each global batch (``experimental_distribute_dataset``), each replica's loss divided by the global
batch's count of loss values, so the all-reduced gradients are those of the global batch's mean
loss. Replicated pipelines (R > 1 x S > 1) have no short plain-TensorFlow form: that module calls
partitioner's ``passes.rewrite.replicate.realise_strategy`` with every replica's layer devices
written out (``LAYER_DEVICES_PER_REPLICA``), and says so.

Safety: every string from the model (layer, input and model names, config values, device strings,
paths) reaches the code only as a ``repr()`` literal, or as an identifier made of ``[A-Za-z0-9_]``;
comments and the docstring carry only sanitised text.
"""

from __future__ import annotations

import builtins
import copy
import importlib.util
import inspect
import json
import keyword
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from cost_models.devices.catalog import DeviceKind, get_device_type
from partitioner.core.errors import RewriteError
from partitioner.core.files import MODEL_MODULE_FLAG
from partitioner.core.strategy import Strategy
from partitioner.core.units import format_seconds
from partitioner.plan.model import Plan
from passes.checks import in_place_reason, rebuild_refusal
from passes.trace import ShapeArg, Unit, input_specs, placement_units, sample_batch_size

logger = logging.getLogger(__name__)

__all__ = [
    "check_emittable",
    "emit_placed_module",
    "emit_plan_module",
    "emit_replicated_module",
    "plan_device_strings",
    "write_placed_module",
]

LINE_WIDTH = 99
INDENT = "    "
# Config keys that always stay in the emitted config: their default depends on global settings
# (``keras.config.image_data_format()``) that may differ where the module is imported.
_ALWAYS_KEEP = frozenset({"name", "data_format"})
_SERIALIZED_MODULES: Mapping[str, str] = MappingProxyType(
    {
        "keras.initializers": "initializers",
        "keras.regularizers": "regularizers",
        "keras.constraints": "constraints",
    }
)
_MAX_ARRAY_ELEMENTS = 4096
# Names the generated code uses itself; tensors get other names.
_RESERVED = frozenset(
    {
        "self", "inputs", "training", "layer", "layers", "model", "keras", "tf", "np", "os",
        "sys", "importlib", "functools", "Any", "Path", "DEVICES", "STAGES", "SAMPLE_INPUTS",
        "MODEL_SOURCE", "MODEL_CLASS", "MODEL_CONFIG", "PlacedModel", "make_layers",
        "build_model", "load_original_weights", "model_source", "placement_units", "on_device",
        "received", "get_keras_mask", "set_keras_mask", "annotations", "zeros",
        "sample_batch", "sample_inputs",
    }
)


class _Unrepresentable(Exception):
    """A value that has no Python literal form."""


# -- text safety ------------------------------------------------------------------------------


def _safe_text(text: str, limit: int = 80) -> str:
    """``text`` reduced to characters that are harmless in a comment or docstring."""
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c in " _-.:,/()[]+#=<>") else "?"
                      for c in str(text))
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


def _identifier(name: str, taken: set[str]) -> str:
    """A fresh Python identifier made from ``name`` (only ``[A-Za-z0-9_]``), added to ``taken``."""
    base = re.sub(r"[^A-Za-z0-9_]+", "_", str(name)).strip("_") or "t"
    base = re.sub(r"__+", "_", base)
    if base[0].isdigit():
        base = f"t_{base}"
    base = base[:40]
    candidate, k = base, 2
    while (
        candidate in taken
        or candidate in _RESERVED
        or keyword.iskeyword(candidate)
        or keyword.issoftkeyword(candidate)
        or hasattr(builtins, candidate)
    ):
        candidate = f"{base}_{k}"
        k += 1
    taken.add(candidate)
    return candidate


# -- literals ---------------------------------------------------------------------------------


def _literal(value: Any, indent: int = 0) -> str:
    """``value`` as Python source: one line if it fits in ``LINE_WIDTH``, else one item a line."""
    flat = _flat_literal(value)
    if indent + len(flat) <= LINE_WIDTH or not isinstance(value, (list, tuple, dict)) or not value:
        return flat
    pad = INDENT * (indent // len(INDENT) + 1)
    close = INDENT * (indent // len(INDENT))
    if isinstance(value, dict):
        items = [f"{pad}{_flat_literal(k)}: {_literal(v, len(pad))}," for k, v in value.items()]
        return "{\n" + "\n".join(items) + f"\n{close}}}"
    items = [f"{pad}{_literal(v, len(pad))}," for v in value]
    opening, closing = ("[", "]") if isinstance(value, list) else ("(", ")")
    return opening + "\n" + "\n".join(items) + f"\n{close}{closing}"


def _flat_literal(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, np.generic):
        return _flat_literal(value.item())
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else '-float("inf")'
        return repr(float(value))
    if isinstance(value, str):
        return repr(str(value))
    if isinstance(value, list):
        return "[" + ", ".join(_flat_literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        if len(value) == 1:
            return f"({_flat_literal(value[0])},)"
        return "(" + ", ".join(_flat_literal(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_flat_literal(k)}: {_flat_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, np.ndarray) and value.size <= _MAX_ARRAY_ELEMENTS:
        return f"np.asarray({_flat_literal(value.tolist())}, dtype={str(value.dtype)!r})"
    raise _Unrepresentable(type(value).__name__)


def _kwargs_source(kwargs: Mapping[str, str]) -> list[str]:
    """``key=value`` for identifier keys, ``**{"odd key": value}`` for the rest (values are code)."""
    plain = [f"{k}={v}" for k, v in kwargs.items() if _is_plain_keyword(k)]
    odd = [f"{_flat_literal(k)}: {v}" for k, v in kwargs.items() if not _is_plain_keyword(k)]
    return plain + (["**{" + ", ".join(odd) + "}"] if odd else [])


def _is_plain_keyword(key: Any) -> bool:
    return (
        isinstance(key, str) and key.isidentifier() and key.isascii() and not keyword.iskeyword(key)
    )


def _call_source(callee: str, args: Sequence[str], indent: int, lead: int = 0) -> str:
    """``callee(a, b)`` on one line if it fits (after ``lead`` characters), else one a line."""
    flat = f"{callee}({', '.join(args)})"
    if indent + lead + len(flat) <= LINE_WIDTH or not args:
        return flat
    pad = INDENT * (indent // len(INDENT) + 1)
    close = INDENT * (indent // len(INDENT))
    return f"{callee}(\n" + "\n".join(f"{pad}{a}," for a in args) + f"\n{close})"


# -- class references -------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClassRef:
    """How the generated code names a class: an expression and the modules it needs."""

    expr: str
    import_module: str | None = None
    from_source: bool = False


def _module_file(module_name: str) -> Path | None:
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def _importable(module_name: str) -> bool:
    if not all(part.isidentifier() and part.isascii() for part in module_name.split(".")):
        return False
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return False
    loaded = _module_file(module_name)
    return loaded is None or Path(spec.origin).resolve() == loaded


def _is_model_module(module_name: str) -> bool:
    """Whether ``module_name`` is the module the CLI imported the model file as (the emitted
    module loads that file itself, never imports it by name)."""
    return bool(getattr(sys.modules.get(module_name), MODEL_MODULE_FLAG, False))


def _registered_function_names(value: Any) -> list[str]:
    """The names (``package>name``) of the user's registered functions a config serializes
    (``{"class_name": "function", "config": "c34g>twice", ...}``); Keras's own functions are
    serialized by their plain names."""
    if isinstance(value, dict):
        if value.get("class_name") == "function" and ">" in str(value.get("config", "")):
            return [str(value["config"])]
        return [n for v in value.values() for n in _registered_function_names(v)]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _registered_function_names(v)]
    return []


def _defining_file(cls: type) -> Path | None:
    """The file of the functions a class defines (its module may be in no ``sys.modules``)."""
    for value in vars(cls).values():
        function = getattr(value, "__func__", value)
        code = getattr(function, "__code__", None)
        if code is not None and Path(code.co_filename).is_file():
            return Path(code.co_filename).resolve()
    return None


class _Emitter:
    """Accumulates what the generated module needs (imports, the user's source file)."""

    def __init__(self, model_source: str | None) -> None:
        self.model_source = Path(model_source).resolve() if model_source is not None else None
        self.imports: set[str] = set()
        self.uses_source = False
        self.registers = False
        """A layer's config names a function the model's code registered with Keras (a
        ``Lambda`` of ``@keras.saving.register_keras_serializable()``): ``make_layers`` loads
        the model's file first, so Keras finds it by that name."""

    def registered_functions(self, config: Mapping[str, Any], what: str) -> None:
        """Note the functions of the user's registered in ``config`` (:attr:`registers`), and
        the file that registers them as the model's source."""
        for name in _registered_function_names(config):
            function = keras.saving.get_registered_object(name)
            code = getattr(function, "__code__", None)
            file = Path(code.co_filename).resolve() if code is not None else None
            module = getattr(function, "__module__", "") or ""
            if _importable(module) and not _is_model_module(module):
                self.imports.add(module)  # importing it registers the function
                continue
            if file is None or not file.is_file():
                raise RewriteError(
                    f"{what}: cannot tell which file registers function {_safe_text(name)}; "
                    "pass model_source= (the model's .py file)"
                )
            self._from_source(
                file,
                f"{what}: function {_safe_text(name)} is registered in {file}, not in the model "
                "file {source}; make its module importable",
            )
            self.registers = True

    def _from_source(self, file: Path, refusal: str) -> None:
        """Take ``file`` as the model's source (the one file the emitted module loads its own
        classes and registered functions from); RewriteError ``refusal`` (its ``{source}`` the
        file already taken) when it is another file."""
        if self.model_source is None:
            self.model_source = file
        elif file != self.model_source:
            raise RewriteError(refusal.replace("{source}", str(self.model_source)))
        self.uses_source = True

    def class_ref(self, cls: type, what: str) -> _ClassRef:
        name = cls.__name__
        if getattr(keras.layers, name, None) is cls:
            return _ClassRef(f"keras.layers.{name}")
        qualname = cls.__qualname__
        if "<" in qualname or not all(p.isidentifier() for p in qualname.split(".")):
            raise RewriteError(
                f"{what}: class {_safe_text(qualname)} is defined inside a function; define it at "
                "module level so the emitted module can name it"
            )
        module_name = cls.__module__
        if _importable(module_name) and not _is_model_module(module_name):
            self.imports.add(module_name)
            return _ClassRef(f"{module_name}.{qualname}", import_module=module_name)
        file = _module_file(module_name) or _defining_file(cls) or self.model_source
        if file is None:
            raise RewriteError(
                f"{what}: cannot tell which file defines class {_safe_text(qualname)}; pass "
                "model_source= (the model's .py file)"
            )
        self._from_source(
            file,
            f"{what}: class {_safe_text(qualname)} comes from {file}, not from the model file "
            "{source}; make its module importable (a package on sys.path)",
        )
        return _ClassRef(f"model_source().{qualname}", from_source=True)


# -- configs ----------------------------------------------------------------------------------


def _required_params(cls: type) -> set[str]:
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name != "self"
    }


def _is_float32_policy(value: Any) -> bool:
    return value == "float32" or (
        isinstance(value, dict)
        and value.get("class_name") == "DTypePolicy"
        and value.get("config") == {"name": "float32"}
    )


def _without_build_configs(value: Any) -> Any:
    """``value`` without the ``build_config`` / ``compile_config`` of the objects serialized in it.

    A wrapper's config serializes its built sublayer with its input shapes (``build_config``); the
    same layer made afresh from the emitted code has none until it is called.
    """
    if isinstance(value, dict):
        serialized = "class_name" in value and "config" in value
        return {
            k: _without_build_configs(v)
            for k, v in value.items()
            if not (serialized and k in ("build_config", "compile_config"))
        }
    if isinstance(value, list):
        return [_without_build_configs(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_without_build_configs(v) for v in value)
    return value


def _no_layers() -> dict[str, Any]:
    return {}


def _made_config(
    cls: type, kwargs: Mapping[str, Any], fresh: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The config of ``cls(**fresh(), **kwargs)``, ``build_config``s left out.

    ``kwargs`` is deep-copied: a constructor or ``from_config`` may change the dicts it is given
    (``Wrapper.from_config`` pops ``"layer"``), and they are the ones the code is written from.
    """
    made = cls(**fresh(), **copy.deepcopy(dict(kwargs)))
    config = made.get_config()
    return dict(_without_build_configs(config))


def _reduced_config(
    cls: type, config: dict[str, Any], fresh: Callable[[], dict[str, Any]] = _no_layers
) -> dict[str, Any]:
    """``config`` without the entries a fresh instance would have anyway (checked by a round trip).

    ``fresh()`` gives the arguments that are passed as objects, never as config entries (a
    wrapper's sublayers, made anew for each probe); they are left out of the result.
    """
    fixed = set(fresh())
    rest = {k: v for k, v in config.items() if k not in fixed}
    want = _without_build_configs(config)
    required = _required_params(cls) | _ALWAYS_KEEP
    try:
        probe = _made_config(cls, {k: v for k, v in rest.items() if k in required}, fresh)
    except Exception:
        return rest
    kept = {
        k
        for k, v in rest.items()
        if k in required
        or k not in probe
        or probe[k] != want[k]
        or (k == "dtype" and not _is_float32_policy(v))
    }
    # Defaults can depend on other arguments (pooling strides default to the pool size): put
    # back whatever the round trip does not reproduce, until it does.
    for _ in range(len(config) + 1):
        reduced = {k: v for k, v in rest.items() if k in kept}
        try:
            again = _made_config(cls, reduced, fresh)
        except Exception:
            return rest
        if again == want:
            return reduced
        wrong = {k for k in rest if k not in again or again[k] != want[k]} - kept
        if not wrong:
            return rest
        kept |= wrong
    return rest


def _dtype_source(value: Any) -> Any:
    """A plain ``DTypePolicy`` config as its name (``"mixed_float16"``), else unchanged."""
    if (
        isinstance(value, dict)
        and value.get("class_name") == "DTypePolicy"
        and value.get("module") == "keras"
        and set(value.get("config") or {}) == {"name"}
    ):
        return value["config"]["name"]
    return value


def _value_source(value: Any, indent: int) -> str:
    """A config value as code: serialized initializers etc. as constructor calls where exact."""
    if isinstance(value, dict) and set(value) >= {"module", "class_name", "config"}:
        namespace = _SERIALIZED_MODULES.get(str(value["module"]))
        class_name = value["class_name"]
        cls = getattr(getattr(keras, namespace), class_name, None) if namespace else None
        config = value["config"]
        if (
            cls is not None
            and isinstance(class_name, str)
            and class_name.isidentifier()
            and isinstance(config, dict)
            and all(_is_plain_keyword(k) for k in config)
            and value.get("registered_name") in (None, class_name)
        ):
            defaults = {
                p.name: p.default
                for p in inspect.signature(cls.__init__).parameters.values()
                if p.default is not inspect.Parameter.empty
            }
            kwargs = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}
            try:
                exact = keras.saving.serialize_keras_object(cls(**kwargs)) == value
            except Exception:
                exact = False
            if exact:
                callee = f"keras.{namespace}.{class_name}"
                args = [f"{k}={_literal(v, indent + len(INDENT))}" for k, v in kwargs.items()]
                return _call_source(callee, args, indent)
    return _literal(value, indent)


def _construction(op: Any, emitter: _Emitter, what: str, indent: int, lead: int = 0) -> str:
    """Source that makes a fresh copy of ``op`` (a layer or op) from its class and config.

    A wrapper (``TimeDistributed``, ``Bidirectional``, an ``RNN`` of a cell: a config entry that
    serializes one of its sublayers) is written as a call that makes its sublayers the same way
    (``keras.layers.TimeDistributed(name="td", layer=keras.layers.Dense(...))``), so a sublayer
    of the user's own class is named like any other. A layer whose call cannot be checked to
    rebuild its config is written as ``from_config`` of its config.
    """
    cls = type(op)
    ref = emitter.class_ref(cls, what)
    config = _config_of(op, what)
    emitter.registered_functions(config, what)
    nested = _nested_layers(op, config)
    source = None
    if nested:
        source = _wrapper_construction(op, nested, config, ref, emitter, what, indent, lead)
    if source is None:
        source = _direct_construction(cls, config, ref, indent, lead)
    if source is not None:
        return source
    try:
        cls.from_config(copy.deepcopy(config))
    except Exception as exc:
        raise RewriteError(
            f"{what}: {cls.__name__}.from_config(get_config()) fails ({type(exc).__name__}: "
            f"{_safe_text(str(exc), 200)}); implement from_config so the layer can be rebuilt"
        ) from exc
    return _call_source(
        f"{ref.expr}.from_config", [_literal(config, indent + len(INDENT))], indent, lead
    )


def _config_of(op: Any, what: str) -> dict[str, Any]:
    """``op.get_config()``, refused in one line unless every value can be written as code."""
    try:
        config = op.get_config()
    except Exception as exc:
        raise RewriteError(
            f"{what}: {type(op).__name__}.get_config() failed ({type(exc).__name__}: {exc}); "
            "implement get_config so the layer can be written out"
        ) from exc
    try:
        _flat_literal(config)
    except _Unrepresentable as exc:
        raise RewriteError(
            f"{what}: its config holds a {exc} value that cannot be written as Python code; "
            "make get_config return plain values"
        ) from None
    config = dict(config)
    vocabulary = _adapted_vocabulary(op, config, what)
    if vocabulary is not None:  # adapt()'s vocabulary, which get_config leaves out
        config["vocabulary"] = vocabulary
    return config


def _adapted_vocabulary(op: Any, config: Mapping[str, Any], what: str) -> list[Any] | None:
    """The vocabulary ``adapt()`` gave a lookup layer (``IntegerLookup``, ``StringLookup``,
    ``TextVectorization``: what Keras's saving writes with ``save_assets``) when its config has
    none; None when there is none to carry. State of another kind is refused in one line."""
    if not hasattr(op, "save_assets"):
        return None
    if type(op).__name__ not in what:
        what = f"{what} ({type(op).__name__})"
    if not hasattr(op, "get_vocabulary") or "vocabulary" not in config:
        raise RewriteError(
            f"{what}: it keeps state in save_assets that emitted code cannot carry; use "
            "plan.apply(model, devices=...), which carries it"
        )
    if config["vocabulary"] is not None:
        return None
    try:
        words = op.get_vocabulary(include_special_tokens=False)
        vocabulary = op.get_vocabulary(include_special_tokens=True)
    except Exception:  # never adapted: nothing to carry
        return None
    if not len(words):
        return None
    if config.get("output_mode") == "tf_idf":
        raise RewriteError(
            f"{what}: its adapted tf-idf vocabulary cannot be written as code; pass "
            "vocabulary= and idf_weights= to the layer, or use plan.apply(model, devices=...)"
        )
    return [v if isinstance(v, str) else int(v) for v in vocabulary]


def _direct_construction(
    cls: type, config: dict[str, Any], ref: _ClassRef, indent: int, lead: int
) -> str | None:
    """``cls(key=value, ...)`` with defaults left out, if that remakes ``config``; else None."""
    want = _without_build_configs(config)
    reduced = _reduced_config(cls, config)
    try:
        direct = _made_config(cls, reduced, _no_layers) == want
    except Exception:
        direct = False
    if not direct:
        return None
    shown = {k: (_dtype_source(v) if k == "dtype" else v) for k, v in reduced.items()}
    if "dtype" in shown and shown["dtype"] != reduced["dtype"]:
        try:
            same = _made_config(cls, shown, _no_layers) == want
        except Exception:
            same = False
        if not same:
            shown = reduced
    values = {k: _value_source(v, indent + len(INDENT)) for k, v in shown.items()}
    return _call_source(ref.expr, _kwargs_source(values), indent, lead)


def _is_serialized_layer(value: Any) -> bool:
    return isinstance(value, dict) and {"class_name", "config"} <= set(value)


def _nested_layers(op: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """The config entries of ``op`` that serialize one of its sublayers, each with that sublayer.

    ``TimeDistributed``: ``layer``; ``Bidirectional``: ``layer`` (its forward layer) and
    ``backward_layer``; ``RNN``: ``cell``. Found by comparing each sublayer attribute's
    serialization with the entry, so any wrapper of this form is covered.
    """
    if not isinstance(op, keras.layers.Layer):
        return {}
    sublayers = [v for v in vars(op).values() if isinstance(v, keras.layers.Layer) and v is not op]
    found: dict[str, Any] = {}
    for key, value in config.items():
        if not _is_serialized_layer(value) or not _is_plain_keyword(key):
            continue
        want = _without_build_configs(value)
        for layer in sublayers:
            try:
                same = _without_build_configs(keras.saving.serialize_keras_object(layer)) == want
            except Exception:
                same = False
            if same:
                found[key] = layer
                break
    return found


def _wrapper_construction(
    op: Any,
    nested: Mapping[str, Any],
    config: dict[str, Any],
    ref: _ClassRef,
    emitter: _Emitter,
    what: str,
    indent: int,
    lead: int,
) -> str | None:
    """``Wrapper(key=<its sublayer made from its class and config>, ...)``, if that remakes
    ``config`` (checked with sublayers made from their configs, as the emitted code makes them);
    else None.
    """
    cls = type(op)

    def fresh() -> dict[str, Any]:
        return {
            k: type(layer).from_config(copy.deepcopy(layer.get_config()))
            for k, layer in nested.items()
        }

    try:
        fresh()
    except Exception:
        return None
    reduced = _reduced_config(cls, config, fresh)
    try:
        rebuilds = _made_config(cls, reduced, fresh) == _without_build_configs(config)
    except Exception:
        rebuilds = False
    if not rebuilds:
        return None
    pad = indent + len(INDENT)
    values: dict[str, str] = {}
    for key in config:
        if key in nested:
            sub_what = f"{what} ({key} {_safe_text(nested[key].name)})"
            values[key] = _construction(nested[key], emitter, sub_what, pad, lead=len(key) + 1)
        elif key in reduced:
            values[key] = _value_source(reduced[key], pad)
    return _call_source(ref.expr, _kwargs_source(values), indent, lead)


# -- validation -------------------------------------------------------------------------------


def _check_plan(
    units: Sequence[Unit],
    layer_devices: Mapping[str, str],
    stages: Sequence[Sequence[str]] | None,
    model_name: str,
) -> None:
    names = [u.name for u in units]
    missing = [n for n in names if n not in layer_devices]
    extra = sorted(set(layer_devices) - set(names))
    if missing or extra:
        raise RewriteError(
            f"the plan does not match model {model_name!r}: layers missing from the plan "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}, layers in the plan but not the "
            f"model {extra[:8]}{'...' if len(extra) > 8 else ''}; make the plan for this model"
        )
    for name, device in layer_devices.items():
        if not isinstance(device, str) or not device:
            raise RewriteError(f"layer {name!r}: device {device!r} is not a device string")
        try:
            tf.DeviceSpec.from_string(device)
        except (ValueError, TypeError) as exc:
            raise RewriteError(
                f"layer {name!r}: {device!r} is not a TensorFlow device string ({exc}); use "
                "e.g. '/device:GPU:0'"
            ) from None
    if stages is not None:
        staged = [n for stage in stages for n in stage]
        twice = sorted({n for n in staged if staged.count(n) > 1})
        unknown = sorted(set(staged) - set(names))
        unstaged = [n for n in names if n not in set(staged)]
        if twice or unknown or unstaged or any(not stage for stage in stages):
            raise RewriteError(
                f"stages do not partition the layers of {model_name!r}: named twice {twice[:8]}, "
                f"unknown {unknown[:8]}, in no stage {unstaged[:8]}, empty stages "
                f"{[k for k, s in enumerate(stages) if not s]}; give each layer exactly one stage"
            )


def _is_graph_model(model: Any) -> bool:
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def _graph_of(container: Any) -> Any:
    """The functional graph that runs ``container`` (a Sequential runs its inner Functional)."""
    if isinstance(container, keras.Sequential):
        graph = getattr(container, "_functional", None)
        if graph is None:
            raise RewriteError(
                f"Sequential model {container.name!r} has no input shape yet; start it with "
                "keras.Input(shape=...) or call it once on data before emitting code"
            )
        return graph
    return container


# -- Sequential and Functional models ---------------------------------------------------------


class _GraphWriter:
    """Writes the ``call`` body that replays a functional graph under ``tf.device`` scopes."""

    def __init__(
        self,
        emitter: _Emitter,
        unit_of: Mapping[int, str],
        stage_of: Mapping[str, int],
        placed: bool = True,
    ) -> None:
        self.emitter = emitter
        self.unit_of = unit_of
        self.stage_of = stage_of
        self.placed = placed
        """Each call under ``with tf.device(DEVICES[...])``; else plain calls (a replica)."""
        self.lines: list[str] = []
        self.names: set[str] = set()
        self.made: dict[str, str] = {}  # unit name -> construction source (make_layers)
        self.current_stage: int | None = None

    # names and structures

    def fresh(self, name: str) -> str:
        return _identifier(name, self.names)

    def expr(self, value: Any, tensors: Mapping[int, str], what: str) -> str:
        if isinstance(value, keras.KerasTensor):
            if id(value) not in tensors:
                raise RewriteError(f"{what}: an input tensor is not computed by the graph")
            return tensors[id(value)]
        if isinstance(value, list):
            return "[" + ", ".join(self.expr(v, tensors, what) for v in value) + "]"
        if isinstance(value, tuple):
            inner = [self.expr(v, tensors, what) for v in value]
            return f"({inner[0]},)" if len(inner) == 1 else "(" + ", ".join(inner) + ")"
        if isinstance(value, dict):
            return "{" + ", ".join(
                f"{_flat_literal(k)}: {self.expr(v, tensors, what)}" for k, v in value.items()
            ) + "}"
        if isinstance(value, slice):  # x[:, :, None] (campaign 34ah: refused as no code)
            parts = (value.start, value.stop, value.step)
            return "slice(" + ", ".join(self.expr(v, tensors, what) for v in parts) + ")"
        if value is Ellipsis:
            return "Ellipsis"
        try:
            return _flat_literal(value)
        except _Unrepresentable as exc:
            raise RewriteError(
                f"{what}: an argument of type {exc} cannot be written as Python code"
            ) from None

    # graph order

    @staticmethod
    def ordered_nodes(graph: Any) -> list[Any]:
        """The graph's nodes in a topological order as close to the model's layer order as may be."""
        import heapq

        position = {id(op): k for k, op in enumerate(graph.operations)}
        nodes = [n for depth in graph._nodes_by_depth.values() for n in depth]
        nodes = [n for n in nodes if n.operation is not None and not n.is_input]
        producer: dict[int, int] = {}
        for k, node in enumerate(nodes):
            for t in node.outputs:
                producer[id(t)] = k
        waiting = [0] * len(nodes)
        consumers: list[list[int]] = [[] for _ in nodes]
        for k, node in enumerate(nodes):
            for t in node.input_tensors:
                src = producer.get(id(t))
                if src is not None:
                    waiting[k] += 1
                    consumers[src].append(k)

        def key(k: int) -> tuple[int, int, int]:
            op = nodes[k].operation
            inbound = getattr(op, "_inbound_nodes", [])
            index = next((i for i, n in enumerate(inbound) if n is nodes[k]), 0)
            return (position.get(id(op), len(position)), index, k)

        ready = [key(k) for k in range(len(nodes)) if waiting[k] == 0]
        heapq.heapify(ready)
        order: list[Any] = []
        while ready:
            _, _, k = heapq.heappop(ready)
            order.append(nodes[k])
            for j in consumers[k]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(ready, key(j))
        if len(order) != len(nodes):
            raise RewriteError("the model's graph has a cycle; it cannot be written out")
        return order

    # emission

    def emit_graph(self, graph: Any, inputs: Sequence[str], training: str, depth: int) -> list[str]:
        """Write ``graph``'s nodes; ``inputs`` name its (flat) inputs. Returns its flat outputs."""
        tensors: dict[int, str] = {}
        if len(inputs) != len(graph.inputs):
            raise RewriteError(
                f"nested model {graph.name!r} is called with {len(inputs)} tensors but takes "
                f"{len(graph.inputs)}"
            )
        for t, name in zip(graph.inputs, inputs):
            tensors[id(t)] = name
        for node in self.ordered_nodes(graph):
            self.emit_node(node, tensors, training, depth)
        return [self.expr(t, tensors, f"model {graph.name!r}") for t in graph.outputs]

    def emit_node(self, node: Any, tensors: dict[int, str], training: str, depth: int) -> None:
        op = node.operation
        if isinstance(op, keras.layers.InputLayer):
            return
        args, kwargs = node.arguments.args, dict(node.arguments.kwargs)
        if isinstance(op, keras.Model):
            self.emit_nested(op, node, args, kwargs, tensors, training, depth)
            return
        unit = self.unit_of.get(id(op))
        if unit is None:
            raise RewriteError(f"layer {op.name!r} is not a placement unit of the model")
        what = f"layer {unit!r}"
        stage = self.stage_of.get(unit)
        if stage is not None and stage != self.current_stage:
            self.current_stage = stage
            self.lines.append("")
            self.lines.append(f"# -- stage {stage}: STAGES[{stage}] --")
        function = _public_function(op)
        explicit_training = kwargs.pop("training", None)
        if function is None:
            if unit not in self.made:
                self.made[unit] = _construction(
                    op, self.emitter, what, 2 * len(INDENT), lead=len(_flat_literal(unit)) + 2
                )
            callee = f"layers[{unit!r}]"
        else:
            callee = f"keras.ops.{function}"
        arg_sources = [self.expr(a, tensors, what) for a in args]
        if "mask" in kwargs and kwargs["mask"] is None and not any(
            getattr(t, "_keras_mask", None) is not None for t in node.input_tensors
        ):
            del kwargs["mask"]  # no mask reaches this node: the explicit None changes nothing
        kw_sources = {k: self.expr(v, tensors, what) for k, v in kwargs.items()}
        if _takes_training(op):
            # At the top level Keras passes the model's `training` down by itself; it is written
            # out only where the original graph fixes or overrides it.
            if explicit_training is None:
                if training != "training":
                    kw_sources["training"] = training
            else:
                kw_sources["training"] = (
                    f"{training} if {training} is not None else {_flat_literal(explicit_training)}"
                )
        elif explicit_training is not None:
            kw_sources["training"] = _flat_literal(explicit_training)
        outputs = [self.fresh(_output_base(op, len(node.outputs), k)) for k in range(len(node.outputs))]
        call_args = arg_sources + _kwargs_source(kw_sources)
        if len(outputs) == 1 and _returns_single_tensor(op, args, node.arguments.kwargs):
            prefix, suffix = f"{outputs[0]} = ", ""
        elif outputs:
            target = ", ".join(outputs) + ("," if len(outputs) == 1 else "")
            prefix, suffix = f"{target} = keras.tree.flatten(", ")"
        else:
            prefix, suffix = "", ""
        self.append_call(unit, callee, call_args, prefix, suffix)
        for t, name in zip(node.outputs, outputs):
            tensors[id(t)] = name

    def append_call(
        self, unit: str, callee: str, call_args: list[str], prefix: str, suffix: str
    ) -> None:
        """``prefix callee(args) suffix`` under ``with tf.device(DEVICES[unit])`` (if placed)."""
        indent = (3 if self.placed else 2) * len(INDENT)
        call = _call_source(callee, call_args, indent, lead=len(prefix) + len(suffix))
        if self.placed:
            self.lines.append(f"with tf.device(DEVICES[{unit!r}]):")
            self.lines.append(f"{INDENT}{prefix}{call}{suffix}")
        else:
            self.lines.append(f"{prefix}{call}{suffix}")

    def emit_nested(
        self,
        model: Any,
        node: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        tensors: dict[int, str],
        training: str,
        depth: int,
    ) -> None:
        if not _is_graph_model(model):
            raise RewriteError(
                f"nested model {model.name!r} is a subclassed keras.Model inside a functional "
                "model; emitted code supports nested Sequential and Functional models only"
            )
        graph = _graph_of(model)
        inputs = keras.tree.flatten(args[0]) if args else keras.tree.flatten(kwargs.get("inputs"))
        input_names = [self.expr(t, tensors, f"model {model.name!r}") for t in inputs]
        explicit = kwargs.get("training")
        inner_training = training
        if explicit is not None:
            inner_training = self.fresh(f"training_{model.name}")
            self.lines.append(
                f"{inner_training} = {training} if {training} is not None else "
                f"{_flat_literal(explicit)}"
            )
        self.lines.append(f"# nested model {_flat_literal(_safe_text(model.name))} (inlined)")
        outputs = self.emit_graph(graph, input_names, inner_training, depth + 1)
        if len(outputs) != len(node.outputs):
            raise RewriteError(
                f"nested model {model.name!r} returns {len(outputs)} tensors where the outer "
                f"graph uses {len(node.outputs)}"
            )
        for t, name in zip(node.outputs, outputs):
            tensors[id(t)] = name


def _output_base(op: Any, count: int, k: int) -> str:
    return str(op.name) if count == 1 else f"{op.name}_{k}"


def _takes_training(op: Any) -> bool:
    if "training" not in (getattr(op, "_call_context_args", None) or ()):
        return False
    try:
        return "training" in inspect.signature(op.call).parameters
    except (TypeError, ValueError):
        return False


def _returns_single_tensor(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether calling ``op`` gives one tensor (not a one-element list), judged symbolically."""
    try:
        spec = op.compute_output_spec(*args, **kwargs)
    except Exception:
        return False
    return isinstance(spec, keras.KerasTensor)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _public_function(op: Any) -> str | None:
    """The ``keras.ops`` function that runs exactly ``op``, when there is one; else None.

    Only ops with no constructor arguments, whose function takes the same parameters as their
    ``call``: ``Add()(x1, x2)`` is ``keras.ops.add(x1, x2)``.
    """
    if isinstance(op, keras.layers.Layer) or not type(op).__module__.startswith("keras."):
        return None
    try:
        if set(op.get_config()) - {"name"}:
            return None
    except Exception:
        return None
    name = _snake(type(op).__name__)
    function = getattr(keras.ops, name, None)
    if function is None or not callable(function):
        return None
    try:
        wanted = list(inspect.signature(op.call).parameters)
        given = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return name if wanted == given else None


def _structure_source(struct: Any, names: Mapping[int, str]) -> str:
    if isinstance(struct, keras.KerasTensor):
        return names[id(struct)]
    if isinstance(struct, (list, tuple)):
        items = [_structure_source(s, names) for s in struct]
        if isinstance(struct, tuple):
            return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"
        return "[" + ", ".join(items) + "]"
    if isinstance(struct, dict):
        return "{" + ", ".join(
            f"{_flat_literal(k)}: {_structure_source(v, names)}" for k, v in struct.items()
        ) + "}"
    raise RewriteError(f"the model's output structure holds a {type(struct).__name__}")


def _input_lines(graph: Any, writer: _GraphWriter) -> tuple[list[str], list[str]]:
    """Lines that take the model's inputs apart, and the names of the flat inputs."""
    struct = graph._inputs_struct
    flat = list(graph.inputs)
    names = [writer.fresh(_input_name(t)) for t in flat]
    if isinstance(struct, keras.KerasTensor):
        sources = ["inputs"]
    elif isinstance(struct, (list, tuple)) and all(isinstance(t, keras.KerasTensor) for t in struct):
        if len(struct) == 1:
            sources = ["inputs[0] if isinstance(inputs, (list, tuple)) else inputs"]
        else:
            sources = [f"inputs[{k}]" for k in range(len(struct))]
    elif isinstance(struct, dict) and all(isinstance(t, keras.KerasTensor) for t in struct.values()):
        by_id = {id(t): k for k, t in struct.items()}
        sources = [f"inputs[{_flat_literal(by_id[id(t)])}]" for t in flat]
    else:
        raise RewriteError(
            f"model {graph.name!r} takes nested inputs; emitted code supports a tensor, a list "
            "or a dict of tensors"
        )
    lines = [
        f"{name} = keras.ops.convert_to_tensor({source}, dtype={str(t.dtype)!r})"
        for name, source, t in zip(names, sources, flat)
    ]
    return lines, names


def _input_name(tensor: Any) -> str:
    history = getattr(tensor, "_keras_history", None)
    operation = getattr(history, "operation", None)
    return str(getattr(operation, "name", None) or tensor.name)


def _check_weight_order(model: Any, units: Sequence[Unit], made: Mapping[str, str]) -> None:
    """The copy's weights come in the units' order; it must be the original's."""
    order = [
        id(w) for u in units if u.name in made for w in getattr(u.operation, "weights", None) or []
    ]
    if order != [id(w) for w in model.weights]:
        raise RewriteError(
            f"model {model.name!r}: its weight order differs from its layers' order, so "
            "set_weights could not load the emitted copy; emitted code cannot keep it"
        )


def _make_layers_lines(
    made: Mapping[str, str], placed: bool = True, registers: bool = False
) -> list[str]:
    """``make_layers()``: every layer of the copy, keyed by its DEVICES name (its layer name in a
    replica, which has no DEVICES); ``registers``: it loads the model's file first (functions it
    registers with Keras, which configs name)."""
    body = ["def make_layers() -> dict[str, Any]:"]
    key = "DEVICES name" if placed else "layer name"
    body.append(
        f'{INDENT}"""The layers (and ops) of the model, keyed by {key}, in the original\'s'
    )
    body.append(f"{INDENT}weight order: load_original_weights (set_weights) relies on that order.")
    body.append(f'{INDENT}"""')
    if registers:
        body.append(f"{INDENT}model_source()  # registers the model's functions that configs name")
    if made:
        body.append(f"{INDENT}return {{")
        for unit, source in made.items():
            body.append(f"{INDENT * 2}{_flat_literal(unit)}: {source},")
        body.append(f"{INDENT}}}")
    else:
        body.append(f"{INDENT}return {{}}")
    return [*body, "", ""]


def _placed_model_lines(call_lines: Sequence[str], result: str, placed: bool = True) -> list[str]:
    """``class PlacedModel``: its ``call`` replays the graph (``call_lines``), each layer under
    its device; or, not ``placed``, ``class ReplicaModel``: the graph as it is (one replica)."""
    if placed:
        body = ["class PlacedModel(keras.Model):"]
        body.append(
            f'{INDENT}"""The original graph, each layer called under tf.device(DEVICES[<layer>]).'
        )
        body.append("")
        body.append(f"{INDENT}Build it with build_model(): it creates every variable on its device.")
    else:
        body = ["class ReplicaModel(keras.Model):"]
        body.append(f'{INDENT}"""The original graph, layer by layer: one whole replica.')
        body.append("")
        body.append(f"{INDENT}Build it with build_model() inside strategy.scope(): the strategy")
        body.append(f"{INDENT}mirrors every variable on each replica's device.")
    body.append(f'{INDENT}"""')
    body.append("")
    body.append(f"{INDENT}def __init__(self, **kwargs: Any) -> None:")
    body.append(f"{INDENT * 2}super().__init__(**kwargs)")
    body.append(f"{INDENT * 2}self.placed_layers = make_layers()")
    if placed:
        body.append(f"{INDENT * 2}for name, layer in self.placed_layers.items():")
        body.append(
            f"{INDENT * 3}# Its call copies inputs from other devices onto its own (received)."
        )
        body.append(
            f"{INDENT * 3}object.__setattr__(layer, \"call\", on_device(layer.call, DEVICES[name]))"
        )
    body.append("")
    body.append(f"{INDENT}def call(self, inputs: Any, training: bool | None = None) -> Any:")
    body.append(f"{INDENT * 2}layers = self.placed_layers")
    body += [f"{INDENT * 2}{line}" if line else "" for line in call_lines]
    body.append(f"{INDENT * 2}return {result}")
    return body


def _graph_module_body(
    model: Any,
    units: Sequence[Unit],
    emitter: _Emitter,
    stage_of: Mapping[str, int],
    placed: bool = True,
) -> tuple[list[str], list[str]]:
    """(``make_layers``/``PlacedModel`` lines, and the import lines they need); not ``placed``:
    ``ReplicaModel``, the graph without device scopes."""
    graph = _graph_of(model)
    writer = _GraphWriter(emitter, {id(u.operation): u.name for u in units}, stage_of, placed)
    input_lines, input_names = _input_lines(graph, writer)
    outputs = writer.emit_graph(graph, input_names, "training", 0)
    names = {id(t): n for t, n in zip(graph.outputs, outputs)}
    result = _structure_source(graph._outputs_struct, names)
    if isinstance(graph._outputs_struct, (list, tuple)) and len(graph._outputs_struct) == 1:
        result = outputs[0]

    _check_weight_order(model, units, writer.made)
    body = _make_layers_lines(writer.made, placed, emitter.registers)
    body += _placed_model_lines([*input_lines, *writer.lines], result, placed)
    return body, sorted(emitter.imports)


# -- the module -------------------------------------------------------------------------------


def _header(
    model: Any,
    layer_devices: Mapping[str, str],
    stages: Sequence[Sequence[str]] | None,
    graph_model: bool,
) -> list[str]:
    devices = list(dict.fromkeys(layer_devices.values()))
    counts = {d: sum(1 for v in layer_devices.values() if v == d) for d in devices}
    lines = [
        f'"""Model {_safe_text(model.name)} with each layer placed on a device, written by partitioner.',
        "",
        f"Plan: {len(layer_devices)} layers on {len(devices)} device(s):",
    ]
    lines += [f"    {_safe_text(d)}: {counts[d]} layer(s)" for d in devices]
    if stages is not None:
        lines.append(
            f"Pipelined in {len(stages)} stages (STAGES); this module runs them one after another."
        )
    lines += [
        "",
        "DEVICES maps each layer to its device: edit a device string to move that layer.",
    ]
    if graph_model:
        lines += [
            "PlacedModel.call runs the original graph, each layer inside",
            "`with tf.device(DEVICES[...])`; build_model() runs it once on zeros so that each",
            "layer creates its variables on its device. Each layer's call copies its inputs made",
            "on another device onto its own first (received(): a loop would fetch them anew on",
            "every iteration).",
        ]
    else:
        lines += [
            "The model is subclassed, so its code stays in MODEL_SOURCE (imported by path; edit",
            "the path if the file moves). build_model() rebuilds it from MODEL_CLASS and",
            "MODEL_CONFIG and runs each sublayer's build and call under tf.device of its entry in",
            "DEVICES, its inputs made on another device copied onto its own first (received():",
            "a loop would fetch them anew on every iteration). Ops in the model's own call(),",
            "outside every sublayer, are not placed.",
        ]
    lines += [
        "",
        "Use:",
        "",
        "    import placed_model                          # this file",
        "    model = placed_model.build_model()",
        "    placed_model.load_original_weights(model, original)  # a keras.Model or .keras file",
        "    model.compile(optimizer=..., loss=..., jit_compile=False)  # XLA ignores tf.device",
        "",
        "Weights saved with original.save_weights(path) need the original architecture: build the",
        "original, call original.load_weights(path), then load_original_weights(model, original).",
        "",
        "Only the forward pass is placed here: Keras's default train_step takes gradients with a",
        "GradientTape, which leaves the backward ops unplaced. partitioner's plan.apply(model)",
        "also puts each gradient on its layer's device.",
        '"""',
    ]
    return lines


def _devices_lines(
    units: Sequence[Unit], layer_devices: Mapping[str, str], graph_model: bool
) -> list[str]:
    lines = ["# Layer -> device, from the plan. Edit a device string to move that layer."]
    if not graph_model:
        lines += [
            "# Layers named by Keras (dense, dense_1, ...) are renamed in every rebuilt copy, so",
            "# build_model() matches the entries by position when the names differ.",
        ]
    lines.append("DEVICES = {")
    lines += [f"{INDENT}{_flat_literal(u.name)}: {_flat_literal(layer_devices[u.name])}," for u in units]
    lines.append("}")
    return lines


def _stages_lines(stages: Sequence[Sequence[str]] | None) -> list[str]:
    if stages is None:
        return ["# The plan does not pipeline.", "STAGES: list[list[str]] | None = None"]
    lines = [
        "# Pipeline stages in dataflow order (layer names). This module runs them one after",
        "# another; to pipeline them with micro-batches, apply the plan with partitioner instead",
        "# (plan.apply(model, ...)).",
        "STAGES: list[list[str]] | None = [",
    ]
    lines += [f"{INDENT}{_literal(list(stage), len(INDENT))}," for stage in stages]
    lines.append("]")
    return lines


def _sample_lines(
    model: Any,
    input_shape: ShapeArg | None,
    graph_model: bool,
    share: int = 1,
    where: str = "on its device",
) -> list[str]:
    """``SAMPLE_INPUTS``: (shape, dtype) of each input at the batch a copy is built on
    (:func:`~passes.trace.sample_batch_size`: the plan's ``share`` of the batch, or the batch
    the model's inputs fix); ``where`` the variables are created, for its comment."""
    batch = sample_batch_size(model, share)
    specs = input_specs(model, batch, input_shape)
    samples = [(tuple(int(d) for d in s.shape), s.dtype.name) for s in specs]
    value: Any = samples
    struct = _graph_of(model)._inputs_struct if graph_model else None
    if isinstance(struct, dict):  # a model that takes a dict: the sample is a dict too
        key_of = {id(t): k for k, t in struct.items()}
        value = {key_of[id(t)]: sample for t, sample in zip(model.inputs, samples)}
    what = "one sample" if batch == 1 else f"a batch of {batch}, one the model was planned at"
    return [
        f"# (shape, dtype) of each model input for {what}: build_model() runs the model on",
        f"# zeros of these shapes so that every layer creates its variables {where}.",
        f"SAMPLE_INPUTS = {_literal(value, 0)}",
    ]


_SOURCE_LOADER = '''

def model_source() -> Any:
    """The module in MODEL_SOURCE, imported once (this runs the file, as importing it would)."""
    name = "placed_model_source_" + str(abs(hash(MODEL_SOURCE)))
    if name in sys.modules:
        return sys.modules[name]
    # Loaded as Python source whatever its name ends with (the file a .py link led to).
    loader = importlib.machinery.SourceFileLoader(name, MODEL_SOURCE)
    spec = importlib.util.spec_from_file_location(name, MODEL_SOURCE, loader=loader)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {MODEL_SOURCE}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    directory = os.path.dirname(os.path.abspath(MODEL_SOURCE))
    sys.path.insert(0, directory)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if directory in sys.path:  # one entry taken off: an entry the file added stays
            sys.path.remove(directory)
    return module'''

_ZEROS_FUNCTION = '''

def zeros(shape: tuple[int, ...], dtype: str) -> Any:
    """Zeros of ``shape``; empty strings for a string input (numpy has no 'string' dtype)."""
    if dtype == "string":
        return np.full(shape, "", dtype=object)
    return np.zeros(shape, dtype=dtype)'''

_SAMPLE_FUNCTION = _ZEROS_FUNCTION + '''


def sample_batch() -> Any:
    """Zeros shaped like one sample of each input (a list or dict when the model takes several)."""
    if isinstance(SAMPLE_INPUTS, dict):
        return {key: zeros(shape, dtype) for key, (shape, dtype) in SAMPLE_INPUTS.items()}
    arrays = [zeros(shape, dtype) for shape, dtype in SAMPLE_INPUTS]
    return arrays[0] if len(arrays) == 1 else arrays'''

_GRAPH_BUILD = '''

def build_model() -> keras.Model:
    """PlacedModel with every layer's variables created on the layer's device."""
    model = PlacedModel(name=MODEL_NAME)
    # Calling call() directly runs the layers eagerly, so each one builds (creates its variables)
    # inside its tf.device block; Keras's own first build would trace call() symbolically and
    # create the variables later, outside every device scope.
    model.call(sample_batch(), training=False)
    model(sample_batch(), training=False)
    return model


def placement_units(model: keras.Model) -> dict[str, Any]:
    """Layer name (a DEVICES key) -> the layer object, for the layers made by make_layers()."""
    return dict(model.placed_layers)'''

_SUBCLASSED_BUILD = '''

def placement_units(model: keras.Model) -> dict[str, Any]:
    """DEVICES name -> layer: the model's leaf layers, nested models opened, in partitioner's order.

    A layer whose name is taken already is named by its path, e.g. "outer/inner/dense".
    """
    units: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(container: Any, path: tuple[str, ...]) -> None:
        if isinstance(container, keras.Sequential) or not hasattr(
            container, "_operations_by_depth"
        ):
            children = list(container.layers)
        else:
            children = list(container.operations)
        for child in children:
            if id(child) in seen or isinstance(child, keras.layers.InputLayer):
                continue
            seen.add(id(child))
            if isinstance(child, keras.Model):
                visit(child, (*path, child.name))
                continue
            name = child.name
            if name in units:
                name = "/".join((*path, child.name))
                k = 2
                while name in units:
                    name = "/".join((*path, f"{child.name}#{k}"))
                    k += 1
            units[name] = child

    visit(model, (model.name,))
    return units


def build_model() -> keras.Model:
    """The original model, rebuilt from MODEL_CONFIG, each sublayer pinned to its device."""
    model_class = model_source()
    for part in MODEL_CLASS.split("."):
        model_class = getattr(model_class, part)
    model = model_class.from_config(MODEL_CONFIG)
    units = placement_units(model)
    if len(units) != len(DEVICES):
        raise ValueError(
            f"the rebuilt model has {len(units)} layers but DEVICES names {len(DEVICES)}; has "
            "MODEL_SOURCE changed?"
        )
    if set(units) == set(DEVICES):
        devices = [DEVICES[name] for name in units]
    else:
        # Layers named by Keras (dense, dense_1, ...) get new names in every rebuilt copy:
        # DEVICES is matched by position then (its order is the order placement_units walks).
        devices = list(DEVICES.values())
    for layer, device in zip(units.values(), devices, strict=True):
        # Its variables (build) and its ops (call) on its device. object.__setattr__ skips
        # Keras's attribute tracking, which would otherwise track the wrapper.
        for method in ("build", "call"):
            object.__setattr__(layer, method, on_device(getattr(layer, method), device))
    if type(model).build is keras.layers.Layer.build:
        # Keras's default first build traces call() symbolically and creates the variables later,
        # outside every device scope; running call() eagerly first builds each layer in its scope.
        # training=False where call() takes it: a call(self, x, training) requires it.
        takes = "training" in inspect.signature(model.call).parameters
        model.call(sample_batch(), **({"training": False} if takes else {}))
    model(sample_batch(), training=False)
    return model'''

# The emitted copy of passes.rewrite.device_placement's received_on (the module runs without
# partitioner): placed layers run under on_device, which copies their inputs first.
_ON_DEVICE = '''

def received(device: str, values: Any) -> Any:
    """``values`` (any nest) with each tensor made on another device copied onto ``device``.

    Why: a tensor from another device that enters a loop (an LSTM's initial_state, say) is
    fetched again on every iteration. An LSTM(256) over 20 steps took 50.5 ms with its
    initial_state from another TensorFlow worker, 19.6 ms with the state copied first. The copy
    is one tf.identity (made under on_device's scope); a Keras mask travels with its tensor.
    """
    here = tf.DeviceSpec.from_string(device)

    def receive(value: Any) -> Any:
        if not isinstance(value, tf.Tensor):
            return value
        there = tf.DeviceSpec.from_string(value.device)
        if there.make_merged_spec(here) == there:  # already on ``device``
            return value
        copy = tf.identity(value)
        mask = get_keras_mask(value)
        if mask is not None:
            set_keras_mask(copy, receive(mask))
        return copy

    return keras.tree.map_structure(receive, values)


def on_device(method: Any, device: str) -> Any:
    """``method`` run under ``tf.device(device)``, its inputs copied there first (received)."""

    @functools.wraps(method)
    def run_on_device(*args: Any, **kwargs: Any) -> Any:
        with tf.device(device):
            args, kwargs = received(device, (args, kwargs))
            return method(*args, **kwargs)

    return run_on_device'''

_DEVICE_CHECK = '''

def check_devices(table: str, devices: Any) -> None:
    """Raise RuntimeError when a device of ``devices`` (the dict or list named ``table``) is not
    one TensorFlow sees in this process: tf.device would run its work on another device without
    a word (every variable on CPU:0 on a machine without the plan's GPUs). A device of a
    cluster's task (a job other than localhost) is left to the cluster."""
    entries = devices.items() if isinstance(devices, dict) else enumerate(devices)
    wanted = [(key, name, tf.DeviceSpec.from_string(name)) for key, name in entries]
    local = [w for w in wanted if w[2].job in (None, "localhost") and w[2].device_type]
    if not local:
        return
    here = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices()]
    for key, name, spec in local:
        if any(is_device(spec, have) for have in here):
            continue
        seen = [f"/device:{h.device_type}:{h.device_index}" for h in here]
        gpus = sum(h.device_type == "GPU" for h in here)
        again = (
            f", or plan again for its {gpus} GPU(s) (partition MODEL.py --gpus {gpus} --emit ...)"
            if gpus
            else " (this machine has no GPU)"
        )
        raise RuntimeError(
            f"{table}[{key!r}] is {name!r}, a device TensorFlow does not see on this machine "
            f"(it sees {seen}), so its work would silently run on another device: run this "
            f"module on a machine that has the plan's devices, edit {table} to devices it "
            f"sees{again}"
        )


def is_device(wanted: Any, have: Any) -> bool:
    """Whether ``have`` (a device of this process) is the one ``wanted`` names: each part that
    ``wanted`` names (job, replica, task, index) is ``have``'s, and the type in any case."""
    this_process = {"job": "localhost", "replica": 0, "task": 0}
    for part in ("job", "replica", "task", "device_index"):
        value, here = getattr(wanted, part), getattr(have, part)
        if here is None:
            here = this_process.get(part)
        if value is not None and value != here:
            return False
    return str(wanted.device_type).upper() == str(have.device_type).upper()'''


def _checking_devices(build: str, table: str) -> str:
    """``build`` (emitted code defining ``build_model``) with ``build_model`` checking the
    devices of ``table`` first (the emitted ``check_devices``, defined after it)."""
    start = build.index("def build_model")
    opening = build.index('"""', start)
    body = build.index('"""', opening + 3) + len('"""\n')
    check = f"{INDENT}check_devices({table!r}, {table})\n"
    return build[:body] + check + build[body:] + _DEVICE_CHECK


_LOAD_WEIGHTS = '''

def load_original_weights(model: keras.Model, original: Any) -> None:
    """Copy the original model's weights into ``model`` (both list them in the same order).

    ``original`` is the original keras.Model, or the path of a .keras file it was saved to.
    """
    if isinstance(original, (str, os.PathLike)):
        original = keras.saving.load_model(original, compile=False)
    weights = original.get_weights()
    expected = [tuple(w.shape) for w in model.weights]
    given = [tuple(w.shape) for w in weights]
    if expected != given:
        raise ValueError(
            f"the original has weights of shapes {given[:4]}... but this model expects "
            f"{expected[:4]}... ({len(given)} vs {len(expected)} weights); is it the same model?"
        )
    model.set_weights(weights)
    for layer in model._flatten_layers():
        # A layer that loads its variables its own way also derives state from them then
        # (Normalization: its mean and variance), which set_weights alone leaves stale.
        if type(layer).load_own_variables is not keras.layers.Layer.load_own_variables:
            store: dict[str, Any] = {}
            layer.save_own_variables(store)
            layer.load_own_variables(store)'''


def _import_lines(
    loads_source: bool, imports: Sequence[str], more: Sequence[str] = (), *, placed: bool
) -> list[str]:
    """The emitted module's imports: the standard library it uses (and ``more`` of it), Keras,
    NumPy, TensorFlow, the modules of the model's own layer classes, and what ``on_device``
    needs in a ``placed`` module."""
    standard = ["import os"]
    if loads_source:
        standard = ["import importlib.machinery", "import importlib.util", "import os", "import sys"]
    if placed:
        standard = ["import functools", *standard]
    standard = sorted({*standard, *more})
    lines = ["", "from __future__ import annotations", ""]
    lines += [*standard, "from typing import Any", "", "import keras", "import numpy as np"]
    lines += ["import tensorflow as tf"]
    lines += [f"import {m}" for m in imports]
    if placed:
        lines += ["from keras.src.backend import get_keras_mask, set_keras_mask"]
    return lines


def _source_lines(model: keras.Model, emitter: _Emitter) -> list[str]:
    """``MODEL_SOURCE``: the file the emitted module loads the model's own classes from."""
    if emitter.model_source is None:
        raise RewriteError(
            f"model {model.name!r}: cannot tell which file defines its classes; pass "
            "model_source= (the model's .py file)"
        )
    return [
        "# The file that defines the model's own classes; edit the path if the file moves.",
        f"MODEL_SOURCE = {_flat_literal(str(emitter.model_source))}",
        "",
    ]


def _subclassed_config_lines(model: keras.Model) -> list[str]:
    """``MODEL_CLASS`` and ``MODEL_CONFIG``, from which a subclassed model is rebuilt."""
    for layer in model._flatten_layers(include_self=False, recursive=True):
        what = f"layer {layer.name!r} ({type(layer).__name__})"
        config = layer.get_config() if hasattr(layer, "save_assets") else {}
        if _adapted_vocabulary(layer, config, what) is not None:
            raise RewriteError(
                f"{what}: its adapted vocabulary is not in the config subclassed model "
                f"{model.name!r} is rebuilt from; pass vocabulary= to the layer, or use "
                "plan.apply(model, devices=...)"
            )
    return [
        f"MODEL_CLASS = {_flat_literal(type(model).__qualname__)}",
        "# The model's get_config(): build_model() rebuilds it with MODEL_CLASS.from_config.",
        f"MODEL_CONFIG = {_literal(model.get_config(), 0)}",
        "",
    ]


def emit_placed_module(
    model: keras.Model,
    layer_devices: Mapping[str, str],
    *,
    model_source: str | os.PathLike[str] | None = None,
    stages: Sequence[Sequence[str]] | None = None,
    input_shape: ShapeArg | None = None,
    share_batch_size: int = 1,
) -> str:
    """The source of a module that rebuilds ``model`` with each layer on ``layer_devices[name]``.

    ``layer_devices`` maps every placement unit name (``passes.trace.placement_units``, the names
    plans use) to a TensorFlow device string. ``model_source`` is the model's ``.py`` file: the
    module imports it for subclassed models and custom layer classes (by default the file that
    defines their class). ``stages`` (unit names per pipeline stage) are listed in the module.
    ``input_shape`` (without the batch) is needed where the model leaves an input dim unknown.
    ``share_batch_size``: the batch the module builds its copy on (a plan's share of the batch,
    :attr:`~partitioner.plan.model.Plan.share_batch_size`). See the module docstring for what the emitted code looks like.
    """
    if not isinstance(model, keras.Model):
        raise RewriteError(f"expected a keras.Model, got {type(model).__name__}")
    units = placement_units(model)
    if not units:
        raise RewriteError(f"model {model.name!r} has no layers to place")
    _check_plan(units, layer_devices, stages, model.name)
    stage_of = {n: k for k, stage in enumerate(stages or ()) for n in stage}
    emitter = _Emitter(None if model_source is None else os.fspath(model_source))
    graph_model = _is_graph_model(model)
    if graph_model:
        body, imports = _graph_module_body(model, units, emitter, stage_of)
    else:
        body, imports = [], []
        _subclassed_checks(model, emitter)
    loads_source = emitter.uses_source or not graph_model
    lines = _header(model, layer_devices, stages, graph_model)
    more = [] if graph_model else ["import inspect"]  # _SUBCLASSED_BUILD's
    lines += _import_lines(loads_source, imports, more, placed=True)
    lines += ["", f"MODEL_NAME = {_flat_literal(str(model.name))}", ""]
    if loads_source:
        lines += _source_lines(model, emitter)
    if not graph_model:
        lines += _subclassed_config_lines(model)
    lines += [*_devices_lines(units, layer_devices, graph_model), ""]
    lines += [*_stages_lines(stages), ""]
    lines += _sample_lines(model, input_shape, graph_model, share_batch_size)
    text = "\n".join(lines)
    if loads_source:
        text += "\n" + _SOURCE_LOADER
    text += "\n" + _SAMPLE_FUNCTION + "\n" + _ON_DEVICE
    if graph_model:
        text += "\n\n\n" + "\n".join(body) + "\n" + _checking_devices(_GRAPH_BUILD, "DEVICES")
    else:
        text += "\n" + _checking_devices(_SUBCLASSED_BUILD, "DEVICES")
    text += "\n" + _LOAD_WEIGHTS + "\n"
    _compile_check(text, "<emitted module>")
    return text


def plan_device_strings(plan: Plan, devices: Sequence[str] | None = None) -> tuple[str, ...]:
    """The TensorFlow device string of each plan device, for emitted code.

    ``devices`` if given; else the plan's own device names (a topology file names them); else
    ``/device:GPU:i`` (``/device:CPU:i`` for a ``cpu`` plan). Unlike ``plan.apply`` this does not
    ask TensorFlow which devices it sees: the module is usually written on another machine than
    the one it runs on, and its ``DEVICES`` table is there to be edited.
    """
    if devices is not None:
        strings = tuple(devices)
        if len(strings) != plan.num_devices:
            raise RewriteError(
                f"the plan has {plan.num_devices} devices but devices= names {len(strings)}: "
                f"{list(strings)}"
            )
        return strings
    if all(d.name for d in plan.devices):
        return tuple(d.name for d in plan.devices)
    cpu_only = all(get_device_type(d.device_type).kind is DeviceKind.CPU for d in plan.devices)
    kind = (DeviceKind.CPU if cpu_only else DeviceKind.GPU).tf_name
    return tuple(f"/device:{kind}:{d.index}" for d in plan.devices)


def check_emittable(
    model: keras.Model, model_source: str | os.PathLike[str] | None = None
) -> None:
    """RewriteError (one line) for a model placed in place
    (:func:`passes.checks.in_place_reason`) without ``model_source``: its emitted program makes
    the model with that file's own code (:func:`_emit_in_place_module`)."""
    from passes.checks import check_model

    if model_source is not None:
        return
    try:
        check_model(model)
    except RewriteError as exc:
        raise RewriteError(
            "an emitted program cannot copy this model from its layers' configs, and makes it "
            f"with its own file's code instead: {exc}; pass model_source= (the .py file whose "
            "builder makes the model)"
        ) from None


def emit_plan_module(
    model: keras.Model,
    plan: Plan,
    *,
    devices: Sequence[str] | None = None,
    model_source: str | os.PathLike[str] | None = None,
    cluster_addresses: Mapping[str, Sequence[str]] | None = None,
    model_attr: str | None = None,
) -> str:
    """:func:`emit_placed_module` for ``plan``: its devices, pipeline stages and input shape.

    A model placed in place (:func:`passes.checks.in_place_reason`: its own ``train_step``, a
    layer that cannot be rebuilt from its config) is not copied: its module imports
    ``model_source``, makes the model with ``model_attr`` there (a builder or a model; by
    default the command line's search) and places it itself (:func:`_emit_in_place_module`).

    ``cluster_addresses`` (``{job: [host:port, ...]}``, e.g. TF_CONFIG's ``cluster``) gives a
    multi-worker program the real task addresses; without it they are placeholders to edit.

    A plan whose strategy has replicas trains that way instead: data parallel (one stage) as
    ``tf.distribute.MirroredStrategy`` code (a ``MultiWorkerMirroredStrategy`` program run on
    every task when the replicas are a cluster's tasks, :func:`emit_replicated_module`);
    replicated pipelines through partitioner's own rewrite, ``realise_strategy``, with every
    replica's layer devices written out.
    """
    check_emittable(model, model_source)
    strings = plan_device_strings(plan, devices)
    strategy = plan.strategy
    if model_source is not None and in_place_reason(model) is not None:
        return _emit_in_place_module(model, plan, strings, model_source, model_attr)
    if strategy is not None and strategy.replicas > 1:
        if strategy.stages == 1:
            return emit_replicated_module(
                model, plan, strings, model_source=model_source, cluster_addresses=cluster_addresses
            )
        return _emit_hybrid_module(model, plan, strategy, strings)
    layer_devices = {name: strings[d] for name, d in plan.assignment.items()}
    stages = None
    if plan.pipeline is not None:
        stages = [
            [name for name in plan.layer_order if plan.assignment[name] == d]
            for d in plan.pipeline.stage_devices
        ]
        stages = [stage for stage in stages if stage]
    return emit_placed_module(
        model,
        layer_devices,
        model_source=model_source,
        stages=stages,
        input_shape=plan.input_shape,
        share_batch_size=plan.share_batch_size,
    )


# -- models placed in place: the user's own file makes them -----------------------------------

_IN_PLACE_BODY = _ZEROS_FUNCTION + '''


def sample_inputs() -> list[Any]:
    """Zeros shaped like one sample of each input, in the model's input order."""
    shapes = SAMPLE_INPUTS.values() if isinstance(SAMPLE_INPUTS, dict) else SAMPLE_INPUTS
    return [zeros(shape, dtype) for shape, dtype in shapes]


def original_model() -> keras.Model:
    """The model MODEL_SOURCE makes: MODEL_ATTR there (a function returning the model, or the
    model), else its first function of BUILDER_NAMES, else its one module-level model."""
    module = model_source()
    names = [MODEL_ATTR] if MODEL_ATTR else [n for n in BUILDER_NAMES if hasattr(module, n)]
    if not names:
        models = [value for value in vars(module).values() if isinstance(value, keras.Model)]
        if len(models) != 1:
            raise ValueError(f"{MODEL_SOURCE} holds {len(models)} models: set MODEL_ATTR")
        return models[0]
    made = getattr(module, names[0])
    if isinstance(made, keras.Model):
        return made
    # The builder's own imports come from its directory first, as when the plan was made.
    directory = os.path.dirname(os.path.abspath(MODEL_SOURCE))
    sys.path.insert(0, directory)
    try:
        return made()
    finally:
        if directory in sys.path:
            sys.path.remove(directory)
'''

_CHECK_LAYERS = '''

def check_layers(model: keras.Model) -> None:
    """ValueError unless ``model``'s layers are, in order, of the classes and (where built) the
    weight shapes of LAYER_SIGNATURES: the model the plan was made for."""
    units = placement_units(model)
    if len(units) != len(LAYER_SIGNATURES):
        raise ValueError(
            f"the model has {len(units)} layers where the plan's has {len(LAYER_SIGNATURES)}: "
            "this program was made for another model (has MODEL_SOURCE changed?); re-plan it"
        )
    for unit, (planned, (kind, shapes)) in zip(units, LAYER_SIGNATURES.items()):
        layer = unit.operation
        if kind is not None and type(layer).__qualname__ != kind:
            raise ValueError(
                f"layer {unit.name!r} is a {type(layer).__qualname__}, where the plan's layer "
                f"{planned!r} is a {kind}: this program was made for another model; re-plan it"
            )
        weights = getattr(layer, "weights", None) or []  # a keras.ops node has none
        got = [tuple(int(d) for d in w.shape) for w in weights]
        if shapes is not None and getattr(layer, "built", True) and got != shapes:
            raise ValueError(
                f"layer {unit.name!r} has weights of shapes {got}, where the plan's layer "
                f"{planned!r} has {shapes}: this program was made for another model; re-plan it"
            )
'''

_IN_PLACE_PLACED = '''

def build_model(model: keras.Model | None = None) -> keras.Model:
    """``model`` (by default original_model()) placed as the plan says, in place: each layer's
    variables, forward ops and backward ops on its device of LAYER_DEVICES, once its layers are
    checked against the plan's (check_layers: before it is built, and after). Returns
    ``model``."""
    model = original_model() if model is None else model
    check_layers(model)
    names = [unit.name for unit in placement_units(model)]
    devices = dict(LAYER_DEVICES)
    if set(names) != set(devices):  # Keras names layers anew in every build: by position
        devices = dict(zip(names, LAYER_DEVICES.values()))
    placed = place_in_place(model, devices, sample_inputs())
    check_layers(placed)
    return placed
'''

_IN_PLACE_REPLICATED = '''

def build_model(model: keras.Model | None = None) -> keras.Model:
    """``model`` (by default original_model()) trained data parallel, in place: one replica on
    each device of REPLICA_DEVICES, its own train_step kept, once its layers are checked
    against the plan's (check_layers: before it is built, and after). Returns ``model``."""
    model = original_model() if model is None else model
    check_layers(model)
    replicated = replicate_in_place(model, REPLICA_DEVICES, sample_inputs())
    check_layers(replicated)
    return replicated
'''


def _layer_signature_lines(plan: Plan, units: Sequence[Unit]) -> list[str]:
    """``LAYER_SIGNATURES``: each layer's class and weight shapes from the plan's fingerprint
    (a layer not built when planned: no shapes), which the in-place program's ``check_layers``
    compares by position (a program for ``Net(16)`` placed any model of as many layers,
    campaign 34ag)."""
    fingerprint = plan.fingerprint
    classes = dict(fingerprint.layer_classes) if fingerprint is not None else {}
    weights = dict(fingerprint.layer_weights) if fingerprint is not None else {}
    lines = ["# Each layer's class and weight shapes (None: not checked), as the plan was made."]
    lines += ["LAYER_SIGNATURES: dict[str, tuple[str | None, list[tuple[int, ...]] | None]] = {"]
    for unit in units:
        kind = classes.get(unit.name)
        shapes = weights.get(unit.name)
        shown = None if shapes is None else [tuple(s) for s in shapes]
        lines += [f"{INDENT}{_flat_literal(unit.name)}: ({_flat_literal(kind)}, {shown!r}),"]
    return [*lines, "}", ""]


def _in_place_header(model: Any, plan: Plan, why: str, replicated: bool) -> list[str]:
    """The docstring of a module that places a model in place: what and why, how to use it."""
    how = (
        [
            "replicate_in_place trains it data parallel through tf.distribute.MirroredStrategy,",
            "one replica on each device of REPLICA_DEVICES: every variable of the model and its",
            "optimizers mirrored on them, the model's own train_step run by each",
            "replica on its share of each batch, the replicas' gradients averaged.",
        ]
        if replicated
        else [
            "place_in_place moves each layer's variables to its device of LAYER_DEVICES and runs",
            "its forward and backward ops there, whichever step takes the gradients (edit a",
            "device string to move that layer).",
        ]
    )
    strategy = plan.strategy
    what = strategy.describe() if strategy is not None else f"{plan.num_devices} device(s)"
    return [
        f'"""Model {_safe_text(model.name)} placed as it is ({_safe_text(what)}), written by '
        "partitioner.",
        "",
        f"Predicted step {format_seconds(plan.step_time_s)}.",
        "",
        "The model is placed in place, not copied from its layers' configs:",
        f"{_safe_text(why, 160)}. build_model() makes it with its own file's code",
        "(MODEL_SOURCE, imported by path; edit the path if the file moves) and places that",
        "model itself with partitioner's passes.rewrite.in_place (partitioner must be",
        "installed), its class, its own steps and its optimizers kept:",
        *how,
        "",
        "The model's own methods import what they import when they run (a train_step's",
        "`import helper`): run this where those imports resolve, as your training script does.",
        "",
        "Use:",
        "",
        "    import placed_model                      # this file",
        "    model = placed_model.build_model()       # or build_model(model): one you made",
        "    model.fit(x, y, batch_size=placed_model.GLOBAL_BATCH_SIZE)",
        '"""',
    ]


def _emit_in_place_module(
    model: keras.Model,
    plan: Plan,
    strings: Sequence[str],
    model_source: str | os.PathLike[str],
    model_attr: str | None,
) -> str:
    """The module of a plan for a model placed in place (see :func:`emit_plan_module`): one
    replica (``place_in_place``) or data-parallel replicas of one stage (``replicate_in_place``);
    the plans that micro-batch are refused for such models when they are made."""
    from partitioner.core.files import BUILDER_NAMES

    strategy = plan.strategy
    replicated = strategy is not None and strategy.replicas > 1
    why = str(in_place_reason(model))
    remote = [d for d in strings if tf.DeviceSpec.from_string(d).job not in (None, "localhost")]
    if remote or len({d.host for d in plan.devices}) > 1:
        raise RewriteError(
            f"{why}: such a model is placed in place on the devices of the process that runs "
            f"it, and the plan's devices are a cluster's ({(remote or list(strings))[0]!r}); "
            "plan for this machine's devices (without --topology tf-config) to emit its program"
        )
    lines = _in_place_header(model, plan, why, replicated)
    lines += _import_lines(True, [], placed=False)
    rewrite = "replicate_in_place" if replicated else "place_in_place"
    lines += ["", "import partitioner  # noqa: F401  (first: no project's 'passes' hides its own)"]
    lines += [f"from passes.rewrite.in_place import {rewrite}"]
    lines += ["from passes.trace import placement_units"]
    lines += ["", f"MODEL_NAME = {_flat_literal(str(model.name))}"]
    lines += [f"GLOBAL_BATCH_SIZE = {plan.batch_size}", ""]
    lines += _source_lines(model, _Emitter(os.fspath(model_source)))
    lines += ["# What in MODEL_SOURCE makes the model (None: the first of BUILDER_NAMES there)."]
    lines += [f"MODEL_ATTR: str | None = {_flat_literal(model_attr)}"]
    lines += [f"BUILDER_NAMES = {_literal(tuple(BUILDER_NAMES), 0)}", ""]
    if replicated and strategy is not None:
        devices = [strings[group[0]] for group in strategy.device_groups]
        lines += ["# One replica on each device, from the plan."]
        lines += [f"REPLICA_DEVICES = {_literal(devices, 0)}", ""]
    else:
        layer_devices = {name: strings[d] for name, d in plan.assignment.items()}
        units = placement_units(model)
        lines += ["# Layer -> device, from the plan. Edit a device string to move that layer."]
        lines += ["LAYER_DEVICES = {"]
        lines += [
            f"{INDENT}{_flat_literal(u.name)}: {_flat_literal(layer_devices[u.name])},"
            for u in units
        ]
        lines += ["}", ""]
    lines += _layer_signature_lines(plan, placement_units(model))
    lines += _sample_lines(
        model,
        plan.input_shape,
        _is_graph_model(model),
        plan.share_batch_size,
        "when it is not built yet",
    )
    text = "\n".join(lines) + "\n" + _SOURCE_LOADER + "\n" + _IN_PLACE_BODY + _CHECK_LAYERS
    text += "\n" + (_IN_PLACE_REPLICATED if replicated else _IN_PLACE_PLACED)
    _compile_check(text, "<emitted module>")
    return text


# -- plans of replicas: data parallel, across hosts, hybrid -----------------------------------

_MIRRORED_STRATEGY = '''

def make_strategy() -> tf.distribute.Strategy:
    """tf.distribute.MirroredStrategy with one replica on each device of REPLICA_DEVICES.

    Gradients are all-reduced by NCCL on GPUs, else summed on the first device.
    """
    if all("GPU" in device.upper() for device in REPLICA_DEVICES):
        all_reduce: tf.distribute.CrossDeviceOps = tf.distribute.NcclAllReduce()
    else:
        all_reduce = tf.distribute.ReductionToOneDevice(reduce_to_device=REPLICA_DEVICES[0])
    return tf.distribute.MirroredStrategy(devices=REPLICA_DEVICES, cross_device_ops=all_reduce)'''

_MULTI_WORKER_STRATEGY = '''

_strategy: tf.distribute.Strategy | None = None


def make_strategy() -> tf.distribute.Strategy:
    """tf.distribute.MultiWorkerMirroredStrategy over the tasks of this worker's TF_CONFIG (one
    replica per device the worker sees), made once per process. Make it first, before any other
    TensorFlow call: its collectives are configured when TensorFlow starts."""
    global _strategy
    if _strategy is None:
        if "TF_CONFIG" not in os.environ:
            first = "chief" if "chief" in CLUSTER else "worker"
            raise RuntimeError(
                "set TF_CONFIG for this worker first, e.g. "
                + json.dumps(example_tf_config(0, first))
            )
        _strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return _strategy


def example_tf_config(index: int, job: str = "worker") -> dict[str, Any]:
    """The TF_CONFIG of task ``index`` of ``job``: CLUSTER as the cluster, that task as this one."""
    return {"cluster": CLUSTER, "task": {"type": job, "index": index}}


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this worker is the cluster's chief: the "chief" task, else worker 0."""
    resolver = strategy.cluster_resolver
    if "chief" in resolver.cluster_spec().jobs:
        return bool(resolver.task_type == "chief")
    return bool(resolver.task_type == "worker" and resolver.task_id == 0)'''

_REPLICA_GRAPH_BUILD = '''

def build_model() -> keras.Model:
    """ReplicaModel with its variables created: call it inside strategy.scope(), which mirrors
    them on every replica's device."""
    model = ReplicaModel(name=MODEL_NAME)
    model(sample_batch(), training=False)
    return model'''

_REPLICA_SUBCLASSED_BUILD = '''

def build_model() -> keras.Model:
    """The original model, rebuilt from MODEL_CONFIG: call it inside strategy.scope(), which
    mirrors its variables on every replica's device."""
    model_class = model_source()
    for part in MODEL_CLASS.split("."):
        model_class = getattr(model_class, part)
    model = model_class.from_config(MODEL_CONFIG)
    model(sample_batch(), training=False)
    return model'''

_TRAIN = '''

def train(
    original: Any, x: Any, y: Any, *, optimizer: Any, loss: Any, epochs: int = 1, **fit: Any
) -> keras.Model:
    """Train a copy of ``original`` (a keras.Model or .keras file) data-parallel; returns it.

    The copy is built, given the original's weights and compiled inside the strategy's scope
    (``optimizer``: a name like "sgd", or a function that makes one: an optimizer must be made
    inside the scope); ``fit`` sees batches of GLOBAL_BATCH_SIZE, each replica an equal share.
    """
    strategy = make_strategy()
    with strategy.scope():
        model = build_model()
        load_original_weights(model, original)
        model.compile(
            optimizer=optimizer if isinstance(optimizer, str) else optimizer(), loss=loss
        )
    model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, **fit)
    return model


def main(argv: list[str]) -> None:
    """``python THIS_FILE.py ORIGINAL.keras DATA.npz``: train the saved, compiled original's copy
    for one epoch on the arrays of DATA.npz (load_data); save the original with the trained
    weights as ORIGINAL.trained.keras."""
    if len(argv) != 2:
        raise SystemExit(f"usage: python {sys.argv[0]} ORIGINAL.keras DATA.npz")
    original = keras.saving.load_model(argv[0])
    if original.optimizer is None:
        raise SystemExit(f"{argv[0]} was saved uncompiled: compile it, save it, run again")
    config = original.optimizer.get_config()
    x, y = load_data(argv[1], original)
    model = train(
        original,
        x,
        y,
        optimizer=lambda: original.optimizer.__class__.from_config(config),
        loss=original.loss,
    )
    original.set_weights(model.get_weights())  # the trained weights, in the original model
    original.save(os.path.splitext(argv[0])[0] + ".trained.keras")


if __name__ == "__main__":
    main(sys.argv[1:])'''

# DATA.npz's arrays for the command line of a data-parallel module (single or multi-worker).
_LOAD_DATA = '''

def load_data(path: str, model: keras.Model) -> tuple[Any, Any]:
    """DATA.npz's inputs and labels: its arrays ``x`` and ``y``; for a model of several named
    inputs (a dict or a list of them), one array per input name instead of ``x``, and ``y``."""
    data = np.load(path)
    struct = getattr(model, "_inputs_struct", None)
    names = list(struct) if isinstance(struct, dict) else [t.name for t in model.inputs]
    if "y" not in data.files:
        raise SystemExit(f"{path} holds no array y (the labels): np.savez(path, x=..., y=...)")
    if "x" in data.files:
        return data["x"], data["y"]
    missing = [name for name in names if name not in data.files]
    if missing:
        raise SystemExit(
            f"{path} holds neither x nor the model's inputs {missing}: np.savez(path, x=..., "
            f"y=...), or one array per input name ({', '.join(names)}) and y"
        )
    if isinstance(struct, dict):
        return {name: data[name] for name in names}, data["y"]
    return [data[name] for name in names], data["y"]
'''


# The multi-worker module's training: Keras 3's fit does not run under
# MultiWorkerMirroredStrategy (tensorflow#72388), so it is a loop of its own.
_TRAIN_LOOP = '''

def train(
    original: Any,
    x: Any,
    y: Any,
    *,
    optimizer: Any,
    loss: Any,
    epochs: int = 1,
    verbose: bool = False,
) -> keras.Model:
    """Train a copy of ``original`` (a keras.Model or .keras file) data-parallel; returns it.

    Call it on every worker, with the same arguments. Each step takes the next GLOBAL_BATCH_SIZE
    rows of x and y (in order; x an array, or a list or dict of arrays for several inputs), each
    worker its replicas' share of them, and updates the weights as one device would on the whole
    batch (train_step). ``optimizer``: a name like "sgd", or a function that makes one (it must
    be made inside the strategy's scope); ``loss``: a keras.losses.Loss, its name, or a function
    of (y_true, y_pred). Keras's fit does not run under MultiWorkerMirroredStrategy in Keras 3
    (tensorflow#72388), hence the loop.
    """
    strategy = make_strategy()
    with strategy.scope():
        model = build_model()
        load_original_weights(model, original)
        made = keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer()
        made.build(model.trainable_variables)
    step = train_step(strategy, model, made, loss_values(loss))
    batches = strategy.experimental_distribute_dataset(global_batches(x, y))
    for epoch in range(epochs):
        for k, batch in enumerate(batches):
            batch_loss = float(step(batch))
            if verbose:
                print(f"epoch {epoch + 1}, step {k + 1}: loss {batch_loss:.6g}", flush=True)
    return model


def global_batches(x: Any, y: Any) -> tf.data.Dataset:
    """x and y in batches of GLOBAL_BATCH_SIZE rows, in order. Every worker holds the same
    arrays: distributed, each batch is split into one equal share per replica, and each worker
    reads its replicas' shares (sharded by data)."""
    features = tuple(x) if isinstance(x, list) else x
    batches = tf.data.Dataset.from_tensor_slices((features, y)).batch(GLOBAL_BATCH_SIZE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return batches.with_options(options)


def loss_values(loss: Any) -> Any:
    """``loss`` (a keras.losses.Loss, its name or a function of (y_true, y_pred)) as the
    function of its values before any reduction."""
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(f"train() takes one loss, for a model of one output; got {loss!r}")
    made = keras.losses.get(loss)
    return made.call if isinstance(made, keras.losses.Loss) else made


def train_step(
    strategy: tf.distribute.Strategy, model: keras.Model, optimizer: Any, values_of: Any
) -> Any:
    """One step on a distributed global batch, as a tf.function; returns the batch's loss.

    Each replica runs forward and backward on its share. Its loss is the sum of its loss values
    divided by the number of values in the whole global batch, so the replicas' gradients, which
    the optimizer sums over all replicas (an all-reduce) before it applies them, add up to the
    gradient of the mean loss over the global batch: the update of one device on the whole batch.
    """

    def replica_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            prediction = model(list(x) if isinstance(x, tuple) else x, training=True)
            values = tf.cast(values_of(y, prediction), tf.float32)
            context = tf.distribute.get_replica_context()
            count = context.all_reduce("sum", tf.cast(tf.size(values), tf.float32))
            loss = tf.reduce_sum(values) / count
            if model.losses:  # regularisers: an equal part on each replica
                extra = tf.cast(tf.add_n(model.losses), tf.float32)
                loss += extra / strategy.num_replicas_in_sync
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    @tf.function(jit_compile=False)
    def step(batch: Any) -> Any:
        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce("sum", losses, axis=None)

    return step


def main(argv: list[str]) -> None:
    """``TF_CONFIG=... python THIS_FILE.py ORIGINAL.keras DATA.npz`` on every worker: train the
    saved, compiled original's copy for one epoch on the arrays of DATA.npz (load_data); the
    chief saves the original with the trained weights as ORIGINAL.trained.keras."""
    if len(argv) != 2:
        raise SystemExit(f"usage: TF_CONFIG=... python {sys.argv[0]} ORIGINAL.keras DATA.npz")
    strategy = make_strategy()  # first: loading the model runs TensorFlow
    original = keras.saving.load_model(argv[0])
    if original.optimizer is None:
        raise SystemExit(f"{argv[0]} was saved uncompiled: compile it, save it, run again")
    config = original.optimizer.get_config()
    x, y = load_data(argv[1], original)
    chief = is_chief(strategy)
    model = train(
        original,
        x,
        y,
        optimizer=lambda: original.optimizer.__class__.from_config(config),
        loss=original.loss,
        verbose=chief,
    )
    if chief:
        original.set_weights(model.get_weights())  # the trained weights, in the original model
        path = os.path.splitext(argv[0])[0] + ".trained.keras"
        original.save(path)
        print(f"trained weights saved to {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])'''

_TASK_JOBS = ("chief", "worker")


@dataclass(frozen=True)
class _Cluster:
    """The cluster tasks a data-parallel plan's replicas run on, numbered from 0 in each job
    (chief first): each task's (job, index), placeholder address and replica device strings."""

    tasks: tuple[tuple[str, int], ...]
    addresses: tuple[str, ...]
    devices: tuple[tuple[str, ...], ...]
    num_hosts: int
    real_addresses: bool = False

    def spec(self) -> dict[str, list[str]]:
        """TF_CONFIG's ``cluster``: each job's task addresses in index order."""
        jobs = [job for job in _TASK_JOBS if any(j == job for j, _ in self.tasks)]
        return {
            job: [a for (j, _), a in zip(self.tasks, self.addresses) if j == job] for job in jobs
        }


def _job_task(device: str) -> tuple[str, int] | None:
    """The (job, task) a device string names (``/job:worker/replica:0/task:1/...``), or None."""
    job = re.search(r"/job:([^/]+)", device)
    if job is None:
        return None
    task = re.search(r"/task:(\d+)", device)
    return job.group(1), int(task.group(1)) if task else 0


def _cluster_of(
    plan: Plan,
    strategy: Strategy,
    strings: Sequence[str],
    known: Mapping[str, Sequence[str]] | None = None,
) -> _Cluster | None:
    """The cluster tasks of the replicas: the job and task in each replica device's string, or
    one worker per host for devices named without a job on several hosts. None when the
    replicas are devices of one process (one host, no job names): MirroredStrategy's case."""
    firsts = [g[0] for g in strategy.device_groups]
    named = [_job_task(strings[d]) for d in firsts]
    if all(n is None for n in named):
        if len({plan.devices[d].host for d in firsts}) < 2:
            return None
        named = [("worker", plan.devices[d].host) for d in firsts]
    tasks: list[tuple[str, int]] = []
    for d, task in zip(firsts, named):
        if task is None or task[0] not in _TASK_JOBS:
            raise RewriteError(
                f"replica device {strings[d]!r} is not on a chief or worker task while other "
                "replicas are on cluster tasks: MultiWorkerMirroredStrategy trains on every "
                "replica's task; plan on the chief and worker tasks only"
            )
        tasks.append(task)
    order = sorted(set(tasks), key=lambda t: (_TASK_JOBS.index(t[0]), t[1]))
    host_of = {t: plan.devices[d].host for d, t in reversed(list(zip(firsts, tasks)))}
    on_host: dict[int, int] = {}
    addresses = []
    for t in order:
        k = on_host[host_of[t]] = on_host.get(host_of[t], -1) + 1
        addresses.append(f"host{host_of[t]}.example:{2222 + k}")
    real = known is not None and all(t[1] < len(known.get(t[0], ())) for t in order)
    if real and known is not None:
        addresses = [str(known[job][index]) for job, index in order]
    return _Cluster(
        tasks=tuple((t[0], [o for o in order if o[0] == t[0]].index(t)) for t in order),
        addresses=tuple(addresses),
        devices=tuple(tuple(strings[d] for d, n in zip(firsts, tasks) if n == t) for t in order),
        num_hosts=len(set(host_of.values())),
        real_addresses=real,
    )


def _replicas_header(
    model: Any,
    plan: Plan,
    strategy: Strategy,
    replica_devices: Sequence[str],
    cluster: _Cluster | None,
) -> list[str]:
    """The docstring of a data-parallel module (devices of one process, or cluster tasks)."""
    how = "MultiWorkerMirroredStrategy" if cluster else "MirroredStrategy"
    lines = [
        f'"""Model {_safe_text(model.name)} trained data-parallel with tf.distribute.{how}, '
        "written by partitioner.",
        "",
        f"Plan: {strategy.describe()} ({len(replica_devices)} devices), predicted step "
        f"{format_seconds(plan.step_time_s)}.",
        "Each replica holds the whole model on its own device; a step splits the global batch",
        "(GLOBAL_BATCH_SIZE) evenly between the replicas and all-reduces their gradients, so the",
        "weights are updated as one device would update them on the whole batch. The replicas",
        "must divide the batch evenly.",
        "",
    ]
    if cluster is None:
        lines += ["REPLICA_DEVICES lists one device per replica: edit it to use others.", ""]
        return [*lines, *_replicas_use_lines()]
    return [*lines, *_launch_lines(cluster), *_multi_worker_use_lines()]


def _launch_lines(cluster: _Cluster) -> list[str]:
    """How to launch the tasks of a multi-worker module: one command per task."""
    hosts = "one host" if cluster.num_hosts == 1 else f"{cluster.num_hosts} hosts"
    lines = [
        f"The replicas run on {len(cluster.tasks)} tasks of a TensorFlow cluster, on {hosts}.",
        "Run this same file once per task, each process with its own TF_CONFIG. CLUSTER lists",
        *(
            ["the tasks' addresses (the cluster it was planned for). Run, each on its task's host:"]
            if cluster.real_addresses
            else [
                "the tasks' addresses: placeholders, so edit them (there and in these commands) to",
                "the real hosts and free ports first. Then run, each on its task's host:",
            ]
        ),
        "",
    ]
    spec = cluster.spec()
    shown = cluster.tasks if len(cluster.tasks) <= 4 else cluster.tasks[:2]
    for job, index in shown:
        config = {"cluster": spec, "task": {"type": job, "index": index}}
        lines += [f"    TF_CONFIG='{json.dumps(config)}' python THIS_FILE.py ORIGINAL.keras DATA.npz"]
        lines += [""]
    if len(shown) < len(cluster.tasks):
        lines += ["and the same for every other task of CLUSTER, with its job and index.", ""]
    chief = "the chief" if "chief" in spec else "worker 0 (the chief)"
    lines += [
        "Every process reads its own copy of ORIGINAL.keras (a compiled Keras model) and",
        "DATA.npz (arrays x and y, or one per input name and y; the same for every task), waits",
        "until every task has joined,",
        "trains one epoch of batches of GLOBAL_BATCH_SIZE rows (in order; each task its replicas'",
        f"share of each batch), and {chief} saves the model with the trained weights",
        "as ORIGINAL.trained.keras beside ORIGINAL.keras on its host. Each task uses every device",
        "it sees, one replica per device (a CPU task: one replica): TASK_DEVICES lists the plan's",
        "devices of each task (limit a task with CUDA_VISIBLE_DEVICES to match them).",
        "",
    ]
    return lines


def _replicas_use_lines() -> list[str]:
    return [
        "Use:",
        "",
        "    import placed_model                          # this file",
        "    strategy = placed_model.make_strategy()",
        "    with strategy.scope():                       # variables mirrored on every replica",
        "        model = placed_model.build_model()",
        "        placed_model.load_original_weights(model, original)  # a keras.Model or .keras",
        "        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=...)  # made in scope",
        "    model.fit(x, y, batch_size=placed_model.GLOBAL_BATCH_SIZE)  # the global batch",
        "",
        "or placed_model.train(original, x, y, optimizer='sgd', loss='mse'), which does that.",
        "Run `python THIS_FILE.py ORIGINAL.keras DATA.npz` to train a saved, compiled",
        "model for one epoch on the arrays x and y of DATA.npz (or, for several named inputs,",
        "one array per input name and y).",
        '"""',
    ]


def _multi_worker_use_lines() -> list[str]:
    return [
        "Use from Python, in every task's process (TF_CONFIG set):",
        "",
        "    import placed_model                          # this file",
        "    placed_model.make_strategy()    # first, before any other TensorFlow call",
        "    model = placed_model.train(original, x, y, optimizer='sgd', loss='mse')",
        "",
        "Keras's fit does not run under MultiWorkerMirroredStrategy in Keras 3 (tensorflow#72388):",
        "train() runs a loop of its own (train_step: GradientTape, then the optimizer applies the",
        "gradients summed over every replica).",
        '"""',
    ]


def _replica_devices_lines(
    plan: Plan, replica_devices: Sequence[str], cluster: _Cluster | None
) -> list[str]:
    """``REPLICA_DEVICES`` (devices of one process) or ``CLUSTER`` and ``TASK_DEVICES``."""
    lines = [f"GLOBAL_BATCH_SIZE = {plan.batch_size}", ""]
    if cluster is None:
        lines.append("# One replica of the whole model on each device.")
        return [*lines, f"REPLICA_DEVICES = {_literal(list(replica_devices), 0)}"]
    task_devices = {t: list(d) for t, d in zip(cluster.tasks, cluster.devices)}
    return [
        *lines,
        "# TF_CONFIG's cluster: the address (host:port) of each task of each job, by index. The",
        "# addresses are placeholders (one host per plan host): edit them to the real ones.",
        f"CLUSTER = {_literal(cluster.spec(), 0)}",
        "# The plan's replica devices on each task, (job, index) -> device strings.",
        f"TASK_DEVICES = {_literal(task_devices, 0)}",
    ]


def emit_replicated_module(
    model: keras.Model,
    plan: Plan,
    strings: Sequence[str],
    *,
    model_source: str | os.PathLike[str] | None = None,
    cluster_addresses: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The source of a module that trains ``model`` data-parallel as ``plan.strategy`` (``R``
    replicas of one stage) says: ``tf.distribute.MirroredStrategy`` over its devices
    (``strings[d]`` for plan device ``d``) when they are devices of one process, else
    ``MultiWorkerMirroredStrategy``: when they are a cluster's tasks (a job in their strings, on
    one host or many) or on several hosts. Like :func:`emit_placed_module`'s, without device
    scopes."""
    strategy = plan.strategy
    if strategy is None or strategy.stages != 1 or strategy.replicas < 2:
        raise RewriteError(
            f"plan for {plan.model_name!r}: emit_replicated_module needs >= 2 replicas of one "
            f"stage, got {'no strategy' if strategy is None else strategy.describe()}"
        )
    units = placement_units(model)
    _check_plan(units, {u.name: strings[0] for u in units}, None, model.name)
    emitter = _Emitter(None if model_source is None else os.fspath(model_source))
    graph_model = _is_graph_model(model)
    if graph_model:
        body, imports = _graph_module_body(model, units, emitter, {}, placed=False)
    else:
        body, imports = [], []
        _subclassed_checks(model, emitter)
    replica_devices = [strings[g[0]] for g in strategy.device_groups]
    cluster = _cluster_of(plan, strategy, strings, cluster_addresses)
    devices = (replica_devices, cluster)
    text = _replicated_text(model, plan, emitter, graph_model, imports, strategy, devices)
    text += "\n\n\n" + "\n".join(body) + "\n" if graph_model else "\n"
    build = _REPLICA_GRAPH_BUILD if graph_model else _REPLICA_SUBCLASSED_BUILD
    text += build if cluster else _checking_devices(build, "REPLICA_DEVICES")
    text += "\n" + (_MULTI_WORKER_STRATEGY if cluster else _MIRRORED_STRATEGY)
    text += "\n" + _LOAD_WEIGHTS + "\n" + _LOAD_DATA + (_TRAIN_LOOP if cluster else _TRAIN) + "\n"
    _compile_check(text, "<emitted module>")
    return text


def _replicated_text(
    model: Any,
    plan: Plan,
    emitter: _Emitter,
    graph_model: bool,
    imports: Sequence[str],
    strategy: Strategy,
    devices: tuple[Sequence[str], _Cluster | None],
) -> str:
    """The data-parallel module up to its model code: docstring, imports, constants.
    ``devices``: the replica devices and the cluster tasks (None: devices of one process)."""
    replica_devices, cluster = devices
    loads_source = emitter.uses_source or not graph_model
    lines = _replicas_header(model, plan, strategy, replica_devices, cluster)
    standard = ["import sys", *(["import json"] if cluster else [])]
    lines += _import_lines(loads_source, imports, standard, placed=False)
    lines += ["", f"MODEL_NAME = {_flat_literal(str(model.name))}", ""]
    if loads_source:
        lines += _source_lines(model, emitter)
    if not graph_model:
        lines += _subclassed_config_lines(model)
    lines += [*_replica_devices_lines(plan, replica_devices, cluster), ""]
    lines += _sample_lines(
        model, plan.input_shape, graph_model, plan.share_batch_size, "in strategy.scope()"
    )
    text = "\n".join(lines)
    if loads_source:
        text += "\n" + _SOURCE_LOADER
    return text + "\n" + _SAMPLE_FUNCTION


_HYBRID_BODY = _ZEROS_FUNCTION + '''


def sample_inputs() -> list[Any]:
    """Zeros shaped like one sample of each input, in the model's input order."""
    shapes = SAMPLE_INPUTS.values() if isinstance(SAMPLE_INPUTS, dict) else SAMPLE_INPUTS
    return [zeros(shape, dtype) for shape, dtype in shapes]


def build_model(original: Any) -> keras.Model:
    """The copy of ``original`` (a keras.Model or .keras file) that trains as the plan says:
    each replica a pipeline over its devices, the replicas' gradients all-reduced. Compiled like
    the original when the original is compiled; the original is not modified."""
    if isinstance(original, (str, os.PathLike)):
        original = keras.saving.load_model(original)
    return realise_strategy(
        original,
        LAYER_DEVICES_PER_REPLICA,
        num_microbatches=NUM_MICROBATCHES,
        schedule=Schedule(SCHEDULE),
        sample_inputs=sample_inputs(),
    )
'''


def _hybrid_header(model: Any, plan: Plan, strategy: Strategy) -> list[str]:
    """The docstring of a hybrid module: what it runs, why through partitioner, how to use it."""
    return [
        f'"""Model {_safe_text(model.name)} trained as {strategy.describe()}, written by '
        "partitioner.",
        "",
        f"Predicted step {format_seconds(plan.step_time_s)}. Each replica is a pipeline over its own",
        f"devices, fed {strategy.num_microbatches} micro-batch(es) of its share of the global",
        "batch; the replicas all-reduce their gradients, so the weights are updated as one device",
        "would update them on the whole batch.",
        "",
        "This module is not plain TensorFlow: replicated pipelines have no short readable form",
        "there, so build_model() calls partitioner's own rewrite,",
        "passes.rewrite.replicate.realise_strategy (partitioner must be installed), with the",
        "layer -> device table of every replica written out in LAYER_DEVICES_PER_REPLICA: edit a",
        "device string to move that layer of that replica (every replica keeps the same stages).",
        "",
        "Use:",
        "",
        "    import placed_model                          # this file",
        "    model = placed_model.build_model(original)   # a keras.Model or .keras file",
        "    # compile it (jit_compile=False) if the original was not compiled",
        "    model.fit(x, y, batch_size=placed_model.GLOBAL_BATCH_SIZE)  # the global batch",
        '"""',
    ]


def _emit_hybrid_module(
    model: keras.Model, plan: Plan, strategy: Strategy, strings: Sequence[str]
) -> str:
    """The module of a hybrid plan (``R > 1`` replicas of ``S > 1`` stages): the layer devices
    of every replica as literals, handed to ``realise_strategy`` (see :func:`_hybrid_header`)."""
    units = placement_units(model)
    per_replica = [
        {name: strings[group[s]] for name, s in zip(plan.layer_order, strategy.stage_of_layer)}
        for group in strategy.device_groups
    ]
    for layer_devices in per_replica:
        _check_plan(units, layer_devices, None, model.name)
    lines = _hybrid_header(model, plan, strategy)
    if len({plan.devices[d].host for d in strategy.devices}) > 1:
        lines[-1:-1] = [
            "",
            "The devices are on several hosts: serve each with `partition worker` and apply the",
            "plan to a cluster instead (plan.apply(model, cluster=...)); realise_strategy alone",
            "reaches the devices of this process only.",
        ]
    lines += ["", "from __future__ import annotations", "", "import os", "from typing import Any"]
    lines += ["", "import keras", "import numpy as np", ""]
    lines += ["from partitioner.core.ir import Schedule"]
    lines += ["from passes.rewrite.replicate import realise_strategy", ""]
    lines += [f"MODEL_NAME = {_flat_literal(str(model.name))}"]
    lines += [f"GLOBAL_BATCH_SIZE = {plan.batch_size}"]
    lines += ["# Micro-batches per replica per step, and their order on each pipeline."]
    lines += [f"NUM_MICROBATCHES = {strategy.num_microbatches}"]
    lines += [f"SCHEDULE = {_flat_literal(strategy.schedule.value)}", ""]
    lines += ["# Layer -> device of each replica (replica 0 first), from the plan."]
    lines += [f"LAYER_DEVICES_PER_REPLICA = {_literal(per_replica, 0)}", ""]
    lines += _sample_lines(
        model, plan.input_shape, _is_graph_model(model), plan.share_batch_size, "on its device"
    )
    text = "\n".join(lines) + "\n" + _HYBRID_BODY
    _compile_check(text, "<emitted module>")
    return text


def _subclassed_checks(model: Any, emitter: _Emitter) -> None:
    """Fail now, not at import, when a subclassed model cannot be rebuilt from its config."""
    what = f"model {model.name!r}"
    ref = emitter.class_ref(type(model), what)
    if not ref.from_source:
        # An importable class still goes through MODEL_SOURCE, the file that defines it.
        file = _module_file(type(model).__module__) or _defining_file(type(model))
        if file is None:
            raise RewriteError(f"{what}: cannot tell which file defines {type(model).__name__}")
        if emitter.model_source is None:
            emitter.model_source = file
        emitter.imports.discard(type(model).__module__)
    try:
        config = model.get_config()
        _flat_literal(config)
        type(model).from_config(copy.deepcopy(config))
    except _Unrepresentable as exc:
        raise RewriteError(
            f"{what}: its config holds a {exc} value that cannot be written as Python code; give "
            "its __init__ plain arguments and return them from get_config"
        ) from None
    except Exception as exc:
        raise rebuild_refusal(model, exc) from exc
    emitter.uses_source = True


def _compile_check(source: str, filename: str) -> None:
    try:
        compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise RewriteError(
            f"the emitted module does not compile ({filename}:{exc.lineno}: {exc.msg}); this is "
            "a bug in partitioner, please report it with the model"
        ) from None


def write_placed_module(path: str | os.PathLike[str], source: str) -> Path:
    """Write ``source`` to ``path`` atomically, after checking that it compiles."""
    from partitioner.core.files import marked, write_atomic

    _compile_check(source, os.fspath(path))
    # a later run may replace it (its mark); a file of the user's is never replaced (34am)
    return write_atomic(path, marked(source, "#"), only_ours=True)
