"""Hostile input III (issue 34), campaign 34y (round 25): the defects found, each at its
mechanism. Most are in data parallelism, of a model placed in place (issue 36) and of the
copies: what Keras's optimizers do per replica that one device does on the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import RewriteError
from passes.rewrite.in_place import replicate_in_place

REPO = Path(__file__).resolve().parents[1]
DEVICES = [f"/device:CPU:{i}" for i in range(4)]
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 6)).astype("float32")
Y = RNG.normal(size=(8, 1)).astype("float32") * 3


class OwnStep(keras.Model):
    """A model class with its own ``train_step``: placed in place."""

    def train_step(self, data: Any) -> Any:
        return super().train_step(data)


def _model(cls: type = OwnStep) -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(1)(hidden))  # type: ignore[no-any-return]


def _same_weights(a: keras.Model, b: keras.Model) -> None:
    for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "clip", [{"clipnorm": 0.05}, {"clipvalue": 0.02}, {"global_clipnorm": 0.05}], ids=str
)
def test_gradients_are_clipped_after_the_replicas_all_reduce(clip: dict[str, float]) -> None:
    """34y b (D1): Keras clips each replica's share before its all-reduce; one device clips the
    whole batch's gradient. The weights after a step differed (relative 0.8-3.2), in place and
    in the copies, without a word. Both clip the all-reduced gradient now."""
    reference, model = _model(), _model()
    for made in (reference, model):
        made.compile(optimizer=keras.optimizers.SGD(0.1, **clip), loss="mse")
    replicate_in_place(model, DEVICES)
    plain = _model(keras.Model)  # copied: a ReplicatedModel under MirroredStrategy
    plain.compile(optimizer=keras.optimizers.SGD(0.1, **clip), loss="mse")
    plan = partitioner.partition(plain, gpus=4, batch_size=8, strategy="data_parallel")
    copy = plan.apply(plain, devices=DEVICES)
    copy.compile(optimizer=keras.optimizers.SGD(0.1, **clip), loss="mse")
    for made in (reference, model, copy):
        made.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
    _same_weights(reference, model)
    _same_weights(reference, copy)


class HeldInAList(keras.Model):
    """A GAN-style model keeping its optimizers in a list attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.opts = [keras.optimizers.SGD(0.1)]

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.opts[0].apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_an_optimizer_held_in_a_list_averages_its_replicas_gradients() -> None:
    """34y b (D2): only optimizers directly in the model's attributes were found; one in a list
    summed its 4 replicas' gradients (4x the step), without a word."""

    def build() -> keras.Model:
        keras.utils.set_random_seed(1)
        made = HeldInAList()
        made(X[:1])
        made.compile()
        return made

    reference, model = build(), build()
    replicate_in_place(model, DEVICES)
    for made in (reference, model):
        made.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
    _same_weights(reference, model)


@pytest.mark.parametrize("option", [{"use_ema": True}, {"gradient_accumulation_steps": 2}], ids=str)
def test_an_optimizer_keras_cannot_run_in_replicas_is_one_line(option: dict[str, Any]) -> None:
    """34y b (D4): an optimizer with an exponential moving average or gradient accumulation
    failed the first step with TensorFlow's "merge_call called while defining a new graph"
    traceback. Refused in one line, naming the option, before anything changes."""
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.1, **option), loss="mse")
    with pytest.raises(RewriteError) as info:
        replicate_in_place(model, DEVICES)
    message = str(info.value)
    assert "\n" not in message and next(iter(option)) in message
    assert "strategy='placed'" in message
    copy_of = _model(keras.Model)
    copy_of.compile(optimizer=keras.optimizers.SGD(0.1, **option), loss="mse")
    plan = partitioner.partition(copy_of, gpus=2, batch_size=8, strategy="data_parallel")
    with pytest.raises(RewriteError, match=next(iter(option))):
        plan.apply(copy_of, devices=DEVICES[:2])  # the copies, compiled as the original


# -- the program --emit writes for a model placed in place -------------------------------------

OWN_STEP_FILE = """
import keras
import tensorflow as tf


class M(keras.Model):
    def train_step(self, data):
        import helper  # imported when training only
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss, "h": helper.VALUE}


def build_model():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="d1")(inputs)
    return M(inputs, keras.layers.Dense(1, name="d2")(hidden), name="m")
"""

LAZY_BUILDER_FILE = """
import keras


def build_model():
    import customlayers  # the builder's own import, from its directory
    inputs = keras.Input((8,))
    hidden = customlayers.Scale(2.0)(keras.layers.Dense(16, name="d1")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1, name="d2")(hidden), name="m")
"""

SCALE = """
import keras


class Scale(keras.layers.Layer):  # no get_config: the model is placed in place
    def __init__(self, k):
        super().__init__()
        self.k = k

    def call(self, x):
        return x * self.k
"""

RUN_EMITTED = """
import sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
import placed
model = placed.build_model()
print("built", model.name, [layer.name for layer in model.layers])
"""


def _run(tmp_path: Path, cwd: Path, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARTITIONER_CACHE_DIR": str(tmp_path / "c")}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600,
        check=False,
    )  # fmt: skip


PLAN = ("-m", "partitioner", "--gpus", "2", "--device-type", "cpu", "--batch-size", "8")


@pytest.mark.slow
def test_emit_is_refused_over_a_module_the_models_own_step_imports(tmp_path: Path) -> None:
    """34y a (D1): ``--emit helper.py`` replaced the user's ``helper.py``, which the model's
    ``train_step`` imports when it trains (no run imports it while planning), and the emitted
    program then failed in training. The model file's source names it: refused, kept."""
    (tmp_path / "gan.py").write_text(OWN_STEP_FILE)
    (tmp_path / "helper.py").write_text("VALUE = 42  # precious\n")
    done = _run(tmp_path, tmp_path, *PLAN[:2], "gan.py", *PLAN[2:], "--emit", "helper.py")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "helper.py" in done.stderr and "is not a file partitioner wrote" in done.stderr
    assert (tmp_path / "helper.py").read_text() == "VALUE = 42  # precious\n"


@pytest.mark.slow
def test_the_emitted_program_runs_the_planned_files(tmp_path: Path) -> None:
    """34y a (D2, D3, D4): the emitted program of a model placed in place (1) ran a builder's
    lazy ``import customlayers`` from wherever it was run, another file's code, without a
    word; (2) imported the file a link on the model's path led to once the model's code had
    re-pointed it; (3) could not import the file a ``.py`` link led to ("not a Python
    file"). It runs the files the plan was made from."""
    model_dir, elsewhere = tmp_path / "t2", tmp_path / "t3"
    model_dir.mkdir()
    elsewhere.mkdir()
    (model_dir / "v1").mkdir()
    (model_dir / "v1" / "model.py").write_text(
        "import os\n"
        f"os.remove({str(model_dir / 'cur')!r})\n"  # a release switch, while the run plans
        f"os.symlink('v2', {str(model_dir / 'cur')!r})\n" + LAZY_BUILDER_FILE
    )
    (model_dir / "v2").mkdir()
    (model_dir / "v2" / "model.py").write_text("print('V2 CODE RAN')\n" + LAZY_BUILDER_FILE)
    for folder in (model_dir / "v1", model_dir / "v2"):
        (folder / "customlayers.py").write_text(SCALE)
    (model_dir / "cur").symlink_to("v1")
    (elsewhere / "customlayers.py").write_text("print('WRONG CUSTOMLAYERS RAN')\n" + SCALE)
    (elsewhere / "run.py").write_text(RUN_EMITTED)
    target = elsewhere / "placed.py"
    done = _run(
        tmp_path, model_dir, *PLAN[:2], "cur/model.py", *PLAN[2:], "--strategy", "placed",
        "--emit", str(target),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"MODEL_SOURCE = {str(model_dir / 'v1' / 'model.py')!r}" in target.read_text()
    ran = _run(tmp_path, elsewhere, "run.py")
    assert ran.returncode == 0, ran.stderr
    assert "built m" in ran.stdout and "WRONG" not in ran.stdout and "V2" not in ran.stdout
    (model_dir / "ganmodel").write_text(OWN_STEP_FILE)  # a .py link to a file without .py
    (model_dir / "link.py").symlink_to("ganmodel")
    (model_dir / "helper.py").write_text("VALUE = 1\n")
    done = _run(
        tmp_path, model_dir, *PLAN[:2], "link.py", *PLAN[2:], "--strategy", "data-parallel",
        "--emit", str(target),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ran = _run(tmp_path, elsewhere, "run.py")
    assert ran.returncode == 0 and "built m" in ran.stdout, ran.stderr


def test_a_masked_loss_under_replicas_is_named_not_exact() -> None:
    """34y b (D3): a padded sequence model (an Embedding with mask_zero) trained on 4 replicas
    reported a first loss of 1.409 for one device's 1.123, its weights off by 0.1, without a
    word: Keras averages a masked loss over each share's own unmasked steps. Plans that split
    its batch say so in a NOT EXACT warning, as for BatchNormalization."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(20, 4, mask_zero=True, name="tokens")(inputs)
    hidden = keras.layers.LSTM(3, return_sequences=True)(embedded)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    plan = partitioner.partition(model, gpus=4, batch_size=8, strategy="data_parallel")
    warned = [w for w in plan.warnings if w.startswith("NOT EXACT: Embedding (tokens)")]
    assert len(warned) == 1 and "unmasked steps" in warned[0], plan.warnings
    unmasked = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(3)(inputs)))
    plan = partitioner.partition(unmasked, gpus=4, batch_size=8, strategy="data_parallel")
    assert not [w for w in plan.warnings if "unmasked steps" in w]


def test_a_step_set_on_the_model_object_or_a_compile_of_its_class_is_kept() -> None:
    """34y c (D4): a ``train_step`` set on the model object (``types.MethodType``), or a class
    whose ``compile`` forces its loss, was copied and trained with partitioner's step and the
    user's compile arguments: other weights after one step, without a word. Such a model is
    placed in place, its methods kept."""
    import types

    def l1_step(self: keras.Model, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.abs(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"l1": loss}

    class MAEModel(keras.Model):
        def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
            super().compile(*args, **{**kwargs, "loss": "mae"})

    def on_object() -> keras.Model:
        made = _model(keras.Model)
        made.train_step = types.MethodType(l1_step, made)
        return made

    for build in (on_object, lambda: _model(MAEModel)):
        reference, model = build(), build()
        plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="placed")
        assert plan.apply(model, devices=DEVICES[:2]) is model  # in place: its own methods
        for made in (reference, model):
            made.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            made.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
        _same_weights(reference, model)


def test_a_model_built_in_a_strategys_scope_is_refused_at_apply_in_one_line() -> None:
    """34y c (D6): a model built inside the user's own MirroredStrategy scope was planned and
    applied, then its first ``fit`` failed with TensorFlow's "Mixing different
    tf.distribute.Strategy objects" (data parallel) or a bare AssertionError (placed)."""
    strategy = tf.distribute.MirroredStrategy(
        DEVICES[2:], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = _model()
    for asked in ("data_parallel", "placed"):
        plan = partitioner.partition(model, gpus=2, batch_size=8, strategy=asked)
        with pytest.raises(RewriteError) as info:
            plan.apply(model, devices=DEVICES[:2])
        assert "\n" not in str(info.value) and "built inside a tf.distribute" in str(info.value)


@pytest.mark.slow
def test_the_emitted_program_makes_the_model_the_command_line_planned(tmp_path: Path) -> None:
    """34y c (D2): the emitted program of a model placed in place chose its builder by other
    rules than the command line (a ``build_model = None`` placeholder called; a private
    ``_teacher`` model counted): it failed or could make another model. It calls what the
    command line used (``MODEL_ATTR``). (D3): a data-parallel plan for a cluster's tasks wrote a
    program for this process's devices that could not run: refused, nothing written."""
    (tmp_path / "gan.py").write_text(OWN_STEP_FILE)
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    (tmp_path / "nb.py").write_text(
        "from gan import build_model as make\nbuild_model = None\ndef create_model():\n"
        "    return make()\n"
    )
    (tmp_path / "priv.py").write_text("from gan import build_model\nmodel = build_model()\n"
                                      "_teacher = build_model()\ndel build_model\n")  # fmt: skip
    (tmp_path / "run.py").write_text(RUN_EMITTED)
    for name, attr in (("nb", "create_model"), ("priv", "model")):
        done = _run(
            tmp_path, tmp_path, *PLAN[:2], f"{name}.py", *PLAN[2:], "--strategy",
            "data-parallel", "--emit", "placed.py",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"MODEL_ATTR: str | None = {attr!r}" in (tmp_path / "placed.py").read_text()
        ran = _run(tmp_path, tmp_path, "run.py")
        assert ran.returncode == 0 and "built m" in ran.stdout, ran.stderr
    (tmp_path / "placed.py").unlink()
    config = '{"cluster": {"worker": ["localhost:23451", "localhost:23452"]}, "task": {"type": "worker", "index": 0}}'
    refused = subprocess.run(
        [sys.executable, *PLAN[:2], "gan.py", "--topology", "tf-config", "--device-type", "cpu",
         "--batch-size", "8", "--strategy", "data-parallel", "--emit", "placed.py"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO), "TF_CONFIG": config,
             "PARTITIONER_CACHE_DIR": str(tmp_path / "c")},
    )  # fmt: skip
    lines = refused.stderr.strip().splitlines()  # the plan's NOT EXACT warning, then the error
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "placed in place on the devices of the process" in lines[-1]
    assert not (tmp_path / "placed.py").exists()


# -- campaign 34z ------------------------------------------------------------------------------

LAZY_MODULE_STEP = """
import importlib
import keras


class M(keras.Model):
    def train_step(self, data):
        {import_line}
        return super().train_step(data)


def build_model():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="d1")(inputs)
    return M(inputs, keras.layers.Dense(2, name="d2")(hidden), name="own")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("import_line", "target"),
    [
        ("import sub.helper", "sub/helper.py"),
        ('helper = importlib.import_module("helper")', "helper.py"),
        ("from lib import f", "helper2.py"),
    ],
    ids=["dotted", "import-module", "through-a-sibling"],
)
def test_emit_is_refused_over_a_module_imported_lazily_however_spelled(
    tmp_path: Path, import_line: str, target: str
) -> None:
    """34z a (D1): row 218 saw only ``import x`` in the model file itself; ``import sub.helper``,
    ``importlib.import_module("helper")`` and a sibling module's own lazy import were replaced
    by the emitted program, exit 0. Every module the model's files name is kept."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "model.py").write_text(LAZY_MODULE_STEP.format(import_line=import_line))
    (tmp_path / "lib.py").write_text("def f():\n    import helper2\n    return helper2\n")
    for name in ("sub/helper.py", "helper.py", "helper2.py"):
        (tmp_path / name).write_text("VALUE = 1  # precious\n")
    done = _run(tmp_path, tmp_path, *PLAN[:2], "model.py", *PLAN[2:], "--emit", target)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    refusals = ("is not a file partitioner wrote", "is named like the module")  # rows 234, 251
    assert any(r in done.stderr for r in refusals), done.stderr  # before the model runs
    assert (tmp_path / target).read_text() == "VALUE = 1  # precious\n"


class InBatchNegatives(keras.Model):
    """keras.io's SimCLR-style step: each sample's negatives are the batch's other samples."""

    def train_step(self, data: Any) -> Any:
        a, b = data
        with tf.GradientTape() as tape:
            za = keras.ops.normalize(self(a, training=True), axis=1)
            zb = keras.ops.normalize(self(b, training=True), axis=1)
            logits = keras.ops.matmul(za, keras.ops.transpose(zb)) / 0.1
            labels = keras.ops.arange(keras.ops.shape(za)[0])
            loss = keras.ops.mean(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def test_a_models_own_loss_step_under_replicas_is_named_not_exact() -> None:
    """34z c (D1): a contrastive model's own step, run on 2 replicas, sees half the negatives:
    weights off by 50-100% after one step, and ``auto`` chose it without a word. A plan that
    splits the batch of a model computing its loss in its own step says NOT EXACT, naming it."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    model = InBatchNegatives(inputs, keras.layers.Dense(4)(keras.layers.Dense(8)(inputs)))
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="data_parallel")
    warned = [w for w in plan.warnings if w.startswith("NOT EXACT: InBatchNegatives")]
    assert len(warned) == 1 and "in-batch negatives" in warned[0], plan.warnings
    placed = partitioner.partition(model, gpus=2, batch_size=8, strategy="placed")
    assert not [w for w in placed.warnings if "in-batch negatives" in w]  # whole batches: exact


def test_predict_on_batch_of_replicas_gives_one_row_per_sample() -> None:
    """34z b (D1): ``predict_on_batch`` of a model replicated (in place, or the copy) gave every
    replica the whole batch and returned 4 times the rows, without a word."""
    reference, model = _model(), _model()
    replicate_in_place(model, DEVICES)
    plain = _model(keras.Model)
    plan = partitioner.partition(plain, gpus=4, batch_size=8, strategy="data_parallel")
    copy = plan.apply(plain, devices=DEVICES)
    want = reference.predict_on_batch(X)
    for made in (model, copy):
        np.testing.assert_allclose(made.predict_on_batch(X), want, rtol=1e-5, atol=1e-6)
