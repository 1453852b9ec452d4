"""Hostile input, round three (issue 34): every number bounded at the boundary, every argument's
type checked, and options that contradict each other refused.

Each bad value is refused by the option groups (:mod:`partitioner.core.options`) or by
:func:`partitioner.api.prepare`, which the API and the command line share: a
:class:`UsageError` (a :class:`PartitionError` from a topology file) naming the argument as the
API spells it, in under a second and before anything is traced. On the command line the same
check prints one line in its flags' terms, exits 2 and writes nothing.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import partitioner
from partitioner.api import partition_prepared, prepare
from partitioner.core.errors import PartitionError, UsageError
from partitioner.core.ir import Device, Link, PartitionProblem, Topology
from partitioner.core.options import (
    MAX_MEMORY_BYTES,
    MAX_SEED,
    SearchOptions,
    TargetOptions,
    parse_memory_limit,
)
from partitioner.core.units import parse_bytes
from partitioner.solvers import get_solver, solver_names

cli = importlib.import_module("partitioner.cli.main")  # the module; partitioner.cli.main is main()

REPO = Path(__file__).resolve().parents[1]
TINY = (
    "import keras\n\n"
    "def build_model():\n"
    "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name='a'),"
    " keras.layers.Dense(2, name='b')])\n"
)
AT_ONCE_S = 1.0


@pytest.fixture(scope="module")
def model() -> keras.Model:
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")]
    )


@pytest.fixture(autouse=True)
def no_trace(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every refusal here comes before the trace: tracing fails the test. The first ``prepare``
    of the process loads the catalog and the solver registry, so it runs before the timing."""
    prepare(TargetOptions(gpus=2))

    def traced(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was traced before the bad option was refused")

    monkeypatch.setattr("passes.trace.trace_model", traced)
    yield


def refused(model: Any, words: Sequence[str], **kwargs: Any) -> str:
    """``partition(model, **kwargs)`` raises a one-line UsageError holding ``words``, at once."""
    started = time.perf_counter()
    with pytest.raises(UsageError) as info:
        partitioner.partition(model, **kwargs)
    elapsed = time.perf_counter() - started
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert elapsed < AT_ONCE_S, f"refused after {elapsed:.2f} s: {message}"
    return message


# -- numbers past their bounds, through the API ----------------------------------------------------

PAST_BOUNDS = [
    ({"seed": 2**31}, ["seed=2147483648", "0..2147483647"]),
    ({"seed": -1}, ["seed=-1", "0..2147483647"]),
    ({"seed": 10**100}, ["seed=1000", "0..2147483647"]),
    ({"memory_limit_bytes": 10**30}, ["memory_limit_bytes=10000", "1 EiB"]),
    ({"memory_limit_bytes": int(9.3e18)}, ["memory_limit_bytes=9300000000000000000", "1 EiB"]),
    ({"memory_limit_bytes": MAX_MEMORY_BYTES + 1}, ["memory_limit_bytes=", "1 EiB"]),
    ({"memory_limit_bytes": -5}, ["memory_limit_bytes=-5", "positive integer of bytes"]),
    ({"memory_limit_bytes": 0}, ["memory_limit_bytes=0", "positive integer of bytes"]),
    ({"gpus": 513}, ["gpus=513", "at most 512"]),
    ({"batch_size": 2**24 + 1}, ["batch_size=16777217", "at most 16777216"]),
    ({"pipeline": True, "num_microbatches": 1025}, ["num_microbatches=1025", "at most 1024"]),
    ({"time_limit_s": 1e12}, ["time_limit_s=1000000000000.0", "at most 86400"]),
    ({"time_limit_s": float("nan")}, ["time_limit_s=nan", "positive number of seconds"]),
    ({"time_limit_s": float("inf")}, ["time_limit_s=inf", "positive number of seconds"]),
    ({"time_limit_s": -1.0}, ["time_limit_s=-1.0", "positive number of seconds"]),
    ({"input_shape": (100_000, 100_000, 3)}, ["input_shape=(100000, 100000, 3)", "2147483648"]),
    ({"input_shape": {"x": (10**10,)}}, ["input_shape={'x': (10000000000,)}", "per sample"]),
]


@pytest.mark.parametrize(("kwargs", "words"), PAST_BOUNDS, ids=lambda v: repr(v)[:40])
def test_numbers_past_their_bounds_are_refused_before_the_trace(
    model: keras.Model, kwargs: dict[str, Any], words: list[str]
) -> None:
    refused(model, words, **{"gpus": 2, **kwargs})


def test_the_bounds_themselves_are_accepted() -> None:
    prepared = prepare(
        TargetOptions(gpus=512, batch_size=2**24, memory_limit_bytes=MAX_MEMORY_BYTES),
        SearchOptions(seed=MAX_SEED, time_limit_s=86_400.0, pipeline=True, num_microbatches=1024),
    )
    assert prepared.num_microbatches == 1024
    assert {d.memory_bytes for d in prepared.topology.devices} == {MAX_MEMORY_BYTES}
    assert SearchOptions(seed=0).seed == 0
    assert parse_memory_limit("1048576TiB") == MAX_MEMORY_BYTES


@pytest.mark.parametrize("name", solver_names())
def test_every_solver_takes_the_largest_seed_and_memory(name: str) -> None:
    """The bounds are what the solvers take: the seed reaches OR-Tools and METIS as a 32-bit
    integer, the memory their 64-bit arrays."""
    devices = tuple(Device(d, "gpu", MAX_MEMORY_BYTES) for d in range(2))
    problem = PartitionProblem(
        layers=("l0", "l1", "l2"),
        compute_time_s=((1.0, 2.0, 1.0),) * 2,
        memory_bytes=(10, 20, 10),
        edges=((0, 1, 1000), (1, 2, 1000)),
        topology=Topology(devices, Link("l", 1e-6, 1e9)),
    )
    solver = get_solver(name, seed=MAX_SEED, time_limit_s=0.5)
    result = solver.solve(problem)
    assert len(result.assignment) == 3


# -- wrong types, through the API -------------------------------------------------------------------

WRONG_TYPES = [
    ("gpus", True),
    ("gpus", 2.0),
    ("gpus", "2"),
    ("batch_size", True),
    ("batch_size", 32.0),
    ("batch_size", "32"),
    ("seed", True),
    ("seed", 1.0),
    ("seed", "0"),
    ("seed", None),
    ("memory_limit_bytes", True),
    ("memory_limit_bytes", 1e30),
    ("memory_limit_bytes", float("nan")),
    ("memory_limit_bytes", float("inf")),
    ("memory_limit_bytes", "16GiB"),
    ("time_limit_s", True),
    ("time_limit_s", "5"),
    ("time_limit_s", None),
    ("num_microbatches", True),
    ("num_microbatches", 2.0),
    ("num_microbatches", "4"),
    ("input_shape", ("4",)),
    ("input_shape", (True,)),
    ("input_shape", 4.0),
    ("pipeline", 1),
    ("pipeline", "yes"),
    ("compare_strategies", 1),
    ("profile", 1),
    ("profile_ops", "no"),
    ("schedule", 3),
    ("solver", 3),
    ("device_type", 3),
    ("topology", 3),
    ("optimizer", None),
    ("precision", 16),
    ("strategy", 3),
    ("cache_dir", 3),
    ("target", "x"),
    ("search", 1),
    ("measure", object()),
    ("progress", 5),
]


@pytest.mark.parametrize(("name", "value"), WRONG_TYPES, ids=lambda v: repr(v)[:20])
def test_a_wrong_type_is_one_usage_error_naming_the_argument(
    model: keras.Model, name: str, value: Any
) -> None:
    kwargs: dict[str, Any] = {"gpus": 2, name: value}
    if name == "num_microbatches":
        kwargs["pipeline"] = True
    refused(model, [f"{name}="], **kwargs)


@pytest.mark.parametrize("thing", [None, "model.py", 3, keras.layers.Dense(2)], ids=repr)
def test_what_is_no_keras_model_is_refused_before_the_trace(thing: object) -> None:
    refused(thing, ["model= is ", "not a Keras model"], gpus=2)


def test_a_bool_or_float_of_one_microbatch_is_refused_without_pipelining(
    model: keras.Model,
) -> None:
    """Without pipelining the integer 1 means the whole batch; ``True`` and ``1.0`` are not it."""
    refused(model, ["num_microbatches=True", "positive integer"], gpus=2, num_microbatches=True)
    refused(model, ["num_microbatches=1.0", "positive integer"], gpus=2, num_microbatches=1.0)


def test_an_array_beside_an_option_group_is_refused(model: keras.Model) -> None:
    refused(
        model,
        ["got target= and also input_shape="],
        target=TargetOptions(gpus=2),
        input_shape=np.array([4]),
    )


def test_the_halves_check_their_arguments() -> None:
    with pytest.raises(UsageError, match=r"^target=\{'gpus': 2\} must be a TargetOptions"):
        prepare({"gpus": 2})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"^search='auto' must be a SearchOptions"):
        prepare(TargetOptions(gpus=2), "auto")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"^prepared=None must be what prepare"):
        partition_prepared(object(), None)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"^memory_limit=16 must be a size"):
        parse_memory_limit(16)  # type: ignore[arg-type]


# -- contradictory options ------------------------------------------------------------------------

CONTRADICTIONS = [
    (
        {"gpus": 2, "batch_size": 16, "pipeline": True, "num_microbatches": 1},
        ["num_microbatches=1 with pipeline=True", "at least 2 micro-batches", "drop pipeline=True"],
    ),
    (
        {"gpus": 2, "batch_size": 1, "pipeline": True},
        ["batch_size=1 cannot be split into micro-batches", "drop pipeline=True"],
    ),
    (
        {"gpus": 2, "solver": "single", "pipeline": True},
        ["solver='single'", "one device", "drop pipeline=True"],
    ),
    (
        {"gpus": 2, "batch_size": 37, "pipeline": True},
        ["batch_size=37 has no divisor from 2 to 8", "num_microbatches=37"],
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "words"), CONTRADICTIONS, ids=["one-microbatch", "batch-1", "single", "prime"]
)
def test_a_pipeline_of_one_microbatch_or_one_device_is_refused(
    model: keras.Model, kwargs: dict[str, Any], words: list[str]
) -> None:
    refused(model, words, **kwargs)


def test_a_pipeline_always_has_two_microbatches_or_more() -> None:
    for batch in range(2, 200):
        for devices in (2, 3, 4, 8):
            try:
                m = SearchOptions(pipeline=True).microbatches_for(batch, devices)
            except UsageError as exc:
                assert "has no divisor" in str(exc)
                continue
            assert m >= 2 and batch % m == 0


# -- sizes and topology files ---------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1e30", "9.3e18", "1e400", "1048577TiB"])
def test_sizes_past_one_exbibyte_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="more than 1 EiB"):
        parse_bytes(text)
    with pytest.raises(UsageError, match=f"^memory_limit={text!r} is more than 1 EiB"):
        parse_memory_limit(text)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"devices": [{"type": "h100", "memory": 2**61}] * 2}, ["big.json", "more than 1 EiB"]),
        ({"devices": [{"type": "h100", "memory": "1e400"}] * 2}, ["big.json", "more than 1 EiB"]),
        ({"devices": [{"type": "h100"}] * 513}, ["big.json", "513 devices", "more than 512"]),
    ],
    ids=["memory-int", "memory-1e400", "513-devices"],
)
def test_a_topology_file_past_the_bounds_is_refused_by_the_api(
    model: keras.Model, data: dict[str, Any], words: list[str], tmp_path: Path
) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(data))
    started = time.perf_counter()
    with pytest.raises(PartitionError) as info:
        partitioner.partition(model, topology=str(path))
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value)
    # the devices are counted as the file is read, before one is made (the limit is the
    # topology reader's own, partitioner.core.options.MAX_DEVICES)
    assert time.perf_counter() - started < AT_ONCE_S


# -- the command line -------------------------------------------------------------------------------


def run_main(
    args: Sequence[str | os.PathLike[str]], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``partition ARGS`` in this process: (exit code, stderr)."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main([os.fspath(a) for a in args])
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    return code, capsys.readouterr().err


def check_one_line(code: int, err: str, words: Sequence[str]) -> str:
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert "Traceback" not in err and "internal error" not in err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


CLI_CASES = [
    (["--seed", "2147483648"], ["--seed 2147483648", "0..2147483647"]),
    (["--seed=-1"], ["--seed -1", "0..2147483647"]),
    (["--seed", "True"], ["--seed", "invalid int value"]),
    (["--memory-limit", "1e30"], ["--memory-limit 1e30", "more than 1 EiB"]),
    (["--memory-limit", "9.3e18"], ["--memory-limit 9.3e18", "more than 1 EiB"]),
    (["--memory-limit", "1e400"], ["--memory-limit 1e400", "more than 1 EiB"]),
    (["--memory-limit", "nan"], ["--memory-limit nan", "is not a size"]),
    (["--memory-limit=-5"], ["--memory-limit -5", "is not a size"]),
    (["--time-limit", "nan"], ["--time-limit nan", "positive number of seconds"]),
    (
        ["--pipeline", "--microbatches", "1"],
        ["--microbatches 1 with --pipeline", "drop --pipeline"],
    ),
    (["--batch-size", "1", "--pipeline"], ["--batch-size 1 cannot be split", "drop --pipeline"]),
    (["--solver", "single", "--pipeline"], ["--solver single", "drop --pipeline"]),
    (["--gpus", "2.5"], ["--gpus", "invalid int value"]),
]


@pytest.mark.parametrize(("flags", "words"), CLI_CASES, ids=lambda v: " ".join(v)[:30])
def test_the_command_line_refuses_in_one_line_and_writes_nothing(
    flags: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_file = tmp_path / "tiny.py"
    model_file.write_text(TINY)
    outputs = ["--out", tmp_path / "p.json", "--report", tmp_path / "r.html"]
    args = [model_file, *(["--gpus", "2"] if "--gpus" not in flags else []), *flags, *outputs]
    started = time.perf_counter()
    code, err = run_main(args, capsys)
    check_one_line(code, err, words)
    assert time.perf_counter() - started < AT_ONCE_S
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.py"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--seed", "2147483648"], ["partition: error: --seed 2147483648"]),
        (["--memory-limit", "1e400"], ["partition: error: --memory-limit 1e400"]),
        (["--pipeline", "--microbatches", "1"], ["partition: error: --microbatches 1"]),
    ],
    ids=["seed", "memory", "one-microbatch"],
)
def test_python_dash_m_refuses_in_one_line_with_exit_2(
    flags: list[str], words: list[str], tmp_path: Path
) -> None:
    model_file = tmp_path / "tiny.py"
    model_file.write_text(TINY)
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner", model_file, "--gpus", "2", *flags, "--out", "p.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    check_one_line(proc.returncode, proc.stderr, words)
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.py"]
