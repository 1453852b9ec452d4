"""Hostile input III (issue 34), campaign 34aa (round 27) and what 34z left: an optimizer the
model does not hold under data parallelism in place, compiled metrics made outside the
strategy's scope, a plan saved into a cache a ``cache_dir=`` made, a data file the model's own
step opens named by ``--emit``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import PartitionError, RewriteError
from passes import trace_cache
from passes.rewrite.in_place import replicate_in_place
from tests.test_campaign_rerun_xiv import PLAN, _run

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


def test_a_plan_is_not_saved_into_a_cache_a_cache_dir_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """34z a: ``Plan.save`` refused the default cache's folders only; a plan saved into the
    traces folder of the ``cache_dir=`` given to ``partition()`` was replaced by the next run.
    Every cache a run makes carries its CACHEDIR.TAG, and no output goes into its folders."""
    monkeypatch.setattr(trace_cache, "MIN_CACHED_TRACE_S", 0.0)  # this small trace cached too
    cache = tmp_path / "mycache"
    model = _model(keras.Model)
    plan = partitioner.partition(model, gpus=2, batch_size=8, cache_dir=cache, trace_cache=True)
    assert sorted(p.name for p in cache.iterdir()) == ["CACHEDIR.TAG", "traces"]
    (cache / "layers").mkdir()  # as a profiling run makes it
    assert (cache / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f")
    for target in (cache / "traces" / "plan.json", cache / "layers" / "plan.json"):
        with pytest.raises(PartitionError, match="a folder of partitioner's cache"):
            plan.save(target)
        assert not target.exists()
    assert plan.save(tmp_path / "plan.json").is_file()


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
    assert "labels.txt" in done.stderr and "the model's code names" in done.stderr
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
