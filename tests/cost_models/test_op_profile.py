"""Per-op profiling inside the traced step: matching profiler events to ops, and a real run."""

from __future__ import annotations

import math

import pytest
from cost_model_graphs import mlp

from cost_models.measure.op_profile import (
    KernelEvent,
    attribute_events,
    concurrency,
    layer_phase_times,
    share_concurrent,
)
from partitioner.core.errors import PartitionError


def ev(node: str, dur_ms: float, start: float = 0.0, op_type: str = "X") -> KernelEvent:
    return KernelEvent(node, op_type, dur_ms * 1e-3, start)


def test_events_go_to_their_op_or_to_the_op_owning_their_scope() -> None:
    g = mlp()  # ops d1/mm, d1/relu, d2/mm, loss, g/d2/mm, g/d2/x, g/d1/relu, g/d1/mm
    events = [
        ev("d1/relu", 2.0),  # a fused MatMul+Relu: the node keeps the last op's name
        ev("d2/mm", 1.0),
        ev("d2/ArithmeticOptimizer/AddOpsRewrite_x", 0.5),  # grappler's node in d2's scope
        ev("g/d1/mm", 3.0),
        ev("elsewhere/op", 7.0),  # no op, no scope: unattributed
    ]
    times, lost = attribute_events(g, events, steps=1)
    assert times == {
        "d1/relu": pytest.approx(2e-3),
        "d2/mm": pytest.approx(1.5e-3),
        "g/d1/mm": pytest.approx(3e-3),
    }
    assert lost == pytest.approx(7e-3)
    per_layer = layer_phase_times(g, times)
    assert per_layer == {
        "dense1": (pytest.approx(2e-3), pytest.approx(3e-3)),
        "dense2": (pytest.approx(1.5e-3), 0.0),
    }


def test_repeated_steps_are_summarised_per_step() -> None:
    g = mlp()
    # Three steps; d1/mm runs twice a step (an unrolled region), the third step was disturbed.
    events = [ev("d1/mm", d, start=t) for t, d in enumerate((1.0, 1.0, 1.2, 1.0, 5.0, 5.0))]
    med, _ = attribute_events(g, events, steps=3, statistic="median")
    low, _ = attribute_events(g, events, steps=3, statistic="min")
    assert med["d1/mm"] == pytest.approx(2.2e-3)  # runs (2.0, 2.2, 10.0) ms
    assert low["d1/mm"] == pytest.approx(2.0e-3)
    # Events are ordered by start time before cutting into steps.
    shuffled = [events[i] for i in (5, 0, 3, 1, 4, 2)]
    assert attribute_events(g, shuffled, steps=3, statistic="min")[0] == low
    # Not a whole number of runs per step: the mean per step.
    odd, _ = attribute_events(g, events[:5], steps=2)
    assert odd["d1/mm"] == pytest.approx(sum((1.0, 1.0, 1.2, 1.0, 5.0)) * 1e-3 / 2)


def on(thread: int, start_ms: float, dur_ms: float, node: str = "x") -> KernelEvent:
    return KernelEvent(node, "X", dur_ms * 1e-3, start_ms * 1e-3, thread)


def shares_ms(events: list[KernelEvent], cores: int = 1) -> list[float]:
    return [round(e.duration_s * 1e3, 9) for e in share_concurrent(events, cores)]


def test_kernels_side_by_side_on_one_core_share_it() -> None:
    # two threads' kernels over the same 2 ms on one core: 1 ms of work each
    assert shares_ms([on(1, 0, 2), on(2, 0, 2)]) == [1.0, 1.0]
    # overlapping for 1 ms of their 3: 2.5 ms each, the 5 ms the core was busy
    assert shares_ms([on(1, 0, 3), on(2, 2, 3)]) == [2.5, 2.5]
    # one after the other, or as many threads as cores: unchanged
    assert shares_ms([on(1, 0, 2), on(2, 2, 3)]) == [2.0, 3.0]
    assert shares_ms([on(1, 0, 2), on(2, 0, 2)], cores=2) == [2.0, 2.0]
    # three threads on two cores: two thirds of a core each
    assert shares_ms([on(t, 0, 3) for t in (1, 2, 3)], cores=2) == [2.0, 2.0, 2.0]


def test_the_shares_add_up_to_the_busy_time_and_keep_every_event() -> None:
    events = [on(1, 0, 4, "a"), on(2, 1, 2, "b"), on(3, 2, 5, "c"), on(1, 5, 1, "d")]
    shared = share_concurrent(events)
    assert [(e.node, e.thread, e.start_s) for e in shared] == [
        (e.node, e.thread, e.start_s) for e in events
    ]
    assert math.fsum(e.duration_s for e in shared) == pytest.approx(7e-3)  # busy 0-7 ms


def test_an_event_nested_in_its_thread_does_not_count_as_a_thread() -> None:
    # thread 1 runs a 4 ms event with a 1 ms one inside it; thread 2 runs 0-2 ms
    shares = shares_ms([on(1, 0, 4), on(1, 1, 1), on(2, 0, 2)])
    assert shares == [3.0, 0.5, 1.0]
    with pytest.raises(PartitionError, match="cores=0"):
        share_concurrent([], cores=0)


def test_concurrency_counts_busy_groups_between_change_points() -> None:
    # group a: 0-2 and a nested 1-1.5; group b: 1-3; group c: 3-4 (touching b's end)
    steps = concurrency([[(0.0, 2.0), (1.0, 1.5)], [(1.0, 3.0)], [(3.0, 4.0)]])
    assert steps == [(0.0, 1), (1.0, 2), (2.0, 1), (3.0, 1), (4.0, 0)]
    assert concurrency([]) == []


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(PartitionError, match="steps=0"):
        attribute_events(mlp(), [], steps=0)
    with pytest.raises(PartitionError, match="statistic='mean'"):
        attribute_events(mlp(), [], steps=1, statistic="mean")  # type: ignore[arg-type]


def test_profile_of_a_real_step_covers_every_layer() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    from cost_models.measure.op_profile import profile_step_ops
    from passes.trace import trace_model

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(1024, activation="relu", name="wide"),
            keras.layers.Dense(8, activation="relu", name="narrow"),
            keras.layers.Dense(4, name="head"),
        ]
    )
    trace = trace_model(model, batch_size=64)
    x = tf.constant(np.random.default_rng(0).standard_normal((64, 512)), dtype=tf.float32)
    prof = profile_step_ops(trace, [x], steps=5, warmup=2, statistic="min")
    per_layer = layer_phase_times(trace.graph, prof.op_time_s)
    assert set(per_layer) == {"wide", "narrow", "head"}
    for layer, (fwd, bwd) in per_layer.items():
        assert fwd > 0 and bwd > 0, layer
    assert prof.unattributed_time_s == 0.0
    assert prof.step_time_s > 0 and math.isfinite(prof.step_time_s)
    assert set(prof.op_time_s) <= {op.id for op in trace.graph.ops}
    # The wide layer's matmul work is over 100x the narrow one's: it must measure slower.
    assert sum(per_layer["wide"]) > sum(per_layer["narrow"])


def test_interleaved_step_times_rank_batches_and_feed_the_calibration() -> None:
    import keras

    from cost_models.estimate.costs import cost_graph
    from cost_models.measure.op_profile import (
        apply_step_profile,
        interleaved_step_times,
        profile_step_ops,
        step_inputs,
    )
    from passes.trace import trace_model

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, name="wide")])
    big, small = trace_model(model, batch_size=1024), trace_model(model, batch_size=64)
    pairs = [(t, step_inputs(t)) for t in (big, small)]
    big_s, small_s = interleaved_step_times(pairs, rounds=5, warmup=1)
    # 16x the rows (milliseconds of matmuls each, well above a call's cost): the big batch's
    # step is the slower one
    assert big_s > small_s > 0
    prof = profile_step_ops(big, pairs[0][1], steps=3, warmup=1, wall_steps=5)
    costed = cost_graph(big.graph, device_type="cpu", num_devices=2)
    out, factor = apply_step_profile(costed, prof, [0, 1], dispatch_s=1e-6)
    assert factor > 0 and out.op_compute_time_s[0] == out.op_compute_time_s[1]
    # The calibrated device's step (one op at a time) is the measured whole step.
    assert sum(out.op_compute_time_s[0]) == pytest.approx(prof.step_time_s, rel=1e-9)
    with pytest.raises(PartitionError, match="rounds=0"):
        interleaved_step_times(pairs, rounds=0)


def test_step_calibration_spreads_the_unexplained_time_over_profiled_ops() -> None:
    from types import SimpleNamespace
    from typing import Any

    from cost_models.measure.op_profile import step_calibration

    ops = [SimpleNamespace(id=i) for i in ("a", "b", "c")]
    # a and b profiled (3 ms + 1 ms), c an estimate of 1 ms, each with 0.5 ms dispatch
    costed: Any = SimpleNamespace(
        graph=SimpleNamespace(ops=ops),
        op_compute_time_s=((3.5e-3, 1.5e-3, 1.5e-3), (1.0, 1.0, 1.0)),
    )
    times = {"a": 3e-3, "b": 1e-3}
    assert step_calibration(costed, times, 10.5e-3) == pytest.approx(2.0)  # 2.5 + 2 x 4 ms
    assert step_calibration(costed, times, 2e-3) == 1.0  # the rest already exceeds the step
    assert step_calibration(costed, {}, 10e-3) == 1.0
    # On row 1 the rest is 3 s - 4 ms: a 10.5 ms step is below it, so nothing is scaled.
    assert step_calibration(costed, times, 10.5e-3, row=1) == 1.0


def test_measured_op_times_replace_the_estimates_on_the_given_rows() -> None:
    from cost_models.estimate.costs import cost_graph
    from cost_models.measure.op_profile import apply_op_profile

    g = mlp()
    costed = cost_graph(g, device_type="cpu", num_devices=2)
    # dense1's forward: relu measured with the fused matmul's work; d1/mm has no event.
    measured = {"d1/relu": 4e-3, "loss": 1e-4}
    out = apply_op_profile(costed, measured, [0], dispatch_s=1e-6)
    ids = [op.id for op in g.ops]
    row0, row1 = out.op_compute_time_s
    assert row0[ids.index("d1/relu")] == pytest.approx(4e-3 + 1e-6)
    assert row0[ids.index("d1/mm")] == pytest.approx(1e-6)  # fused into relu: only dispatch
    assert row0[ids.index("loss")] == pytest.approx(1e-4 + 1e-6)  # glue measured too
    # dense2 and dense1's backward had no measured op: estimates kept.
    for name in ("d2/mm", "g/d1/mm", "g/d2/x"):
        assert row0[ids.index(name)] == costed.op_compute_time_s[0][ids.index(name)]
    assert row1 == costed.op_compute_time_s[1]  # row 1 not profiled
    assert out.measured == ("dense1",)
    assert costed.measured == ()  # the input is untouched
    with pytest.raises(PartitionError, match=r"device rows \[2\]"):
        apply_op_profile(costed, measured, [2])
    with pytest.raises(PartitionError, match="dispatch_s"):
        apply_op_profile(costed, measured, [0], dispatch_s=-1.0)


def test_a_loop_bodys_kernels_go_to_the_loop_op_not_the_first_op_of_its_scope() -> None:
    """The kernels of a While's body (named under the While op) are the While's time: given to
    the first op of the layer's scope instead, an op without the loop's inputs, the simulator ran
    a decoder's recurrence before its encoder had finished."""
    from dataclasses import replace

    from cost_model_graphs import op

    g = mlp()
    b = 32
    loop = (
        op("d2/zeros", "Fill", "dense2", shape=(b, 10)),  # first op of scope d2, no inputs
        op("d2/while", "While", "dense2", shape=(b, 10)),
    )
    g = replace(g, ops=(*g.ops[:3], *loop, *g.ops[3:]))
    events = [
        ev("d2/while/body/_1/d2/while/MatMul", 4.0),
        ev("d2/while/body/_1/d2/while/Tanh", 1.0),
        ev("d2/ArithmeticOptimizer/AddOpsRewrite_x", 0.5),  # grappler's, in d2's scope
    ]
    times, lost = attribute_events(g, events, steps=1)
    assert times["d2/while"] == pytest.approx(5e-3)
    assert times["d2/zeros"] == pytest.approx(0.5e-3)
    assert lost == 0.0
