"""The emitted data-parallel program of a TF_CONFIG plan, launched as its docstring says.

Two tasks on one host (127.0.0.1, free ports): the program is written for the plan, the original
model is saved compiled (SGD, MSE) and the data written as DATA.npz, and each launch command of
the program's docstring is run as its own process as written (the plan is made for a TF_CONFIG
of two free loopback ports, whose addresses the program names, as ``partition --emit`` passes
them). After its three steps the model the chief saves
(ORIGINAL.trained.keras) holds the weights of the original trained on one device on the same
global batches. Slow: two TensorFlow processes (about 15 s on two cores).
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from partitioner.cli.worker import free_ports
from passes.rewrite.codegen import emit_plan_module, write_placed_module
from tests.passes.test_codegen_strategy import (
    BATCH,
    REL_TOL,
    cluster_plan,
    data,
    mlp,
    relative_error,
)

pytestmark = pytest.mark.slow

STEPS = 3
TIMEOUT_S = 90.0


def launch_commands(source: str) -> list[list[str]]:
    """Each launch command of the module's docstring, split as a shell would split it."""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    lines = docstring.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip().startswith("TF_CONFIG=")]


def as_run_here(command: list[str], program: Path) -> tuple[Any, ...]:
    """``command`` (``TF_CONFIG=... python THIS_FILE.py ORIGINAL.keras DATA.npz``) as written,
    with this interpreter for ``python`` and the paths of the files its words name."""
    assignment, *argv = command
    names = {
        "python": sys.executable,
        "THIS_FILE.py": str(program),
        "ORIGINAL.keras": "original.keras",
        "DATA.npz": "data.npz",
    }
    return assignment.removeprefix("TF_CONFIG="), [names.get(word, word) for word in argv]


def run_workers(commands: list[tuple[Any, ...]], cwd: Path) -> list[str]:
    """Run every (TF_CONFIG, argv) as its own process in ``cwd``; their outputs once all end.
    Bounded by TIMEOUT_S; when one fails or time is up, every process still running is killed."""
    logs = [cwd / f"worker{k}.log" for k in range(len(commands))]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for (tf_config, argv), log in zip(commands, logs):
            env = {**os.environ, "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "3"}
            with log.open("wb") as out:
                processes.append(
                    subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in processes]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break  # all done, or one failed: the others would wait for it until the timeout
            time.sleep(0.1)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    codes = [p.returncode for p in processes]
    assert codes == [0] * len(processes), "\n".join(
        f"{c}: {o[-2000:]}" for c, o in zip(codes, outputs)
    )
    return outputs


def test_the_emitted_program_on_two_loopback_workers_trains_as_one_device(tmp_path: Path) -> None:
    model = mlp()
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    plan = cluster_plan(model, cluster)
    source = emit_plan_module(model, plan, cluster_addresses=cluster)  # as the CLI does
    assert "(the cluster it was planned for)" in source
    assert "tf.distribute.MultiWorkerMirroredStrategy()" in source
    program = write_placed_module(tmp_path / "program.py", source)
    model.save(tmp_path / "original.keras")
    x, y = data(STEPS * BATCH, seed=5)
    np.savez(tmp_path / "data.npz", x=x, y=y)

    commands = launch_commands(source)
    assert len(commands) == 2
    assert json.loads(commands[0][0].removeprefix("TF_CONFIG="))["cluster"] == cluster
    outputs = run_workers([as_run_here(c, program) for c in commands], tmp_path)

    assert "trained weights saved to original.trained.keras" in outputs[0]
    assert "trained weights saved" not in outputs[1]  # only the chief writes
    trained = keras.saving.load_model(tmp_path / "original.trained.keras")
    reference = mlp()
    for k in range(STEPS):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        reference.train_on_batch(x[rows], y[rows])
    weights = trained.get_weights()
    assert len(weights) == len(reference.get_weights())
    for k, (a, b) in enumerate(zip(weights, reference.get_weights())):
        assert relative_error(a, b) <= REL_TOL, f"weight {k}"
    assert relative_error(weights[0], model.get_weights()[0]) > 1e-3  # it did train
