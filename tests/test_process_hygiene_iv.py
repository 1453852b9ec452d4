"""Process hygiene, the fourth round (issue 34, "hostile input III").

A child process the model's code starts with ``subprocess`` or ``os.fork`` is named and stopped
when ``partition`` ends (it held stdout and stderr: ``partition ... | tee log`` waited for it);
Ctrl-C just after "Plan written to ..." is one line, never a death by the signal; a stderr that
fails or is closed leaves an error's status as it is.

Whole runs are subprocesses (``python -m partitioner``) with timeouts, so a regression fails
instead of hanging; the helpers of the exit run in this process.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from partitioner.plan.model import load_plan
from tests.test_process_hygiene import (
    REPO,
    RUN_TIMEOUT_S,
    TINY,
    _default_sigint,
    _finish,
    _one_line,
    _start,
)

cli = importlib.import_module("partitioner.cli.main")  # the module; partitioner.cli.main is main()

EOF_TIMEOUT_S = 30.0
"""How long after ``partition`` exits its stdout and stderr may stay open (a child the model's
code started holds them until it ends)."""


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :][:1] in ("Z", "X")


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# -- D7: children started with subprocess or os.fork --------------------------------------------

POPEN = """\
import subprocess

_child = subprocess.Popen(["sleep", "3600"])
with open({pidfile!r}, "w") as f:
    f.write(str(_child.pid))

"""
FORK = """\
import os
import time

_child = os.fork()
if _child == 0:
    time.sleep(3600)
    os._exit(0)
with open({pidfile!r}, "w") as f:
    f.write(str(_child))

"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc here")
@pytest.mark.parametrize("how", ["popen", "fork"])
def test_a_child_process_the_model_starts_is_named_stopped_and_frees_the_pipes(
    how: str, tmp_path: Path
) -> None:
    """A child from ``subprocess.Popen`` or ``os.fork`` held the run's stdout and stderr, so a
    reader (``| tee log``) waited until it ended (the plan at ~7 s, the pipe open until 65 s);
    only ``multiprocessing`` children were known. Now every child /proc lists is named (name and
    pid) in the one-line note and stopped: the pipes close as the process ends."""
    pidfile = tmp_path / "child.pid"
    model = tmp_path / f"{how}.py"
    model.write_text((POPEN if how == "popen" else FORK).format(pidfile=str(pidfile)) + TINY)
    out = tmp_path / "plan.json"
    proc = _start(
        [model, "--gpus", "2", "--no-strategies", "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    child = None
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is not None, f"partition did not exit within {RUN_TIMEOUT_S:g} s"
        child = int(pidfile.read_text())
        try:
            _, err_bytes = proc.communicate(timeout=EOF_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stdout/stderr stayed open {EOF_TIMEOUT_S:g} s after partition exited")
    finally:
        if child is not None:
            _kill_quietly(child)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    err = err_bytes.decode(errors="replace")
    assert proc.returncode == 0, err
    load_plan(out)  # whole
    name = "'sleep'" if how == "popen" else "'python"
    line = _one_line(err, "note", "left 1 child process running (", name, f"as pid {child}")
    assert line.startswith("partition: note: ") and line.endswith("the child processes are stopped")
    assert _gone(child)


def _children_of_this_test(pids: set[int]) -> list[Any]:
    return [c for c in cli._children_left(1.0) if c.pid in pids]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc here")
def test_every_live_child_is_named_and_stopped_with_what_runs_under_it() -> None:
    """``_children_left`` names every running child of the process, however it was started,
    after waiting for those that end; ``_stop_children`` stops them and their own children
    (a shell's command), killing one that ignores SIGTERM after ``STOP_GRACE_S``."""
    stubborn_code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    procs = [
        subprocess.Popen(["sleep", "60"]),
        subprocess.Popen([sys.executable, "-c", stubborn_code], stdout=subprocess.PIPE),
        subprocess.Popen(["sh", "-c", "sleep 61; true"]),
        subprocess.Popen(["sleep", "0.2"]),  # ends within the wait: not named
    ]
    under: list[int] = []
    try:
        assert procs[1].stdout is not None and procs[1].stdout.readline() == b"ready\n"
        pids = {p.pid for p in procs}
        deadline = time.monotonic() + 10
        while not under and time.monotonic() < deadline:  # the shell's sleep, once started
            table = cli._process_table()
            assert table is not None
            under = [pid for pid, row in table.items() if row[0] == procs[2].pid]
        assert under, "the shell started no command"
        left = _children_of_this_test(pids)
        assert [(c.pid, c.name) for c in left] == sorted(
            [
                (procs[0].pid, "sleep"),
                (procs[1].pid, os.path.basename(sys.executable)[:15]),
                (procs[2].pid, "sh"),
            ]
        )
        started = time.monotonic()
        cli._stop_children(left)
        assert time.monotonic() - started < cli.STOP_GRACE_S + 5
        for pid in [*pids, *under]:
            assert _gone(pid), pid
        assert _children_of_this_test(pids) == []
    finally:
        for pid in [*(p.pid for p in procs), *under]:
            _kill_quietly(pid)
        for p in procs:
            p.wait()


def test_the_note_names_each_child_by_name_and_pid() -> None:
    children = [cli._Child(4242, "sleep"), cli._Child(4243, "py\x1bthon")]
    note = cli._left_running([], children)
    assert note == (
        "the model's code left 2 child processes running ('sleep', 'py\\x1bthon') as pids "
        f"4242, 4243; exiting anyway after {cli.THREAD_GRACE_S:g} s; the child processes are "
        "stopped"
    )


def test_without_proc_only_multiprocessing_children_are_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where /proc is missing (another system) the exit keeps its earlier behaviour: the
    ``multiprocessing`` children only, and no error."""
    monkeypatch.setattr(cli, "PROC", str(tmp_path / "no-proc"))
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert cli._process_table() is None
        assert [c for c in cli._children_left(0.0) if c.pid == sleeper.pid] == []
    finally:
        sleeper.kill()
        sleeper.wait()


# -- D8: Ctrl-C just after the plan is written ---------------------------------------------------

SLOW_TEARDOWN = """\
import atexit
import builtins
import time


class _SlowToFree:
    def __del__(self):
        time.sleep(30)


builtins._slow_to_free = _SlowToFree()  # freed by the interpreter's teardown, at the very end


def _mark():
    with open({marker!r}, "w") as f:
        f.write("ran")


atexit.register(_mark)

"""
SLOW_EXIT_HANDLER = """\
import atexit
import time


def _mark_and_wait():
    with open({marker!r}, "w") as f:
        f.write("ran")
    time.sleep(30)


atexit.register(_mark_and_wait)

"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["teardown", "exit-handler"])
def test_ctrl_c_just_after_the_plan_is_written_is_one_line_never_a_silent_death(
    where: str, tmp_path: Path
) -> None:
    """Python puts SIGINT back to its default action before it frees its modules (a second or
    more with TensorFlow loaded; here an object slow to free makes it 30 s), so a Ctrl-C there
    killed ``partition`` by the signal with no line (status -2). The process now ends after its
    exit handlers without that teardown (``teardown``: status 0, and the model's exit handler
    ran); a Ctrl-C while the exit handlers run is one line and 130 (``exit-handler``)."""
    marker = tmp_path / "atexit-ran"
    model = tmp_path / "slow_end.py"
    text = SLOW_TEARDOWN if where == "teardown" else SLOW_EXIT_HANDLER
    model.write_text(text.format(marker=str(marker)) + TINY)
    out = tmp_path / "plan.json"
    proc = _start(
        [model, "--gpus", "2", "--no-strategies", "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        for line in iter(proc.stdout.readline, b""):
            if line.startswith(b"Plan written to"):
                break
        else:
            pytest.fail(f"no 'Plan written to' line (status {proc.wait()})")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
    except BaseException:
        proc.kill()
        raise
    code, err = _finish(proc, 20)
    assert marker.read_text() == "ran"  # the model's exit handler ran
    load_plan(out)  # whole
    if where == "teardown":
        assert (code, err.strip()) == (0, "")
    else:
        assert code == 130, err
        _one_line(err, "partition: interrupted")


SLOW_WHILE_PLANNED = """\
import time
import traceback

import keras


class Slow(keras.layers.Layer):
    def call(self, x):
        if any(f.name == "partition_prepared" for f in traceback.extract_stack()):  # planned
            with open({marker!r}, "w") as f:
                f.write("tracing")
            time.sleep(60)
        return x


def build_model():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="a"), Slow(name="slow"),
         keras.layers.Dense(2, name="b")]
    )
"""
MODEL_SIGINT = """\
import signal


def _models_own(signum, frame):
    raise RuntimeError("the model's own Ctrl-C handler ran")


signal.signal(signal.SIGINT, _models_own)

"""


def _interrupt_while_planned(
    model: Path, marker: Path, tmp_path: Path, pidfile: Path | None = None
) -> tuple[int, str]:
    """Run ``model`` (planned slowly: :data:`SLOW_WHILE_PLANNED`) and send Ctrl-C once it is
    being traced: its status and its stderr, which must close within :data:`EOF_TIMEOUT_S` (the
    child whose pid the model wrote to ``pidfile`` is killed if they do not)."""
    proc = _start(
        [model, "--gpus", "2", "--no-strategies", "--out", tmp_path / "plan.json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert proc.poll() is None and marker.exists(), "the model was not traced"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=EOF_TIMEOUT_S)
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        proc.kill()
        if pidfile is not None and pidfile.exists():
            _kill_quietly(int(pidfile.read_text()))
        proc.communicate()
        pytest.fail(f"{exc} (status {proc.returncode})")
    return proc.returncode, err.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc here")
def test_an_interrupted_run_stops_the_child_the_model_started(tmp_path: Path) -> None:
    """Ctrl-C ends the run at once with its line and 130, and the child the model's code
    started is sent SIGTERM on the way out: it held stdout and stderr open after the run."""
    pidfile, marker = tmp_path / "child.pid", tmp_path / "tracing"
    model = tmp_path / "popen_slow.py"
    model.write_text(
        POPEN.format(pidfile=str(pidfile)) + SLOW_WHILE_PLANNED.format(marker=str(marker))
    )
    code, err = _interrupt_while_planned(model, marker, tmp_path, pidfile)
    assert code == 130, err
    _one_line(err, "partition: interrupted")
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)


@pytest.mark.slow
def test_a_model_that_installs_its_own_ctrl_c_handler_does_not_keep_it(tmp_path: Path) -> None:
    """A model file that installs a SIGINT handler at import turned a Ctrl-C while it was
    planned into the model's error (status 2); the run's own handler is put back once the model
    is loaded, so Ctrl-C is the run's one line and 130."""
    marker = tmp_path / "tracing"
    model = tmp_path / "own_handler.py"
    model.write_text(MODEL_SIGINT + SLOW_WHILE_PLANNED.format(marker=str(marker)))
    code, err = _interrupt_while_planned(model, marker, tmp_path)
    assert code == 130, err
    _one_line(err, "partition: interrupted")
    assert not (tmp_path / "plan.json").exists()


# -- a stderr that fails or is closed ------------------------------------------------------------


def _close_stderr() -> None:
    _default_sigint()
    os.close(2)


@pytest.mark.parametrize("stderr", ["full", "closed"])
@pytest.mark.parametrize(
    "args", [["missing_model.py", "--gpus", "2"], ["--no-such-flag"]], ids=["error", "usage"]
)
def test_an_error_keeps_its_status_when_stderr_is_full_or_closed(
    stderr: str, args: list[str], tmp_path: Path
) -> None:
    """An error's line on a stderr that fails (``2>/dev/full``) raised out of ``main``, and a
    closed stderr (``2>&-``) is None: both exited 1 (a traceback nobody sees), not the
    documented 2. Stderr is now dropped when it fails, and /dev/null when it was closed."""
    if stderr == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    command = [sys.executable, "-m", "partitioner", *args]
    if stderr == "full":
        with open("/dev/full", "wb") as full:
            proc = subprocess.run(
                command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=full,
                preexec_fn=_default_sigint, timeout=120,
            )  # fmt: skip
    else:
        proc = subprocess.run(
            command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
            preexec_fn=_close_stderr, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stdout


def _env() -> dict[str, str]:
    """This environment with the checkout importable from another working directory."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p)}


@pytest.mark.slow
def test_a_plan_is_written_with_stderr_closed(tmp_path: Path) -> None:
    """With file descriptor 2 closed (``2>&-``) the run failed at its start with status 1 and
    wrote nothing; fd 2 is now /dev/null and the plan is written."""
    model = tmp_path / "tiny.py"
    model.write_text(TINY)
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner", model, "--gpus", "2", "--no-strategies", "--out", out],
        cwd=REPO, stdout=subprocess.PIPE, preexec_fn=_close_stderr, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    # the terminal-width wrap may cut the long path anywhere: read the line unwrapped
    assert re.search(rb"Plan written to\s*\S*plan\.json", proc.stdout.replace(b"\n", b""))
    load_plan(out)
