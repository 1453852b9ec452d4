"""Hostile input III (issue 34), campaign 34l (round 12): the defects found, each at its
mechanism."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from partitioner.core.errors import OutputError
from partitioner.core.files import marked

REPO = Path(__file__).resolve().parents[1]


OLD = marked("old\n", "#")
"""An earlier output partitioner wrote: a run replaces it, a failed run keeps it."""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_another_users_file_in_a_shared_directory_is_not_replaced(tmp_path: Path) -> None:
    """Campaign 34l a (N70): another user's regular file planted in a sticky directory anyone
    may write (``/tmp``) was replaced by root's output through a rename, which the kernel's
    ``protected_regular`` never sees, and the new file kept its mode 666: that user could then
    edit root's emitted module. Such a file is refused; the user's own, and one the directory's
    owner made, are replaced."""
    from partitioner.core.files import check_output_path, write_atomic

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "placed.py"
    planted.write_text("# planted\n")
    planted.chmod(0o666)
    os.chown(planted, 65534, 65534)
    for attempt in (lambda: check_output_path(planted), lambda: write_atomic(planted, "x = 1\n")):
        with pytest.raises(OutputError) as info:
            attempt()
        assert f"it is a file of another user (uid 65534) in {shared}" in str(info.value)
    assert planted.read_text() == "# planted\n"
    os.chown(shared, 65534, -1)  # the directory's owner's file: replaced
    assert check_output_path(planted) == planted
    os.chown(shared, os.geteuid(), -1)
    os.chown(planted, os.geteuid(), -1)  # the user's own: replaced
    write_atomic(planted, "x = 1\n")
    assert planted.read_text() == "x = 1\n"


def test_a_profile_cache_entry_past_an_hour_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Campaign 34l a (N1): an entry giving a layer 1e300 s passed the schema (times >= 0) and
    made a plan whose step no plan file takes (``partition show`` refused it). An entry past
    :data:`MAX_MEASURED_LAYER_S` is ignored with a warning and measured again."""
    from cost_models.measure import profiled

    key = "a" * 64
    entry = tmp_path / "layers" / f"{key}.json"
    entry.parent.mkdir()
    body = {"schema": profiled.CACHE_SCHEMA, "key": key, "repeats": 3}
    entry.write_text(json.dumps({**body, "forward_time_s": 1e300, "backward_time_s": 0.1}))
    with caplog.at_level(logging.WARNING, logger="cost_models.measure.profiled"):
        assert profiled._read_entry(tmp_path, key) is None
    assert "more than the 3600.0 s any measured layer takes" in caplog.text
    entry.write_text(json.dumps({**body, "forward_time_s": 0.2, "backward_time_s": 0.1}))
    assert profiled._read_entry(tmp_path, key) == (0.2, 0.1, 3)


@pytest.mark.slow
def test_a_worker_on_a_port_in_use_says_one_line(tmp_path: Path) -> None:
    """Campaign 34l a (N6): gRPC's own lines (``Failed to add port to server ... 0.0.0.0``)
    came before the worker's one line; they are held while the server starts, and dropped when
    it fails."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = tmp_path / "c.json"
        cluster.write_text(f'{{"worker": ["127.0.0.1:{port}"]}}')
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env["PYTHONPATH"] = str(REPO)
        cmd = [sys.executable, "-m", "partitioner", "worker", "--task", "0"]
        done = subprocess.run(
            [*cmd, "--cluster", str(cluster)],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
    assert done.returncode == 2
    lines = [x for x in done.stderr.splitlines() if "cuInit" not in x]
    assert len(lines) == 1, done.stderr
    assert f"could not listen on 127.0.0.1:{port}" in lines[0]
    assert "is the port in use by another process?" in lines[0]


@pytest.fixture(scope="module")
def pipeline_plan(mlp: Any) -> Any:
    import partitioner

    return partitioner.partition(mlp, gpus=2, batch_size=16, strategy="pipeline")


def _edited(data: dict[str, Any], edit: str) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    predicted = data["predicted"]
    if edit == "batch_size":
        data["batch_size"] = 32
    elif edit == "peak_memory":
        predicted["memory_bytes"] = [1] * len(predicted["memory_bytes"])
    elif edit == "step_past_timeline":
        predicted["step_time_s"] = predicted["step_time_s"] * 4
    elif edit == "bytes_received":
        predicted["bytes_received"] = [999_999] + [0] * (len(predicted["bytes_received"]) - 1)
    return data


@pytest.mark.parametrize(
    "edit", ["batch_size", "peak_memory", "step_past_timeline", "bytes_received"]
)
def test_a_plan_file_edited_after_it_was_written_is_refused(pipeline_plan: Any, edit: str) -> None:
    """Campaign 34l b (Y01-Y05, K44, X13): a plan file whose batch size, peak memory, step or
    bytes received were edited kept the predictions made for the others and was shown and
    applied. Field-by-field checks cannot see every such edit; the plan's digest of the rest
    of the file can: an edited figure is refused, and the file as written still loads."""
    from partitioner.core.errors import PlanError
    from partitioner.plan.model import Plan

    data = pipeline_plan.to_json_dict()
    assert Plan.from_json_dict(json.loads(json.dumps(data))) == pipeline_plan
    with pytest.raises(PlanError) as info:
        Plan.from_json_dict(_edited(data, edit), origin="plan file 'p.json'")
    assert str(info.value) == (
        "plan file 'p.json': it was changed after it was written (its digest does not match "
        "the rest): a plan's predictions hold only for the batch, devices and placement they "
        "were made for; make the plan again"
    )


def test_a_plan_file_without_a_digest_is_read_with_a_warning(
    pipeline_plan: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from partitioner.plan.model import Plan

    data = pipeline_plan.to_json_dict()
    del data["digest"]
    with caplog.at_level(logging.WARNING, logger="partitioner.plan.model"):
        assert Plan.from_json_dict(data, origin="plan file 'p.json'") == pipeline_plan
    assert "plan file 'p.json' has no digest" in caplog.text
    assert "its predictions are read as written, unchecked" in caplog.text


# -- campaign 34l c: the model's code and the process ----------------------------------------

MLP_FILE = """
import keras{extra}

def build_model():
    x = keras.Input((16,))
    h = keras.layers.Dense(32, name="d1")(x)
    h = keras.layers.Dense(32, name="d2")(h)
    h = keras.layers.Dense(32, name="d3")(h)
    return keras.Model(x, keras.layers.Dense(4, name="d4")(h), name="m")
"""


def _partition(tmp_path: Path, extra: str, *flags: str) -> subprocess.CompletedProcess[str]:
    model = tmp_path / "model.py"
    model.write_text(MLP_FILE.format(extra=extra))
    (tmp_path / "p.json").write_text(OLD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "partitioner", str(model), "--gpus", "4", "--device-type", "cpu"]
    return subprocess.run(
        [*cmd, "--batch-size", "8", "--out", str(tmp_path / "p.json"), *flags],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_a_thread_of_the_model_calling_os_exit_does_not_end_the_run(tmp_path: Path) -> None:
    """Campaign 34l c (n10): a timer thread of the model's code calling ``os._exit(0)`` while
    the run planned ended it with status 0, no line and no plan: the stale ``--out`` looked like
    this run's. That thread is stopped, the run goes on, and a note says so."""
    extra = ", os, threading\nthreading.Timer(0.2, lambda: os._exit(0)).start()"
    done = _partition(tmp_path, extra)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "p.json").read_text())["model"] == "m"
    assert (
        "partition: note: a thread of the model's code (Thread-1) called os._exit(0) while the "
        "run planned; that thread was stopped and the run went on"
    ) in done.stderr
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr


@pytest.mark.slow
def test_os_exit_in_the_models_main_code_is_one_line(tmp_path: Path) -> None:
    done = _partition(tmp_path, ", os\nos._exit(0)")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"partition: error: importing {tmp_path / 'model.py'} called os._exit(0); remove the exit "
        "from the model file (or put it under if __name__ == '__main__':)"
    )
    assert (tmp_path / "p.json").read_text() == OLD


@pytest.mark.slow
def test_a_model_closing_the_descriptors_it_was_given_still_plans(tmp_path: Path) -> None:
    """Campaign 34l c (s23): ``os.closerange(3, 256)`` at import (as daemonising code does)
    closed the CLI's copies of stdout and stderr and its record of the files the model read:
    status 1 and no line. Those are kept at high descriptors now."""
    done = _partition(tmp_path, ", os\nos.closerange(3, 256)", "--report", str(tmp_path / "r.txt"))
    assert done.returncode == 0, done.stderr
    assert "Plan written to" in done.stdout
    assert json.loads((tmp_path / "p.json").read_text())["model"] == "m"
    assert (tmp_path / "r.txt").is_file()


@pytest.mark.slow
def test_a_stdout_pipe_the_model_made_non_blocking_takes_the_whole_report(
    tmp_path: Path,
) -> None:
    """Campaign 34l c (s20): the model made the pipes it holds non-blocking with a 4 KiB buffer;
    the report was cut at 4 KiB, status 0. The CLI writes its stdout blocking."""
    extra = """, fcntl, os, stat
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, 1031, 4096)  # F_SETPIPE_SZ
            os.set_blocking(fd, False)
    except OSError:
        pass"""
    model = tmp_path / "model.py"
    model.write_text(MLP_FILE.format(extra=extra))
    plan = tmp_path / "p.json"
    command = (
        f"{sys.executable} -m partitioner {model} --gpus 4 --device-type cpu --batch-size 8 "
        f"--out {plan} | (while [ ! -e {plan} ]; do sleep 0.2; done; sleep 2; wc -c)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 4096


def test_a_task_of_a_job_without_workers_is_told_to_serve_that_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Campaign 34l c (t17): TF_CONFIG whose task is ``ps`` and which has no ``worker`` job was
    told to list the workers in the bare form, which TF_CONFIG refuses (row 133)."""
    from partitioner.core.errors import UsageError
    from passes.cluster.runtime import load_cluster

    config = {"cluster": {"chief": ["h:1"], "ps": ["h:2"]}, "task": {"type": "ps", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(UsageError) as info:
        load_cluster(None)
    assert str(info.value) == (
        "TF_CONFIG has no job 'worker' (jobs found: chief, ps), and its task is of job 'ps': "
        "serve that job instead (partition worker --job ps), or list the 'worker' tasks as "
        '{"cluster": {"worker": ["host0:2222", "host1:2222"]}}'
    )
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["h:2"]}}))
    with pytest.raises(UsageError, match=r'as \{"cluster": \{"worker"'):
        load_cluster(None)


def test_a_subclassed_model_is_told_to_plan_without_a_pipeline_in_no_flags_words() -> None:
    """Campaign 34l c (u12): ``--strategy pipeline`` on a subclassed model was advised "or plan
    with no --pipeline", a flag the user never gave."""
    import keras

    from partitioner.core.errors import RewriteError
    from passes.rewrite import pipeline

    class Sub(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="sub")
            self.out = keras.layers.Dense(2)

        def call(self, x: Any) -> Any:
            return self.out(x)

    with pytest.raises(RewriteError) as info:
        pipeline._graph_of(Sub())
    assert str(info.value).endswith(
        "build it with the functional API or Sequential, or plan it without a pipeline (one "
        "device, data parallel or a plain split)"
    )


CLIENT_SCRIPT = """
import socket, sys
from passes.cluster.loopback import listening_sockets, _socket_fds
from passes.cluster.runtime import connect
before = set(listening_sockets())
connect(sys.argv[1], timeout_s=120)
fds = _socket_fds()
for inode, port in listening_sockets().items():
    fd = next(f for f, i in fds.items() if i == inode)
    sock = socket.socket(fileno=__import__("os").dup(fd))
    device = sock.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16).rstrip(b"\\0")
    print(port, device.decode() or "-", "new" if inode not in before else "old")
"""


@pytest.mark.slow
def test_the_clients_own_server_stays_on_this_machine_for_a_local_cluster(
    tmp_path: Path,
) -> None:
    """Campaign 34l a (W3): ``partition calibrate`` and ``plan.apply(cluster=...)`` connect as
    TensorFlow's client, whose own gRPC server listened on every interface while the workers
    were loopback-only: another host could send it graphs. Its listeners are tied to ``lo``."""
    sys.path.insert(0, str(REPO / "tests"))
    from cluster_util import start_workers, worker_env

    workers = start_workers(1, tmp_path / "w")
    try:
        done = subprocess.run(
            [sys.executable, "-c", CLIENT_SCRIPT, str(workers.cluster_file)],
            capture_output=True, text=True, env=worker_env(), timeout=300, check=False,
        )  # fmt: skip
    finally:
        workers.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    new = [row for row in rows if row[2] == "new"]
    assert new, done.stdout  # the connect opened the client's server
    assert all(device == "lo" for _, device, _ in new), done.stdout


# -- campaign 34m ------------------------------------------------------------------------------


def test_a_plan_rewritten_by_jq_still_loads(pipeline_plan: Any) -> None:
    """Campaign 34m a (D1b): ``jq .`` writes ``0.0`` as ``0``; the values are equal, and the
    digest is of the values (a float equal to an integer as that integer)."""
    from partitioner.plan.model import Plan

    text = json.dumps(pipeline_plan.to_json_dict())
    assert ".0," in text or ".0]" in text or ".0}" in text  # there are such floats to rewrite
    rewritten = json.loads(text.replace(".0,", ",").replace(".0]", "]").replace(".0}", "}"))
    assert Plan.from_json_dict(rewritten) == pipeline_plan


def test_a_huge_string_in_a_plan_file_is_not_echoed_whole(pipeline_plan: Any) -> None:
    """Campaign 34m a (D1e, E1): a 10 MB ``digest`` or device type was printed whole."""
    from partitioner.core.errors import PlanError
    from partitioner.plan.model import Plan

    for edit in ("digest", "device_type"):
        data = pipeline_plan.to_json_dict()
        if edit == "digest":
            data["digest"] = "a" * 10_000_000
        else:
            data["devices"][0]["device_type"] = "x" * 10_000_000
        with pytest.raises(PlanError) as info:
            Plan.from_json_dict(data, origin="p.json")
        assert len(str(info.value)) < 600, str(info.value)[:300]


@pytest.mark.parametrize(
    ("task", "words"),
    [
        ({"type": "worker", "idx": 1}, "task has no 'index' (TensorFlow would take task 0) but has key 'idx'"),
        ({"index": 1}, "task gives index 1 but no type; add the job it is of"),
    ],
)  # fmt: skip
def test_a_tf_config_task_misspelt_is_refused(task: dict[str, Any], words: str) -> None:
    """Campaign 34m c (t13, t15): ``{"type": "worker", "idx": 1}`` served task 0; a task with
    an index and no type was told it had no index."""
    from cost_models.devices.tf_config import parse_tf_config
    from partitioner.core.errors import PartitionError

    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": task}
    with pytest.raises(PartitionError, match=re.escape(words)):
        parse_tf_config(json.dumps(config))
    cloud = {**config, "task": {"type": "worker", "index": 1, "trial": "3"}}
    assert parse_tf_config(json.dumps(cloud)).task_index == 1  # the keys clouds add are fine


def test_a_memory_limit_is_read_exactly() -> None:
    """Campaign 34m b (DEF3): ``--memory-limit`` went through a float: 2**60 + 1 passed as
    2**60, and 9007199254740993 became ...992."""
    from partitioner.core.units import parse_bytes

    assert parse_bytes("9007199254740993") == 9007199254740993
    with pytest.raises(ValueError, match="more than 1 EiB"):
        parse_bytes(str(2**60 + 1))
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000


def test_an_unbuilt_sequential_refusing_the_input_shape_is_the_users_error() -> None:
    """Campaign 34m c (a5): ``Sequential([Conv2D, ...])`` with ``input_shape=(16,)`` leaked
    Keras's ValueError (the CLI: "internal error")."""
    import keras

    import partitioner
    from partitioner.core.errors import TraceError

    model = keras.Sequential(
        [keras.layers.Conv2D(4, 3, name="c1"), keras.layers.Flatten(), keras.layers.Dense(4)]
    )
    with pytest.raises(TraceError) as info:
        partitioner.partition(model, gpus=2, batch_size=8, input_shape=(16,))
    message = str(info.value)
    assert "raised ValueError while built" in message and "layer 'c1'" in message
    assert message.endswith("it was traced at batch_size=8 with input_shape=(16,)")


def test_an_error_whose_str_raises_is_still_one_line() -> None:
    """Campaign 34m c (L1): a layer raising an exception whose ``__str__`` raises leaked a
    RuntimeError from the library."""
    import keras

    import partitioner
    from partitioner.core.errors import TraceError

    class Weird(Exception):
        def __str__(self) -> str:
            raise RuntimeError("str of the error fails too")

    class Raising(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            if x.shape[0] == 8:
                raise Weird()
            return x

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(Raising(name="weird")(inputs)))
    with pytest.raises(TraceError, match=r"layer 'weird' \(Raising\) .* raised Weird while traced"):
        partitioner.partition(model, gpus=2, batch_size=8)


@pytest.mark.slow
def test_a_model_ignoring_ctrl_c_does_not_swallow_it(tmp_path: Path) -> None:
    """Campaign 34m c (b1): ``signal.signal(SIGINT, SIG_IGN)`` at the model's import had the
    kernel discard Ctrl-C: the run went on, replaced the old plan and exited 0. The model's
    SIGINT handler is not installed while the run plans: Ctrl-C is the user's."""
    import signal
    import time

    marker = tmp_path / "building"
    model = tmp_path / "model.py"
    model.write_text(
        "import signal, time, keras\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "def build_model():\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    time.sleep(30)\n"
        "    x = keras.Input((8,))\n"
        "    return keras.Model(x, keras.layers.Dense(2)(x))\n"
    )
    out = tmp_path / "p.json"
    out.write_text(OLD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "partitioner", str(model), "--gpus", "2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "partition: interrupted; no file was left half-written"
    assert out.read_text() == OLD


# -- campaign 34n ------------------------------------------------------------------------------


def test_a_module_file_that_is_a_fifo_or_huge_does_not_stall_the_key(tmp_path: Path) -> None:
    """Campaign 34n a (N2, N1): the key read every module file whole: a module whose
    ``__file__`` is a FIFO hung the run; a 3 GiB data file the model read a header of took
    74 s and 3.8 GB. A file that is not regular is never read (and never the same key twice);
    one past 64 MiB is keyed by its size, time and inode."""
    from passes import trace_cache

    fifo = tmp_path / "plug.fifo"
    os.mkfifo(fifo)
    first = trace_cache._file_digest(str(fifo), {})
    assert first.startswith("unreadable") and trace_cache._file_digest(str(fifo), {}) != first
    big = tmp_path / "data.bin"
    with big.open("wb") as f:
        f.truncate(trace_cache.MAX_HASHED_BYTES + 1)  # sparse: nothing is written
    st = big.stat()
    assert trace_cache._file_digest(str(big), {}) == (
        f"{st.st_size} {st.st_mtime_ns} {st.st_dev} {st.st_ino}"
    )


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_an_input_through_another_users_link_is_refused(tmp_path: Path) -> None:
    """Campaign 34n a (N15): ``--topology shared/t.json``, ``partition show shared/p.json`` and
    ``partition shared/m.py`` followed another user's link in a sticky directory anyone may
    write (root ran that user's model code). Inputs are refused there, as outputs are."""
    from partitioner.cli.loader import check_model_path
    from partitioner.core.errors import ModelLoadError, PlanError
    from partitioner.core.files import read_input_text

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    theirs = tmp_path / "theirs.py"
    theirs.write_text("x = 1\n")
    for name in ("m.py", "p.json"):
        (shared / name).symlink_to(theirs)
        os.chown(shared / name, 65534, 65534, follow_symlinks=False)
    with pytest.raises(ModelLoadError, match="is a symbolic link of another user"):
        check_model_path(str(shared / "m.py"))
    with pytest.raises(PlanError, match="is a symbolic link of another user"):
        read_input_text(shared / "p.json", "plan file", PlanError, 1 << 20)
    os.chown(shared / "p.json", os.geteuid(), -1, follow_symlinks=False)  # the user's own
    assert read_input_text(shared / "p.json", "plan file", PlanError, 1 << 20) == "x = 1\n"


def test_a_huge_job_name_is_cut_in_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Campaign 34n a (N8): a 900 KB job name made a 900 KB error line."""
    from partitioner.core.errors import UsageError
    from passes.cluster.runtime import load_cluster

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"j" * 120_000: ["127.0.0.1:1"]}}))
    with pytest.raises(UsageError) as info:
        load_cluster(None)
    assert len(str(info.value)) < 500


def test_calibrate_refuses_an_unknown_device_type_before_measuring() -> None:
    """Campaign 34n b (K03): ``partition calibrate --device-type tpu9`` connected and measured
    for 45 s before refusing the type."""
    from partitioner.core.errors import PartitionError
    from passes.cluster.calibrate import CalibrationOptions

    with pytest.raises(PartitionError, match="unknown device type 'tpu9'"):
        CalibrationOptions(device_type="tpu9").check()


def test_a_gradient_that_refuses_a_share_refuses_the_strategy() -> None:
    """Campaign 34n c (D1): a layer whose gradient refuses a batch of 4 (its forward runs at
    any batch) got a hybrid plan of micro-batches of 4 with exit 0, which could not train:
    a derived share is confirmed by a real trace (gradients too), not by its forward pass."""
    import keras
    import tensorflow as tf

    import partitioner
    from partitioner.core.errors import PartitionError

    class GradNot4(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            @tf.custom_gradient
            def f(t: Any) -> Any:
                def grad(dy: Any) -> Any:
                    if dy.shape[0] == 4:
                        raise ValueError("the gradient refuses a batch of 4")
                    return dy * 2.0

                return t * 2.0, grad

            return f(x)

    inputs = keras.Input((16,))
    hidden = GradNot4(name="g")(keras.layers.Dense(16, name="d1")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="d2")(hidden))
    try:
        plan = partitioner.partition(
            model, gpus=4, device_type="cpu", batch_size=16, strategy="hybrid"
        )
    except PartitionError as exc:
        assert "refuses a batch of 4" in str(exc)
        return
    strategy = plan.strategy
    assert strategy is not None
    assert 16 // (strategy.replicas * strategy.num_microbatches) != 4, strategy.describe()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_a_cluster_file_through_another_users_link_is_refused(tmp_path: Path) -> None:
    """Campaign 34o a (S5, S12): ``partition worker --cluster shared/c.json`` served, and
    ``load_cluster`` returned, the cluster another user's link in a sticky directory led to:
    that user chose root's worker ports and calibrate's targets. The data files' reader
    refuses such a link, as plan and topology files are refused."""
    from partitioner.core.errors import UsageError
    from passes.cluster.runtime import load_cluster

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    theirs = tmp_path / "c.json"
    theirs.write_text('{"worker": ["127.0.0.1:23457"]}')
    (shared / "c.json").symlink_to(theirs)
    os.chown(shared / "c.json", 65534, 65534, follow_symlinks=False)
    with pytest.raises(UsageError, match=r"is a symbolic link of another user \(uid 65534\)"):
        load_cluster(str(shared / "c.json"))
    os.chown(shared / "c.json", os.geteuid(), -1, follow_symlinks=False)  # the user's own
    assert load_cluster(str(shared / "c.json")).addresses == ("127.0.0.1:23457",)


def test_a_pipeline_whose_micro_batch_the_gradient_refuses_is_refused() -> None:
    """Campaign 34o c (g3): ``--pipeline --microbatches 4`` at batch 16 (micro-batches of 4)
    of a model whose gradient needs 8 or more exited 0 with a plan that could not train: the
    micro-batch's graph was derived from the traces at 16 and 8. It is traced for real."""
    import keras
    import tensorflow as tf

    import partitioner
    from partitioner.core.errors import PartitionError

    class GradAtLeast8(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            @tf.custom_gradient
            def f(t: Any) -> Any:
                def grad(dy: Any) -> Any:
                    if dy.shape[0] is not None and dy.shape[0] < 8:
                        raise ValueError(
                            f"the gradient needs a batch of 8 or more, got {dy.shape[0]}"
                        )
                    return dy * 2.0

                return t * 2.0, grad

            return f(x)

    inputs = keras.Input((16,))
    hidden = GradAtLeast8(name="g")(keras.layers.Dense(16, name="d1")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="d2")(hidden))
    with pytest.raises(PartitionError, match="the gradient needs a batch of 8 or more, got 4"):
        partitioner.partition(
            model, gpus=2, device_type="cpu", batch_size=16, pipeline=True, num_microbatches=4
        )


def test_an_error_ctrl_c_caused_in_c_code_is_not_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI of 3a14bdf (the random-kill test): a Ctrl-C pending while TensorFlow's C code called
    ``__import__`` became a ``SystemError ... returned a result with an exception set``, printed
    as an unraisable traceback above the run's one ``interrupted`` line. Once an interrupt has
    arrived, an unraisable error it caused is not printed; any other still is."""
    import importlib
    import types

    main = importlib.import_module("partitioner.cli.main")
    monkeypatch.setattr(main._INTERRUPTS, "arrived", True)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise SystemError("returned a result with an exception set") from interrupt
    except SystemError as caused:
        error = caused

    def unraisable(exc: BaseException) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            exc_type=type(exc), exc_value=exc, exc_traceback=None, err_msg=None, object=None
        )

    printed: list[Any] = []
    monkeypatch.setattr(sys, "__unraisablehook__", printed.append)
    main._unraisable_but_interrupts(unraisable(error))
    # CI of 76d0134: TensorFlow's C code reports it itself, without the interrupt as its cause.
    bare = SystemError("<built-in function __import__> returned a result with an exception set")
    main._unraisable_but_interrupts(unraisable(bare))
    assert printed == []
    other = unraisable(ValueError("not the interrupt's"))
    main._unraisable_but_interrupts(other)
    assert printed == [other]
