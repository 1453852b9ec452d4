"""Load the example model files in ``examples/`` for the pass tests (by path: not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import keras
import numpy as np

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_NAMES = ("mnist_mlp", "two_device_dense", "cnn", "branchy", "subclassed")


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` once, as module ``partitioner_example_<name>``."""
    module_name = f"partitioner_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def build_example(name: str, seed: int = 0) -> keras.Model:
    """A fresh model from ``examples/<name>.py``, with weights drawn from a fixed seed."""
    keras.utils.set_random_seed(seed)
    return load_example(name).build_model()


def random_input(model: keras.Model, batch_size: int, seed: int = 0) -> np.ndarray:
    """A random batch for a single-input model (the examples all take one input)."""
    from passes.trace import input_specs

    (spec,) = input_specs(model, batch_size)
    rng = np.random.default_rng(seed)
    return rng.standard_normal(tuple(spec.shape)).astype(np.float32)


def check_loops_read_only_their_device(graph: Any, device: str) -> None:
    """Some loop of ``graph`` runs on ``device`` (a ``/device:CPU:k`` suffix), and every such
    loop reads only tensors made there (its variables aside): the copy of inputs from other
    devices that the rewrite and the emitted code both make (``received_on`` / ``received``)."""
    import tensorflow as tf

    def on_device(name: str) -> bool:
        return name.endswith(device.lstrip("/"))

    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    here = [op for op in loops if on_device(op.device)]
    assert here, [(op.name, op.device) for op in loops]
    for op in here:
        data = [t for t in op.inputs if t.dtype != tf.resource]
        assert all(on_device(t.op.device) for t in data), [(t.name, t.op.device) for t in data]
