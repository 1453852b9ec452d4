"""Hostile input, round two (issue 19): special files, shared paths, unbounded input, locales,
names that drive the terminal, model code that exits, and the worker's listening address.

Most cases call the CLI's ``main()`` in-process (they are refused before TensorFlow is used);
the locale cases and whole runs are subprocesses. Every refusal is one line on stderr, a
non-zero exit, no traceback, and leaves the files as they were.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from partitioner.core.errors import OutputError, PlanError
from partitioner.core.files import write_all_atomic, write_atomic
from partitioner.plan.model import MAX_PLAN_BYTES, load_plan, plan_digest

cli = importlib.import_module("partitioner.cli.main")  # the module; partitioner.cli.main is main()

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist_mlp.py"
TINY = (
    "import keras\n\n"
    "def build_model():\n"
    "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name='a'),"
    " keras.layers.Dense(2, name='b')])\n"
)


@pytest.fixture(autouse=True)
def _alarm() -> Iterator[None]:
    """A case that would hang (a FIFO opened for reading) fails after 20 s instead."""

    def fail(signum: int, frame: object) -> None:
        raise TimeoutError("hung: the command did not return within 20 s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_main(
    args: Sequence[str | os.PathLike[str]], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """``partition ARGS`` in this process: (exit code, stdout, stderr)."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main([os.fspath(a) for a in args])
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code: int, err: str, *words: str) -> str:
    assert code != 0, err
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture()
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


# -- output paths ---------------------------------------------------------------------------------


def test_out_fifo_is_refused_and_left_a_fifo(fifo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main([MNIST, "--gpus", "2", "--out", fifo], capsys)
    one_line_error(code, err, "--out", "named pipe (FIFO)", "regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_out_socket_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        code, _, err = run_main([MNIST, "--gpus", "2", "--report", path], capsys)
    one_line_error(code, err, "--report", "socket")
    assert stat.S_ISSOCK(os.stat(path).st_mode)


@pytest.fixture()
def dev_null(tmp_path: Path) -> Path:
    """A character device like ``/dev/null`` (1, 3), made in ``tmp_path``: a regression then
    replaces this node, never the machine's ``/dev/null``."""
    path = tmp_path / "null"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


def test_out_dev_null_is_refused_not_replaced(
    dev_null: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = os.stat(dev_null)
    code, _, err = run_main([MNIST, "--gpus", "2", "--emit", dev_null], capsys)
    one_line_error(code, err, f"--emit {dev_null}", "character device")
    after = os.stat(dev_null)
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_out_through_a_symlink_to_a_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "link").symlink_to(tmp_path)
    code, _, err = run_main([MNIST, "--gpus", "2", "--out", tmp_path / "link"], capsys)
    one_line_error(code, err, "--out", "directory")
    assert (tmp_path / "link").is_symlink()


def test_write_follows_a_symlink_and_keeps_the_link(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")
    write_atomic(dangling, "made\n")
    assert dangling.is_symlink() and (tmp_path / "made.json").read_text() == "made\n"


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-null"])
def test_write_atomic_never_replaces_a_special_file(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "f" if kind == "fifo" else tmp_path
    if kind == "fifo":
        os.mkfifo(path)
    if kind == "dev-null":
        path = request.getfixturevalue("dev_null")
    mode = os.stat(path).st_mode
    with pytest.raises(OutputError, match="cannot write"):
        write_atomic(path, "x")
    assert os.stat(path).st_mode == mode


def test_out_is_the_topology_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topology = tmp_path / "two.json"
    text = '{"devices": [{"type": "h100", "count": 2}]}\n'
    topology.write_text(text)
    code, _, err = run_main([MNIST, "--topology", topology, "--out", topology], capsys)
    one_line_error(code, err, "--out", "the topology file", "input")
    assert topology.read_text() == text


def test_out_is_a_hard_link_to_the_model_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(TINY)
    os.link(model, tmp_path / "alias.py")
    code, _, err = run_main([model, "--gpus", "2", "--emit", tmp_path / "alias.py"], capsys)
    one_line_error(code, err, "--emit", "the model file")
    assert model.read_text() == TINY


def test_a_failed_write_leaves_no_new_file_and_restores_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--out is replaced first; the --report rename fails: the old --out comes back, the new
    --emit that never existed is not left behind, no temporary file stays."""
    out, report, emit = tmp_path / "plan.json", tmp_path / "r.html", tmp_path / "e.py"
    out.write_text("old plan\n")
    real_replace = os.replace
    calls = []

    def failing_replace(src: str, dst: str | os.PathLike[str]) -> None:
        calls.append(dst)
        if Path(dst) == report:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OutputError, match="No space left"):
        write_all_atomic([(emit, "new emit\n"), (out, "new plan\n"), (report, "<html>")])
    assert out.read_text() == "old plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


# -- input paths ----------------------------------------------------------------------------------


def test_show_of_a_fifo_is_refused_without_opening_it(
    fifo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(["show", fifo], capsys)
    one_line_error(code, err, str(fifo), "named pipe (FIFO)")


@pytest.mark.parametrize("path", ["/dev/zero", "/proc/self"])
def test_show_of_a_device_or_directory_is_refused(
    path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(["show", path], capsys)
    one_line_error(code, err, path, "regular file")


def test_show_of_a_huge_file_is_refused_by_its_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:  # sparse: costs no disk
        fh.truncate(MAX_PLAN_BYTES + 1)
    started = time.perf_counter()
    code, _, err = run_main(["show", big], capsys)
    one_line_error(code, err, str(big), f"{MAX_PLAN_BYTES // 2**20} MiB")
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 200_000, ["nested more than 64 deep"]),
        ('{"a": ' * 70 + "1" + "}" * 70, ["more than 64 deep"]),
        ('{"schema_version": ' + "9" * 5000 + "}", ["5000 digits", "at most 100"]),
        ('{"schema_version": 1.' + "0" * 5000 + "}", ["characters", "at most 100"]),
        ('{"schema_version": 1, "model": "m", "devi', ["truncated"]),
    ],
    ids=["deep-lists", "deep-objects", "long-integer", "long-float", "truncated"],
)
def test_show_of_unbounded_json_is_one_line(
    text: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(text)
    code, _, err = run_main(["show", plan], capsys)
    one_line_error(code, err, str(plan), *words)


def test_load_plan_is_bounded_for_python_callers_too(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("[" * 5000)
    with pytest.raises(PlanError, match="deep"):
        load_plan(plan)
    with pytest.raises(PlanError, match="is a directory; give a regular file"):
        load_plan(tmp_path)


def test_topology_fifo_is_refused_without_hanging(
    fifo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main([MNIST, "--topology", fifo], capsys)
    one_line_error(code, err, "topology file", "named pipe (FIFO)")


def test_topology_symlink_to_dev_zero_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    code, _, err = run_main([MNIST, "--topology", zero], capsys)
    one_line_error(code, err, "topology file", "character device")


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("deep.json", '{"devices": ' + "[" * 100 + "]" * 100 + "}", ["64 deep"]),
        ("long.json", '{"devices": [{"count": ' + "1" * 400 + "}]}", ["400 digits"]),
        ("deep.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n", ["not valid TOML"]),
        ("long.toml", "a = " + "1" * 5000 + "\n", ["not valid TOML"]),
        ("big.toml", "# x\n" * 300_000, ["larger than 1 MiB"]),
    ],
)
def test_topology_file_bounds(
    name: str, text: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, _, err = run_main([MNIST, "--topology", path, "--out", tmp_path / "p.json"], capsys)
    one_line_error(code, err, name, *words)
    assert not (tmp_path / "p.json").exists()


# -- bounds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--gpus", "100000000"], ["--gpus 100000000", "512"]),
        (["--gpus", "2", "--batch-size", "10000000000"], ["--batch-size", str(1 << 24)]),
        (["--gpus", "2", "--pipeline", "--microbatches", "1000000"], ["--microbatches", "1024"]),
        (["--gpus", "2", "--time-limit", "1e12"], ["--time-limit", "86400"]),
        (["--gpus", "2", "--input-shape", "100000,100000,3"], ["--input-shape", "2147483648"]),
    ],
    ids=["gpus", "batch-size", "microbatches", "time-limit", "input-shape"],
)
def test_counts_past_their_limit_are_refused_at_once(
    flags: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.perf_counter()
    code, _, err = run_main([MNIST, *flags, "--out", tmp_path / "p.json"], capsys)
    one_line_error(code, err, *words)
    assert time.perf_counter() - started < 1.0
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "data",
    [
        {"hosts": [{"devices": [{"type": "h100", "count": 4096}]}]},
        {"hosts": [{"count": 64, "devices": [{"type": "h100", "count": 64}]}]},
        {"devices": [{"type": "h100"}] * 513},
    ],
    ids=["4096-on-one-host", "64x64-hosts", "513-entries"],
)
def test_a_topology_of_too_many_devices_is_refused_at_once(
    data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(data))
    started = time.perf_counter()
    code, _, err = run_main([MNIST, "--topology", path], capsys)
    one_line_error(code, err, "big.json", "more than 512")
    assert time.perf_counter() - started < 1.0


# -- terminal safety --------------------------------------------------------------------------------


def test_show_escapes_control_characters_in_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # whole names, not cut to the column
    sys.path.insert(0, str(REPO / "tests"))
    from report_plans import make_plan

    hostile = "conv1\x1b[2J\x1b]0;pwned\x07\u202e\x9b31m"
    data = json.loads(make_plan().to_json().replace('"conv1"', json.dumps(hostile)))
    data["digest"] = plan_digest(data)  # a plan of a model named so, as written
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    code, out, err = run_main(["show", plan], capsys)
    assert code == 0, err
    assert "conv1\\x1b[2J" in out and "\\u202e" in out and "\\x9b" in out and "\\x07" in out
    assert not any(ch in out for ch in "\x1b\x07\x9b\u202e")


def test_error_messages_escape_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "no\x1b[31mdir\nx" / "plan.json"
    code, _, err = run_main([MNIST, "--gpus", "2", "--out", bad], capsys)
    line = one_line_error(code, err, "does not exist", "\\x1b[31m")
    assert "\x1b" not in line


# -- model files that exit ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code_wanted", "words"),
    [
        ("import sys\n\ndef build_model():\n    sys.exit(0)\n", 2, ["sys.exit(0)"]),
        ("import sys\n\ndef build_model():\n    raise SystemExit('bye')\n", 2, ["sys.exit('bye')"]),
        ("import sys\nsys.exit(0)\n", 2, ["importing", "sys.exit(0)"]),
        ("def build_model():\n    raise KeyboardInterrupt\n", 130, ["interrupted"]),
        (
            "class Stop(BaseException):\n    pass\n\ndef build_model():\n    raise Stop('halt')\n",
            2,
            ["Stop: halt"],
        ),
    ],
    ids=["exit-0-in-builder", "systemexit-text", "exit-0-at-import", "keyboardinterrupt", "baseexception"],
)
def test_model_code_that_exits_ends_in_one_line_and_a_non_zero_exit(
    body: str,
    code_wanted: int,
    words: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = tmp_path / "exits.py"
    model.write_text(body)
    code, _, err = run_main([model, "--gpus", "2", "--out", tmp_path / "p.json"], capsys)
    one_line_error(code, err, *words)
    assert code == code_wanted
    assert not (tmp_path / "p.json").exists()


# -- locales (subprocesses: the streams' encoding is fixed at start-up) ---------------------------


def _run_ascii(args: Sequence[str | os.PathLike[str]]) -> subprocess.CompletedProcess[str]:
    """``partition ARGS`` with ``LC_ALL=C`` and Python's UTF-8 mode off: an ASCII terminal."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("PYTHONIOENCODING", None)
    return subprocess.run(
        [sys.executable, "-m", "partitioner", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        encoding="ascii",
        errors="strict",
        timeout=240,
    )


def test_devices_and_show_work_on_an_ascii_terminal(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from report_plans import make_plan

    plan = tmp_path / "plan.json"
    plan.write_text(make_plan().to_json())
    for args in (["devices"], ["show", plan]):
        proc = _run_ascii(args)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "", proc.stderr
        assert "+--" in proc.stdout or "|" in proc.stdout  # ASCII boxes
    bad = _run_ascii(["show", tmp_path / "missing.json"])
    assert bad.returncode != 0 and len(bad.stderr.splitlines()) == 1, bad.stderr


@pytest.mark.slow
def test_a_run_on_an_ascii_terminal_exits_0_with_its_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = _run_ascii([MNIST, "--gpus", "2", "--no-strategies", "--out", out])
    assert proc.returncode == 0, proc.stderr
    assert "Predicted step time" in proc.stdout and json.loads(out.read_text())


@pytest.mark.slow
def test_a_run_that_fails_writing_the_report_writes_no_plan(tmp_path: Path) -> None:
    """A whole run whose --report cannot be renamed into place: no --out either."""
    out, report = tmp_path / "plan.json", tmp_path / "report.html"
    code = (
        "import os, sys\n"
        "real = os.replace\n"
        "def replace(src, dst):\n"
        "    if str(dst).endswith('report.html'):\n"
        "        raise OSError(28, 'No space left on device')\n"
        "    real(src, dst)\n"
        "os.replace = replace\n"
        "from partitioner.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(MNIST), "--gpus", "2", "--no-strategies",
         "--out", str(out), "--report", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode != 0
    assert len(proc.stderr.splitlines()) == 1 and "No space left" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_model_path_that_is_a_fifo_is_refused_without_opening_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.py"
    os.mkfifo(model)
    code, _, err = run_main([model, "--gpus", "2"], capsys)
    one_line_error(code, err, "model.py", "named pipe (FIFO)")


# -- the worker: this machine only unless told --------------------------------------------------


def test_worker_help_says_it_runs_any_graph_and_binds_loopback() -> None:
    from partitioner.cli.worker import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "executes any graph a client sends it" in text
    assert "127.0.0.1" in text and "--bind" in text and "trusted" in text


def test_worker_refuses_a_non_loopback_task_address_by_default() -> None:
    from partitioner.cli.worker import run_worker
    from partitioner.core.errors import UsageError

    with pytest.raises(UsageError, match=r"not this machine's loopback.*--bind 0\.0\.0\.0"):
        run_worker(0, {"worker": ["192.0.2.77:2222"]})


def _non_loopback_ip() -> str | None:
    """An address of this machine that is not loopback (None when it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent
            ip = probe.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else str(ip)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("bind", [None, "0.0.0.0"], ids=["default", "bind-all"])
def test_worker_serves_this_machine_only_unless_told(bind: str | None, tmp_path: Path) -> None:
    """Default: 127.0.0.1 connects, this machine's other address is refused. ``--bind
    0.0.0.0``: both connect, and stderr carries one warning line."""
    from partitioner.cli.worker import READY_PREFIX, free_ports

    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback address")
    signal.alarm(0)
    (port,) = free_ports(1)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"worker": [f"127.0.0.1:{port}"]}))
    cmd = [sys.executable, "-m", "partitioner.cli.worker", "--task", "0", "--cluster", str(cluster)]
    cmd += [] if bind is None else ["--bind", bind]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 120
        while READY_PREFIX not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()
        assert _reachable("127.0.0.1", port)
        assert _reachable(ip, port) is (bind is not None)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    warnings = [ln for ln in err.decode().splitlines() if "warning" in ln]
    if bind is None:
        assert warnings == [], err
    else:
        assert len(warnings) == 1 and "every interface" in warnings[0], err
        assert "executes any graph" in warnings[0]


def test_load_topology_is_bounded_for_python_callers_too(fifo: Path, tmp_path: Path) -> None:
    from cost_models.devices.topology import MAX_TOPOLOGY_BYTES, load_topology
    from partitioner.core.errors import UsageError

    with pytest.raises(UsageError, match="named pipe"):  # refused before it is opened: no hang
        load_topology(str(fifo))
    big = tmp_path / "big.toml"
    big.write_text("#" * (MAX_TOPOLOGY_BYTES + 1))
    with pytest.raises(UsageError, match="larger than 1 MiB"):
        load_topology(str(big))
