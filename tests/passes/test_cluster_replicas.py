"""plan.apply(model, cluster=...) of plans with replicas: data parallel and hybrid on two workers.

Workers are real ``partition worker`` subprocesses on free 127.0.0.1 ports (tests/cluster_util.py);
the client runs in its own subprocess (this file run as a script, ``python
tests/passes/test_cluster_replicas.py SCENARIO CLUSTER_FILE OUT_JSON``), as in
tests/passes/test_cluster.py, because a process that connected to a cluster keeps global
TensorFlow state.

Checked, for data parallel (2 replicas x 1 stage over the two workers, an MLP and a model with an
``Embedding``, whose gradient must stay a ``tf.IndexedSlices`` through the all-reduce) and hybrid
(2 replicas x 2 stages): the copy's outputs equal the original's; after 3 SGD steps with ``fit``
and, on a second copy, with ``train_on_batch``, every replica's weights equal one device's on the
same global batches (<= 1e-5 relative) and the replicas are bitwise equal; each replica's
variables live on its own remote task. The hybrid needs four devices: each of its two workers
exposes two CPU devices, by this file's ``worker`` mode, which is ``partition worker`` with
``device_count={"CPU": 2}`` in its server config (``partition worker`` has no option for it).
Also the one-line PlanError when the cluster cannot hold the replicas (no workers needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for cluster_util
from cluster_util import READY_TIMEOUT_S, REPO_ROOT, start_workers, worker_env

pytestmark = pytest.mark.xdist_group("passes/test_cluster_replicas.py")

SCRIPT = Path(__file__).resolve()
CLIENT_TIMEOUT_S = 240.0
REL_TOL = 1e-5
BATCH = 16
STEPS = 3
DEVICES_PER_WORKER = 2


# -- the client side (runs in a subprocess) ------------------------------------------------------


def _mlp() -> Any:
    import keras

    keras.utils.set_random_seed(7)
    inputs = keras.Input((12,), name="x")
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(16, activation="tanh", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    return keras.Model(inputs, outputs, name="mlp")


def _embedding_model() -> Any:
    import keras

    keras.utils.set_random_seed(7)
    inputs = keras.Input((4,), dtype="int32", name="ids")
    h = keras.layers.Embedding(64, 8, name="emb")(inputs)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(16, activation="tanh", name="dense")(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    return keras.Model(inputs, outputs, name="recommender")


def _data(model_name: str) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(3)
    rows = STEPS * BATCH
    if model_name == "recommender":  # few ids, so the replicas look up some rows alike
        x = rng.integers(0, 20, (rows, 4)).astype("int32")
    else:
        x = rng.standard_normal((rows, 12)).astype("float32")
    return x, rng.standard_normal((rows, 3)).astype("float32")


def _train(model: Any, x: Any, y: Any, how: str) -> None:
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if how == "fit":
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        model.train_on_batch(x[rows], y[rows])


def _relative_diffs(replicated: Any, expected: list[Any]) -> list[float]:
    """Per replica, the largest relative difference of its weights from ``expected``."""
    import numpy as np

    return [
        max(
            float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
            for got, want in zip(replica.get_weights(), expected)
        )
        for replica in replicated.replicas
    ]


def _spy_on_reductions() -> list[str]:
    """``sparse`` (a ``tf.IndexedSlices``) or ``dense`` for every value the explicit all-reduce
    makes, recorded when a step traces."""
    import tensorflow as tf

    import passes.rewrite.replicate as replicate

    made: list[str] = []
    reduce = replicate.sum_gradients

    def spy(values: Any, divisor: Any) -> Any:
        out = reduce(values, divisor)
        made.append("sparse" if isinstance(out, tf.IndexedSlices) else "dense")
        return out

    replicate.sum_gradients = spy
    return made


def client_replicas(cluster_file: str, model_name: str, family: str) -> dict[str, Any]:
    """partition() a plan of ``family`` for 4 (hybrid) or 2 devices, apply it on the cluster
    twice, train one copy with ``fit`` and one with ``train_on_batch``, compare."""
    import keras
    import numpy as np

    import partitioner

    model = (_embedding_model if model_name == "recommender" else _mlp)()
    x, y = _data(model_name)
    reductions = _spy_on_reductions()
    gpus = 4 if family == "hybrid" else 2
    plan = partitioner.partition(
        model, gpus=gpus, batch_size=BATCH, strategy=family, time_limit_s=1.0,
        **({"solver": "even"} if family not in ("single", "data_parallel") else {}),
    )
    out: dict[str, Any] = {"strategy": plan.strategy.describe(), "family": family}
    for how in ("fit", "train_on_batch"):
        copy = plan.apply(model, cluster=cluster_file, timeout_s=60)
        out[f"{how}_out_diff"] = float(
            np.max(np.abs(copy.predict(x, verbose=0) - model.predict(x, verbose=0)))
        )
        reference = keras.models.clone_model(model)
        reference.set_weights(model.get_weights())
        _train(copy, x, y, how)
        _train(reference, x, y, how)
        out[f"{how}_rel_diffs"] = _relative_diffs(copy, reference.get_weights())
        first = copy.replicas[0].get_weights()
        out[f"{how}_replicas_equal"] = all(
            all(np.array_equal(a, b) for a, b in zip(first, r.get_weights()))
            for r in copy.replicas[1:]
        )
        out[f"{how}_update"] = max(
            float(np.max(np.abs(a - b))) for a, b in zip(first, model.get_weights())
        )
        out["variable_devices"] = [
            sorted({v.value.device for v in replica.weights}) for replica in copy.replicas
        ]
        out["stage_devices"] = [list(s) for s in copy.stage_devices]
        out["guarded"] = getattr(copy, "cluster", None) is not None  # guard_model's bounds
    out["reductions"] = reductions
    return out


SCENARIOS = {
    "data_parallel_mlp": lambda f: client_replicas(f, "mlp", "data_parallel"),
    "data_parallel_embedding": lambda f: client_replicas(f, "recommender", "data_parallel"),
    "hybrid_mlp": lambda f: client_replicas(f, "mlp", "hybrid"),
}


def serve_with_two_cpus(argv: list[str]) -> int:
    """``partition worker`` whose server exposes two CPU devices (``device_count``)."""
    import tensorflow as tf

    from partitioner.cli import worker

    config_proto = tf.compat.v1.ConfigProto

    def with_devices(**kwargs: Any) -> Any:
        return config_proto(device_count={"CPU": DEVICES_PER_WORKER}, **kwargs)

    tf.compat.v1.ConfigProto = with_devices
    return worker.main(argv)


# -- the test side -------------------------------------------------------------------------------


def _run_client(scenario: str, cluster_file: Path, out_json: Path) -> dict[str, Any]:
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), scenario, str(cluster_file), str(out_json)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(),
        cwd=REPO_ROOT,
    )
    try:
        _, stderr = process.communicate(timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"client did not finish within {CLIENT_TIMEOUT_S} s (a hang)")
    if process.returncode != 0 or not out_json.exists():
        pytest.fail(f"client failed ({process.returncode}): {stderr[-3000:]}")
    data: dict[str, Any] = json.loads(out_json.read_text())
    return data


def _start_two_cpu_workers(directory: Path) -> Any:
    """Two workers of this file's ``worker`` mode (each with two CPU devices), once ready."""
    from partitioner.cli.worker import READY_PREFIX, LocalWorkers, free_ports

    directory.mkdir(parents=True, exist_ok=True)
    addresses = tuple(f"127.0.0.1:{p}" for p in free_ports(2))
    cluster_file = directory / "cluster.json"
    cluster_file.write_text(json.dumps({"worker": list(addresses)}))
    workers = LocalWorkers(cluster_file, addresses)
    try:
        for task in range(2):
            workers.logs.append(directory / f"worker{task}.log")
            with open(workers.logs[-1], "wb") as log:
                command = [sys.executable, str(SCRIPT), "worker", "--task", str(task)]
                command += ["--cluster", str(cluster_file), "--threads", "1"]
                workers.processes.append(
                    subprocess.Popen(
                        command, stdout=log, stderr=subprocess.STDOUT, env=worker_env()
                    )
                )
        deadline = time.monotonic() + READY_TIMEOUT_S
        for task, process in enumerate(workers.processes):
            while READY_PREFIX not in workers.log(task):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"worker {task} did not start: {workers.log(task)[-2000:]}")
                time.sleep(0.2)
    except BaseException:
        workers.stop()
        raise
    return workers


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cluster = start_workers(2, tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


def _check_trained_alike(r: dict[str, Any]) -> None:
    assert r["guarded"]
    for how in ("fit", "train_on_batch"):
        assert r[f"{how}_out_diff"] <= REL_TOL, (how, r)
        assert r[f"{how}_update"] > 1e-3, (how, r)  # the steps changed the weights
        assert max(r[f"{how}_rel_diffs"]) <= REL_TOL, (how, r)
        assert r[f"{how}_replicas_equal"], (how, r)


def _task_of(device: str) -> str:
    return device.split("/device:")[0]


@pytest.mark.slow
def test_data_parallel_on_two_workers_trains_like_one_device(
    two_workers: Any, tmp_path: Path
) -> None:
    r = _run_client("data_parallel_mlp", two_workers.cluster_file, tmp_path / "out.json")
    assert r["strategy"] == "2 data-parallel replicas", r
    _check_trained_alike(r)
    tasks = [f"/job:worker/replica:0/task:{t}" for t in (0, 1)]
    assert r["variable_devices"] == [[f"{t}/device:CPU:0"] for t in tasks]
    assert set(r["reductions"]) == {"dense"}


@pytest.mark.slow
def test_data_parallel_embedding_on_two_workers_reduces_its_gradient_sparse(
    two_workers: Any, tmp_path: Path
) -> None:
    r = _run_client("data_parallel_embedding", two_workers.cluster_file, tmp_path / "out.json")
    _check_trained_alike(r)
    assert [[_task_of(d) for d in ds] for ds in r["variable_devices"]] == [
        [f"/job:worker/replica:0/task:{t}"] for t in (0, 1)
    ]
    # per traced step: the embedding table's gradient sparse; the loss and 4 gradients dense
    sparse, dense = (r["reductions"].count(kind) for kind in ("sparse", "dense"))
    assert sparse > 0 and dense == 5 * sparse, r["reductions"]


@pytest.mark.slow
def test_hybrid_on_two_workers_of_two_devices_trains_like_one_device(tmp_path: Path) -> None:
    cluster = _start_two_cpu_workers(tmp_path / "cluster")
    try:
        r = _run_client("hybrid_mlp", cluster.cluster_file, tmp_path / "out.json")
    finally:
        cluster.stop()
    assert r["strategy"].startswith("2 data-parallel replicas x 2 stages"), r
    _check_trained_alike(r)
    # replica r's two stages on task r's two devices; its variables there and nowhere else
    for t, (stages, variables) in enumerate(zip(r["stage_devices"], r["variable_devices"])):
        expected = [f"/job:worker/replica:0/task:{t}/device:CPU:{k}" for k in range(2)]
        assert stages == expected and variables == expected, r


def test_a_cluster_too_small_for_the_replicas_is_refused_in_one_line() -> None:
    import partitioner
    from partitioner.core.errors import PlanError
    from passes.apply import apply_plan
    from passes.cluster.runtime import ClusterHandle, WorkerCluster

    model = _mlp()
    plan = partitioner.partition(model, gpus=4, batch_size=BATCH, solver="even", strategy="hybrid")
    assert plan.strategy is not None and len(plan.strategy.devices) == 4
    cluster = WorkerCluster(
        "worker", ("127.0.0.1:1", "127.0.0.1:2"), source="cluster file 'c.json'"
    )
    names = tuple(f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2))
    handle = ClusterHandle(cluster, names)  # not connected: the check comes first
    with pytest.raises(PlanError) as caught:
        apply_plan(plan, model, cluster=handle)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"the plan runs {plan.strategy.describe()} on 4 devices, but ")
    assert message.endswith(
        "the cluster in cluster file 'c.json' holds 2 (2 worker task(s) x 1 device(s)); start "
        "workers for 2 more device(s) (partition worker), or plan for at most 2 devices (gpus=2)"
    )


def _fake_handle(tasks: int, cpus_per_task: int) -> Any:
    from passes.cluster.runtime import ClusterHandle, WorkerCluster

    cluster = WorkerCluster("worker", tuple(f"127.0.0.1:{2000 + t}" for t in range(tasks)))
    names = tuple(
        f"/job:worker/replica:0/task:{t}/device:CPU:{k}"
        for t in range(tasks)
        for k in range(cpus_per_task)
    )
    return ClusterHandle(cluster, names)


def test_more_one_host_plan_devices_than_tasks_fill_the_tasks_devices_in_order() -> None:
    from partitioner.plan.model import PlanDevice
    from passes.cluster.runtime import ClusterError, remote_device_strings

    handle = _fake_handle(2, 2)
    task = [f"/job:worker/replica:0/task:{t}/device:CPU:" for t in range(2)]
    devices = [PlanDevice(i, "cpu", 1 << 30) for i in range(5)]
    # as many as tasks: device i on task i (unchanged); more: task 0's devices, then task 1's
    assert remote_device_strings(handle, devices[:2]) == (f"{task[0]}0", f"{task[1]}0")
    assert remote_device_strings(handle, devices[:4]) == (
        f"{task[0]}0",
        f"{task[0]}1",
        f"{task[1]}0",
        f"{task[1]}1",
    )
    with pytest.raises(ClusterError, match=r"plan device 4 needs task 2, but the cluster"):
        remote_device_strings(handle, devices)


def test_only_the_devices_the_replicas_use_are_mapped_to_the_cluster() -> None:
    from types import SimpleNamespace

    from partitioner.plan.model import PlanDevice
    from passes.apply import _device_strings

    plan = SimpleNamespace(devices=[PlanDevice(i, "cpu", 1 << 30) for i in range(4)], num_devices=4)
    handle = _fake_handle(2, 1)  # holds 2 of the plan's 4 devices: the 2 the replicas use
    assert _device_strings(plan, None, handle, used=(2, 3)) == (
        "",
        "",
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
    )


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(REPO_ROOT))
    if sys.argv[1] == "worker":
        code = serve_with_two_cpus(sys.argv[2:])
        sys.stdout.flush()
        os._exit(code)
    scenario, cluster_path, out_path = sys.argv[1:4]
    outcome = SCENARIOS[scenario](cluster_path)
    Path(out_path).write_text(json.dumps(outcome))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # leave without TF's teardown of the remote context
