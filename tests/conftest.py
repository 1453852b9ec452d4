"""Test configuration: four logical CPU devices stand in for GPUs.

Logical devices must be configured before TensorFlow initialises, so this runs at collection time,
before any test touches TensorFlow. Pure-Python tests (IR, cost models, solvers) never import it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

NUM_LOGICAL_DEVICES = 4


def pytest_configure(config: object) -> None:
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - the pure-Python suites still run
        return
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_DEVICES
        )
    except RuntimeError:  # already initialised by an earlier import; keep what it has
        pass
