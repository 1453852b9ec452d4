"""``PATH[:ATTR]``: finding the model in a user's Python file, and one-line errors when there is none."""

from __future__ import annotations

import sys
from pathlib import Path

import keras
import pytest

from partitioner.cli.loader import check_model_path, load_model, split_spec
from partitioner.core.errors import ModelLoadError

MODEL = """
import keras

def _mlp(name):
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)], name=name
    )
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("models/net.py:build", (Path("models/net.py"), "build")),
        ("models/net.py", (Path("models/net.py"), None)),
        ("/abs/net.py:MODEL", (Path("/abs/net.py"), "MODEL")),
        ("dir:with/colon/net.py", (Path("dir:with/colon/net.py"), None)),
        ("net.txt:build", (Path("net.txt:build"), None)),
    ],
)
def test_split_spec(spec: str, expected: tuple[Path, str | None]) -> None:
    assert split_spec(spec) == expected


@pytest.mark.parametrize("builder", ["build_model", "create_model", "get_model", "make_model"])
def test_builder_function_is_found(tmp_path: Path, builder: str) -> None:
    path = write(tmp_path, "net.py", MODEL + f"\ndef {builder}():\n    return _mlp('{builder}')\n")
    model = load_model(str(path))
    assert isinstance(model, keras.Model)
    assert model.name == builder


def test_builder_is_preferred_to_module_level_model(tmp_path: Path) -> None:
    text = (
        MODEL + "\nMODEL = _mlp('module_level')\n\ndef build_model():\n    return _mlp('built')\n"
    )
    assert load_model(str(write(tmp_path, "net.py", text))).name == "built"


def test_single_module_level_model(tmp_path: Path) -> None:
    path = write(tmp_path, "net.py", MODEL + "\nnet = _mlp('only')\n_private = _mlp('hidden')\n")
    assert load_model(str(path)).name == "only"


def test_attr_names_a_model_or_a_function(tmp_path: Path) -> None:
    text = MODEL + "\nA = _mlp('a')\nB = _mlp('b')\n\ndef other():\n    return _mlp('other')\n"
    path = write(tmp_path, "net.py", text)
    assert load_model(f"{path}:B").name == "b"
    assert load_model(f"{path}:other").name == "other"


def test_several_models_need_a_choice(tmp_path: Path) -> None:
    path = write(tmp_path, "net.py", MODEL + "\nA = _mlp('a')\nB = _mlp('b')\n")
    with pytest.raises(ModelLoadError, match=r"several models \(A, B\)") as info:
        load_model(str(path))
    assert f"{path}:NAME" in str(info.value)


def test_main_block_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = (
        MODEL
        + "\ndef build_model():\n    return _mlp('m')\n"
        + f"\nif __name__ == '__main__':\n    open({str(marker)!r}, 'w').close()\n"
    )
    load_model(str(write(tmp_path, "net.py", text)))
    assert not marker.exists()


def test_sibling_module_imports_and_sys_path_is_restored(tmp_path: Path) -> None:
    write(tmp_path, "helper_for_loader_test.py", MODEL)
    text = "from helper_for_loader_test import _mlp\n\ndef build_model():\n    return _mlp('sib')\n"
    before = list(sys.path)
    assert load_model(str(write(tmp_path, "net.py", text))).name == "sib"
    assert sys.path == before


@pytest.mark.parametrize(
    ("name", "text", "suffix", "message"),
    [
        ("net.py", "X = 1\n", "", r"no model found in .*net\.py.*build_model\(\)"),
        ("net.py", "CONSTANT = 3\n", ":CONSTANT", r"CONSTANT is of type int, not a keras\.Model"),
        ("net.py", "X = 1\n", ":missing", r"has no attribute 'missing'"),
        ("net.py", "class Net:\n    pass\n", ":Net", r"Net is of type type, not a keras\.Model"),
        (
            "net.py",
            "def build(units):\n    pass\n",
            ":build",
            r"build needs arguments \(units\)",
        ),
        ("net.py", "def build_model():\n    return 3\n", "", r"returned a int, not a keras\.Model"),
        (
            "net.py",
            "def build_model():\n    x = 1\n    raise ValueError('boom')\n",
            "",
            r"build_model\(\) failed: ValueError: boom \(line 3\)",
        ),
        (
            "net.py",
            "import os\nraise RuntimeError('at import')\n",
            "",
            r"importing .*net\.py failed: RuntimeError: at import \(line 2\)",
        ),
        ("net.py", "import sys\nsys.exit(3)\n", "", r"called sys\.exit\(3\)"),
        ("net.py", "x = 1\ndef f(:\n", "", r"net\.py:2: syntax error"),
        (
            "net.py",
            "import no_such_module_for_partitioner_tests\n",
            "",
            r"ModuleNotFoundError: .*no_such_module_for_partitioner_tests",
        ),
    ],
)
def test_load_errors(tmp_path: Path, name: str, text: str, suffix: str, message: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(f"{path}{suffix}")
    assert "\n" not in str(info.value)


def test_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "missing.py"))
    with pytest.raises(ModelLoadError, match=r"not a \.py file"):
        load_model(str(write(tmp_path, "net.txt", "X = 1\n")))
    (tmp_path / "pkg.py").mkdir()
    with pytest.raises(ModelLoadError, match="is not a file"):
        load_model(str(tmp_path / "pkg.py"))


def test_check_model_path(tmp_path: Path) -> None:
    path = write(tmp_path, "net.py", "raise RuntimeError('must not be imported')\n")
    assert check_model_path(f"{path}:build") == path
    with pytest.raises(ModelLoadError, match="no such file"):
        check_model_path(str(tmp_path / "missing.py:build"))


ASSIGNS = """
import keras

class Doubled(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 1024), initializer="ones")
        self.w.assign(self.w * 2.0)

    def call(self, x):
        return x @ self.w

def build_model():
    x = keras.Input((256,))
    return keras.Model(x, Doubled(name="doubled")(x))
"""


def test_a_model_file_is_loaded_without_its_weights(tmp_path: Path) -> None:
    from passes.weightless import deferred_variables

    text = MODEL + (
        "\nfrom dataclasses import dataclass\n\n@dataclass(frozen=True)\nclass Size:\n"
        "    width: int = 3\n\ndef build_model():\n    return _mlp(f'm{Size().width}')\n"
    )  # a model file may define dataclasses: the module is registered while it runs
    model = load_model(str(write(tmp_path, "net.py", text)), weightless=True)
    assert model.name == "m3"
    assert len(deferred_variables(model)) == len(model.variables) == 4


def test_a_model_that_needs_its_weights_is_built_with_them_when_they_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "assigns.py", ASSIGNS)
    model = load_model(str(path), weightless=True)
    assert float(model.get_layer("doubled").w.numpy()[0, 0]) == 2.0  # the build's own value
    assert "layer 'doubled' assigns to doubled/" in caplog.text
    assert "built it with its weights instead" in caplog.text


def test_a_model_that_needs_weights_that_do_not_fit_is_refused_with_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import passes.weightless

    monkeypatch.setattr(passes.weightless, "available_memory_bytes", lambda: 1000)
    path = write(tmp_path, "assigns.py", ASSIGNS)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), weightless=True)
    message = str(err.value)
    assert "layer 'doubled' assigns" in message and "1.00 MiB" in message and "1000 B" in message


def test_a_model_file_that_compiles_its_model_loads_without_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An optimizer makes variables from values (its learning rate), which Keras refuses in a
    stateless scope; they are deferred like the weights, and the plan is the one with weights."""
    import partitioner
    from passes.weightless import is_weightless

    path = Path(__file__).resolve().parents[1] / "examples" / "mnist_mlp.py"
    model = load_model(str(path), weightless=True)
    assert is_weightless(model) and model.compiled and not caplog.text
    weighted = load_model(str(path))
    plans = [partitioner.partition(m, gpus=2, batch_size=32) for m in (model, weighted)]
    assert plans[0].step_time_s == plans[1].step_time_s
