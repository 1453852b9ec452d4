"""The fifth campaign's process and message defects of ``partition`` (issue 34, rerun V).

Exit handlers (``atexit``) of the model's code are bounded and each misbehaving one is one note
line; a builder that raises runs once; ``async def build_model`` is refused without Python's
warning; ``worker`` and ``calibrate`` say a bad command line in one line; ``--input-shape``
keyed by an unknown name is said in the command line's words; a NUL byte in a model file is a
line number, not "None"; help that cannot be printed says so; an integer-only model says
what to do.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from partitioner.cli.loader import load_model
from partitioner.core.errors import ModelLoadError
from tests.test_process_hygiene import (
    REPO,
    RUN_TIMEOUT_S,
    TINY,
    _finish,
    _one_line,
    _run_main,
    _start,
)

QUICK_TIMEOUT_S = 60.0
"""The longest a run that imports no TensorFlow may take on a loaded machine."""

# -- D1, D13: exit handlers of the model's code --------------------------------------------------

EXIT_HANDLERS = (
    "import atexit\nimport time\n\n"
    "atexit.register(lambda: time.sleep(3600))\n\n"
    "def boom():\n    raise RuntimeError('atexit boom')\n\n"
    "atexit.register(boom)\n\n" + TINY
)
"""A model file whose exit handlers raise (``boom``, run first: last registered) and then
never return (the lambda)."""


@pytest.mark.slow
def test_exit_handlers_that_raise_or_never_return_are_one_note_each(tmp_path: Path) -> None:
    """The plan was written, then a 6-line "Exception ignored in atexit callback" traceback,
    then the process hung for ever in the sleeping handler."""
    model = tmp_path / "exits.py"
    model.write_text(EXIT_HANDLERS)
    out = tmp_path / "plan.json"
    proc = _start(
        [model, "--gpus", "2", "--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    code, err = _finish(proc, RUN_TIMEOUT_S)
    assert code == 0, err
    assert out.is_file()
    notes = [line for line in err.splitlines() if line.startswith("partition: note:")]
    assert len(notes) == 2, err
    assert "boom (exits.py line 7), raised RuntimeError: atexit boom" in notes[0]
    assert "<lambda> (exits.py line 4), was still running after 5 s" in notes[1]
    assert "Traceback" not in err and "Exception ignored" not in err


EXIT_HANDLERS_ALONE = """\
import atexit
import os
import time

def stuck():
    time.sleep(3600)

def boom():
    raise ValueError("no")

atexit.register(stuck)
atexit.register(boom)

from partitioner.cli.exits import run_exit_handlers

for note in run_exit_handlers(0.5):
    print(note, flush=True)
os._exit(0)  # as partition ends: the interpreter's exit would run the handlers again
"""


def test_run_exit_handlers_is_bounded_and_names_each_handler(tmp_path: Path) -> None:
    """The handlers run in their own process (this one's are pytest's); the wait ends after the
    grace period."""
    script = tmp_path / "exits.py"
    script.write_text(EXIT_HANDLERS_ALONE)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout, as python -m partitioner
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
        check=False,
    )
    lines = proc.stdout.splitlines()
    assert lines == [
        "an exit handler (atexit) of the model's code, boom (exits.py line 9), raised "
        "ValueError: no",
        "an exit handler (atexit) of the model's code, stuck (exits.py line 6), was still "
        "running after 0.5 s; exiting without it: remove the atexit.register call, or make the "
        "handler return",
    ], proc.stdout + proc.stderr


# -- D2: a builder that raises runs once ---------------------------------------------------------

COUNTED = """\
with open({log!r}, "a") as f:
    f.write("import\\n")

def build_model():
    with open({log!r}, "a") as f:
        f.write("build\\n")
    raise ValueError("fail")
"""


def test_a_builder_that_raises_runs_once_and_says_it_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It ran twice: without weights, then again with them "for the user's own error"."""
    log = tmp_path / "runs.txt"
    model = tmp_path / "counted.py"
    model.write_text(COUNTED.format(log=str(log)))
    code, err = _run_main([model, "--gpus", "2", "--out", tmp_path / "p.json"], capsys)
    assert code == 2
    _one_line(err, "build_model() failed: ValueError: fail (line 7)")
    assert log.read_text().splitlines() == ["import", "build"]


# -- D6: async def build_model -------------------------------------------------------------------

ASYNC = (
    "import keras\n\n"
    "async def build_model():\n"
    "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
)


def _load_refused(path: Path) -> str:
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), weightless=True)
    return str(err.value)


def test_an_async_builder_is_refused_in_one_line_without_a_runtime_warning(
    tmp_path: Path,
) -> None:
    model = tmp_path / "coro.py"
    model.write_text(ASYNC)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        message = _load_refused(model)
        gc.collect()  # a coroutine never awaited warns as it is freed
    assert "build_model() returned a coroutine, not a keras.Model (it is an async def)" in message
    assert "make build_model a plain def" in message
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], [
        str(w.message) for w in seen
    ]


# -- D9: worker and calibrate say a bad command line in one line ---------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["worker", "--task", "0", "--cores", "0-1"], ("partition worker: error:", "--cores")),
        (["worker", "--threads", "1.5"], ("partition worker: error:", "--threads")),
        (
            ["calibrate", "--out", "x.json", "--rounds", "5.5"],
            ("partition calibrate: error:", "--rounds"),
        ),
    ],
)
def test_subcommand_argument_errors_are_one_line_as_the_main_commands(
    args: list[str], words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _run_main(args, capsys)
    assert exit_.value.code == 2
    line = _one_line(capsys.readouterr().err, *words)
    assert line.endswith(f"(see {words[0].removesuffix(' error:').rstrip(':')} --help)")


# -- D10: --input-shape keyed by a name the model does not have ----------------------------------

MLP16 = (
    "import keras\n\n"
    "def build_model():\n"
    "    inp = keras.Input((16,))\n"
    "    out = keras.layers.Dense(4, name='d2')(keras.layers.Dense(8, name='d1')(inp))\n"
    "    return keras.Model(inp, out, name='mlp')\n"
)


def test_an_unknown_input_name_is_said_with_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "mlp.py"
    model.write_text(MLP16)
    args: list[str | Path] = [
        model,
        "--gpus",
        "2",
        "--input-shape",
        "input_layer=16",
        "--no-strategies",
    ]
    code, err = _run_main(args, capsys)
    assert code == 2
    line = _one_line(err, "--input-shape input_layer=16: model 'mlp' has no input named")
    assert re.search(r"e\.g\. --input-shape keras_tensor(_\d+)?=16$", line), line
    assert "input_shape" not in line


# -- D11: a NUL byte in a model file -------------------------------------------------------------


def test_a_nul_byte_in_the_model_file_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "nul.py"
    model.write_bytes(b"def build_model():\n    return 1\x00\n")
    code, err = _run_main([model, "--gpus", "2", "--out", tmp_path / "p.json"], capsys)
    assert code == 2
    line = _one_line(err, f"{model}:2: syntax error:", "null bytes")
    assert "None" not in line


# -- D12: help to a full disk --------------------------------------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("command", [[], ["worker"], ["calibrate"]])
def test_help_that_cannot_be_printed_is_one_line_and_not_success(command: list[str]) -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "partitioner", *command, "--help"],
            cwd=REPO,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=QUICK_TIMEOUT_S,
            check=False,
        )
    assert proc.returncode == 2, proc.stderr
    prog = " ".join(["partition", *command])
    _one_line(proc.stderr, f"{prog}: error: cannot print the help on stdout (No space left")


# -- D14: a model whose only output is an integer ------------------------------------------------

INT_OUTPUT = """\
import keras

class ArgMax(keras.layers.Layer):
    def call(self, t):
        return keras.ops.argmax(t, axis=-1)

def build_model():
    inp = keras.Input((16,))
    return keras.Model(inp, ArgMax(name="am")(keras.layers.Dense(8, name="d1")(inp)))
"""


def test_an_integer_only_output_is_named_with_the_next_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "intout.py"
    model.write_text(INT_OUTPUT)
    code, err = _run_main([model, "--gpus", "2", "--no-strategies"], capsys)
    assert code == 2
    line = _one_line(err, "no floating-point output to train on (its output: int")
    assert re.search(r"from op '[^']*am[^']*/ArgMax'", line), line
    assert "plan a model that returns float values" in line
