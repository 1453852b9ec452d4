"""Concurrent planning in one process (issue 34): every thread gets the sequential plan.

Tracing wraps Keras's ``Layer.__call__`` on the class, which every thread sees; two traces at once
used to save and restore each other's wrapper, so ops lost their layer or went to another one,
edges between layers were dropped and a worse split was reported. ``passes.trace`` now traces
one thread at a time (``KERAS_CALL_LOCK``); these cases run several ``partition()`` and
``trace_model`` calls at once, from a barrier, and compare each with the sequential result.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import keras

import partitioner
from partitioner.core.ir import Graph
from partitioner.plan.model import Plan
from passes.trace import trace_model

THREADS = 4
ROUNDS = 2
OPTIONS: dict[str, Any] = {"gpus": 2, "compare_strategies": False, "time_limit_s": 2.0}

T = TypeVar("T")


def _model() -> keras.Model:
    """A small MLP whose best 2-device split is not the one-device plan."""
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(128, activation="relu", name="a"),
            keras.layers.Dense(96, activation="relu", name="b"),
            keras.layers.Dense(64, activation="relu", name="c"),
            keras.layers.Dense(10, name="d"),
        ],
        name="concurrent_mlp",
    )


def _at_once(call: Callable[[int], T], n: int = THREADS) -> list[T]:
    """``call(i)`` for ``i < n`` in ``n`` threads released together; re-raises the first error."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = call(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a planning thread did not finish"
    if errors:
        raise errors[0]
    return results


def _plan_facts(plan: Plan) -> dict[str, Any]:
    """What a plan decides and predicts (not its wall-clock phase times)."""
    return {
        "layers": plan.layer_order,
        "assignment": plan.device_of_layer,
        "layer_edges": plan.layer_edges,
        "solver": (plan.solver.name, plan.solver.status),
        "baselines": tuple(b.solver for b in plan.baselines),
        "per_device_bytes": tuple(
            (d.memory_bytes, d.transfer_bytes, d.bytes_sent, d.bytes_received)
            for d in plan.per_device
        ),
    }


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _check_same_plan(got: Plan, want: Plan, label: str) -> None:
    assert _plan_facts(got) == _plan_facts(want), label
    assert _close(got.step_time_s, want.step_time_s), (label, got.step_time_s, want.step_time_s)
    assert _close(got.lower_bound_s, want.lower_bound_s), label
    assert len(got.layer_compute_s) == len(want.layer_compute_s), label
    for g, w in zip(got.layer_compute_s, want.layer_compute_s, strict=True):
        assert _close(g, w), (label, got.layer_compute_s, want.layer_compute_s)
    for g_d, w_d in zip(got.per_device, want.per_device, strict=True):
        assert _close(g_d.compute_s, w_d.compute_s), (label, "per-device compute")
    for g_b, w_b in zip(got.baselines, want.baselines, strict=True):
        assert _close(g_b.step_time_s, w_b.step_time_s), (label, g_b.solver)


def _attribution(graph: Graph) -> tuple[Any, ...]:
    """Every op's name, layer and phase, and every edge: the trace's op-to-layer map."""
    ops = tuple((op.id, op.layer, op.phase, op.flops, op.output_bytes) for op in graph.ops)
    edges = tuple((e.src, e.dst, e.output_index, e.bytes) for e in graph.edges)
    return ops, edges


def test_concurrent_partition_calls_return_the_sequential_plan() -> None:
    want = partitioner.partition(_model(), **OPTIONS)
    assert len(set(want.device_of_layer)) == 2  # a split: layers and edges matter
    shared = _model()
    for round_ in range(ROUNDS):
        # the first round builds a model per thread, in the thread; the second shares one model
        plans = _at_once(
            lambda _i, r=round_: partitioner.partition(_model() if r == 0 else shared, **OPTIONS)
        )
        for i, plan in enumerate(plans):
            _check_same_plan(plan, want, f"round {round_}, thread {i}")


def test_concurrent_traces_charge_every_op_to_its_layer() -> None:
    want = _attribution(trace_model(_model(), batch_size=32).graph)
    for round_ in range(ROUNDS):
        graphs = _at_once(lambda _i: trace_model(_model(), batch_size=32).graph)
        for i, graph in enumerate(graphs):
            assert _attribution(graph) == want, f"round {round_}, thread {i}"
