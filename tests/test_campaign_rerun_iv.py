"""Hostile input III (issue 34), the fifth campaign's findings: a plan's devices, a cluster's
timeouts and forms, and options that would be ignored.

- Two plan devices that hold layers, given (or named in the plan) as one TensorFlow device in
  any spelling, are refused: the stages would run one after another on it, not as planned.
  Before, a 2-device placed or pipelined plan trained on CPU:0 alone without a word.
- ``plan.apply(cluster=..., timeout_s=inf)`` (or past an hour, or ``step_timeout_s=inf``) is
  refused before any connection; before, a down cluster made it wait for ever.
- ``cluster=`` of another type is one ``UsageError`` naming it (was a raw ``TypeError``), and a
  ``TF_CONFIG`` JSON string is read as one, as documented (was taken for a file name).
- ``solver=`` beside ``strategy='single'`` or ``'data-parallel'``, which place no stages, is
  refused (was ignored, the plan labelled with the solver's name).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import keras
import pytest

from partitioner.core.errors import PlanError, UsageError
from partitioner.core.options import SearchOptions
from partitioner.plan.model import Plan
from passes.cluster.runtime import load_cluster

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "devices",
    [
        ["/cpu:0", "/device:CPU:0"],
        ["/device:CPU:1"] * 2,
        # this process's task spelled out, in part or in full (the campaign's sixth rerun)
        ["/job:localhost/replica:0/task:0/device:CPU:0", "/device:CPU:0"],
        ["/task:0/device:CPU:0", "/cpu:0"],
        ["/job:localhost/device:CPU:1", "CPU:1"],
    ],
)
def test_two_plan_devices_given_as_one_device_are_refused(
    plan: Plan, mlp: keras.Model, devices: list[str]
) -> None:
    assert len(set(plan.assignment.values())) == 2  # both devices hold layers
    with pytest.raises(UsageError) as info:
        plan.apply(mlp, devices)
    message = str(info.value)
    assert message.startswith("devices= put plan devices 0 and 1 on one device") and (
        "\n" not in message
    )
    placed = plan.apply(mlp, ["/device:CPU:0", "/cpu:1"])  # distinct, in any spelling
    held = {v.value.device.split("/")[-1] for v in placed.weights}
    assert held == {"device:CPU:0", "device:CPU:1"}


@pytest.mark.parametrize(
    "names",
    [
        ("/device:CPU:0", "/device:CPU:0"),
        ("/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1"),
    ],
)
def test_a_plan_naming_one_device_twice_is_refused(
    plan: Plan, mlp: keras.Model, names: tuple[str, str]
) -> None:
    named = replace(
        plan, devices=tuple(replace(d, name=n) for d, n in zip(plan.devices, names, strict=True))
    )
    with pytest.raises(PlanError, match=r"^the plan's device names put plan devices 0 and 1"):
        named.apply(mlp)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"timeout_s": float("inf")}, "timeout_s=inf must be a positive, finite number"),
        ({"timeout_s": 1e300}, r"timeout_s=1e\+300 is more than 3600 seconds"),
        ({"timeout_s": 86401}, "timeout_s=86401 is more than 3600 seconds"),
        ({"step_timeout_s": float("inf")}, "step_timeout_s=inf must be a positive, finite"),
    ],
)
def test_an_unbounded_wait_on_a_cluster_is_refused_before_connecting(
    plan: Plan, mlp: keras.Model, tmp_path: Path, kwargs: dict[str, float], needle: str
) -> None:
    cluster = tmp_path / "down.json"
    cluster.write_text(json.dumps({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}))
    started = time.monotonic()
    with pytest.raises(UsageError, match=needle):
        plan.apply(mlp, cluster=str(cluster), **kwargs)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5  # refused, not a wait on the down tasks


@pytest.mark.parametrize("cluster", [["localhost:2222", "localhost:2223"], 7, 2.5])
def test_a_cluster_of_another_type_is_one_usage_error(cluster: object) -> None:
    with pytest.raises(UsageError, match=r"^cluster=.* is no cluster; give a cluster file"):
        load_cluster(cluster)  # type: ignore[arg-type]


def test_a_tf_config_string_is_read_as_one() -> None:
    text = json.dumps(
        {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
         "task": {"type": "worker", "index": 0}}
    )  # fmt: skip
    spec = load_cluster(text)
    assert spec.addresses == ("127.0.0.1:2222", "127.0.0.1:2223")
    with pytest.raises(UsageError, match=r"JSON"):
        load_cluster("{not json")


@pytest.mark.parametrize("strategy", ["single", "data-parallel"])
@pytest.mark.parametrize("solver", ["metis", "ilp", "even"])
def test_a_solver_beside_a_strategy_without_stages_is_refused(strategy: str, solver: str) -> None:
    with pytest.raises(UsageError, match=f"^solver='{solver}' places a model's stages"):
        SearchOptions(strategy=strategy, solver=solver)
    SearchOptions(strategy=strategy, solver="auto")
    SearchOptions(strategy="placed", solver=solver)


def test_the_cli_says_it_in_its_flags(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = subprocess.run(
        [sys.executable, "-m", "partitioner", str(REPO / "examples" / "mnist_mlp.py"),
         "--gpus", "2", "--strategy", "data-parallel", "--solver", "metis", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "partition: error: --solver metis places a model's stages, and --strategy data-parallel "
        "has none (the whole model on each device): drop --solver metis, or use --strategy "
        "placed (or 'pipeline', 'hybrid') to have it place them"
    )


# -- clusters: one check for cluster files, TF_CONFIG and a topology read from either ----------


@pytest.mark.parametrize(
    ("jobs", "needle"),
    [
        ({"worker": ["h:1"], "a/b": ["h:2"]}, "job 'a/b' is not a TensorFlow job name"),
        ({"worker": ["h:1"], "": ["h:2"]}, "job '' is not a TensorFlow job name"),
        ({"worker": ["h:1"], "w\x1b[31m": ["h:2"]}, r"job 'w\x1b[31m' is not a TensorFlow job"),
        ({"chief": ["h:1", "h:2"], "worker": ["h:3"]}, "job 'chief' lists 2 tasks"),
        ({"worker": ["h:1"], "evaluator": ["h:2", "h:3"]}, "job 'evaluator' lists 2 tasks"),
        ({"worker": [f"h:{2000 + i}" for i in range(513)]}, "lists 513 tasks, more than 512"),
        ({"worker": ["0.0.0.0:2003", "127.0.0.1:2003"]}, "lists an address twice"),
        ({"worker": ["[::]:2003", "localhost:2003"]}, "lists an address twice"),
    ],
)
def test_a_cluster_tensorflow_would_refuse_is_refused_in_one_line(
    jobs: dict[str, list[str]], needle: str, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(jobs))
    with pytest.raises(UsageError) as info:
        load_cluster(str(path))
    message = str(info.value)
    assert needle in message and "\n" not in message and "\x1b" not in message


def test_a_tf_config_job_it_does_not_define_is_refused_not_dropped() -> None:
    from cost_models.devices.topology import topology_from_tf_config
    from partitioner.core.errors import CatalogError

    config = {"cluster": {"worker": ["h0:2222"], "Worker": ["h1:2222"]}}
    with pytest.raises(CatalogError, match="has job 'Worker', which TF_CONFIG does not define"):
        topology_from_tf_config(config, device_type="cpu")
    both = {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"], "ps": ["h2:2222"]}}
    assert topology_from_tf_config(both, device_type="cpu").num_devices == 2


# -- numbers and messages at the boundary --------------------------------------------------------


def test_time_limit_takes_numpy_numbers_and_refuses_huge_ints_in_one_line() -> None:
    import numpy as np

    for value in (np.int64(5), np.float32(5), np.float16(5), np.longdouble(5)):
        assert SearchOptions(time_limit_s=value).time_limit_s == 5.0
    for value, needle in ((10**400, "is more than 86400"), (-(10**400), "must be a positive"),
                          (True, "must be a positive"), (float("nan"), "must be a positive")):  # fmt: skip
        with pytest.raises(UsageError) as info:
            SearchOptions(time_limit_s=value)
        assert needle in str(info.value) and len(str(info.value)) < 200


def test_an_error_whose_message_raises_or_is_huge_is_one_bounded_line() -> None:
    from partitioner.core.errors import MAX_MESSAGE_CHARS, error_line

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("the user's __str__ fails")

    assert error_line(Unprintable()) == "Unprintable"
    line = error_line(ValueError("x" * 5_000_000))
    assert line.startswith("x" * MAX_MESSAGE_CHARS + "... (4999000 more characters)")
