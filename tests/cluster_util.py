"""Local TensorFlow cluster workers for tests (``python -m partitioner.cli.worker`` subprocesses).

``start_workers(n, directory)`` is :func:`partitioner.cli.worker.start_local_workers` with the
repository importable by the children: free 127.0.0.1 ports, a cluster file, one subprocess per
task, a bounded wait until each serves. ``LocalWorkers.stop()`` ends them (SIGTERM, then
SIGKILL); call it in a ``finally`` or a fixture finalizer so no worker outlives its test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from partitioner.cli.worker import LocalWorkers, free_ports, start_local_workers

__all__ = ["REPO_ROOT", "LocalWorkers", "free_ports", "start_workers", "worker_env"]

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 90.0


def worker_env() -> dict[str, str]:
    """The environment for a worker or client subprocess: the repo importable, TF quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("TF_CONFIG", None)
    return env


def start_workers(
    num_tasks: int,
    directory: Path,
    *,
    threads: int = 1,
    cores: Sequence[int | None] | None = None,
) -> LocalWorkers:
    """Start ``num_tasks`` local workers; wait until all serve (bounded)."""
    return start_local_workers(
        num_tasks,
        directory,
        threads=threads,
        cores=cores,
        env=worker_env(),
        timeout_s=READY_TIMEOUT_S,
    )
