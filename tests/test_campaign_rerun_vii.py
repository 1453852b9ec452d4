"""Issue 34, what the sixth rerun of the hostile-input campaign (34f) found still open: outputs
that hold binary data anywhere are never replaced, files the model's code reads are protected
as they were when read."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import pytest

from partitioner.core.errors import OutputError, PartitionError
from partitioner.core.files import MAX_REPLACEABLE_BYTES, binary_offset, check_replaceable
from tests.test_campaign_rerun_v_files import _tiny_model
from tests.test_hostile_input_iii_paths import (
    CUSTOM_LAYERS,
    TINY,
    one_line_error,
    run_cli,
    snapshot,
    write_tree,
)

READS_THROUGH_DIR_FD = {
    "m.py": (
        "import os\n"
        "fd = os.open('dep', os.O_RDONLY)\n"
        "{read}\n"
        "os.close(fd)\n"
        "from tiny import build_model\n"
    ),
    "tiny.py": TINY,
    "dep/settings.txt": "lr = 0.1  # the user's settings\n",
}


@pytest.mark.parametrize(
    ("content", "offset"),
    [
        (b"#!/bin/sh\n" + b"echo text\n" * 1000 + b"\x00\x01payload", 10010),  # past 4 KiB (c61)
        (b"a" * (2**20 - 1) + "é".encode(), None),  # a character across a chunk boundary is text
        (b"a" * 5000 + b"\xff\xfe", 5000),
        (b"plain text\n", None),
        (b"ends inside a character \xc3", 24),
    ],
    ids=["binary-after-4KiB", "char-across-chunks", "invalid-utf8", "text", "cut-character"],
)
def test_binary_offset_reads_the_whole_file(
    content: bytes, offset: int | None, tmp_path: Path
) -> None:
    path = tmp_path / "f"
    path.write_bytes(content)
    assert binary_offset(path) == offset


def test_a_file_binary_only_past_its_first_4_kib_is_not_replaced(tmp_path: Path) -> None:
    """A 26 KB self-extracting installer (a shell script, then an archive) named as ``--out``
    was replaced: the guard read 4 KiB only (c61)."""
    installer = tmp_path / "installer.run"
    installer.write_bytes(b"#!/bin/sh\n" + b"# text\n" * 1000 + bytes(range(256)) * 80)
    with pytest.raises(OutputError, match=r"^--out installer.run exists and holds binary data"):
        check_replaceable(installer, "--out installer.run")
    text = tmp_path / "plan.json"
    text.write_text('{"a": 1}\n' * 10000)
    with pytest.raises(OutputError, match=r"^--out plan.json exists and is not a file partitioner"):
        check_replaceable(text, "--out plan.json")  # a user's text file is kept (row 234)
    check_replaceable(tmp_path / "new.json", "--out new.json")  # nothing there yet


def test_a_file_larger_than_anything_partitioner_writes_is_not_replaced(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_REPLACEABLE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(OutputError, match=r"is larger \(\d+ bytes\) than any file partitioner"):
        check_replaceable(big, "--report big.json")


@pytest.mark.parametrize(
    "read",
    [
        "os.close(os.open('settings.txt', os.O_RDONLY, dir_fd=fd))",
        "open('settings.txt', opener=lambda p, f: os.open(p, f, dir_fd=fd)).close()",
    ],
    ids=["os.open-dir_fd", "opener"],
)
def test_a_file_read_relative_to_a_directory_descriptor_is_not_replaced(
    read: str, tmp_path: Path
) -> None:
    """The audit event of ``os.open(name, flags, dir_fd=fd)`` carries ``name`` without its
    directory: it was taken as relative to the working directory, and ``--out
    dep/settings.txt`` overwrote the file the model read (c15, c19)."""
    files = dict(READS_THROUGH_DIR_FD)
    files["m.py"] = files["m.py"].format(read=read)
    write_tree(tmp_path, files)
    before = snapshot(tmp_path)
    proc = run_cli(
        ["m.py", "--gpus", "2", "--no-strategies", "--out", "dep/settings.txt"], tmp_path
    )
    one_line_error(proc, "--out dep/settings.txt exists and is not a file partitioner wrote")
    assert snapshot(tmp_path) == before


def test_a_file_read_through_a_link_is_protected_where_it_was_read(tmp_path: Path) -> None:
    """The model reads ``data/x.txt`` (``data -> dirA``), then re-points ``data -> dirB``: the
    reads were resolved after the model ran, so ``--out dirA/x.txt`` overwrote the file read
    (c62). They are resolved when read."""
    write_tree(tmp_path, {"dirA/x.txt": "A data\n", "dirB/x.txt": "B data\n", "tiny.py": TINY})
    (tmp_path / "data").symlink_to("dirA")
    (tmp_path / "m.py").write_text(
        "import os\nopen('data/x.txt').read()\nos.remove('data')\nos.symlink('dirB', 'data')\n"
        "from tiny import build_model\n"
    )
    proc = run_cli(["m.py", "--gpus", "2", "--no-strategies", "--out", "dirA/x.txt"], tmp_path)
    one_line_error(proc, "--out dirA/x.txt exists and is not a file partitioner wrote")
    assert (tmp_path / "dirA" / "x.txt").read_text() == "A data\n"


@pytest.mark.parametrize(
    ("call", "shown"), [("os._exit(0)", "os._exit(0)"), ("sys.exit(0)", "sys.exit(0)")]
)
def test_an_exit_handler_that_exits_0_does_not_turn_a_failed_run_into_success(
    call: str, shown: str, tmp_path: Path
) -> None:
    """``atexit.register(lambda: os._exit(0))`` in the model file: the run failed (an input
    shape the model refuses), printed its error, then ended with status 0 (c16)."""
    (tmp_path / "m.py").write_text(
        f"import atexit, os, sys\natexit.register(lambda: {call})\n" + TINY
    )
    proc = run_cli(["m.py", "--gpus", "2", "--input-shape", "5", "--out", "p.json"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("partition: error: "), proc.stderr
    assert f"called {shown}, ignored: the run's own exit status stands" in lines[1]
    assert not (tmp_path / "p.json").exists()


def test_what_the_models_code_writes_to_stderr_is_shown(tmp_path: Path) -> None:
    """A model that says why it stops (``print(..., file=sys.stderr)`` then ``sys.exit(3)``):
    its line was swallowed with TensorFlow's native start-up logging, so the user saw only
    "remove the exit from the model file" (c24). Python's stderr now reaches the user while
    the model's code runs; native writes to fd 2 stay silent."""
    (tmp_path / "m.py").write_text(
        "import os, sys\n"
        "if 'DATA_DIR' not in os.environ:\n"
        "    print('mymodel: set DATA_DIR to the folder with vocab.txt', file=sys.stderr)\n"
        "    sys.exit(3)\n" + TINY
    )
    proc = run_cli(["m.py", "--gpus", "2", "--out", "p.json"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0] == "mymodel: set DATA_DIR to the folder with vocab.txt", proc.stderr
    assert len(lines) == 2 and "called sys.exit(3)" in lines[1], proc.stderr


def test_the_models_own_warnings_show_and_the_libraries_do_not(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "import warnings\nwarnings.warn('mymodel: vocab.txt is old')\n" + TINY
    )
    proc = run_cli(["m.py", "--gpus", "2", "--out", "p.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "UserWarning: mymodel: vocab.txt is old" in proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "Warning" in line]
    assert len(warned) == 1 and "m.py:2: UserWarning" in warned[0], proc.stderr  # only the model's


STATEFUL = (
    "import keras\n\ndef build_model():\n"
    "    i = keras.Input(batch_shape=(8, 5, 3), name='x')\n"
    "    h = keras.layers.GRU(4, stateful=True, name='sgru')(i)\n"
    "    return keras.Model(i, keras.layers.Dense(2, name='out')(h), name='sg')\n"
)


def _stateful_model() -> Any:
    namespace: dict[str, Any] = {}
    exec(STATEFUL, namespace)
    return namespace["build_model"]()


def test_a_fixed_batch_model_placed_runs_at_its_batch(tmp_path: Path) -> None:
    """A stateful GRU with ``batch_shape=(8, ...)``, planned with strategy 'placed' (the one the
    fixed-batch refusal recommends): ``Plan.apply`` built its copy on one sample, so the state
    was made at batch 1 and Keras refused the model's own batch 8 with a raw ValueError; the
    emitted module's ``SAMPLE_INPUTS`` had batch 1 too (c28). Copies are built at the fixed
    batch."""
    import numpy as np

    import partitioner
    from tests.emitted import import_emitted

    model = _stateful_model()
    plan = partitioner.partition(model, gpus=2, device_type="cpu", strategy="placed", batch_size=8)
    placed = plan.apply(model, devices=["/device:CPU:0", "/device:CPU:1"])
    x = np.random.default_rng(0).standard_normal((8, 5, 3)).astype("float32")
    assert np.allclose(placed(x), _stateful_model_copy(model)(x), atol=1e-5)
    (tmp_path / "m.py").write_text(STATEFUL)
    proc = run_cli(
        ["m.py", "--gpus", "2", "--device-type", "cpu", "--batch-size", "8", "--strategy",
         "placed", "--out", "p.json", "--emit", "emitted.py"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    emitted = import_emitted(tmp_path / "emitted.py").build_model()
    assert tuple(emitted(x).shape) == (8, 2)


def _stateful_model_copy(model: Any) -> Any:
    """A fresh stateful model with ``model``'s weights (its state at zero, as the copy's)."""
    fresh = _stateful_model()
    fresh.set_weights(model.get_weights())
    return fresh


def test_a_builder_that_imports_a_sibling_module_itself_loads(tmp_path: Path) -> None:
    """``def build_model(): import customlayers`` failed with ModuleNotFoundError: the model's
    directory left ``sys.path`` once the file was imported, before its builder ran (c12b)."""
    write_tree(
        tmp_path,
        {
            "customlayers.py": CUSTOM_LAYERS,
            "m.py": "import keras\n\ndef build_model():\n    import customlayers\n"
            "    return keras.Sequential([keras.Input((8,)), customlayers.dense('a'),"
            " keras.layers.Dense(4, name='b')])\n",
        },
    )
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    proc = run_cli(["../m.py", "--gpus", "2", "--out", "p.json"], elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert (elsewhere / "p.json").is_file()
    # the directory is on sys.path while the model's code runs, not after
    from partitioner.cli.loader import load_model

    before = list(sys.path)
    try:
        assert load_model(str(tmp_path / "m.py")).name
    finally:
        sys.modules.pop("customlayers", None)  # this process's other tests have their own
    assert sys.path == before


@pytest.mark.parametrize("flag", ["--out", "--report", "--emit"])
def test_an_output_path_ending_in_a_slash_is_refused(flag: str, tmp_path: Path) -> None:
    """``--out plan.json/`` wrote the regular file plan.json (c56): a trailing slash names a
    directory."""
    write_tree(tmp_path, {"m.py": TINY})
    before = snapshot(tmp_path)
    proc = run_cli(["m.py", "--gpus", "2", flag, "plan.json/"], tmp_path)
    one_line_error(proc, f"{flag} plan.json/ ends with a slash", "give a file path")
    assert snapshot(tmp_path) == before


def test_a_model_path_to_a_proc_file_is_one_line_with_a_next_step(tmp_path: Path) -> None:
    """A model path that is a link to ``/proc/self/pagemap`` (a "regular" file of size 0 that
    refuses a whole read) gave ``OSError: [Errno 22] Invalid argument`` with no next step
    (c34)."""
    (tmp_path / "m.py").symlink_to("/proc/self/pagemap")
    proc = run_cli(["m.py", "--gpus", "2"], tmp_path)
    line = one_line_error(proc, "m.py")
    assert "is it the right file?" in line or "give a Python file" in line, line
    assert "Errno" not in line or "cannot read" in line


def test_a_profile_cache_that_cannot_be_written_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache directory that is a file gave one warning per layer (c20)."""
    from cost_models.measure.profiled import ProfileSettings, profile_model

    cache = tmp_path / "cache"
    cache.write_text("not a directory\n")
    fast = ProfileSettings(warmup=0, min_repeats=1, max_repeats=1, min_time_s=0.0)
    with caplog.at_level(logging.WARNING, logger="cost_models.measure.profiled"):
        profiled = profile_model(_tiny_model(), batch_size=4, cache_dir=cache, settings=fast)
    assert profiled.measured_count >= 2
    warned = [r for r in caplog.records if "not written" in r.getMessage()]
    assert len(warned) == 1 and "not cached" in warned[0].getMessage()
    assert cache.read_text() == "not a directory\n"


def test_a_profile_cache_whose_layers_directory_is_a_link_is_not_written_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache's ``layers/`` a symbolic link to another directory: entries were written
    through it into that directory (c24)."""
    from cost_models.measure.profiled import ProfileSettings, profile_model

    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    elsewhere.mkdir()
    (cache / "layers").symlink_to(elsewhere)
    fast = ProfileSettings(warmup=0, min_repeats=1, max_repeats=1, min_time_s=0.0)
    with caplog.at_level(logging.WARNING, logger="cost_models.measure.profiled"):
        profile_model(_tiny_model(), batch_size=4, cache_dir=cache, settings=fast)
    assert list(elsewhere.iterdir()) == []
    assert "is a symbolic link" in caplog.text


def test_a_cluster_address_longer_than_a_host_name_is_refused() -> None:
    """A 300-character host name was accepted in ``TF_CONFIG`` (t20)."""
    from cost_models.devices.tf_config import (
        MAX_HOST_NAME_CHARS,
        check_addresses,
        parse_tf_config,
    )

    long_host = "a" * 60 + ("." + "b" * 60) * 4  # 304 characters, labels within 63
    for host in (long_host, "c" * 64 + ".example"):
        text = json.dumps({"cluster": {"worker": [f"{host}:2222"]}})
        with pytest.raises(
            PartitionError, match=rf"longer than a host name can be \({MAX_HOST_NAME_CHARS}"
        ):
            check_addresses(parse_tf_config(text))
    check_addresses(parse_tf_config(json.dumps({"cluster": {"worker": ["b" * 63 + ".x:2222"]}})))


def test_a_model_that_changes_the_umask_does_not_make_outputs_unreadable(tmp_path: Path) -> None:
    """``os.umask(0o777)`` in the model file made the new report mode 0000 (c21)."""
    write_tree(tmp_path, {"m.py": "import os\nos.umask(0o777)\n" + TINY})
    proc = run_cli(["m.py", "--gpus", "2", "--out", "p.json", "--report", "r.html"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("p.json", "r.html"):
        assert (tmp_path / name).stat().st_mode & 0o600 == 0o600, name


def test_a_worker_whose_tf_config_task_is_another_job_is_told_which_flag() -> None:
    """TF_CONFIG's task ``{type: ps, index: 0}`` with the default ``--job worker`` was told "set
    TF_CONFIG's task.index", which was set: the job differs (B12)."""
    from partitioner.cli.worker import run_worker
    from partitioner.core.errors import UsageError

    config = {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "ps", "index": 0},
    }
    with pytest.raises(UsageError, match=r"task is of job 'ps'.*pass --job ps to serve that task"):
        run_worker(None, config)


@pytest.mark.parametrize("host", ["::ffff:127.0.0.1", "[::ffff:127.0.0.1]", "127.0.0.1", "::1"])
def test_an_ipv4_mapped_loopback_address_is_loopback(host: str) -> None:
    """``[::ffff:127.0.0.1]:port`` in a cluster file was refused as "not this machine's
    loopback" (B16): it is 127.0.0.1 (README row 90)."""
    from partitioner.cli.worker import is_loopback

    assert is_loopback(host)
    assert not is_loopback("::ffff:8.8.8.8")


def test_run_worker_open_to_every_interface_warns_through_the_library(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``run_worker(bind="0.0.0.0")`` from the API opened every interface without a word; the
    command line warned (B14). The warning comes before the server starts (here a core this
    machine lacks stops the run right after it)."""
    from partitioner.cli.worker import run_worker
    from partitioner.core.errors import UsageError

    with caplog.at_level(logging.WARNING, logger="partitioner.cli.worker"):
        with pytest.raises(UsageError):
            run_worker(0, {"worker": ["127.0.0.1:1"]}, bind="0.0.0.0", cores=[100000])
    assert "bind='0.0.0.0': listening on every interface" in caplog.text


def test_a_plan_measured_on_127_0_0_1_applies_to_the_cluster_spelled_localhost(
    plan: Any, mlp: Any
) -> None:
    """A plan calibrated on ``127.0.0.1:p`` was refused for the same cluster spelled
    ``localhost:p`` (K4), which README row 78 treats as one server. The check passes (the
    connection then fails: nothing listens there) and a real difference is still named."""
    import dataclasses

    from passes.cluster.runtime import ClusterError

    measured = dataclasses.replace(plan, cluster_addresses=("127.0.0.1:1", "127.0.0.1:2"))
    with pytest.raises(ClusterError, match="is down"):
        measured.apply(mlp, cluster={"worker": ["localhost:1", "localhost:02"]}, timeout_s=0.5)
    with pytest.raises(
        PartitionError, match=r"task 1: 127\.0\.0\.1:2 in the plan, localhost:3 here"
    ):
        measured.apply(mlp, cluster={"worker": ["localhost:1", "localhost:3"]}, timeout_s=0.5)


SPELLINGS = [
    "CPU:0", "cpu:0", "/cpu:0", "/CPU:0", "/device:CPU:0", "/device:cpu:0", "/job:localhost/device:CPU:0",
    "/task:0/device:CPU:0", "/replica:0/task:0/device:CPU:0",
    "/job:localhost/replica:0/task:0/device:CPU:0", "/device:CPU:1", "/job:localhost/device:CPU:1",
    "/device:GPU:0", "/gpu:0", "/job:worker/replica:0/task:1/device:CPU:0",
    "/job:worker/task:1/device:CPU:0", "/job:worker/task:1/cpu:0", "/task:1/device:CPU:0",
    "/device:CPU:00", "/device:CPU:*",
]  # fmt: skip


def test_the_plans_device_key_reads_names_as_tensorflow_does() -> None:
    """One home for "which spellings name one device": a plan file is checked without
    TensorFlow (``partitioner.plan.model.device_key``) and ``Plan.apply`` uses the same key; it
    groups these spellings exactly as TensorFlow's ``DeviceSpec`` (merged into this process's
    ``/job:localhost/replica:0/task:0``) does."""
    import tensorflow as tf

    from partitioner.plan.model import device_key

    here = tf.DeviceSpec(job="localhost", replica=0, task=0)

    def tf_key(name: str) -> str:
        return here.make_merged_spec(tf.DeviceSpec.from_string(name)).to_string()

    for a in SPELLINGS:
        for b in SPELLINGS:
            assert (device_key(a) == device_key(b)) == (tf_key(a) == tf_key(b)), (a, b)


# -- the seventh rerun (34g) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "read",
    [
        "import io, pathlib\nio.FileIO(pathlib.Path('dep/settings.txt')).read()\n",
        "import io, os\nio.FileIO(next(e for e in os.scandir('dep'))).read()\n",
        "import multiprocessing as mp\n"
        "def _read(p):\n    with open(p) as f:\n        return f.read()\n"
        "with mp.get_context('fork').Pool(1) as pool:\n"
        "    pool.map(_read, ['dep/settings.txt'])\n",
    ],
    ids=["FileIO-Path", "FileIO-DirEntry", "forked-pool"],
)
def test_a_file_read_through_a_path_object_or_a_forked_child_is_not_replaced(
    read: str, tmp_path: Path
) -> None:
    """``io.FileIO(pathlib.Path(...))`` passes the path object itself to the audit event, which
    was skipped; a file read in a forked ``multiprocessing`` child was recorded in the child's
    copy only (34g N1, N51). Both were overwritten by ``--out``."""
    write_tree(tmp_path, {"m.py": read + TINY, "dep/settings.txt": "lr = 0.1\n"})
    before = snapshot(tmp_path)
    proc = run_cli(["m.py", "--gpus", "2", "--out", "dep/settings.txt"], tmp_path)
    one_line_error(proc, "--out dep/settings.txt exists and is not a file partitioner wrote")
    assert snapshot(tmp_path) == before


def test_a_profile_cache_directory_the_model_re_points_is_refused(tmp_path: Path) -> None:
    """The model turns ``PARTITIONER_CACHE_DIR`` into a link to another directory at import:
    ``--profile`` wrote its entries there (34g N22). The cache is resolved before the model's
    code runs and checked after it, as outputs are (row 97)."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "elsewhere").mkdir()
    write_tree(
        tmp_path,
        {
            "m.py": "import os\nos.rename('cache', 'cache_old')\n"
            "os.symlink(os.path.abspath('elsewhere'), 'cache')\n" + TINY
        },
    )
    env = {**os.environ, "PARTITIONER_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "partitioner", "m.py", "--gpus", "1", "--device-type", "cpu",
         "--profile", "--out", "p.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "the profile cache directory" in proc.stderr and "now leads to" in proc.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert not (tmp_path / "p.json").exists()


def test_a_json_file_of_millions_of_containers_is_refused_before_parsing(tmp_path: Path) -> None:
    """A 60 MiB plan file of twenty million ``{}`` under an extra key took 48 s and 3 GB to parse
    before its error (34g N24)."""
    from partitioner import load_plan
    from partitioner.core.errors import PlanError
    from partitioner.core.jsonfiles import MAX_CONTAINERS

    bomb = tmp_path / "bomb.json"
    bomb.write_text('{"x": [' + "{}," * MAX_CONTAINERS + "{}]}")
    with pytest.raises(PlanError, match=rf"holds {MAX_CONTAINERS + 3} lists/objects, more than"):
        load_plan(bomb)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("x.json/", "it ends with a slash"),
        ("/dev/stdout", "an open file descriptor (a stream such as stdout), not a file"),
    ],
)
def test_plan_save_refuses_a_directory_spelling_and_a_pipe(
    path: str, words: str, plan: Any, tmp_path: Path
) -> None:
    """``Plan.save('x.json/')`` wrote x.json (34g L3); ``Plan.save('/dev/stdout')`` with stdout
    a pipe said "No such file or directory" of ``/proc/<pid>/fd/pipe:[N]`` (L9)."""
    if path == "/dev/stdout":
        read, write = os.pipe()
        saved = os.dup(1)
        os.dup2(write, 1)
        try:
            with pytest.raises(OutputError, match=f"/dev/stdout: .*{re.escape(words)}"):
                plan.save(path)
        finally:
            os.dup2(saved, 1)
            for fd in (read, write, saved):
                os.close(fd)
        return
    with pytest.raises(OutputError, match=words):
        plan.save(f"{tmp_path}/{path}")
    assert not (tmp_path / "x.json").exists()


EXACT8 = """\
import keras


class Exact(keras.layers.Layer):
    def call(self, x):
        if x.shape[0] is not None and x.shape[0] % 8:
            raise ValueError(f"Exact needs a batch that is a multiple of 8, got {x.shape[0]}")
        return x

    def compute_output_shape(self, s):
        return s


def build_model():
    i = keras.Input(shape=(16,))
    h = keras.layers.Dense(8, name="d1")(i)
    h = Exact(name="exact")(h)
    return keras.Model(i, keras.layers.Dense(2, name="d2")(h), name="h8")
"""

BUILD_EMITTED = """\
import sys, numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tests.emitted import import_emitted
module = import_emitted(__import__("pathlib").Path(sys.argv[1]))
model = module.build_model()
print(tuple(model(np.ones((8, 16), "float32")).shape))
"""


def test_a_model_that_refuses_a_batch_of_one_is_applied_and_emitted_at_its_share(
    tmp_path: Path,
) -> None:
    """A layer that takes only multiples of 8, planned at batch 8: ``Plan.apply`` and the
    emitted module built their copy on one sample, and Keras refused it (34g c D2). A copy is
    built at the plan's share of the batch, which the planner traced."""
    import numpy as np

    import partitioner

    namespace: dict[str, Any] = {}
    exec(EXACT8, namespace)
    model = namespace["build_model"]()
    plan = partitioner.partition(model, gpus=2, device_type="cpu", strategy="placed", batch_size=8)
    assert plan.share_batch_size == 8
    placed = plan.apply(model, devices=["/device:CPU:0", "/device:CPU:1"])
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    assert np.allclose(placed(x), model(x), atol=1e-6)
    (tmp_path / "m.py").write_text(EXACT8)
    _emit_and_build(tmp_path, "--strategy", "placed")


def _emit_and_build(tmp_path: Path, *flags: str) -> None:
    """``partition m.py ... --emit emitted.py``, then the module built and called at batch 8 in
    a fresh interpreter (nothing the planning process registered or imported)."""
    args = ["m.py", "--gpus", "2", "--device-type", "cpu", "--batch-size", "8", *flags]
    proc = run_cli([*args, "--out", "p.json", "--emit", "emitted.py"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "build.py").write_text(BUILD_EMITTED)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    built = subprocess.run(
        [sys.executable, "build.py", "emitted.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.strip().endswith("(8, 2)"), built.stdout


def test_an_emitted_module_of_a_registered_lambda_loads_the_model_file_first(
    tmp_path: Path,
) -> None:
    """Row 107's advice followed (a Lambda of a function registered with
    ``@keras.saving.register_keras_serializable``): the emitted module never loaded the model
    file, so Keras could not find the function by its name (34g c D3)."""
    (tmp_path / "m.py").write_text(
        "import keras\n\n\n@keras.saving.register_keras_serializable(package='c34g')\n"
        "def twice(t):\n    return t * 2.0\n\n\ndef build_model():\n"
        "    i = keras.Input(shape=(16,))\n    h = keras.layers.Dense(8, name='d1')(i)\n"
        "    h = keras.layers.Lambda(twice, name='lam')(h)\n"
        "    return keras.Model(i, keras.layers.Dense(2, name='d2')(h), name='lr')\n"
    )
    _emit_and_build(tmp_path, "--strategy", "pipeline")
    assert "model_source()  # registers" in (tmp_path / "emitted.py").read_text()


def test_a_worker_given_a_cluster_file_says_tf_configs_task_is_not_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``partition worker --cluster FILE`` with TF_CONFIG's ``task.index`` set was told "set
    TF_CONFIG's task.index", which was set and is not read beside a cluster file (34g c D5)."""
    from partitioner.cli.worker import run_worker
    from partitioner.core.errors import UsageError

    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
        ),
    )
    cluster = tmp_path / "cl.json"
    cluster.write_text(json.dumps({"worker": ["127.0.0.1:2", "127.0.0.1:3"]}))
    with pytest.raises(
        UsageError,
        match=r"pass --task I for this worker \(cluster file .* names no task, and TF_CONFIG's task is not read",
    ) as info:
        run_worker(None, str(cluster))
    assert "set TF_CONFIG's task.index" not in str(info.value)


def test_a_tf_config_topology_never_names_cpu_devices_no_worker_has() -> None:
    """``--topology tf-config --device-type cpu --gpus 4`` over 2 tasks planned stages on
    ``/task:0/device:CPU:0`` and ``CPU:1``: a TensorFlow process has one CPU device, so the
    plan named a device no worker serves (34g c D6)."""
    from cost_models.devices.topology import load_topology, topology_from_tf_config
    from partitioner.core.errors import UsageError

    config = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}})
    environ = {"TF_CONFIG": config}
    with pytest.raises(UsageError, match=r"gpus=4 over the 2 TF_CONFIG tasks makes 2 CPU devices"):
        load_topology("tf-config", device_type="cpu", num_devices=4, environ=environ)
    with pytest.raises(UsageError, match=r"devices_per_task=2 CPU devices"):
        topology_from_tf_config(config, device_type="cpu", devices_per_task=2)
    assert (
        load_topology("tf-config", device_type="cpu", num_devices=2, environ=environ).num_devices
        == 2
    )
    assert (
        load_topology("tf-config", device_type="h100", num_devices=4, environ=environ).num_devices
        == 4
    )


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d["predicted"].update(step_time_s=1e300), "predicted.step_time_s"),
        (lambda d: d["solver"].update(objective=1e300), "solver.objective"),
        (lambda d: d["phase_times_s"].update(trace=1e300), "phase_times_s"),
        (lambda d: d["pipeline"].update(num_microbatches=2048), "pipeline.num_microbatches"),
    ],
    ids=["step", "objective", "phase", "microbatches"],
)
def test_a_plan_files_times_and_micro_batches_are_held_to_the_planners_bounds(
    edit: Any, words: str, mlp: Any, tmp_path: Path
) -> None:
    """A plan file with a step of 1e300 s showed a 300-digit time; one of 2048 micro-batches
    (the planner takes at most 1024) loaded and applied, and its step never ended (34g b E46,
    E10)."""
    import partitioner
    from partitioner import load_plan
    from partitioner.core.errors import PlanError

    plan = partitioner.partition(mlp, gpus=2, device_type="cpu", batch_size=32, pipeline=True)
    data = json.loads(plan.to_json())
    data.setdefault("phase_times_s", {})
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=re.escape(words)):
        load_plan(path)


@pytest.mark.parametrize(
    "devices", [{"/device:CPU:0", "/device:CPU:1"}, frozenset({"/device:CPU:0"})]
)
def test_apply_refuses_devices_given_as_a_set(devices: Any, plan: Any, mlp: Any) -> None:
    """``plan.apply(model, devices={...})``: which stage landed where changed with
    ``PYTHONHASHSEED`` (34g b A18)."""
    from partitioner.core.errors import UsageError

    with pytest.raises(UsageError, match=r"is a set, which has no order"):
        plan.apply(mlp, devices=devices)


class _NoConfig(keras.Model):
    """The usual subclass: an ``__init__`` of no arguments, so Keras cannot rebuild it."""

    def __init__(self) -> None:
        super().__init__(name="sub")
        self.d1 = keras.layers.Dense(8, name="d1")
        self.d2 = keras.layers.Dense(2, name="d2")

    def call(self, x: Any) -> Any:
        return self.d2(self.d1(x))


class _WithConfig(_NoConfig):
    """The same model, rebuildable (what the plan is made from)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()


def test_applying_to_a_subclassed_model_keras_cannot_rebuild_is_one_line() -> None:
    """``Plan.apply`` on such a model raised a 5-line RewriteError holding Keras's whole "Unable
    to revive model from config" text and the config (34g b A10, A11). Since issue 36 it is
    placed in place; an emitted program without the model's file (model_source=), which
    cannot copy it, is refused in one line."""
    import numpy as np

    import partitioner
    from partitioner.core.errors import RewriteError
    from passes.rewrite.codegen import check_emittable

    twin, model = _WithConfig(), _NoConfig()
    for m in (twin, model):
        m(np.zeros((1, 16), "float32"))
    plan = partitioner.partition(twin, gpus=2, device_type="cpu", strategy="placed", batch_size=8)
    assert plan.apply(model, devices=["/device:CPU:0", "/device:CPU:1"]) is model
    with pytest.raises(RewriteError) as info:
        check_emittable(model)
    assert "\n" not in str(info.value) and len(str(info.value)) < 800, str(info.value)
    assert "cannot be rebuilt from its config, which copying it onto a device needs (TypeError: Unable to revive" in str(info.value)


def test_sizes_take_the_units_of_their_own_bound_and_say_what_is_wrong() -> None:
    """``--memory-limit 1EiB`` (the bound the refusal of ``1e400KiB`` names) was "not a size";
    ``0.5`` was "not a positive size" (34g b C11, C12, C15)."""
    from partitioner.core.units import MAX_SIZE_BYTES, parse_bytes

    assert parse_bytes("1EiB") == parse_bytes("1024PiB") == MAX_SIZE_BYTES
    assert parse_bytes("2PB") == 2 * 10**15
    with pytest.raises(ValueError, match=r"'0\.5' is less than one byte"):
        parse_bytes("0.5")
    with pytest.raises(ValueError, match="'0' is not a positive size"):
        parse_bytes("0")


def test_apply_checks_its_waits_without_a_cluster_too(plan: Any, mlp: Any) -> None:
    """``plan.apply(model, devices=..., timeout_s=nan)`` was accepted when no cluster was given
    (34g b A19)."""
    with pytest.raises(PartitionError, match="timeout_s"):
        plan.apply(mlp, devices=["/device:CPU:0", "/device:CPU:1"], timeout_s=float("nan"))


# -- the eighth rerun (34h) ----------------------------------------------------------------------


def test_a_plan_records_the_wiring_of_every_layer_it_applies_to(mlp: Any, tmp_path: Path) -> None:
    """A plan file whose ``fingerprint.layer_inputs`` lost entries applied to a model wired
    otherwise (34h b D1): the layers it no longer records are compared too."""
    import partitioner
    from partitioner import load_plan
    from partitioner.core.errors import PlanError
    from partitioner.plan.model import plan_digest

    plan = partitioner.partition(mlp, gpus=2, device_type="cpu", batch_size=16, strategy="placed")
    data = json.loads(plan.to_json())
    wiring = data["fingerprint"]["layer_inputs"]
    dropped = sorted(wiring)[-1]
    del wiring[dropped]
    data["digest"] = plan_digest(data)  # a plan written so: the wiring check refuses it
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        PlanError, match=rf"layer '{dropped}' is fed by .* records no inputs for it"
    ):
        load_plan(path).apply(mlp, devices=["/device:CPU:0", "/device:CPU:1"])


@pytest.mark.parametrize("speedup", [1e300, -3.0, 0.0])
def test_a_plan_files_speedup_is_bounded(speedup: float, mlp: Any, tmp_path: Path) -> None:
    """``strategies[].speedup_over_single`` of 1e300, -3 or 0 showed with exit 0 (34h b D2)."""
    import partitioner
    from partitioner import load_plan
    from partitioner.core.errors import PlanError

    plan = partitioner.partition(mlp, gpus=2, device_type="cpu", batch_size=16)
    data = json.loads(plan.to_json())
    data["strategies"][0]["speedup_over_single"] = speedup
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"strategies\[0\]\.speedup_over_single"):
        load_plan(path)


def test_a_profile_cache_that_cannot_be_written_is_one_warning_per_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mlp: Any
) -> None:
    """With the strategy search, each batch it costs profiles again: a cache that cannot be
    written warned once per batch, 4 times (34h b D4). The run checks it once."""
    import partitioner

    cache = tmp_path / "cache"
    cache.write_text("a file\\n")
    with caplog.at_level(logging.WARNING):
        partitioner.partition(
            mlp, gpus=2, device_type="cpu", batch_size=16, profile=True, cache_dir=str(cache)
        )
    warned = [r for r in caplog.records if "not written" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]


@pytest.mark.parametrize(
    ("moves", "out", "named"),
    [
        ("open('settings.txt').read()\nos.rename('settings.txt', 'settings.bak')\n",
         "settings.bak", "settings.txt"),
        ("os.link('settings.txt', 'alias.txt')\nopen('alias.txt').read()\nos.unlink('alias.txt')\n",
         "settings.txt", "alias.txt"),
    ],
    ids=["renamed-after-read", "read-through-a-removed-hard-link"],
)  # fmt: skip
def test_a_file_read_stays_protected_under_another_name(
    moves: str, out: str, named: str, tmp_path: Path
) -> None:
    """Reads were protected by the path they were read under: a file the model renamed after
    reading it, or read through a hard link it then removed, was replaced by ``--out`` (34h a
    A3, C5). A read records the file's identity (device, inode) too."""
    write_tree(tmp_path, {"m.py": "import os\n" + moves + TINY, "settings.txt": "lr = 0.1\n"})
    proc = run_cli(["m.py", "--gpus", "2", "--out", out], tmp_path)
    said = (  # there at the start: not partitioner's (row 234); made by the model: read as
        f"--out {out} exists and is not a file partitioner wrote"
        if out == "settings.txt"
        else f"--out {out} is the file the model's code read as {named}"
    )
    one_line_error(proc, said)
    assert (tmp_path / out).read_text() == "lr = 0.1\n"


@pytest.mark.skipif(
    not os.access("/proc/kmsg", os.R_OK), reason="/proc/kmsg is readable by root only"
)
def test_a_file_whose_read_would_block_is_one_line_not_a_hang(tmp_path: Path) -> None:
    """``/proc/kmsg`` (a "regular" file whose read waits for the next kernel message) as the
    model file hung ``partition``; as a plan file, the non-blocking read returned None and
    ``partition show`` crashed with a TypeError (34h a C7, C8)."""
    (tmp_path / "k.py").symlink_to("/proc/kmsg")
    (tmp_path / "k.json").symlink_to("/proc/kmsg")
    line = one_line_error(run_cli(["k.py", "--gpus", "2"], tmp_path), "a read would block")
    assert "k.py" in line
    proc = run_cli(["show", "k.json"], tmp_path)
    one_line_error(proc, "cannot read plan file k.json", "a read would block")


def test_an_input_batch_past_tensorflows_shape_integers_names_the_batch_and_shape() -> None:
    """``--batch-size 16 --input-shape 134217728`` (within the per-sample bound) failed as the
    model's own "Invalid value in tensor used for shape: -2147483648" (34h b D3)."""
    from partitioner.core.errors import TraceError
    from passes.trace import MAX_TENSOR_VALUES, input_specs

    model = keras.Sequential([keras.Input((2**27,)), keras.layers.Activation("relu")])
    with pytest.raises(TraceError, match=r"batch_size=16 samples of 134217728 values each") as info:
        input_specs(model, 16)
    assert "plan batch_size=15 or less" in str(info.value)
    assert input_specs(model, MAX_TENSOR_VALUES // 2**27)[0].shape[0] == 15


@pytest.mark.parametrize("fails", [False, True], ids=["plans", "fails"])
def test_a_model_that_sets_sys_stderr_to_none_still_plans_or_says_why(
    fails: bool, tmp_path: Path
) -> None:
    """``sys.stderr = None`` in the model file: every run ended with status 1, no plan and no
    word (the CLI flushed None) (34h c D2)."""
    build = "keras.Input((None,))" if fails else "keras.Input((8,))"
    (tmp_path / "m.py").write_text(
        "import sys, keras\nsys.stderr = None\n\ndef build_model():\n"
        f"    return keras.Sequential([{build}, keras.layers.Dense(4, name='d1')])\n"
    )
    proc = run_cli(["m.py", "--gpus", "2", "--out", "p.json"], tmp_path)
    if fails:
        one_line_error(proc, "m.py")
        assert proc.returncode == 2 and not (tmp_path / "p.json").exists()
    else:
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "p.json").is_file()


def test_a_key_error_from_the_models_code_is_its_reason_not_kerass_wrapper() -> None:
    """A ``KeyError`` raised in a layer's call was shown as the repr of Keras's whole wrapped
    message: escaped newlines, ANSI codes and the call's arguments (34h c D4)."""
    from partitioner.core.errors import error_line

    wrapped = KeyError(
        "Exception encountered when calling K.call().\n\n\x1b[1mbatch_8\x1b[0m\n\n"
        "Arguments received by K.call():\n  • x=tf.Tensor(shape=(8, 16), dtype=float32)"
    )
    assert error_line(wrapped) == "batch_8"
    assert error_line(KeyError("plain")) == "plain"
    assert error_line(KeyError(3)) == "3"


def test_an_interrupt_that_surfaces_as_another_exception_is_still_the_interrupt(
    tmp_path: Path,
) -> None:
    """Ctrl-C landing inside Python's import machinery (a run imports TensorFlow) surfaced as
    CPython's ``TypeError: expected a message argument`` and the run ended as an internal error
    with status 1 (CI of a9830dd..5aebc2a, the Ctrl-C-at-1.5-s case under load). Here the
    model's import turns the interrupt into a TypeError the same way."""
    (tmp_path / "m.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "except KeyboardInterrupt:\n"
        "    raise TypeError('expected a message argument') from None\n" + TINY
    )
    proc = run_cli(["m.py", "--gpus", "2", "--out", "p.json"], tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "partition: interrupted; no file was left half-written"
    ]
    assert not (tmp_path / "p.json").exists()


def test_every_json_reader_bounds_its_numbers_and_containers(tmp_path: Path) -> None:
    """A cluster file holding a 5000-digit integer got Python's "use
    sys.set_int_max_str_digits()" as its next step: the data-file reader did not hold the
    100-digit bound plan files do (README row 49) (34h a B6)."""
    from partitioner.core.errors import UsageError
    from passes.cluster.runtime import load_cluster

    path = tmp_path / "cl.json"
    path.write_text('{"worker": ["127.0.0.1:1"], "extra": ' + "9" * 5000 + "}")
    with pytest.raises(UsageError, match=r"a number of 5000 digits \(at most 100\)") as info:
        load_cluster(path)
    assert "set_int_max_str_digits" not in str(info.value)
