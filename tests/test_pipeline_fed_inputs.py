"""Pipelining branchy models: a model input read by several towers orders no stages.

The traced model input (a layer-less placeholder) is merged for costing into one of the towers
that read it -- not necessarily the first in layer order (``Graph.layer_graph``). Read as that
tower's output, it made every other tower's device wait for that tower's device, while the towers
feed the head the other way: solvers' placements that the layer graph calls acyclic (metis, auto)
were refused as a cycle by the pipeline simulator. The pipelined rewrite (``passes.rewrite.pipeline``)
feeds every stage its slice of the model's inputs, so the inputs order nothing: the simulator now
says so (:func:`partitioner.simulation.pipeline.fed_ops`), and ``auto`` falls back to a candidate that
pipelines when its own placement does not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import keras
import pytest

import partitioner
import partitioner.api as api
from benchmarks.zoo import multi_tower
from partitioner.core.errors import PlanError
from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    Schedule,
    Topology,
)
from partitioner.simulation.pipeline import fed_ops, pipeline_stages, simulate_pipeline
from partitioner.solvers.stages import make_acyclic

F, B = Phase.FORWARD, Phase.BACKWARD
CPUS = [f"/device:CPU:{i}" for i in range(4)]


# -- the op-level pattern, by hand ------------------------------------------------------------


def two_towers() -> CostedGraph:
    """Input ``x`` (layer-less; its first consumer in edge order is tower ``T1``) read by towers
    ``T0`` and ``T1`` (layer order T0, T1, H), both feeding head ``H``; backward ops mirror them
    (no gradient for the input). A layer-less ``Cast`` of ``x`` feeds ``T0``; a layer-less loss
    reads the head."""
    ops = (
        Op("x", "Placeholder", None, F),
        Op("cast", "Cast", None, F),
        Op("fT1", "MatMul", "T1", F),
        Op("fT0", "MatMul", "T0", F),
        Op("fH", "ConcatV2", "H", F),
        Op("loss", "Mean", None, F),
        Op("bH", "Slice", "H", B),
        Op("bT0", "MatMul", "T0", B),
        Op("bT1", "MatMul", "T1", B),
    )
    edges = (
        Edge("x", "fT1", 64), Edge("x", "cast", 64), Edge("cast", "fT0", 64),
        Edge("x", "bT1", 64), Edge("cast", "bT0", 64),
        Edge("fT0", "fH", 32), Edge("fT1", "fH", 32), Edge("fH", "loss", 32),
        Edge("loss", "bH", 4),
        Edge("bH", "bT0", 32), Edge("bH", "bT1", 32),
    )  # fmt: skip
    layers = tuple(LayerInfo(n, "Dense") for n in ("T0", "T1", "H"))
    graph = Graph("two_towers", ops, edges, layers, batch_size=4)
    topo = Topology(tuple(Device(d, "gpu", 1 << 30) for d in range(2)), Link("l", 0.25, 100.0))
    times = ((0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 2.0, 2.0, 2.0),) * 2
    memory = tuple(LayerMemory(n.name, 0, 0, 0, 0) for n in layers)
    return CostedGraph(graph, topo, times, memory)


def test_inputs_constants_and_glue_on_them_alone_are_fed() -> None:
    c = two_towers()
    fed = dict(zip((op.id for op in c.graph.ops), fed_ops(c.graph), strict=True))
    assert fed == {
        "x": True, "cast": True, "fT1": False, "fT0": False,
        "fH": False, "loss": False, "bH": False, "bT0": False, "bT1": False,
    }  # fmt: skip


@pytest.mark.parametrize("placement", [(0, 1, 1), (1, 0, 1)], ids=["T0|T1,H", "T1|T0,H"])
def test_a_shared_input_orders_no_stages_and_is_not_sent(placement: tuple[int, int, int]) -> None:
    """Whichever tower the input is merged into, one of these placements put that tower after
    the other tower's device while the input was read as its output: a cycle."""
    c = two_towers()
    stages = pipeline_stages(c, placement)
    first = placement[0] if placement[1] == 1 else placement[1]
    assert [s.device for s in stages] == [first, 1 - first]
    s0, s1 = stages
    # activations to the head, gradients back; the input travels nowhere
    assert [(t.dst_stage, t.phase, t.batch_bytes) for t in s0.sends] == [(1, F, 32)]
    assert [(t.dst_stage, t.phase, t.batch_bytes) for t in s1.sends] == [(0, B, 32)]
    sim = simulate_pipeline(c, placement, schedule=Schedule.ONE_F_ONE_B, num_microbatches=2)
    assert sim.stage_devices == (first, 1 - first) and sim.step_time_s > 0
    # and what make_acyclic makes of it (the layer graph's undirected input edge) pipelines too
    staged = make_acyclic(placement, c.problem())
    assert len(pipeline_stages(c, staged)) == 2


# -- the multi-tower model through the API ----------------------------------------------------


@pytest.fixture(scope="module")
def towers() -> Any:
    """The benchmark zoo's multi-tower MLP at the equivalence sweep's size."""
    keras.utils.set_random_seed(3)
    return multi_tower(towers=3, depth=2, width=24, features=16)


def pipelined_plan(model: Any, solver: str) -> partitioner.Plan:
    return partitioner.partition(
        model, gpus=4, device_type="cpu", batch_size=8, pipeline=True, num_microbatches=4,
        optimizer="sgd", solver=solver,
    )  # fmt: skip


def _pipeline_test_helpers() -> ModuleType:
    path = Path(__file__).resolve().parent / "passes" / "test_pipeline.py"
    spec = importlib.util.spec_from_file_location("_pipeline_test_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("solver", ["metis", "auto"])
def test_metis_and_auto_pipeline_the_multi_tower_model(towers: Any, solver: str) -> None:
    plan = pipelined_plan(towers, solver)
    assert plan.pipeline is not None
    assert len(plan.pipeline.stage_devices) >= 2
    assert sorted(plan.pipeline.stage_devices) == sorted(set(plan.assignment.values()))
    assert plan.step_time_s > 0
    # auto's own placement pipelines (no fallback needed)
    assert not any("not a pipeline" in note for note in plan.solver.notes)


def test_the_pipelined_multi_tower_trains_like_the_original(towers: Any) -> None:
    plan = pipelined_plan(towers, "metis")
    towers.compile(optimizer="sgd", loss="mse")
    pipelined = plan.apply(towers, devices=CPUS)
    assert type(pipelined).__name__ == "PipelinedModel"
    assert len(pipelined.stage_devices) == len(plan.pipeline.stage_devices)
    _pipeline_test_helpers().check_gradients(towers, pipelined, "multi_tower metis M=4")


# -- auto falls back when its own placement does not pipeline ----------------------------------


def failing_first(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[int]:
    """Make the first ``failures`` simulated pipelines refuse their placement."""
    real = api.evaluate_pipeline
    calls: list[int] = []

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) <= failures:
            raise PlanError("the placement's devices [0, 1] depend on each other in a cycle")
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "evaluate_pipeline", evaluate)
    return calls


def test_auto_falls_back_to_a_candidate_that_pipelines(
    towers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_first(monkeypatch, 1)
    plan = partitioner.partition(
        towers, gpus=2, device_type="cpu", batch_size=8, pipeline=True, optimizer="sgd"
    )
    note = next(n for n in plan.solver.notes if n.startswith("pipelined 1f1b"))
    assert "auto: not a pipeline (the placement's devices [0, 1] depend" in note
    assert note.count("(chosen)") == 1
    assert plan.solver.name == "auto" and plan.pipeline is not None


def test_auto_says_so_in_one_line_when_nothing_pipelines(
    towers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_first(monkeypatch, 10**6)
    with pytest.raises(PlanError, match="could be pipelined: auto: not a pipeline") as info:
        partitioner.partition(towers, gpus=2, device_type="cpu", batch_size=8, pipeline=True)
    assert "\n" not in str(info.value) and "without pipeline=True" in str(info.value)


def test_a_named_solver_that_does_not_pipeline_names_itself(
    towers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_first(monkeypatch, 1)
    with pytest.raises(PlanError, match=r"the metis placement is not a pipeline .* solver='auto'"):
        partitioner.partition(
            towers, gpus=2, device_type="cpu", batch_size=8, pipeline=True, solver="metis"
        )
