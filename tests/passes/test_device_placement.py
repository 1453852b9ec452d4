"""passes.rewrite.device_placement: a placed copy computes what the original computes, where the plan says.

Every example model (and ResNet50, marked slow) is placed on 2 and 4 of the logical CPU devices
that tests/conftest.py configures, and checked for: equal outputs, equal gradients, weights (and
optimizer slots) on the planned devices, every op of the traced training step (gradients included)
on its layer's device, a working ``fit``, and an untouched original.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from example_models import (
    EXAMPLE_NAMES,
    build_example,
    check_loops_read_only_their_device,
    random_input,
)

from partitioner.core.errors import RewriteError
from passes.rewrite.device_placement import PlacedModel, place_model
from passes.trace import _CallRecorder, placement_units

BATCH = 4
COMPUTE_OPS = frozenset(
    {
        "MatMul",
        "BatchMatMulV2",
        "Conv2D",
        "Conv2DBackpropInput",
        "Conv2DBackpropFilter",
        "DepthwiseConv2dNative",
    }
)
GRADIENT_NAME = re.compile(r"^gradients/(.+?)_grad/")
TOL = 1e-5

Plan = dict[str, str]


def device(i: int) -> str:
    return f"/device:CPU:{i}"


def contiguous(model: keras.Model, num_devices: int) -> Plan:
    """Consecutive placement units in ``num_devices`` nearly equal runs."""
    units = placement_units(model)
    return {u.name: device(k * num_devices // len(units)) for k, u in enumerate(units)}


def round_robin(model: keras.Model, num_devices: int) -> Plan:
    return {u.name: device(k % num_devices) for k, u in enumerate(placement_units(model))}


ASSIGNMENTS: dict[str, Callable[[keras.Model, int], Plan]] = {
    "contiguous": contiguous,
    "round_robin": round_robin,
}

CASES = [
    *[(name, n, "contiguous") for name in EXAMPLE_NAMES for n in (2, 4)],
    ("mnist_mlp", 4, "round_robin"),
    ("branchy", 3, "round_robin"),
]
CASE_IDS = [f"{name}-{n}dev-{how}" for name, n, how in CASES]


def resnet50(input_shape: tuple[int, int, int] = (64, 64, 3), classes: int = 10) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.applications.ResNet50(weights=None, input_shape=input_shape, classes=classes)


def unit_devices(
    model: keras.Model, placed: PlacedModel, plan: Mapping[str, str]
) -> dict[int, str]:
    """id(unit of the copy) -> planned device; units correspond by position."""
    originals = placement_units(model)
    copies = placement_units(placed.inner)
    assert [type(u.operation) for u in copies] == [type(u.operation) for u in originals]
    return {id(c.operation): plan[o.name] for o, c in zip(originals, copies)}


def weights_of(unit: Any, trainable: bool = False) -> list[Any]:
    """A unit's (trainable) weights; functional-API ops such as ``keras.ops.add`` have none."""
    return list(getattr(unit.operation, "trainable_weights" if trainable else "weights", []))


def paired_trainable(model: keras.Model, placed: PlacedModel) -> list[tuple[Any, Any]]:
    """(original variable, copy's variable) for every trainable weight, matched unit by unit."""
    pairs = []
    for o, c in zip(placement_units(model), placement_units(placed.inner)):
        pairs.extend(zip(weights_of(o, trainable=True), weights_of(c, trainable=True), strict=True))
    assert len(pairs) == len(model.trainable_weights) == len(placed.trainable_weights)
    return pairs


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    assert diff <= TOL * scale, f"{what}: max abs diff {diff} (scale {scale})"


def ends_with_device(device_string: str, planned: str) -> bool:
    return device_string.endswith(planned.lstrip("/"))


# -- the checks, shared by the example cases and ResNet50 -------------------------------------


def check_outputs(model: keras.Model, placed: PlacedModel, x: np.ndarray) -> None:
    expected = tf.nest.flatten(model(x, training=False))
    actual = tf.nest.flatten(placed(x, training=False))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_close(np.asarray(a), np.asarray(e), "output")


def check_gradients(model: keras.Model, placed: PlacedModel, x: np.ndarray) -> None:
    pairs = paired_trainable(model, placed)
    out_shape = tuple(model(x[:1], training=False).shape[1:])
    y = np.random.default_rng(1).standard_normal((len(x), *out_shape)).astype(np.float32)

    @tf.function(autograph=False)
    def both_gradients(x: tf.Tensor, y: tf.Tensor) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        loss_original = tf.reduce_mean(tf.square(model(x, training=False) - y))
        loss_placed = tf.reduce_mean(tf.square(placed(x, training=False) - y))
        g_original = tf.gradients(loss_original, [o.value for o, _ in pairs])
        g_placed = tf.gradients(loss_placed, [c.value for _, c in pairs])
        return g_original, g_placed

    g_original, g_placed = both_gradients(tf.constant(x), tf.constant(y))
    for (o, _), go, gp in zip(pairs, g_original, g_placed):
        assert go is not None and gp is not None, o.path
        assert_close(gp.numpy(), go.numpy(), f"gradient of {o.path}")


def check_weights(model: keras.Model, placed: PlacedModel, plan: Mapping[str, str]) -> None:
    devices = unit_devices(model, placed, plan)
    checked = 0
    for unit in placement_units(placed.inner):
        planned = devices[id(unit.operation)]
        for w in weights_of(unit):
            assert ends_with_device(w.value.device, planned), (w.path, w.value.device, planned)
            checked += 1
    assert checked == len(model.weights)
    # the optimizer's slots sit with their variable
    placed.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    optimizer = placed.optimizer
    optimizer.build(placed.trainable_variables)
    slots = zip(
        placed.trainable_variables, optimizer._momentums, optimizer._velocities, strict=True
    )
    for w, momentum, velocity in slots:
        assert momentum.value.device == w.value.device, (w.path, momentum.path)
        assert velocity.value.device == w.value.device, (w.path, velocity.path)


def check_train_step_ops(
    model: keras.Model, placed: PlacedModel, plan: Mapping[str, str], x: np.ndarray
) -> None:
    """Every op a unit creates, and every gradient op colocated with one, is on the unit's device."""
    devices_by_id = unit_devices(model, placed, plan)
    copies = placement_units(placed.inner)
    device_of = {u.name: devices_by_id[id(u.operation)] for u in copies}
    placed.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    placed.optimizer.build(placed.trainable_variables)
    recorder = _CallRecorder(copies)
    y_shape = (BATCH, *tuple(model(x[:1], training=False).shape[1:]))

    def step(x: tf.Tensor, y: tf.Tensor) -> Any:
        with recorder.recording(tf.compat.v1.get_default_graph()):
            return placed.train_step((x, y))

    x_spec = tf.TensorSpec((BATCH, *x.shape[1:]), tf.float32)
    y_spec = tf.TensorSpec(y_shape, tf.float32)
    graph = tf.function(step, autograph=False).get_concrete_function(x_spec, y_spec).graph

    owner: dict[str, str | None] = {}
    checked_compute = checked_gradients = 0
    first_device = device(0)
    for pos, op in enumerate(graph.get_operations()):
        layer = recorder.owner_of(pos)
        if op.name.startswith("gradients/"):
            layer = None
            for group in op.colocation_groups():
                target = group.decode()[len("loc:@") :]
                if target != op.name and owner.get(target) is not None:
                    layer = owner[target]
                    break
            # a gradient of a unit's MatMul/Conv must be colocated with (so owned like) it
            named = GRADIENT_NAME.match(op.name)
            forward_owner = owner.get(named.group(1)) if named else None
            if forward_owner is not None and op.type in COMPUTE_OPS:
                assert layer == forward_owner, f"{op.name} is not colocated with its forward op"
        owner[op.name] = layer
        if layer is None:
            continue
        planned = device_of[layer]
        if op.device:
            assert ends_with_device(op.device, planned), (op.name, op.device, planned)
        if op.type in COMPUTE_OPS:
            assert ends_with_device(op.device, planned), (op.name, op.device, planned)
            checked_compute += 1
        if op.name.startswith("gradients/"):
            assert op.device, f"gradient op {op.name} of {layer} is unplaced"
            if planned != first_device:
                assert not ends_with_device(op.device, first_device), (op.name, op.device)
            checked_gradients += 1
    assert checked_compute >= 3
    assert checked_gradients > 0


def place(model: keras.Model, plan: Plan, x: np.ndarray) -> PlacedModel:
    return place_model(model, plan, [x[:1]])


# -- example models ---------------------------------------------------------------------------


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request: pytest.FixtureRequest) -> tuple[keras.Model, PlacedModel, Plan, np.ndarray]:
    name, num_devices, how = request.param
    model = build_example(name)
    x = random_input(model, BATCH)
    plan = ASSIGNMENTS[how](model, num_devices)
    assert len(set(plan.values())) == num_devices
    return model, place(model, plan, x), plan, x


def test_outputs_match(case: tuple[keras.Model, PlacedModel, Plan, np.ndarray]) -> None:
    model, placed, _, x = case
    check_outputs(model, placed, x)


def test_gradients_match(case: tuple[keras.Model, PlacedModel, Plan, np.ndarray]) -> None:
    model, placed, _, x = case
    check_gradients(model, placed, x)


def test_weights_on_planned_devices(
    case: tuple[keras.Model, PlacedModel, Plan, np.ndarray],
) -> None:
    model, placed, plan, _ = case
    check_weights(model, placed, plan)


def test_train_step_ops_on_planned_devices(
    case: tuple[keras.Model, PlacedModel, Plan, np.ndarray],
) -> None:
    model, placed, plan, x = case
    check_train_step_ops(model, placed, plan, x)


def _weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w.numpy()) for w in model.weights]


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_fit_lowers_loss_and_leaves_the_original_alone(name: str) -> None:
    model = build_example(name)
    before = _weights(model)
    x = np.random.default_rng(2).standard_normal((32, *random_input(model, 1).shape[1:]))
    x = x.astype(np.float32)
    n_out = int(model(x[:1], training=False).shape[-1])
    y = np.random.default_rng(3).integers(0, n_out, size=len(x)).astype(np.int32)
    placed = place(model, contiguous(model, 2), x)
    keras.utils.set_random_seed(0)
    placed.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    loss_before = placed.evaluate(x, y, batch_size=32, verbose=0)
    history = placed.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    loss_after = placed.evaluate(x, y, batch_size=32, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert loss_after < loss_before, (loss_before, loss_after, history.history["loss"])
    # the original: same weights, no layer patched, not trained along
    for w0, w1 in zip(before, _weights(model)):
        np.testing.assert_array_equal(w0, w1)
    for layer in model._flatten_layers(include_self=True, recursive=True):
        assert "call" not in vars(layer), layer.name
    assert any(
        not np.array_equal(w0, np.asarray(w1)) for w0, w1 in zip(before, placed.inner.weights)
    ), "the placed copy did not train"


def test_placed_model_keeps_compile_settings() -> None:
    model = build_example("two_device_dense")
    x = random_input(model, 2)
    placed = place(model, contiguous(model, 2), x)
    assert placed.compiled
    assert isinstance(placed.optimizer, keras.optimizers.Adam)
    assert placed.optimizer is not model.optimizer


@pytest.mark.parametrize("name", ["mnist_mlp", "branchy", "subclassed"])
def test_plan_missing_a_layer_is_refused(name: str) -> None:
    model = build_example(name)
    plan = contiguous(model, 2)
    dropped = list(plan)[1]
    del plan[dropped]
    with pytest.raises(RewriteError, match=dropped):
        place(model, plan, random_input(model, 1))


def test_plan_with_an_unknown_layer_is_refused() -> None:
    model = build_example("mnist_mlp")
    plan = {**contiguous(model, 2), "no_such_layer": device(1)}
    with pytest.raises(RewriteError, match="no_such_layer"):
        place(model, plan, random_input(model, 1))


# -- ResNet50 ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("num_devices", [4])  # 2 devices: the sweep's resnet50-placed-2dev
def test_resnet50_small(num_devices: int) -> None:
    model = resnet50()
    x = np.random.default_rng(0).random((2, 64, 64, 3)).astype(np.float32)
    plan = contiguous(model, num_devices)
    placed = place(model, plan, x)
    check_outputs(model, placed, x)
    check_gradients(model, placed, x)
    check_weights(model, placed, plan)
    check_train_step_ops(model, placed, plan, x)


@pytest.mark.slow
def test_resnet50_default_shape_outputs() -> None:
    model = resnet50(input_shape=(224, 224, 3), classes=1000)
    x = np.random.default_rng(0).random((2, 224, 224, 3)).astype(np.float32)
    placed = place(model, contiguous(model, 4), x)
    check_outputs(model, placed, x)


def _seq2seq_with_masks() -> keras.Model:
    """A decoder LSTM whose initial state and mask come from layers of another device."""
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    src = keras.layers.Embedding(50, 8, mask_zero=True, name="src")(tokens)
    _, h, c = keras.layers.LSTM(8, return_state=True, name="enc")(src)
    tgt = keras.layers.Embedding(50, 8, mask_zero=True, name="tgt")(tokens)
    decoded = keras.layers.LSTM(8, name="dec")(tgt, initial_state=[h, c])
    return keras.Model(tokens, keras.layers.Dense(3, name="head")(decoded))


def test_inputs_from_another_device_are_copied_before_a_loop_reads_them() -> None:
    """The decoder's loop reads only tensors made on its device; outputs and gradients equal.

    Without the copy, the decoder's ``While`` took the encoder's state from the other device,
    which TensorFlow fetched on every step (2.6x slower on two loopback workers).
    """
    keras.utils.set_random_seed(0)
    model = _seq2seq_with_masks()
    late = {"dec", "head"}
    plan = {u.name: device(int(u.name in late)) for u in placement_units(model)}
    x = np.array([[3, 4, 5, 0, 0, 0], [7, 1, 2, 9, 4, 0]], dtype=np.int32)
    placed = place_model(model, plan, [x[:1]])
    y = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    pairs = paired_trainable(model, placed)

    @tf.function(autograph=False)
    def both(x: tf.Tensor, y: tf.Tensor) -> Any:
        out = [m(x, training=False) for m in (model, placed)]
        losses = [tf.reduce_mean(tf.square(o - y)) for o in out]
        grads = [tf.gradients(losses[k], [p[k].value for p in pairs]) for k in (0, 1)]
        return out, [[tf.convert_to_tensor(g) for g in gs] for gs in grads]

    (out, grads), graph = both(x, y), both.get_concrete_function(x, y).graph
    assert_close(out[1].numpy(), out[0].numpy(), "outputs")
    for (o, _), go, gp in zip(pairs, *grads):
        assert_close(gp.numpy(), go.numpy(), f"gradient of {o.path}")
    check_loops_read_only_their_device(graph, device(1))
