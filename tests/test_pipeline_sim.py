"""The pipelined step simulator: hand-computed schedules, the GPipe bubble, 1F1B memory, invariants."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.core.errors import PlanError, UsageError
from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    EventKind,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    Schedule,
    TimelineEvent,
    Topology,
)
from partitioner.simulation.pipeline import (
    PipelineSimulation,
    SimTask,
    Stage,
    StageTransfer,
    pipeline_stages,
    run_tasks,
    simulate_pipeline,
    simulate_stages,
)
from partitioner.simulation.schedules import peak_live_microbatches, stage_steps
from partitioner.simulation.step import simulate_step

F, B = Phase.FORWARD, Phase.BACKWARD
# latency 0.25 s + bytes / 100 B/s: 75 bytes take 1.0 s, 25 bytes take 0.5 s.
LINK = Link("test", latency_s=0.25, bandwidth_bytes_per_s=100.0)


def topology(n_dev: int, link: Link = LINK) -> Topology:
    return Topology(tuple(Device(d, "gpu", 1 << 30) for d in range(n_dev)), link)


def chain_graph(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    act_bytes: Sequence[int],
    grad_bytes: Sequence[int],
    *,
    batch_size: int = 16,
    link: Link = LINK,
    n_dev: int | None = None,
    memory: Sequence[LayerMemory] | None = None,
) -> CostedGraph:
    """A chain of layers L0..L{K-1}, each one forward op and one backward op (whole-batch times).

    ``act_bytes[k]`` flows Lk/f -> L{k+1}/f, ``grad_bytes[k]`` flows L{k+1}/b -> Lk/b; each layer's
    backward also reads its own forward output (no transfer when both sit on one device).
    """
    k = len(fwd_s)
    names = [f"L{i}" for i in range(k)]
    ops = [Op(f"{n}/f", "X", n, F) for n in names]
    ops += [Op(f"{n}/b", "X", n, B) for n in reversed(names)]
    edges = [Edge(f"L{i}/f", f"L{i + 1}/f", act_bytes[i]) for i in range(k - 1)]
    edges += [Edge(f"L{i + 1}/b", f"L{i}/b", grad_bytes[i]) for i in range(k - 1)]
    edges += [Edge(f"L{i}/f", f"L{i}/b", 8) for i in range(k)]
    graph = Graph(
        "chain", tuple(ops), tuple(edges), tuple(LayerInfo(n, "Dense") for n in names), batch_size
    )
    times = [*fwd_s, *reversed(bwd_s)]
    n = n_dev if n_dev is not None else k
    mem = tuple(memory) if memory is not None else tuple(LayerMemory(x, 0, 0, 0, 0) for x in names)
    return CostedGraph(graph, topology(n, link), tuple(tuple(times) for _ in range(n)), mem)


def spans(sim: PipelineSimulation) -> dict[tuple[str, EventKind, int], tuple[float, float]]:
    """(resource, kind, micro-batch) -> (start, end), for compute and transfer events."""
    out: dict[tuple[str, EventKind, int], tuple[float, float]] = {}
    for ev in sim.timeline:
        key = (ev.resource, ev.kind, ev.microbatch)
        assert key not in out, f"{key} scheduled twice"
        out[key] = (ev.start_s, ev.end_s)
    return out


def expected(
    per_stage: dict[str, list[tuple[str, int, float, float]]],
) -> dict[tuple[str, EventKind, int], tuple[float, float]]:
    kinds = {"F": EventKind.FORWARD, "B": EventKind.BACKWARD, "X": EventKind.TRANSFER}
    return {(res, kinds[k], mb): (s, e) for res, rows in per_stage.items() for k, mb, s, e in rows}


# -- hand-computed schedules: 2 stages x 4 micro-batches -----------------------------------------
#
# Per micro-batch (M = 4, whole-batch op times are 4x these): "uniform" is f = 1, b = 2 on both
# stages; "non-uniform" is f0 = 1, b0 = 2, f1 = 2, b1 = 3. "With transfers": 300 bytes of
# activations and 100 bytes of gradients per step, i.e. 75 B / 25 B per micro-batch, which take
# 0.25 + 75/100 = 1.0 s and 0.25 + 25/100 = 0.5 s on LINK. "Without": the same edges carry 0 bytes.
# A task starts at max(its device/link free, its inputs' ends).

D0, D1, X01, X10 = "device 0", "device 1", "link 0->1", "link 1->0"


def two_stage(uniform: bool, transfers: bool) -> CostedGraph:
    f1, b1 = (1.0, 2.0) if uniform else (2.0, 3.0)
    act, grad = (300, 100) if transfers else (0, 0)
    return chain_graph([4.0, 4 * f1], [8.0, 4 * b1], [act], [grad])


def check(sim: PipelineSimulation, rows: dict[str, list[tuple[str, int, float, float]]]) -> None:
    got = spans(sim)
    want = expected(rows)
    compute = {k: v for k, v in got.items() if k[1] is not EventKind.TRANSFER}
    if not any(r == X01 for r in rows):
        assert compute == want
    else:
        assert got == want


def test_gpipe_uniform_no_transfer() -> None:
    sim = simulate_pipeline(
        two_stage(True, False), (0, 1), schedule=Schedule.GPIPE, num_microbatches=4
    )
    # Forwards back to back; stage 1 one step behind: F1(m) = [m+1, m+2].
    # Backwards in reverse micro-batch order; stage 1 starts B3 when F3 ends at 5:
    # B1(3) [5,7], B1(2) [7,9], B1(1) [9,11], B1(0) [11,13];
    # stage 0's B0(m) waits for B1(m): [7,9], [9,11], [11,13], [13,15]. Step 15 = (4+2-1)*(1+2).
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("F", 2, 2, 3), ("F", 3, 3, 4),
             ("B", 3, 7, 9), ("B", 2, 9, 11), ("B", 1, 11, 13), ("B", 0, 13, 15)],
        D1: [("F", 0, 1, 2), ("F", 1, 2, 3), ("F", 2, 3, 4), ("F", 3, 4, 5),
             ("B", 3, 5, 7), ("B", 2, 7, 9), ("B", 1, 9, 11), ("B", 0, 11, 13)],
    })  # fmt: skip
    assert sim.step_time_s == 15.0
    assert sim.device_busy_s == (12.0, 12.0)
    assert sim.bubble_fraction == pytest.approx((3 / 15, 3 / 15), rel=1e-12)
    assert sim.stage_devices == (0, 1)
    assert sim.peak_live_microbatches == (4, 4)


def test_1f1b_uniform_no_transfer() -> None:
    sim = simulate_pipeline(
        two_stage(True, False), (0, 1), schedule=Schedule.ONE_F_ONE_B, num_microbatches=4
    )
    # Stage 0: warm-up of K-s-1 = 1 forward: F0 F1 B0 F2 B1 F3 B2 B3; stage 1: F0 B0 F1 B1 ...
    # s0 F0 [0,1], F1 [1,2]; s1 F0 [1,2], B0 [2,4]; s0 B0 waits for s1 B0: [4,6];
    # s1 F1 [4,5] (device free at 4), B1 [5,7]; s0 F2 [6,7]; s1 F2 [7,8]; s0 B1 [7,9];
    # s1 B2 [8,10]; s0 F3 [9,10]; s1 F3 [10,11]; s0 B2 [10,12]; s1 B3 [11,13]; s0 B3 [13,15].
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 4, 6), ("F", 2, 6, 7),
             ("B", 1, 7, 9), ("F", 3, 9, 10), ("B", 2, 10, 12), ("B", 3, 13, 15)],
        D1: [("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 4, 5), ("B", 1, 5, 7),
             ("F", 2, 7, 8), ("B", 2, 8, 10), ("F", 3, 10, 11), ("B", 3, 11, 13)],
    })  # fmt: skip
    assert sim.step_time_s == 15.0
    assert sim.peak_live_microbatches == (2, 1)


def test_gpipe_non_uniform_no_transfer() -> None:
    sim = simulate_pipeline(
        two_stage(False, False), (0, 1), schedule=Schedule.GPIPE, num_microbatches=4
    )
    # s0 F(m) = [m, m+1]; s1 F0 [1,3], then back to back (each input ready before): [3,5],
    # [5,7], [7,9]; s1 B3 [9,12], B2 [12,15], B1 [15,18], B0 [18,21];
    # s0 B(m) starts when s1 B(m) ends: B3 [12,14], B2 [15,17], B1 [18,20], B0 [21,23].
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("F", 2, 2, 3), ("F", 3, 3, 4),
             ("B", 3, 12, 14), ("B", 2, 15, 17), ("B", 1, 18, 20), ("B", 0, 21, 23)],
        D1: [("F", 0, 1, 3), ("F", 1, 3, 5), ("F", 2, 5, 7), ("F", 3, 7, 9),
             ("B", 3, 9, 12), ("B", 2, 12, 15), ("B", 1, 15, 18), ("B", 0, 18, 21)],
    })  # fmt: skip
    assert sim.step_time_s == 23.0
    assert sim.device_busy_s == (12.0, 20.0)
    assert sim.bubble_fraction == pytest.approx((11 / 23, 3 / 23), rel=1e-12)


def test_1f1b_non_uniform_no_transfer() -> None:
    sim = simulate_pipeline(
        two_stage(False, False), (0, 1), schedule=Schedule.ONE_F_ONE_B, num_microbatches=4
    )
    # s0 F0 [0,1], F1 [1,2]; s1 F0 [1,3], B0 [3,6]; s0 B0 [6,8]; s1 F1 [6,8], B1 [8,11];
    # s0 F2 [8,9]; s1 F2 max(9, 11) = [11,13]; s0 B1 max(11, 9) = [11,13]; s1 B2 [13,16];
    # s0 F3 [13,14]; s1 F3 max(14, 16) = [16,18], B3 [18,21]; s0 B2 max(16, 14) = [16,18];
    # s0 B3 [21,23].
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 6, 8), ("F", 2, 8, 9),
             ("B", 1, 11, 13), ("F", 3, 13, 14), ("B", 2, 16, 18), ("B", 3, 21, 23)],
        D1: [("F", 0, 1, 3), ("B", 0, 3, 6), ("F", 1, 6, 8), ("B", 1, 8, 11),
             ("F", 2, 11, 13), ("B", 2, 13, 16), ("F", 3, 16, 18), ("B", 3, 18, 21)],
    })  # fmt: skip
    assert sim.step_time_s == 23.0


def test_gpipe_uniform_with_transfers() -> None:
    sim = simulate_pipeline(
        two_stage(True, True), (0, 1), schedule=Schedule.GPIPE, num_microbatches=4
    )
    # Activations (1 s) leave as each s0 F ends: [1,2], [2,3], [3,4], [4,5]; s1 F(m) = [m+2, m+3].
    # s1 B3 [6,8], B2 [8,10], B1 [10,12], B0 [12,14]; gradients (0.5 s) at each end:
    # [8,8.5], [10,10.5], [12,12.5], [14,14.5]; s0 B3 [8.5,10.5], B2 [10.5,12.5],
    # B1 [12.5,14.5], B0 [14.5,16.5].
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("F", 2, 2, 3), ("F", 3, 3, 4),
             ("B", 3, 8.5, 10.5), ("B", 2, 10.5, 12.5), ("B", 1, 12.5, 14.5), ("B", 0, 14.5, 16.5)],
        D1: [("F", 0, 2, 3), ("F", 1, 3, 4), ("F", 2, 4, 5), ("F", 3, 5, 6),
             ("B", 3, 6, 8), ("B", 2, 8, 10), ("B", 1, 10, 12), ("B", 0, 12, 14)],
        X01: [("X", 0, 1, 2), ("X", 1, 2, 3), ("X", 2, 3, 4), ("X", 3, 4, 5)],
        X10: [("X", 3, 8, 8.5), ("X", 2, 10, 10.5), ("X", 1, 12, 12.5), ("X", 0, 14, 14.5)],
    })  # fmt: skip
    assert sim.step_time_s == 16.5
    assert sim.link_busy_s == ((X01, 4.0), (X10, 2.0))


def test_1f1b_uniform_with_transfers() -> None:
    sim = simulate_pipeline(
        two_stage(True, True), (0, 1), schedule=Schedule.ONE_F_ONE_B, num_microbatches=4
    )
    # s0 F0 [0,1], F1 [1,2]; act0 [1,2], act1 [2,3]; s1 F0 [2,3], B0 [3,5]; grad0 [5,5.5];
    # s0 B0 [5.5,7.5]; s1 F1 max(3, 5) = [5,6], B1 [6,8]; grad1 [8,8.5]; s0 F2 [7.5,8.5];
    # act2 [8.5,9.5]; s0 B1 [8.5,10.5]; s1 F2 [9.5,10.5], B2 [10.5,12.5]; grad2 [12.5,13];
    # s0 F3 [10.5,11.5]; act3 [11.5,12.5]; s1 F3 [12.5,13.5], B3 [13.5,15.5]; grad3 [15.5,16];
    # s0 B2 [13,15]; s0 B3 [16,18].
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 5.5, 7.5), ("F", 2, 7.5, 8.5),
             ("B", 1, 8.5, 10.5), ("F", 3, 10.5, 11.5), ("B", 2, 13, 15), ("B", 3, 16, 18)],
        D1: [("F", 0, 2, 3), ("B", 0, 3, 5), ("F", 1, 5, 6), ("B", 1, 6, 8),
             ("F", 2, 9.5, 10.5), ("B", 2, 10.5, 12.5), ("F", 3, 12.5, 13.5), ("B", 3, 13.5, 15.5)],
        X01: [("X", 0, 1, 2), ("X", 1, 2, 3), ("X", 2, 8.5, 9.5), ("X", 3, 11.5, 12.5)],
        X10: [("X", 0, 5, 5.5), ("X", 1, 8, 8.5), ("X", 2, 12.5, 13), ("X", 3, 15.5, 16)],
    })  # fmt: skip
    assert sim.step_time_s == 18.0


def test_gpipe_non_uniform_with_transfers() -> None:
    sim = simulate_pipeline(
        two_stage(False, True), (0, 1), schedule=Schedule.GPIPE, num_microbatches=4
    )
    # act(m) [m+1, m+2]; s1 F0 [2,4], F1 [4,6], F2 [6,8], F3 [8,10] (inputs arrive by 3, 4, 5);
    # s1 B3 [10,13], B2 [13,16], B1 [16,19], B0 [19,22]; grads [13,13.5], [16,16.5],
    # [19,19.5], [22,22.5]; s0 B3 [13.5,15.5], B2 [16.5,18.5], B1 [19.5,21.5], B0 [22.5,24.5].
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("F", 2, 2, 3), ("F", 3, 3, 4),
             ("B", 3, 13.5, 15.5), ("B", 2, 16.5, 18.5), ("B", 1, 19.5, 21.5), ("B", 0, 22.5, 24.5)],
        D1: [("F", 0, 2, 4), ("F", 1, 4, 6), ("F", 2, 6, 8), ("F", 3, 8, 10),
             ("B", 3, 10, 13), ("B", 2, 13, 16), ("B", 1, 16, 19), ("B", 0, 19, 22)],
        X01: [("X", 0, 1, 2), ("X", 1, 2, 3), ("X", 2, 3, 4), ("X", 3, 4, 5)],
        X10: [("X", 3, 13, 13.5), ("X", 2, 16, 16.5), ("X", 1, 19, 19.5), ("X", 0, 22, 22.5)],
    })  # fmt: skip
    assert sim.step_time_s == 24.5


def test_1f1b_non_uniform_with_transfers() -> None:
    sim = simulate_pipeline(
        two_stage(False, True), (0, 1), schedule=Schedule.ONE_F_ONE_B, num_microbatches=4
    )
    # s0 F0 [0,1], F1 [1,2]; act0 [1,2], act1 [2,3]; s1 F0 [2,4], B0 [4,7]; grad0 [7,7.5];
    # s0 B0 [7.5,9.5]; s1 F1 max(3, 7) = [7,9], B1 [9,12]; grad1 [12,12.5]; s0 F2 [9.5,10.5];
    # act2 [10.5,11.5]; s1 F2 max(11.5, 12) = [12,14], B2 [14,17]; grad2 [17,17.5];
    # s0 B1 [12.5,14.5]; s0 F3 [14.5,15.5]; act3 [15.5,16.5]; s1 F3 max(16.5, 17) = [17,19],
    # B3 [19,22]; grad3 [22,22.5]; s0 B2 [17.5,19.5]; s0 B3 [22.5,24.5].
    check(sim, {
        D0: [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 7.5, 9.5), ("F", 2, 9.5, 10.5),
             ("B", 1, 12.5, 14.5), ("F", 3, 14.5, 15.5), ("B", 2, 17.5, 19.5), ("B", 3, 22.5, 24.5)],
        D1: [("F", 0, 2, 4), ("B", 0, 4, 7), ("F", 1, 7, 9), ("B", 1, 9, 12),
             ("F", 2, 12, 14), ("B", 2, 14, 17), ("F", 3, 17, 19), ("B", 3, 19, 22)],
        X01: [("X", 0, 1, 2), ("X", 1, 2, 3), ("X", 2, 10.5, 11.5), ("X", 3, 15.5, 16.5)],
        X10: [("X", 0, 7, 7.5), ("X", 1, 12, 12.5), ("X", 2, 17, 17.5), ("X", 3, 22, 22.5)],
    })  # fmt: skip
    assert sim.step_time_s == 24.5


def test_none_schedule_runs_micro_batches_one_after_another() -> None:
    sim = simulate_pipeline(
        two_stage(True, True), (0, 1), schedule=Schedule.NONE, num_microbatches=4
    )
    # Each micro-batch: s0 F 1 + act 1 + s1 F 1 + s1 B 2 + grad 0.5 + s0 B 2 = 7.5 s, four times.
    assert sim.step_time_s == 30.0
    assert sim.peak_live_microbatches == (1, 1)


# -- the plain step and the op-level simulator ---------------------------------------------------


@pytest.mark.parametrize("schedule", list(Schedule))
def test_one_microbatch_is_the_plain_stage_level_step(schedule: Schedule) -> None:
    c = chain_graph([1.0, 2.0, 0.5], [2.0, 3.0, 1.5], [300, 200], [100, 50])
    sim = simulate_pipeline(c, (0, 1, 2), schedule=schedule, num_microbatches=1)
    # forwards 1 + 2 + 0.5, backwards 1.5 + 3 + 2; transfers 0.25 + 3, 0.25 + 2, 0.25 + 0.5,
    # 0.25 + 1 (latency + bytes / 100).
    plain = 3.5 + 6.5 + 3.25 + 2.25 + 1.25 + 0.75
    assert sim.step_time_s == pytest.approx(plain, rel=1e-12)
    # One forward and one backward op per stage and one tensor per boundary: the op-level
    # simulator sees the same step.
    assert simulate_step(c, (0, 1, 2)).step_time_s == pytest.approx(plain, rel=1e-12)


# -- the GPipe bubble and 1F1B memory ------------------------------------------------------------


def uniform_stages(k: int, f: float, b: float, act: int = 0) -> tuple[Stage, ...]:
    return tuple(
        Stage(s, s, (f"L{s}",), f, b, 1000 * (s + 1), act,
              ((StageTransfer(s, s + 1, F, 0, (F,)),) if s + 1 < k else ())
              + ((StageTransfer(s, s - 1, B, 0, (B,)),) if s > 0 else ()))
        for s in range(k)
    )  # fmt: skip


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_gpipe_bubble_is_k_minus_1_over_m_plus_k_minus_1(k: int, m: int) -> None:
    f, b = 1.0 * m, 2.0 * m  # whole batch: 1 s forward and 2 s backward per micro-batch
    sim = simulate_stages(
        uniform_stages(k, f, b), topology(k), schedule=Schedule.GPIPE, num_microbatches=m
    )
    assert sim.step_time_s == pytest.approx((m + k - 1) * 3.0, rel=1e-12)
    for frac in sim.bubble_fraction:
        assert frac == pytest.approx((k - 1) / (m + k - 1), rel=1e-12, abs=1e-12)
    one = simulate_stages(
        uniform_stages(k, f, b), topology(k), schedule=Schedule.ONE_F_ONE_B, num_microbatches=m
    )
    assert one.step_time_s == pytest.approx(sim.step_time_s, rel=1e-12)


def test_gpipe_bubble_through_the_op_graph() -> None:
    for k, m in [(2, 4), (3, 6), (4, 8)]:
        c = chain_graph([m * 1.0] * k, [m * 2.0] * k, [0] * (k - 1), [0] * (k - 1))
        sim = simulate_pipeline(c, tuple(range(k)), schedule=Schedule.GPIPE, num_microbatches=m)
        assert sim.bubble_fraction == pytest.approx([(k - 1) / (m + k - 1)] * k, rel=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
@pytest.mark.parametrize("schedule", list(Schedule))
def test_peak_live_activations_follow_the_schedule(k: int, m: int, schedule: Schedule) -> None:
    act = 700 * m  # 700 bytes per micro-batch
    sim = simulate_stages(
        uniform_stages(k, 1.0 * m, 2.0 * m, act), topology(k), schedule=schedule, num_microbatches=m
    )
    for s in range(k):
        live = {Schedule.NONE: 1, Schedule.GPIPE: m, Schedule.ONE_F_ONE_B: min(m, k - s)}[schedule]
        assert sim.peak_live_microbatches[s] == live == peak_live_microbatches(schedule, k, s, m)
        assert sim.peak_memory_bytes[s] == 1000 * (s + 1) + live * 700


def test_peak_memory_from_layer_memory() -> None:
    mem = (LayerMemory("L0", 100, 100, 200, 4000), LayerMemory("L1", 10, 10, 20, 400))
    c = chain_graph([4.0, 4.0], [8.0, 8.0], [0], [0], memory=mem)
    gpipe = simulate_pipeline(c, (0, 1), schedule=Schedule.GPIPE, num_microbatches=4)
    one = simulate_pipeline(c, (0, 1), schedule=Schedule.ONE_F_ONE_B, num_microbatches=4)
    # static 400 + 4 live x 1000; 1F1B: stage 0 holds 2, stage 1 holds 1.
    assert gpipe.peak_memory_bytes == (4400, 440)
    assert one.peak_memory_bytes == (400 + 2 * 1000, 40 + 100)
    # no micro-batching: the whole activation, as the plain plan counts it
    plain = simulate_pipeline(c, (0, 1), schedule=Schedule.NONE, num_microbatches=1)
    assert plain.peak_memory_bytes == (4400, 440)


def test_every_backward_after_the_first_adds_its_gradients_into_the_sums() -> None:
    from dataclasses import replace

    from cost_models.devices.catalog import get_device_type
    from partitioner.simulation.pipeline import accumulate_time_s

    grads = int(get_device_type("cpu").memory_bandwidth_bytes_per_s)  # 3 s per addition
    mem = (LayerMemory("L0", 0, grads, 0, 0), LayerMemory("L1", 0, 0, 0, 0))
    cpus = Topology(tuple(Device(d, "cpu", 1 << 30) for d in range(2)), LINK)
    c = replace(chain_graph([4.0, 4.0], [8.0, 8.0], [0], [0], memory=mem), topology=cpus)
    free = replace(c, layer_memory=tuple(LayerMemory(x.layer, 0, 0, 0, 0) for x in mem))
    assert accumulate_time_s("cpu", grads) == pytest.approx(3.0)
    assert accumulate_time_s("no-such-device", grads) == 0.0
    for m in (1, 4):
        sim = simulate_pipeline(c, (0, 1), schedule=Schedule.NONE, num_microbatches=m)
        base = simulate_pipeline(free, (0, 1), schedule=Schedule.NONE, num_microbatches=m)
        # micro-batches run one after another: stage 0's M - 1 additions lengthen the step
        assert sim.step_time_s == pytest.approx(base.step_time_s + 3.0 * (m - 1))
        backward_s = {
            e.microbatch: e.end_s - e.start_s
            for e in sim.timeline
            if e.kind is EventKind.BACKWARD and e.resource == "device 0"
        }
        assert backward_s == pytest.approx({mb: 8.0 / m + (3.0 if mb else 0.0) for mb in range(m)})
    # GPipe runs B3 B2 B1 B0: the first backward it runs (B3) starts the sums, the others add.
    gpipe = simulate_pipeline(c, (0, 1), schedule=Schedule.GPIPE, num_microbatches=4)
    backward_s = {
        e.microbatch: e.end_s - e.start_s
        for e in gpipe.timeline
        if e.kind is EventKind.BACKWARD and e.resource == "device 0"
    }
    assert backward_s == pytest.approx({0: 5.0, 1: 5.0, 2: 5.0, 3: 2.0})


def test_schedule_orders() -> None:
    assert stage_steps(Schedule.ONE_F_ONE_B, 4, 1, 5) == (
        (F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (F, 4), (B, 2), (B, 3), (B, 4),
    )  # fmt: skip
    assert stage_steps(Schedule.GPIPE, 4, 1, 3) == ((F, 0), (F, 1), (F, 2), (B, 2), (B, 1), (B, 0))
    assert stage_steps(Schedule.NONE, 4, 1, 2) == ((F, 0), (B, 0), (F, 1), (B, 1))
    # fewer micro-batches than the warm-up: all forwards, then all backwards
    assert stage_steps(Schedule.ONE_F_ONE_B, 4, 0, 2) == ((F, 0), (F, 1), (B, 0), (B, 1))


# -- stages from a placement ---------------------------------------------------------------------


def test_stages_follow_dataflow_not_device_numbers() -> None:
    mem = tuple(LayerMemory(f"L{i}", 1, 2, 3, 10 * (i + 1)) for i in range(3))
    c = chain_graph([1.0, 2.0, 4.0], [8.0, 16.0, 32.0], [100, 200], [50, 60], n_dev=3, memory=mem)
    stages = pipeline_stages(c, {"L0": 2, "L1": 2, "L2": 0})
    assert [s.device for s in stages] == [2, 0]
    s0, s1 = stages
    assert s0.layers == ("L0", "L1") and s1.layers == ("L2",)
    assert (s0.forward_time_s, s0.backward_time_s) == (3.0, 24.0)
    assert (s1.forward_time_s, s1.backward_time_s) == (4.0, 32.0)
    assert s0.static_memory_bytes == 12 and s0.activation_bytes == 30
    assert s0.sends == (StageTransfer(0, 1, F, 200, (F,)),)
    assert s1.sends == (StageTransfer(1, 0, B, 60, (B,)),)
    assert (s0.forward_send_bytes, s1.backward_send_bytes) == (200, 60)
    sim = simulate_pipeline(c, (2, 2, 0), schedule=Schedule.GPIPE, num_microbatches=2)
    assert sim.stage_devices == (2, 0)
    assert sim.device_busy_s[1] == 0.0 and sim.bubble_fraction[1] == 1.0
    assert sim.peak_memory_bytes[1] == 0
    assert {ev.resource for ev in sim.timeline} == {
        "device 2",
        "device 0",
        "link 2->0",
        "link 0->2",
    }


def test_a_tensor_read_twice_on_another_device_is_sent_once() -> None:
    ops = (
        Op("x", "Placeholder", None, F),  # glue: follows layer A
        Op("a", "X", "A", F),
        Op("b1", "X", "B", F),
        Op("b2", "X", "B", F),
        Op("gb", "X", "B", B),
        Op("ga", "X", "A", B),
    )
    edges = (
        Edge("x", "a", 8), Edge("a", "b1", 400), Edge("a", "b2", 400), Edge("a", "gb", 480),
        Edge("b1", "b2", 4), Edge("b2", "gb", 4), Edge("gb", "ga", 40), Edge("a", "ga", 400),
    )  # fmt: skip
    graph = Graph("g", ops, edges, (LayerInfo("A", "Dense"), LayerInfo("B", "Dense")), 8)
    times = ((0.0, 1.0, 2.0, 3.0, 4.0, 5.0),) * 2
    c = CostedGraph(
        graph, topology(2), times, (LayerMemory("A", 0, 0, 0, 0), LayerMemory("B", 0, 0, 0, 0))
    )
    s0, s1 = pipeline_stages(c, (0, 1))
    assert s0.forward_time_s == 1.0 and s0.backward_time_s == 5.0
    assert s1.forward_time_s == 5.0 and s1.backward_time_s == 4.0
    # "a" goes to device 1 once (at the largest size an edge gives it), read by forward and
    # backward ops there
    assert s0.sends == (StageTransfer(0, 1, F, 480, (F, B)),)
    assert s1.sends == (StageTransfer(1, 0, B, 40, (B,)),)


def test_skip_connection_transfers_between_non_adjacent_stages() -> None:
    # L0 -> L1 -> L2 and L0 -> L2 (skip), one layer per device
    ops = tuple(Op(f"L{i}/f", "X", f"L{i}", F) for i in range(3)) + tuple(
        Op(f"L{i}/b", "X", f"L{i}", B) for i in (2, 1, 0)
    )
    edges = (
        Edge("L0/f", "L1/f", 100), Edge("L1/f", "L2/f", 100), Edge("L0/f", "L2/f", 300),
        Edge("L2/b", "L1/b", 100), Edge("L1/b", "L0/b", 100), Edge("L2/b", "L0/b", 300),
    )  # fmt: skip
    graph = Graph("skip", ops, edges, tuple(LayerInfo(f"L{i}", "Dense") for i in range(3)), 4)
    times = ((2.0, 2.0, 2.0, 2.0, 2.0, 2.0),) * 3
    mem = tuple(LayerMemory(f"L{i}", 0, 0, 0, 0) for i in range(3))
    c = CostedGraph(graph, topology(3), times, mem)
    stages = pipeline_stages(c, (0, 1, 2))
    assert stages[0].sends == (StageTransfer(0, 1, F, 100, (F,)), StageTransfer(0, 2, F, 300, (F,)))
    assert stages[2].sends == (StageTransfer(2, 0, B, 300, (B,)), StageTransfer(2, 1, B, 100, (B,)))
    sim = simulate_pipeline(c, (0, 1, 2), schedule=Schedule.ONE_F_ONE_B, num_microbatches=2)
    got = spans(sim)
    for mb in range(2):
        # per micro-batch: 150 bytes over 0->2 take 0.25 + 1.5 s
        x_start, x_end = got[("link 0->2", EventKind.TRANSFER, mb)]
        assert x_end - x_start == pytest.approx(1.75)
        assert x_start >= got[("device 0", EventKind.FORWARD, mb)][1]
        assert got[("device 2", EventKind.FORWARD, mb)][0] >= x_end


def test_a_placement_whose_stages_form_a_cycle_is_refused() -> None:
    c = chain_graph([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [10, 10], [10, 10], n_dev=2)
    with pytest.raises(PlanError, match="cycle"):
        pipeline_stages(c, (0, 1, 0))
    with pytest.raises(PlanError, match="cycle"):
        simulate_pipeline(c, (0, 1, 0), schedule=Schedule.GPIPE, num_microbatches=2)


def test_backward_feeding_another_devices_forward_is_refused() -> None:
    ops = (Op("a", "X", "A", F), Op("ga", "X", "A", B), Op("b", "X", "B", F))
    graph = Graph(
        "g",
        ops,
        (Edge("a", "ga", 4), Edge("ga", "b", 4)),
        (LayerInfo("A", "Dense"), LayerInfo("B", "Dense")),
        4,
    )
    c = CostedGraph(
        graph,
        topology(2),
        ((1.0, 1.0, 1.0),) * 2,
        (LayerMemory("A", 0, 0, 0, 0), LayerMemory("B", 0, 0, 0, 0)),
    )
    with pytest.raises(PlanError, match="backward op 'ga'"):
        pipeline_stages(c, (0, 1))
    assert len(pipeline_stages(c, (0, 0))) == 1


@pytest.mark.parametrize("m", [0, -1, True, 2.0])
def test_bad_microbatch_counts_are_usage_errors(m: object) -> None:
    c = two_stage(True, False)
    with pytest.raises(UsageError, match="num_microbatches"):
        simulate_pipeline(c, (0, 1), schedule=Schedule.GPIPE, num_microbatches=m)  # type: ignore[arg-type]


def test_more_microbatches_than_samples_and_bad_schedule_are_refused() -> None:
    c = chain_graph([1.0, 1.0], [1.0, 1.0], [0], [0], batch_size=4)
    with pytest.raises(UsageError, match="exceeds the batch size 4"):
        simulate_pipeline(c, (0, 1), schedule=Schedule.GPIPE, num_microbatches=8)
    with pytest.raises(UsageError, match="schedule"):
        simulate_pipeline(c, (0, 1), schedule="gpipe", num_microbatches=2)  # type: ignore[arg-type]
    with pytest.raises(PlanError):
        simulate_pipeline(c, (0, 5), schedule=Schedule.GPIPE, num_microbatches=2)


def test_hand_made_stages_are_validated() -> None:
    good = uniform_stages(2, 1.0, 1.0)
    with pytest.raises(PlanError, match="one stage"):
        simulate_stages(
            (good[0], Stage(1, 0, (), 1.0, 1.0, 0, 0)),
            topology(2),
            schedule=Schedule.GPIPE,
            num_microbatches=1,
        )
    with pytest.raises(PlanError, match="index"):
        simulate_stages(good[::-1], topology(2), schedule=Schedule.GPIPE, num_microbatches=1)
    with pytest.raises(PlanError, match="at least one stage"):
        simulate_stages((), topology(2), schedule=Schedule.GPIPE, num_microbatches=1)


# -- the discrete-event core ---------------------------------------------------------------------


def test_unordered_resources_serve_first_come_first_served() -> None:
    tasks = [
        SimTask("a", 3.0),  # 0
        SimTask("b", 1.0),  # 1
        SimTask("link", 2.0, (0,)),  # 2: ready at 3
        SimTask("link", 2.0, (1,)),  # 3: ready at 1, served first
        SimTask("link", 0.5, (1,)),  # 4: ready at 1, after 3 (index order)
    ]
    start, end = run_tasks(tasks, {})
    assert start == (0.0, 0.0, 3.5, 1.0, 3.0)
    assert end == (3.0, 1.0, 5.5, 3.0, 3.5)


def test_an_order_against_the_dependencies_deadlocks() -> None:
    tasks = [SimTask("r", 1.0), SimTask("r", 1.0, (0,))]
    assert run_tasks(tasks, {"r": (0, 1)}) == ((0.0, 1.0), (1.0, 2.0))
    with pytest.raises(PlanError, match="deadlocks"):
        run_tasks(tasks, {"r": (1, 0)})
    with pytest.raises(PlanError, match="leaves out"):
        run_tasks(tasks, {"r": (1,)})
    with pytest.raises(PlanError, match="twice"):
        run_tasks(tasks, {"r": (1, 1)})
    with pytest.raises(PlanError, match="depends on task 5"):
        run_tasks([SimTask("r", 1.0, (5,))], {})


# -- invariants on random pipelines --------------------------------------------------------------


@st.composite
def random_pipelines(draw: st.DrawFn) -> tuple[tuple[Stage, ...], Topology, Schedule, int]:
    k = draw(st.integers(1, 5))
    m = draw(st.integers(1, 8))
    times = st.floats(0.0, 5.0, allow_nan=False)
    stages = []
    for s in range(k):
        sends = []
        for t in range(s + 1, k):
            if t == s + 1 or draw(st.booleans()):
                sends.append(StageTransfer(s, t, F, draw(st.integers(0, 1000)), (F,)))
        for t in range(s):
            if t == s - 1 or draw(st.booleans()):
                sends.append(StageTransfer(s, t, B, draw(st.integers(0, 1000)), (B,)))
        stages.append(
            Stage(
                s,
                s,
                (f"L{s}",),
                draw(times),
                draw(times),
                0,
                draw(st.integers(0, 10_000)),
                tuple(sends),
            )
        )
    hosts = draw(st.lists(st.integers(0, 1), min_size=k, max_size=k))
    link = Link("l", draw(st.floats(0.0, 1.0)), draw(st.floats(1.0, 1e4)))
    topo = Topology(
        tuple(Device(d, "gpu", 1 << 30, host=h) for d, h in enumerate(hosts)),
        link,
        inter_host_link=Link("net", 0.5, 50.0),
    )
    return tuple(stages), topo, draw(st.sampled_from(list(Schedule))), m


def by_resource(timeline: Sequence[TimelineEvent]) -> dict[str, list[TimelineEvent]]:
    out: dict[str, list[TimelineEvent]] = {}
    for ev in timeline:
        out.setdefault(ev.resource, []).append(ev)
    return out


@settings(max_examples=150, deadline=None)
@given(random_pipelines())
def test_pipeline_invariants(case: tuple[tuple[Stage, ...], Topology, Schedule, int]) -> None:
    stages, topo, schedule, m = case
    k = len(stages)
    sim = simulate_stages(stages, topo, schedule=schedule, num_microbatches=m)
    eps = 1e-9
    # every (stage, micro-batch, F/B) exactly once, with its duration
    compute = [ev for ev in sim.timeline if ev.kind is not EventKind.TRANSFER]
    seen = {(ev.resource, ev.kind, ev.microbatch) for ev in compute}
    assert len(compute) == len(seen) == 2 * k * m
    ends = {}
    for ev in compute:
        st_ = stages[int(ev.resource.split()[1])]
        per = st_.forward_time_s if ev.kind is EventKind.FORWARD else st_.backward_time_s
        assert ev.end_s - ev.start_s == pytest.approx(per / m, abs=eps)
        ends[(int(ev.resource.split()[1]), ev.kind, ev.microbatch)] = (ev.start_s, ev.end_s)
    # one resource never runs two events at once
    for events in by_resource(sim.timeline).values():
        ordered = sorted(events, key=lambda ev: (ev.start_s, ev.end_s))
        for a, b in itertools.pairwise(ordered):
            assert b.start_s >= a.end_s - eps
    # dependencies: B after its F; each transfer after its producer, each consumer after it
    for (s, kind, mb), (start, _) in ends.items():
        if kind is EventKind.BACKWARD:
            assert start >= ends[(s, EventKind.FORWARD, mb)][1] - eps
    transfers = [ev for ev in sim.timeline if ev.kind is EventKind.TRANSFER]
    assert len(transfers) == m * sum(len(s.sends) for s in stages)
    for s, stage in enumerate(stages):
        for t in stage.sends:
            what = "activations" if t.phase is F else "gradients"
            kind = EventKind.FORWARD if t.phase is F else EventKind.BACKWARD
            for mb in range(m):
                (x,) = [
                    ev
                    for ev in transfers
                    if ev.label == f"stage {s}->{t.dst_stage} {what}" and ev.microbatch == mb
                ]
                assert x.start_s >= ends[(s, kind, mb)][1] - eps
                assert ends[(t.dst_stage, kind, mb)][0] >= x.end_s - eps
    # totals
    assert sim.step_time_s == max(ev.end_s for ev in sim.timeline)
    for s, stage in enumerate(stages):
        busy = stage.forward_time_s + stage.backward_time_s
        assert sim.device_busy_s[s] == pytest.approx(busy, abs=eps)
        assert sim.step_time_s >= busy - eps
        assert sim.peak_live_microbatches[s] == peak_live_microbatches(schedule, k, s, m)
        assert 0.0 <= sim.bubble_fraction[s] <= 1.0
    link_total = sum(ev.end_s - ev.start_s for ev in transfers)
    assert sum(b for _, b in sim.link_busy_s) == pytest.approx(link_total, abs=1e-6)
    assert simulate_stages(stages, topo, schedule=schedule, num_microbatches=m) == sim


def test_a_loss_reading_two_heads_joins_the_later_head_so_any_contiguous_split_pipelines() -> None:
    """Layers A -> H1, A -> H2; the loss (glue) reads H1 then H2. Merged into H1 (its first
    producer), it would make H1's device wait for H2's and H2's wait for H1's gradient: no
    pipeline. Glue ops join the producer latest in the layer order (backward glue: the earliest
    backward producer), so data flows with the layer order and every contiguous split works."""
    from partitioner.core.ir import Device, Edge, Graph, LayerInfo, LayerMemory, Link, Op, Topology
    from partitioner.solvers.stages import make_acyclic

    f, b = Phase.FORWARD, Phase.BACKWARD
    ops = (
        Op("fA", "X", "A", f),
        Op("fH1", "X", "H1", f),
        Op("fH2", "X", "H2", f),
        Op("loss", "AddN", None, f),
        Op("dloss", "X", None, b),
        Op("bH2", "X", "H2", b),
        Op("bH1", "X", "H1", b),
        Op("bA", "X", "A", b),
    )
    edges = (
        Edge("fA", "fH1", 8),
        Edge("fA", "fH2", 8),
        Edge("fH1", "loss", 8),
        Edge("fH2", "loss", 8),
        Edge("loss", "dloss", 8),
        Edge("dloss", "bH2", 8),
        Edge("dloss", "bH1", 8),
        Edge("bH2", "bA", 8),
        Edge("bH1", "bA", 8),
    )
    layers = tuple(LayerInfo(n, "Dense") for n in ("A", "H1", "H2"))
    graph = Graph("two_heads", ops, edges, layers, batch_size=4)
    assert graph.layer_graph.op_owner["loss"] == "H2"
    assert graph.layer_graph.op_owner["dloss"] == "H2"
    topo = Topology(tuple(Device(i, "gpu", 1 << 30) for i in range(2)), Link("l", 0.0, 1e9))
    costed = CostedGraph(
        graph,
        topo,
        ((1.0,) * len(ops),) * 2,
        tuple(LayerMemory(x.name, 0, 0, 0, 0) for x in layers),
    )
    for placement in [(0, 0, 1), (0, 1, 1)]:
        staged = make_acyclic(placement, costed.problem())
        sim = simulate_pipeline(costed, staged, schedule=Schedule.GPIPE, num_microbatches=2)
        assert sim.stage_devices == (0, 1) and sim.step_time_s > 0
