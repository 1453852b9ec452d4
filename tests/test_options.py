"""The option groups of a planning run (:mod:`partitioner.core.options`): pure data that checks
its own fields and names them as the Python API spells them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from partitioner.core.errors import PartitionError, UsageError
from partitioner.core.ir import Schedule
from partitioner.core.options import (
    DEFAULT_SCHEDULE,
    MeasureOptions,
    SearchOptions,
    TargetOptions,
    parse_memory_limit,
    parse_schedule,
)


def test_defaults_are_the_apis() -> None:
    target, search, measure = TargetOptions(), SearchOptions(), MeasureOptions()
    assert (target.gpus, target.device_type, target.topology, target.batch_size) == (
        None, None, "pcie", 32,
    )  # fmt: skip
    assert (target.input_shape, target.optimizer, target.memory_limit_bytes) == (None, "adam", None)
    assert (search.solver, search.seed, search.time_limit_s, search.pipeline) == (
        "auto", 0, 5.0, False,
    )  # fmt: skip
    assert search.pipeline_schedule is None and search.microbatches_for(32, 2) == 1
    assert measure == MeasureOptions(profile=False, profile_ops=False, cache_dir=None)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TargetOptions(gpus=0), "gpus=0 must be a positive integer"),
        (lambda: TargetOptions(gpus=True), "gpus=True must be a positive integer"),
        (lambda: TargetOptions(batch_size=-1), "batch_size=-1 must be a positive integer"),
        (lambda: TargetOptions(device_type=""), "device_type='' must be a non-empty string"),
        (lambda: TargetOptions(input_shape=(32, 0)), r"input_shape=\(32, 0\) must be positive"),
        (lambda: TargetOptions(input_shape=()), r"input_shape=\(\) must be positive"),
        (lambda: TargetOptions(memory_limit_bytes=0), "memory_limit_bytes=0 must be a positive"),
        (lambda: SearchOptions(seed=1.5), "seed=1.5 must be an integer"),
        (lambda: SearchOptions(time_limit_s=0), "time_limit_s=0 must be a positive number"),
        (lambda: SearchOptions(time_limit_s=float("inf")), "time_limit_s=inf must be"),
        (lambda: SearchOptions(pipeline=1), "pipeline=1 must be True or False"),
        (lambda: SearchOptions(num_microbatches=4), "num_microbatches=4 needs pipeline=True"),
        (lambda: SearchOptions(schedule=Schedule.GPIPE), "schedule='gpipe' needs pipeline=True"),
        (lambda: SearchOptions(pipeline=True, num_microbatches=0), "num_microbatches=0 must be"),
        (
            lambda: SearchOptions(pipeline=True, schedule=Schedule.NONE),
            "pipeline=True needs a pipeline schedule",
        ),
        (lambda: MeasureOptions(profile="yes"), "profile='yes' must be True or False"),
    ],
)
def test_each_field_is_checked_where_it_is_defined(build: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        build()
    assert isinstance(info.value, PartitionError)
    assert "--" not in str(info.value), "library errors name API arguments, not flags"


def test_input_shape_becomes_a_tuple_of_ints() -> None:
    shape = TargetOptions(input_shape=[np.int64(32), 32, 3]).input_shape  # type: ignore[arg-type]
    assert shape == (32, 32, 3) and all(type(d) is int for d in shape)
    with pytest.raises(UsageError, match="input_shape="):
        TargetOptions(input_shape=(True, 3))


def test_schedules_are_parsed_from_names() -> None:
    assert parse_schedule("GPipe") is Schedule.GPIPE
    assert parse_schedule(Schedule.ONE_F_ONE_B) is Schedule.ONE_F_ONE_B
    with pytest.raises(UsageError, match="schedule='zigzag' is not a pipeline schedule; known: "):
        parse_schedule("zigzag")
    assert SearchOptions(pipeline=True).pipeline_schedule is DEFAULT_SCHEDULE
    chosen = SearchOptions(pipeline=True, schedule="gpipe")  # type: ignore[arg-type]
    assert chosen.pipeline_schedule is Schedule.GPIPE


def test_microbatches_for_the_batch_and_devices() -> None:
    search = SearchOptions(pipeline=True)
    assert search.microbatches_for(16, 2) == 8  # the most up to 4 x devices dividing 16
    assert search.microbatches_for(12, 4) == 12
    assert search.microbatches_for(7, 2) == 7
    assert SearchOptions(pipeline=True, num_microbatches=4).microbatches_for(16, 2) == 4
    with pytest.raises(UsageError, match="batch_size=32 is not divisible by num_microbatches=3"):
        SearchOptions(pipeline=True, num_microbatches=3).microbatches_for(32, 2)
    with pytest.raises(UsageError, match="pipeline=True needs at least 2 devices"):
        search.microbatches_for(32, 1)


def test_memory_limit_text() -> None:
    assert parse_memory_limit("1KiB") == 1024
    with pytest.raises(UsageError, match="memory_limit='3XB' is not a size"):
        parse_memory_limit("3XB")


def test_options_are_frozen() -> None:
    with pytest.raises(AttributeError):
        TargetOptions().gpus = 2  # type: ignore[misc]
