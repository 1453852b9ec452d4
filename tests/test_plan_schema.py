"""The plan JSON Schema: every plan we write validates; a broken file is refused naming the field;
a plan for another model is refused naming the missing and extra layers."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
from report_plans import XSS_IMG, make_plan

from partitioner.core.errors import PlanError
from partitioner.core.ir import EventKind, Schedule
from partitioner.plan.model import SCHEMA_VERSION, Plan
from partitioner.plan.schema import check_plan_matches_model, plan_schema, validate_plan_data

PLANS = {
    "pipelined": make_plan(),
    "no timeline": make_plan(pipelined=False, with_timeline=False, over_memory=True),
    "bare": replace(
        make_plan(pipelined=False, with_timeline=False),
        baselines=(),
        warnings=(),
        advice=(),
        layer_edges=(),
        layer_compute_s=(),
        input_shape=None,
        phase_times_s=(),
    ),
}


def data_of(plan: Plan) -> dict[str, Any]:
    """What a saved plan file holds (through JSON text, as load_plan sees it)."""
    return json.loads(plan.to_json())  # type: ignore[no-any-return]


def refused(data: Any) -> str:
    with pytest.raises(PlanError) as info:
        validate_plan_data(data, "plan.json")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("plan.json: ")
    return message


def test_the_schema_is_valid_draft_2020_12_and_versioned() -> None:
    schema = plan_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA_VERSION in schema["properties"]["schema_version"]["enum"]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_plan_we_write_validates(name: str) -> None:
    validate_plan_data(data_of(PLANS[name]), name)


def test_the_schema_describes_every_field_the_plan_writes() -> None:
    schema = plan_schema()
    data = data_of(PLANS["pipelined"])
    assert set(data) == set(schema["properties"])
    for key in ("predicted", "solver", "pipeline"):
        assert set(data[key]) == set(schema["properties"][key]["properties"]), key
    assert set(data["devices"][0]) == set(schema["properties"]["devices"]["items"]["properties"])
    event = schema["properties"]["timeline"]["items"]
    assert set(data["timeline"][0]) == set(event["properties"])
    assert set(event["properties"]["kind"]["enum"]) == {k.value for k in EventKind}
    schedule = schema["properties"]["pipeline"]["properties"]["schedule"]
    assert set(schedule["enum"]) == {s.value for s in Schedule}


def edited(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = copy.deepcopy(data_of(PLANS["pipelined"]))
    change(data)
    return data


@pytest.mark.parametrize(
    ("field", "remove"),
    [
        ("model", lambda d: d.pop("model")),
        ("predicted.step_time_s", lambda d: d["predicted"].pop("step_time_s")),
        ("solver.status", lambda d: d["solver"].pop("status")),
        ("devices[1].memory_bytes", lambda d: d["devices"][1].pop("memory_bytes")),
        ("timeline[2].end_s", lambda d: d["timeline"][2].pop("end_s")),
        ("pipeline.stage_devices", lambda d: d["pipeline"].pop("stage_devices")),
    ],
)
def test_a_missing_field_is_named(field: str, remove: Callable[[dict[str, Any]], None]) -> None:
    message = refused(edited(remove))
    assert f"field {field!r} is missing" in message


@pytest.mark.parametrize(
    ("field", "value", "expected", "got"),
    [
        ("predicted.step_time_s", "fast", "number", "string"),
        ("batch_size", 32.5, "integer", "number"),
        ("batch_size", True, "integer", "boolean"),
        ("devices[0].memory_bytes", "80GB", "integer", "string"),
        ("predicted.compute_s[1]", None, "number", "null"),
        ("solver.objective", "low", "number or null", "string"),
        ("advice[0]", 7, "string", "integer"),
        ("layer_edges[0][2]", "4096", "integer", "string"),
        ("timeline[0].microbatch", 0.5, "integer", "number"),
        ("pipeline", [1], "object or null", "array"),
    ],
)
def test_a_wrong_type_is_named(field: str, value: Any, expected: str, got: str) -> None:
    def put(data: dict[str, Any]) -> None:
        target: Any = data
        path = field.replace("]", "").replace("[", ".").split(".")
        for part in path[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        last = path[-1]
        target[int(last) if last.isdigit() else last] = value

    message = refused(edited(put))
    assert f"field {field!r} must be {expected}, got {got}" in message


def test_a_layer_name_in_the_path_is_quoted() -> None:
    message = refused(edited(lambda d: d["assignment"].__setitem__(XSS_IMG, "0")))
    assert f"assignment[{json.dumps(XSS_IMG)}]" in message
    assert "must be integer, got string" in message


def test_a_hyphenated_layer_name_in_the_path_is_quoted() -> None:
    message = refused(edited(lambda d: d["assignment"].__setitem__("dense-1", "0")))
    assert 'field \'assignment["dense-1"]\' must be integer, got string' in message


def test_other_violations_are_named() -> None:
    assert "field 'batch_size' must be >= 1, got 0" in refused(
        edited(lambda d: d.__setitem__("batch_size", 0))
    )
    message = refused(edited(lambda d: d["timeline"][0].__setitem__("kind", "sleep")))
    assert "field 'timeline[0].kind' must be one of" in message and "'sleep'" in message
    message = refused(edited(lambda d: d.__setitem__("colour", "blue")))
    assert "unknown field(s) 'colour'" in message
    assert "field 'devices' must have at least 1 items, got 0" in refused(
        edited(lambda d: d.__setitem__("devices", []))
    )
    assert "field 'layer_edges[0]' must have at least 3 items, got 2" in refused(
        edited(lambda d: d["layer_edges"].__setitem__(0, [0, 1]))
    )
    assert "field '(top level)' must be object, got array" in refused([1, 2])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_numbers_are_finite(value: float) -> None:
    # Python's JSON reader accepts NaN and Infinity; the plan's validator does not.
    for field, change in (
        ("predicted.step_time_s", lambda d: d["predicted"].__setitem__("step_time_s", value)),
        ("solver.objective", lambda d: d["solver"].__setitem__("objective", value)),
        ("timeline[1].end_s", lambda d: d["timeline"][1].__setitem__("end_s", value)),
    ):
        message = refused(edited(change))
        assert f"field {field!r} must be a finite number, got {value!r}" in message


def test_integers_are_json_integers() -> None:
    # jsonschema counts 2.0 as an integer; a plan's counts and indices are written as ints.
    assert "field 'batch_size' must be integer, got number" in refused(
        edited(lambda d: d.__setitem__("batch_size", 2.0))
    )
    assert "field 'assignment.fc1' must be integer, got number" in refused(
        edited(lambda d: d["assignment"].__setitem__("fc1", 1.0))
    )


def test_from_json_dict_checks_what_the_schema_cannot() -> None:
    data = data_of(PLANS["pipelined"])
    n_dev = len(data["devices"])
    with pytest.raises(
        PlanError, match=rf"plan\.json: field 'assignment' puts layer .* on device {n_dev},"
    ):
        bad = copy.deepcopy(data)
        bad["assignment"][next(iter(bad["assignment"]))] = n_dev
        Plan.from_json_dict(bad, "plan.json")
    with pytest.raises(
        PlanError, match=rf"plan\.json: predicted\.bytes_sent has 1 entries for {n_dev}"
    ):
        bad = copy.deepcopy(data)
        bad["predicted"]["bytes_sent"] = [0]
        Plan.from_json_dict(bad, "plan.json")
    with pytest.raises(
        PlanError, match=r"plan\.json: field 'timeline\[0\]' has start_s=.* > end_s="
    ):
        bad = copy.deepcopy(data)
        bad["timeline"][0]["start_s"] = bad["timeline"][0]["end_s"] + 1.0
        Plan.from_json_dict(bad, "plan.json")
    assert Plan.from_json_dict(data).to_json_dict() == data


def test_another_schema_version_is_refused_with_the_next_step() -> None:
    message = refused(edited(lambda d: d.__setitem__("schema_version", SCHEMA_VERSION + 1)))
    assert f"schema_version {SCHEMA_VERSION + 1} is not supported" in message
    assert "make the plan again" in message


def test_the_shallowest_problem_is_reported_first() -> None:
    def two_problems(d: dict[str, Any]) -> None:
        d["timeline"][0]["start_s"] = "early"
        d.pop("link")

    assert "field 'link' is missing" in refused(edited(two_problems))


# -- the model match --------------------------------------------------------------------------


def test_a_plan_for_the_same_layers_in_any_order_matches() -> None:
    check_plan_matches_model(["a", "b", "c"], ["c", "a", "b"], "m")


def test_a_plan_for_another_model_names_missing_and_extra_layers() -> None:
    with pytest.raises(PlanError) as info:
        check_plan_matches_model(
            ["input", "fc1", XSS_IMG, "head"],
            ["input", "fc1", "fc9", "head"],
            "small",
            applied_to="other",
        )
    message = str(info.value)
    assert "\n" not in message
    assert "plan was made for model 'small' and not for 'other'" in message
    assert f"missing layers [{XSS_IMG!r}]" in message
    assert "extra layers ['fc9']" in message
    assert "make a new plan" in message


def test_long_layer_lists_are_cut_with_a_count() -> None:
    plan_layers = [f"p{i}" for i in range(25)]
    with pytest.raises(PlanError) as info:
        check_plan_matches_model(plan_layers, ["q"], "m")
    message = str(info.value)
    assert "'p9', +15 more]" in message and "'p10'" not in message
    assert "extra layers ['q']" in message
    assert "(25 layers; this model has 1)" in message


def test_schedule_names_come_from_the_enum() -> None:
    from partitioner.core.ir import Schedule

    schedule = plan_schema()["properties"]["pipeline"]["properties"]["schedule"]
    assert schedule["enum"] == [s.value for s in Schedule]
    message = refused(edited(lambda d: d["pipeline"].update(schedule="zero-bubble")))
    assert "pipeline.schedule" in message


def test_strategy_family_names_come_from_the_enum() -> None:
    from partitioner.core.strategy import Family

    family = plan_schema()["properties"]["strategies"]["items"]["properties"]["family"]
    assert family["enum"] == [f.value for f in Family]
