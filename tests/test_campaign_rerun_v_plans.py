"""Campaign rerun (issue 34): a plan file is held to the bounds the planner holds a run to, and
``--device-type`` beside a topology file is not dropped without a word.

P5-P8: a plan file whose ``batch_size`` is 10**18 (a run takes at most 2**24), whose device
memory is 10**30 (at most 1 EiB), whose ``lower_bound_s`` is above its own step, or whose
``device_type`` is not in the device catalog loaded, and ``partition show`` exited 0. Now the
plan schema carries the planner's bounds (filled in from ``partitioner.core.options`` and the
catalog) and the reader the cross-field check; each is refused in one line naming the field, the
value and the bound, and saying to make the plan again.

P9: a plan file whose ``input_shape`` contradicts its own fingerprint loaded, and ``plan.apply``
failed with Keras's multi-line ValueError. Now the reader refuses it, naming both.

O10: ``--topology FILE --device-type v100`` (and ``partition(topology=FILE, device_type=...)``)
planned the file's devices and never said that v100 was ignored. Now a device type given beside
a file that names every device's type is refused unless every device is of that type; a file's
entries that name no type still take it (the documented meaning).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from report_plans import make_plan

from partitioner.api import prepare
from partitioner.core.errors import PlanError, UsageError
from partitioner.core.options import MAX_BATCH_SIZE, MAX_MEMORY_BYTES, TargetOptions
from partitioner.plan.model import InputSignature, ModelFingerprint, Plan, load_plan, plan_digest

cli = importlib.import_module("partitioner.cli.main")  # the module; partitioner.cli.main is main()
REPO = Path(__file__).resolve().parent.parent
CPU_PLUS_GPUS = REPO / "examples" / "topologies" / "cpu_plus_gpus.toml"
MNIST = REPO / "examples" / "mnist_mlp.py"


def _fingerprinted() -> Plan:
    """A plan (pure Python) for a one-input model of 16 features, with its fingerprint."""
    plan = make_plan(pipelined=False, with_timeline=False)
    inputs = (InputSignature("x", (16,), "float32"),)
    weights = tuple((name, ()) for name in plan.layer_order)  # it covers every placed layer
    return replace(plan, input_shape=(16,), fingerprint=ModelFingerprint(inputs, weights))


def _write(tmp_path: Path, change: Callable[[dict[str, Any]], None], name: str) -> Path:
    data = copy.deepcopy(json.loads(_fingerprinted().to_json()))
    change(data)
    data["digest"] = plan_digest(data)  # as written: the figures under test, not the digest
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def _refused(path: Path) -> str:
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ") and message.endswith("make the plan again")
    return message


def _show(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``partition show PATH`` in this process: (exit code, stderr)."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(["show", os.fspath(path)])
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    return code, capsys.readouterr().err


def _devices(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        for device in data["devices"]:
            device[key] = value

    return change


PAST_BOUNDS: dict[str, tuple[Callable[[dict[str, Any]], None], Sequence[str]]] = {
    "batch_1e18": (
        lambda d: d.update(batch_size=10**18),
        ["'batch_size'", f"<= {MAX_BATCH_SIZE}", str(10**18)],
    ),
    "memory_1e30": (
        _devices("memory_bytes", 10**30),
        ["'devices[0].memory_bytes'", f"<= {MAX_MEMORY_BYTES}", str(10**30)],
    ),
    "peak_1e30": (
        lambda d: d["predicted"]["memory_bytes"].__setitem__(0, 10**30),
        ["'predicted.memory_bytes[0]'", f"<= {MAX_MEMORY_BYTES}", str(10**30)],
    ),
    "limit_1e30": (
        lambda d: d["predicted"]["memory_limit_bytes"].__setitem__(1, 10**30),
        ["'predicted.memory_limit_bytes[1]'", f"<= {MAX_MEMORY_BYTES}"],
    ),
    "lower_bound_above_step": (
        lambda d: d["predicted"].update(lower_bound_s=10.0),
        ["'predicted.lower_bound_s'", "10.0", "above", "'predicted.step_time_s'"],
    ),
    "device_type_tpu9000": (
        _devices("device_type", "tpu9000"),
        ["'devices[0].device_type' is 'tpu9000', not a device type of the catalog (cpu, t4,"],
    ),
    "too_many_devices": (
        lambda d: d.update(devices=[dict(d["devices"][0], index=i) for i in range(513)]),
        ["'devices'", "at most 512 items", "got 513"],
    ),
}


@pytest.mark.parametrize("case", sorted(PAST_BOUNDS))
def test_a_plan_file_past_the_planners_bounds_is_refused(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, words = PAST_BOUNDS[case]
    path = _write(tmp_path, change, case)
    message = _refused(path)
    for word in words:
        assert word in message, (word, message)
    code, err = _show(path, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "make the plan again" in err, err


def test_the_bounds_themselves_load(tmp_path: Path) -> None:
    def at_bounds(d: dict[str, Any]) -> None:
        d.update(batch_size=MAX_BATCH_SIZE)
        for device in d["devices"]:
            device.update(memory_bytes=MAX_MEMORY_BYTES, device_type="a100-80gb")
        d["predicted"].update(lower_bound_s=d["predicted"]["step_time_s"])
        d["predicted"]["memory_limit_bytes"] = [MAX_MEMORY_BYTES] * len(d["devices"])

    plan = load_plan(_write(tmp_path, at_bounds, "at_bounds"))
    assert plan.batch_size == MAX_BATCH_SIZE and plan.lower_bound_s == plan.step_time_s
    assert {d.memory_bytes for d in plan.devices} == {MAX_MEMORY_BYTES}


def test_a_lower_bound_a_rounding_above_the_step_loads(tmp_path: Path) -> None:
    """The bound and the step are sums of the same times in another order."""
    step = 1.2e-3
    path = _write(
        tmp_path,
        lambda d: d["predicted"].update(step_time_s=step, lower_bound_s=step * (1 + 1e-15)),
        "rounding",
    )
    assert load_plan(path).step_time_s == step


@pytest.mark.parametrize(
    ("input_shape", "spelled"),
    [([999], "[999]"), ({"x": [17]}, "{'x': [17]}"), ({"y": [16]}, "{'y': [16]}")],
)
def test_an_input_shape_that_contradicts_the_fingerprint_is_refused(
    input_shape: Any, spelled: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, lambda d: d.update(input_shape=input_shape), "shape")
    message = _refused(path)
    assert f"field 'input_shape' {spelled} contradicts 'fingerprint.inputs'" in message
    assert "'x' [16]" in message
    code, err = _show(path, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "'input_shape'" in err, err


@pytest.mark.parametrize("input_shape", [[16], {"x": [16]}, None])
def test_an_input_shape_that_agrees_with_the_fingerprint_loads(
    input_shape: Any, tmp_path: Path
) -> None:
    plan = load_plan(_write(tmp_path, lambda d: d.update(input_shape=input_shape), "shape"))
    assert plan.fingerprint is not None and plan.fingerprint.inputs[0].shape == (16,)


def test_an_input_shape_without_a_fingerprint_loads(tmp_path: Path) -> None:
    """Plans of earlier releases have no fingerprint: nothing to contradict."""
    path = _write(tmp_path, lambda d: d.update(input_shape=[999], fingerprint=None), "old")
    assert load_plan(path).input_shape == (999,)


# -- O10: --device-type beside a topology file ------------------------------------------------


def test_a_device_type_a_topology_file_would_ignore_is_refused() -> None:
    with pytest.raises(UsageError) as info:
        prepare(TargetOptions(topology=str(CPU_PLUS_GPUS), device_type="v100"))
    message = str(info.value)
    assert "\n" not in message
    assert "names the type of each of its devices (cpu, l4)" in message
    assert "device_type='v100' would be ignored" in message
    assert message.endswith("; drop one of the two")


def test_the_command_line_refuses_it_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(
            [str(MNIST), "--topology", str(CPU_PLUS_GPUS), "--device-type", "v100", "--out", str(out)]
        )
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--device-type v100 would be ignored; drop one of the two" in err
    assert "cpu_plus_gpus.toml" in err
    assert not out.exists()


def test_a_topology_file_alone_plans_its_own_types() -> None:
    prepared = prepare(TargetOptions(topology=str(CPU_PLUS_GPUS)))
    assert [d.device_type for d in prepared.topology.devices] == ["cpu", "l4", "l4"]


def test_a_device_type_the_file_agrees_with_is_taken(tmp_path: Path) -> None:
    topology = tmp_path / "cpus.toml"
    topology.write_text('[[devices]]\ntype = "cpu"\ncount = 2\n')
    prepared = prepare(TargetOptions(topology=str(topology), device_type="CPU"))
    assert [d.device_type for d in prepared.topology.devices] == ["cpu", "cpu"]


def test_entries_that_name_no_type_take_the_device_type(tmp_path: Path) -> None:
    topology = tmp_path / "typeless.toml"
    topology.write_text('[[devices]]\ntype = "cpu"\n\n[[devices]]\ncount = 2\n')
    given = prepare(TargetOptions(topology=str(topology), device_type="v100"))
    assert [d.device_type for d in given.topology.devices] == ["cpu", "v100", "v100"]
    default = prepare(TargetOptions(topology=str(topology)))
    assert [d.device_type for d in default.topology.devices] == ["cpu", "h100", "h100"]


def test_a_link_kind_still_takes_the_device_type_and_its_default() -> None:
    assert {d.device_type for d in prepare(TargetOptions(gpus=2)).topology.devices} == {"h100"}
    given = prepare(TargetOptions(gpus=2, device_type="cpu"))
    assert {d.device_type for d in given.topology.devices} == {"cpu"}
