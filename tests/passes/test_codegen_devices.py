"""passes.rewrite.codegen: an emitted module's ``build_model()`` refuses devices that are not here.

Issue 34 (D10): the module ``--emit`` wrote for a 2-GPU plan, imported and built on a machine
without a GPU, built with every variable on CPU:0 and no word (``tf.device`` of a missing device
falls back silently), where ``plan.apply`` refuses the same plan. ``build_model()`` now checks
each device of ``DEVICES`` (``REPLICA_DEVICES`` for data parallel on one machine) against
``tf.config.list_logical_devices()``, spellings matched through ``tf.DeviceSpec`` as
``plan.apply`` matches them, and raises one line naming the entry, the device, what TensorFlow
sees, and what to do. Devices of a cluster's tasks are left to the cluster.

The tests run on the four logical CPU devices of ``tests/conftest.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType

import keras
import pytest
import tensorflow as tf
from example_models import build_example

import partitioner
from partitioner.plan.model import Plan
from passes.rewrite.codegen import emit_placed_module, emit_plan_module, write_placed_module
from passes.trace import placement_units
from tests.emitted import import_emitted

_counter = itertools.count()
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


@pytest.fixture(scope="module")
def mnist() -> keras.Model:
    return build_example("mnist_mlp")


@pytest.fixture(scope="module")
def plans(mnist: keras.Model) -> dict[str, Plan]:
    return {
        strategy: partitioner.partition(mnist, gpus=2, batch_size=8, strategy=strategy)
        for strategy in ("placed", "data_parallel")
    }


def emitted(source: str, tmp_path: Path) -> ModuleType:
    return import_emitted(write_placed_module(tmp_path / f"emitted_{next(_counter)}.py", source))


@pytest.mark.skipif(HAS_GPU, reason="needs a machine without a GPU")
def test_a_two_gpu_plan_refuses_to_build_without_gpus(
    mnist: keras.Model, plans: dict[str, Plan], tmp_path: Path
) -> None:
    module = emitted(emit_plan_module(mnist, plans["placed"]), tmp_path)
    assert set(module.DEVICES.values()) == {"/device:GPU:0", "/device:GPU:1"}
    with pytest.raises(RuntimeError) as error:
        module.build_model()
    message = str(error.value)
    assert message.startswith("DEVICES['dense_in'] is '/device:GPU:0', a device TensorFlow does")
    assert "it sees ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']" in message
    assert "run this module on a machine that has the plan's devices" in message
    assert "edit DEVICES to devices it sees (this machine has no GPU)" in message
    assert "\n" not in message


@pytest.mark.skipif(HAS_GPU, reason="needs a machine without a GPU")
def test_a_two_gpu_data_parallel_plan_refuses_to_build_without_gpus(
    mnist: keras.Model, plans: dict[str, Plan], tmp_path: Path
) -> None:
    module = emitted(emit_plan_module(mnist, plans["data_parallel"]), tmp_path)
    assert module.REPLICA_DEVICES == ["/device:GPU:0", "/device:GPU:1"]
    with pytest.raises(RuntimeError, match=r"^REPLICA_DEVICES\[0\] is '/device:GPU:0', a device"):
        module.build_model()


def test_a_cpu_device_that_is_not_here_is_named(
    mnist: keras.Model, plans: dict[str, Plan], tmp_path: Path
) -> None:
    source = emit_plan_module(mnist, plans["placed"], devices=["/device:CPU:1", "/device:CPU:9"])
    module = emitted(source, tmp_path)
    with pytest.raises(RuntimeError) as error:
        module.build_model()
    layer = next(k for k, v in module.DEVICES.items() if v == "/device:CPU:9")
    assert str(error.value).startswith(f"DEVICES[{layer!r}] is '/device:CPU:9', a device")


def test_a_subclassed_model_checks_its_devices(tmp_path: Path) -> None:
    model = build_example("subclassed")
    layer_devices = {u.name: "/device:CPU:0" for u in placement_units(model)}
    last = list(layer_devices)[-1]
    layer_devices[last] = "/device:CPU:7"
    module = emitted(emit_placed_module(model, layer_devices), tmp_path)
    with pytest.raises(RuntimeError, match=rf"^DEVICES\['{last}'\] is '/device:CPU:7'"):
        module.build_model()


def test_a_plan_on_logical_cpu_devices_that_exist_builds_there(
    mnist: keras.Model, plans: dict[str, Plan], tmp_path: Path
) -> None:
    source = emit_plan_module(mnist, plans["placed"], devices=["/device:CPU:0", "/cpu:3"])
    module = emitted(source, tmp_path)
    built = module.build_model()
    units = module.placement_units(built)
    on_three = [name for name, device in module.DEVICES.items() if device == "/cpu:3"]
    assert on_three
    for name in on_three:
        for variable in units[name].weights:
            assert variable.value.device.endswith("device:CPU:3")
    replicas = ["/device:CPU:1", "/device:CPU:2"]
    module = emitted(emit_plan_module(mnist, plans["data_parallel"], devices=replicas), tmp_path)
    with module.make_strategy().scope():
        assert module.build_model().weights


def test_devices_are_matched_in_any_spelling_and_a_clusters_are_left_alone(
    mnist: keras.Model, plans: dict[str, Plan], tmp_path: Path
) -> None:
    source = emit_plan_module(mnist, plans["placed"], devices=["/device:CPU:0"] * 2)
    module = emitted(source, tmp_path)
    here = {
        "a": "/job:localhost/replica:0/task:0/device:CPU:2",
        "b": "/CPU:1",
        "c": "/device:cpu:3",
        "d": "/job:worker/replica:0/task:1/device:GPU:0",  # a cluster task's: not checked here
        "e": "",  # no device: tf.device("") places nothing
    }
    module.check_devices("DEVICES", here)
    for wrong in ("/job:localhost/replica:0/task:1/device:CPU:0", "/device:CPU:4", "/TPU:0"):
        with pytest.raises(RuntimeError, match="a device TensorFlow does not see"):
            module.check_devices("DEVICES", {"x": wrong})
