"""passes.rewrite.codegen: the emitted module, imported, rebuilds the model on the planned devices.

Every example model (and ResNet50) is emitted for plans over the logical CPU devices of
tests/conftest.py, written with ``write_placed_module``, imported from the file, built, loaded with
the original's weights and checked for: equal outputs (max abs diff <= 1e-5), every variable on
its layer's device, and every op a layer creates on that layer's device. A model file with the
awkward cases (a custom layer class, dict inputs and outputs, a nested model shared between two
calls with a fixed ``training`` flag, ``keras.ops`` calls with arguments) is checked the same way,
and names built to inject code are shown to stay inert. A seq2seq (functional and subclassed)
checks that inputs from another device are copied before the decoder's loop reads them.
"""

from __future__ import annotations

import ast
import itertools
import os
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from example_models import (
    EXAMPLE_NAMES,
    EXAMPLES_DIR,
    build_example,
    check_loops_read_only_their_device,
    random_input,
)

from partitioner.cli.loader import load_model
from partitioner.core.errors import RewriteError
from partitioner.core.files import marked
from partitioner.core.ir import Schedule
from partitioner.plan.model import PipelineInfo, Plan, PlanDevice, SolverInfo
from passes.rewrite.codegen import (
    emit_placed_module,
    emit_plan_module,
    plan_device_strings,
    write_placed_module,
)
from passes.trace import Unit, _CallRecorder, placement_units
from tests.emitted import import_emitted

TOL = 1e-5
COMPUTE_OPS = frozenset({"MatMul", "BatchMatMulV2", "Conv2D", "DepthwiseConv2dNative"})
# What an emitted module may import: nothing of partitioner, so it runs on its own.
ALLOWED_IMPORTS = frozenset(
    {"__future__", "os", "sys", "functools", "importlib.machinery", "importlib.util", "inspect", "typing",
     "keras", "numpy",
     "tensorflow", "keras.src.ops.numpy", "keras.src.backend"}
)
_counter = itertools.count()

LayerDevices = dict[str, str]


def device(i: int) -> str:
    return f"/device:CPU:{i}"


def contiguous(model: keras.Model, num_devices: int) -> LayerDevices:
    units = placement_units(model)
    return {u.name: device(k * num_devices // len(units)) for k, u in enumerate(units)}


def round_robin(model: keras.Model, num_devices: int) -> LayerDevices:
    return {u.name: device(k % num_devices) for k, u in enumerate(placement_units(model))}


ASSIGNMENTS: dict[str, Callable[[keras.Model, int], LayerDevices]] = {
    "contiguous": contiguous,
    "round_robin": round_robin,
}



def emit_and_import(
    model: keras.Model, plan: Mapping[str, str], tmp_path: Path, **kwargs: Any
) -> tuple[str, ModuleType]:
    source = emit_placed_module(model, plan, **kwargs)
    path = write_placed_module(tmp_path / f"placed_{next(_counter)}.py", source)
    assert path.read_text(encoding="utf-8") == marked(source, "#")  # a later run replaces it
    return source, import_emitted(path)


def ends_with_device(device_string: str, planned: str) -> bool:
    return device_string.endswith(planned.lstrip("/"))


def max_abs_diff(actual: Any, expected: Any) -> float:
    a_flat, e_flat = tf.nest.flatten(actual), tf.nest.flatten(expected)
    assert len(a_flat) == len(e_flat)
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(e)))) for a, e in zip(a_flat, e_flat))


def emitted_units(module: ModuleType, placed: keras.Model, plan: Mapping[str, str]) -> list[Unit]:
    """The emitted model's units with their planned device (by position, as build_model does)."""
    units = module.placement_units(placed)
    if hasattr(module, "PlacedModel"):  # graph models: ops written as keras.ops calls are not units
        assert set(units) <= set(plan)
        pairs = [(name, units[name]) for name in plan if name in units]
    else:  # a subclassed copy: Keras renamed the auto-named layers
        assert len(units) == len(plan)
        pairs = list(zip(plan, units.values()))
    return [Unit(name=name, operation=layer, path=()) for name, layer in pairs]


def check_weights_placed(module: ModuleType, placed: keras.Model, plan: Mapping[str, str]) -> int:
    checked = 0
    for unit in emitted_units(module, placed, plan):
        for w in getattr(unit.operation, "weights", []):
            planned = plan[unit.name]
            assert ends_with_device(w.value.device, planned), (unit.name, w.path, w.value.device)
            checked += 1
    assert checked == len(placed.weights)
    return checked


def check_ops_placed(
    module: ModuleType, placed: keras.Model, plan: Mapping[str, str], x: Any, training: bool
) -> int:
    """Every op a layer creates in a traced forward pass is on the layer's device."""
    units = emitted_units(module, placed, plan)
    recorder = _CallRecorder(units)

    def forward(*inputs: tf.Tensor) -> Any:
        with recorder.recording(tf.compat.v1.get_default_graph()):
            return placed(rebuild(inputs), training=training)

    flat = tf.nest.flatten(x)

    def rebuild(inputs: tuple[tf.Tensor, ...]) -> Any:
        return tf.nest.pack_sequence_as(x, list(inputs))

    specs = [tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in flat]
    graph = tf.function(forward, autograph=False).get_concrete_function(*specs).graph
    checked = 0
    for pos, op in enumerate(graph.get_operations()):
        owner = recorder.owner_of(pos)
        if owner is None:
            continue
        planned = plan[owner]
        if op.device or op.type in COMPUTE_OPS:
            assert ends_with_device(op.device, planned), (owner, op.name, op.device, planned)
            checked += 1
    return checked


def check_module_imports(source: str) -> None:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {node.module or ""}
        else:
            continue
        assert names <= ALLOWED_IMPORTS, names


def devices_table(source: str) -> dict[str, str]:
    """The DEVICES literal of an emitted module, read without running it."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "DEVICES"
        ]:
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return value
    raise AssertionError("no DEVICES table")


# -- the example models -----------------------------------------------------------------------

CASES = [
    *[(name, 2, "contiguous") for name in EXAMPLE_NAMES],
    *[(name, 4, "round_robin") for name in EXAMPLE_NAMES],
]


@pytest.mark.parametrize(("name", "num_devices", "how"), CASES, ids=[f"{n}-{d}dev-{h}" for n, d, h in CASES])
def test_emitted_module_reproduces_the_example(
    name: str, num_devices: int, how: str, tmp_path: Path
) -> None:
    model = build_example(name)
    plan = ASSIGNMENTS[how](model, num_devices)
    assert len(set(plan.values())) == num_devices
    source, module = emit_and_import(model, plan, tmp_path)
    placed = module.build_model()
    module.load_original_weights(placed, model)
    x = random_input(model, 4, seed=1)
    diff = max_abs_diff(placed(x, training=False), model(x, training=False))
    assert diff <= TOL, f"{name}: max abs diff {diff}"
    check_weights_placed(module, placed, plan)
    assert check_ops_placed(module, placed, plan, x, training=False) >= 2
    check_module_imports(source)
    assert devices_table(source) == plan


def test_weights_are_really_copied(tmp_path: Path) -> None:
    """Without load_original_weights the copy differs: the output check can fail."""
    model = build_example("two_device_dense")
    _, module = emit_and_import(model, contiguous(model, 2), tmp_path)
    placed = module.build_model()
    x = random_input(model, 4)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) > TOL
    module.load_original_weights(placed, model)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) <= TOL


def test_a_saved_keras_file_loads_too(tmp_path: Path) -> None:
    model = build_example("cnn")
    model.save(tmp_path / "original.keras")
    _, module = emit_and_import(model, round_robin(model, 3), tmp_path)
    placed = module.build_model()
    module.load_original_weights(placed, str(tmp_path / "original.keras"))
    x = random_input(model, 2)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) <= TOL


def test_weights_of_another_model_are_refused(tmp_path: Path) -> None:
    _, module = emit_and_import(build_example("cnn"), round_robin(build_example("cnn"), 2), tmp_path)
    placed = module.build_model()
    with pytest.raises(ValueError, match="same model"):
        module.load_original_weights(placed, build_example("mnist_mlp"))


def test_the_module_is_readable(tmp_path: Path) -> None:
    model = build_example("branchy")
    plan = contiguous(model, 2)
    source, _ = emit_and_import(model, plan, tmp_path)
    (add,) = [n for n in plan if n.startswith("add")]  # Keras numbers it: add, add_1, ...
    compile(source, "placed.py", "exec")
    assert source.startswith('"""')
    assert source.count("with tf.device(DEVICES['") == 11  # 10 units, shared_proj called twice
    for line in (
        "import keras",
        "import tensorflow as tf",
        "def build_model() -> keras.Model:",
        "def load_original_weights(",
        "class PlacedModel(keras.Model):",
        "'shared_proj': keras.layers.Dense(name='shared_proj', units=32, activation='tanh'),",
        f"{add} = keras.ops.add(shared_proj, shared_proj_2)",
        f"merge = layers['merge']([shared_proj, shared_proj_2, {add}])",
    ):
        assert line in source, line
    assert ".from_config(" not in source  # every layer of the example is written plainly
    assert max(len(line) for line in source.splitlines()) <= 100


def test_editing_devices_moves_a_layer(tmp_path: Path) -> None:
    model = build_example("mnist_mlp")
    plan = {u.name: device(0) for u in placement_units(model)}
    source = emit_placed_module(model, plan)
    edited = source.replace("'dense_hidden': '/device:CPU:0'", "'dense_hidden': '/device:CPU:3'")
    assert edited != source
    module = import_emitted(write_placed_module(tmp_path / "edited.py", edited))
    placed = module.build_model()
    assert ends_with_device(module.placement_units(placed)["dense_hidden"].kernel.value.device, device(3))
    assert ends_with_device(module.placement_units(placed)["dense_in"].kernel.value.device, device(0))


def test_subclassed_module_imports_the_model_file(tmp_path: Path) -> None:
    model = build_example("subclassed")
    plan = round_robin(model, 4)
    source, module = emit_and_import(model, plan, tmp_path)
    assert module.MODEL_SOURCE == str((EXAMPLES_DIR / "subclassed.py").resolve())
    assert module.MODEL_CLASS == "ResidualMLP"
    assert "object.__setattr__(layer, method, on_device(" in source
    placed = module.build_model()
    assert type(placed).__name__ == "ResidualMLP"


# -- stages -----------------------------------------------------------------------------------


def test_stages_are_listed_and_marked(tmp_path: Path) -> None:
    model = build_example("two_device_dense")
    names = [u.name for u in placement_units(model)]
    stages = [names[:2], names[2:]]
    plan = {n: device(0 if n in stages[0] else 1) for n in names}
    source, module = emit_and_import(model, plan, tmp_path, stages=stages)
    assert module.STAGES == stages
    assert "# -- stage 0: STAGES[0] --" in source and "# -- stage 1: STAGES[1] --" in source
    assert source.index("# -- stage 1") < source.index(f"DEVICES[{names[2]!r}]):\n", source.index("def call"))
    placed = module.build_model()
    module.load_original_weights(placed, model)
    x = random_input(model, 3)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) <= TOL


def hand_plan(model: keras.Model, devices: list[int], pipelined: bool, **device_kw: Any) -> Plan:
    names = [u.name for u in placement_units(model)]
    count = max(devices) + 1
    return Plan(
        model_name=model.name,
        devices=tuple(
            PlanDevice(index=i, device_type="h100", memory_bytes=80 << 30, **device_kw)
            for i in range(count)
        ),
        layer_order=tuple(names),
        device_of_layer=tuple(devices),
        step_time_s=1e-3,
        lower_bound_s=1e-3,
        per_device=(),
        solver=SolverInfo(name="even", status="heuristic", objective=None, solve_time_s=0.0),
        link="pcie",
        batch_size=8,
        pipeline=(
            PipelineInfo(Schedule.ONE_F_ONE_B, num_microbatches=2, stage_devices=(1, 0))
            if pipelined
            else None
        ),
    )


def test_a_pipelined_plan_emits_its_stages(tmp_path: Path) -> None:
    model = build_example("two_device_dense")
    plan = hand_plan(model, [1, 1, 1, 0, 0], pipelined=True)
    source = emit_plan_module(model, plan)
    module = import_emitted(write_placed_module(tmp_path / "from_plan.py", source))
    names = list(plan.layer_order)
    assert module.STAGES == [names[:3], names[3:]]  # stage 0 on plan device 1
    assert module.DEVICES == {n: f"/device:GPU:{d}" for n, d in plan.assignment.items()}
    with_cpus = emit_plan_module(model, plan, devices=[device(2), device(3)])
    module = import_emitted(write_placed_module(tmp_path / "on_cpus.py", with_cpus))
    assert module.DEVICES == {n: device(2 + d) for n, d in plan.assignment.items()}
    placed = module.build_model()
    module.load_original_weights(placed, model)
    x = random_input(model, 2)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) <= TOL
    check_weights_placed(module, placed, module.DEVICES)


def test_plan_device_names_are_used_and_counted() -> None:
    model = build_example("mnist_mlp")
    named = hand_plan(model, [0, 0, 1, 1, 1], pipelined=False, name="/job:worker/device:GPU:0")
    assert plan_device_strings(named) == ("/job:worker/device:GPU:0",) * 2
    assert plan_device_strings(hand_plan(model, [0, 0, 1, 1, 1], pipelined=False)) == (
        "/device:GPU:0",
        "/device:GPU:1",
    )
    with pytest.raises(RewriteError, match="2 devices"):
        plan_device_strings(named, devices=[device(0)])


@pytest.mark.parametrize(
    "stages",
    [
        [["hidden_0", "hidden_1"], ["hidden_2", "hidden_3"]],  # classifier in no stage
        [["hidden_0", "hidden_1", "hidden_2"], ["hidden_2", "hidden_3", "classifier"]],  # twice
        [["hidden_0", "hidden_1", "hidden_2", "hidden_3", "classifier", "nope"]],  # unknown
    ],
)
def test_stages_that_do_not_partition_the_layers_are_refused(stages: list[list[str]]) -> None:
    model = build_example("two_device_dense")
    with pytest.raises(RewriteError, match="stages do not partition"):
        emit_placed_module(model, contiguous(model, 2), stages=stages)


# -- plans that do not fit --------------------------------------------------------------------


def test_plan_missing_a_layer_is_refused() -> None:
    model = build_example("branchy")
    plan = contiguous(model, 2)
    del plan["tower_3x3"]
    with pytest.raises(RewriteError, match="tower_3x3"):
        emit_placed_module(model, plan)


def test_plan_with_an_unknown_layer_is_refused() -> None:
    model = build_example("mnist_mlp")
    with pytest.raises(RewriteError, match="no_such_layer"):
        emit_placed_module(model, {**contiguous(model, 2), "no_such_layer": device(1)})


def test_bad_device_string_is_refused() -> None:
    model = build_example("mnist_mlp")
    plan = {**contiguous(model, 2), "dense_in": '/device:CPU:0"); import os; ("'}
    with pytest.raises(RewriteError, match="dense_in"):
        emit_placed_module(model, plan)


def test_source_that_does_not_compile_is_not_written(tmp_path: Path) -> None:
    target = tmp_path / "placed.py"
    with pytest.raises(RewriteError, match="does not compile"):
        write_placed_module(target, "def build_model(:\n")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


# -- code injection through names -------------------------------------------------------------

EVIL_NAMES = (
    'x"); import os; os.environ.__setitem__("PARTITIONER_PWNED", "1"); ("',
    "y'''\n\"\"\"\nimport os\nos.environ['PARTITIONER_PWNED'] = '1'  # \\",
)


def test_names_cannot_inject_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARTITIONER_PWNED", raising=False)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name='in"put\nimport os')
    h = keras.layers.Dense(4, name=EVIL_NAMES[0])(inputs)
    h = keras.layers.Dense(3, name=EVIL_NAMES[1])(h)
    model = keras.Model(inputs, h, name='model"""; import os #')
    plan = {u.name: device(k) for k, u in enumerate(placement_units(model))}
    assert set(plan) == set(EVIL_NAMES)
    source, module = emit_and_import(model, plan, tmp_path)
    # The names appear only inside string literals: the module imports nothing else and makes
    # no call to os.environ.
    check_module_imports(source)
    tree = ast.parse(source)
    assert not any(
        isinstance(node, ast.Attribute) and node.attr == "environ" for node in ast.walk(tree)
    )
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert set(EVIL_NAMES) <= strings
    placed = module.build_model()
    assert "PARTITIONER_PWNED" not in os.environ
    module.load_original_weights(placed, model)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) <= TOL
    assert module.MODEL_NAME == model.name
    assert devices_table(source) == plan


# -- the awkward cases, from a model file -----------------------------------------------------

TRICKY_MODEL = '''
"""Awkward graph shapes for the code generator."""

import keras


class Scale(keras.layers.Layer):
    """A custom layer (not registered): x * w * factor."""

    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal", name="w")

    def call(self, x):
        return x * self.w * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def block():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu", name="block_dense")(inputs)
    h = keras.layers.BatchNormalization(name="block_bn")(h)
    return keras.Model(inputs, h, name="block")


def build_model():
    a = keras.Input((8,), name="a")
    b = keras.Input((8,), name="b")
    shared = block()
    ha = shared(a, training=False)  # a nested model, shared, once with a fixed training flag
    hb = shared(b)
    both = keras.ops.concatenate([ha, hb], axis=-1)  # keras.ops calls with arguments
    total = keras.ops.sum(both, axis=-1, keepdims=True)
    scaled = Scale(3.0, name="scale")(ha)
    out = keras.layers.Concatenate(name="cat")([scaled, total, hb])
    return keras.Model({"a": a, "b": b}, {"out": out, "total": total}, name="tricky")
'''


@pytest.fixture
def tricky(tmp_path: Path) -> tuple[keras.Model, Path]:
    path = tmp_path / "tricky_model.py"
    path.write_text(textwrap.dedent(TRICKY_MODEL), encoding="utf-8")
    keras.utils.set_random_seed(0)
    return load_model(str(path)), path


@pytest.mark.parametrize("training", [False, True])
def test_tricky_model_file(tricky: tuple[keras.Model, Path], tmp_path: Path, training: bool) -> None:
    model, path = tricky
    # BatchNormalization moving statistics away from their initial values, so inference differs
    # from training mode and from a fresh layer.
    bn = next(u.operation for u in placement_units(model) if u.name == "block_bn")
    bn.moving_mean.assign(np.linspace(-1, 1, 8).astype(np.float32))
    bn.moving_variance.assign(np.linspace(0.5, 2, 8).astype(np.float32))
    plan = round_robin(model, 4)
    source, module = emit_and_import(model, plan, tmp_path, model_source=path)
    assert module.MODEL_SOURCE == str(path.resolve())
    assert "model_source().Scale(name='scale', factor=3.0)" in source
    assert "keras.src.ops.numpy.Concatenate(" in source
    placed = module.build_model()
    module.load_original_weights(placed, model)
    rng = np.random.default_rng(0)
    x = {k: rng.standard_normal((4, 8)).astype(np.float32) for k in ("a", "b")}
    expected = model(x, training=training)
    actual = placed(x, training=training)
    assert set(actual) == {"out", "total"}
    diff = max(max_abs_diff(actual[k], expected[k]) for k in ("out", "total"))
    assert diff <= TOL, diff
    check_weights_placed(module, placed, plan)
    assert check_ops_placed(module, placed, plan, x, training=training) >= 2


def test_subclassed_model_inside_a_functional_model_is_refused(
    tricky: tuple[keras.Model, Path],
) -> None:
    from example_models import load_example

    inner = load_example("subclassed").ResidualMLP(hidden=8, num_classes=3)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, inner(inputs), name="outer")
    with pytest.raises(RewriteError, match=r"subclassed keras\.Model inside a functional"):
        emit_placed_module(model, contiguous(model, 2))


def test_text_model_with_masks_and_two_outputs(tmp_path: Path) -> None:
    """int inputs, a mask made by a keras.ops node, an LSTM, a layer with two outputs."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(50, 8, mask_zero=True, name="emb")(tokens)
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm")(h)
    h, scores = keras.layers.MultiHeadAttention(2, 4, name="mha")(h, h, return_attention_scores=True)
    pooled = keras.layers.GlobalAveragePooling1D(name="gap")(h)
    model = keras.Model(tokens, [pooled, scores], name="text")
    plan = round_robin(model, 3)
    source, module = emit_and_import(model, plan, tmp_path)
    assert "mha_0, mha_1 = keras.tree.flatten(" in source
    placed = module.build_model()
    module.load_original_weights(placed, model)
    x = np.random.default_rng(0).integers(1, 50, (3, 6)).astype(np.int32)
    x[:, -2:] = 0  # padding, masked
    diff = max_abs_diff(placed(x, training=False), model(x, training=False))
    assert diff <= TOL, diff
    check_weights_placed(module, placed, plan)
    assert check_ops_placed(module, placed, plan, x, training=False) >= 2


SEQ2SEQ_MODEL = '''
import keras
import numpy as np


def encoded(layers, tokens):
    """A decoder LSTM whose initial state and input (with its mask) come from layers that the
    test puts on another device."""
    src, enc, tgt, dec, head = layers
    _, h, c = enc(src(tokens))
    return head(dec(tgt(tokens), initial_state=[h, c]))


def seq2seq_layers():
    return [
        keras.layers.Embedding(50, 8, mask_zero=True, name="src"),
        keras.layers.LSTM(8, return_state=True, name="enc"),
        keras.layers.Embedding(50, 8, mask_zero=True, name="tgt"),
        keras.layers.LSTM(8, name="dec"),
        keras.layers.Dense(3, name="head"),
    ]


class Seq2Seq(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.parts = seq2seq_layers()

    def call(self, tokens):
        return encoded(self.parts, tokens)


def build_model(subclassed=False):
    if subclassed:
        model = Seq2Seq(name="seq2seq")
        model(np.zeros((1, 6), dtype=np.int32))
        return model
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    return keras.Model(tokens, encoded(seq2seq_layers(), tokens), name="seq2seq")
'''


@pytest.mark.parametrize("subclassed", [False, True], ids=["functional", "subclassed"])
def test_inputs_from_another_device_are_copied_before_a_loop_reads_them(
    tmp_path: Path, subclassed: bool
) -> None:
    """The decoder's ``While`` on device 1 reads only tensors made on device 1; outputs equal.

    Its initial state (from the encoder) and its input and mask (from an embedding) are made on
    device 0: without the emitted ``received`` the loop read them from there, which TensorFlow
    does on every step (tests/passes/test_device_placement.py checks the rewrite the same way).
    """
    path = tmp_path / "seq2seq_model.py"
    path.write_text(SEQ2SEQ_MODEL, encoding="utf-8")
    keras.utils.set_random_seed(0)
    model = import_emitted(path).build_model(subclassed)
    plan = {u.name: device(int(u.name in {"dec", "head"})) for u in placement_units(model)}
    source, module = emit_and_import(model, plan, tmp_path, model_source=path, input_shape=(6,))
    check_module_imports(source)
    placed = module.build_model()
    module.load_original_weights(placed, model)
    x = np.array([[3, 4, 5, 0, 0, 0], [7, 1, 2, 9, 4, 0]], dtype=np.int32)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) <= TOL
    forward = tf.function(lambda t: placed(t, training=False), autograph=False)
    graph = forward.get_concrete_function(tf.TensorSpec(x.shape, tf.int32)).graph
    check_loops_read_only_their_device(graph, device(1))


def test_sequential_built_without_input_with_a_nested_sequential(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    inner = keras.Sequential(
        [keras.layers.Dense(4, name="inner_1"), keras.layers.Dense(4, name="inner_2")], name="inner"
    )
    model = keras.Sequential(
        [keras.layers.Dense(5, name="first"), inner, keras.layers.Dense(2, name="last")], name="seq"
    )
    model.build((None, 3))
    plan = contiguous(model, 4)
    _, module = emit_and_import(model, plan, tmp_path)
    placed = module.build_model()
    module.load_original_weights(placed, model)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    assert max_abs_diff(placed(x, training=False), model(x, training=False)) <= TOL
    check_weights_placed(module, placed, plan)


def test_sequential_without_an_input_shape_is_refused() -> None:
    model = keras.Sequential([keras.layers.Dense(2, name="only")])
    with pytest.raises(RewriteError, match="no input shape yet"):
        emit_placed_module(model, {"only": device(0)})


# -- ResNet50 ---------------------------------------------------------------------------------


def check_resnet(model: keras.Model, x: np.ndarray, num_devices: int, tmp_path: Path) -> None:
    plan = contiguous(model, num_devices)
    source, module = emit_and_import(model, plan, tmp_path)
    placed = module.build_model()
    module.load_original_weights(placed, model)
    diff = max_abs_diff(placed(x, training=False), model(x, training=False))
    assert diff <= TOL, f"ResNet50: max abs diff {diff}"
    assert check_weights_placed(module, placed, plan) == len(model.weights)
    assert ".from_config(" not in source
    assert source.count("with tf.device(DEVICES['") == len(plan)


def test_resnet50_small(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    x = np.random.default_rng(0).random((2, 64, 64, 3)).astype(np.float32)
    check_resnet(model, x, 4, tmp_path)


def test_resnet50_example(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    model = load_model(str(EXAMPLES_DIR / "resnet50.py"))
    x = np.random.default_rng(0).random((2, 224, 224, 3)).astype(np.float32)
    check_resnet(model, x, 2, tmp_path)
