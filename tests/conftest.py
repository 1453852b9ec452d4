"""Test configuration: four logical CPU devices stand in for GPUs.

Logical devices must be configured before TensorFlow initialises, so this runs at collection time,
before any test touches TensorFlow. Pure-Python tests (IR, cost models, solvers) never import it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

NUM_LOGICAL_DEVICES = 4
TESTS = Path(__file__).resolve().parent


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


# -- the fast set and the full set ---------------------------------------------------------------
#
# `python -m pytest` runs the fast set for the edit-test loop; `python -m pytest --all` (what CI
# runs) adds every case marked `slow`. A case is slow when it is marked `@pytest.mark.slow` in its
# file, or when its id starts with one of these (whole files of TensorFlow-heavy cases: the
# equivalence sweep over real models, subprocess CLI and cluster runs, the hypothesis fuzzing;
# and single cases on ResNet50 or the transformer). The Chromium cases are marked in their file.
SLOW_IDS = (
    "test_equivalence_sweep.py",
    "test_cli.py",
    "test_kill_safety.py",
    "test_cluster_zoo.py",
    "test_fuzz.py",
    "passes/test_cluster.py",
    "passes/test_codegen.py::test_resnet50",
    "passes/test_device_placement.py::test_resnet50",
    "passes/test_pipeline.py::test_weights_after_one_step_match[transformer",
)


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        default=False,
        help="run every test, the ones marked slow too (CI does)",
    )


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    slow_mark = pytest.mark.slow
    for item in items:
        node = item.nodeid.removeprefix("tests/")
        if node.startswith(SLOW_IDS):
            item.add_marker(slow_mark)
    if config.getoption("--all") or config.getoption("-m"):
        return
    kept = [item for item in items if item.get_closest_marker("slow") is None]
    deselected = [item for item in items if item.get_closest_marker("slow") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
