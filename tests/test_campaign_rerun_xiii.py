"""Hostile input III (issue 34), campaign 34v (round 22): the defects found, each at its
mechanism."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner
from partitioner.core.errors import UsageError
from partitioner.core.files import marked

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist_mlp.py"


OLD = marked("old\n", "#")
"""An earlier output partitioner wrote: a run replaces it, a failed run keeps it."""


def _partition(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """``partition ARGS`` as a user runs it, in ``tmp_path``, with a cache of its own."""
    environment = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PARTITIONER_CACHE_DIR": str(tmp_path / "cache"),
    }
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "partitioner", *args],
        capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip


def _plan() -> Any:
    inputs = keras.Input((16,), name="x")
    hidden = keras.layers.Dense(32, name="a")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="b")(hidden), name="mlp")
    return partitioner.partition(model, gpus=2, batch_size=8, compare_strategies=False)


@pytest.mark.parametrize(
    ("flags", "out", "words"),
    [
        ((), "cache/layers", "is in the profile cache"),
        (("--no-trace-cache",), "cache/traces", "is in the trace cache"),
        (("--device-type", "cpu", "--profile"), "cache/traces", "is in the trace cache"),
        ((), "cache", "is the cache directory"),
    ],
    ids=["layers-without-profile", "traces-without-trace-cache", "traces-with-profile", "cache"],
)
def test_the_cache_and_both_its_folders_are_refused_whatever_the_run_uses(
    tmp_path: Path, flags: tuple[str, ...], out: str, words: str
) -> None:
    """Campaign 34v a (D1, D2): ``--out cache/layers`` without ``--profile`` (and ``traces``
    with ``--no-trace-cache`` or ``--profile``) was written, since only the caches the run used
    were checked; ``--out`` the cache directory itself, not made yet, was written too. Every
    later run then lost its cache. Both folders and the directory are refused, always."""
    if out != "cache":
        (tmp_path / "cache").mkdir()  # a cache made by earlier runs
    done = _partition(tmp_path, str(MNIST), "--gpus", "2", *flags, "--out", out)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "give a path outside it" in done.stderr
    assert not (tmp_path / out).is_file()


def test_plan_save_refuses_the_cache_directory_keras_config_and_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Campaign 34v a (D2, D3): ``plan.save`` of the cache directory (not made yet), of
    ``~/.keras/keras.json`` and of the packaged device catalog were written (the catalog: every
    later run failed); the command line refuses them (row 173). One check for both
    (:func:`partitioner.core.files.check_outside_kept_files`)."""
    import cost_models

    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path / "pc"))
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "kh"))
    (tmp_path / "kh").mkdir()
    keras_json = tmp_path / "kh" / "keras.json"
    keras_json.write_text('{"backend": "tensorflow"}')
    catalog = Path(cost_models.__file__).parent / "data" / "devices.json"
    before = catalog.read_bytes()
    plan = _plan()
    for path, words in (
        (tmp_path / "pc", "is the cache directory"),
        (keras_json, "is Keras's configuration file"),
        (catalog, "is in partitioner's own installation"),
    ):
        with pytest.raises(UsageError, match=words):
            plan.save(path)
    assert not (tmp_path / "pc").exists()
    assert keras_json.read_text() == '{"backend": "tensorflow"}'
    assert catalog.read_bytes() == before


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_pipelined_embedding_trains_as_the_original_under_adam(optimizer: str) -> None:
    """Campaign 34v b (D1): with Adam, a pipelined copy of an ``Embedding`` model ended the step
    with embeddings 0.044 away from the original's: the micro-batches' sparse gradients were
    summed dense, and Adam's sparse update (the original's, on the whole batch's slices, ids
    repeated) squares each slice before adding them up. The slices are concatenated instead."""
    import numpy as np

    def build() -> keras.Model:
        keras.utils.set_random_seed(1)
        ids = keras.Input((3,), dtype="int32", name="ids")
        e = keras.layers.Embedding(10, 4, name="emb")(ids)
        e = keras.layers.GlobalAveragePooling1D(name="gap")(e)
        out = keras.layers.Dense(2, name="out")(keras.layers.Dense(8, name="d")(e))
        return keras.Model(ids, out, name="m")

    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, (16, 3)).astype("int32")
    y = rng.normal(size=(16, 2)).astype("float32")

    def train(model: keras.Model) -> list[Any]:
        made = keras.optimizers.Adam(0.05) if optimizer == "adam" else keras.optimizers.SGD(0.05)
        model.compile(optimizer=made, loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return [np.array(w) for w in model.get_weights()]

    expected = train(build())
    model = build()
    plan = partitioner.partition(model, gpus=2, batch_size=16, strategy="pipeline")
    assert plan.pipeline is not None and plan.pipeline.num_microbatches > 1
    got = train(plan.apply(model, devices=["/device:CPU:0", "/device:CPU:1"]))
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_model_replacing_a_standard_module_in_sys_modules_still_gets_its_plan(
    tmp_path: Path,
) -> None:
    """Campaign 34v c (D1): ``sys.modules["json"] = types.ModuleType("json")`` in the model file
    was ``internal error: AttributeError: module 'json' has no attribute 'dumps'``: the trace
    cache imported the fake. A standard library module replaced there is put back (row 177)."""
    (tmp_path / "fake.py").write_text(
        "import keras, sys, types\n"
        "sys.modules['json'] = types.ModuleType('json')\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, name='d')])\n"
    )
    done = _partition(tmp_path, "fake.py", "--gpus", "2", "--out", "plan.json")
    assert done.returncode == 0, done.stderr
    assert "removed or replaced json in sys.modules; the run put them back" in done.stderr
    assert partitioner.load_plan(tmp_path / "plan.json").layer_order == ("d",)


@pytest.mark.slow
def test_a_model_ignoring_sigterm_is_still_stopped_by_it(tmp_path: Path) -> None:
    """Campaign 34v c (D2): a model file that set SIGTERM to ``SIG_IGN`` made a TERM sent while
    its code ran (``timeout``, systemd) a no-op: the old plan replaced, status 0. Its
    ``signal.signal(SIGTERM, ...)`` leaves the run's handler in place, as for SIGINT (row 157)."""
    import signal
    import time

    (tmp_path / "slow.py").write_text(
        "import keras, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "def build_model():\n"
        "    open('building', 'w').close()\n"
        "    time.sleep(30)\n"
        "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, name='d')])\n"
    )
    (tmp_path / "plan.json").write_text(OLD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARTITIONER_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "partitioner", "slow.py", "--gpus", "2", "--out", "plan.json"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "building").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "interrupted" in err, (proc.returncode, err)
    assert (tmp_path / "plan.json").read_text() == OLD


def test_an_empty_sequential_is_said_to_have_no_layers() -> None:
    """Campaign 34v c (D3): ``keras.Sequential([])`` was "a subclassed model that was never
    built; give ... --input-shape", whose advice led to Keras's own refusal."""
    from partitioner.core.errors import TraceError
    from passes.trace import input_specs

    for given in (None, (8,)):
        with pytest.raises(TraceError, match="model 'empty' has no layers to place"):
            input_specs(keras.Sequential([], name="empty"), 4, given)


def test_a_lower_bound_of_zero_shows_no_ratio() -> None:
    """Campaign 34v b (D4): a plan whose lower bound is 0 showed ``ratio nanx``."""
    from dataclasses import replace

    from partitioner.report.terminal import _summary_line

    plan = _plan()
    assert "ratio" in _summary_line(plan) and "nan" not in _summary_line(plan)
    line = _summary_line(replace(plan, lower_bound_s=0.0))
    assert "lower bound 0" in line and "ratio" not in line and "nan" not in line


def test_calibrate_refuses_keras_config_and_the_caches_before_connecting(tmp_path: Path) -> None:
    """Campaign 34w a (D2): ``partition calibrate --out`` measured for a minute, then wrote the
    topology over Keras's ``keras.json``, into the trace cache or over the packaged catalog
    (every later run failing); ``--out`` of ``partition`` refuses them (rows 173, 197). The same
    checks, before any worker is asked."""
    (tmp_path / "kh").mkdir()
    (tmp_path / "kh" / "keras.json").write_text('{"backend": "tensorflow"}')
    (tmp_path / "cache" / "traces").mkdir(parents=True)
    (tmp_path / "c.json").write_text('{"worker": ["localhost:1", "localhost:2"]}')
    env = {"KERAS_HOME": str(tmp_path / "kh")}
    for out, words in (
        ("kh/keras.json", "is Keras's configuration file"),
        ("cache/traces/x.json", "is in the trace cache"),
    ):
        done = _partition(tmp_path, "calibrate", "--cluster", "c.json", "--out", out, env=env)
        assert done.returncode == 2 and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert (tmp_path / "kh" / "keras.json").read_text() == '{"backend": "tensorflow"}'
    assert not (tmp_path / "cache" / "traces" / "x.json").exists()


def test_a_plain_split_by_a_named_solver_is_that_solvers_split() -> None:
    """Campaign 34w b (C): ``--strategy placed --solver round-robin`` applied another solver's
    contiguous split ([0, 0, 0, 1, 1], a device idle) labelled round-robin. A named solver's
    plain split is its own."""
    from examples.mnist_mlp import build_model

    plan = partitioner.partition(
        build_model(), gpus=3, batch_size=32, strategy="placed", solver="round-robin"
    )
    assert plan.solver.name == "round-robin"
    assert list(plan.assignment.values()) == [0, 1, 2, 0, 1]  # layer k on device k mod 3


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unseeded-random", "batch-norm-called"])
def test_a_model_built_again_with_its_weights_keeps_its_names_and_seed(
    tmp_path: Path, case: str
) -> None:
    """Campaign 34w c (A, B): a builder calling an unseeded ``keras.random.normal`` failed
    ("'NoneType' object has no attribute 'assign'": the global seed generator made by the build
    without weights had no state) and was blamed on the model; a builder calling its
    BatchNormalization model in training mode was built again with its weights, as
    ``sequential_1``, ``dense_2``: a plan the user's own build never applies to. The second
    build starts from Keras's global state as the first did."""
    body = {
        "unseeded-random": "    m(keras.random.normal((2, 8)))\n",
        "batch-norm-called": "    m(np.ones((4, 8), 'float32'), training=True)\n",
    }[case]
    (tmp_path / "m.py").write_text(
        "import keras, numpy as np\n"
        "def build_model():\n"
        "    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),\n"
        "                          keras.layers.BatchNormalization(), keras.layers.Dense(1)])\n"
        + body
        + "    return m\n"
    )
    done = _partition(tmp_path, "m.py", "--gpus", "2", "--device-type", "cpu", "--out", "p.json")
    assert done.returncode == 0, done.stderr
    assert "built it with its weights instead" in done.stderr
    plan = partitioner.load_plan(tmp_path / "p.json")
    assert plan.model_name == "sequential"
    assert plan.layer_order == ("dense", "batch_normalization", "dense_1")


@pytest.mark.slow
def test_a_models_package_named_like_partitioners_own_is_named(tmp_path: Path) -> None:
    """Campaign 34x a: a model importing its own package ``passes`` (a name partitioner's own
    package has), run from another directory, failed with "cannot import name 'block' from
    'passes' (.../partitioner's passes/__init__.py)", blaming the model. The line says which
    package hides which, and what to do."""
    (tmp_path / "t7" / "passes").mkdir(parents=True)
    (tmp_path / "t7" / "passes" / "__init__.py").write_text(
        "import keras\ndef block(x):\n    return keras.layers.Dense(8, name='d2')(x)\n"
    )
    (tmp_path / "t7" / "m.py").write_text(
        "import keras\nfrom passes import block\n"
        "def build_model():\n"
        "    i = keras.Input((4,))\n"
        "    return keras.Model(i, block(keras.layers.Dense(8, name='d1')(i)))\n"
    )
    done = _partition(tmp_path, "t7/m.py", "--gpus", "2", "--out", "t7/p.json")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "its own package 'passes'" in done.stderr and "rename the model's package" in done.stderr
    assert not (tmp_path / "t7" / "p.json").exists()
