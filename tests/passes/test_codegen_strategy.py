"""passes.rewrite.codegen for plans that apply a strategy of replicas.

On the logical CPU devices of tests/conftest.py: a data-parallel plan's emitted module
(``tf.distribute.MirroredStrategy`` in plain TensorFlow) trains one step to the loss and weights
of the original trained on one device on the same global batch, and ``fit`` works. A plan whose
replicas are a cluster's tasks (job names in its device strings, on one host or many) emits a
``MultiWorkerMirroredStrategy`` program: its text here, its training loop run in this process
under a ``MirroredStrategy`` (the same ``strategy.run`` code; two launched workers are
test_codegen_multi_worker.py's, slow). A hybrid plan's module hands every replica's layer devices
to ``realise_strategy``; plans without replicas emit what they emitted before.
"""

from __future__ import annotations

import ast
import itertools
import json
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from cost_models.devices.topology import topology_from_tf_config
from partitioner.core.errors import RewriteError
from partitioner.core.ir import Schedule
from partitioner.core.strategy import Strategy
from partitioner.plan.model import Plan, PlanDevice, SolverInfo
from passes.rewrite.codegen import (
    emit_placed_module,
    emit_plan_module,
    emit_replicated_module,
    write_placed_module,
)
from passes.trace import placement_units
from tests.emitted import import_emitted as import_path

CPU = [f"/device:CPU:{i}" for i in range(4)]
REL_TOL = 1e-5
BATCH = 8
_counter = itertools.count()
PLAIN_TF_IMPORTS = frozenset(
    {"__future__", "os", "sys", "json", "typing", "keras", "numpy", "tensorflow"}
)


def mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="d1")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="d2")(h)
    outputs = keras.layers.Dense(3, name="d3")(h)
    model = keras.Model(inputs, outputs, name="mlp")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    return model


def data(rows: int = BATCH, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((rows, 6)).astype(np.float32),
        rng.standard_normal((rows, 3)).astype(np.float32),
    )


def strategy_plan(model: keras.Model, strategy: Strategy, hosts: tuple[int, ...] = ()) -> Plan:
    """A plan of ``model`` applying ``strategy`` (device ``d`` on ``hosts[d]``, named as a
    cluster's when the devices are on several hosts)."""
    names = tuple(u.name for u in placement_units(model))
    count = max(strategy.devices) + 1
    devices = tuple(
        PlanDevice(i, "h100", 80 << 30)
        if not hosts
        else PlanDevice(i, "h100", 80 << 30, hosts[i], f"/job:worker/task:{hosts[i]}/device:GPU:0")
        for i in range(count)
    )
    return Plan(
        model_name=model.name,
        devices=devices,
        layer_order=names,
        device_of_layer=strategy.layer_devices(0),
        step_time_s=2e-3,
        lower_bound_s=1e-3,
        per_device=(),
        solver=SolverInfo(name="auto", status="heuristic", objective=None, solve_time_s=0.0),
        link="pcie",
        batch_size=BATCH,
        strategy=strategy,
    )


def import_emitted(source: str, tmp_path: Path) -> ModuleType:
    path = write_placed_module(tmp_path / f"strategy_module_{next(_counter)}.py", source)
    return import_path(path)


def imported_modules(source: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            out.add(node.module)
    return out


def relative_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want)) / max(float(np.linalg.norm(want)), 1e-30)


def assert_same_step(weights: list[np.ndarray], loss: float, reference: keras.Model) -> None:
    x, y = data()
    want_loss = reference.train_on_batch(x, y)
    assert relative_error(loss, want_loss) <= REL_TOL
    want = reference.get_weights()
    assert len(weights) == len(want)
    for k, (a, b) in enumerate(zip(weights, want)):
        assert relative_error(a, b) <= REL_TOL, f"weight {k}"


DATA_PARALLEL = Strategy(device_groups=((0,), (1,)), stage_of_layer=(0, 0, 0))


def test_a_data_parallel_plan_emits_mirrored_strategy_code_that_steps_as_one_device(
    tmp_path: Path,
) -> None:
    model = mlp()
    plan = strategy_plan(model, DATA_PARALLEL)
    source = emit_plan_module(model, plan, devices=CPU[:2])
    assert "tf.distribute.MirroredStrategy(devices=REPLICA_DEVICES" in source
    assert "with tf.device" not in source
    assert imported_modules(source) <= PLAIN_TF_IMPORTS  # plain TensorFlow, no partitioner
    module = import_emitted(source, tmp_path)
    assert module.REPLICA_DEVICES == CPU[:2]
    assert module.GLOBAL_BATCH_SIZE == BATCH
    strategy = module.make_strategy()
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        copy = module.build_model()
        module.load_original_weights(copy, model)
        copy.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    assert copy.distribute_strategy is strategy
    x, y = data()
    np.testing.assert_allclose(copy.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5)
    loss = copy.train_on_batch(x, y)
    assert_same_step(copy.get_weights(), float(loss), mlp())


def test_the_emitted_train_function_fits_on_the_global_batch(tmp_path: Path) -> None:
    model = mlp()
    module = import_emitted(
        emit_plan_module(model, strategy_plan(model, DATA_PARALLEL), devices=CPU[2:4]), tmp_path
    )
    x, y = data()
    trained = module.train(model, x, y, optimizer=lambda: keras.optimizers.SGD(0.1), loss="mse")
    assert trained.distribute_strategy.num_replicas_in_sync == 2
    reference = mlp()
    reference.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    for a, b in zip(trained.get_weights(), reference.get_weights()):
        assert relative_error(a, b) <= REL_TOL


def test_a_plan_across_hosts_emits_a_multi_worker_script(tmp_path: Path) -> None:
    model = mlp()
    strategy = Strategy(device_groups=((0,), (1,), (2,), (3,)), stage_of_layer=(0, 0, 0))
    plan = strategy_plan(model, strategy, hosts=(0, 0, 1, 1))
    source = emit_plan_module(model, plan)
    assert "tf.distribute.MultiWorkerMirroredStrategy()" in source
    assert "MirroredStrategy(devices=" not in source
    assert "TF_CONFIG=" in source and "python THIS_FILE.py ORIGINAL.keras DATA.npz" in source
    assert imported_modules(source) <= PLAIN_TF_IMPORTS
    module = import_emitted(source, tmp_path)
    assert module.CLUSTER == {"worker": ["host0.example:2222", "host1.example:2222"]}
    assert module.TASK_DEVICES == {
        ("worker", 0): ["/job:worker/task:0/device:GPU:0"] * 2,
        ("worker", 1): ["/job:worker/task:1/device:GPU:0"] * 2,
    }
    assert module.example_tf_config(1)["task"] == {"type": "worker", "index": 1}
    assert launch_configs(source) == [module.example_tf_config(0), module.example_tf_config(1)]
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TF_CONFIG", raising=False)
        with pytest.raises(RuntimeError, match="set TF_CONFIG"):
            module.make_strategy()


def launch_configs(source: str) -> list[Any]:
    """The TF_CONFIG of each launch command in the module's docstring, in order."""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return [
        json.loads(line.split("TF_CONFIG='", 1)[1].rsplit("'", 1)[0])
        for line in docstring.splitlines()
        if line.strip().startswith("TF_CONFIG='")
    ]


def cluster_plan(model: keras.Model, tasks: dict[str, list[str]]) -> Plan:
    """A data-parallel plan over the tasks of a TF_CONFIG cluster, one CPU device per task,
    named as ``--topology tf-config`` names them."""
    config = {"cluster": tasks, "task": {"type": next(iter(tasks)), "index": 0}}
    topology = topology_from_tf_config(config, device_type="cpu")
    devices = tuple(
        PlanDevice(d.index, d.device_type, d.memory_bytes, d.host, d.name) for d in topology.devices
    )
    layers = (0,) * len(placement_units(model))
    strategy = Strategy(tuple((d.index,) for d in devices), layers)
    return replace(strategy_plan(model, strategy), devices=devices)


def test_tasks_on_one_host_emit_the_multi_worker_program_not_in_graph_mirrored() -> None:
    model = mlp()
    source = emit_plan_module(
        model, cluster_plan(model, {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]})
    )
    assert "tf.distribute.MultiWorkerMirroredStrategy()" in source
    assert "MirroredStrategy(devices=" not in source and "REPLICA_DEVICES" not in source
    assert "on 2 tasks of a TensorFlow cluster, on one host" in source
    spec = {"worker": ["host0.example:2222", "host0.example:2223"]}
    assert launch_configs(source) == [
        {"cluster": spec, "task": {"type": "worker", "index": k}} for k in range(2)
    ]
    # The strategy is made before TensorFlow runs anything: main makes it before the model
    # loads; and the loop is its own (Keras 3's fit does not run under it).
    main = source[source.index("def main(") :]
    assert main.index("make_strategy()") < main.index("keras.saving.load_model")
    assert ".fit(" not in source and "strategy.run(replica_step" in source
    assert "_maybe_symbolic_build" not in source
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    assert max((n.end_lineno or n.lineno) - n.lineno + 1 for n in functions) <= 60  # house rule


def test_a_cluster_with_a_chief_launches_the_chief_first() -> None:
    model = mlp()
    tasks = {"chief": ["a:1"], "worker": ["b:1", "b:2"]}
    source = emit_plan_module(model, cluster_plan(model, tasks))
    spec = {"chief": ["host0.example:2222"], "worker": ["host1.example:2222", "host1.example:2223"]}
    assert [c["task"] for c in launch_configs(source)] == [
        {"type": "chief", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    assert all(c["cluster"] == spec for c in launch_configs(source))
    assert "on 3 tasks of a TensorFlow cluster, on 2 hosts" in source
    assert "and the chief saves" in source


def test_replicas_on_a_ps_task_or_on_both_a_task_and_a_local_device_are_refused() -> None:
    model = mlp()
    plan = cluster_plan(model, {"worker": ["a:1", "a:2"]})
    with pytest.raises(RewriteError, match="is not on a chief or worker task"):
        emit_plan_module(model, plan, devices=["/job:worker/task:0/device:CPU:0", CPU[1]])
    with pytest.raises(RewriteError, match="'/job:ps/task:0/device:CPU:0' is not on a chief"):
        emit_plan_module(
            model, plan, devices=["/job:worker/task:0/device:CPU:0", "/job:ps/task:0/device:CPU:0"]
        )


def test_the_multi_worker_loop_steps_as_one_device_on_the_global_batch(tmp_path: Path) -> None:
    """The loop of the multi-worker program (train -> train_step, global_batches, loss_values),
    run under a MirroredStrategy of two local devices: the same strategy.run code, without
    launching workers. A last batch that is not full, a Loss object and a regulariser too."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu", name="d1", kernel_regularizer="l2")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="d2")(hidden), name="reg")
    plan = cluster_plan(model, {"worker": ["a:1", "a:2"]})
    module = import_emitted(emit_plan_module(model, replace(plan, batch_size=4)), tmp_path)
    x, y = data(11, seed=3)  # batches of 4, 4 and 3 rows
    with pytest.MonkeyPatch.context() as patch:
        mirrored = tf.distribute.MirroredStrategy(CPU[:2])
        patch.setattr(module, "make_strategy", lambda: mirrored)
        trained = module.train(
            model,
            x,
            y,
            optimizer=lambda: keras.optimizers.SGD(0.1),
            loss=keras.losses.MeanSquaredError(),
        )
    assert trained.distribute_strategy.num_replicas_in_sync == 2
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for k, (a, b) in enumerate(zip(trained.get_weights(), reference.get_weights())):
        assert relative_error(a, b) <= REL_TOL, f"weight {k}"


def test_a_hybrid_plan_emits_every_replicas_devices_for_realise_strategy(tmp_path: Path) -> None:
    from passes.rewrite.replicate import ReplicatedPipeline

    model = mlp()
    strategy = Strategy(((0, 1), (2, 3)), (0, 0, 1), 2, Schedule.ONE_F_ONE_B)
    source = emit_plan_module(model, strategy_plan(model, strategy), devices=CPU)
    assert "from passes.rewrite.replicate import realise_strategy" in source
    assert "partitioner's own rewrite" in source
    module = import_emitted(source, tmp_path)
    assert module.LAYER_DEVICES_PER_REPLICA == [
        {"d1": CPU[0], "d2": CPU[0], "d3": CPU[1]},
        {"d1": CPU[2], "d2": CPU[2], "d3": CPU[3]},
    ]
    assert (module.NUM_MICROBATCHES, module.SCHEDULE) == (2, "1f1b")
    copy = module.build_model(model)
    assert isinstance(copy, ReplicatedPipeline)
    x, y = data()
    loss = copy.train_on_batch(x, y)
    assert_same_step(copy.replicas[0].get_weights(), float(np.ravel(loss)[0]), mlp())


def test_plans_without_replicas_emit_as_before() -> None:
    model = mlp()
    names = [u.name for u in placement_units(model)]
    split = Strategy(((0, 1),), (0, 0, 1))
    plan = replace(strategy_plan(model, split), strategy=None)
    devices = dict(zip(names, ["/device:GPU:0"] * 2 + ["/device:GPU:1"]))
    # a plan's module builds its copy at the plan's share of the batch (what it was traced at)
    before = emit_placed_module(model, devices, share_batch_size=plan.share_batch_size)
    assert emit_plan_module(model, plan) == before
    assert emit_plan_module(model, replace(plan, strategy=split)) == before


def test_emit_replicated_module_refuses_a_plan_without_replicas() -> None:
    model = mlp()
    plan = strategy_plan(model, Strategy(((0, 1),), (0, 0, 1)))
    with pytest.raises(RewriteError, match="needs >= 2 replicas of one stage"):
        emit_replicated_module(model, plan, CPU[:2])


def test_the_emitted_script_trains_a_saved_model_on_saved_arrays(tmp_path: Path) -> None:
    model = mlp()
    module = import_emitted(
        emit_plan_module(model, strategy_plan(model, DATA_PARALLEL), devices=CPU[:2]), tmp_path
    )
    saved = tmp_path / "original.keras"
    model.save(saved)
    x, y = data(BATCH, seed=1)  # one batch: fit's shuffling leaves its step alone
    np.savez(tmp_path / "data.npz", x=x, y=y)
    module.main([str(saved), str(tmp_path / "data.npz")])
    trained = keras.saving.load_model(tmp_path / "original.trained.keras")
    reference = mlp()
    reference.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    for a, b in zip(trained.get_weights(), reference.get_weights()):
        assert relative_error(a, b) <= REL_TOL


def test_a_hybrid_plan_across_hosts_says_to_apply_it_to_a_cluster() -> None:
    model = mlp()
    strategy = Strategy(((0, 1), (2, 3)), (0, 0, 1), 2, Schedule.ONE_F_ONE_B)
    source = emit_plan_module(model, strategy_plan(model, strategy, hosts=(0, 0, 1, 1)))
    assert "plan.apply(model, cluster=...)" in source
    assert "/job:worker/task:1/device:GPU:0" in source
    one_host = emit_plan_module(model, strategy_plan(model, strategy), devices=CPU)
    assert "cluster=" not in one_host
