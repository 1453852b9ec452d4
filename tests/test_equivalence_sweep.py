"""Equivalence sweep: the rewrites of every zoo family and example compute what the original does.

Every model of ``tests/sweep_models.py`` (the five examples in ``examples/``; the zoo's BERT-like
and GPT-2-like Transformers, LSTM encoder-decoder and multi-tower MLP at tiny sizes; MobileNetV2,
ResNet50, InceptionV3 and DenseNet121 from keras.applications at small inputs, marked slow; the
convolutional models run in float64, see ``tests/sweep_models.py`` for why) is rewritten with a
contiguous layer -> device split over the logical CPU devices that tests/conftest.py configures:

* placed (``passes.rewrite.device_placement.place_model``) on 2 and on 4 devices;
* pipelined (``passes.rewrite.pipeline.pipeline_model``) on 2 devices with M = 2 (GPipe) and M = 4 (1F1B)
  micro-batches and on 4 devices with M = 2 (GPipe) and M = 4 (1F1B). The Transformers and the
  LSTM (large graphs per micro-batch) get 2 devices M = 2 and 4 devices M = 4; the
  keras.applications CNNs get one pipelined setting each and ResNet50 one placed setting too
  (``HEAVY_SETTINGS``: the placed rewrite of MobileNetV2, InceptionV3 and DenseNet is checked by
  ``tests/real_models``, which places each on 4 devices and compares outputs, gradients and
  weights after a step).

Each case checks, for one batch of ``BATCH`` samples and an MSE loss on random targets:

1. inference outputs (``training=False``) equal the original's;
2. one training step with the same SGD optimizer (momentum 0.9) compiled the same way: the copy
   runs its own ``train_step`` (what ``fit`` and ``train_on_batch`` run: ``tf.gradients`` for a
   ``PlacedModel``, ``pipeline_gradients`` for a ``PipelinedModel``) traced into one
   ``tf.function``; the gradients it hands its optimizer, its training-mode outputs and its loss
   equal the reference's;
3. after that step every weight (trainable, and BatchNormalization's moving statistics) equals
   the reference's.

The reference is the original model stepped by Keras's own ``train_on_batch`` (eager) on the
whole batch, except where micro-batching is not exact by design:

* BatchNormalization (cnn and the keras.applications CNNs), pipelined with M micro-batches: each
  micro-batch is normalised with its own statistics. The reference is then the original on the
  same M micro-batches (gradients of the 1/M-weighted losses summed, one SGD update, moving
  statistics updated M times in order), and the case asserts that the pipelined model's
  ``warnings`` say BatchNormalization and name its layers. The placed model is compared with
  the whole batch (exact).
* Dropout (mnist_mlp): masks are random, so training is compared on a twin whose Dropout rates are
  0 (same weights; at inference Dropout is the identity anyway).
  ``test_pipelining_dropout_warns_and_names_the_layers`` asserts that pipelining the original
  warns about its Dropout layers.

Tolerances (``TOLERANCE``: 1e-5 for float32 models, 1e-9 for the float64 convolutional models): outputs
``max |a - e| <= tol * max(1, max |e|)``; gradients, weight updates and moving statistics:
relative error (2-norm) ``<= tol`` over all variables and per variable, where a variable whose
exact value is zero (a convolution's bias before BatchNormalization, a moving mean after a
bias-free convolution of normalised activations) is held to 1e-3 of the whole norm, and a weight
update may also differ by the rounding of the new weight (one ulp); the loss to float32 precision
(Keras's loss tracker is a float32 mean).

Also: the subclassed example cannot be pipelined (its ``call`` cannot be split), asserted as a
clean ``RewriteError``; models that are exact under micro-batching must not warn; and cases that
go through the planner (``partitioner.partition`` then ``Plan.apply``) instead of a hand-made
split. (An LSTM without dropout
draws no random masks and must not warn either.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import pytest
import sweep_models
import tensorflow as tf

import partitioner
from partitioner.core.errors import RewriteError
from partitioner.core.ir import Schedule
from passes.rewrite.device_placement import PlacedModel, place_model
from passes.rewrite.pipeline import PipelinedModel, pipeline_model
from passes.trace import placement_units

BATCH = 4
TOLERANCE = {"float32": 1e-5, "float64": 1e-9}
"""Output (max abs, scaled) and relative (2-norm) tolerance by the model's float type."""
ZERO_GRADIENT_FLOOR = 1e-3
LEARNING_RATE = 0.1
CPU = tuple(f"/device:CPU:{i}" for i in range(4))

BATCH_NORM_MODELS = frozenset({"cnn", "mobilenet_v2", "resnet50", "inception_v3", "densenet121"})
DROPOUT_MODELS = frozenset({"mnist_mlp"})


@dataclass(frozen=True)
class Setting:
    """One rewrite of a model: placed (``num_microbatches`` None) or pipelined."""

    num_devices: int
    num_microbatches: int | None = None
    schedule: Schedule = Schedule.ONE_F_ONE_B

    @property
    def label(self) -> str:
        if self.num_microbatches is None:
            return f"placed-{self.num_devices}dev"
        return f"pipelined-{self.num_devices}dev-M{self.num_microbatches}-{self.schedule.value}"


PLACED = (Setting(2), Setting(4))
PIPELINED = (
    Setting(2, 2, Schedule.GPIPE),
    Setting(2, 4, Schedule.ONE_F_ONE_B),
    Setting(4, 2, Schedule.GPIPE),
    Setting(4, 4, Schedule.ONE_F_ONE_B),
)
LARGE_GRAPH_PIPELINED = (Setting(2, 2, Schedule.GPIPE), Setting(4, 4, Schedule.ONE_F_ONE_B))
LARGE_GRAPH_MODELS = frozenset({"bert_tiny", "gpt2_tiny", "lstm_nmt_tiny"})
HEAVY_SETTINGS = {
    # one pipelined setting each (2 and 4 devices, M = 2 and 4, both schedules); one placed
    # setting for ResNet50. Placed MobileNetV2, InceptionV3 and DenseNet (4 devices) are cases of
    # tests/real_models (the same check through partition() and Plan.apply), not repeated here.
    "mobilenet_v2": (Setting(4, 4, Schedule.ONE_F_ONE_B),),
    "resnet50": (Setting(2), Setting(4, 2, Schedule.GPIPE)),
    "inception_v3": (Setting(2, 2, Schedule.ONE_F_ONE_B),),
    "densenet121": (Setting(2, 2, Schedule.GPIPE),),
}


def _settings(entry: sweep_models.SweepModel) -> tuple[Setting, ...]:
    if entry.name == "subclassed":
        return PLACED
    if entry.heavy:
        return HEAVY_SETTINGS[entry.name]
    if entry.name in LARGE_GRAPH_MODELS:
        return PLACED + LARGE_GRAPH_PIPELINED
    return PLACED + PIPELINED


CASES = [
    pytest.param(
        entry.name,
        setting,
        id=f"{entry.name}-{setting.label}",
        marks=[pytest.mark.slow] if entry.heavy else [],
    )
    for entry in sweep_models.SWEEP_MODELS
    for setting in _settings(entry)
]


# -- helpers ----------------------------------------------------------------------------------


def contiguous_split(model: keras.Model, num_devices: int) -> dict[str, str]:
    """Consecutive placement units in ``num_devices`` nearly equal runs; the units of one nested
    model stay together (a pipeline stage cannot split a nested model)."""
    blocks: list[list[str]] = []
    block_keys: list[object] = []
    for k, unit in enumerate(placement_units(model)):
        key: object = unit.path[1] if len(unit.path) > 1 else k
        if block_keys and block_keys[-1] == key:
            blocks[-1].append(unit.name)
        else:
            blocks.append([unit.name])
            block_keys.append(key)
    assert len(blocks) >= num_devices, f"{model.name}: {len(blocks)} blocks for {num_devices}"
    return {
        name: CPU[k * num_devices // len(blocks)]
        for k, block in enumerate(blocks)
        for name in block
    }


def without_dropout(model: keras.Model) -> keras.Model:
    """A twin of a graph ``model`` whose Dropout layers drop nothing, holding the same weights."""

    def clone(layer: Any) -> Any:
        config = layer.get_config()
        if isinstance(layer, keras.layers.Dropout):
            config = {**config, "rate": 0.0}
        return layer.__class__.from_config(config)

    twin = keras.models.clone_model(model, clone_function=clone)
    twin.set_weights(model.get_weights())
    return twin


def one_or_list(arrays: Sequence[Any]) -> Any:
    return arrays[0] if len(arrays) == 1 else list(arrays)


def microbatches(arrays: Sequence[np.ndarray], m: int) -> list[list[np.ndarray]]:
    return [[np.split(a, m)[k] for a in arrays] for k in range(m)]


def paired_weights(model: keras.Model, copy: PlacedModel) -> list[tuple[Any, Any]]:
    """(original variable, copy's variable) for every weight, matched unit by unit."""
    pairs: list[tuple[Any, Any]] = []
    for o, c in zip(placement_units(model), placement_units(copy.inner), strict=True):
        pairs += list(
            zip(
                getattr(o.operation, "weights", []),
                getattr(c.operation, "weights", []),
                strict=True,
            )
        )
    assert len(pairs) == len(model.weights) == len(copy.weights)
    return pairs


def max_abs_diff(actual: Any, expected: Any, what: str, tol: float) -> float:
    """Asserts the output tolerance and returns the scaled difference."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = max(1.0, float(np.max(np.abs(expected))))
    diff = float(np.max(np.abs(actual - expected))) / scale
    assert diff <= tol, f"{what}: max abs diff {diff * scale} (scale {scale})"
    return diff


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = float(np.linalg.norm(expected))
    diff = float(np.linalg.norm(actual - expected))
    return diff / scale if scale > 0 else diff


def check_relative(
    names: Sequence[str],
    actual: Sequence[np.ndarray],
    expected: Sequence[np.ndarray],
    what: str,
    tol: float,
    slack: Sequence[float] | None = None,
) -> float:
    """Relative errors (2-norm) <= ``tol`` over all variables and per variable (a variable whose
    exact value is zero is held to ZERO_GRADIENT_FLOOR of the whole norm; ``slack[k]`` is an
    absolute allowance for variable k, such as float32 rounding). Returns the worst error."""
    whole_expected = np.concatenate([np.ravel(e) for e in expected])
    whole_diff = np.concatenate([np.ravel(a - e) for a, e in zip(actual, expected, strict=True)])
    total_norm = float(np.linalg.norm(whole_expected))
    assert total_norm > 0, f"{what}: all zero"
    slacks = list(slack) if slack is not None else [0.0] * len(names)
    whole_slack = float(np.linalg.norm(slacks))
    whole = max(0.0, float(np.linalg.norm(whole_diff)) - whole_slack) / total_norm
    assert whole <= tol, f"{what}: relative error {whole} over all variables"
    worst = whole
    for name, a, e, allowed in zip(names, actual, expected, slacks, strict=True):
        scale = max(float(np.linalg.norm(e)), ZERO_GRADIENT_FLOOR * total_norm)
        err = max(0.0, float(np.linalg.norm(a - e)) - allowed) / scale
        assert err <= tol, f"{what} of {name}: relative error {err}"
        worst = max(worst, err)
    return worst


def compile_sgd(model: keras.Model, run_eagerly: bool = False) -> None:
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=LEARNING_RATE, momentum=0.9),
        loss="mse",
        run_eagerly=run_eagerly,
    )


@dataclass(frozen=True)
class StepResult:
    """What one training step computed: the loss, the training outputs, each gradient."""

    loss: float
    y_pred: np.ndarray
    gradients: dict[int, np.ndarray]
    """id(variable) -> its gradient."""


@contextlib.contextmanager
def spying(model: keras.Model) -> Iterator[dict[str, Any]]:
    """Record what ``model.train_step`` hands its optimizer and its metrics: the gradients with
    their variables, and the training outputs (as the step made them: graph tensors inside a
    ``tf.function``, values when eager)."""
    seen: dict[str, Any] = {}
    optimizer = model.optimizer
    apply_gradients = optimizer.apply_gradients
    compute_metrics = model.compute_metrics

    def spy_apply(grads_and_vars: Any) -> Any:
        pairs = list(grads_and_vars)
        seen["gradients"] = [g for g, _ in pairs]
        seen["variables"] = [v for _, v in pairs]
        return apply_gradients(pairs)

    def spy_metrics(x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        seen["y_pred"] = y_pred
        return compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    object.__setattr__(optimizer, "apply_gradients", spy_apply)
    object.__setattr__(model, "compute_metrics", spy_metrics)
    try:
        yield seen
    finally:
        object.__delattr__(optimizer, "apply_gradients")
        object.__delattr__(model, "compute_metrics")


def dense(gradient: Any) -> np.ndarray:
    return np.asarray(tf.convert_to_tensor(gradient))


def reference_step(
    model: keras.Model, xs: Sequence[np.ndarray], y: np.ndarray, m: int
) -> StepResult:
    """One SGD step of the original, compiled eagerly: Keras's own ``train_on_batch`` on the
    whole batch (m = 1), or its math on ``m`` micro-batches (losses weighted 1/m, gradients
    summed, one update)."""
    if m == 1:
        with spying(model) as seen:
            loss = model.train_on_batch(one_or_list(xs), y, return_dict=True)["loss"]
        return StepResult(
            float(loss),
            np.asarray(seen["y_pred"]),
            {id(v): dense(g) for g, v in zip(seen["gradients"], seen["variables"], strict=True)},
        )
    loss_total = 0.0
    outputs = []
    grads: list[np.ndarray] | None = None
    for x_m, (y_m,) in zip(microbatches(xs, m), microbatches([y], m), strict=True):
        with tf.GradientTape() as tape:
            y_pred = model(one_or_list(x_m), training=True)
            loss = model.compute_loss(x=one_or_list(x_m), y=y_m, y_pred=y_pred, training=True)
            loss = loss / m
        g = [dense(t) for t in tape.gradient(loss, model.trainable_weights)]
        grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
        loss_total += float(loss)
        outputs.append(np.asarray(y_pred))
    assert grads is not None
    model.optimizer.apply_gradients(zip(grads, model.trainable_weights))
    return StepResult(
        loss_total,
        np.concatenate(outputs),
        {id(v): g for v, g in zip(model.trainable_weights, grads, strict=True)},
    )


def copy_step(copy: PlacedModel, xs: Sequence[np.ndarray], y: np.ndarray) -> StepResult:
    """One SGD step of the copy through its own ``train_step`` (what ``fit`` and
    ``train_on_batch`` run), traced once into a ``tf.function``."""
    copy.optimizer.build(copy.trainable_variables)  # no variables created while tracing
    with spying(copy) as seen:

        @tf.function(autograph=False)
        def step(x: Any, y: Any) -> Any:
            logs = copy.train_step((x, y))
            return (
                logs["loss"],
                seen["y_pred"],
                [tf.convert_to_tensor(g) for g in seen["gradients"]],
            )

        loss, y_pred, grads = step(one_or_list([tf.constant(a) for a in xs]), tf.constant(y))
    return StepResult(
        float(loss),
        np.asarray(y_pred),
        {id(v): np.asarray(g) for g, v in zip(grads, seen["variables"], strict=True)},
    )


@dataclass(frozen=True)
class Measured:
    """The worst differences one case saw (scaled as the tolerances are)."""

    inference_output: float
    training_output: float
    gradient: float
    update: float


def check_equivalence(
    model: keras.Model, copy: PlacedModel, xs: Sequence[np.ndarray], reference_m: int
) -> Measured:
    """The checks of the module docstring; ``reference_m`` micro-batches for the reference."""
    tol = TOLERANCE[model.dtype_policy.variable_dtype]
    pairs = paired_weights(model, copy)
    x = one_or_list(xs)
    expected = model(x, training=False)
    inference = max_abs_diff(copy(x, training=False), expected, "inference output", tol)
    y = np.random.default_rng(1).standard_normal(np.shape(expected)).astype(np.float32)
    y = y.astype(np.asarray(expected).dtype)

    compile_sgd(model, run_eagerly=True)
    compile_sgd(copy)
    before = [np.array(o.numpy()) for o, _ in pairs]
    want = reference_step(model, xs, y, reference_m)
    got = copy_step(copy, xs, y)

    # the loss comes from Keras's loss tracker, a float32 Mean whatever the model's float type
    loss_tol = max(tol, float(np.finfo(np.float32).eps))
    assert abs(got.loss - want.loss) <= loss_tol * abs(want.loss), (got.loss, want.loss)
    training = max_abs_diff(got.y_pred, want.y_pred, "training output", tol)
    trainable = [(o, c) for o, c in pairs if id(o) in want.gradients]
    assert len(trainable) == len(model.trainable_weights) == len(got.gradients)
    names = [o.path for o, _ in trainable]
    gradient = check_relative(
        names,
        [got.gradients[id(c)] for _, c in trainable],
        [want.gradients[id(o)] for o, _ in trainable],
        "gradient",
        tol,
    )

    steps_got, steps_want, rounding = [], [], []
    stats_got, stats_want, stats_names = [], [], []
    for (o, c), start in zip(pairs, before, strict=True):
        now_want, now_got = np.asarray(o.numpy()), np.asarray(c.numpy())
        if id(o) in want.gradients:
            steps_got.append(now_got - start)
            steps_want.append(now_want - start)
            # w + step is rounded to the weight's float type: half an ulp of it each
            rounding.append(float(np.linalg.norm(np.spacing(np.abs(now_want)))))
        else:  # BatchNormalization's moving statistics
            stats_got.append(now_got)
            stats_want.append(now_want)
            stats_names.append(o.path)
    update = check_relative(names, steps_got, steps_want, "SGD update", tol, rounding)
    if stats_names:
        # a moving mean whose exact value is zero (after a normalised, bias-free layer) is
        # rounding noise: held to ZERO_GRADIENT_FLOOR of all the statistics' norm
        stats = check_relative(stats_names, stats_got, stats_want, "moving statistics", tol)
        update = max(update, stats)
    return Measured(inference, training, gradient, update)


def rewrite(model: keras.Model, setting: Setting, sample: Sequence[np.ndarray]) -> PlacedModel:
    plan = contiguous_split(model, setting.num_devices)
    if setting.num_microbatches is None:
        return place_model(model, plan, sample)
    return pipeline_model(
        model,
        plan,
        num_microbatches=setting.num_microbatches,
        schedule=setting.schedule,
        sample_inputs=sample,
    )


def batch_norm_layers(model: keras.Model) -> list[str]:
    return [
        layer.name
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


# -- the sweep --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "setting"), CASES)
def test_rewrite_is_equivalent(
    name: str, setting: Setting, record_property: Callable[[str, object], None]
) -> None:
    with sweep_models.dtype_policy(sweep_models.sweep_model(name).dtype):
        model = sweep_models.build(name)
        if name in DROPOUT_MODELS:
            model = without_dropout(model)
        xs = sweep_models.random_inputs(model, BATCH)
        copy = rewrite(model, setting, [a[:1] for a in xs])
        reference_m = 1
        if setting.num_microbatches is not None:
            assert isinstance(copy, PipelinedModel)
            assert len(copy.stage_devices) == setting.num_devices
            assert copy.num_microbatches == setting.num_microbatches
            if name in BATCH_NORM_MODELS:
                warned = " ".join(copy.warnings)
                assert "BatchNormalization" in warned, copy.warnings
                named = [n for n in batch_norm_layers(model) if n in warned]
                assert named, f"no BatchNormalization layer named in {copy.warnings}"
                reference_m = setting.num_microbatches
            else:
                assert not any("BatchNormalization" in line for line in copy.warnings)
        measured = check_equivalence(model, copy, xs, reference_m)
    for field, value in vars(measured).items():
        record_property(field, value)


EXACT_UNDER_MICROBATCHES = [
    entry.name
    for entry in sweep_models.SWEEP_MODELS
    if not entry.heavy and entry.name not in BATCH_NORM_MODELS | DROPOUT_MODELS | {"subclassed"}
]


@pytest.mark.parametrize("name", EXACT_UNDER_MICROBATCHES)
def test_exact_models_get_no_exactness_warning(name: str) -> None:
    """Models without batch statistics or randomness pipeline exactly (the sweep shows it), so
    their pipelined copies must not warn that they are not exact."""
    model = sweep_models.build(name)
    xs = sweep_models.random_inputs(model, BATCH)
    copy = rewrite(model, Setting(2, 2), [a[:1] for a in xs])
    assert isinstance(copy, PipelinedModel)
    assert copy.warnings == ()


def test_pipelining_dropout_warns_and_names_the_layers() -> None:
    model = sweep_models.build("mnist_mlp")
    xs = sweep_models.random_inputs(model, BATCH)
    copy = rewrite(model, Setting(2, 2), [a[:1] for a in xs])
    assert isinstance(copy, PipelinedModel)
    (line,) = copy.warnings
    assert "dropout_in" in line and "dropout_hidden" in line, line
    # at inference Dropout is the identity: the copy still computes the original's outputs
    expected = model(xs[0], training=False)
    max_abs_diff(copy(xs[0], training=False), expected, "inference output", TOLERANCE["float32"])


def test_subclassed_model_is_refused_for_pipelining() -> None:
    model = sweep_models.build("subclassed")
    xs = sweep_models.random_inputs(model, BATCH)
    with pytest.raises(RewriteError, match="subclassed"):
        rewrite(model, Setting(2, 2), [a[:1] for a in xs])


# -- through the planner ----------------------------------------------------------------------


PLANNER_CASES = [
    pytest.param("bert_tiny", 2, 2, id="bert_tiny-dp-2gpus-M2"),
    pytest.param("two_device_dense", 4, 4, id="two_device_dense-dp-4gpus-M4"),
    pytest.param("multi_tower_tiny", 4, None, id="multi_tower_tiny-metis-4gpus"),
    pytest.param("gpt2_tiny", 2, 2, id="gpt2_tiny-dp-2gpus-M2"),
    pytest.param("cnn", 2, 2, id="cnn-dp-2gpus-M2"),
]


@pytest.mark.parametrize(("name", "gpus", "num_microbatches"), PLANNER_CASES)
def test_planned_rewrite_is_equivalent(name: str, gpus: int, num_microbatches: int | None) -> None:
    with sweep_models.dtype_policy(sweep_models.sweep_model(name).dtype):
        check_planned(name, gpus, num_microbatches)


def check_planned(name: str, gpus: int, num_microbatches: int | None) -> None:
    model = sweep_models.build(name)
    pipelined = num_microbatches is not None
    plan = partitioner.partition(
        model,
        gpus=gpus,
        batch_size=BATCH,
        solver="dp" if pipelined else "metis",
        pipeline=pipelined,
        num_microbatches=num_microbatches,
        schedule="1f1b",
    )
    assert len(set(plan.assignment.values())) >= 2, plan.assignment
    copy = plan.apply(model, devices=list(CPU[:gpus]))
    if pipelined:
        assert isinstance(copy, PipelinedModel) and copy.num_microbatches == num_microbatches
    else:
        assert isinstance(copy, PlacedModel) and not isinstance(copy, PipelinedModel)
    reference_m = 1
    if pipelined and name in BATCH_NORM_MODELS:
        assert any("BatchNormalization" in w for w in plan.warnings), plan.warnings
        assert num_microbatches is not None
        reference_m = num_microbatches
    xs = sweep_models.random_inputs(model, BATCH)
    check_equivalence(model, copy, xs, reference_m)
