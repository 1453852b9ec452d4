"""A layer's whole saved state carried from the original into a rewrite's copy.

Weights alone are not all of a layer's state: ``adapt()`` leaves a lookup layer's vocabulary in
a table (``IntegerLookup``, ``StringLookup``, ``TextVectorization``) and a ``Normalization``
layer's mean and variance in constants it derives from its variables when they are loaded.
Keras's own saving (``keras/src/saving/saving_lib.py`` ``_save_state``/``_load_state``) carries
them through each layer's ``save_own_variables``/``load_own_variables`` (a dict store) and
``save_assets``/``load_assets`` (a directory); Keras 3.15's saving calls no ``finalize_state``
(the layers that need it call it from ``load_own_variables``, as ``Normalization`` does). This
module does the same, layer by layer, from the original into its copy, in the copy's device
scope so nothing it makes moves the copy's variables off their device.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from partitioner.core.errors import RewriteError
from passes.checks import one_line
from passes.weightless import is_deferred


def _layers(layer: Any) -> list[Any]:
    """``layer`` and the layers it holds, in Keras's tracking order."""
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is None:
        return [layer]
    return list(flatten(include_self=True, recursive=True))


def _overrides(layer: Any, method: str) -> bool:
    """Whether ``layer``'s class saves or loads its variables its own way (a plain layer's
    variables are its weights, which the rewrites copy onto their devices already)."""
    own = getattr(type(layer), method, None)
    return own is not None and own is not getattr(keras.layers.Layer, method)


def _own_variables_ready(layer: Any) -> bool:
    own = list(getattr(layer, "_trainable_variables", [])) + list(
        getattr(layer, "_non_trainable_variables", [])
    )
    return not any(is_deferred(v) for v in own)


@contextlib.contextmanager
def _carrying(name: str) -> Iterator[None]:
    try:
        yield
    except RewriteError:
        raise
    except Exception as exc:
        raise RewriteError(
            f"layer {name!r}: its saved state (what adapt() or loading left in it) could not be "
            f"carried into the copy ({type(exc).__name__}: {one_line(exc)}); rebuild the layer "
            "with its state as arguments (vocabulary=, mean=, variance=) and plan again"
        ) from exc


def _pairs(copy: Any, source: Any, name: str) -> list[tuple[Any, Any]]:
    new, old = _layers(copy), _layers(source)
    if [type(layer) for layer in new] != [type(layer) for layer in old]:
        raise RewriteError(
            f"layer {name!r}: the copy holds other layers than the original "
            f"({len(new)} vs {len(old)}); implement get_config/from_config"
        )
    return list(zip(new, old))


def carry_assets(copy: Any, source: Any, name: str, device: str | None = None) -> None:
    """``save_assets`` of ``source`` (and its sublayers) loaded by ``copy``'s ``load_assets``,
    through a temporary directory: a lookup layer's vocabulary. Needs no built copy."""
    pairs = [(n, o) for n, o in _pairs(copy, source, name) if hasattr(o, "save_assets")]
    if not pairs:
        return
    scope = tf.device(device) if device else contextlib.nullcontext()
    with _carrying(name), scope, tempfile.TemporaryDirectory() as tmp:
        for k, (new, old) in enumerate(pairs):
            folder = os.path.join(tmp, str(k))
            os.mkdir(folder)
            old.save_assets(folder)
            new.load_assets(folder)


def carry_own_variables(copy: Any, source: Any, name: str, device: str | None = None) -> None:
    """``save_own_variables`` of ``source`` (and its sublayers) loaded by ``copy``'s
    ``load_own_variables`` where a class does either its own way (``Normalization``: its mean
    and variance constants; a tf-idf lookup's weights). Call it once ``copy`` is built."""
    pairs = [
        (n, o)
        for n, o in _pairs(copy, source, name)
        if (_overrides(o, "save_own_variables") or _overrides(o, "load_own_variables"))
        and _own_variables_ready(o)
    ]
    scope = tf.device(device) if device else contextlib.nullcontext()
    with _carrying(name), scope:
        for new, old in pairs:
            store: dict[str, Any] = {}
            old.save_own_variables(store)
            new.load_own_variables(store)


def carry_model_state(copy: keras.Model, source: keras.Model, *, assets: bool = True) -> None:
    """Every layer's saved state of ``source`` into its copy ``copy`` (the same layers in the
    same order: a clone, or the model rebuilt from its config); ``assets=False``: the variables'
    part only (the assets carried already, before the copy was first called)."""
    name = str(getattr(source, "name", "model"))
    if assets:
        carry_assets(copy, source, name)
    carry_own_variables(copy, source, name)
