"""Hostile input III (issue 34), campaign 34l (round 12): the defects found, each at its
mechanism."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from partitioner.core.errors import OutputError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_another_users_file_in_a_shared_directory_is_not_replaced(tmp_path: Path) -> None:
    """Campaign 34l a (N70): another user's regular file planted in a sticky directory anyone
    may write (``/tmp``) was replaced by root's output through a rename, which the kernel's
    ``protected_regular`` never sees, and the new file kept its mode 666: that user could then
    edit root's emitted module. Such a file is refused; the user's own, and one the directory's
    owner made, are replaced."""
    from partitioner.core.files import check_output_path, write_atomic

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "placed.py"
    planted.write_text("# planted\n")
    planted.chmod(0o666)
    os.chown(planted, 65534, 65534)
    for attempt in (lambda: check_output_path(planted), lambda: write_atomic(planted, "x = 1\n")):
        with pytest.raises(OutputError) as info:
            attempt()
        assert f"it is a file of another user (uid 65534) in {shared}" in str(info.value)
    assert planted.read_text() == "# planted\n"
    os.chown(shared, 65534, -1)  # the directory's owner's file: replaced
    assert check_output_path(planted) == planted
    os.chown(shared, os.geteuid(), -1)
    os.chown(planted, os.geteuid(), -1)  # the user's own: replaced
    write_atomic(planted, "x = 1\n")
    assert planted.read_text() == "x = 1\n"


def test_a_profile_cache_entry_past_an_hour_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Campaign 34l a (N1): an entry giving a layer 1e300 s passed the schema (times >= 0) and
    made a plan whose step no plan file takes (``partition show`` refused it). An entry past
    :data:`MAX_MEASURED_LAYER_S` is ignored with a warning and measured again."""
    from cost_models.measure import profiled

    key = "a" * 64
    entry = tmp_path / "layers" / f"{key}.json"
    entry.parent.mkdir()
    body = {"schema": profiled.CACHE_SCHEMA, "key": key, "repeats": 3}
    entry.write_text(json.dumps({**body, "forward_time_s": 1e300, "backward_time_s": 0.1}))
    with caplog.at_level(logging.WARNING, logger="cost_models.measure.profiled"):
        assert profiled._read_entry(tmp_path, key) is None
    assert "more than the 3600.0 s any measured layer takes" in caplog.text
    entry.write_text(json.dumps({**body, "forward_time_s": 0.2, "backward_time_s": 0.1}))
    assert profiled._read_entry(tmp_path, key) == (0.2, 0.1, 3)


@pytest.mark.slow
def test_a_worker_on_a_port_in_use_says_one_line(tmp_path: Path) -> None:
    """Campaign 34l a (N6): gRPC's own lines (``Failed to add port to server ... 0.0.0.0``)
    came before the worker's one line; they are held while the server starts, and dropped when
    it fails."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = tmp_path / "c.json"
        cluster.write_text(f'{{"worker": ["127.0.0.1:{port}"]}}')
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env["PYTHONPATH"] = str(REPO)
        cmd = [sys.executable, "-m", "partitioner", "worker", "--task", "0"]
        done = subprocess.run(
            [*cmd, "--cluster", str(cluster)],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
    assert done.returncode == 2
    lines = [x for x in done.stderr.splitlines() if "cuInit" not in x]
    assert len(lines) == 1, done.stderr
    assert f"could not listen on 127.0.0.1:{port}" in lines[0]
    assert "is the port in use by another process?" in lines[0]


@pytest.fixture(scope="module")
def pipeline_plan(mlp: Any) -> Any:
    import partitioner

    return partitioner.partition(mlp, gpus=2, batch_size=16, strategy="pipeline")


def _edited(data: dict[str, Any], edit: str) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    predicted = data["predicted"]
    if edit == "batch_size":
        data["batch_size"] = 32
    elif edit == "peak_memory":
        predicted["memory_bytes"] = [1] * len(predicted["memory_bytes"])
    elif edit == "step_past_timeline":
        predicted["step_time_s"] = predicted["step_time_s"] * 4
    elif edit == "bytes_received":
        predicted["bytes_received"] = [999_999] + [0] * (len(predicted["bytes_received"]) - 1)
    return data


@pytest.mark.parametrize(
    "edit", ["batch_size", "peak_memory", "step_past_timeline", "bytes_received"]
)
def test_a_plan_file_edited_after_it_was_written_is_refused(pipeline_plan: Any, edit: str) -> None:
    """Campaign 34l b (Y01-Y05, K44, X13): a plan file whose batch size, peak memory, step or
    bytes received were edited kept the predictions made for the others and was shown and
    applied. Field-by-field checks cannot see every such edit; the plan's digest of the rest
    of the file can: an edited figure is refused, and the file as written still loads."""
    from partitioner.core.errors import PlanError
    from partitioner.plan.model import Plan

    data = pipeline_plan.to_json_dict()
    assert Plan.from_json_dict(json.loads(json.dumps(data))) == pipeline_plan
    with pytest.raises(PlanError) as info:
        Plan.from_json_dict(_edited(data, edit), origin="plan file 'p.json'")
    assert str(info.value) == (
        "plan file 'p.json': it was changed after it was written (its digest does not match "
        "the rest): a plan's predictions hold only for the batch, devices and placement they "
        "were made for; make the plan again"
    )


def test_a_plan_file_without_a_digest_is_read_with_a_warning(
    pipeline_plan: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from partitioner.plan.model import Plan

    data = pipeline_plan.to_json_dict()
    del data["digest"]
    with caplog.at_level(logging.WARNING, logger="partitioner.plan.model"):
        assert Plan.from_json_dict(data, origin="plan file 'p.json'") == pipeline_plan
    assert "plan file 'p.json' has no digest" in caplog.text
    assert "its predictions are read as written, unchecked" in caplog.text
