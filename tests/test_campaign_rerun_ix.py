"""Hostile input III (issue 34), campaign 34i's rerun leftovers and campaign 34j: the defects
found, each at its mechanism.

- A builder that runs a ``multiprocessing`` pool of the ``spawn`` start method hung silently:
  the model file was imported under a private module name, which a spawned child (importing a
  function's module by name to unpickle it) could not import; it died unseen and the pool
  started another for ever. The model file is now imported under its own name wherever that
  name imports the file back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from partitioner.cli import loader
from partitioner.core.files import MODEL_MODULE_FLAG

REPO = Path(__file__).resolve().parents[1]

SPAWN_POOL_MODEL = '''
import multiprocessing

import keras


def width(i):
    return 8 * (i + 1)


def build_model():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        widths = pool.map(width, [0, 1])
    inputs = keras.Input((4,))
    x = inputs
    for w in widths:
        x = keras.layers.Dense(w, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))
'''


@pytest.mark.slow
def test_a_builder_running_a_spawn_pool_plans(tmp_path: Path) -> None:
    (tmp_path / "spawnpool.py").write_text(SPAWN_POOL_MODEL)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "partitioner", "spawnpool.py", "--gpus", "2", "--batch-size", "8",
         "--strategy", "single", "--out", "p.json"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Plan written to p.json" in run.stdout
    # the pool's widths (8, 16) made the layers
    assert '"dense_1"' in (tmp_path / "p.json").read_text()


@pytest.mark.parametrize(
    ("file_name", "own_name"),
    [
        ("spawnpool_c34j.py", True),
        ("json.py", False),  # the standard library's: importing it back would shadow json
        ("my-model.py", False),  # not an identifier
        ("class.py", False),  # a keyword
        ("pytest.py", False),  # an installed module's name
        ("os.py", False),  # already imported
    ],
)
def test_the_model_module_takes_its_own_name_only_where_it_imports_back(
    tmp_path: Path, file_name: str, own_name: bool
) -> None:
    path = tmp_path / file_name
    path.write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        name = loader._module_name(path)
    finally:
        sys.path.remove(str(tmp_path))
    assert (name == path.stem) is own_name
    assert own_name or name.startswith("_partitioner_model_")


def test_the_model_module_is_flagged_for_codegen(tmp_path: Path) -> None:
    from passes.rewrite.codegen import _is_model_module

    path = tmp_path / "flagged_c34j.py"
    path.write_text("X = 1\n")
    module = loader._import_file(path)
    try:
        assert getattr(module, MODEL_MODULE_FLAG) is True
        assert _is_model_module(module.__name__)
        assert not _is_model_module("json")
    finally:
        sys.modules.pop(module.__name__, None)


DAEMON = """\
import os
import time


def _daemon():
    if os.fork() == 0:
        if os.fork() == 0:
            os.setsid()
            with open({pidfile!r}, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        os._exit(0)


_daemon()
os.wait()
print("the model's own line")
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="no /proc here")
def test_a_daemon_the_model_forks_twice_does_not_hold_the_pipes(tmp_path: Path) -> None:
    """Campaign 34h c D3 (34i c D3): a daemon forked twice (reparented away, a session of its
    own) is out of reach of the stop of the model's children, and held the run's stdout (and the
    CLI's copies of it and of stderr): ``partition ... | cat`` waited for it. It now has none of
    them; what the model's code prints itself is still shown."""
    from tests.test_process_hygiene import TINY, _start
    from tests.test_process_hygiene_iv import EOF_TIMEOUT_S, _kill_quietly

    pidfile = tmp_path / "daemon.pid"
    model = tmp_path / "daemon.py"
    model.write_text(DAEMON.format(pidfile=str(pidfile)) + TINY)
    proc = _start(
        [model, "--gpus", "2", "--no-strategies", "--out", tmp_path / "p.json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    alive = False
    try:
        out, err = proc.communicate(timeout=EOF_TIMEOUT_S + 120)
        alive = Path(f"/proc/{int(pidfile.read_text())}/fd").exists()
    except subprocess.TimeoutExpired:
        pytest.fail("stdout/stderr stayed open: the daemon holds them")
    finally:
        if pidfile.exists():
            _kill_quietly(int(pidfile.read_text()))
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"the model's own line" in out and b"Plan written to" in out
    assert alive  # the pipes closed while the daemon still ran


@pytest.mark.parametrize("bind", ["[0.0.0.0", "0.0.0.0]", "[[::]]", "[::]]", "[127.0.0.1"])
def test_a_bind_of_unpaired_brackets_is_a_typo_not_every_interface(bind: str) -> None:
    """Campaign 34i a (N15d, L4): brackets were stripped from both ends however many there
    were, so ``[0.0.0.0`` opened the worker on every interface (with a warning) where row 55
    refuses a typo. Only one pair around the whole address is taken off."""
    from partitioner.cli.worker import check_bind
    from partitioner.core.errors import UsageError

    with pytest.raises(UsageError) as info:
        check_bind(bind)
    assert str(info.value).startswith(f"--bind {bind!r} is not an address (its brackets")
    assert check_bind("[::1]") is True and check_bind("[::]") is False


def test_a_bind_that_is_no_string_says_its_type() -> None:
    """Campaign 34i a (L2): ``run_worker(bind=IPv4Address("0.0.0.0"))`` was refused as "not an
    address", which it is; it is not a string."""
    import ipaddress

    from partitioner.cli.worker import check_bind
    from partitioner.core.errors import UsageError

    with pytest.raises(UsageError) as info:
        check_bind(ipaddress.ip_address("0.0.0.0"))  # type: ignore[arg-type]
    assert str(info.value).startswith(
        "--bind IPv4Address('0.0.0.0') is not a string (its type is IPv4Address); give the "
        "address as text"
    )


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_an_output_through_another_users_link_in_a_shared_directory_is_refused(
    tmp_path: Path,
) -> None:
    """Campaign 34j a (P11, L2): outputs resolve their links themselves and rename over the
    target, so the kernel's ``protected_symlinks`` never ran: another user's link planted in a
    sticky directory anyone may write (``/tmp``) had the run replace the file it pointed at.
    Such a link is refused (``Plan.save`` and every CLI output); the user's own is followed."""
    from partitioner.core.errors import OutputError
    from partitioner.core.files import check_output_path, write_atomic

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own text\n")
    planted = shared / "plan.json"
    planted.symlink_to(victim)
    os.chown(planted, 65534, 65534, follow_symlinks=False)
    for attempt in (lambda: check_output_path(planted), lambda: write_atomic(planted, "{}")):
        with pytest.raises(OutputError) as info:
            attempt()
        assert f"{planted} is a symbolic link of another user (uid 65534) in {shared}" in str(
            info.value
        )
    assert victim.read_text() == "the user's own text\n"
    # a link to a link: the second, planted one is refused too
    own = shared / "own.json"
    own.symlink_to(planted)
    with pytest.raises(OutputError, match="uid 65534"):
        check_output_path(own)
    # the user's own link, and one the directory's owner made, are followed
    os.chown(planted, os.geteuid(), -1, follow_symlinks=False)
    assert check_output_path(planted) == victim
    os.chown(shared, 65534, -1)
    os.chown(planted, 65534, -1, follow_symlinks=False)
    assert check_output_path(planted) == victim
    # outside a sticky directory anyone may write, the link's owner does not matter
    shared.chmod(0o755)
    os.chown(shared, os.geteuid(), -1)
    assert check_output_path(planted) == victim


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_the_cli_refuses_another_users_link_before_the_model_runs(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own text\n")
    (shared / "r.html").symlink_to(victim)
    os.chown(shared / "r.html", 65534, 65534, follow_symlinks=False)
    (tmp_path / "m.py").write_text(SPAWN_POOL_MODEL.replace("import keras", "import keras\nraise SystemExit('ran')"))
    run = subprocess.run(
        [sys.executable, "-m", "partitioner", "m.py", "--gpus", "2", "--report", "shared/r.html"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.startswith("partition: error: --report shared/r.html: ")
    assert "is a symbolic link of another user (uid 65534)" in run.stderr
    assert victim.read_text() == "the user's own text\n"


def test_a_worker_log_never_empties_a_hard_linked_file_nor_waits_on_a_fifo(
    tmp_path: Path,
) -> None:
    """Campaign 34j a (L1a, L1b): ``start_local_workers`` truncated a hard link at
    ``DIR/worker0.log`` (the user's file it shares emptied and overwritten) and waited for ever
    to open a FIFO there. The log is a new file; a FIFO is one line."""
    from partitioner.cli.worker import LOG_HEADER, _new_log
    from partitioner.core.errors import UsageError

    victim = tmp_path / "victim.txt"
    victim.write_text("user data\n")
    log = tmp_path / "worker0.log"
    os.link(victim, log)
    with _new_log(log) as f:
        f.write(b"partition worker ready\n")
    assert victim.read_text() == "user data\n"
    assert log.read_bytes() == LOG_HEADER.encode() + b"partition worker ready\n"
    fifo = tmp_path / "worker1.log"
    os.mkfifo(fifo)
    with pytest.raises(UsageError) as info:
        _new_log(fifo)  # before: blocked in open() for ever
    assert str(info.value) == (
        f"cannot write the worker log {fifo}: it is a named pipe (FIFO); give a directory "
        "without it"
    )


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_a_timeout_of_an_integer_past_floats_is_one_line(value: int) -> None:
    """Campaign 34j b (DEF-E): ``math.isfinite(10**400)`` raised a raw OverflowError in the
    check of every wait (``Plan.apply(timeout_s=...)``, ``step_timeout_s``, calibration's);
    ``time_limit_s`` was refused in one line. The value is shown cut short, as there."""
    from partitioner.core.errors import UsageError
    from passes.cluster.calibrate import check_timeout_s

    with pytest.raises(UsageError) as info:
        check_timeout_s("timeout_s", value)
    message = str(info.value)
    assert message.startswith(f"timeout_s={str(value)[:37]}...") and len(message) < 160


# -- campaign 34j b: a plan file's predictions agree with the plan ------------------------------


@pytest.fixture(scope="module")
def compared(mlp: Any) -> Any:
    """A two-stage pipeline of ``mlp`` with its strategies table and timeline."""
    import partitioner

    return partitioner.partition(
        mlp, gpus=2, batch_size=16, solver="even", pipeline=True, num_microbatches=2
    )


def _chosen_row(data: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in data["strategies"] if r["chosen"])


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda d: _chosen_row(d).update(peak_memory_bytes=2**45),
         ".fits' is true, but its peak of 35184372088832 bytes is over its limit"),
        (lambda d: d["strategies"][-1].update(chosen=True),
         "field 'strategies' marks rows [0, 3] chosen; one is the fastest"),
        (lambda d: d["strategies"][-1].update(family=d["strategies"][0]["family"]),
         "field 'strategies[3]' is a second "),
        (lambda d: _chosen_row(d).update(step_time_s=1e-3),
         " 0.001 s) is marked chosen, but "),
        (lambda d: d["timeline"][0].update(resource="device 7"),
         "field 'timeline[0].resource' is 'device 7', not one of the plan's 2 devices"),
        (lambda d: d["timeline"][0].update(resource="link 1->1"),
         "field 'timeline[0].resource' is 'link 1->1'"),
        (lambda d: d["predicted"]["transfer_bytes"].append(0),
         "field 'predicted.transfer_bytes' has 3 entries for the plan's 2 devices"),
        (lambda d: d["pipeline"]["bubble_fraction"].append(0.1),
         "field 'pipeline.bubble_fraction' has 3 entries for the plan's 2 devices"),
        (lambda d: d["timeline"][0].update(end_s=5.0),
         "field 'timeline' ends at 5.0 s, after 'predicted.step_time_s' "),
        (lambda d: d["predicted"]["compute_s"].__setitem__(0, 0.5),
         "field 'predicted.compute_s[0]' is 0.5 s, more than 'predicted.step_time_s' "),
        (lambda d: d["predicted"]["memory_limit_bytes"].__setitem__(0, 2**30),
         "field 'predicted.memory_limit_bytes[0]' is 1073741824, but 'devices[0].memory_bytes'"),
        (lambda d: d["strategies"][0].update(memory_limit_bytes=2**30),
         "field 'strategies[0].memory_limit_bytes' is 1073741824, no device's memory"),
        (lambda d: d["baselines"].append(d["baselines"][0]),
         "field 'baselines' lists solver "),
    ],
    ids=["fits-over-limit", "two-chosen", "family-twice", "chosen-slower",
         "timeline-device", "timeline-self-link", "transfer-bytes", "bubbles", "timeline-end",
         "compute-over-step", "limit-not-memory", "row-limit", "baseline-twice"],
)  # fmt: skip
def test_a_plan_files_predictions_must_agree_with_the_plan(
    compared: Any, tmp_path: Path, edit: Any, says: str
) -> None:
    """Campaign 34j b (DEF-A..D): each edit was shown with exit 0 and applied: a strategies row
    that fits at 133% of its memory, two rows chosen, one family twice or a slower row marked
    fastest, a timeline row for a device the plan has not, lists of another length
    than the devices or stages. (The chosen row is the fastest family, which a plan told to
    pipeline need not run.)"""
    from partitioner.core.errors import PlanError
    from partitioner.plan.model import load_plan
    from tests.test_plan_consistency_vii import _written

    assert compared.strategy is not None and compared.strategies and compared.timeline
    assert load_plan(compared.save(tmp_path / "same.json")).strategies == compared.strategies
    path = _written(compared, tmp_path, edit)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message


def test_tf_config_is_read_in_its_own_form_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Campaign 34j c (DD): calibrate and the worker took ``TF_CONFIG='{"worker": [...]}'``
    (a cluster file's bare form, which TensorFlow reads no cluster from) and calibrate's advice
    showed that form, while the planner refused it. TF_CONFIG needs its ``cluster`` key in
    every command; a cluster file or mapping may still be the bare form."""
    from partitioner.core.errors import UsageError
    from passes.cluster.runtime import load_cluster

    monkeypatch.setenv("TF_CONFIG", '{"worker": ["localhost:2222"]}')
    with pytest.raises(UsageError) as info:
        load_cluster(None)
    assert str(info.value).startswith(
        "TF_CONFIG: (top level): is missing key 'cluster', under which TensorFlow reads the jobs"
    )
    monkeypatch.setenv("TF_CONFIG", '{"worker": ["localhost:2222"')
    with pytest.raises(UsageError, match=r'it should look like \{"cluster": \{"worker"'):
        load_cluster(None)
    assert load_cluster({"worker": ["localhost:2222"]}).addresses == ("localhost:2222",)


def test_an_unbuilt_sequential_runs_any_batch_and_is_split(tmp_path: Path) -> None:
    """Campaign 34j c (DB): a ``keras.Sequential`` without ``keras.Input`` was built by its
    first (traced) call at batch 8, which Keras records as a fixed batch: data parallelism and
    pipelines were refused "as a stateful layer needs", and ``auto`` left them out silently.
    It is built with the batch unknown, as ``keras.Input(shape=...)`` would declare it."""
    import keras

    import partitioner
    from passes.trace import fixed_batch

    model = keras.Sequential(
        [keras.layers.Dense(16, name="d1"), keras.layers.Dense(2, name="d2")], name="unbuilt"
    )
    plan = partitioner.partition(
        model, gpus=2, batch_size=8, input_shape=(16,), strategy="data_parallel",
        device_type="cpu",
    )  # fmt: skip
    assert plan.strategy is not None and plan.strategy.replicas == 2
    assert fixed_batch(model) is None and model.inputs[0].shape == (None, 16)


MAKES_ITS_VOCABULARY = """\
import tensorflow as tf

with tf.io.gfile.GFile("vocab.txt", "w") as f:
    f.write("a\\nb\\n")
VOCABULARY = tf.io.gfile.GFile("vocab.txt").read()
"""


@pytest.mark.slow
def test_an_output_the_model_made_while_it_ran_is_not_replaced(tmp_path: Path) -> None:
    """Campaign 34j a (S3): a file that was not there when the run started, which the model's
    code made and read back through TensorFlow's file layer (no hook sees it, and no watch was
    set on a file that did not exist), was replaced by the plan with exit 0."""
    from tests.test_process_hygiene import TINY

    (tmp_path / "m.py").write_text(MAKES_ITS_VOCABULARY + TINY)
    run = subprocess.run(
        [sys.executable, "-m", "partitioner", "m.py", "--gpus", "2", "--out", "vocab.txt"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == (
        "partition: error: --out vocab.txt did not exist when the run started, and something "
        "made it while the run went on (the model's code, or another process); refusing to "
        "overwrite it: give another path"
    )
    assert (tmp_path / "vocab.txt").read_text() == "a\nb\n"


def test_a_plain_function_in_a_keras_layers_config_is_told_to_register_it() -> None:
    """Campaign 34j c (DA): a ``Dense`` given an unregistered ``kernel_regularizer`` (or
    ``activation``) function was told to "pass **kwargs to super().__init__ and implement
    get_config", advice for a custom layer; the way out is registering the function."""
    import keras

    from partitioner.core.errors import RewriteError
    from passes.checks import check_rebuildable

    def my_l2(w: Any) -> Any:
        return 0.01 * keras.ops.sum(keras.ops.square(w))

    def my_act(x: Any) -> Any:
        return keras.ops.relu(x)

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="d1", kernel_regularizer=my_l2, activation=my_act)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="d2")(hidden))
    with pytest.raises(RewriteError) as info:
        check_rebuildable(model)
    message = str(info.value)
    assert message.startswith("layer 'd1' (Dense) cannot be rebuilt from its config")
    assert "decorate my_act, my_l2 with @keras.saving.register_keras_serializable()" in message
    assert "super().__init__" not in message


def test_a_plan_that_does_not_fit_a_given_memory_limit_names_it(mlp: Any) -> None:
    """Campaign 34j b (CD, unclear): ``--memory-limit 16KiB`` below one layer's need was told
    to use larger devices, a smaller batch or split the layer, never the limit the user gave."""
    import partitioner
    from partitioner.core.errors import InfeasibleError

    with pytest.raises(InfeasibleError) as info:
        partitioner.partition(
            mlp, gpus=2, batch_size=16, memory_limit_bytes=16384, compare_strategies=False
        )
    message = str(info.value)
    assert message.endswith("; each device's memory here is memory_limit_bytes=16384 as given")
    assert "\n" not in message


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_another_users_link_anywhere_on_the_path_is_refused(tmp_path: Path) -> None:
    """Campaign 34k a (DEF2): only a planted link at the path's last component was refused;
    one that is a directory of the path (``/tmp/sub`` of ``/tmp/sub/plan.json``) was followed
    by every output, the profile cache and ``start_local_workers``."""
    from cost_models.measure.profiled import cache_write_problem
    from partitioner.cli.worker import start_local_workers
    from partitioner.core.errors import OutputError
    from partitioner.core.files import check_output_path

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir()
    (shared / "sub").symlink_to(victim)
    os.chown(shared / "sub", 65534, 65534, follow_symlinks=False)
    with pytest.raises(OutputError, match=f"{shared / 'sub'} is a symbolic link of another"):
        check_output_path(shared / "sub" / "plan.json")
    with pytest.raises(OutputError, match="uid 65534"):
        start_local_workers(1, shared / "sub" / "w")
    problem = cache_write_problem(shared / "sub" / "cache")
    assert problem is not None and "is a symbolic link of another user" in problem
    assert list(victim.iterdir()) == []


def test_an_output_that_leads_to_an_open_stream_is_refused(tmp_path: Path) -> None:
    """Campaign 34k a (DEF1): ``--out /dev/stdout >> journal.txt`` (stdout a regular file)
    replaced the journal with the plan; only a stdout that is a pipe was refused."""
    from partitioner.core.errors import OutputError
    from partitioner.core.files import check_output_path, write_atomic

    journal = tmp_path / "journal.txt"
    journal.write_text("line 1\n")
    with journal.open("a") as stream:
        fd_path = f"/proc/self/fd/{stream.fileno()}"
        for attempt in (lambda: check_output_path(fd_path), lambda: write_atomic(fd_path, "{}")):
            with pytest.raises(OutputError) as info:
                attempt()
            assert "an open file descriptor (a stream such as stdout), not a file" in str(
                info.value
            )
    assert journal.read_text() == "line 1\n"


def test_checking_a_new_profile_cache_makes_no_directory(tmp_path: Path) -> None:
    """Campaign 34k a (DEF3): a run refused before it measured anything left the new cache
    directory and its ``layers`` behind: the check made them. The first entry makes them."""
    from cost_models.measure.profiled import cache_write_problem

    assert cache_write_problem(tmp_path / "new" / "cache") is None
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    assert cache_write_problem(tmp_path / "file" / "cache") == f"{tmp_path / 'file'} is not a directory"


# -- campaign 34k c -------------------------------------------------------------------------------


def test_an_error_keras_wrapped_is_reported_whole() -> None:
    """Campaign 34k c (D3): Keras's layer-call wrapper keeps an error's first argument only, so
    a missing file in ``call()`` was "raised FileNotFoundError while traced: 2", and a
    ``CalledProcessError`` (which Keras re-raises as a RuntimeError) "RuntimeError ...: 1". The
    error it wrapped, at hand as its context, is reported."""
    import subprocess as sp

    from partitioner.core.errors import error_line, unwrapped

    def wrapped(inner: BaseException, outer: BaseException) -> BaseException:
        outer.__context__ = inner
        return outer

    head = "Exception encountered when calling Vocab.call().\n\n\x1b[1m{}\x1b[0m\n\nArguments"
    missing = wrapped(
        FileNotFoundError(2, "No such file or directory", "vocab.txt"),
        FileNotFoundError(head.format(2)),
    )
    assert error_line(missing) == "[Errno 2] No such file or directory: 'vocab.txt'"
    failed = wrapped(sp.CalledProcessError(1, ["false"]), RuntimeError(head.format(1)))
    assert type(unwrapped(failed)) is sp.CalledProcessError
    assert error_line(failed) == "Command '['false']' returned non-zero exit status 1."
    # an error of another class, or none, is Keras's own message
    other = wrapped(KeyError("k"), ValueError(head.format("bad value")))
    assert error_line(other) == "bad value" and unwrapped(other) is other


def test_calibrates_advice_names_its_flags() -> None:
    """Campaign 34k c (D4): ``partition calibrate`` advised ``cluster=`` (the library's
    spelling) where the command takes ``--cluster``."""
    from partitioner.cli.calibrate import cli_message

    assert cli_message("calibrate them with cluster= (a cluster file)") == (
        "calibrate them with --cluster (a cluster file)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("stdout", ["full", "closed"])
def test_a_worker_whose_stdout_takes_no_line_serves_and_says_so(
    stdout: str, tmp_path: Path
) -> None:
    """Campaign 34k c (D1): ``partition worker >/dev/full`` (or ``>&-``, ``| true``) ended in
    a traceback from its ready line and stopped serving; it says so on stderr and serves."""
    import socket
    import time

    from partitioner.cli.worker import free_ports

    port = free_ports(1)[0]
    cluster = tmp_path / "c.json"
    cluster.write_text(f'{{"worker": ["127.0.0.1:{port}"]}}')
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    sink = open("/dev/full", "w") if stdout == "full" else subprocess.DEVNULL
    cmd = [sys.executable, "-m", "partitioner", "worker", "--cluster", str(cluster), "--task", "0"]
    kwargs: dict[str, Any] = {"stdout": sink} if stdout == "full" else {"close_fds": True}
    if stdout == "closed":
        cmd = ["sh", "-c", 'exec "$@" >&-', "sh", *cmd]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env, **kwargs)
    try:
        deadline = time.monotonic() + 120
        served = False
        while time.monotonic() < deadline and proc.poll() is None and not served:
            with socket.socket() as s:
                served = s.connect_ex(("127.0.0.1", port)) == 0
            time.sleep(0.5)
        assert served and proc.poll() is None  # still serving
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
        if stdout == "full":
            sink.close()
    line = next(x for x in err.decode().splitlines() if "ready" in x)
    reason = "No space left on device" if stdout == "full" else "it is closed"
    assert line == (
        f"partition worker: note: stdout takes no line ({reason}); partition worker ready: task "
        f"0 at 127.0.0.1:{port}"
    )
    assert "Traceback" not in err.decode()


@pytest.mark.parametrize("link", ["nvlink", "nvlink4"])
def test_a_topology_files_nvlink_between_cpus_is_refused(link: str, tmp_path: Path) -> None:
    """Campaign 34k b (DEF4): ``[[links]] devices = [0, 1], link = "nvlink"`` between two CPU
    devices was priced as the host link without a word (``--topology nvlink`` on CPUs is
    refused); ``nvlink4`` was priced as NVLink between CPUs."""
    from cost_models.devices.topology import load_topology
    from partitioner.core.errors import CatalogError

    path = tmp_path / "t.toml"
    path.write_text(
        f'[[devices]]\ntype = "cpu"\ncount = 2\n[[links]]\ndevices = [0, 1]\nlink = "{link}"\n'
    )
    with pytest.raises(CatalogError) as info:
        load_topology(str(path))
    assert str(info.value).endswith(
        f"links[0].link: is {link!r} between devices 0 and 1, but device type 'cpu' has no "
        "NVLink; use link 'pcie' for a CPU"
    )


def test_a_ctrl_c_swallowed_by_the_import_machinery_still_ends_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """CI of cb681eb (``test_ctrl_c_early_is_one_line_130_and_nothing_written[at-1.5s]``): a
    Ctrl-C raised inside a weakref callback of Python's import machinery was printed as
    "Exception ignored ... KeyboardInterrupt" and swallowed; the run went on and exited 0.
    It is not printed, and the run ends with it at its next phase (one line, 130)."""
    import importlib
    from types import SimpleNamespace

    cli = importlib.import_module("partitioner.cli.main")
    interrupts = cli._INTERRUPTS
    assert not interrupts.arrived
    interrupts.honour()  # none arrived: nothing
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupts(2, None)
        cli._unraisable_but_interrupts(
            SimpleNamespace(exc_value=KeyboardInterrupt(), exc_type=KeyboardInterrupt)
        )
        assert capsys.readouterr().err == ""
        with pytest.raises(KeyboardInterrupt):
            interrupts.honour()
    finally:
        interrupts.arrived = False
