"""Issue 17's real-model suite: every model of ``tests/real_models/zoo.py`` through the planner.

For each model and setting (``placed``: ``strategy="placed"`` on 2 devices; ``auto``: the default
strategy on 4 devices; ``pipeline``: ``pipeline=True`` on 2 devices, for chains), the case
passes in exactly one of two ways:

* **it works end to end**: ``partitioner.partition`` plans it, ``plan.apply`` places it on the
  logical CPUs of tests/conftest.py, and on one batch the copy's inference outputs (same
  structure: a dict stays a dict) equal the original's, and one ``fit`` step of the copy (SGD,
  learning rate 0.1, no momentum) moves every weight as Keras's own ``train_on_batch`` of the
  original does: the update is ``-0.1 x gradient``, so equal updates are equal gradients, held to
  ``TOLERANCE`` relative (2-norm, over all variables and per variable, less the rounding of the new
  weight), and the losses agree; BatchNormalization's moving statistics too when the copy runs the
  whole batch at once. Where the plan micro-batches or replicates (R x M pieces), the reference is
  the original on R x M slices of the batch (gradients of the 1/(R x M)-weighted losses summed):
  BatchNormalization normalises each piece by its own statistics, by design;
* **it is placed in place** (a model the copying rewrites cannot take: its own ``train_step``,
  layers that cannot be rebuilt; :mod:`passes.rewrite.in_place`): ``plan.apply`` returns the model
  itself, and the same checks hold against the model built again from the same seed;
* **it is refused at plan time** with a ``PartitionError`` whose message is one line (a known
  limitation, issue 17's groups: dict inputs, custom ``train_step``, layers that cannot be
  rebuilt, op-less layers).

Anything else fails: an exception of another type, a multi-line message, an error at apply or in
``fit``, unequal outputs or gradients. Each case writes its outcome (``applies``, ``pipelines``,
``refused`` with the message, or ``fails`` with the one-line cause) to ``RESULTS_DIR``;
``python -m tests.real_models.table`` turns them into the README's table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import PartitionError

from . import zoo

TOLERANCE = 1e-5
ZERO_FLOOR = 1e-3
"""A variable whose exact update is zero is held to this fraction of the whole update's norm."""
LEARNING_RATE = 0.1
CPU = tuple(f"/device:CPU:{i}" for i in range(4))
RESULTS_DIR = Path(
    os.environ.get(
        "PARTITIONER_REAL_MODELS_RESULTS",
        Path(tempfile.gettempdir()) / "partitioner-real-models",
    )
)
KERAS_HUB = '"keras-hub==0.32.0"'
"""The version tested (README, Quick start; .ci/run)."""
FAST = frozenset({"custom_layer_config", "subclassed", "mnist_convnet", "gpt2", "multi_io"})
"""Cheap cases kept in the fast set (their ``placed`` setting; ones that pass, so the edit-test
loop stays green); every other case is slow."""


@dataclass(frozen=True)
class Setting:
    label: str
    gpus: int
    strategy: str | None = None
    pipeline: bool = False

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"gpus": self.gpus}
        if self.strategy is not None:
            kw["strategy"] = self.strategy
        if self.pipeline:
            kw["pipeline"] = True
            kw["num_microbatches"] = 2
        return kw


PLACED = Setting("placed-2gpus", 2, strategy="placed")
PLACED_4 = Setting("placed-4gpus", 4, strategy="placed")
AUTO = Setting("auto-4gpus", 4)
PIPELINE = Setting("pipeline-2gpus", 2, pipeline=True)
DATA_PARALLEL = Setting("data-parallel-4gpus", 4, strategy="data_parallel")
SETTINGS = {s.label: s for s in (PLACED, PLACED_4, AUTO, PIPELINE, DATA_PARALLEL)}

IN_PLACE = frozenset(
    {"llama", "vit", "custom_layer_no_config", "text_transformer", "vae", "gan", "shared_branches"}
)
"""Issue 36's kinds (layers that cannot be rebuilt, a model's own ``train_step``, a training
branch with a shared layer and ``add_loss``): planned data parallel on 4 devices too."""


FOUR_ONLY = frozenset(
    {"mobilenet_v3_small", "densenet_small", "efficientnet_small", "efficientnet_v2_small"}
)
"""CNNs of a hundred layers or more: placed on 4 devices only (the setting that cuts them most),
to keep the suite short; their families' default plans are covered by resnet_small, vgg16 and
convnext_small."""
NO_AUTO = frozenset({"mobilenet"})
"""Chains pipelined on 2 devices instead of the default 4-device plan (a 4-way micro-batched
MobileNet normalises one sample of a 1x1 map)."""


def settings_of(case: zoo.Case) -> tuple[Setting, ...]:
    """Placed on 2 devices and the default strategy on 4 (pipelined too if a chain); a heavy
    case (hundreds of layers) is placed on 4 devices only, to keep the suite short."""
    if case.heavy or case.name in FOUR_ONLY:
        return (PLACED_4,)
    if case.name == "resnet_v2_small":
        return (PLACED, PLACED_4)
    auto = () if case.name in NO_AUTO else (AUTO,)
    replicas = (DATA_PARALLEL,) if case.name in IN_PLACE else ()
    return (PLACED, *auto, *((PIPELINE,) if case.chain else ()), *replicas)


def _cases() -> list[Any]:
    params = []
    for case in zoo.CASES:
        for setting in settings_of(case):
            fast = case.name in FAST and setting is PLACED
            params.append(
                pytest.param(
                    case.name,
                    setting.label,
                    id=f"{case.name}-{setting.label}",
                    marks=[] if fast else [pytest.mark.slow],
                )
            )
    return params


# -- outcomes ----------------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    more = f" [a {len(lines)}-line message]" if len(lines) > 1 else ""
    return f"{type(error).__name__}: {lines[0].strip() if lines else ''}"[:300] + more


def record(name: str, label: str, outcome: str, detail: str, seconds: float) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    entry = {
        "name": name,
        "source": zoo.BY_NAME[name].source,
        "setting": label,
        "outcome": outcome,
        "detail": detail,
        "seconds": round(seconds, 1),
    }
    (RESULTS_DIR / f"{name}--{label}.json").write_text(json.dumps(entry, indent=1) + "\n")


# -- the comparison ----------------------------------------------------------------------------


def loss_for(y: Any) -> Any:
    if isinstance(y, dict):
        return {k: "mse" for k in y}
    if isinstance(y, (list, tuple)):
        return ["mse"] * len(y)
    return "mse"


def compile_sgd(model: keras.Model, y: Any, run_eagerly: bool = False) -> None:
    optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
    if isinstance(model, zoo.GAN):  # its own compile: two optimizers and a loss
        model.compile(
            d_optimizer=optimizer,
            g_optimizer=keras.optimizers.SGD(learning_rate=LEARNING_RATE),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
            run_eagerly=run_eagerly,
        )
    elif y is None:  # the model's own train_step computes its loss
        model.compile(optimizer=optimizer, run_eagerly=run_eagerly)
    else:
        model.compile(optimizer=optimizer, loss=loss_for(y), run_eagerly=run_eagerly)


def pieces_of(plan: Any) -> int:
    """How many slices of the batch the copy computes its gradients on (replicas x micro-batches)."""
    strategy = getattr(plan, "strategy", None)
    replicas = strategy.replicas if strategy is not None else 1
    pipeline = getattr(plan, "pipeline", None)
    microbatches = pipeline.num_microbatches if pipeline is not None else 1
    if strategy is not None and strategy.num_microbatches:
        microbatches = max(microbatches, strategy.num_microbatches)
    return max(1, replicas * microbatches)


def has_batch_statistics(model: keras.Model) -> bool:
    return any(
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in model._flatten_layers(include_self=False, recursive=True)
    )


def compare_outputs(actual: Any, expected: Any) -> None:
    keras.tree.assert_same_structure(actual, expected)
    for a, e in zip(keras.tree.flatten(actual), keras.tree.flatten(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"output shape {a.shape} != {e.shape}"
        scale = max(1.0, float(np.max(np.abs(e))))
        diff = float(np.max(np.abs(a - e))) / scale
        assert diff <= TOLERANCE, f"inference outputs differ by {diff:.3g} (scaled)"


def check_relative(
    what: str,
    names: Sequence[str],
    actual: Sequence[np.ndarray],
    expected: Sequence[np.ndarray],
    slack: Sequence[float],
) -> None:
    total = float(np.linalg.norm(np.concatenate([np.ravel(e) for e in expected])))
    assert total > 0, f"{what}: all zero"
    diff = np.concatenate([np.ravel(a - e) for a, e in zip(actual, expected, strict=True)])
    whole = max(0.0, float(np.linalg.norm(diff)) - float(np.linalg.norm(slack))) / total
    assert whole <= TOLERANCE, f"{what}: relative error {whole:.3g} over all variables"
    for name, a, e, allowed in zip(names, actual, expected, slack, strict=True):
        scale = max(float(np.linalg.norm(e)), ZERO_FLOOR * total)
        err = max(0.0, float(np.linalg.norm(a - e)) - allowed) / scale
        assert err <= TOLERANCE, f"{what} of {name}: relative error {err:.3g}"


def slices(x: Any, m: int) -> list[Any]:
    return [keras.tree.map_structure(lambda a, k=k: np.split(a, m)[k], x) for k in range(m)]


def reference_step(model: keras.Model, x: Any, y: Any, m: int) -> float:
    """One SGD step of the original: Keras's own ``train_on_batch`` on the whole batch (m = 1),
    or its math on m slices (losses weighted 1/m, gradients summed, one update)."""
    if m == 1 or y is None:
        logs = model.train_on_batch(x, y, return_dict=True)
        return float(logs["loss"])
    total, grads = 0.0, None
    for x_k, y_k in zip(slices(x, m), slices(y, m), strict=True):
        with tf.GradientTape() as tape:
            y_pred = model(x_k, training=True)
            loss = model.compute_loss(x=x_k, y=y_k, y_pred=y_pred, training=True) / m
        g = [tf.convert_to_tensor(t) for t in tape.gradient(loss, model.trainable_weights)]
        grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
        total += float(loss)
    assert grads is not None
    model.optimizer.apply_gradients(zip(grads, model.trainable_weights))
    return total


def own_step_on_slices(model: keras.Model, x: Any, y: Any, m: int) -> float:
    """The model's own ``train_step`` on m slices of the batch, as m replicas run it: each
    slice's gradients recorded (its optimizer's ``apply`` deferred), their mean applied once;
    the loss its metrics give after the m slices. For a model with one optimizer whose step
    draws random numbers (a VAE): each replica draws for its share, as each slice does here."""
    optimizer = model.optimizer
    recorded: list[tuple[list[Any], list[Any]]] = []

    def record(grads: Any, variables: Any = None) -> None:
        recorded.append(([tf.convert_to_tensor(g) for g in grads], list(variables)))

    optimizer.apply = record  # type: ignore[method-assign]
    try:
        for k in range(m):
            data = slices(x, m)[k] if y is None else (slices(x, m)[k], slices(y, m)[k])
            logs = model.train_step(keras.tree.map_structure(tf.convert_to_tensor, data))
    finally:
        del optimizer.apply
    variables = recorded[0][1]
    mean = [sum(g[i] for g, _ in recorded) / m for i in range(len(variables))]
    optimizer.apply(mean, variables)
    return float(logs["loss"])


def paired(model: keras.Model, copy: Any) -> list[tuple[Any, Any]]:
    """(original variable, copy's variable), by path (by order when the paths differ)."""
    originals, copies = list(model.weights), list(copy.weights)
    assert len(originals) == len(copies), f"{len(copies)} weights in the copy, {len(originals)}"
    by_path = {v.path: v for v in copies}
    if len(by_path) == len(copies) and all(v.path in by_path for v in originals):
        return [(v, by_path[v.path]) for v in originals]
    return list(zip(originals, copies, strict=True))


def check_equivalence(
    model: keras.Model,
    copy: Any,
    x: Any,
    y: Any,
    m: int,
    own_fit: bool = False,
    draws_in: int = 1,
) -> None:
    """``own_fit``: the reference trains by ``fit`` too (a model with its own ``train_step``
    takes its data as ``fit`` gives it; ``train_on_batch`` adds the empty targets), or, when its
    step draws random numbers and the copy runs ``draws_in`` > 1 replicas, by
    :func:`own_step_on_slices`."""
    compare_outputs(copy(x, training=False), model(x, training=False))
    pairs = paired(model, copy)
    before = [(np.array(o.numpy()), np.array(c.numpy())) for o, c in pairs]
    for (o, _), (b_o, b_c) in zip(pairs, before, strict=True):
        np.testing.assert_array_equal(b_c, b_o, err_msg=f"{o.path} before the step")
    compile_sgd(model, y, run_eagerly=True)
    compile_sgd(copy, y)
    if own_fit and draws_in > 1:
        want_loss = own_step_on_slices(model, x, y, draws_in)
    elif own_fit:
        fitted = model.fit(x, y, batch_size=zoo.BATCH, epochs=1, shuffle=False, verbose=0)
        want_loss = float(fitted.history["loss"][0])
    else:
        want_loss = reference_step(model, x, y, m)
    history = copy.fit(x, y, batch_size=zoo.BATCH, epochs=1, shuffle=False, verbose=0)
    got_loss = float(history.history["loss"][0])
    assert abs(got_loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (got_loss, want_loss)
    trainable = {id(v) for v in model.trainable_weights}
    names, got, want, rounding = [], [], [], []
    stats_names, stats_got, stats_want = [], [], []
    for (o, c), (b_o, b_c) in zip(pairs, before, strict=True):
        now_o, now_c = np.asarray(o.numpy()), np.asarray(c.numpy())
        if id(o) in trainable:
            names.append(o.path)
            got.append(now_c - b_c)
            want.append(now_o - b_o)
            rounding.append(float(np.linalg.norm(np.spacing(np.abs(now_o)))))
        elif m == 1 and now_o.dtype.kind == "f":  # moving statistics
            stats_names.append(o.path)
            stats_got.append(now_c)
            stats_want.append(now_o)
    check_relative("gradient (SGD update / learning rate)", names, got, want, rounding)
    if stats_names:
        check_relative("moving statistics", stats_names, stats_got, stats_want, [0.0] * len(stats_names))


# -- the suite ---------------------------------------------------------------------------------


def run_case(name: str, label: str) -> tuple[str, str]:
    """Plans, applies and checks one case; returns (outcome, detail) or raises."""
    case, setting = zoo.BY_NAME[name], SETTINGS[label]
    with zoo.dtype_policy(case.dtype):
        model, x, y = _stage("build", lambda: zoo.build(name))
        try:
            plan = partitioner.partition(
                model,
                batch_size=zoo.BATCH,
                input_shape=case.input_shape,
                time_limit_s=1.0,
                **setting.kwargs(),
            )
        except PartitionError as error:
            message = str(error).strip()
            assert "\n" not in message, f"a multi-line refusal at plan time: {message!r}"
            return "refused", f"{type(error).__name__}: {message}"
        copy = _stage("apply", lambda: plan.apply(model, devices=list(CPU[: setting.gpus])))
        pieces = pieces_of(plan)
        m = pieces if pieces > 1 and has_batch_statistics(model) else 1
        if copy is model:  # placed in place: the reference is the same model built again
            reference, _, _ = zoo.build(name)
            draws_in = pieces if case.draws else 1
            _stage(
                "check",
                lambda: check_equivalence(reference, copy, x, y, m, own_fit=True, draws_in=draws_in),
            )
            return "in place", f"{type(copy).__name__} itself, {pieces} piece(s)"
        _stage("check", lambda: check_equivalence(model, copy, x, y, m))
        outcome = "pipelines" if getattr(plan, "pipeline", None) is not None else "applies"
        return outcome, f"{type(copy).__name__}, {pieces} piece(s)"


class StageError(Exception):
    """An error after planning, labelled with the stage it happened in."""


def _stage(stage: str, fn: Any) -> Any:
    try:
        return fn()
    except Exception as error:
        raise StageError(f"at {stage}: {first_line(error)}") from error


@pytest.mark.parametrize(("name", "label"), _cases())
def test_real_model(name: str, label: str) -> None:
    if zoo.BY_NAME[name].source.startswith("keras_hub") and not importlib.util.find_spec(
        "keras_hub"
    ):
        pytest.skip(f"keras-hub is not installed: python -m pip install --no-deps {KERAS_HUB}")
    start = time.perf_counter()
    try:
        outcome, detail = run_case(name, label)
    except BaseException as error:
        cause = str(error) if isinstance(error, StageError) else f"at plan: {first_line(error)}"
        record(name, label, "fails", cause, time.perf_counter() - start)
        raise
    record(name, label, outcome, detail, time.perf_counter() - start)


def test_the_readme_table_lists_every_architecture() -> None:
    """The README's "Real models" table (python -m tests.real_models.table) has a row per case."""
    from .table import BEGIN, END, README

    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "no real-models block in the README"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    missing = [case.name for case in zoo.CASES if f"| {case.name} |" not in block]
    assert not missing, f"run python -m tests.real_models.table; not in the table: {missing}"
