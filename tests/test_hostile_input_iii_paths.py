"""Hostile input, round three (issue 34): paths and data loss.

Every path of the command line is made absolute against the directory the run started in before
the model's code runs, so a model that calls ``os.chdir`` at import moves no output; and no output
may be a file the model's code imported (its own modules, directly or not), so ``--emit`` never
replaces the user's module. The runs are subprocesses (``python -m partitioner``), as a user runs
them: the working directory is the process's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from partitioner.cli.loader import user_module_files

TIMEOUT_S = 240
TINY = (
    "import keras\n\n"
    "def build_model():\n"
    "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name='a'),"
    " keras.layers.Dense(4, name='b')])\n"
)
CUSTOM_LAYERS = "import keras\n\nWIDTH = 16\n\ndef dense(name):\n    return keras.layers.Dense(WIDTH, name=name)\n"
USES_CUSTOM_LAYERS = (
    "import keras\nimport customlayers\n\n"
    "def build_model():\n"
    "    return keras.Sequential([keras.Input((8,)), customlayers.dense('a'),"
    " keras.layers.Dense(4, name='b')])\n"
)


def run_cli(
    args: Sequence[str | os.PathLike[str]], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """``partition ARGS`` in ``cwd``; no bytecode caches (the trees are compared whole) and a
    wide console (a long path is printed on one line)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "400"}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "partitioner", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("partition: error: "), lines[0]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert "written to" not in proc.stdout, proc.stdout
    return lines[0]


# -- a model that changes the working directory ---------------------------------------------------


def test_a_model_that_chdirs_at_import_moves_no_output(tmp_path: Path) -> None:
    """``--out important.json --emit placed.py`` (relative) land in the directory the run
    started in; the same-named file where the model moved to stays as it was."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "important.json").write_text('{"precious": true}\n')
    before = snapshot(elsewhere)
    write_tree(work, {"model.py": f"import os\nos.chdir({str(elsewhere)!r})\n\n{TINY}"})
    proc = run_cli(
        ["model.py", "--gpus", "2", "--no-strategies", "--out", "important.json",
         "--emit", "placed.py"],
        cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert snapshot(elsewhere) == before  # untouched, nothing new
    plan = json.loads((work / "important.json").read_text())
    assert plan["schema_version"] == 2 and set(plan["assignment"]) == {"a", "b"}
    assert "tf.device" in (work / "placed.py").read_text()
    # The messages name the files written (absolute: the process's directory moved).
    assert f"Plan written to {work / 'important.json'}\n" in proc.stdout, proc.stdout
    assert f"written to {work / 'placed.py'}\n" in proc.stdout, proc.stdout


# -- an output that is one of the model's modules ---------------------------------------------------

PACKAGE = {
    "model.py": (
        "import keras\nimport pkg.a\n\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((8,)), pkg.a.layer('a'),"
        " keras.layers.Dense(4, name='b')])\n"
    ),
    "pkg/__init__.py": "",
    "pkg/a.py": "from pkg import b\n\ndef layer(name):\n    return b.make(name)\n",
    "pkg/b.py": "import keras\n\ndef make(name):\n    return keras.layers.Dense(16, name=name)\n",
}
LAZY = {
    "model.py": (
        "import keras\n\n"
        "def build_model():\n"
        "    import lazylayers\n"
        "    return keras.Sequential([keras.Input((8,)), lazylayers.dense('a'),"
        " keras.layers.Dense(4, name='b')])\n"
    ),
    "lazylayers.py": CUSTOM_LAYERS,
}
DEP = {"dep/model.py": USES_CUSTOM_LAYERS, "dep/customlayers.py": CUSTOM_LAYERS}


@pytest.mark.parametrize(
    ("files", "model", "flag", "output", "module"),
    [
        (DEP, "dep/model.py", "--emit", "dep/customlayers.py", "dep/customlayers.py"),
        (DEP, "dep/model.py", "--out", "dep/customlayers.py", "dep/customlayers.py"),
        (DEP, "dep/model.py", "--out", "dep/../dep/customlayers.py", "dep/customlayers.py"),
        (PACKAGE, "model.py", "--out", "pkg/b.py", "pkg/b.py"),
        (PACKAGE, "model.py", "--report", "pkg/__init__.py", "pkg/__init__.py"),
        (LAZY, "model.py", "--emit", "lazylayers.py", "lazylayers.py"),
    ],
    ids=["emit-module", "out-module", "out-module-dotdot", "out-indirect", "report-package-init",
         "emit-imported-in-builder"],
)  # fmt: skip
def test_an_output_that_is_a_module_the_model_imports_is_refused(
    files: Mapping[str, str], model: str, flag: str, output: str, module: str, tmp_path: Path
) -> None:
    write_tree(tmp_path, files)
    before = snapshot(tmp_path)
    proc = run_cli([model, "--gpus", "2", "--no-strategies", flag, output], cwd=tmp_path)
    line = one_line_error(proc, f"{flag} {output}")
    refusals = ("exists and is not a file partitioner wrote", "that the model imports",
                "is the file that makes")  # the last: a package's __init__.py (34ai)
    assert any(reason in line for reason in refusals), line  # fmt: skip
    assert snapshot(tmp_path) == before  # byte-identical, and no new file


SPEC_LOADED = {
    "model.py": (
        "import importlib.util\nimport keras\n\n"
        "_spec = importlib.util.spec_from_file_location('widths', __file__[:-8] + 'widths.py')\n"
        "widths = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(widths)\n\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(widths.UNITS, "
        "name='a'), keras.layers.Dense(4, name='b')])\n"
    ),
    "widths.py": "UNITS = 16\n",
}
RUN_PATH = {
    "model.py": (
        "import runpy\nimport keras\n\n"
        "UNITS = runpy.run_path(__file__[:-8] + 'settings.py')['UNITS']\n\n"
        "def build_model():\n"
        "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(UNITS, name='a'),"
        " keras.layers.Dense(4, name='b')])\n"
    ),
    "settings.py": "UNITS = 16\n",
}
DATA_FILE = {
    "model.py": (
        "import keras\n\n"
        "def build_model():\n"
        "    with open(__file__[:-8] + 'units.txt') as f:\n        units = int(f.read())\n"
        "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(units, name='a'),"
        " keras.layers.Dense(4, name='b')])\n"
    ),
    "units.txt": "16\n",
}


THREAD_READ = {
    "model.py": (
        "from concurrent.futures import ThreadPoolExecutor\nimport keras\n\n"
        "def _units():\n    with open(__file__[:-8] + 'units.txt') as f:\n"
        "        return int(f.read())\n\n"
        "def build_model():\n"
        "    with ThreadPoolExecutor(1) as pool:\n        units = pool.submit(_units).result()\n"
        "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(units, name='a'),"
        " keras.layers.Dense(4, name='b')])\n"
    ),
    "units.txt": "16\n",
}


@pytest.mark.parametrize(
    ("files", "flag", "output"),
    [
        (SPEC_LOADED, "--emit", "widths.py"),
        (RUN_PATH, "--emit", "settings.py"),
        (DATA_FILE, "--out", "units.txt"),
        (THREAD_READ, "--out", "units.txt"),
    ],
    ids=["spec-from-file-location", "runpy-run-path", "data-file-read-in-builder",
         "read-in-a-thread"],
)  # fmt: skip
def test_an_output_that_is_a_file_the_models_code_read_is_refused(
    files: Mapping[str, str], flag: str, output: str, tmp_path: Path
) -> None:
    """A module loaded without an import (so not in ``sys.modules``), a file run by ``runpy``,
    a data file read by the builder: the campaign's rerun overwrote the first two with
    ``--emit`` (issue 34). Every file the model's code opens for reading is recorded (an audit
    hook, :func:`partitioner.cli.loader.recording_files_read`) and no output may be one."""
    write_tree(tmp_path, files)
    before = snapshot(tmp_path)
    proc = run_cli(["model.py", "--gpus", "2", "--no-strategies", flag, output], cwd=tmp_path)
    one_line_error(proc, f"{flag} {output}", "exists and is not a file partitioner wrote")
    assert snapshot(tmp_path) == before  # byte-identical, and no new file


NATIVE_READS = {
    "model.py": (
        "import sqlite3\nimport keras\n\n"
        "def build_model():\n"
        "    units = sqlite3.connect(__file__[:-8] + 'hp.db').execute('select u from hp')"
        ".fetchone()[0]\n"
        "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(units, name='a'),"
        " keras.layers.Dense(4, name='b')])\n"
    ),
}


@pytest.mark.parametrize("flag", ["--out", "--report", "--emit"])
def test_an_output_that_holds_binary_data_is_not_replaced(flag: str, tmp_path: Path) -> None:
    """A sqlite database the builder reads through native code (no Python ``open`` the audit
    hook sees) was replaced by ``--report hp.db`` (the third campaign, issue 34). partitioner
    writes only text: an existing output holding binary data is refused before the model runs."""
    import sqlite3

    write_tree(tmp_path, NATIVE_READS)
    with sqlite3.connect(tmp_path / "hp.db") as db:
        db.execute("create table hp (u integer)")
        db.execute("insert into hp values (16)")
    before = snapshot(tmp_path)
    proc = run_cli(["model.py", "--gpus", "2", "--no-strategies", flag, "hp.db"], cwd=tmp_path)
    one_line_error(proc, f"{flag} hp.db exists and holds binary data", "remove it first")
    assert snapshot(tmp_path) == before  # byte-identical, and no new file


def test_a_symlink_to_a_module_the_model_imports_is_refused(tmp_path: Path) -> None:
    write_tree(tmp_path, DEP)
    (tmp_path / "link.py").symlink_to(tmp_path / "dep" / "customlayers.py")
    before = snapshot(tmp_path)
    proc = run_cli(["dep/model.py", "--gpus", "2", "--no-strategies", "--emit", "link.py"], tmp_path)
    one_line_error(proc, "--emit link.py", "exists and is not a file partitioner wrote")
    assert snapshot(tmp_path) == before


# -- legitimate outputs ---------------------------------------------------------------------------


def test_outputs_beside_the_model_and_named_like_stdlib_modules_are_written(tmp_path: Path) -> None:
    """``--out plan.json`` next to a model that imports its own module, and ``--report
    colorsys.html`` for a model that imports the standard library's colorsys: neither is the
    model's module (a ``.py`` named like one, ``--emit colorsys.py``, would be imported in its
    place: refused, campaign 34ag)."""
    files = {"model.py": "import colorsys  # noqa: F401\n" + USES_CUSTOM_LAYERS,
             "customlayers.py": CUSTOM_LAYERS}  # fmt: skip
    write_tree(tmp_path, files)
    proc = run_cli(
        ["model.py", "--gpus", "2", "--no-strategies", "--out", "plan.json",
         "--report", "colorsys.html", "--emit", "colorsys_placed.py"],
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["schema_version"] == 2
    assert "tf.device" in (tmp_path / "colorsys_placed.py").read_text()
    assert "<html" in (tmp_path / "colorsys.html").read_text().lower()
    assert "Plan written to plan.json\n" in proc.stdout, proc.stdout
    assert "written to colorsys.html\n" in proc.stdout, proc.stdout
    for name, text in files.items():
        assert (tmp_path / name).read_text() == text
    refused = run_cli(["model.py", "--gpus", "2", "--emit", "colorsys.py"], cwd=tmp_path)
    assert refused.returncode == 2 and "named like the module 'colorsys'" in refused.stderr
    assert not (tmp_path / "colorsys.py").exists()


# -- the loader's list of the user's modules (in-process, no TensorFlow) ---------------------------


def test_user_module_files_lists_the_users_modules_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_tree(tmp_path, {"mine.py": "import colorsys, json\nimport partitioner.core.units\n"})
    for name in ("colorsys", "mine"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = frozenset(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.find_spec("mine")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mine", module)
    spec.loader.exec_module(module)
    assert "colorsys" in sys.modules and "colorsys" not in before
    assert user_module_files(before) == [tmp_path / "mine.py"]
