"""Hostile input III (issue 34), campaign 34aa (round 27) and what 34z left: an optimizer the
model does not hold under data parallelism in place, compiled metrics made outside the
strategy's scope, a plan saved into a cache a ``cache_dir=`` made, a data file the model's own
step opens named by ``--emit``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import PartitionError, RewriteError
from partitioner.core.files import marked, written_by_partitioner
from passes import trace_cache
from passes.rewrite.in_place import replicate_in_place
from tests.test_campaign_rerun_xiv import PLAN, OwnStep, _run

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 6)).astype("float32")
Y = RNG.integers(0, 3, size=(8,))

_OPTIMIZERS: dict[str, Any] = {}
"""A module's own table of optimizers, as a script keeps them: what the step below uses."""


class GlobalOptimizer(keras.Model):
    """A step applying an optimizer the model does not hold (a module's global)."""

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, self(x)))
        grads = tape.gradient(loss, self.trainable_weights)
        _OPTIMIZERS["sgd"].apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class OwnMetricsStep(keras.Model):
    """keras.io's "customizing what happens in fit": the step updates ``self.metrics`` itself."""

    def train_step(self, data: Any) -> Any:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight)
        return {m.name: m.result() for m in self.metrics}


def _model(cls: type) -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(3, activation="softmax")(hidden))  # type: ignore[no-any-return]


def test_an_optimizer_the_model_does_not_hold_is_refused_in_one_line() -> None:
    """34z b: the step applied an optimizer kept in a module's table; its all-reduce summed the
    four replicas' gradients (4 times the step), without a word. Refused at the first step, in
    one line, the weights untouched."""
    _OPTIMIZERS["sgd"] = keras.optimizers.SGD(0.1)
    model = _model(GlobalOptimizer)
    model.compile()
    replicate_in_place(model, DEVICES)
    before = model.get_weights()
    with pytest.raises(RewriteError, match="outside the model's optimizers") as raised:
        model.fit(X, Y, batch_size=8, verbose=0)
    assert "\n" not in str(raised.value) and "self.optimizer" in str(raised.value)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_same_optimizer_held_by_the_model_trains_as_one_device() -> None:
    """The fix the message asks for: the optimizer held by the model averages."""
    reference, model = _model(GlobalOptimizer), _model(GlobalOptimizer)
    for made, replicate in ((reference, False), (model, True)):
        _OPTIMIZERS["sgd"] = made.held = keras.optimizers.SGD(0.1)
        made.compile()
        if replicate:
            replicate_in_place(made, DEVICES)
        made.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("evaluated_first", [False, True])
def test_compiled_metrics_of_an_own_step_report_the_whole_batch(evaluated_first: bool) -> None:
    """34aa b (D1): a metric object made before ``compile`` (outside the strategy's scope) and
    built by ``fit``'s first build kept one variable that the four replicas updated and read
    in turn: ``fit``'s history showed a share's value (cross-entropy 1.13 for 1.31, an accuracy
    of 0.52 on 8 samples), the weights right. The history equals the unreplicated model's."""
    made = []
    for replicate in (False, True):
        model = _model(OwnMetricsStep)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss="sparse_categorical_crossentropy",
            metrics=[keras.metrics.SparseCategoricalCrossentropy(name="xent"), "accuracy"],
        )
        if evaluated_first:
            model.evaluate(X, Y, batch_size=8, verbose=0)
        if replicate:
            replicate_in_place(model, DEVICES)
        made.append(model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False).history)
    reference, replicated = made
    assert set(reference) == set(replicated) == {"loss", "xent", "accuracy"}
    for name, values in reference.items():
        np.testing.assert_allclose(replicated[name], values, rtol=1e-5, err_msg=name)


def test_a_plan_in_a_cache_dir_s_folder_is_kept_unless_named_like_an_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """34z a: ``Plan.save`` refused the default cache's folders only. In the folders of a
    ``cache_dir=`` given to ``partition()``, a run replaces or removes only files named like
    its entries (a SHA-256 key): a plan saved there under its own name outlives the next runs;
    a name like an entry's is refused, in any folder named like a cache's."""
    monkeypatch.setattr(trace_cache, "MAX_TRACE_CACHE_BYTES", 1)  # every run evicts
    monkeypatch.setattr(trace_cache, "MIN_CACHED_TRACE_S", 0.0)  # this small trace cached too
    cache = tmp_path / "mycache"
    model = _model(keras.Model)
    plan = partitioner.partition(model, gpus=2, batch_size=8, cache_dir=cache, trace_cache=True)
    kept = plan.save(cache / "traces" / "plan.json").read_text()
    for gpus in (2, 4):  # the same key replaced, another written, both evicted
        partitioner.partition(model, gpus=gpus, batch_size=8, cache_dir=cache, trace_cache=True)
    assert (cache / "traces" / "plan.json").read_text() == kept
    (tmp_path / "layers").mkdir()
    for folder in (cache / "traces", tmp_path / "layers"):
        target = folder / f"{'ab' * 32}.json"
        with pytest.raises(PartitionError, match="named like a cache entry"):
            plan.save(target)
        assert not target.exists()


OPENS_IN_STEP = """
import keras
import tensorflow as tf


class M(keras.Model):
    def train_step(self, data):
        with open("labels.txt") as f:  # read when training only
            scale = float(len(f.read().split()))
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2) * scale
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def build_model():
    inputs = keras.Input((8,))
    return M(inputs, keras.layers.Dense(1, name="d")(inputs), name="m")
"""


@pytest.mark.slow
def test_emit_is_refused_over_a_file_the_models_own_step_opens(tmp_path: Path) -> None:
    """34z a: ``--emit labels.txt`` replaced the text file the model's ``train_step`` opens
    (no run opens it while planning); the emitted program then failed in training. The model's
    files name it: refused in one line, the file kept."""
    (tmp_path / "m.py").write_text(OPENS_IN_STEP)
    (tmp_path / "labels.txt").write_text("cat dog\n")
    done = _run(tmp_path, tmp_path, *PLAN[:2], "m.py", *PLAN[2:], "--emit", "labels.txt")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "labels.txt" in done.stderr and "is not a file partitioner wrote" in done.stderr
    assert (tmp_path / "labels.txt").read_text() == "cat dog\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "c") == ["labels.txt", "m.py"]


def _project_with_passes(folder: Path) -> Path:
    """A user's project holding its own package ``passes`` (a name partitioner's has)."""
    (folder / "passes").mkdir(parents=True)
    (folder / "passes" / "__init__.py").write_text("")
    (folder / "passes" / "mylayers.py").write_text(
        "import keras\nclass Twice(keras.layers.Layer):\n    def call(self, x):\n"
        "        return 2 * x\n"
    )
    (folder / "model.py").write_text(
        "import keras\nfrom passes.mylayers import Twice\ndef build_model():\n"
        "    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), Twice()])\n"
    )
    return folder


def test_a_projects_own_passes_hiding_partitioners_is_one_line(tmp_path: Path) -> None:
    """34aa c (D1): ``python -m partitioner`` run in a project holding its own ``passes``
    package (the working directory first on ``sys.path``) failed with a traceback inside
    partitioner (``No module named 'passes.backend'``); a program importing partitioner there
    (an emitted one) failed the same way, or ran the user's modules as partitioner's. One line
    naming the package that hides partitioner's, nothing written."""
    project = _project_with_passes(tmp_path / "proj")
    done = _run(tmp_path, project, *PLAN[:2], "model.py", *PLAN[2:], "--out", "p.json")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"'passes' is hidden by {project / 'passes'}" in done.stderr
    assert sorted(p.name for p in project.iterdir()) == ["model.py", "passes"]
    imported = _run(tmp_path, project, "-c", "import partitioner")
    assert imported.returncode == 1
    assert (
        imported.stderr.strip()
        .splitlines()[-1]
        .startswith("ImportError: partitioner's package 'passes' is hidden by")
    )


@pytest.mark.slow
def test_a_model_importing_its_own_dotted_passes_is_named(tmp_path: Path) -> None:
    """34aa c (D1): planned from elsewhere, the model's ``from passes.mylayers import Twice``
    found partitioner's ``passes`` and failed as ``No module named 'passes.mylayers'``,
    blaming the model's file (row 210 named ``from passes import block`` only)."""
    _project_with_passes(tmp_path / "proj")
    done = _run(tmp_path, tmp_path, *PLAN[:2], "proj/model.py", *PLAN[2:], "--out", "p.json")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "its own package 'passes'" in done.stderr and "rename the model's package" in done.stderr
    assert not (tmp_path / "p.json").exists()


def _regression(cls: type) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = cls(inputs, keras.layers.Dense(3)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss="mse",
        metrics=[keras.metrics.RootMeanSquaredError(), keras.metrics.R2Score(), "mae"],
    )
    return model  # type: ignore[no-any-return]


class OwnSteps(OwnMetricsStep):
    """keras.io's own ``test_step`` beside its ``train_step``: results of ``self.metrics``."""

    def test_step(self, data: Any) -> Any:
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(self.compute_loss(y=y, y_pred=y_pred))
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _metric_logs(model: keras.Model, x: Any, y: Any) -> list[dict[str, float]]:
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    return [
        {k: v[-1] for k, v in history.items()},
        model.train_on_batch(x, y, return_dict=True),
        model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True),
    ]


@pytest.mark.parametrize("how", ["in place, own steps", "in place", "copies"])
def test_metrics_of_replicas_are_the_whole_batchs(how: str) -> None:
    """34ab b (D1, D2): a metric that is no mean of its shares' values (RMSE, R2) was reported
    as the mean of the replicas' results: ``train_on_batch`` (in place and in the copies, two
    different wrong values), and ``fit``'s history and ``evaluate`` of a model whose own steps
    return ``self.metrics``' results. Read across the replicas, they equal one device's."""
    rows = np.random.default_rng(1)
    x = rows.normal(size=(16, 6)).astype("float32")
    y = rows.normal(size=(16, 3)).astype("float32")
    cls = OwnSteps if how == "in place, own steps" else keras.Model
    reference, model = _regression(cls), _regression(cls)
    if how == "copies":
        plan = partitioner.partition(model, gpus=4, batch_size=16, strategy="data_parallel")
        model = plan.apply(model, devices=DEVICES)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss="mse",
            metrics=[keras.metrics.RootMeanSquaredError(), keras.metrics.R2Score(), "mae"],
        )
    else:
        replicate_in_place(model, DEVICES)
    for want, got in zip(_metric_logs(reference, x, y), _metric_logs(model, x, y), strict=True):
        assert set(got) == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)


JOINS_IN_STEP = """
import os
import keras

HERE = os.path.dirname(os.path.abspath(__file__))
USAGE = "partition m.py --gpus 2 --emit data/placed.py"  # names the program's file


class M(keras.Model):
    def train_step(self, data):
        with open(os.path.join(HERE, "data", "labels.txt")) as f:  # joined when training
            self.names = f.read().split()
        return super().train_step(data)


def build_model():
    inputs = keras.Input((8,))
    return M(inputs, keras.layers.Dense(2, name="d")(inputs), name="m")
"""


@pytest.mark.slow
def test_emit_is_refused_over_a_file_whose_name_the_model_joins(tmp_path: Path) -> None:
    """34ab a (D3): ``--emit data/labels.txt`` replaced the file the model's ``train_step``
    opens through ``os.path.join(HERE, "data", "labels.txt")``: no string names the whole
    path. An existing output whose name ends a string of the model's files is refused, unless
    partitioner wrote it (a program it emitted is replaced as before)."""
    (tmp_path / "m.py").write_text(JOINS_IN_STEP)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "labels.txt").write_text("cat\ndog\n")
    done = _run(tmp_path, tmp_path, *PLAN[:2], "m.py", *PLAN[2:], "--emit", "data/labels.txt")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "labels.txt" in done.stderr and "is not a file partitioner wrote" in done.stderr
    assert (tmp_path / "data" / "labels.txt").read_text() == "cat\ndog\n"
    first = _run(tmp_path, tmp_path, *PLAN[:2], "m.py", *PLAN[2:], "--emit", "data/placed.py")
    again = _run(tmp_path, tmp_path, *PLAN[:2], "m.py", *PLAN[2:], "--emit", "data/placed.py")
    assert first.returncode == again.returncode == 0, (first.stderr, again.stderr)


class TwoTower(keras.Model):
    """A keras.io-style subclassed model taking a dict, with its own ``train_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = keras.layers.Dense(4), keras.layers.Dense(4)

    def call(self, inputs: Any) -> Any:
        return self.left(inputs["left"]) * self.right(inputs["right"])

    def train_step(self, data: Any) -> Any:
        return super().train_step(data)


def test_a_dict_model_with_its_own_step_is_not_advised_a_wrapper_that_drops_it() -> None:
    """34ab c (D2): the advice for a subclassed model taking a dict, a functional wrapper of
    class ``keras.Model``, trained with Keras's default step instead of the model's own,
    without a word. For such a class, the advice keeps its class (and so its step)."""
    model = TwoTower()
    model({"left": np.zeros((2, 4), "float32"), "right": np.zeros((2, 3), "float32")})
    with pytest.raises(PartitionError) as raised:
        partitioner.partition(model, gpus=2, batch_size=8)
    message = str(raised.value)
    assert "its class has its own train_step" in message and "TwoTower(inputs=" in message
    assert "wrap it in a functional model" not in message


class GanTrackers(keras.Model):
    """keras.io's DCGAN: subclassed, never called before ``compile``, which makes the loss
    trackers."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))

    def compile(self, d_optimizer: Any, loss_fn: Any) -> None:  # type: ignore[override]
        super().compile()
        self.d_optimizer, self.loss_fn = d_optimizer, loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")

    @property
    def metrics(self) -> list[Any]:
        return [self.d_loss_metric]

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.d_loss_metric.update_state(loss)
        return {"d_loss": self.d_loss_metric.result()}


@pytest.mark.parametrize("how", ["planned", "placed", "replicated"])
def test_a_compile_making_state_after_the_placement_trains(how: str) -> None:
    """34ab c (D1): planning (its trace) and the placement build a model never called;
    keras.io's GAN then makes its trackers in its own ``compile``, which Keras refused on a
    built model ("You cannot add new elements of state"). It compiles and trains as the model
    never planned does."""
    y = RNG.normal(size=(8, 3)).astype("float32")
    histories = []
    for plan_it in (False, True):
        keras.utils.set_random_seed(1)
        model = GanTrackers()
        if plan_it:
            replicated = how == "replicated"
            plan = partitioner.partition(
                model, gpus=4 if replicated else 2, batch_size=8, input_shape=(6,),
                strategy="data_parallel" if replicated else "placed",
            )  # fmt: skip
            if how != "planned":
                assert plan.apply(model, devices=DEVICES[: plan.num_devices]) is model
        model.compile(
            d_optimizer=keras.optimizers.SGD(0.1), loss_fn=keras.losses.MeanSquaredError()
        )
        histories.append(model.fit(X, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history)
    np.testing.assert_allclose(histories[1]["d_loss"], histories[0]["d_loss"], rtol=1e-5)


def test_a_users_file_is_never_replaced_and_partitioners_own_are(tmp_path: Path) -> None:
    """34ac a (D1-D3): outputs guarded by guesses (a file the model's strings name, a file
    whose text says "partitioner" or starts as a plan) replaced a user's config and notes, and
    files named through joined paths, modules outside the model's folder or relative imports.
    An existing non-empty file is replaced only if partitioner wrote it and it is unchanged:
    a plan (its digest), an emitted program or a report (its last line)."""
    plan = partitioner.partition(_model(keras.Model), gpus=2, batch_size=8)
    users = {
        "config.json": '{\n  "schema_version": 2,\n  "units": 16\n}\n',
        "notes.txt": "My notes on the partitioner experiments.\n",
        "fake.py": "x = 1\n# written by partitioner, sha256 " + "0" * 64 + "\n",
    }
    for name, text in users.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(PartitionError, match="is not a file partitioner wrote"):
            plan.save(tmp_path / name)
        assert (tmp_path / name).read_text() == text
    saved = plan.save(tmp_path / "plan.json")
    assert written_by_partitioner(saved) and plan.save(saved) == saved
    doubled = saved.read_text().replace("{\n", '{\n  "model": "MY NOTES",\n', 1)
    (tmp_path / "doubled.json").write_text(doubled)  # a key given twice: a value outside the
    assert not written_by_partitioner(tmp_path / "doubled.json")  # digest (34ad a)
    edited = saved.read_text().replace('"batch_size": 8', '"batch_size": 16')
    saved.write_text(edited)  # edited since: the user's now
    assert not written_by_partitioner(saved)
    program = tmp_path / "placed.py"
    program.write_text(marked("MODEL = 1\n", "#"))
    assert written_by_partitioner(program)
    program.write_text(program.read_text().replace("MODEL = 1", "MODEL = 2"))
    assert not written_by_partitioner(program)
    (tmp_path / "empty.json").write_text("")
    assert plan.save(tmp_path / "empty.json").stat().st_size > 0  # nothing there to lose


class CallbackLogs(keras.callbacks.Callback):
    """Every batch's logs, as callbacks (and the progress bar) get them."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict[str, float]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


class MaxAbsError(keras.metrics.Metric):
    """A custom metric whose state is a running maximum, not a sum."""

    def __init__(self, name: str = "max_abs_err", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.worst = self.add_variable(shape=(), initializer="zeros", name="worst")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        worst = keras.ops.max(keras.ops.abs(y_true - y_pred))
        self.worst.assign(keras.ops.maximum(self.worst, worst))

    def result(self) -> Any:
        return self.worst


def _classifier(cls: type) -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))  # type: ignore[no-any-return]


def _compile_classifier(model: keras.Model) -> None:
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="binary_crossentropy",
        metrics=[
            keras.metrics.AUC(name="auc"),
            keras.metrics.RootMeanSquaredError(),
            MaxAbsError(),
        ],
    )


def _batch_logs(model: keras.Model, x: Any, y: Any) -> list[dict[str, float]]:
    logs = CallbackLogs()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[logs])
    model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[logs])
    return logs.logs


@pytest.mark.parametrize("how", ["in place", "copies"])
def test_each_batchs_logs_of_replicas_are_the_whole_batchs(how: str) -> None:
    """34ac b (D1), c (D1): each batch's logs were the mean of the replicas' results (an AUC
    0.27 for 0.47), and in place a running maximum was read as the sum of the replicas'
    maxima. Every batch's logs, training and testing, equal one device's."""
    rows = np.random.default_rng(0)
    x = rows.normal(size=(32, 5)).astype("float32")
    x[:8] *= 10
    y = (rows.random((32, 1)) > 0.5).astype("float32")
    reference = _classifier(keras.Model)
    _compile_classifier(reference)
    if how == "copies":
        model = _classifier(keras.Model)
        plan = partitioner.partition(model, gpus=4, batch_size=16, strategy="data_parallel")
        model = plan.apply(model, devices=DEVICES)
    else:
        model = _classifier(OwnStep)
        replicate_in_place(model, DEVICES)
    _compile_classifier(model)
    want, got = _batch_logs(reference, x, y), _batch_logs(model, x, y)
    assert len(want) == len(got) == 4
    for one, other in zip(want, got, strict=True):
        assert set(one) == set(other)
        for name, value in one.items():
            np.testing.assert_allclose(other[name], value, rtol=1e-5, err_msg=name)


def _unplaced_then_replicated(make: Any) -> Iterator[keras.Model]:
    """``make()`` as it is, then ``make()`` replicated in place on :data:`DEVICES`."""
    yield make()
    model = make()
    replicate_in_place(model, DEVICES)
    yield model


def test_a_running_maximum_metric_in_place_is_the_whole_batchs() -> None:
    """34ac c (D1): in place, the maximum's variable was mirrored and read as the sum of the
    four replicas' maxima (66.0 for 50.6); it keeps one variable, as in the copies."""
    rows = np.random.default_rng(1)
    x = rows.normal(size=(32, 5)).astype("float32")
    x[:8] *= 10
    y = rows.normal(size=(32, 1)).astype("float32")
    results = []
    for model in _unplaced_then_replicated(lambda: _classifier(OwnStep)):
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=[MaxAbsError()])
        fitted = model.fit(x, y, batch_size=32, verbose=0, shuffle=False).history
        results.append(
            [fitted["max_abs_err"][-1], model.evaluate(x, y, batch_size=32, verbose=0)[1]]
        )
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


def test_a_strategy_in_a_message_is_spelled_as_the_command_line_takes_it() -> None:
    """34aa c: the command line said ``--strategy data_parallel`` to a user who typed
    ``--strategy data-parallel``, in the batch-size refusal's advice."""
    from partitioner.cli.main import cli_message

    said = cli_message("the replica counts strategy='data_parallel' can use: strategy='auto'")
    assert said == "the replica counts --strategy data-parallel can use: --strategy auto"


class OwnLossLogs(keras.Model):
    """A step reporting its own batch's loss under the name of Keras's loss tracker."""

    def train_step(self, data: Any) -> Any:
        x, y = data[0], data[1]
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        logs = self.compute_metrics(x, y, y_pred)
        logs["loss"] = loss  # this batch's, not the tracker's
        return logs


def test_a_value_the_step_computes_under_a_metrics_name_is_kept() -> None:
    """34ad b (D1): the step's own batch loss, returned under the loss tracker's name, was
    replaced by the tracker's state (0.0 for 1.26 from ``train_on_batch``): only values
    computed from the metrics' state are read across the replicas."""
    rows = np.random.default_rng(0)
    x = rows.normal(size=(32, 6)).astype("float32")
    y = rows.normal(size=(32, 3)).astype("float32")
    results = []
    for model in _unplaced_then_replicated(lambda: _regression(OwnLossLogs)):
        results.append(_metric_logs(model, x, y) + _batch_logs(model, x, y))
    for want, got in zip(*results, strict=True):
        assert set(got) == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)


class VaeLogs(keras.Model):
    """keras.io's VAE's logs: a tracker named ``total_loss`` logged as ``loss``; ``fit(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.encode, self.decode = keras.layers.Dense(4, activation="relu"), keras.layers.Dense(6)
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

    @property
    def metrics(self) -> list[Any]:
        return [self.total_loss_tracker]

    def call(self, x: Any) -> Any:
        return self.decode(self.encode(x))

    def train_step(self, data: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.sum(keras.ops.square(data - self(data)), axis=1))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(loss)
        return {"loss": self.total_loss_tracker.result()}


def _vae() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = VaeLogs()
    model(np.zeros((1, 6), "float32"))
    return model


def test_a_trackers_result_logged_under_another_name_is_the_whole_batchs() -> None:
    """34ad c (D1): keras.io's VAE logs its ``total_loss`` tracker as ``loss``; the replicas
    read it at different moments and Keras averaged the reads (12.38 for 12.69). A value read
    from one metric's variables alone is that metric's result, read across the replicas."""
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    histories = []
    for replicate in (False, True):
        model = _vae()
        if replicate:
            replicate_in_place(model, DEVICES)
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        histories.append(model.fit(x, batch_size=8, epochs=2, verbose=0, shuffle=False).history)
    np.testing.assert_allclose(histories[1]["loss"], histories[0]["loss"], rtol=1e-5)


def test_fit_without_labels_and_a_compiled_loss_is_one_line() -> None:
    """34ad c (D2): ``fit(x)`` of a model compiled with ``loss=`` (its own step ignores it)
    failed in Keras's build of the replicated model with "None values not supported"."""
    model = _vae()
    replicate_in_place(model, DEVICES)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.zeros((8, 6), "float32")
    with pytest.raises(PartitionError, match="compile it without loss= and metrics=") as raised:
        model.fit(x, batch_size=8, verbose=0)
    assert "\n" not in str(raised.value)


class DerivedLogs(keras.Model):
    """A step logging metric results transformed, combined, and under another metric's name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.total = keras.metrics.Mean(name="total_loss")
        self.top = keras.metrics.Mean(name="top")
        self.auc = keras.metrics.AUC(name="auc")

    @property
    def metrics(self) -> list[Any]:
        return [self.total, self.top, self.auc]

    def train_step(self, data: Any) -> Any:
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            p = self(x, training=True)
            loss = keras.ops.mean(keras.losses.binary_crossentropy(y, p))
        grads = tape.gradient(loss, self.trainable_variables)
        penalty = keras.ops.sum(keras.ops.square(self.trainable_weights[0]))
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.total.update_state(loss)
        self.top.update_state(p)
        self.auc.update_state(y, p)
        return {
            "loss": self.total.result(),  # a tracker under another name: whole batch
            "auc": self.top.result(),  # another metric's result under a metric's name
            "total_loss": self.total.result() + penalty,  # a metric and the weights
            "error": 1 - self.auc.result(),  # derived: averaged as tf.distribute does
        }


def test_only_a_metrics_own_result_is_read_across_the_replicas() -> None:
    """34ae b (D1, D2): a logged ``total + penalty``, ``1 - auc``, or one tracker's result
    under another metric's name was replaced by a metric's plain result (the 3.48 penalty
    dropped, an error rate shown as the AUC). Only a value that is a metric's ``result()``
    (the same ops on the same variables) is read across the replicas; the others are the
    step's own values (a derived one averaged over the replicas, as tf.distribute does)."""
    rows = np.random.default_rng(0)
    x = rows.normal(size=(16, 5)).astype("float32")
    y = (rows.random((16, 1)) > 0.5).astype("float32")
    logs = []
    for replicate in (False, True):
        model = _classifier(DerivedLogs)
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        if replicate:
            replicate_in_place(model, DEVICES)
        logs.append(model.train_on_batch(x, y, return_dict=True))
    want, got = logs
    for name in ("loss", "auc"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    penalty = want["total_loss"] - want["loss"]
    assert penalty > 0.1 and got["total_loss"] - got["loss"] > 0.5 * penalty  # not dropped
    assert got["error"] != pytest.approx(1 - want["error"], rel=1e-3)  # never the plain AUC


class CountRows(keras.metrics.Sum):
    """The rows seen."""

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        return super().update_state(keras.ops.ones_like(y_pred[:, 0]))


@pytest.mark.parametrize("how", ["in place", "copies"])
def test_test_on_batch_of_replicas_counts_each_sample_once(how: str) -> None:
    """34ae b (D4): ``test_on_batch`` gave every replica the whole batch: a count metric was
    4 times the rows. It evaluates the batch in one step, a share per replica."""
    rows = np.random.default_rng(0)
    x = rows.normal(size=(16, 6)).astype("float32")
    y = rows.normal(size=(16, 3)).astype("float32")
    results = []
    for replicate in (False, True):
        model = _regression(keras.Model if how == "copies" else OwnStep)
        if replicate and how == "copies":
            plan = partitioner.partition(model, gpus=4, batch_size=16, strategy="data_parallel")
            model = plan.apply(model, devices=DEVICES)
        elif replicate:
            replicate_in_place(model, DEVICES)
        model.compile(optimizer="sgd", loss="mse", metrics=[CountRows(name="n"), "mae"])
        results.append(model.test_on_batch(x, y, np.ones(16, "float32"), return_dict=True))
    assert results[1]["n"] == results[0]["n"]
    np.testing.assert_allclose(results[1]["mae"], results[0]["mae"], rtol=1e-5)


def test_local_workers_keep_a_users_cluster_file_and_logs(tmp_path: Path) -> None:
    """34ae a (D1): ``start_local_workers(n, DIR)`` replaced the user's ``DIR/cluster.json``
    and removed their ``DIR/worker0.log``. Refused in one line before any worker starts."""
    from partitioner.cli.worker import start_local_workers

    theirs = '{"worker": ["10.0.0.5:2222"], "note": "my real cluster"}\n'
    (tmp_path / "cluster.json").write_text(theirs)
    with pytest.raises(PartitionError, match="is not a cluster file start_local_workers wrote"):
        start_local_workers(1, tmp_path, timeout_s=5)
    assert (tmp_path / "cluster.json").read_text() == theirs
    (tmp_path / "cluster.json").unlink()
    (tmp_path / "worker0.log").write_text("my notes\n")
    with pytest.raises(PartitionError, match="is not a log partitioner wrote"):
        start_local_workers(1, tmp_path, timeout_s=5)
    assert (tmp_path / "worker0.log").read_text() == "my notes\n"
    assert not (tmp_path / "cluster.json").exists()


ARGPARSE_MODEL = """
import argparse
import keras

parser = argparse.ArgumentParser()
parser.add_argument("--units", type=int, default=4)
args = parser.parse_args()


def build_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(args.units, name="d")])
"""


@pytest.mark.slow
def test_a_model_file_parsing_its_arguments_at_import_sees_its_own(tmp_path: Path) -> None:
    """34ae c (D1): a model file calling ``parse_args()`` at import read ``partition``'s own
    command line and exited ("unrecognized arguments"), blamed on a ``sys.exit`` the user never
    wrote. Its code sees ``sys.argv == [model file]``, as ``python model.py`` gives it."""
    (tmp_path / "m.py").write_text(ARGPARSE_MODEL)
    done = _run(tmp_path, tmp_path, *PLAN[:2], "m.py", *PLAN[2:], "--out", "p.json")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "p.json").read_text())["batch_size"] == 8


class WideNet(keras.Model):
    """keras.io-style: layers in a list and a dict, a custom layer without get_config; its
    ``build`` (Keras's default) makes no weights: only a call does."""

    def __init__(self, units: int) -> None:
        super().__init__(name="net")
        self.stack = [keras.layers.Dense(units, name=f"d{i}") for i in range(2)]
        self.head = {"o": keras.layers.Dense(1, name="o")}

    def call(self, x: Any) -> Any:
        for layer in self.stack:
            x = layer(x)
        return self.head["o"](x)


def test_a_plan_is_checked_against_weights_the_apply_itself_builds() -> None:
    """34ae c (D2): a plan for ``Net(16)`` applied to ``Net(256)`` built only by ``apply``
    (``model.build`` made no weights) passed the fingerprint: nothing to compare yet. The
    model is built on the sample batch first, then checked; the model it was made for
    applies."""
    planned = WideNet(16)
    planned.build((None, 8))
    plan = partitioner.partition(planned, gpus=2, batch_size=8, strategy="placed", input_shape=(8,))
    wider = WideNet(256)
    wider.build((None, 8))
    with pytest.raises(PartitionError, match=r"layer 'd0' has weights of shapes \[\(8, 256\)"):
        plan.apply(wider, devices=DEVICES[:2])
    same = WideNet(16)
    same.build((None, 8))
    assert plan.apply(same, devices=DEVICES[:2]) is not None


def test_a_deeply_nested_users_json_is_not_partitioners(tmp_path: Path) -> None:
    """34af a (D2): a user's JSON nested 600 deep passed ``json.loads`` and overflowed the
    stack in the digest: "internal error: RecursionError" instead of the refusal."""
    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' + "[" * 600 + "]" * 600 + "}")
    assert not written_by_partitioner(deep)


WRITES_WHILE_EMITTED = """
import os
import traceback
import keras

HERE = os.path.dirname(os.path.abspath(__file__))


class Scale(keras.layers.Layer):
    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        if any("codegen" in frame.filename for frame in traceback.extract_stack()):
            with open(os.path.join(HERE, "journal.txt"), "a") as f:
                f.write("a record\\n")
        return {**super().get_config(), "factor": self.factor}


def build_model():
    inputs = keras.Input((16,))
    hidden = Scale(name="s")(keras.layers.Dense(32, name="d1")(inputs))
    return keras.Model(inputs, keras.layers.Dense(4, name="d2")(hidden))
"""


@pytest.mark.slow
def test_an_output_the_models_code_writes_while_the_program_is_made_is_kept(
    tmp_path: Path,
) -> None:
    """34af a (D1): a ``get_config`` run while the program was made wrote ``journal.txt``,
    the ``--emit`` path, after the last check; the program replaced it, exit 0. Every output
    is checked again right before the write."""
    (tmp_path / "m.py").write_text(WRITES_WHILE_EMITTED)
    done = _run(tmp_path, tmp_path, *PLAN[:2], "m.py", *PLAN[2:], "--emit", "journal.txt")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "did not exist when the run started" in done.stderr
    assert (tmp_path / "journal.txt").read_text().startswith("a record\n")
