"""partition(precision=...): checked before any slow work, priced, and said in the plan."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest

import partitioner
from partitioner.core.errors import UsageError

TWO_TYPES = Path(__file__).resolve().parents[1] / "examples" / "topologies" / "two_gpu_types.toml"


def _mlp() -> keras.Model:
    x = keras.Input((64,), name="x")
    h = keras.layers.Dense(256, activation="relu", name="d1")(x)
    return keras.Model(x, keras.layers.Dense(10, name="d2")(h))


def test_an_unknown_precision_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError, match=r"precision='fp8'"):
        partitioner.partition(_mlp(), gpus=1, solver="single", precision="fp8")


def test_the_plan_says_which_precision_it_priced() -> None:
    model = _mlp()
    common = {"gpus": 1, "device_type": "a100", "solver": "single", "compare_strategies": False}
    default = partitioner.partition(model, **common)
    mixed = partitioner.partition(model, precision="fp16", **common)
    assert "priced at precision tf32 (the model's dtype policy)" in default.cost_notes
    assert "priced at precision mixed_float16 (precision='fp16')" in mixed.cost_notes
    assert mixed.step_time_s < default.step_time_s


def test_the_plan_says_which_roofline_priced_each_device_family() -> None:
    common = {"solver": "single", "compare_strategies": False}
    a100 = partitioner.partition(_mlp(), gpus=1, device_type="a100", **common)
    assert a100.cost_notes[0].endswith(": roofline calibrated for ampere")
    mixed = partitioner.partition(
        _mlp(), topology=str(TWO_TYPES), **common
    )
    assert "calibrated for volta but not for hopper" in mixed.cost_notes[0]
    assert "compare them with care" in mixed.cost_notes[0]
