"""Issue 34, the sixth rerun of the hostile-input campaign: what a plan is applied to and read
from (README rows 95 and 100)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import pytest

from partitioner import Plan, load_plan
from partitioner.core.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", [None, 5, b"plan.json", ["plan.json"]])
def test_load_plan_of_no_path_is_one_usage_error(path: Any) -> None:
    needs = r"^load_plan needs a path \(a str or os.PathLike\), got"
    with pytest.raises(UsageError, match=needs) as info:
        load_plan(path)
    assert "\n" not in str(info.value) and type(path).__name__ in str(info.value)


@pytest.mark.parametrize("model", [None, "mlp.py", 7])
def test_apply_to_what_is_no_model_is_one_usage_error(plan: Plan, model: Any) -> None:
    with pytest.raises(UsageError, match=r"^Plan.apply needs a keras.Model, got ") as info:
        plan.apply(model)
    assert "\n" not in str(info.value)


def test_apply_to_a_copy_it_already_placed_is_refused(plan: Plan, mlp: keras.Model) -> None:
    placed = plan.apply(mlp, ["/device:CPU:0", "/device:CPU:1"])
    with pytest.raises(UsageError, match=r"is already a copy placed by Plan.apply") as info:
        plan.apply(placed, ["/device:CPU:0", "/device:CPU:1"])
    assert "\n" not in str(info.value)
    assert plan.apply(mlp, ["/device:CPU:0", "/device:CPU:1"]) is not placed  # the original
