"""Load the example model files in ``examples/`` for the pass tests (by path: not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
