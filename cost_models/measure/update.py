"""The optimizer's update of a training step, timed on this machine (imports TensorFlow).

The traced step (:func:`passes.trace.trace_model`) is the forward pass, the loss and the
gradients; a training step also applies them (``optimizer.apply_gradients``), which reads and
writes every variable and its optimizer slots: for a model with a large table or wide layers a
fifth of the step or more (an ``Embedding(200000, 64)`` recommender on one core: 63 ms for the
forward and backward, 80 ms with Keras's SGD update). :func:`update_time_s` times it the way
Keras runs it: a **clone** of the model (``keras.models.clone_model``: new variables, so the
user's weights and optimizer are never touched) compiled with the optimizer and MSE, its
``train_on_batch`` on the profiled inputs, less the traced step and less a no-op
``train_on_batch`` (Keras's fixed cost of a call), all three in interleaved rounds
(:func:`cost_models.measure.transfers.time_interleaved`). A model Keras cannot clone, or whose
outputs have no static shape, is not timed (None).
:func:`cost_models.estimate.costs.with_update_time` then gives the time to the layers.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from cost_models.measure.transfers import time_interleaved

__all__ = ["update_time_s"]


def _trainable_clone(model: Any, optimizer: Any, batch: int) -> tuple[Any, list[Any]] | None:
    """A clone of ``model`` compiled with ``optimizer`` and MSE, and zero targets of the batch;
    None when Keras cannot clone it or its outputs have no static shape."""
    try:
        clone = keras.models.clone_model(model)
        shapes = [(batch, *tuple(o.shape)[1:]) for o in model.outputs]
    except Exception:  # any model Keras cannot rebuild: not timed, said in the cost notes
        return None
    if any(d is None for s in shapes for d in s):
        return None
    clone.compile(optimizer=optimizer, loss="mse")
    return clone, [np.zeros(s, np.float32) for s in shapes]


def _no_op_step(optimizer: Any) -> Callable[[], Any]:
    inputs = keras.Input((4,))
    tiny = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    tiny.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    return lambda: tiny.train_on_batch(x, y)


def update_time_s(
    model: Any,
    step_function: Any,
    inputs: Sequence[Any],
    make_optimizer: Callable[[], Any],
    *,
    rounds: int = 5,
    warmup: int = 1,
) -> float | None:
    """Seconds of one update of ``model``'s variables by an optimizer from ``make_optimizer``
    (module docstring); ``inputs`` are the traced step's inputs (one array per model input)."""
    arrays = [np.asarray(x) for x in inputs]
    made = _trainable_clone(model, make_optimizer(), int(arrays[0].shape[0]))
    if made is None:
        return None
    clone, targets = made

    def step() -> None:
        step_function(*inputs)[0].numpy()

    steps = {
        "train": lambda: clone.train_on_batch(arrays, targets),
        "no-op": _no_op_step(make_optimizer()),
        "step": step,
    }
    samples = {k: statistics.median(v) for k, v in time_interleaved(steps, rounds, warmup).items()}
    return max(0.0, samples["train"] - samples["no-op"] - samples["step"])
