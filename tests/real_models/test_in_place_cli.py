"""Issue 36's done-when from the command line: ``partition`` on a model of each kind the copies
cannot take (custom layers without ``get_config``, a keras_hub backbone whose config does not
round-trip, a VAE and a GAN with their own ``train_step``, a subclassed model branching on
``training`` with a shared layer and ``add_loss``) writes a plan, placed or data parallel, that
``plan.apply`` uses on the model itself (the subclassed one, whose configs round-trip, on a
copy): outputs, gradients and the weights after one step of the model's own ``fit`` equal the
model built again from the same seed (``check_equivalence`` of the real-model suite)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner

from . import zoo
from .test_real_models import CPU, KERAS_HUB, check_equivalence, has_batch_statistics, pieces_of

REPO = Path(__file__).resolve().parents[2]

MODELS_FILE = """
import keras

from tests.real_models import zoo


def _built(name):
    keras.utils.set_random_seed(0)
    with zoo.dtype_policy(zoo.BY_NAME[name].dtype):
        return zoo.BY_NAME[name].build()[0]


def custom_layer_no_config():
    return _built("custom_layer_no_config")


def text_transformer():
    return _built("text_transformer")


def llama():
    return _built("llama")


def vae():
    return _built("vae")


def gan():
    return _built("gan")


def shared_branches():
    return _built("shared_branches")
"""

KINDS = (
    ("custom_layer_no_config", "placed"),
    ("text_transformer", "data-parallel"),
    ("llama", "placed"),
    ("vae", "data-parallel"),
    ("gan", "data-parallel"),
    ("shared_branches", "placed"),
)


def _partition(tmp_path: Path, name: str, strategy: str) -> Any:
    out = tmp_path / f"{name}.json"
    shapes = [
        f"{k}={','.join(map(str, v))}" for k, v in (zoo.BY_NAME[name].input_shape or {}).items()
    ]
    command = [
        sys.executable, "-m", "partitioner", f"models.py:{name}", "--gpus", "2",
        "--device-type", "cpu", "--batch-size", str(zoo.BATCH), "--strategy", strategy,
        "--out", str(out), *(f"--input-shape={s}" for s in shapes),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARTITIONER_CACHE_DIR": str(tmp_path / "c")}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr
    return partitioner.load_plan(out)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "strategy"), KINDS, ids=[f"{n}-{s}" for n, s in KINDS])
def test_the_command_line_plans_each_kind_and_apply_places_the_model_itself(
    tmp_path: Path, name: str, strategy: str
) -> None:
    if zoo.BY_NAME[name].source.startswith("keras_hub") and not importlib.util.find_spec(
        "keras_hub"
    ):
        pytest.skip(f"keras-hub is not installed: python -m pip install --no-deps {KERAS_HUB}")
    (tmp_path / "models.py").write_text(MODELS_FILE)
    plan = _partition(tmp_path, name, strategy)
    strat = plan.strategy
    if strategy == "placed":
        assert len(set(plan.assignment.values())) == 2  # a real split
    else:
        assert strat is not None and strat.replicas == 2
    case = zoo.BY_NAME[name]
    keras.backend.clear_session()  # Keras's automatic layer names (dense_1, ...) as in a new process
    with zoo.dtype_policy(case.dtype):
        model, x, y = zoo.build(name)
        applied = plan.apply(model, devices=list(CPU[:2]))
        pieces = pieces_of(plan)
        m = pieces if pieces > 1 and has_batch_statistics(model) else 1
        if name == "shared_branches":  # its configs round-trip: copied
            assert applied is not model
            check_equivalence(model, applied, x, y, m)
            return
        assert applied is model  # in place, not a copy
        reference, _, _ = zoo.build(name)
        draws_in = pieces if case.draws else 1
        check_equivalence(reference, model, x, y, m, own_fit=True, draws_in=draws_in)
