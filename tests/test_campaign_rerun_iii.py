"""Defects found by the rerun of issue 34's hostile-input campaign (new cases of its kinds).

* Strategy options that contradict each other or the devices: ``--strategy pipeline
  --microbatches 4`` advised ``--pipeline``, which was then refused with ``--strategy`` (a circle);
  ``--strategy pipeline --solver single`` planned a pipeline labelled "single"; ``--gpus 1
  --strategy pipeline`` (or ``data-parallel``) planned one device without a word.
* A Keras layer refusing its input in the builder: Keras's reason was dropped, and the
  command line must not spell the arguments in Keras's own words as its flags.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import partitioner
from partitioner.core.errors import UsageError
from partitioner.core.options import SearchOptions
from tests.test_hostile_input import MNIST, one_line_error, run_main

AT_ONCE_S = 2.0
"""Refused before the model is imported: well under TensorFlow's start-up."""


@pytest.mark.parametrize(
    ("options", "devices", "words"),
    [
        (
            {"strategy": "pipeline", "num_microbatches": 4},
            2,
            [
                "num_microbatches=4 needs pipeline=True",
                "strategy='pipeline' chooses the micro",
                "give pipeline=True instead of strategy='pipeline'",
            ],
        ),
        (
            {"strategy": "hybrid", "schedule": "gpipe"},
            4,
            ["schedule='gpipe' needs pipeline=True", "strategy='hybrid' chooses"],
        ),
        (
            {"strategy": "pipeline", "solver": "single"},
            2,
            ["solver='single' puts every layer on one device", "strategy='pipeline' splits"],
        ),
        (
            {"strategy": "placed", "solver": "single"},
            2,
            ["solver='single'", "strategy='placed' splits the model into stages"],
        ),
        ({"strategy": "pipeline"}, 1, ["strategy='pipeline' needs at least 2 devices", "has 1"]),
        ({"strategy": "data-parallel"}, 1, ["needs at least 2 devices", "gpus=2 or more"]),
        ({"strategy": "hybrid"}, 2, ["strategy='hybrid' needs at least 4 devices", "has 2"]),
    ],
)
def test_contradictory_strategy_options_are_refused_with_advice_that_works(
    options: dict[str, object], devices: int, words: list[str]
) -> None:
    with pytest.raises(UsageError) as info:
        search = SearchOptions(**options)  # type: ignore[arg-type]
        search.check_devices(devices)
    text = str(info.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text


def test_what_the_strategy_options_allow_still_plans() -> None:
    SearchOptions(strategy="data-parallel", solver="single").check_devices(2)
    SearchOptions(strategy="single", solver="single").check_devices(1)
    SearchOptions(pipeline=True, num_microbatches=4).check_devices(2)
    SearchOptions(strategy="hybrid").check_devices(4)


def test_the_api_refuses_a_strategy_the_devices_cannot_run_before_the_trace() -> None:
    started = time.perf_counter()
    with pytest.raises(UsageError, match="strategy='pipeline' needs at least 2 devices"):
        partitioner.partition(object(), gpus=1, strategy="pipeline")
    assert time.perf_counter() - started < AT_ONCE_S


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--gpus", "2", "--strategy", "pipeline", "--microbatches", "4"],
            ["--microbatches 4 needs --pipeline", "give --pipeline instead of --strategy pipeline"],
        ),
        (
            ["--gpus", "2", "--strategy", "pipeline", "--solver", "single"],
            ["--solver single puts every layer on one device", "--strategy single"],
        ),
        (
            ["--gpus", "1", "--strategy", "pipeline"],
            ["--strategy pipeline needs at least 2 devices", "--gpus 2 or more"],
        ),
    ],
)
def test_the_cli_says_it_in_its_flags_and_writes_nothing(
    flags: Sequence[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    code, _, err = run_main([MNIST, *flags, "--out", out], capsys)
    one_line_error(code, err, *words)
    assert not out.exists() and os.listdir(tmp_path) == []


RESHAPE_10_TO_3X3 = (
    "import keras\n\n"
    "def build_model():\n"
    "    inp = keras.Input(shape=(10,), name='x')\n"
    "    h = keras.layers.Reshape((3, 3), name='rs')(inp)\n"
    "    return keras.Model(inp, keras.layers.Dense(2, name='d2')(h))\n"
)


def test_a_layer_refusing_its_input_in_the_builder_says_keras_reason_verbatim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keras's reason was dropped ("Exception encountered when calling Reshape.call(). (line
    5)"), and once kept, its ``input_shape=(10,)`` must not be read as the CLI's own argument
    (``--input-shape 10``): the user's code's words are quoted as they are."""
    model = tmp_path / "reshape.py"
    model.write_text(RESHAPE_10_TO_3X3)
    code, _, err = run_main([model, "--gpus", "2", "--out", tmp_path / "p.json"], capsys)
    line = one_line_error(
        code, err, "build_model() failed: ValueError in Reshape.call(): The total size of the "
        "tensor must be unchanged. Received: input_shape=(10,), target_shape=(3, 3) (line 5)"
    )  # fmt: skip
    assert "--input-shape" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reshape.py"]


def test_the_cli_spells_flags_outside_quoted_text_only() -> None:
    from partitioner.cli.main import cli_message

    text = "Keras said input_shape=(10,); give batch_size=8"
    assert cli_message(text) == "Keras said --input-shape 10; give --batch-size 8"
    assert cli_message(text, ["Keras said input_shape=(10,)"]) == (
        "Keras said input_shape=(10,); give --batch-size 8"
    )


def stateful(batch: int = 4) -> Any:
    """A stateful GRU: the model's inputs fix the batch (``keras.Input(batch_shape=...)``)."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input(batch_shape=(batch, 5, 3), name="x")
    h = keras.layers.GRU(8, stateful=True, name="gru")(inp)
    out = keras.layers.Dense(2, name="d2")(keras.layers.Dense(8, name="d1")(h))
    model = keras.Model(inp, out, name="stateful")
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize(
    ("options", "shares"),
    [
        ({"strategy": "data-parallel"}, "replicas"),
        ({"strategy": "pipeline"}, "micro-batches"),
        ({"pipeline": True, "solver": "even"}, "micro-batches"),
    ],
)
def test_a_fixed_batch_is_not_split_and_the_reason_is_the_split(
    options: dict[str, Any], shares: str
) -> None:
    """A stateful model planned with data parallelism said "traced at --batch-size 2 ... plan it
    at --batch-size 4" although 4 was given: the split made the 2. It is refused before the
    trace, naming the fixed batch, the split and the strategies that run whole batches."""
    started = time.perf_counter()
    with pytest.raises(UsageError) as info:
        partitioner.partition(stateful(), gpus=2, batch_size=4, **options)
    text = str(info.value)
    assert "\n" not in text and "traced at" not in text
    for word in ("has a fixed batch of 4", f"splits each batch into {shares}", "'placed'"):
        assert word in text, text
    assert time.perf_counter() - started < AT_ONCE_S


def test_a_fixed_batch_plans_whole_batch_strategies_and_says_what_was_left_out() -> None:
    placed = partitioner.partition(stateful(), gpus=2, batch_size=4, strategy="placed")
    assert placed.strategy is not None and placed.strategy.replicas == 1
    auto = partitioner.partition(stateful(), gpus=2, batch_size=4)
    assert auto.strategy is not None
    assert (auto.strategy.replicas, auto.strategy.num_microbatches) == (1, 1)
    assert any("not compared: data_parallel, pipeline, hybrid" in n for n in auto.solver.notes), (
        auto.solver.notes
    )


@pytest.mark.parametrize("text", ["16,,16", ",16", "16,x16", "16,,"])
def test_an_input_shape_with_an_empty_dimension_is_refused(text: str) -> None:
    """``--input-shape 16,,16`` was read as (16, 16): a typo planned silently."""
    from partitioner.cli.main import _parse_shape

    with pytest.raises(UsageError, match="is not a list of integers like 32,32,3"):
        _parse_shape([text])
    assert _parse_shape(["784,"]) == (784,)  # a trailing comma is Python's one-tuple


# -- the third campaign (new cases of the same kinds) ---------------------------------------------


@pytest.mark.parametrize("reader", ["cluster", "catalog", "tf_config"])
def test_json_nested_past_the_bound_is_one_line_in_every_reader(
    reader: str, tmp_path: Path
) -> None:
    """A cluster file, a device catalog or TF_CONFIG nested 50000 deep raised RecursionError
    (a traceback from the worker and calibrate, "internal error" from planning)."""
    from cost_models.devices.catalog import load_catalog_from
    from cost_models.devices.tf_config import parse_tf_config
    from partitioner.core.errors import PartitionError
    from passes.cluster.runtime import load_cluster

    deep = "[" * 50000 + "]" * 50000
    path = tmp_path / "deep.json"
    path.write_text('{"worker": ' + deep + "}")
    calls = {
        "cluster": lambda: load_cluster(path),
        "catalog": lambda: load_catalog_from(path),
        "tf_config": lambda: parse_tf_config('{"cluster": {"worker": ' + deep + "}}"),
    }
    with pytest.raises(PartitionError, match="nested more than 64 deep") as info:
        calls[reader]()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "pair",
    [
        ["127.1:2222", "127.0.0.1:2222"],
        ["0x7f000001:2222", "localhost:2222"],
        ["10.1:2222", "10.0.0.1:2222"],
    ],
)
def test_every_ipv4_spelling_of_one_server_is_one_address(pair: list[str]) -> None:
    from cost_models.devices.tf_config import check_addresses, parse_tf_config
    from partitioner.core.errors import PartitionError

    with pytest.raises(PartitionError, match="one server spelled two ways"):
        check_addresses(parse_tf_config({"cluster": {"worker": pair}}))


@pytest.mark.parametrize("port", ["２２２２", "٢٢٢٢"])
def test_a_port_in_other_digits_is_refused(port: str) -> None:
    from cost_models.devices.tf_config import check_addresses, parse_tf_config
    from partitioner.core.errors import PartitionError

    with pytest.raises(PartitionError, match="is not a 'host:port' address"):
        check_addresses(parse_tf_config({"cluster": {"worker": [f"localhost:{port}"]}}))


def test_numpy_integers_in_range_are_taken_as_integers() -> None:
    import numpy as np

    from partitioner.core.options import TargetOptions

    target = TargetOptions(
        gpus=np.int64(2), batch_size=np.int32(8), memory_limit_bytes=np.int64(1 << 30)
    )
    assert (type(target.gpus), type(target.batch_size)) == (int, int)
    assert type(SearchOptions(seed=np.int64(7)).seed) is int
    with pytest.raises(UsageError, match=r"gpus=np\.True_ must be a positive integer"):
        TargetOptions(gpus=np.bool_(True))


def test_a_schedule_beside_a_strategy_is_refused_through_the_api_too() -> None:
    with pytest.raises(UsageError, match="schedule='gpipe' needs pipeline=True"):
        partitioner.partition(object(), gpus=2, strategy="pipeline", schedule="gpipe")


def test_two_inputs_swapped_are_another_model(tmp_path: Path) -> None:
    import keras

    from partitioner.core.errors import PlanError

    def two_inputs(swapped: bool) -> Any:
        a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
        first, second = (b, a) if swapped else (a, b)
        out = keras.layers.Add(name="add")([keras.layers.Dense(3, name="d1")(first),
                                  keras.layers.Dense(3, name="d2")(second)])  # fmt: skip
        return keras.Model([a, b], out, name="two")

    plan = partitioner.partition(two_inputs(False), gpus=2, batch_size=8, solver="even",
                                 compare_strategies=False)  # fmt: skip
    with pytest.raises(PlanError, match="layer 'd1' is fed by \\['<input 1>'\\] here"):
        plan.apply(two_inputs(True), devices=["/device:CPU:0", "/device:CPU:1"])


def test_a_device_wildcard_is_refused() -> None:
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    plan = partitioner.partition(
        model, gpus=2, batch_size=8, solver="even", compare_strategies=False
    )
    with pytest.raises(UsageError, match="names no one device"):
        plan.apply(model, devices=["/device:CPU:*", "/device:CPU:*"])


# -- the fourth campaign -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pair",
    [
        ["[::ffff:127.0.0.1]:2222", "127.0.0.1:2222"],
        ["[0:0:0:0:0:0:0:1]:2222", "[::1]:2222"],
        ["[fe80::1]:1", "[FE80:0::1]:1"],
    ],
)
def test_every_ipv6_spelling_of_one_server_is_one_address(pair: list[str]) -> None:
    from cost_models.devices.tf_config import check_addresses, parse_tf_config
    from partitioner.core.errors import PartitionError

    with pytest.raises(PartitionError, match="one server spelled two ways"):
        check_addresses(parse_tf_config({"cluster": {"worker": pair}}))


def test_keras_reason_after_error_encountered_is_kept() -> None:
    """Keras's "Could not automatically infer the output shape ... Error encountered:" puts the
    reason on a line of its own; the one line ended at the colon."""
    from partitioner.core.errors import error_line

    wrapped = RuntimeError(
        "Exception encountered when calling Rec.call().\n\n\x1b[1mCould not automatically infer "
        "the output shape of 'rec'. Error encountered:\n\nmaximum recursion depth exceeded"
        "\x1b[0m\n\nArguments received by Rec.call():\n  • args=..."
    )
    assert error_line(wrapped) == (
        "Could not automatically infer the output shape of 'rec'. Error encountered: maximum "
        "recursion depth exceeded"
    )


def test_a_model_file_past_16_mib_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from partitioner.cli.loader import load_model
    from partitioner.core.errors import ModelLoadError

    big = tmp_path / "big.py"
    with open(big, "wb") as f:
        f.truncate(17 << 20)  # sparse: nothing is written, and nothing read
    with pytest.raises(ModelLoadError, match=r"more than 16\.00 MiB, the largest model file"):
        load_model(str(big))
