"""Issue 34, campaign 34g: a strategy is never returned at a share of the batch (a replica's, a
micro-batch) that the model's own code was not run at for real: the search prices most shares
from two traces (``graph_at_batch``), so the forced hybrid's micro-batch of 4 was never traced,
and a layer refusing it planned with exit 0 and failed in training (D1); the report called that
micro-batch "of 8" (the whole batch over the micro-batches, not the replica's share). An unbuilt
subclassed model whose ``call`` takes a dict was advised to key its shapes by ``input_0``, which
led to a TypeError; it gets the functional wrapper's advice, as the built model does (D4)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner
from partitioner.core.errors import TraceError
from partitioner.core.strategy import Family
from partitioner.planner.search import StrategyOptions, search_strategies
from passes.trace import input_specs
from tests.planner.strategy_graphs import FAST_LINK, chain_costs, uniform_topology
from tests.test_hostile_input_iii_paths import one_line_error, run_cli

_CHAIN: dict[str, Any] = {
    "fwd_s": (1.0, 1.0, 1.0, 1.0),
    "weight_bytes": (100,) * 4,
    "act_bytes": 40,
}
HYBRID = StrategyOptions(families=(Family.HYBRID,))


class _Confirm:
    """A ``confirm`` whose real trace fails at the batches ``bad`` (the model's own layer), with
    the batches it was asked to run."""

    def __init__(self, bad: set[int]) -> None:
        self.bad, self.calls = bad, []  # type: list[int]

    def __call__(self, batch: int) -> None:
        self.calls.append(batch)
        if batch in self.bad:
            raise TraceError(
                f"layer 'exact' raised ValueError: no; it was traced at batch_size={batch}"
            )


def _costed_at(batch: int = 16) -> Any:
    """A 4-layer chain on 4 devices whose costs at any batch are derived, never refused."""
    return chain_costs(batch, topology=uniform_topology(4, FAST_LINK), **_CHAIN)


def _micro(strategy: Any, batch: int = 16) -> int:
    return batch // (strategy.replicas * strategy.num_microbatches)


# -- D1: the chosen strategy's shares are run for real before it is returned -------------------


def test_a_forced_hybrid_whose_micro_batches_fail_for_real_is_the_error_at_the_share() -> None:
    """Before: the hybrid was returned at a micro-batch of 4 that only the derived costs had
    seen (a layer taking multiples of 8), exit 0."""
    confirm = _Confirm({4, 2, 1})
    with pytest.raises(TraceError) as info:
        search_strategies(_costed_at(), 16, HYBRID, confirm=confirm)
    message = str(info.value)
    assert re.fullmatch(
        r"layer 'exact' raised ValueError: no; it was traced at a micro-batch of [421] "
        r"\(batch_size=16 over 2 replicas and [248] micro-batches each\); change batch_size=, "
        r"the devices \(gpus=\) or strategy= so that a micro-batch suits the model",
        message,
    ), message
    assert sorted(confirm.calls) == [1, 2, 4, 8]  # each share run once, the replica's too


def test_a_failed_share_drops_its_candidates_and_the_next_best_is_run_for_real() -> None:
    """Before: the model that refuses only a batch of 4 planned 2 micro-batches of 4 each."""
    unchecked = search_strategies(_costed_at(), 16, HYBRID)
    refused = _micro(unchecked.best.strategy)
    confirm = _Confirm({refused})
    search = search_strategies(_costed_at(), 16, HYBRID, confirm=confirm)
    chosen = _micro(search.best.strategy)
    assert chosen != refused and search.best.strategy.family is Family.HYBRID
    assert chosen in confirm.calls and 8 in confirm.calls
    assert all(_micro(c.strategy) != refused for c in search.candidates)
    assert any(
        n.startswith(f"strategies on shares of the batch of {refused} not scored: layer 'exact'")
        for n in search.notes
    ), search.notes


def test_only_the_chosen_strategys_shares_are_traced_again() -> None:
    """Planning stays fast: without a failure, only the best candidate's shares are run."""
    confirm = _Confirm(set())
    search = search_strategies(_costed_at(), 16, confirm=confirm)
    strategy = search.best.strategy
    assert set(confirm.calls) <= {16 // strategy.replicas, _micro(strategy)}
    assert len(confirm.calls) == len(set(confirm.calls))


def test_auto_falls_back_to_the_whole_batch_when_every_share_fails_for_real() -> None:
    search = search_strategies(_costed_at(), 16, confirm=_Confirm({8, 4, 2, 1}))
    assert search.best.strategy.family in (Family.SINGLE, Family.PLACED)
    assert search.best.strategy.replicas * search.best.strategy.num_microbatches == 1


_NOT4 = (
    "import keras\n\n"
    "class Not4(keras.layers.Layer):\n"
    "    def call(self, x):\n"
    "        if x.shape[0] is not None and x.shape[0] == 4:\n"
    "            raise ValueError(f'Not4 refuses a batch of 4, got {x.shape[0]}')\n"
    "        return x\n"
    "    def compute_output_shape(self, s):\n"
    "        return s\n\n"
    "def build_model():\n"
    "    i = keras.Input(shape=(16,))\n"
    "    h = Not4(name='not4')(keras.layers.Dense(8, name='d1')(i))\n"
    "    h = keras.layers.Dense(8, name='d2')(h)\n"
    "    return keras.Model(i, keras.layers.Dense(2, name='d3')(h), name='n4')\n"
)


def test_the_forced_hybrid_plans_a_micro_batch_the_model_runs_and_names_its_size(
    tmp_path: Path,
) -> None:
    """Before: exit 0 with 2 micro-batches of 4 per replica, shown as "2 micro-batches of 8";
    applying the plan then failed in training at a batch of 4."""
    (tmp_path / "model.py").write_text(_NOT4)
    proc = run_cli(
        [
            "model.py",
            "--gpus",
            "4",
            "--batch-size",
            "16",
            "--strategy",
            "hybrid",
            "--out",
            "plan.json",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    strategy = json.loads((tmp_path / "plan.json").read_text())["strategy"]
    replicas, micro = len(strategy["device_groups"]), strategy["num_microbatches"]
    size = 16 // (replicas * micro)
    assert replicas == 2 and size != 4
    assert f"{micro} micro-batches of {size} per replica, 2 stages" in proc.stdout, proc.stdout
    assert "strategies on shares of the batch of 4 not scored: layer 'not4'" in proc.stdout


# -- D4: an unbuilt subclassed model taking a dict is advised the functional wrapper ----------


class _DictModel(keras.Model):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(8, name="d1")
        self.d2 = keras.layers.Dense(2, name="d2")

    def call(self, inputs: Any) -> Any:
        return self.d2(self.d1(inputs["x"]) + inputs["y"])


def test_an_unbuilt_subclassed_models_named_shapes_get_the_wrapping_advice() -> None:
    """Before: "has no input named 'x', 'y' (its inputs are ['input_0']) ... e.g.
    input_shape={'input_0': (128,)}", which then failed with a TypeError in the trace."""
    with pytest.raises(TraceError) as info:
        input_specs(_DictModel(name="sd"), 8, {"x": (16,), "y": (8,)})
    assert str(info.value) == (
        "input_shape={'x': (16,), 'y': (8,)}: subclassed model 'sd' was never built, so Keras "
        "knows no names or dtypes for its inputs; if its call takes a dict ('x', 'y'), wrap it "
        "in a functional model, one keras.Input(shape=..., dtype=..., name=KEY) per key, and "
        "plan that; if it takes one tensor, give its shape alone, e.g. input_shape=(16,)"
    )
    assert [tuple(s.shape) for s in input_specs(_DictModel(), 8, {"input_0": (16,)})] == [(8, 16)]


def test_the_advised_wrapper_plans() -> None:
    inner = _DictModel(name="sd")
    x = keras.Input(shape=(16,), dtype="float32", name="x")
    y = keras.Input(shape=(8,), dtype="float32", name="y")
    wrapped = keras.Model({"x": x, "y": y}, inner({"x": x, "y": y}), name="wrapped")
    plan = partitioner.partition(wrapped, gpus=2, batch_size=8, compare_strategies=False)
    assert plan.batch_size == 8


_UNBUILT_DICT = (
    "import keras\n\n"
    "class M(keras.Model):\n"
    "    def __init__(self, **kw):\n"
    "        super().__init__(**kw)\n"
    "        self.d1 = keras.layers.Dense(8, name='d1')\n"
    "        self.d2 = keras.layers.Dense(2, name='d2')\n"
    "    def call(self, inputs):\n"
    "        return self.d2(self.d1(inputs['x']) + inputs['y'])\n"
    "    def get_config(self):\n"
    "        return {'name': self.name}\n\n"
    "def build_model():\n"
    "    return M(name='sd')\n"
)


def test_the_command_line_advises_the_wrapper_not_input_0(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(_UNBUILT_DICT)
    proc = run_cli(
        [
            "model.py",
            "--gpus",
            "2",
            "--batch-size",
            "8",
            "--input-shape",
            "x=16",
            "--input-shape",
            "y=8",
        ],
        cwd=tmp_path,
    )
    line = one_line_error(
        proc,
        "--input-shape x=16 --input-shape y=8: subclassed model 'sd' was never built",
        "wrap it in a functional model, one keras.Input(shape=..., dtype=..., name=KEY) per key",
        "give its shape alone, e.g. --input-shape 16",
    )
    assert "input_0" not in line
