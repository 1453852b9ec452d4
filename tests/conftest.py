"""Test configuration: four logical CPU devices stand in for GPUs.

Logical devices must be configured before TensorFlow initialises, so this runs at collection time,
before any test touches TensorFlow. Pure-Python tests (IR, cost models, solvers) never import it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

NUM_LOGICAL_DEVICES = 4
TESTS = Path(__file__).resolve().parent


def _share_the_cores() -> None:
    """Under pytest-xdist (``-n N``), give each worker process its share of the cores.

    TensorFlow's intra-op pool defaults to every core, so N workers would run N x cores kernel
    threads. ``TF_NUM_INTRAOP_THREADS`` is read when TensorFlow creates its runtime, here and in
    the subprocesses a test starts (the CLI runs inherit it; ``partition worker`` sets its own).
    The inter-op pool is left alone: the cluster client warns when it is one thread.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(max(1, (cores or 1) // int(workers))))


def _own_cache_directory() -> None:
    """The ``partition`` command caches traces (:mod:`passes.trace_cache`) in
    ``$PARTITIONER_CACHE_DIR``: the suite's runs (and the commands they start, which inherit
    it) use a directory of their own, never the user's cache."""
    os.environ["PARTITIONER_CACHE_DIR"] = tempfile.mkdtemp(prefix="partitioner-tests-cache-")


def pytest_configure(config: object) -> None:
    _share_the_cores()
    _own_cache_directory()
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


# -- the README's example model, planned ----------------------------------------------------------


@pytest.fixture(scope="module")
def mlp() -> Any:
    """The MNIST MLP of examples/mnist_mlp.py, as `partition` loads it (a file may define its
    own ``mlp``, which takes precedence)."""
    from partitioner.cli.loader import load_model

    return load_model(str(TESTS.parent / "examples" / "mnist_mlp.py"))


@pytest.fixture(scope="module")
def plan(mlp: Any) -> Any:
    """A plain split of ``mlp`` over two devices (fast: no strategy comparison)."""
    import partitioner

    return partitioner.partition(
        mlp, gpus=2, batch_size=16, solver="even", compare_strategies=False
    )


# -- running in parallel (pytest-xdist) -------------------------------------------------------------
#
# The full set runs over two processes (`python -m pytest -q --all -n 2 --dist loadgroup`, CI).
# Cases are handed to whichever process is free, so a module-scoped fixture would be set up once
# in each process that runs a case of its file; these files' fixtures are expensive (a CLI or
# cluster run, a planned and applied model), so each file stays in one process (`xdist_group`).
ONE_PROCESS_FILES = (
    "test_cli.py",
    "test_kill_safety.py",
    "test_api.py",
    "test_api_pipeline.py",
    "test_api_strategy.py",
    "test_benchmarks_run.py",
    "test_dict_inputs.py",
    "test_html_report.py",
    "test_pipeline_fed_inputs.py",
    "test_plan.py",
    "passes/test_cluster.py",
    "cost_models/test_saved_activations.py",
)


def pytest_unconfigure(config: object) -> None:
    cache = os.environ.get("PARTITIONER_CACHE_DIR", "")
    if Path(cache).name.startswith("partitioner-tests-cache-"):
        shutil.rmtree(cache, ignore_errors=True)


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        default=False,
        help="run every test, the ones marked slow too (CI does)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    slow_mark = pytest.mark.slow
    for item in items:
        node = item.nodeid.removeprefix("tests/")
        if node.startswith(SLOW_IDS):
            item.add_marker(slow_mark)
        if node.startswith(ONE_PROCESS_FILES):
            item.add_marker(pytest.mark.xdist_group(node.split("::", 1)[0]))
    if config.getoption("--all") or config.getoption("-m"):
        return
    kept = [item for item in items if item.get_closest_marker("slow") is None]
    deselected = [item for item in items if item.get_closest_marker("slow") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
