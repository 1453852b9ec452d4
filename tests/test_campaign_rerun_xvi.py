"""Hostile input III (issue 34), campaign 34ag (round 33) and what 34af left: a functional
model holding a subclassed model that cannot be rebuilt from its config."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import OutputError, PartitionError
from partitioner.core.files import check_not_hiding_a_module, written_by_partitioner
from passes.checks import in_place_reason
from passes.rewrite.codegen import emit_plan_module, write_placed_module
from passes.rewrite.in_place import replicate_in_place
from tests.emitted import import_emitted
from tests.test_campaign_rerun_xiv import REPO, OwnStep

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 6)).astype("float32")
Y = RNG.normal(size=(8, 2)).astype("float32")


class Block(keras.Model):
    """keras.io's style: a subclassed block with a required argument and no ``get_config``."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.first = keras.layers.Dense(units, activation="relu")
        self.second = keras.layers.Dense(units)

    def call(self, x: Any) -> Any:
        return self.second(self.first(x))


def _functional_with_block() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(Block(8)(hidden)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_a_nested_subclassed_model_without_config_is_placed_in_place() -> None:
    """34af c: the functional model was copied, which rebuilds the nested ``Block`` from its
    config, and ``plan.apply`` failed with Keras's 22-line text on ``get_config``. The nested
    model is named as the reason, the model is placed in place, and one step trains it as the
    unplaced model."""
    model = _functional_with_block()
    reason = in_place_reason(model)
    assert reason is not None and "'block'" in reason and "(Block)" in reason
    reference = _functional_with_block()
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="placed")
    placed = plan.apply(model, devices=DEVICES[:2])
    assert placed is model
    devices = {v.value.device.rsplit("/", 1)[-1] for v in model.weights}
    assert devices == {"device:CPU:0", "device:CPU:1"}, devices
    loss = placed.train_on_batch(X, Y)
    expected = reference.train_on_batch(X, Y)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(placed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_pipeline_advice_asks_for_more_micro_batches_only_where_they_divide_the_batch() -> None:
    """34ag b (D2): a batch of 7 over 3 stages ran as 7 micro-batches of 1, and the advice
    asked for more micro-batches, which the batch refuses. It names the batch instead; a batch
    with a larger divisor still gets the advice."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((32,))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Dense(64, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))

    def bubbles(batch: int, microbatches: int) -> str:
        plan = partitioner.partition(
            model, gpus=3, batch_size=batch, pipeline=True, num_microbatches=microbatches
        )
        return next(a for a in plan.advice if a.startswith("Bubbles reach"))

    assert "no more micro-batches divide the batch of 7 (7 micro-batches of 1 row)" in bubbles(7, 7)
    assert "more micro-batches (--microbatches, now 2) shrink them" in bubbles(8, 2)


class StateLogged(keras.Model):
    """A step logging a metric's result beside its own state variables (``count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.head = keras.layers.Dense(2)
        self.tracker = keras.metrics.Mean(name="tracked")

    def call(self, x: Any) -> Any:
        return self.head(self.hidden(x))

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result(), "count": self.tracker.count}

    @property
    def metrics(self) -> list[Any]:
        return [self.tracker]


def _made(cls: type, seed: int = 1) -> keras.Model:
    """A built, compiled model of the subclass ``cls`` (a step of its own), seeded."""
    keras.utils.set_random_seed(seed)
    model = cls()
    model(X[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model  # type: ignore[no-any-return]


def test_a_logged_metric_state_variable_of_replicas_is_named_not_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """34ag b (D1): the step logged its tracker's ``count`` beside its result; under 4 replicas
    in place every replica updates the tracker, so the count was 4 times one device's, without
    a word. The result is still the whole batch's; the count is named NOT EXACT, once."""
    reference, model = _made(StateLogged), _made(StateLogged)
    replicate_in_place(model, DEVICES)
    with caplog.at_level(logging.WARNING, logger="passes.rewrite.replicate"):
        logs = model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    expected = reference.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)
    warned = [r.getMessage() for r in caplog.records if "NOT EXACT" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "'count'" in warned[0] and "each of the 4 replicas updates the metric" in warned[0]
    assert "'loss'" not in warned[0]


class _Hangup(Exception):
    """What this test's SIGHUP (SIGUSR1) handler raises (its default would end the process)."""


def _hangup(signum: int, frame: object) -> None:
    raise _Hangup


_hangup.ends_run = True  # type: ignore[attr-defined]  # as the CLI's handlers are marked


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_an_interrupt_during_a_write_of_several_files_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int
) -> None:
    """34ag a (D1): a Ctrl-C (or a full disk) after the plan was staged and before the report
    was left a hidden ``.plan.json.*.tmp``: the staged files were only removed when every one
    had been staged; 34ah a (D2): a SIGHUP (a closed terminal) was not held at all. A signal is
    held until the files are as they were, then raised; a failure on a later file removes the
    earlier ones' staged copies."""
    import partitioner.core.files as files

    (tmp_path / "old.json").write_text("kept")
    staged = files._stage

    def staged_then_interrupted(target: Path, text: str, private: bool = False) -> str:
        tmp = staged(target, text, private)
        os.kill(os.getpid(), signum)  # as Ctrl-C, or a hang-up, between two files
        return tmp

    monkeypatch.setattr(files, "_stage", staged_then_interrupted)
    before = signal.getsignal(signum)
    if signum != signal.SIGINT:  # its default would end the test process (34aj: SIGUSR1)
        signal.signal(signum, _hangup)
    try:
        with pytest.raises(KeyboardInterrupt if signum == signal.SIGINT else _Hangup):
            files.write_all_atomic([(tmp_path / "old.json", "new"), (tmp_path / "r.html", "x")])
    finally:
        signal.signal(signum, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "kept"
    monkeypatch.setattr(files, "_stage", staged)
    with pytest.raises(TypeError):  # the second file's text is no text
        files.write_all_atomic([(tmp_path / "p.json", "{}\n"), (tmp_path / "r.html", None)])  # type: ignore[list-item]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]


def test_local_workers_replace_only_their_own_cluster_file(tmp_path: Path) -> None:
    """34ag a (D2): a user's own loopback ``cluster.json`` (one job ``worker`` on 127.0.0.1,
    the README's form) was taken for the one start_local_workers writes, by its content, and
    replaced. Their file now carries a digest: a hand-written one is refused, theirs replaced."""
    from partitioner.cli.worker import start_local_workers

    theirs = '{"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}'
    (tmp_path / "cluster.json").write_text(theirs)
    with pytest.raises(PartitionError, match="is not a cluster file start_local_workers wrote"):
        start_local_workers(0, tmp_path)
    assert (tmp_path / "cluster.json").read_text() == theirs
    (tmp_path / "cluster.json").unlink()
    for _ in range(2):  # its own file, again
        start_local_workers(0, tmp_path).stop()
    assert written_by_partitioner(tmp_path / "cluster.json")
    assert json.loads((tmp_path / "cluster.json").read_text())["cluster"] == {"worker": []}


def test_an_output_named_like_a_module_python_imports_is_refused(tmp_path: Path) -> None:
    """34ag a (D3): ``--emit keras.py`` was written, and every later run in that folder (the
    model, the emitted program importing itself as keras, partitioner) failed; the error then
    blamed Keras's backend setting. A ``.py`` output named like a module found elsewhere on the
    path is refused; other names are written."""
    for name in ("keras.py", "numpy.py", "colorsys.py", "sys.py"):
        with pytest.raises(OutputError, match=f"is named like the module '{name[:-3]}'"):
            check_not_hiding_a_module(str(tmp_path / name), f"--emit {name}")
    for name in ("placed.py", "keras.json", "keras_plan.py", "plan.json"):
        check_not_hiding_a_module(str(tmp_path / name), f"--emit {name}")
    for name in ("keras.pyc", "json.cpython-311-x86_64-linux-gnu.so", "__init__.py"):  # 34ai
        with pytest.raises(OutputError, match=r"is named like the module|makes .* a package"):
            check_not_hiding_a_module(str(tmp_path / name), f"--out {name}")
    (tmp_path / "helpers.py").write_text("def act(x):\n    return x\n")  # 34ak a (D1)
    for name in ("helpers.so", "helpers.cpython-311-x86_64-linux-gnu.so", "helpers.pyc"):
        with pytest.raises(OutputError, match=r"from .*helpers\.py beside it"):
            check_not_hiding_a_module(str(tmp_path / name), f"--out {name}")
    (tmp_path / "mylib").mkdir()  # 34ah a (D1): a namespace package the model imports from
    with pytest.raises(OutputError, match=r"from the directory .*mylib beside it"):
        check_not_hiding_a_module(str(tmp_path / "mylib.py"), "--emit mylib.py")


@pytest.mark.parametrize("hidden", ["numpy", "keras"])
def test_a_file_hiding_a_package_partitioner_needs_is_one_line(tmp_path: Path, hidden: str) -> None:
    """34ag a (D3): a ``numpy.py`` in the working directory gave ``python -m partitioner`` a
    30-line traceback, and a ``keras.py`` Keras's backend advice. Both name the file."""
    (tmp_path / f"{hidden}.py").write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "partitioner", "devices"], capture_output=True, text=True,
        cwd=tmp_path, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"hidden by {tmp_path / hidden}.py" in done.stderr, done.stderr


def test_a_string_model_data_parallel_in_place_trains_as_one_device() -> None:
    """34ag c (D1): Keras builds a replicated model from the first batch averaged over the
    replicas, and no mean takes strings: a ``StringLookup`` model with its own ``train_step``
    planned data parallel failed its first ``fit`` with TensorFlow's ``AddN`` error. It is built
    from the first replica's share, and trains as one device."""

    def made() -> keras.Model:
        keras.utils.set_random_seed(0)
        words = keras.Input((), dtype="string")
        ids = keras.layers.StringLookup(vocabulary=["a", "b", "c"])(words)
        logits = keras.layers.Dense(2)(keras.layers.Embedding(5, 4)(ids))
        model = OwnStep(words, logits)
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(True))
        return model

    x, y = np.array(["a", "b", "c", "z"] * 2, dtype=object), np.array([0, 1, 0, 1] * 2)
    reference, model = made(), made()
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="data_parallel")
    assert plan.apply(model, devices=DEVICES[:2]) is model
    got = model.fit(x, y, batch_size=8, verbose=0, shuffle=False).history["loss"]
    want = reference.fit(x, y, batch_size=8, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class NeedsTraining(keras.Model):
    """keras.io's ``call(self, x, training)``: ``training`` required, Keras's fit passes it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(4)
        self.second = keras.layers.Dense(2)

    def call(self, x: Any, training: Any) -> Any:
        return self.second(self.first(x))


def test_a_call_requiring_training_is_rebuilt_and_emitted(tmp_path: Path) -> None:
    """34ag c (D2): ``plan.apply`` and both emitted programs called the rebuilt model without
    ``training``, which its ``call`` requires: a bare TypeError. They pass ``training=False``."""
    source = tmp_path / "needs_training.py"
    source.write_text(
        "import keras\nfrom tests.test_campaign_rerun_xvi import NeedsTraining\n\n\n"
        "def build_model():\n    model = NeedsTraining(name='needs')\n"
        "    model(keras.ops.zeros((1, 6)), training=False)\n    return model\n"
    )
    model = NeedsTraining(name="needs")
    model(X[:1], training=False)
    for strategy in ("placed", "data_parallel"):
        plan = partitioner.partition(model, gpus=2, batch_size=8, strategy=strategy)
        applied = plan.apply(model, devices=DEVICES[:2])
        assert applied(X, training=False).shape == (8, 2)
        program = write_placed_module(
            tmp_path / f"{strategy}_program.py",
            emit_plan_module(model, plan, devices=DEVICES[:2], model_source=source),
        )
        module = import_emitted(program)
        built = module.build_model() if strategy == "placed" else _in_scope(module)
        assert built(X, training=False).shape == (8, 2)


def _in_scope(module: Any) -> Any:
    with module.make_strategy().scope():
        return module.build_model()


@pytest.mark.parametrize("strategy", ["placed", "data_parallel"])
def test_the_emitted_in_place_program_refuses_another_model(tmp_path: Path, strategy: str) -> None:
    """34ag c (D3): the in-place program's ``build_model(model)`` matched layers by position
    and placed any model of as many layers (512-wide for a plan of 16); 34ah c (D1): the data
    parallel one replicated any model. Both check each layer's class and weight shapes against
    the plan's, by position."""
    source = tmp_path / "own_step.py"
    source.write_text(
        "import keras\nfrom tests.test_campaign_rerun_xvi import own_step_model\n\n\n"
        "def build_model():\n    return own_step_model(16)\n"
    )
    model = own_step_model(16)
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy=strategy)
    text = emit_plan_module(model, plan, devices=DEVICES[:2], model_source=source)
    module = import_emitted(write_placed_module(tmp_path / f"{strategy}_program.py", text))
    assert module.build_model() is not None
    with pytest.raises(ValueError, match=r"has weights of shapes \[\(6, 512\)"):
        module.build_model(own_step_model(512))


def own_step_model(width: int) -> keras.Model:
    """A functional model of ``OwnStep`` (its own ``train_step``: placed in place)."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    model = OwnStep(inputs, keras.layers.Dense(2)(hidden))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_the_data_parallel_copy_compiles_with_keras_positional_arguments() -> None:
    """34ah b (D3): ``compile("sgd", "mse")`` on the data-parallel copy was a TypeError
    (``takes from 1 to 2 positional arguments``), where Keras and the other rewrites take it."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(inputs)))
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="data_parallel")
    copy = plan.apply(model, devices=DEVICES[:2])
    copy.compile(keras.optimizers.SGD(0.1), "mse", None, ["mae"])
    logs = copy.fit(X, Y, batch_size=8, epochs=1, verbose=0).history
    assert set(logs) == {"loss", "mae"}
    with pytest.raises(TypeError, match="multiple values for argument 'loss'"):
        copy.compile("sgd", "mse", loss="mae")


def _two_heads() -> keras.Model:
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,), name="x")
    trunk = keras.layers.Dense(16, activation="relu", name="d1")(inputs)
    deeper = keras.layers.Dense(16, activation="relu", name="d2")(trunk)
    heads = {
        "cls": keras.layers.Dense(1, name="cls")(deeper),
        "reg": keras.layers.Dense(2, name="reg")(trunk),
    }
    model = keras.Model(inputs, heads, name="two_heads")
    model.compile(keras.optimizers.SGD(0.1), {"cls": "mse", "reg": "mse"})
    return model


def test_a_two_headed_model_pipelines_in_the_plans_stage_order() -> None:
    """34ah b (D1): a trunk with two heads on four devices: the plan's stage order put ``cls``
    before ``reg``, both ready once the trunk ran, and the rewrite, taking Keras's order of
    them, refused it as "not the dataflow order" for every solver. The rewrite takes the plan's
    order among stages the dataflow leaves unordered, and trains as the unplaced model."""
    x = RNG.normal(size=(24, 6)).astype("float32")
    y = {"cls": RNG.normal(size=(24, 1)), "reg": RNG.normal(size=(24, 2))}
    reference, model = _two_heads(), _two_heads()
    plan = partitioner.partition(model, gpus=4, batch_size=24, pipeline=True, solver="even")
    assert plan.pipeline is not None and len(plan.pipeline.stage_devices) == 4
    piped = plan.apply(model, devices=DEVICES)
    piped.compile(keras.optimizers.SGD(0.1), {"cls": "mse", "reg": "mse"})
    got = piped.train_on_batch(x, y, return_dict=True)
    want = reference.train_on_batch(x, y, return_dict=True)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for a, b in zip(piped.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_model_slicing_its_tensors_is_emitted(tmp_path: Path) -> None:
    """34ah a (D3): ``x[:, :, None]`` in a functional model (Keras's ``GetItem`` with slices)
    failed ``--emit`` for the whole run ("an argument of type slice cannot be written as Python
    code"). Slices and ``...`` are written as code, and the program computes the model's
    outputs."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, name="d0")(inputs)
    picked = hidden[:, :, None][..., 0:1, :]
    model = keras.Model(inputs, keras.layers.Dense(2, name="d1")(keras.layers.Flatten()(picked)))
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="placed")
    text = emit_plan_module(model, plan, devices=DEVICES[:2])
    assert "slice(0, 1, None)" in text and "Ellipsis" in text
    built = import_emitted(write_placed_module(tmp_path / "sliced.py", text)).build_model()
    built.set_weights(model.get_weights())
    np.testing.assert_allclose(built(X), model(X), rtol=1e-5, atol=1e-6)


def _cnn() -> keras.Model:
    inputs = keras.Input((16, 16, 3))
    hidden = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(hidden))
    return keras.Model(inputs, keras.layers.Dense(4)(hidden))


def _embedding() -> keras.Model:
    ids = keras.Input((12,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(ids))
    return keras.Model(ids, keras.layers.Dense(3)(hidden))


def _mlp() -> keras.Model:
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10)(hidden))


@pytest.mark.parametrize(("build", "rel"), [(_mlp, 1e-9), (_cnn, 1e-9), (_embedding, 1e-2)])
def test_a_model_is_priced_alike_with_and_without_its_weights(build: Any, rel: float) -> None:
    """34ah b (D2): on CPUs, a model built without its weights (the command line's way) was
    priced about 4% below the same model with them (the Python API's): the step with weights
    reads each variable through a resource handle, and every op is priced a dispatch there;
    the weightless trace had none. Both steps now have the same ops, and the same plan; a
    variable the step reads twice (an Embedding's table) is one read in the weightless trace,
    one dispatch (under 1%) apart."""
    with partitioner.without_weights():
        weightless = build()
    plans = [
        partitioner.partition(m, gpus=2, device_type="cpu", batch_size=8, strategy="single")
        for m in (weightless, build())
    ]
    a, b = (p.step_time_s for p in plans)
    assert a == pytest.approx(b, rel=rel), (a, b)


class PerSampleLogged(keras.Model):
    """A step logging each sample's loss beside the batch's mean (hard-example mining)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head = keras.layers.Dense(2)

    def call(self, x: Any) -> Any:
        return self.head(x)

    def train_step(self, data: Any) -> Any:
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            per_sample = keras.ops.mean((self(x, training=True) - y) ** 2, axis=-1)
            loss = keras.ops.mean(per_sample)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        column_mean = keras.ops.mean(self(x), axis=0)  # 2 columns, a share of 4 rows
        return {"loss": loss, "per_sample": per_sample, "column_mean": column_mean}


def test_a_per_sample_log_of_replicas_is_named_not_exact(caplog: pytest.LogCaptureFixture) -> None:
    """34ai c (D1): the step's per-sample losses came back as 4 rows for a batch of 8 under 2
    replicas, each the mean of two unrelated samples (Keras averages the replicas' logs),
    without a word. Gathering them instead (34aj b) took column means for rows, as a shape
    does not say which a value is: a value with as many rows as a share is named NOT EXACT,
    once; a value reduced over the batch of other length (the mean prediction per column) is
    one device's, and not named."""

    reference, model = _made(PerSampleLogged, 5), _made(PerSampleLogged, 5)
    replicate_in_place(model, DEVICES[:2])
    with caplog.at_level(logging.WARNING, logger="passes.rewrite.replicate"):
        got = model.train_on_batch(X, Y, return_dict=True)
        model.train_on_batch(X, Y, return_dict=True)
    want = reference.train_on_batch(X, Y, return_dict=True)
    warned = [r.getMessage() for r in caplog.records if "NOT EXACT" in r.getMessage()]
    assert len(warned) == 1 and "'per_sample'" in warned[0] and "'column_mean'" not in warned[0]
    np.testing.assert_allclose(got["column_mean"], want["column_mean"], rtol=1e-5)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


def test_batch_normalization_under_replicas_is_named_for_the_replicas_shares() -> None:
    """34ai b (unclear): a data-parallel plan's note on BatchNormalization spoke of
    micro-batches and "the unpipelined model" where no pipeline runs."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="data_parallel")
    note = next(n for n in (*plan.advice, *plan.warnings) if "BatchNormalization" in n)
    assert "a replica's share" in note and "unpipelined" not in note, note


def test_plan_save_refuses_a_name_that_hides_a_module(tmp_path: Path) -> None:
    """34ai a (D1): ``plan.save("json.py")`` wrote the plan where every later program in that
    folder imported it as ``json``; the command line refused ``--out json.py``. So does
    ``Plan.save``, with the same line."""
    plan = partitioner.partition(_mlp(), gpus=2, batch_size=8, strategy="placed")
    for name in ("json.py", "keras.py", "numpy.pyc"):
        with pytest.raises(OutputError, match=f"is named like the module '{name.split('.')[0]}'"):
            plan.save(tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    plan.save(tmp_path / "plan.json")


def _masked_mean_model() -> keras.Model:
    """An own-step functional model with a bool mask input and ``keras.ops`` on its tensors."""
    keras.utils.set_random_seed(7)
    ids = keras.Input((6,), dtype="int32", name="ids")
    keep = keras.Input((6,), dtype="bool", name="keep")
    embedded = keras.layers.Embedding(50, 8, name="emb")(ids)
    weights = keras.ops.expand_dims(keras.ops.cast(keep, "float32"), -1)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(embedded * weights)
    model = OwnStep({"ids": ids, "keep": keep}, keras.layers.Dense(1, name="out")(pooled))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_a_bool_input_model_replicated_in_place_trains_and_is_emitted(tmp_path: Path) -> None:
    """34aj c: a bool mask input failed the first ``fit`` of the model replicated in place
    (TensorFlow's ``AddN`` error: Keras builds from the replicas' mean of the first batch, and
    row 253 took the first share for strings only) (D2); and its emitted in-place program
    failed in its own layer check on the ``keras.ops`` nodes, which have no ``weights`` (D1)."""
    rng = np.random.default_rng(0)
    x = {"ids": rng.integers(0, 50, (16, 6)).astype("int32"), "keep": rng.random((16, 6)) > 0.3}
    y = rng.normal(size=(16, 1)).astype("float32")
    reference, model = _masked_mean_model(), _masked_mean_model()
    plan = partitioner.partition(model, gpus=4, batch_size=16, strategy="data_parallel")
    assert plan.apply(model, devices=DEVICES) is model
    got = model.fit(x, y, batch_size=16, verbose=0, shuffle=False).history["loss"]
    want = reference.fit(x, y, batch_size=16, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    source = tmp_path / "masked.py"
    source.write_text(
        "from tests.test_campaign_rerun_xvi import _masked_mean_model as build_model\n"
    )
    for strategy in ("placed", "data_parallel"):
        fresh = _masked_mean_model()
        plan = partitioner.partition(fresh, gpus=2, batch_size=16, strategy=strategy)
        text = emit_plan_module(fresh, plan, devices=DEVICES[:2], model_source=source)
        module = import_emitted(write_placed_module(tmp_path / f"{strategy}_masked.py", text))
        assert module.build_model() is not None


def _two_losses() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((10,), name="x")
    trunk = keras.layers.Dense(16, activation="tanh", name="t1")(inputs)
    trunk = keras.layers.Dense(16, activation="tanh", name="t2")(trunk)
    heads = {
        "cls": keras.layers.Dense(3, name="cls")(keras.layers.Dense(16, name="a")(trunk)),
        "reg": keras.layers.Dense(1, name="reg")(keras.layers.Dense(16, name="b")(trunk)),
    }
    return keras.Model(inputs, heads)


def _compiled(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        loss_weights={"cls": 0.3, "reg": 2.0},
    )
    return model


def test_a_hybrid_plan_logs_each_outputs_loss() -> None:
    """34aj b (D2): replicas of a pipeline (``strategy="hybrid"``) logged ``loss`` but not
    ``cls_loss`` and ``reg_loss``: the replicas' own loss trackers saw their shares, the
    model's none. Each output's loss is the whole batch's, as one device logs it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 10)).astype("float32")
    y = {"cls": rng.integers(0, 3, 16), "reg": rng.normal(size=(16, 1)).astype("float32")}
    model = _two_losses()
    reference = _compiled(_two_losses())
    plan = partitioner.partition(model, gpus=4, batch_size=16, strategy="hybrid")
    assert plan.strategy is not None and plan.strategy.replicas > 1 and plan.strategy.stages > 1
    hybrid = _compiled(plan.apply(model, devices=DEVICES))
    got = hybrid.fit(x, y, batch_size=16, epochs=2, verbose=0).history
    want = reference.fit(x, y, batch_size=16, epochs=2, verbose=0).history
    assert set(got) == set(want) == {"loss", "cls_loss", "reg_loss"}
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)


def test_a_users_file_written_while_the_outputs_are_staged_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """34ak a (D2): the checks ran before the outputs were staged (seconds for a large report),
    and a user's file written at ``--out`` meanwhile was replaced. Each target is checked again
    right before its rename: refused, the user's file kept, nothing staged left."""
    import partitioner.core.files as files

    plan_path = tmp_path / "p.json"
    staged = files._stage

    def staged_then_written(target: Path, text: str, private: bool = False) -> str:
        tmp = staged(target, text, private)
        plan_path.write_text("USER RESULTS 42\n")  # another process, while the run stages
        return tmp

    monkeypatch.setattr(files, "_stage", staged_then_written)
    with pytest.raises(OutputError, match="is not a file partitioner wrote"):
        files.write_all_atomic([(plan_path, "{}\n"), (tmp_path / "r.html", "x")], only_ours=True)
    assert plan_path.read_text() == "USER RESULTS 42\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


class ForgetfulGate(keras.layers.Layer):
    """keras.io's common bug: ``get_config`` leaves the ``alpha`` argument out."""

    def __init__(self, units: int, alpha: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units, self.alpha = units, alpha

    def build(self, shape: Any) -> None:
        self.kernel = self.add_weight(shape=(shape[-1], self.units))

    def call(self, x: Any) -> Any:
        return keras.ops.matmul(x, self.kernel) * self.alpha

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units}


def test_a_layer_whose_config_forgets_an_argument_is_placed_in_place() -> None:
    """34ak c (D1): a custom layer's ``get_config`` left ``alpha=3.0`` out, the copies rebuilt
    it with ``alpha=1.0``, and the placed, data-parallel and emitted models computed another
    function without a word. The rebuild's attributes are compared: the layer is named, and
    the model is placed in place, computing what it did."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((6,))
    gated = ForgetfulGate(4, alpha=3.0, name="gate")(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(gated))
    reason = in_place_reason(model)
    assert reason is not None and "'gate'" in reason, reason
    before = np.asarray(model(X))
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="placed")
    placed = plan.apply(model, devices=DEVICES[:2])
    assert placed is model
    np.testing.assert_allclose(np.asarray(placed(X)), before, rtol=1e-5, atol=1e-6)


def test_the_time_table_of_replicas_names_the_all_reduce() -> None:
    """34ak b (D1): for replicas, "Where the time goes" showed the gradients' all-reduce (the
    step after replica 0's timeline) as each device's idle time, and nothing named it."""
    from partitioner.report.tables import time_table

    plan = partitioner.partition(_mlp(), gpus=4, batch_size=32, strategy="data_parallel")
    assert plan.strategy is not None and plan.strategy.replicas > 1
    table = time_table(plan)
    assert table.columns[3].header == "idle + all-reduce"
    tail = plan.step_time_s - max(e.end_s for e in plan.timeline)
    assert tail > 0 and "is the replicas' gradient all-reduce" in table.caption
    single = partitioner.partition(_mlp(), gpus=2, batch_size=32, strategy="placed")
    assert time_table(single).columns[3].header == "idle"


class ResultInAList(StateLogged):
    """The tracker's result logged under a key and inside a list and a tuple."""

    def train_step(self, data: Any) -> Any:
        logs = super().train_step(data)
        result = self.tracker.result()
        return {"loss": logs["loss"], "as_list": [result], "as_tuple": (result,)}


def test_a_metric_result_logged_in_a_list_is_the_whole_batchs() -> None:
    """34al b (D1): a tracker's ``result()`` logged inside a list or a tuple was each replica's
    own, averaged (0.89 where one device logs 0.82), while the same result under a key was the
    whole batch's. Items of lists and tuples are read across the replicas too."""

    reference, model = _made(ResultInAList), _made(ResultInAList)
    replicate_in_place(model, DEVICES)
    got = model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    want = reference.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    for key in ("loss", "as_list", "as_tuple"):
        np.testing.assert_allclose(np.ravel(got[key]), np.ravel(want[key]), rtol=1e-5)


def _two_inputs() -> keras.Model:
    keras.utils.set_random_seed(9)
    a, b = keras.Input((8,), name="a"), keras.Input((3,), name="b")
    joined = keras.layers.Concatenate()([keras.layers.Dense(16)(a), b])
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(4)(joined))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_the_emitted_data_parallel_command_trains_a_model_of_named_inputs(tmp_path: Path) -> None:
    """34am c (D1): the program's documented ``python THIS_FILE.py ORIGINAL.keras DATA.npz``
    read ``x`` and ``y`` only, and no ``.npz`` holds a dict: a model of named inputs failed with
    numpy's traceback. DATA.npz may hold one array per input name, and y; without them, one
    line names what it needs."""
    model = _two_inputs()
    plan = partitioner.partition(model, gpus=2, batch_size=16, strategy="data_parallel")
    text = emit_plan_module(model, plan, devices=DEVICES[:2])
    module = import_emitted(write_placed_module(tmp_path / "dp_named.py", text))
    saved = tmp_path / "original.keras"
    model.save(saved)
    rng = np.random.default_rng(1)
    x = {"a": rng.normal(size=(16, 8)).astype("float32"), "b": rng.normal(size=(16, 3))}
    y = rng.normal(size=(16, 4)).astype("float32")
    np.savez(tmp_path / "named.npz", a=x["a"], b=x["b"].astype("float32"), y=y)
    module.main([str(saved), str(tmp_path / "named.npz")])
    trained = keras.saving.load_model(tmp_path / "original.trained.keras")
    reference = _two_inputs()
    reference.fit({"a": x["a"], "b": x["b"].astype("float32")}, y, batch_size=16, verbose=0)
    for got, want in zip(trained.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.savez(tmp_path / "wrong.npz", a=x["a"], y=y)
    with pytest.raises(SystemExit, match=r"holds neither x nor the model's inputs \['b'\]"):
        module.main([str(saved), str(tmp_path / "wrong.npz")])


def test_the_one_device_baseline_does_not_advise_a_device_count() -> None:
    """34am b (D1): with ``gpus=4`` and a memory limit one device cannot meet, the ``single``
    row said "use gpus=2 or more": the count of its own one-device run, not the user's."""
    inputs = keras.Input((64,))
    hidden = inputs
    for _ in range(6):
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    plan = partitioner.partition(
        model, gpus=4, device_type="h100", batch_size=64, memory_limit_bytes=3_000_000
    )
    note = next(b.note for b in plan.baselines if b.solver == "single")
    assert "one device cannot hold it" in note and "gpus=" not in note, note


def test_a_signal_the_program_ignores_leaves_the_files_written(tmp_path: Path) -> None:
    """34am a (D1): under ``nohup`` (SIGHUP ignored), a hang-up while the outputs were written
    undid them, and the run still said "Plan written" and exited 0. A signal whose handler does
    not end the run is delivered after the write, which completes."""
    import partitioner.core.files as files

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    staged = files._stage

    def staged_then_hung_up(target: Path, text: str, private: bool = False) -> str:
        tmp = staged(target, text, private)
        os.kill(os.getpid(), signal.SIGHUP)
        return tmp

    try:
        files._stage = staged_then_hung_up  # type: ignore[assignment]
        files.write_all_atomic([(tmp_path / "p.json", "{}\n"), (tmp_path / "r.html", "x")])
    finally:
        files._stage = staged  # type: ignore[assignment]
        signal.signal(signal.SIGHUP, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "r.html"]


def test_the_cp_sat_worker_does_not_import_the_working_directorys_modules(tmp_path: Path) -> None:
    """34am a (D2): with TensorFlow imported first, CP-SAT runs in a worker started as
    ``python -c``, which put the working directory first on its path: a ``numpy.py`` there ran.
    The worker is started with ``-P``."""
    (tmp_path / "numpy.py").write_text(
        "open('RAN', 'w').write('the working directory's numpy.py ran')\nraise ImportError\n"
    )
    script = (
        "import tensorflow, keras, partitioner\n"
        "i = keras.Input((8,)); h = keras.layers.Dense(8)(i)\n"
        "m = keras.Model(i, keras.layers.Dense(2)(keras.layers.Dense(8)(h)))\n"
        "partitioner.partition(m, gpus=2, solver='ilp', compare_strategies=False)\n"
        "print('planned')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-P", "-c", script], capture_output=True, text=True, cwd=tmp_path,
        env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "planned" in done.stdout, done.stderr[-2000:]
    assert not (tmp_path / "RAN").exists()


def test_the_exported_writers_keep_a_users_file(tmp_path: Path) -> None:
    """34am a (D3): ``write_html_report`` and ``write_placed_module`` replaced any file."""
    from partitioner.report.html import write_html_report

    plan = partitioner.partition(_mlp(), gpus=2, batch_size=8, strategy="placed")
    (tmp_path / "mine.html").write_text("<html>my page</html>\n")
    (tmp_path / "mine_code.py").write_text("print('mine')\n")
    with pytest.raises(OutputError, match="is not a file partitioner wrote"):
        write_html_report(plan, tmp_path / "mine.html")
    with pytest.raises(OutputError, match="is not a file partitioner wrote"):
        write_placed_module(tmp_path / "mine_code.py", "x = 1\n")
    assert (tmp_path / "mine.html").read_text() == "<html>my page</html>\n"
    assert (tmp_path / "mine_code.py").read_text() == "print('mine')\n"
    write_html_report(plan, tmp_path / "ours.html")
    write_html_report(plan, tmp_path / "ours.html")  # its own, again
