"""Hostile input III (issue 34), campaign 34p (round 16): the defects found, each at its
mechanism."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner
from partitioner.core.errors import PlanError, UsageError
from partitioner.plan.model import load_plan

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist_mlp.py"


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


def _mlp() -> keras.Model:
    inputs = keras.Input((16,), name="x")
    hidden = keras.layers.Dense(32, name="a")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="b")(hidden), name="mlp")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_another_users_profile_entry_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Campaign 34p a (D1): a profile cache entry another user wrote in a shared cache (times a
    thousand times too long) was read, and root's plan predicted 4.965 s for a 6.651 ms step,
    exit 0. It is ignored with a warning, as the trace cache's entries are (row 153)."""
    from cost_models.measure import profiled

    key = "b" * 64
    entry = tmp_path / "layers" / f"{key}.json"
    entry.parent.mkdir()
    body = {"schema": profiled.CACHE_SCHEMA, "key": key, "repeats": 3}
    entry.write_text(json.dumps({**body, "forward_time_s": 0.2, "backward_time_s": 0.1}))
    assert profiled._read_entry(tmp_path, key) == (0.2, 0.1, 3)
    os.chown(entry, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="cost_models.measure.profiled"):
        assert profiled._read_entry(tmp_path, key) is None
    assert "it belongs to another user (uid 65534)" in caplog.text


@pytest.mark.slow
def test_a_failed_profile_run_leaves_no_cache_entry(tmp_path: Path) -> None:
    """Campaign 34p a (D2): a ``--profile`` run that failed after measuring (no placement fits
    ``--memory-limit 100KiB``) left the profile cache directory and its new entries. They wait
    for the outputs (:class:`~cost_models.measure.profiled.ProfileWrites`), as trace entries do;
    a run that succeeds writes them."""
    base = [str(MNIST), "--gpus", "2", "--device-type", "cpu", "--profile", "--batch-size", "8"]
    failed = _partition(tmp_path, *base, "--memory-limit", "100KiB", "--out", "p.json")
    assert failed.returncode == 2 and "no candidate placement fits" in failed.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "p.json").exists()
    done = _partition(tmp_path, *base, "--out", "p.json")
    assert done.returncode == 0, done.stderr
    assert len(list((tmp_path / "cache" / "layers").glob("*.json"))) > 0


def test_an_output_among_the_cache_entries_is_refused(tmp_path: Path) -> None:
    """Campaign 34p a (D3): ``--out`` naming the trace entry the run stores was written, "Plan
    written to ..." printed, then replaced by the entry (exit 0, the plan lost). An output in
    the cache's entry directories is refused before anything runs."""
    entries = tmp_path / "cache" / "traces"
    entries.mkdir(parents=True)
    done = _partition(
        tmp_path, str(MNIST), "--gpus", "2", "--out", str(entries / f"{'c' * 64}.json")
    )
    assert done.returncode == 2
    assert "is in the trace cache" in done.stderr and "give a path outside it" in done.stderr
    assert list(entries.iterdir()) == []


@pytest.mark.parametrize("given", ["base.json/.", "base.json/..", "."])
def test_an_output_spelled_as_a_directory_is_refused_at_once(tmp_path: Path, given: str) -> None:
    """Campaign 34p a (D6): ``--out base.json/.`` (``base.json`` a file) ran the whole plan, then
    blamed the model's code for making the file. A path whose last part is ``.`` or ``..``
    names a directory, as a trailing slash does (row 111): refused before anything runs."""
    (tmp_path / "base.json").write_text("{}\n")
    done = _partition(tmp_path, str(MNIST), "--gpus", "2", "--out", given)
    assert done.returncode == 2
    assert done.stderr.strip().endswith("which names a directory; give a file path")
    assert "importing" not in done.stderr and (tmp_path / "base.json").read_text() == "{}\n"


@pytest.mark.parametrize("path", [b"plan.json", 3, None, "a\0b"])
def test_plan_save_and_cache_dir_of_no_path_are_one_usage_error(
    tmp_path: Path, path: object
) -> None:
    """Campaign 34p a (D4, D5): ``plan.save(b'x.json')`` (``3``, ``None``) raised a raw
    ``TypeError``, and ``cache_dir='a\\0b'`` a raw ``ValueError: embedded null byte``."""
    from partitioner.core.options import MeasureOptions

    plan = partitioner.partition(_mlp(), gpus=2, batch_size=8, compare_strategies=False)
    with pytest.raises(UsageError, match=r"^Plan\.save( needs a path|=)") as info:
        plan.save(path)  # type: ignore[arg-type]
    assert "\n" not in str(info.value) and "plan.save('plan.json')" in str(info.value)
    if path is not None:  # no cache_dir is the default one
        with pytest.raises(UsageError, match=r"^cache_dir"):
            MeasureOptions(cache_dir=path)  # type: ignore[arg-type]


def test_pipeline_advice_names_what_to_run_in_the_users_terms() -> None:
    """Campaign 34p b (D1, D2): a ``--pipeline`` plan said "passes.rewrite.replicate.
    realise_strategy runs the plain split strategy" (a module path, and not what the plan
    runs) and that data parallelism "is worth comparing" under the table that compared it;
    on the command line its idle devices were advised ``strategy='auto'``, the library's
    spelling of what the run already did. The advice names the argument to change, and the
    command line spells it as its flags."""
    from partitioner.cli.main import cli_message

    model = _mlp()
    plan = partitioner.partition(model, gpus=4, batch_size=8, pipeline=True, schedule="gpipe")
    text = " ".join(plan.advice)
    assert "passes." not in text and "worth comparing" not in text
    assert "(without pipeline=True)" in text or "without pipeline=True," in text
    spelled = " ".join(cli_message(line) for line in plan.advice)
    assert "pipeline=True" not in spelled and "--pipeline" in spelled
    assert "strategy='" not in spelled and "--strategy " in spelled


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["env", "file"])
def test_another_keras_backend_is_one_line(tmp_path: Path, setting: str) -> None:
    """Campaign 34p c (D1): ``KERAS_BACKEND=jax`` (or ``keras.json`` saying ``"backend": "jax"``)
    without JAX installed gave ``internal error: ModuleNotFoundError: No module named 'jax'``,
    exit 1. It names the setting and what to set instead."""
    env = {"KERAS_BACKEND": "jax"} if setting == "env" else {"KERAS_HOME": str(tmp_path / "kh")}
    (tmp_path / "kh").mkdir()
    (tmp_path / "kh" / "keras.json").write_text('{"backend": "jax"}')
    clean = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "KERAS_HOME")}
    environment = {**clean, "PYTHONPATH": str(REPO), **env}
    done = subprocess.run(
        [sys.executable, "-m", "partitioner", str(MNIST), "--gpus", "2", "--out", "p.json"],
        capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("partition: error: partitioner traces through Keras's TensorFlow")
    named = "KERAS_BACKEND='jax' selects another" if setting == "env" else "keras.json selects"
    assert named in line and "KERAS_BACKEND=tensorflow" in line
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_a_model_replacing_json_or_os_replace_still_gets_its_plan(tmp_path: Path) -> None:
    """Campaign 34p c (D2, D3): a model file replacing ``json.dumps`` (``"{not json"``) or
    ``os.replace`` (doing nothing) made the command write a plan that was no JSON, or none, and
    say "Plan written to plan.json", exit 0. The standard library functions the run writes
    with are put back once the model's code is done, with a warning naming them."""
    (tmp_path / "patchy.py").write_text(
        "import json, os, keras\n"
        "json.dumps = lambda *a, **k: '{not json'\n"
        "json.dump = lambda obj, fp, *a, **k: fp.write('{not json')\n"
        "os.replace = lambda a, b, **k: None\n"
        "os.rename = lambda a, b, **k: None\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(4, name='d')])\n"
    )
    done = _partition(tmp_path, "patchy.py", "--gpus", "2", "--out", "plan.json")
    assert done.returncode == 0, done.stderr
    assert "the model's code replaced json.dump, json.dumps, os.rename, os.replace" in done.stderr
    assert load_plan(tmp_path / "plan.json").model_name == "sequential"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == [
        "patchy.py",
        "plan.json",
    ]


def test_an_output_the_run_reads_before_the_model_runs_is_refused(tmp_path: Path) -> None:
    """Campaign 34q a (D1, D2): ``--report ~/.keras/keras.json`` (Keras reads it when the run
    imports Keras, before the model's code, where no hook watches) and ``--out`` naming the
    packaged device catalog were replaced by the plan, exit 0: Keras then ran on its defaults,
    and every later ``partition`` failed. Both are refused before anything runs."""
    settings = '{"floatx": "float64", "backend": "tensorflow"}'
    (tmp_path / "kh").mkdir()
    (tmp_path / "kh" / "keras.json").write_text(settings)
    env = {"KERAS_HOME": str(tmp_path / "kh")}
    done = _partition(tmp_path, str(MNIST), "--gpus", "2", "--report", "kh/keras.json", env=env)
    assert done.returncode == 2
    assert "is Keras's configuration file, which this run reads" in done.stderr
    assert (tmp_path / "kh" / "keras.json").read_text() == settings
    inside = REPO / "cost_models" / "data" / "not_a_catalog.json"
    try:
        done = _partition(tmp_path, str(MNIST), "--gpus", "2", "--out", str(inside))
        assert done.returncode == 2 and "is in partitioner's own installation" in done.stderr
        assert not inside.exists()
    finally:
        inside.unlink(missing_ok=True)


def test_a_broken_packaged_catalog_is_one_line(tmp_path: Path) -> None:
    """Campaign 34q a (D3): a packaged device catalog that no longer parses (replaced by a
    plan, a damaged install) made every command, ``--help`` too, end in a traceback from the
    parser's construction. One line, naming the file and saying to reinstall."""
    import shutil

    for package in ("partitioner", "cost_models", "passes"):
        shutil.copytree(REPO / package, tmp_path / "copy" / package)
    (tmp_path / "copy" / "cost_models" / "data" / "devices.json").write_text("{}\n")
    env = {"PYTHONPATH": str(tmp_path / "copy")}
    for args in (["devices"], [str(MNIST), "--gpus", "2"]):
        done = _partition(tmp_path, *args, env=env)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            "partition: error: device catalog data/devices.json: (top level): is missing key "
            "'devices'; reinstall the package"
        ]


def test_a_plan_refuses_a_layer_of_another_class_under_its_name() -> None:
    """Campaign 34q b (D1): a plan made with layer ``mix`` an ``Activation`` applied, without a
    word, to the same model with ``mix`` a weightless custom layer of fifty matmuls (16.6x the
    step the plan predicted): the fingerprint recorded weights and wiring, not classes. Each
    layer's class is recorded and compared, and survives the plan file."""

    class Heavy(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            for _ in range(3):
                x = keras.ops.matmul(x, keras.ops.ones((32, 32)))
            return x

    def model(heavy: bool) -> keras.Model:
        inputs = keras.Input((16,), name="x")
        h = keras.layers.Dense(32, name="a")(inputs)
        h = (Heavy(name="mix") if heavy else keras.layers.Activation("linear", name="mix"))(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="b")(h), name="m")

    plan = partitioner.partition(model(False), gpus=2, batch_size=8, compare_strategies=False)
    assert plan.fingerprint is not None and dict(plan.fingerprint.layer_classes)["mix"] == (
        "Activation"
    )
    again = type(plan).from_json_dict(json.loads(plan.to_json()))
    for made in (plan, again):
        with pytest.raises(
            PlanError, match=r"layer 'mix' is a .*Heavy here, but the plan was made"
        ):
            made.apply(model(True), devices=["/device:CPU:0", "/device:CPU:1"])


def test_a_layer_refusing_its_build_is_named(tmp_path: Path) -> None:
    """Campaign 34q c (D1): an unbuilt Sequential whose custom layer's ``build`` refuses the
    shape was reported as the model's error (``model 'br' raised ValueError while built``),
    the failing layer named nowhere. The layer whose method raised is named."""
    (tmp_path / "br.py").write_text(
        "import keras\n"
        "class B(keras.layers.Layer):\n"
        "    def build(self, shape):\n"
        "        raise ValueError(f'build says no for shape {shape}')\n"
        "    def call(self, x):\n"
        "        return x\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.layers.Dense(4, name='d0'), B(name='bad')], name='br')\n"
    )
    done = _partition(tmp_path, "br.py", "--gpus", "2", "--input-shape", "8", "--out", "p.json")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "partition: error: layer 'bad' (B) of model 'br' raised ValueError while built: build "
        "says no for shape (None, 4); it was traced at --batch-size 32 with --input-shape 8"
    ]


@pytest.mark.slow
def test_a_model_removing_a_module_from_sys_modules_still_gets_its_plan(tmp_path: Path) -> None:
    """Campaign 34q c (D2): ``sys.modules["hashlib"] = None`` in the model file made the run's
    next import of ``hashlib`` fail: ``internal error: ModuleNotFoundError``, exit 1. What the
    model's code set to None or removed there is put back once it is done, with a warning."""
    (tmp_path / "hm.py").write_text(
        "import sys, keras\n"
        "sys.modules['hashlib'] = None\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name='d')])\n"
    )
    done = _partition(tmp_path, "hm.py", "--gpus", "2", "--out", "plan.json")
    assert done.returncode == 0, done.stderr
    assert "the model's code removed or replaced hashlib in sys.modules; the run put them back" in (
        done.stderr
    )
    assert load_plan(tmp_path / "plan.json").layer_order == ("d",)


@pytest.mark.parametrize("cluster", ["", "  ", b'{"worker": ["localhost:1"]}'])
def test_a_cluster_argument_of_nothing_says_what_to_give(cluster: object) -> None:
    """Campaign 34q c (D3, D4): ``plan.apply(model, cluster="")`` said ``cannot read cluster
    file '.': it is a directory``; a cluster of the wrong type was told to pass ``None for
    TF_CONFIG``, which ``Plan.apply`` takes as no cluster (the plan then applied to local
    devices). The empty value is named, and the advice works for every caller."""
    from passes.cluster.runtime import load_cluster

    with pytest.raises(UsageError) as info:
        load_cluster(cluster)  # type: ignore[arg-type]
    message = str(info.value)
    assert "None" not in message and "os.environ['TF_CONFIG']" in message
    assert "'.'" not in message and "directory" not in message


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_a_sticky_directory_a_group_may_write_is_shared_too(tmp_path: Path) -> None:
    """Campaign 34r a (D1): in a sticky directory only its group may write (mode 1770, a team's
    directory), another user's link was followed (root's own file outside it overwritten) and
    their file replaced, kept writable by them: only world-writable sticky directories counted
    as shared. Group-writable ones do too, as Linux's ``protected_regular=2`` has it."""
    from partitioner.core.errors import OutputError
    from partitioner.core.files import check_links_followed, check_output_path

    team = tmp_path / "team"
    team.mkdir()
    os.chown(team, 0, 65534)
    team.chmod(0o1770)
    own = tmp_path / "rootfile.txt"
    own.write_text("root's\n")
    (team / "link.json").symlink_to(own)
    os.chown(team / "link.json", 65534, 65534, follow_symlinks=False)
    (team / "p.json").write_text("theirs\n")
    os.chown(team / "p.json", 65534, 65534)
    with pytest.raises(OutputError, match="a sticky directory its group may write to"):
        check_links_followed(team / "link.json", "--out")
    with pytest.raises(OutputError, match="a sticky directory its group may write to"):
        check_output_path(team / "p.json", "--out")
    assert own.read_text() == "root's\n" and (team / "p.json").read_text() == "theirs\n"


def test_cache_entries_are_private_and_one_others_may_write_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Campaign 34r a (D2): under ``umask 000`` the trace cache's entries were made 0666 and its
    directory 0777: another user edited root's entry in place (owner unchanged) and the next
    run served it (25.4 s for an 8.8 ms step), exit 0. Entries are written 0600 whatever the
    umask, and an entry other users may write is ignored with a warning."""
    from passes.trace import trace_model
    from passes.trace_cache import TraceCache, trace_key

    model = _mlp()
    traced = trace_model(model, batch_size=8)
    cache = TraceCache(tmp_path)
    cache.pending[trace_key(model, 8, None)] = (traced, cache.forward_signature(model, 8, None))
    old = os.umask(0)
    try:
        cache.flush()
    finally:
        os.umask(old)
    (entry,) = (tmp_path / "traces").iterdir()
    assert entry.stat().st_mode & 0o777 == 0o600
    assert TraceCache(tmp_path).trace(model, 8, None).graph == traced.graph
    entry.chmod(0o666)
    reader = TraceCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="passes.trace_cache"):
        reader.trace(model, 8, None)
    assert reader.hits == 0 and "other users may write it (mode 0666)" in caplog.text


def test_the_strategy_refinement_ends_by_its_moves_not_the_clock() -> None:
    """Campaign 34r b (D1): the same ``--strategy hybrid`` command planned three different
    strategies on a busy machine (7.310 / 7.808 / 8.017 ms): the refinement ran for the time
    left after scoring. It ends by its move budget (the same plan on any machine); the time
    limit only caps it, and a plan it cut says so."""
    from partitioner.core.ir import Schedule
    from partitioner.core.strategy import Strategy
    from partitioner.planner.refine import refine
    from partitioner.simulation.strategy import simulate_strategy
    from tests.planner.strategy_graphs import FAST_LINK, chain_at, uniform_topology

    costed = chain_at(
        16, full_batch=16, topology=uniform_topology(2, FAST_LINK), fwd_s=(1.0,) * 8,
        weight_bytes=(1,) * 8, act_bytes=8,
    )  # fmt: skip
    start = simulate_strategy(costed, Strategy(((0, 1),), (0,) * 7 + (1,), 8, Schedule.ONE_F_ONE_B))
    runs = [refine(costed, start, seed=3, time_limit_s=60.0) for _ in range(2)]
    assert runs[0] == runs[1] and not runs[0].cut_by_time and runs[0].moves > 0
    cut = refine(costed, start, seed=3, time_limit_s=0.0)
    assert cut.cut_by_time and cut.moves == 0 and cut.best == start


def test_a_copy_starts_with_the_originals_state_and_output_names() -> None:
    """Campaign 34r c (D1, D2): building the copy ``plan.apply`` returns ran one forward pass on
    its variables, so a layer counting its calls started one ahead of the original; and a
    two-output copy lost its outputs' names (``fit`` reported ``mse_loss``, ``mae``, ``mae_1``
    for ``o1_loss``, ``o1_mae``, ``o2_loss``, ``o2_mae``). Placed, data-parallel and pipelined
    copies keep both."""
    import numpy as np

    class Counter(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.count = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                         trainable=False, name="count")  # fmt: skip

        def call(self, x: Any) -> Any:
            self.count.assign_add(1)
            return x

    inputs = keras.Input((16,), name="x")
    h = Counter(name="cnt")(keras.layers.Dense(8, name="a")(inputs))
    outputs = [keras.layers.Dense(2, name="o1")(h), keras.layers.Dense(3, name="o2")(h)]
    model = keras.Model(inputs, outputs, name="two")
    x, y = np.ones((8, 16), "float32"), [np.zeros((8, 2)), np.ones((8, 3))]
    for strategy in ("placed", "data_parallel", "pipeline"):
        plan = partitioner.partition(model, gpus=2, batch_size=8, strategy=strategy)
        copy = plan.apply(model, devices=["/device:CPU:0", "/device:CPU:1"])
        assert [int(w) for w in copy.get_weights() if w.dtype.kind == "i"] == [0], strategy
        copy.compile(optimizer="sgd", loss=["mse", "mse"], metrics=[["mae"], ["mae"]])
        history = copy.fit(x, y, epochs=1, verbose=0, batch_size=8).history
        assert sorted(history) == ["loss", "o1_loss", "o1_mae", "o2_loss", "o2_mae"], strategy


def test_plan_save_refuses_a_programs_own_source(tmp_path: Path) -> None:
    """Campaign 34s a (D1): ``plan.save(os.path.abspath("tiny.py"))`` (a module the program
    imported) and ``plan.save("lib.py")`` from the running script replaced their source with
    the plan, exit 0; the command line refuses such outputs (rows 10, 61), the library did not."""
    from partitioner.core.errors import OutputError

    source = tmp_path / "own_module_34s.py"
    source.write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        __import__("own_module_34s")
        plan = partitioner.partition(_mlp(), gpus=2, batch_size=8, compare_strategies=False)
        with pytest.raises(OutputError, match="is the source of module 'own_module_34s'"):
            plan.save(source)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("own_module_34s", None)
    assert source.read_text() == "VALUE = 1\n"


def test_a_long_legal_output_name_is_written(tmp_path: Path) -> None:
    """Campaign 34s a (D2): a 250-character name (legal: ``touch`` takes it) failed as "File name
    too long" after the whole run: the temporary file beside it was named ``.NAME.XXXXXXXX.tmp``.
    The temporary (and backup) names cut the name to 200 bytes."""
    from partitioner.core.files import write_all_atomic

    name = "p" * 245 + ".json"
    write_all_atomic([(tmp_path / name, "new\n"), (tmp_path / "other.json", "two\n")])
    write_all_atomic([(tmp_path / name, "again\n"), (tmp_path / "other.json", "three\n")])
    assert (tmp_path / name).read_text() == "again\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "other.json"])


def test_the_cache_directories_themselves_are_refused_as_outputs(tmp_path: Path) -> None:
    """Campaign 34s a (unclear Q3): ``--out $PARTITIONER_CACHE_DIR/traces`` (not made yet)
    became a file of that name, and every later run's cache failed ("File exists")."""
    (tmp_path / "cache").mkdir()
    done = _partition(tmp_path, str(MNIST), "--gpus", "2", "--out", "cache/traces")
    assert done.returncode == 2 and "is in the trace cache" in done.stderr
    assert not (tmp_path / "cache" / "traces").exists()


class _Cast(keras.layers.Layer):
    """Computes in ``self.compute_in`` (not in its config: a file read through TensorFlow's
    file layer stands behind it in the campaign's case)."""

    compute_in = "float16"

    def call(self, x: Any) -> Any:
        return keras.ops.cast(keras.ops.cast(x, self.compute_in) * 2, "float32")


def test_the_forward_signature_sees_a_layer_computing_in_another_dtype() -> None:
    """Campaign 34s b (D1): a layer casting to a dtype read through ``tf.io.gfile`` (float16,
    then float64) was served its float16 trace: the forward signature hashed each op's type and
    shapes, not its dtypes. It hashes the dtypes too."""
    from passes.trace import forward_signature

    inputs = keras.Input((16,), name="x")
    layer = _Cast(name="cast")
    model = keras.Model(inputs, keras.layers.Dense(4, name="b")(layer(inputs)), name="c")
    before = forward_signature(model, batch_size=None)
    layer.compute_in = "float64"
    assert forward_signature(model, batch_size=None) != before


def test_a_plan_whose_keys_were_sorted_still_loads() -> None:
    """Campaign 34s b (D3): ``jq -S .`` (or ``json.dump(sort_keys=True)``) of a correct plan was
    refused (``field 'assignment' puts layer 'dense_out' on device 1, but field 'strategy' ...``):
    the layer order was the order of ``assignment``'s keys. Plans carry ``layer_order``."""
    inputs = keras.Input((16,), name="x")
    hidden = keras.layers.Dense(32, name="z_first")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="a_last")(hidden), name="zm")
    plan = partitioner.partition(model, gpus=2, batch_size=8, compare_strategies=False)
    data = json.loads(json.dumps(json.loads(plan.to_json()), sort_keys=True))
    assert list(data["assignment"]) == sorted(plan.layer_order) != list(plan.layer_order)
    again = type(plan).from_json_dict(data)
    assert again.layer_order == plan.layer_order and again.assignment == plan.assignment


def test_a_layer_running_a_loop_is_named_in_the_cost_notes() -> None:
    """Campaign 34s b (D2): a ``tf.while_loop`` run 200 times was predicted as 2 (one pass of its
    body; 186x under the same work unrolled), without a word. The trace cannot know a loop's
    trip count; the plan names the layers that run one."""

    class Loop(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            import tensorflow as tf

            _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 2.0), (0, x))
            return h

    inputs = keras.Input((16,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(4, name="b")(Loop(name="loop")(inputs)))
    plan = partitioner.partition(model, gpus=2, batch_size=8, compare_strategies=False)
    assert any("layers 'loop' run a loop (tf.while_loop)" in n for n in plan.cost_notes)
    plain = partitioner.partition(_mlp(), gpus=2, batch_size=8, compare_strategies=False)
    assert not any("run a loop" in n for n in plain.cost_notes)


@pytest.mark.slow
def test_a_model_replacing_open_still_gets_its_plan(tmp_path: Path) -> None:
    """Campaign 34s c (D1): a model file replacing ``builtins.open`` / ``io.open`` (writes into a
    ``StringIO``) ended the run in ``internal error: UnsupportedOperation: fileno``, exit 1: the
    run's own watch of the next block of model code opened its channel through them. What the
    model's code replaced is put back after each block of it (its loading, its trace)."""
    (tmp_path / "op.py").write_text(
        "import io, builtins, keras\n"
        "_open = builtins.open\n"
        "def fake(f, mode='r', *a, **k):\n"
        "    if 'w' in mode:\n"
        "        return io.BytesIO() if 'b' in mode else io.StringIO()\n"
        "    return _open(f, mode, *a, **k)\n"
        "builtins.open = io.open = fake\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name='d')])\n"
    )
    done = _partition(tmp_path, "op.py", "--gpus", "2", "--out", "plan.json")
    assert done.returncode == 0, done.stderr
    assert "the model's code replaced builtins.open, io.open" in done.stderr
    assert load_plan(tmp_path / "plan.json").layer_order == ("d",)


def test_the_refinement_is_capped_by_the_users_time_limit_not_the_searchs() -> None:
    """Campaign 34t b (D1): the refinement was capped by the strategy comparison's own 2 s, so
    on a busy machine a 72-layer model's chain stopped after 166-237 moves, every run elsewhere,
    and its note's advice (raise time_limit_s) changed nothing. Its cap is the user's limit."""
    from partitioner.core.strategy import Family
    from partitioner.planner.search import StrategyOptions, search_strategies
    from tests.planner.strategy_graphs import SLOW_LINK, chain_costs, uniform_topology

    costs = chain_costs(
        32, topology=uniform_topology(4, SLOW_LINK), fwd_s=(1.0, 2.0, 3.0, 1.0),
        weight_bytes=(100_000,) * 4, act_bytes=8,
    )  # fmt: skip
    families = (Family.PIPELINE,)

    def notes(**limits: float) -> str:
        options = StrategyOptions(families=families, **limits)  # type: ignore[arg-type]
        return " ".join(search_strategies(costs, 32, options).notes)

    assert "stopped at" not in notes(time_limit_s=1e-9, refine_limit_s=60.0)
    assert "stopped at time_limit_s=1e-09" in notes(time_limit_s=60.0, refine_limit_s=1e-9)


def test_a_plan_refuses_a_layer_frozen_or_unfrozen_since() -> None:
    """Campaign 34t b (D2): a plan made with layer ``b`` frozen applied, without a word, to the
    model with ``b`` trainable (its gradients and Adam's slots: four times the memory the plan
    predicted on that device). The fingerprint records how many of each layer's weights
    train."""

    def model(frozen: bool) -> keras.Model:
        made = _mlp()
        made.get_layer("a").trainable = not frozen
        return made

    plan = partitioner.partition(model(True), gpus=2, batch_size=8, compare_strategies=False)
    again = type(plan).from_json_dict(json.loads(plan.to_json()))
    for made in (plan, again):
        with pytest.raises(
            PlanError, match=r"layer 'a' trains 2 of its weights here, but the plan"
        ):
            made.apply(model(False), devices=["/device:CPU:0", "/device:CPU:1"])
    assert plan.apply(model(True), devices=["/device:CPU:0", "/device:CPU:1"]) is not None
