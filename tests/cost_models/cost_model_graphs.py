"""Small hand-made graphs for the cost-model tests."""

from __future__ import annotations

import math

from partitioner.core.ir import Edge, Graph, LayerInfo, Op, Phase

F32 = 4


def act(*shape: int) -> int:
    """Bytes of a float32 tensor of ``shape``."""
    return F32 * math.prod(shape)


def op(
    id: str,
    op_type: str,
    layer: str | None,
    *,
    shape: tuple[int, ...] = (),
    dtype: str = "float32",
    flops: int = 0,
    phase: Phase = Phase.FORWARD,
) -> Op:
    n = math.prod(shape)
    itemsize = 2 if dtype in ("bfloat16", "float16") else F32
    return Op(id, op_type, layer, phase, (shape,), (dtype,), n * itemsize, flops)


def single_op_graph(new_op: Op, input_bytes: tuple[int, ...] = ()) -> Graph:
    """``new_op`` fed by one Placeholder per entry of ``input_bytes``."""
    inputs = tuple(
        Op(f"in{i}", "Placeholder", None, Phase.FORWARD, ((b,),), ("int8",), b)
        for i, b in enumerate(input_bytes)
    )
    edges = tuple(Edge(f"in{i}", new_op.id, b) for i, b in enumerate(input_bytes))
    layer = new_op.layer or "l"
    return Graph("one", (*inputs, new_op), edges, (LayerInfo(layer, "Dense"),))


def mlp() -> Graph:
    """x -> dense1 (64->128, relu) -> dense2 (128->10) -> loss, with its backward pass."""
    b = 32
    ops = (
        op("x", "Placeholder", None, shape=(b, 64)),
        op("d1/mm", "MatMul", "dense1", shape=(b, 128), flops=2 * b * 64 * 128),
        op("d1/relu", "Relu", "dense1", shape=(b, 128), flops=b * 128),
        op("d2/mm", "MatMul", "dense2", shape=(b, 10), flops=2 * b * 128 * 10),
        op("loss", "Mean", None, shape=(), flops=b * 10),
        op("g/d2/mm", "MatMul", "dense2", shape=(128, 10), flops=2 * b * 128 * 10,
           phase=Phase.BACKWARD),
        op("g/d2/x", "MatMul", "dense2", shape=(b, 128), flops=2 * b * 128 * 10,
           phase=Phase.BACKWARD),
        op("g/d1/relu", "ReluGrad", "dense1", shape=(b, 128), flops=b * 128,
           phase=Phase.BACKWARD),
        op("g/d1/mm", "MatMul", "dense1", shape=(64, 128), flops=2 * b * 64 * 128,
           phase=Phase.BACKWARD),
    )  # fmt: skip
    edges = (
        Edge("x", "d1/mm", act(b, 64)),
        Edge("d1/mm", "d1/relu", act(b, 128)),
        Edge("d1/relu", "d2/mm", act(b, 128)),
        Edge("d2/mm", "loss", act(b, 10)),
        Edge("loss", "g/d2/mm", F32),
        Edge("d1/relu", "g/d2/mm", act(b, 128)),
        Edge("loss", "g/d2/x", F32),
        Edge("g/d2/x", "g/d1/relu", act(b, 128)),
        Edge("d1/relu", "g/d1/relu", act(b, 128)),
        Edge("g/d1/relu", "g/d1/mm", act(b, 128)),
        Edge("x", "g/d1/mm", act(b, 64)),
    )
    layers = (
        LayerInfo("dense1", "Dense", 64 * 128 + 128, 64 * 128 + 128,
                  F32 * (64 * 128 + 128), F32 * (64 * 128 + 128)),
        LayerInfo("dense2", "Dense", 128 * 10 + 10, 0, F32 * (128 * 10 + 10), 0),
    )  # fmt: skip
    return Graph("mlp", ops, edges, layers, batch_size=b)
