"""Hostile input, round three (issue 34, campaign 34: D4, D5, D14): the numbers and addresses
``partition worker`` and ``partition calibrate`` take are bounded, and refused in one line before
TensorFlow loads.

* ``--threads`` / ``--inter-op-threads`` (and ``run_worker(threads=, inter_op_threads=)``) are at
  most ``MAX_THREADS`` (1024): ``--threads 100000000`` ate all memory before.
* ``--timeout`` is finite, > 0 and at most ``MAX_TIMEOUT_S`` (3600 s), ``--rounds`` 3..``MAX_ROUNDS``
  (100), in ``CalibrationOptions.check`` and ``calibrate_cluster(timeout_s=)``: ``--timeout inf``
  waited for ever on a down worker before. The command names its flags, not the API's names.
* ``--bind`` refuses what no host is: the limited broadcast ``255.255.255.255``, this machine's
  networks' broadcast addresses, multicast and reserved addresses (the kernel lets a socket bind
  them, so they passed as "an address of this machine" and served every interface).

The command-line cases run with a ``tensorflow`` package on ``PYTHONPATH`` that ends the process
(status 99) when imported: a refusal must come before TensorFlow, and a regression fails at once
instead of starting a server (``--threads 100000000``) or waiting for ever (``--timeout inf``).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from partitioner.core.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
POISON_STATUS = 99
"""The exit status of a process that imported TensorFlow (see the module docstring)."""
FAST_S = 30.0
"""A refusal happens before TensorFlow and any network wait; this is the generous bound."""
MAX_TIMEOUT_PLUS_ONE = 3601.0
"""Past ``MAX_TIMEOUT_S`` (a literal: the constant did not exist before)."""


@pytest.fixture(scope="module")
def poisoned_tensorflow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a ``tensorflow`` package whose import ends the process."""
    root = tmp_path_factory.mktemp("poison")
    (root / "tensorflow").mkdir()
    (root / "tensorflow" / "__init__.py").write_text(
        "import os\n"
        "os.write(2, b'test: tensorflow was imported before the refusal\\n')\n"
        f"os._exit({POISON_STATUS})\n"
    )
    return root


def run_cli(poison: Path, *args: str | os.PathLike[str], cwd: Path) -> tuple[int, str, str]:
    """``python -m partitioner ARGS`` without TensorFlow: (exit code, stdout, stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(poison), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.pop("TF_CONFIG", None)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner", *(os.fspath(a) for a in args)],
        capture_output=True, text=True, timeout=120, env=env, cwd=cwd,
    )  # fmt: skip
    assert proc.returncode != POISON_STATUS, "TensorFlow was imported before the refusal"
    assert time.monotonic() - started < FAST_S
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(code: int, err: str, *words: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


@pytest.fixture()
def cluster_file(tmp_path: Path) -> Path:
    """A one-task cluster file on a free loopback port (no worker is running there)."""
    from partitioner.cli.worker import free_ports

    path = tmp_path / "cl.json"
    path.write_text(json.dumps({"worker": [f"127.0.0.1:{free_ports(1)[0]}"]}))
    return path


@pytest.fixture()
def two_task_cluster(tmp_path: Path) -> Path:
    """A two-task cluster file on free loopback ports, both down."""
    from partitioner.cli.worker import free_ports

    path = tmp_path / "cl2.json"
    path.write_text(json.dumps({"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}))
    return path


# -- D4: worker thread counts ----------------------------------------------------------------------

THREAD_CASES = [
    ("--threads", "100000000"),
    ("--threads", "1025"),
    ("--inter-op-threads", "100000000"),
    ("--inter-op-threads", "1025"),
]


@pytest.mark.parametrize(("flag", "value"), THREAD_CASES)
def test_worker_refuses_a_thread_count_past_the_bound(
    flag: str, value: str, cluster_file: Path, tmp_path: Path, poisoned_tensorflow: Path
) -> None:
    before = _files(tmp_path)
    code, out, err = run_cli(
        poisoned_tensorflow, "worker", "--task", "0", "--cluster", cluster_file, flag, value,
        cwd=tmp_path,
    )  # fmt: skip
    one_line_error(code, err, "partition worker: error:", f"{flag} {value}", "1024")
    assert out == "" and _files(tmp_path) == before


def test_run_worker_bounds_the_threads_with_the_same_constant() -> None:
    """The API refuses first, before the cluster is read (a task index out of range here would
    be the error otherwise), naming the bound of :data:`MAX_THREADS`."""
    from partitioner.cli.worker import MAX_THREADS, run_worker

    cluster = {"worker": ["127.0.0.1:1"]}
    stop = threading.Event()
    stop.set()
    for kwargs, flag in (
        ({"threads": 10**8}, "--threads"),
        ({"threads": MAX_THREADS + 1}, "--threads"),
        ({"inter_op_threads": 10**8}, "--inter-op-threads"),
        ({"threads": 2, "inter_op_threads": MAX_THREADS + 1}, "--inter-op-threads"),
    ):
        with pytest.raises(UsageError, match=rf"^{flag} \d+ is more than {MAX_THREADS}\b") as info:
            run_worker(5, cluster, stop=stop, **kwargs)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)
    assert MAX_THREADS == 1024


# -- D5: calibrate --timeout and --rounds --------------------------------------------------------

CALIBRATE_CASES = [
    (("--timeout", "inf"), "--timeout inf"),
    (("--timeout", "1e12"), "--timeout 1000000000000.0"),
    (("--timeout", "nan"), "--timeout nan"),
    (("--timeout", "3601"), "--timeout 3601"),
    (("--timeout", "0"), "--timeout 0"),
    (("--timeout", "-1"), "--timeout -1"),
    (("--rounds", "1000000000"), "--rounds 1000000000"),
    (("--rounds", "101"), "--rounds 101"),
    (("--rounds", "0"), "--rounds 0"),
    (("--quick", "--rounds", "-1"), "--rounds -1"),
]


@pytest.mark.parametrize(
    ("args", "words"), CALIBRATE_CASES, ids=[" ".join(a) for a, _ in CALIBRATE_CASES]
)
def test_calibrate_refuses_a_timeout_or_rounds_past_the_bounds_naming_its_flag(
    args: tuple[str, ...],
    words: str,
    two_task_cluster: Path,
    tmp_path: Path,
    poisoned_tensorflow: Path,
) -> None:
    before = _files(tmp_path)
    code, out, err = run_cli(
        poisoned_tensorflow, "calibrate", "--cluster", two_task_cluster, "--out", "cal.json",
        *args, cwd=tmp_path,
    )  # fmt: skip
    line = one_line_error(code, err, "partition calibrate: error:", words)
    for api_name in ("rounds=", "step_timeout_s", "timeout_s="):
        assert api_name not in line, line
    assert out == "" and _files(tmp_path) == before


def test_calibration_options_bound_rounds_and_timeout_in_one_place() -> None:
    from passes.cluster.calibrate import MAX_ROUNDS, MAX_TIMEOUT_S, CalibrationOptions

    for kwargs, name in (
        ({"rounds": 10**9}, "rounds"),
        ({"rounds": MAX_ROUNDS + 1}, "rounds"),
        ({"rounds": 2}, "rounds"),
        ({"rounds": True}, "rounds"),
        ({"warmup": MAX_ROUNDS + 1}, "warmup"),
        ({"step_timeout_s": math.inf}, "step_timeout_s"),
        ({"step_timeout_s": math.nan}, "step_timeout_s"),
        ({"step_timeout_s": 1e12}, "step_timeout_s"),
        ({"step_timeout_s": MAX_TIMEOUT_S + 1}, "step_timeout_s"),
        ({"step_timeout_s": 0.0}, "step_timeout_s"),
        ({"step_timeout_s": True}, "step_timeout_s"),
    ):
        with pytest.raises(UsageError, match=rf"^{name}=") as info:
            CalibrationOptions(**kwargs).check()
        assert "\n" not in str(info.value)
    CalibrationOptions(rounds=MAX_ROUNDS, warmup=MAX_ROUNDS, step_timeout_s=MAX_TIMEOUT_S).check()
    CalibrationOptions(rounds=3, warmup=0, step_timeout_s=0.5).check()
    assert (MAX_ROUNDS, MAX_TIMEOUT_S) == (100, 3600.0)


@pytest.mark.parametrize("timeout_s", [math.inf, 1e12, MAX_TIMEOUT_PLUS_ONE])
def test_calibrate_cluster_refuses_an_unbounded_connect_timeout_at_once(
    timeout_s: float, two_task_cluster: Path
) -> None:
    """No worker runs: an unbounded ``timeout_s`` waited for ever in the connect (nan and 0
    were refused by ``connect`` already)."""
    from passes.cluster.calibrate import calibrate_cluster

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            calibrate_cluster(two_task_cluster, timeout_s=timeout_s)
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60.0)
    assert not thread.is_alive(), "calibrate_cluster(timeout_s=...) waited on a down cluster"
    assert isinstance(outcome[0], UsageError), outcome
    assert str(outcome[0]).startswith(f"timeout_s={timeout_s!r} ")


def test_calibrate_cli_message_names_its_flags() -> None:
    from partitioner.cli.calibrate import cli_message

    assert cli_message("rounds=0 must be an integer from 3 to 100") == (
        "--rounds 0 must be an integer from 3 to 100"
    )
    assert cli_message("step_timeout_s=inf must be finite; timeout_s=1e+12.") == (
        "--timeout inf must be finite; --timeout 1000000000000.0."
    )
    assert cli_message("name their type, e.g. device_type='h100'") == (
        "name their type, e.g. --device-type h100"
    )
    assert (
        cli_message("sizes_bytes=[1] must hold two sizes") == "sizes_bytes=[1] must hold two sizes"
    )


# -- D14: worker --bind that no host is ---------------------------------------------------------

NOT_UNICAST = {
    "255.255.255.255": "the limited broadcast address",
    "224.0.0.1": "a multicast address",
    "239.255.255.250": "a multicast address",
    "ff02::1": "a multicast address",
    "[ff02::1]": "a multicast address",
    "::ffff:224.0.0.1": "a multicast address",
    "::ffff:255.255.255.255": "the limited broadcast address",
    "240.0.0.1": "a reserved address",
}


def _network_broadcasts() -> list[str]:
    """This machine's non-loopback network broadcast addresses (empty off Linux)."""
    from partitioner.cli.worker import _broadcast_addresses

    return sorted(a for a in _broadcast_addresses() if not ipaddress.ip_address(a).is_loopback)


@pytest.mark.parametrize("bind", ["255.255.255.255", "224.0.0.1", "ff02::1"])
def test_worker_refuses_a_broadcast_or_multicast_bind(
    bind: str, cluster_file: Path, tmp_path: Path, poisoned_tensorflow: Path
) -> None:
    before = _files(tmp_path)
    code, out, err = run_cli(
        poisoned_tensorflow, "worker", "--task", "0", "--cluster", cluster_file, "--bind", bind,
        cwd=tmp_path,
    )  # fmt: skip
    line = one_line_error(code, err, "partition worker: error:", f"--bind {bind!r}")
    assert NOT_UNICAST[bind] in line
    assert "every interface" not in line and "warning" not in err
    assert out == "" and _files(tmp_path) == before


def test_check_bind_refuses_what_no_host_is_and_keeps_the_rest() -> None:
    from partitioner.cli.worker import check_bind

    for bind, kind in NOT_UNICAST.items():
        with pytest.raises(UsageError, match=r"^--bind ") as info:
            check_bind(bind)
        assert f"--bind {bind!r} is {kind}," in str(info.value)
        assert "\n" not in str(info.value)
    for broadcast in _network_broadcasts():
        with pytest.raises(UsageError, match="a broadcast address of this machine's networks"):
            check_bind(broadcast)
    # README rows 54 and 55: loopback keeps the worker to this machine, an explicit unspecified
    # address serves every interface (the caller warns).
    for loopback in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2", "::ffff:127.0.0.1"):
        assert check_bind(loopback) is True, loopback
    assert check_bind("0.0.0.0") is False
    assert check_bind("::") is False


def test_run_worker_refuses_a_broadcast_bind_before_serving(cluster_file: Path) -> None:
    from partitioner.cli.worker import run_worker

    stop = threading.Event()
    stop.set()  # a regression that serves returns at once instead of serving for ever
    for bind in ("255.255.255.255", "224.0.0.1", *_network_broadcasts()):
        with pytest.raises(UsageError, match="^" + re.escape(f"--bind {bind!r} is ")):
            run_worker(0, cluster_file, bind=bind, stop=stop)


# -- calibrate --out never replaces the user's binary data (campaign 34f, c44 / c47) -------------


@pytest.mark.parametrize("through_link", [False, True], ids=["file", "symlink"])
def test_calibrate_refuses_an_out_that_holds_binary_data_before_calibrating(
    through_link: bool, two_task_cluster: Path, tmp_path: Path, poisoned_tensorflow: Path
) -> None:
    """``partition calibrate --out weights.json`` replaced 2000 random bytes (and, through a
    symbolic link, the link's binary target) with the topology after a 25 s calibration; the
    guard ``partition``'s outputs have (README row 88) now runs before any worker is asked."""
    data = bytes(range(256)) * 8
    (tmp_path / "h5.bin").write_bytes(data)
    out = "weights.json"
    if through_link:
        (tmp_path / out).symlink_to(tmp_path / "h5.bin")
    else:
        (tmp_path / out).write_bytes(data)
    before = _files(tmp_path)
    code, stdout, err = run_cli(
        poisoned_tensorflow, "calibrate", "--cluster", two_task_cluster, "--out", out, cwd=tmp_path
    )
    one_line_error(code, err, f"--out {out} exists and holds binary data", "remove it first")
    assert stdout == "" and _files(tmp_path) == before
    assert (tmp_path / "h5.bin").read_bytes() == data and (tmp_path / out).read_bytes() == data
