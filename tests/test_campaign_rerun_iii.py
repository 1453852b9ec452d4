"""Defects found by the rerun of issue 34's hostile-input campaign (new cases of its kinds).

* Strategy options that contradict each other or the devices: ``--strategy pipeline
  --microbatches 4`` advised ``--pipeline``, which was then refused with ``--strategy`` (a circle);
  ``--strategy pipeline --solver single`` planned a pipeline labelled "single"; ``--gpus 1
  --strategy pipeline`` (or ``data-parallel``) planned one device without a word.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

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
