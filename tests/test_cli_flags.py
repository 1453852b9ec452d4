"""The command line's table from the library's argument names to its flags (fast: no
subprocess). ``tests/test_cli.py`` checks the same errors as a user sees them."""

from __future__ import annotations

from dataclasses import fields

import pytest

from partitioner.cli.main import FLAGS, build_parser, cli_message
from partitioner.core.options import MeasureOptions, SearchOptions, TargetOptions


def test_flags_cover_every_api_option() -> None:
    """Every field of the API's option groups has a spelling on the command line, and every
    flag in the table is one the parser knows."""
    names = {f.name for group in (TargetOptions, SearchOptions, MeasureOptions) for f in fields(group)}
    assert names <= set(FLAGS), names - set(FLAGS)
    known = {o for action in build_parser()._actions for o in action.option_strings}
    for template in FLAGS.values():
        flag = template.split(" ")[0]
        assert flag in known or flag == "PARTITIONER_CACHE_DIR={}", template


@pytest.mark.parametrize(
    ("api", "cli"),
    [
        ("gpus=0 must be a positive integer", "--gpus 0 must be a positive integer"),
        ("batch_size=32 is not divisible by num_microbatches=3;", "--batch-size 32 is not divisible by --microbatches 3;"),
        ("(use gpus=2 or more, or drop pipeline=True)", "(use --gpus 2 or more, or drop --pipeline)"),
        ("plan for device_type='cpu', or use profile=True.", "plan for --device-type cpu, or use --profile."),
        ("give input_shape=(32, 32, 3)", "give --input-shape 32,32,3"),
        ("schedule='gpipe' needs pipeline=True", "--schedule gpipe needs --pipeline"),
        ("raise time_limit_s=5.", "raise --time-limit 5."),
        ("memory_limit='3XB' is not a size", "--memory-limit 3XB is not a size"),
        ("profile_ops=True times ops", "--profile-ops times ops"),
        ("topology='my cluster.toml' has", "--topology 'my cluster.toml' has"),
        ("(device_type=, gpus=)", "(--device-type, --gpus)"),
        ("solver='auto' instead", "--solver auto instead"),
        ("strategy='auto' needs compare_strategies=True", "--strategy auto needs --strategies"),
        ("strategy='data_parallel' does not fit", "--strategy data-parallel does not fit"),
        ("unchanged: --out x.json, random_seed=3, a.gpus=2", "unchanged: --out x.json, random_seed=3, a.gpus=2"),
    ],
)  # fmt: skip
def test_cli_message_spells_api_arguments_as_flags(api: str, cli: str) -> None:
    assert cli_message(api) == cli


@pytest.mark.parametrize("spelling", ["data-parallel", "data_parallel"])
def test_strategy_flag_takes_either_spelling(spelling: str) -> None:
    from partitioner.cli.main import _options
    from partitioner.core.strategy import Family

    args = build_parser().parse_args(["model.py", "--strategy", spelling])
    assert _options(args)[1].strategy is Family.DATA_PARALLEL
