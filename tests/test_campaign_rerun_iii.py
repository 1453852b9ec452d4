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
            ["num_microbatches=4 needs pipeline=True", "strategy='pipeline' chooses the micro",
             "give pipeline=True instead of strategy='pipeline'"],
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
