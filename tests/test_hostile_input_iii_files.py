"""Hostile input, round three (issue 34): ``partition worker --bind`` fails closed, and every file
the product reads goes through the one bounded reader
(``partitioner.core.files.read_regular_text``).

A ``--bind`` that is no address (empty, a typo, a name that does not resolve) is refused in one
line before anything starts; it never falls back to serving every interface. A cluster file, a
``TF_CONFIG`` value, a profile cache entry, a catalog or calibration file that is a FIFO, a device
(``/dev/zero``), a directory or larger than its bound is refused at once (a cache entry: ignored
with a warning, as a malformed one is), never blocked on. A case that would hang runs in a
subprocess with a timeout or a thread with a join timeout, so a regression fails, not blocks.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cost_models.devices.datafiles import read_text
from partitioner.core.errors import CatalogError, PartitionError, UsageError
from partitioner.core.files import UnreadableInput, read_input_text, read_regular_text

REPO = Path(__file__).resolve().parents[1]
BAD_BINDS = ["not.an.address.invalid", "", "127.0.0.l"]
JOIN_S = 60.0
"""How long a call that must return at once may take before the case fails (it imports
TensorFlow the first time)."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.pop("TF_CONFIG", None)
    return env


def run_cli(*args: str | os.PathLike[str], cwd: Path) -> tuple[int, str, str]:
    """``python -m partitioner ARGS`` (exit code, stdout, stderr); a hang fails after 120 s."""
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner", *(os.fspath(a) for a in args)],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=cwd,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(code: int, err: str, *words: str) -> str:
    assert code != 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def returns_within(call: Callable[[], Any], unblock: Path | None = None) -> BaseException | None:
    """What ``call()`` raised (None when it returned), in a thread joined for :data:`JOIN_S`: a
    call still blocked fails the case (and ``unblock``, a FIFO, is opened for writing so the
    thread ends)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    if thread.is_alive():
        if unblock is not None:
            try:
                os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"the call did not return within {JOIN_S:g} s: it blocked")
    return outcome[0]


@pytest.fixture()
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


@pytest.fixture()
def cluster_file(tmp_path: Path) -> Path:
    from partitioner.cli.worker import free_ports

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"worker": [f"127.0.0.1:{free_ports(1)[0]}"]}))
    return path


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


# -- the one bounded reader ------------------------------------------------------------------------


@pytest.fixture()
def special(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A file that is not regular, and the words naming its kind."""
    kind = request.param
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        yield path, "named pipe (FIFO)"
    elif kind == "dev-zero":
        yield Path("/dev/zero"), "character device"
    elif kind == "directory":
        yield tmp_path, "directory"
    else:
        path = tmp_path / "s.sock"
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))
            yield path, "socket"


SPECIALS = ["fifo", "dev-zero", "directory", "socket"]


@pytest.mark.parametrize("special", SPECIALS, indirect=True)
def test_the_reader_refuses_what_is_not_a_regular_file_at_once(special: tuple[Path, str]) -> None:
    path, kind = special
    exc = returns_within(lambda: read_regular_text(path, 1 << 20), unblock=path)
    assert isinstance(exc, UnreadableInput) and exc.kind == "type"
    assert str(exc) == f"cannot read {path}: it is a {kind}, not a regular file"
    exc = returns_within(lambda: read_text(path, "cluster file 'x'", UsageError), unblock=path)
    assert isinstance(exc, UsageError)
    assert str(exc) == (
        f"cannot read cluster file 'x': it is a {kind}, not a regular file; give a regular file"
    )
    exc = returns_within(lambda: read_input_text(path, "plan file", UsageError, 1 << 20), path)
    assert isinstance(exc, UsageError)
    assert str(exc) == f"plan file {path} is a {kind}; give a regular file"


def test_the_reader_bounds_size_and_names_the_rest(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text("x" * ((1 << 20) + 1))
    with pytest.raises(UnreadableInput, match=r"larger than 1 MiB, the most read$"):
        read_regular_text(big, 1 << 20)
    assert read_regular_text(big, 2 << 20) == "x" * ((1 << 20) + 1)
    with pytest.raises(UsageError, match=r"^cannot read my file: it does not exist; check the"):
        read_text(tmp_path / "none.json", "my file", UsageError)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"a": "\xe9"}')
    with pytest.raises(CatalogError, match=r"^cannot read my file: it is not UTF-8 text \(byte 7"):
        read_text(latin, "my file", CatalogError)
    with pytest.raises(UsageError, match=r"larger than 1 MiB.*; is it the right file\?$"):
        read_text(big, "my file", UsageError, max_bytes=1 << 20)


def test_catalog_and_calibration_files_go_through_the_reader(fifo: Path) -> None:
    from cost_models.devices.catalog import load_catalog_from
    from cost_models.estimate.calibrate import load_calibration

    for load in (load_catalog_from, load_calibration):
        exc = returns_within(lambda: load(fifo), unblock=fifo)  # noqa: B023 - joined at once
        assert isinstance(exc, CatalogError) and "named pipe (FIFO)" in str(exc), exc
        assert str(fifo) in str(exc) and "\n" not in str(exc)


# -- partition worker --bind fails closed ----------------------------------------------------------


@pytest.mark.parametrize("bind", BAD_BINDS, ids=["unresolvable", "empty", "typo"])
def test_worker_refuses_a_bind_that_is_no_address(
    bind: str, cluster_file: Path, tmp_path: Path
) -> None:
    before = _files(tmp_path)
    code, out, err = run_cli(
        "worker", "--task", "0", "--cluster", cluster_file, f"--bind={bind}", cwd=tmp_path
    )
    line = one_line_error(code, err, "partition worker: error:", f"--bind {bind!r}")
    assert "every interface" not in line and "warning" not in err
    assert out == "" and _files(tmp_path) == before


@pytest.mark.parametrize("bind", [*BAD_BINDS, " ", "192.0.2.77", "example.invalid:2222"])
def test_run_worker_refuses_a_bind_that_is_no_address(bind: str, cluster_file: Path) -> None:
    from partitioner.cli.worker import run_worker

    stop = threading.Event()
    stop.set()  # a regression that serves returns at once instead of serving for ever
    with pytest.raises(UsageError, match=r"^--bind ") as info:
        run_worker(0, cluster_file, bind=bind, stop=stop)
    assert repr(bind) in str(info.value) and "\n" not in str(info.value)


def test_check_bind_opens_only_for_an_explicit_address_of_this_machine() -> None:
    from partitioner.cli.worker import check_bind

    for loopback in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert check_bind(loopback) is True, loopback
    assert check_bind("0.0.0.0") is False
    for bad in (*BAD_BINDS, "192.0.2.77", "999.1.1.1"):
        with pytest.raises(UsageError, match=r"^--bind "):
            check_bind(bad)


# -- cluster files and TF_CONFIG -----------------------------------------------------------------


@pytest.mark.slow  # a worker process importing TensorFlow
@pytest.mark.parametrize("what", ["fifo", "dev-zero"])
def test_worker_cluster_file_that_blocks_is_refused(what: str, fifo: Path, tmp_path: Path) -> None:
    path, kind = (fifo, "named pipe (FIFO)")
    if what == "dev-zero":
        path, kind = Path("/dev/zero"), "character device"
    code, out, err = run_cli("worker", "--task", "0", "--cluster", path, cwd=tmp_path)
    one_line_error(code, err, "cannot read cluster file", str(path), kind, "not a regular file")
    assert out == ""


@pytest.mark.slow  # a calibrate process importing TensorFlow
def test_calibrate_cluster_file_fifo_is_refused(fifo: Path, tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    code, _, err = run_cli("calibrate", "--cluster", fifo, "--out", out, cwd=tmp_path)
    one_line_error(code, err, "cannot read cluster file", "named pipe (FIFO)")
    assert not out.exists()


@pytest.mark.parametrize("special", SPECIALS, indirect=True)
def test_connect_and_load_cluster_refuse_at_once(special: tuple[Path, str]) -> None:
    from passes.cluster.runtime import connect, load_cluster

    path, kind = special
    for call in (lambda: load_cluster(path), lambda: connect(path, timeout_s=5)):
        exc = returns_within(call, unblock=path)
        assert isinstance(exc, UsageError), exc
        assert f"cannot read cluster file {str(path)!r}: it is a {kind}" in str(exc)


def test_oversized_cluster_file_is_refused(tmp_path: Path) -> None:
    from passes.cluster.runtime import MAX_CLUSTER_BYTES, load_cluster

    big = tmp_path / "cluster.json"
    big.write_text('{"worker": ["127.0.0.1:2222"]}' + " " * MAX_CLUSTER_BYTES)
    with pytest.raises(UsageError, match=r"cluster file .*larger than 1 MiB, the most read"):
        load_cluster(big)


def test_tf_config_of_two_mib_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from cost_models.devices.topology import load_topology, topology_from_tf_config
    from passes.cluster.runtime import load_cluster

    big = json.dumps({"cluster": {"worker": ["127.0.0.1:2222"]}, "pad": "x" * (2 << 20)})
    monkeypatch.setenv("TF_CONFIG", big)
    pattern = r"TF_CONFIG environment variable holds \d+ bytes, more than the 1 MiB read"
    with pytest.raises(UsageError, match=pattern):
        load_cluster(None)
    with pytest.raises(UsageError, match=pattern):
        load_topology("tf-config", device_type="h100")
    with pytest.raises(UsageError, match=r"^TF_CONFIG holds \d+ bytes"):
        topology_from_tf_config(big, device_type="h100")


def test_plan_apply_with_a_fifo_cluster_returns_at_once(fifo: Path) -> None:
    import keras

    import partitioner

    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")]
    )
    plan = partitioner.partition(model, gpus=2, batch_size=4, solver="even")
    exc = returns_within(lambda: plan.apply(model, cluster=fifo, timeout_s=5), unblock=fifo)
    assert isinstance(exc, PartitionError) and "named pipe (FIFO)" in str(exc), exc
    assert str(fifo) in str(exc) and "\n" not in str(exc)


# -- the profile cache ---------------------------------------------------------------------------


def test_profile_cache_entry_fifo_or_oversized_is_a_miss_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cost_models.measure import profiled

    key = "0" * 64
    path = tmp_path / "layers" / f"{key}.json"
    path.parent.mkdir()
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING):
        assert returns_within(lambda: profiled._read_entry(tmp_path, key), unblock=path) is None
    assert "named pipe (FIFO)" in caplog.text and str(path) in caplog.text
    caplog.clear()
    path.unlink()
    big = {"schema": profiled.CACHE_SCHEMA, "key": key, "pad": "x" * (1 << 20)}
    path.write_text(json.dumps(big))
    with caplog.at_level(logging.WARNING):
        assert profiled._read_entry(tmp_path, key) is None
    assert "larger than 1 MiB" in caplog.text


def test_profile_with_fifos_in_the_cache_measures_and_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every entry the profiler would read is a FIFO: it ignores them (a warning each),
    measures, and cannot write over them (a warning), all without blocking."""
    import keras

    from cost_models.measure.profiled import ProfileSettings, profile_model

    fast = ProfileSettings(warmup=0, min_repeats=1, max_repeats=1, min_time_s=0.0)

    def tiny() -> Any:
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")]
        )

    first = profile_model(tiny(), batch_size=4, settings=fast, cache_dir=tmp_path)
    entries = sorted((tmp_path / "layers").glob("*.json"))
    assert first.measured_count == 2 and len(entries) == 2
    for entry in entries:
        entry.unlink()
        os.mkfifo(entry)
    results: list[Any] = []

    def again() -> None:
        results.append(profile_model(tiny(), batch_size=4, settings=fast, cache_dir=tmp_path))

    with caplog.at_level(logging.WARNING):
        exc = returns_within(again, unblock=entries[0])
    assert exc is None, exc
    assert results[0].measured_count == 2 and results[0].cached_count == 0
    assert caplog.text.count("named pipe (FIFO)") >= 2
