"""Process hygiene and errors from the user's own code (issue 34).

A ``partition`` process ends after its plan is written even when the model's code left a thread
running; Ctrl-C at any moment is one line and status 130 with nothing written; a stdout that
fails (a closed pipe, a full disk) loses no plan file and prints no traceback. A Keras layer
that refuses its arguments, or a call that fails at the traced batch or input shape, is
reported as the model's error, with the layer, the shapes and the flag to change.

Whole runs are subprocesses (``python -m partitioner``) with timeouts, so a regression fails
instead of hanging; the errors from user code run ``main()`` in this process.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from partitioner.core.errors import OutputError
from partitioner.plan.model import load_plan

cli = importlib.import_module("partitioner.cli.main")  # the module; partitioner.cli.main is main()

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist_mlp.py"
TINY = (
    "import keras\n\n"
    "def build_model():\n"
    "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name='a'),"
    " keras.layers.Dense(2, name='b')])\n"
)
THREADED = (
    "import threading\nimport time\n\n"
    "threading.Thread(target=time.sleep, args=(3600,), name='spinner').start()\n\n" + TINY
)
RUN_TIMEOUT_S = 240.0
"""The longest a whole run may take on a loaded two-core machine; past it the test fails."""


def _default_sigint() -> None:
    """In the child before exec: SIGINT's default action, as a terminal gives it. A test run
    started in the background of a script (``.ci/run &``, ``nohup``) inherits SIGINT ignored,
    and the command rightly keeps it ignored (row 67 of the README's bad-input table)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: Sequence[str | os.PathLike[str]], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``python -m partitioner ARGS`` in its own process, SIGINT at its default action."""
    return subprocess.Popen(
        [sys.executable, "-m", "partitioner", *map(str, args)],
        cwd=REPO,
        preexec_fn=_default_sigint,
        **kwargs,
    )


def _finish(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, str]:
    """Wait for ``proc`` (killed and failed past ``timeout_s``): its status and its stderr."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"partition did not exit within {timeout_s:g} s")
    return proc.returncode, (err or b"").decode(errors="replace")


def _one_line(err: str, *words: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


# -- threads left running ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_thread_left_running_by_the_model_does_not_keep_the_process(tmp_path: Path) -> None:
    model = tmp_path / "threaded.py"
    model.write_text(THREADED)
    out = tmp_path / "plan.json"
    proc = _start(
        [model, "--gpus", "2", "--no-strategies", "--out", out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    started = time.monotonic()
    written_at = None
    while proc.poll() is None and time.monotonic() - started < RUN_TIMEOUT_S:
        if written_at is None and out.exists():
            written_at = time.monotonic()
        if written_at is not None and time.monotonic() - written_at > 15:
            break
        time.sleep(0.1)
    code, err = _finish(proc, 1)
    assert code == 0, err
    load_plan(out)  # whole
    line = _one_line(err, "note", "left 1 thread running", "'spinner'", "exiting anyway")
    assert line.startswith("partition: note: ")


FORKED = (
    "import multiprocessing\nimport time\n\n"
    "def _forever():\n    time.sleep(3600)\n\n"
    "_child = multiprocessing.get_context('fork').Process(target=_forever, name='forked')\n"
    "_child.start()\n\n" + TINY
)


@pytest.mark.slow
def test_a_child_process_left_running_by_the_model_does_not_keep_the_process(
    tmp_path: Path,
) -> None:
    """The interpreter's exit joins non-daemon ``multiprocessing`` children, so a model that
    started one never let ``partition`` exit (the campaign's rerun, issue 34)."""
    model = tmp_path / "forked.py"
    model.write_text(FORKED)
    out = tmp_path / "plan.json"
    proc = _start(
        [model, "--gpus", "2", "--no-strategies", "--out", out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    code, err = _finish(proc, RUN_TIMEOUT_S)
    assert code == 0, err
    load_plan(out)  # whole
    _one_line(err, "note", "left 1 child process running ('forked')", "are stopped")


def test_threads_left_waits_for_a_thread_that_ends_and_not_for_one_that_does_not() -> None:
    stop = threading.Event()
    short = threading.Thread(target=time.sleep, args=(0.2,), name="short")
    long = threading.Thread(target=stop.wait, name="long")
    daemon = threading.Thread(target=stop.wait, name="daemon", daemon=True)
    for thread in (short, long, daemon):
        thread.start()
    try:
        t0 = time.monotonic()
        left = cli._threads_left(1.0)
        waited_s = time.monotonic() - t0
    finally:
        stop.set()
    assert [t.name for t in left] == ["long"]
    assert 0.9 <= waited_s < 5
    assert cli._threads_left(1.0) == []  # all ended: no wait


# -- Ctrl-C at any moment ------------------------------------------------------------------------


@pytest.mark.parametrize("delay_s", [0.3, 1.5], ids=["at-0.3s", "at-1.5s"])
def test_ctrl_c_early_is_one_line_130_and_nothing_written(delay_s: float, tmp_path: Path) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(TINY)
    proc = _start(
        [model, "--gpus", "2", "--out", tmp_path / "plan.json", "--report", tmp_path / "r.html"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    time.sleep(delay_s)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc, 60)
    assert code == 130, err
    _one_line(err, "partition: interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.py"]


CP_SAT_SEARCH = """\
import random
import sys

from ortools.sat.python import cp_model

from partitioner.solvers import ilp

# number partitioning of 60 random 40-bit values: the search runs to its 30 s limit
rng = random.Random(0)
values = [rng.randrange(1, 2**40) for _ in range(60)]
model = cp_model.CpModel()
chosen = [model.new_bool_var(f"x{i}") for i in range(len(values))]
gap = model.new_int_var(0, sum(values), "gap")
side = sum(v * b for v, b in zip(values, chosen))
model.add(gap >= 2 * side - sum(values))
model.add(gap >= sum(values) - 2 * side)
model.minimize(gap)
solver = cp_model.CpSolver()
solver.parameters.max_time_in_seconds = 30
solver.parameters.num_workers = 1
guard = ilp._ctrl_c_stops_search(solver) if sys.argv[1] == "guarded" else ilp.contextlib.nullcontext()
print("solving", flush=True)
with guard:
    status = solver.solve(model)
print("returned", solver.status_name(status), flush=True)
"""


@pytest.mark.parametrize("mode", ["guarded", "plain"])
def test_ctrl_c_during_a_cp_sat_search_interrupts_instead_of_ending_the_search(
    mode: str, tmp_path: Path
) -> None:
    """CP-SAT's own SIGINT handler ends its search and returns the best assignment so far, as
    if the time limit had come, so the plan was written and the run exited 0 (issue 34). The
    solver's search in this process runs inside ``_ctrl_c_stops_search``: the search stops and
    KeyboardInterrupt (the CLI's one line and 130) follows at once. ``plain`` shows the defect."""
    script = tmp_path / "search.py"
    script.write_text(CP_SAT_SEARCH)
    proc = subprocess.Popen(
        [sys.executable, script, mode],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"solving\n"
    time.sleep(1.0)
    assert proc.poll() is None, "the search ended before it could be interrupted"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 10  # not the 30 s time limit
    if mode == "guarded":
        assert b"KeyboardInterrupt" in err and b"returned" not in out, err
    else:
        assert proc.returncode == 0 and out.startswith(b"returned FEASIBLE"), (out, err)


CONSOLE_SCRIPT = """\
import os
import signal
import sys


class CtrlCWhileTheCliLoads:
    def find_spec(self, name, path=None, target=None):
        if name == "partitioner.cli.main":
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, CtrlCWhileTheCliLoads())
from partitioner.cli.main import main

sys.exit(main())
"""


def test_ctrl_c_while_the_console_script_loads_the_cli_is_one_line(tmp_path: Path) -> None:
    """The ``partition`` script's first import is ``partitioner.cli``: its Ctrl-C handler is
    installed there (:mod:`partitioner.cli.early`), before the CLI's imports. It was installed
    inside ``partitioner/cli/main.py``, after ``partitioner``'s own imports, and a Ctrl-C 0.05 s
    after start printed a KeyboardInterrupt traceback (the campaign's rerun, issue 34). Here
    the signal arrives deterministically, as the CLI module is looked up."""
    code, err = _run_as_console_script(tmp_path, CONSOLE_SCRIPT, "--help")
    assert code == 130, err
    _one_line(err, "partition: interrupted; nothing was written")


def _run_as_console_script(tmp_path: Path, text: str, *args: str) -> tuple[int, str]:
    """``text`` run as a script named ``partition`` (the console script's name, as pip writes
    it, which the CLI's early Ctrl-C handler looks for): its status and stderr."""
    script = tmp_path / "partition"
    script.write_text(text)
    proc = subprocess.Popen(
        [sys.executable, script, *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_default_sigint,
    )
    return _finish(proc, 60)


QUIETED = """\
import os
import signal

import partitioner.cli  # the console script's first import installs the handler

devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 2)  # as while TensorFlow starts (its native lines kept off the terminal)
os.kill(os.getpid(), signal.SIGINT)
"""


def test_ctrl_c_while_stderr_is_quieted_still_says_it_on_the_terminal(tmp_path: Path) -> None:
    """``partition worker`` imports TensorFlow with fd 2 at /dev/null, and a Ctrl-C then exited
    130 with no line at all (the third campaign, issue 34): the line goes to a copy of the
    stderr the process started with."""
    code, err = _run_as_console_script(tmp_path, QUIETED)
    assert code == 130, err
    _one_line(err, "partition: interrupted; nothing was written")


# -- a stdout that fails -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_closed_pipe_on_stdout_keeps_the_plan_and_exits_quietly(tmp_path: Path) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(TINY)
    out = tmp_path / "plan.json"
    proc = _start(
        [model, "--gpus", "2", "--no-strategies", "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # `partition ... | head -0`: the reader is gone before anything is printed
    code, err = _finish(proc, RUN_TIMEOUT_S)
    assert code == 0, err
    assert err.strip() == ""
    load_plan(out)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_full_stdout_keeps_the_plan_in_one_line(tmp_path: Path) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(TINY)
    out = tmp_path / "plan.json"
    with open("/dev/full", "wb") as full:
        proc = _start(
            [model, "--gpus", "2", "--no-strategies", "--out", out],
            stdout=full,
            stderr=subprocess.PIPE,
        )
        code, err = _finish(proc, RUN_TIMEOUT_S)
    assert code == 2, err
    _one_line(err, "cannot print the report on stdout", "No space left", "plan.json", "written")
    load_plan(out)


@pytest.mark.slow
def test_a_full_pipe_on_stdout_keeps_the_plan_and_ctrl_c_still_ends_the_run(
    tmp_path: Path,
) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(TINY)
    out = tmp_path / "plan.json"
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:  # fill the pipe: the run's first write to stdout blocks, as nobody reads
            os.write(write_end, b"x" * 65536)
    os.set_blocking(write_end, True)
    try:
        proc = _start(
            [model, "--gpus", "2", "--no-strategies", "--out", out],
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
        os.close(write_end)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        assert proc.poll() is None, "the run ended although its stdout could not take the report"
        load_plan(out)  # written before stdout was tried
        proc.send_signal(signal.SIGINT)
        code, err = _finish(proc, 30)
    finally:
        os.close(read_end)
    assert code == 130, err
    _one_line(err, "partition: interrupted")
    load_plan(out)


def test_print_out_ends_quietly_on_a_closed_pipe_and_names_the_files_on_other_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Failing:
        def __init__(self, exc: OSError) -> None:
            self.exc = exc

        def write(self, text: str) -> int:
            raise self.exc

        def flush(self) -> None:
            raise self.exc

    monkeypatch.setattr(sys, "stdout", Failing(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    assert cli.print_out("report\n", "the report", ["plan.json"]) == 0
    monkeypatch.setattr(sys, "stdout", Failing(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OutputError, match=r"\(No space left on device\); plan.json was written"):
        cli.print_out("report\n", "the report", ["plan.json"])


# -- errors from the model's own code ------------------------------------------------------------


def _run_main(
    args: Sequence[str | os.PathLike[str]], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``partition ARGS`` in this process: (status, stderr)."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main([os.fspath(a) for a in args])
    finally:
        signal.signal(signal.SIGTERM, handler)
    return code, capsys.readouterr().err


def test_a_keras_layer_refusing_its_arguments_is_the_models_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "dense0.py"
    model.write_text(
        "import keras\n\ndef build_model():\n"
        "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(0)])\n"
    )
    code, err = _run_main([model, "--gpus", "2", "--out", tmp_path / "p.json"], capsys)
    assert code == 2, err
    line = _one_line(err, "build_model()", "Received an invalid value for `units`")
    assert "AttributeError" not in line and "internal error" not in line
    assert not (tmp_path / "p.json").exists()


def test_an_input_shape_the_model_does_not_take_names_its_shape_and_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [MNIST, "--gpus", "2", "--input-shape", "10", "--no-strategies"]
    code, err = _run_main([*args, "--out", tmp_path / "p.json"], capsys)
    assert code == 2, err
    line = _one_line(err, "layer 'dense_in' (Dense)", "784", "--input-shape 10", "--batch-size 32")
    assert "Exception encountered" not in line and "\\x1b" not in line
    assert not (tmp_path / "p.json").exists()


def test_a_stateful_rnn_at_another_batch_names_its_fixed_batch_and_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "stateful.py"
    model.write_text(
        "import keras\n\ndef build_model():\n"
        "    inputs = keras.Input(batch_shape=(4, 6, 3))\n"
        "    x = keras.layers.LSTM(2, stateful=True, name='rnn')(inputs)\n"
        "    return keras.Model(inputs, keras.layers.Dense(1, name='head')(x))\n"
    )
    args = [model, "--gpus", "2", "--batch-size", "8", "--no-strategies"]
    code, err = _run_main([*args, "--out", tmp_path / "p.json"], capsys)
    assert code == 2, err
    _one_line(err, "'rnn'", "--batch-size 8", "fixed batch of 4", "plan it at --batch-size 4")
    assert not (tmp_path / "p.json").exists()


def test_error_line_is_keras_own_message_without_its_call_context() -> None:
    from passes.trace import error_line

    wrapped = ValueError(
        "Exception encountered when calling Dense.call().\n\n\x1b[1mInput 0 is incompatible: "
        "expected 784\nsecond line\x1b[0m\n\nArguments received by Dense.call():\n  • x=..."
    )
    assert error_line(wrapped) == "Input 0 is incompatible: expected 784"
    assert error_line(ValueError("plain\nmore")) == "plain"
    assert error_line(ValueError()) == "ValueError"


def test_an_unexpected_error_raised_in_the_model_file_is_the_models_not_internal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "user_model.py"
    source.write_text("def helper():\n    raise RuntimeError('the model broke\\nmore')\n")
    spec = importlib.util.spec_from_file_location("user_model_for_hygiene", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(RuntimeError) as raised:
        module.helper()
    assert cli._internal_error(raised.value, os.path.realpath(source)) == 2
    line = _one_line(capsys.readouterr().err, "the model's code raised RuntimeError: the model broke")
    assert "in helper() of" in line and "line 2" in line and "internal error" not in line
    assert cli._internal_error(raised.value, None) == 1  # not known to be the model's: ours
    _one_line(capsys.readouterr().err, "internal error: RuntimeError: the model broke")
