"""The ``partition`` command line, run as a user runs it: in a subprocess.

TensorFlow's own log-level variable is removed from the child's environment, so these tests also
check that the CLI keeps TensorFlow's start-up noise off stderr by itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from partitioner.cli.main import cli_message
from partitioner.core.files import marked

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist_mlp.py"
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.pop("PYTHONWARNINGS", None)
    return env


def run_cli(args: Sequence[str | os.PathLike[str]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "partitioner", *map(str, args)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr}"
    line = lines[0]
    assert line.strip(), "stderr line is empty"
    assert "Traceback" not in line
    assert "Plan written" not in proc.stdout
    return line


# -- a successful run -----------------------------------------------------------------------


@dataclass(frozen=True)
class GoodRun:
    proc: subprocess.CompletedProcess[str]
    out: Path


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> GoodRun:
    """``partition examples/mnist_mlp.py --gpus 2 --out plan.json`` over an existing file."""
    out = tmp_path_factory.mktemp("good") / "plan.json"
    out.write_text(marked("sentinel: not a plan\n", "#"))  # one partitioner wrote (row 234)
    proc = run_cli([MNIST.relative_to(REPO), "--gpus", "2", "--out", out])
    return GoodRun(proc=proc, out=out)


def test_partition_mnist_prints_report(good_run: GoodRun) -> None:
    proc = good_run.proc
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    assert "Predicted step time" in proc.stdout
    # The per-device table: a header row and one row per device.
    assert "device" in proc.stdout and "compute" in proc.stdout and "memory" in proc.stdout
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("│")]
    assert any(r.split("│")[1].strip() == "0" for r in rows), proc.stdout
    assert any(r.split("│")[1].strip() == "1" for r in rows), proc.stdout
    assert f"Plan written to {good_run.out}" in proc.stdout


def test_partition_mnist_plan_json(good_run: GoodRun) -> None:
    from partitioner.cli.loader import load_model
    from passes.trace import placement_units

    assert good_run.proc.returncode == 0, good_run.proc.stderr
    data = json.loads(good_run.out.read_text())
    assert data["schema_version"] == 2
    assert [d["index"] for d in data["devices"]] == [0, 1]
    assert all(d["device_type"] == "h100" for d in data["devices"])

    units = [u.name for u in placement_units(load_model(str(MNIST)))]
    assignment = data["assignment"]
    assert isinstance(assignment, dict)
    assert sorted(assignment) == sorted(units)
    assert all(isinstance(v, int) for v in assignment.values())
    assert set(assignment.values()) == {0, 1}

    predicted = data["predicted"]
    assert isinstance(predicted["step_time_s"], float) and predicted["step_time_s"] > 0
    for key in ("compute_s", "memory_bytes", "transfer_bytes"):
        assert len(predicted[key]) == 2, key
        assert all(v >= 0 for v in predicted[key]), key
    assert all(v > 0 for v in predicted["compute_s"])
    assert data["solver"]["name"] == "auto"  # the default
    assert isinstance(data["solver"]["status"], str) and data["solver"]["status"]

    # The plan file also loads through the library.
    import partitioner

    assert partitioner.load_plan(good_run.out).to_json_dict() == data


def test_existing_out_is_replaced_whole_and_kept_on_failure(
    good_run: GoodRun, tmp_path: Path
) -> None:
    """The sentinel became a plan; failing runs with the same --out leave it byte for byte."""
    assert good_run.proc.returncode == 0, good_run.proc.stderr
    before = good_run.out.read_bytes()
    assert json.loads(before)["schema_version"] == 2  # no longer the sentinel
    broken = tmp_path / "broken.py"
    broken.write_text("def build_model(:\n    pass\n")
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(
            pool.map(
                run_cli,
                [
                    [MNIST, "--gpus", "0", "--out", good_run.out],
                    [broken, "--gpus", "2", "--out", good_run.out],
                ],
            )
        )
    for proc in procs:
        assert_one_line_error(proc)
    assert good_run.out.read_bytes() == before
    assert sorted(p.name for p in good_run.out.parent.iterdir()) == ["plan.json"]


def test_console_script_help() -> None:
    script = shutil.which("partition") or str(Path(sys.prefix) / "bin" / "partition")
    assert Path(script).is_file(), "the `partition` console script is not installed"
    proc = subprocess.run(
        [script, "--help"], capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr
    assert "--gpus" in proc.stdout and "PATH[:ATTR]" in proc.stdout


def test_python_dash_m_help() -> None:
    proc = run_cli(["--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: partition")


# -- bad input ------------------------------------------------------------------------------

MODEL_FILES = {
    "syntax.py": "import keras\n\ndef build_model(:\n    return None\n",
    "nomodel.py": "import keras\n\nX = 1\n",
    "constant.py": "import keras\n\nCONSTANT = 3\n",
    "raises.py": "def build_model():\n    raise ValueError('boom in build_model')\n",
    "import_raises.py": "raise RuntimeError('boom at import')\n",
    "tiny.py": (
        "import keras\n\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name='a'),"
        " keras.layers.Dense(2, name='b')])\n"
    ),
    "bad_topology.toml": "[[hosts]\nlink = ",
    "tpu_topology.json": '{"devices": [{"type": "tpu9"}]}',
    "two.toml": '[[hosts]]\n[[hosts.devices]]\ntype = "h100"\ncount = 2\n',
    "badname.py": (
        "import keras\n\n"
        "def build_model():\n"
        "    x = keras.Input((4,))\n"
        "    y = keras.layers.Dense(3, name='<img src=x onerror=alert(1)>')(x)\n"
        "    return keras.Model(x, keras.layers.Dense(2, name='out')(y))\n"
    ),
    "unknown_dim.py": (
        "import keras\n\n"
        "def build_model():\n"
        "    x = keras.Input((None, 8))\n"
        "    return keras.Model(x, keras.layers.Dense(4)(x))\n"
    ),
}

# case id -> (arguments; "{d}" is the case's directory), the words the message must hold.
BAD_CASES: dict[str, tuple[list[str], list[str]]] = {
    # Rejected before TensorFlow is imported.
    "gpus-0": ([str(MNIST), "--gpus", "0", "--out", "{d}/plan.json"], ["--gpus", "0"]),
    "gpus-negative": ([str(MNIST), "--gpus", "-1", "--out", "{d}/plan.json"], ["--gpus", "-1"]),
    "gpus-abc": ([str(MNIST), "--gpus", "abc", "--out", "{d}/plan.json"], ["--gpus", "abc"]),
    "device-type": (
        [str(MNIST), "--gpus", "2", "--device-type", "nope", "--out", "{d}/plan.json"],
        ["nope", "h100"],
    ),
    "solver": (
        [str(MNIST), "--gpus", "2", "--solver", "nope", "--out", "{d}/plan.json"],
        ["nope", "metis"],
    ),
    "input-shape-abc": (
        [str(MNIST), "--gpus", "2", "--input-shape", "abc", "--out", "{d}/plan.json"],
        ["--input-shape", "abc"],
    ),
    "out-missing-dir": (
        [str(MNIST), "--gpus", "2", "--out", "{d}/no/such/dir/plan.json"],
        ["does not exist"],
    ),
    "out-is-directory": ([str(MNIST), "--gpus", "2", "--out", "{d}"], ["directory"]),
    # Root may write anywhere, so "read-only" is a directory nothing can be created in.
    "out-read-only": (
        [str(MNIST), "--gpus", "2", "--out", "/proc/partitioner-test-plan.json"],
        ["/proc/partitioner-test-plan.json", "not writable"],
    ),
    "missing-file": (["{d}/missing.py", "--gpus", "2", "--out", "{d}/plan.json"], ["missing.py"]),
    "gpus-missing": ([str(MNIST), "--out", "{d}/plan.json"], ["--gpus"]),
    "microbatches-not-dividing": (
        [str(MNIST), "--gpus", "2", "--pipeline", "--microbatches", "3", "--out", "{d}/plan.json"],
        ["--batch-size 32", "--microbatches 3"],
    ),
    "microbatches-0": (
        [str(MNIST), "--gpus", "2", "--pipeline", "--microbatches", "0", "--out", "{d}/p.json"],
        ["--microbatches", "0"],
    ),
    "pipeline-one-device": (
        [str(MNIST), "--gpus", "1", "--pipeline", "--out", "{d}/plan.json"],
        ["--pipeline", "2 devices"],
    ),
    "profile-ops-no-cpu": (
        [str(MNIST), "--gpus", "2", "--profile-ops", "--out", "{d}/plan.json"],
        ["--profile-ops", "no cpu device", "--profile"],
    ),
    "schedule-without-pipeline": (
        [str(MNIST), "--gpus", "2", "--schedule", "gpipe", "--out", "{d}/plan.json"],
        ["--schedule", "--pipeline"],
    ),
    "schedule-unknown": (
        [str(MNIST), "--gpus", "2", "--pipeline", "--schedule", "zigzag"],
        ["zigzag", "1f1b"],
    ),
    "topology-unknown-kind": (
        [str(MNIST), "--gpus", "2", "--topology", "carrier-pigeon", "--out", "{d}/plan.json"],
        ["carrier-pigeon", "nvlink"],
    ),
    "topology-file-missing": (
        [str(MNIST), "--topology", "{d}/none.toml", "--out", "{d}/plan.json"],
        ["none.toml"],
    ),
    "topology-file-malformed": (
        [str(MNIST), "--topology", "{d}/bad_topology.toml", "--out", "{d}/plan.json"],
        ["bad_topology.toml"],
    ),
    "topology-unknown-device": (
        [str(MNIST), "--topology", "{d}/tpu_topology.json", "--out", "{d}/plan.json"],
        ["tpu9", "h100"],
    ),
    "topology-gpus-disagree": (
        [str(MNIST), "--gpus", "3", "--topology", "{d}/two.toml", "--out", "{d}/plan.json"],
        ["2 devices", "--gpus"],
    ),
    "report-same-as-out": (
        [str(MNIST), "--gpus", "2", "--out", "{d}/same.json", "--report", "{d}/same.json"],
        ["--out", "--report"],
    ),
    "out-is-the-model-file": (["{d}/tiny.py", "--gpus", "2", "--out", "{d}/tiny.py"], ["model file"]),
    "emit-missing-dir": (
        [str(MNIST), "--gpus", "2", "--emit", "{d}/no/dir/placed.py"],
        ["--emit", "does not exist"],
    ),
    # Fail after importing TensorFlow and the model.
    "syntax-error": (["{d}/syntax.py", "--gpus", "2", "--out", "{d}/plan.json"], ["syntax"]),
    "no-model": (["{d}/nomodel.py", "--gpus", "2", "--out", "{d}/plan.json"], ["no model"]),
    "attr-not-model": (
        ["{d}/constant.py:CONSTANT", "--gpus", "2", "--out", "{d}/plan.json"],
        ["CONSTANT", "int"],
    ),
    "attr-raises": (
        ["{d}/raises.py:build_model", "--gpus", "2", "--out", "{d}/plan.json"],
        ["boom in build_model"],
    ),
    "import-raises": (
        ["{d}/import_raises.py", "--gpus", "2", "--out", "{d}/plan.json"],
        ["boom at import"],
    ),
    # More devices than layers plans (replicas, idle devices named: tests/test_api_strategy.py);
    # only stages are bounded by the layers.
    "strategy-pipeline-one-layer": (
        ["{d}/unknown_dim.py", "--input-shape", "5,8", "--gpus", "3", "--strategy", "pipeline",
         "--out", "{d}/plan.json"],
        ["--strategy pipeline", "1 layer", "--strategy data-parallel"],
    ),
    "layer-name-not-a-tf-scope": (
        ["{d}/badname.py", "--gpus", "2", "--out", "{d}/plan.json"],
        ["<img src=x onerror=alert(1)>", "rename the layer"],
    ),
    "unknown-dim": (
        ["{d}/unknown_dim.py", "--gpus", "2", "--out", "{d}/plan.json"],
        ["--input-shape"],
    ),
}


@dataclass(frozen=True)
class BadRun:
    proc: subprocess.CompletedProcess[str]
    directory: Path
    files_before: frozenset[str]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BadRun]:
    """Every bad case run once, concurrently; each in its own directory."""
    prepared = {}
    for case, (args, _) in BAD_CASES.items():
        d = tmp_path_factory.mktemp(case)
        for name, text in MODEL_FILES.items():
            (d / name).write_text(text)
        prepared[case] = (d, [a.replace("{d}", str(d)) for a in args])
    before = {case: frozenset(os.listdir(d)) for case, (d, _) in prepared.items()}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {case: pool.submit(run_cli, args) for case, (_, args) in prepared.items()}
        return {
            case: BadRun(proc=f.result(), directory=prepared[case][0], files_before=before[case])
            for case, f in futures.items()
        }


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_one_line_error(case: str, bad_runs: dict[str, BadRun]) -> None:
    run = bad_runs[case]
    line = assert_one_line_error(run.proc)
    assert line.startswith("partition: error: "), line
    for word in BAD_CASES[case][1]:
        assert word in line, f"{word!r} not in {line!r}"
    # Nothing was written: no plan, no temporary file.
    assert frozenset(os.listdir(run.directory)) == run.files_before
    assert not Path("/proc/partitioner-test-plan.json").exists()


def test_show_prints_the_same_tables_as_the_run(good_run: GoodRun) -> None:
    assert good_run.proc.returncode == 0, good_run.proc.stderr
    shown = run_cli(["show", good_run.out])
    assert shown.returncode == 0, shown.stderr
    made = [ln for ln in good_run.proc.stdout.splitlines() if not ln.startswith("Plan written")]
    assert shown.stdout.splitlines() == made


def test_show_of_a_corrupt_plan_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"schema_version": 1, "model": "m", "devi')
    line = assert_one_line_error(run_cli(["show", bad]))
    assert str(bad) in line and "truncated" in line


def test_devices_lists_the_catalog() -> None:
    proc = run_cli(["devices"])
    assert proc.returncode == 0, proc.stderr
    for name in ("cpu", "v100", "a100-80gb", "h100", "h200"):
        assert name in proc.stdout


def test_model_that_cannot_fit_names_memory_and_fewest_devices(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = run_cli([MNIST.relative_to(REPO), "--gpus", "1", "--memory-limit", "10MiB", "--out", out])
    line = assert_one_line_error(proc)
    assert "needs" in line and "at least" in line and "devices" in line, line
    assert not out.exists()


def test_pipeline_with_report_and_emitted_code(tmp_path: Path) -> None:
    """``--pipeline --out --report --emit``: three whole files from one run."""
    branchy = REPO / "examples" / "branchy.py"
    out, report, emit = tmp_path / "p.json", tmp_path / "r.html", tmp_path / "placed.py"
    proc = run_cli(
        [branchy, "--gpus", "2", "--pipeline", "--schedule", "gpipe", "--microbatches", "4",
         "--out", out, "--report", report, "--emit", emit]
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    assert plan["pipeline"]["schedule"] == "gpipe" and plan["pipeline"]["num_microbatches"] == 4
    assert plan["timeline"], "a pipelined plan records its simulated timeline"
    html = report.read_text()
    assert html.startswith("<!DOCTYPE html>") and "</html>" in html
    # Works offline: nothing is loaded from elsewhere.
    assert not re.search(r"<script[^>]*\bsrc=", html, re.IGNORECASE)
    assert not re.search(r"<link[^>]*href=[\"']?https?:", html, re.IGNORECASE)
    source = emit.read_text()
    compile(source, str(emit), "exec")
    assert "with tf.device(" in source
    assert "Report written to" in proc.stdout and "Model code (" in proc.stdout


# -- library errors in the command line's terms -----------------------------------------------


@pytest.mark.parametrize(
    ("case", "target", "search", "measure"),
    [
        ("gpus-0", {"gpus": 0}, {}, {}),
        ("microbatches-not-dividing", {"gpus": 2}, {"pipeline": True, "num_microbatches": 3}, {}),
        ("pipeline-one-device", {"gpus": 1}, {"pipeline": True}, {}),
        ("profile-ops-no-cpu", {"gpus": 2}, {}, {"profile_ops": True}),
        ("schedule-without-pipeline", {"gpus": 2}, {"schedule": "gpipe"}, {}),
    ],
)
def test_the_cli_error_is_the_api_error_in_flags(
    case: str, target: dict, search: dict, measure: dict, bad_runs: dict[str, BadRun]
) -> None:
    """The API says ``batch_size=32``; the command line says ``--batch-size 32``, same words."""
    from partitioner.api import prepare
    from partitioner.core.errors import PartitionError
    from partitioner.core.ir import Schedule
    from partitioner.core.options import MeasureOptions, SearchOptions, TargetOptions

    if "schedule" in search:
        search = {**search, "schedule": Schedule(search["schedule"])}
    with pytest.raises(PartitionError) as info:
        prepare(TargetOptions(**target), SearchOptions(**search), MeasureOptions(**measure))
    api_message = str(info.value)
    assert "--" not in api_message, api_message
    line = assert_one_line_error(bad_runs[case].proc)
    assert line == f"partition: error: {cli_message(api_message)}"
    assert line != f"partition: error: {api_message}"
