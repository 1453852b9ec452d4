"""Campaign rerun (issue 34): no write follows a symbolic link the user did not name.

D2: a profile cache entry that is a symbolic link (by mistake, or planted by another user of a
shared ``PARTITIONER_CACHE_DIR``) is a miss, and the measured entry replaces the link itself; the
file it pointed at (a user's file, the model file) is never written. The same for the files
``start_local_workers`` makes in its directory (``cluster.json``, the worker logs).

D3: ``--out outdir/plan.json`` where ``outdir`` is a symbolic link the model's code re-points at
import: the output is resolved before the model's code runs and written there (where ``outdir``
led when the run started), never to the file the link leads to afterwards; a symbolic link the
code puts on the resolved path itself is refused in one line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from partitioner.core.errors import OutputError
from partitioner.core.files import UnreadableInput, read_regular_text, write_atomic

VICTIM = "precious user notes\n"
TIMEOUT_S = 240


def _victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    victim = tmp_path / name
    victim.write_text(VICTIM)
    return victim


# -- D2: the profile cache ---------------------------------------------------------------------


def _tiny_model() -> object:
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="d1"), keras.layers.Dense(4, name="d2")]
    )


def test_a_symlinked_profile_cache_entry_is_a_miss_and_its_target_is_never_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The campaign's case (D2_cache_symlink_clobber.sh) through ``profile_model``: every entry
    of a first run replaced by a link to a user file; the second run measures again, leaves each
    user file as it was, and leaves regular cache files where the links were."""
    from cost_models.measure.profiled import ProfileSettings, profile_model

    fast = ProfileSettings(warmup=0, min_repeats=1, max_repeats=1, min_time_s=0.0)
    cache = tmp_path / "cache"
    first = profile_model(_tiny_model(), batch_size=4, cache_dir=cache, settings=fast)
    entries = sorted((cache / "layers").iterdir())
    assert first.measured_count == len(entries) >= 2
    victims = []
    for i, entry in enumerate(entries):
        entry.unlink()
        victims.append(_victim(tmp_path, f"victim{i}.txt"))
        entry.symlink_to(victims[-1])
    with caplog.at_level(logging.WARNING, logger="cost_models.measure.profiled"):
        second = profile_model(_tiny_model(), batch_size=4, cache_dir=cache, settings=fast)
    assert [v.read_text() for v in victims] == [VICTIM] * len(victims)
    assert second.cached_count == 0 and second.measured_count == first.measured_count
    assert "symbolic link" in caplog.text
    for entry in entries:
        assert not entry.is_symlink() and json.loads(entry.read_text())["key"] == entry.stem
    third = profile_model(_tiny_model(), batch_size=4, cache_dir=cache, settings=fast)
    assert third.measured_count == 0  # the rewritten entries are this cache's own again


def test_a_symlink_to_a_valid_entry_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link whose target holds a well-formed entry of the right key is still a miss: the
    cache reads only its own files (``O_NOFOLLOW``)."""
    from cost_models.measure import profiled

    key = "1" * 64
    elsewhere = tmp_path / "elsewhere.json"
    good = {
        "schema": profiled.CACHE_SCHEMA, "key": key, "forward_time_s": 1.0,
        "backward_time_s": 2.0, "repeats": 3,
    }  # fmt: skip
    elsewhere.write_text(json.dumps(good))
    (tmp_path / "layers").mkdir()
    entry = tmp_path / "layers" / f"{key}.json"
    entry.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="cost_models.measure.profiled"):
        assert profiled._read_entry(tmp_path, key) is None
    assert "symbolic link" in caplog.text
    entry.unlink()
    entry.write_text(json.dumps(good))  # the same text as the cache's own file: a hit
    assert profiled._read_entry(tmp_path, key) == (1.0, 2.0, 3)
    dangling = tmp_path / "layers" / f"{'2' * 64}.json"
    dangling.symlink_to(tmp_path / "nowhere.json")
    assert profiled._read_entry(tmp_path, "2" * 64) is None


def test_a_cache_entry_write_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    from cost_models.measure import profiled

    key = "3" * 64
    (tmp_path / "layers").mkdir()
    victim = _victim(tmp_path)
    entry = tmp_path / "layers" / f"{key}.json"
    entry.symlink_to(victim)
    profiled._write_entry(tmp_path, key, {"layer": "x"}, 1.0, 2.0, 3)
    assert victim.read_text() == VICTIM
    assert not entry.is_symlink() and json.loads(entry.read_text())["key"] == key
    assert profiled._read_entry(tmp_path, key) == (1.0, 2.0, 3)


def test_write_atomic_without_following_links(tmp_path: Path) -> None:
    """``follow_symlinks=False``: a link (to a file, or dangling) is itself replaced and its
    target untouched; a directory or a FIFO there is still refused; the default still follows."""
    victim = _victim(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    write_atomic(link, "new\n", follow_symlinks=False)
    assert victim.read_text() == VICTIM
    assert not link.is_symlink() and link.read_text() == "new\n"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")
    write_atomic(dangling, "made\n", follow_symlinks=False)
    assert not (tmp_path / "made.json").exists() and dangling.read_text() == "made\n"
    (tmp_path / "dir").mkdir()
    with pytest.raises(OutputError, match="directory"):
        write_atomic(tmp_path / "dir", "x\n", follow_symlinks=False)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OutputError, match="FIFO"):
        write_atomic(tmp_path / "fifo", "x\n", follow_symlinks=False)
    followed = tmp_path / "followed.json"
    followed.symlink_to(victim)
    write_atomic(followed, "through\n")  # a path the user named: documented, unchanged
    assert followed.is_symlink() and victim.read_text() == "through\n"


def test_read_regular_text_without_following_refuses_a_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "link.txt"
    link.symlink_to(victim)
    assert read_regular_text(link, 1024) == VICTIM
    with pytest.raises(UnreadableInput, match="symbolic link") as info:
        read_regular_text(link, 1024, follow_symlinks=False)
    assert info.value.kind == "type"
    assert read_regular_text(victim, 1024, follow_symlinks=False) == VICTIM


def test_local_workers_cluster_file_is_never_written_through_a_link(tmp_path: Path) -> None:
    """``start_local_workers`` writes ``cluster.json`` in its directory: a link there (left by
    someone else in a shared directory) is replaced, never followed."""
    from partitioner.cli.worker import start_local_workers

    work = tmp_path / "work"
    work.mkdir()
    cluster_victim = _victim(tmp_path, "c.txt")
    (work / "cluster.json").symlink_to(cluster_victim)
    workers = start_local_workers(0, work)
    assert cluster_victim.read_text() == VICTIM
    assert not (work / "cluster.json").is_symlink()
    assert json.loads((work / "cluster.json").read_text())["cluster"] == {"worker": []}
    assert workers.cluster_file == work / "cluster.json"


def test_local_worker_logs_are_never_written_through_a_link(tmp_path: Path) -> None:
    """The same for each worker's log (``worker<i>.log``, opened by ``_new_log``)."""
    from partitioner.cli.worker import LOG_HEADER, _new_log

    work = tmp_path / "work"
    work.mkdir()
    log_victim = _victim(tmp_path, "l.txt")
    (work / "worker0.log").symlink_to(log_victim)
    with _new_log(work / "worker0.log") as out:
        out.write(b"log line\n")
    assert log_victim.read_text() == VICTIM
    assert not (work / "worker0.log").is_symlink()
    assert (work / "worker0.log").read_bytes() == LOG_HEADER.encode() + b"log line\n"


# -- D3: outputs resolved before the model's code runs ---------------------------------------------


def _paths(args: Sequence[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    from partitioner.cli.main import _resolve_paths, build_parser

    monkeypatch.chdir(cwd)
    return _resolve_paths(build_parser().parse_args(list(args)))


def _linked_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """``d1`` (empty), ``d2`` holding the user's ``plan.json``, and ``outdir`` -> ``d1``."""
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    (d2 / "plan.json").write_text('{"mine": true}\n')
    (tmp_path / "outdir").symlink_to("d1")
    return d1, d2


def test_outputs_are_resolved_through_links_before_the_models_code_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partitioner.cli.main import _check_outputs

    d1, _ = _linked_dirs(tmp_path)
    paths = _paths(["m.py", "--out", "outdir/plan.json"], tmp_path, monkeypatch)
    (out,) = paths.outputs  # type: ignore[attr-defined]
    assert out.path == os.path.realpath(d1 / "plan.json") and out.given == "outdir/plan.json"
    assert paths.shown(out.given, out.path) == "outdir/plan.json"  # type: ignore[attr-defined]
    (tmp_path / "outdir").unlink()  # what the model's code does at import
    (tmp_path / "outdir").symlink_to("d2")
    _check_outputs(paths, [])  # type: ignore[arg-type]  # still d1's file: fine to write
    # "outdir/plan.json" now names another file: messages name the one written
    assert paths.shown(out.given, out.path) == out.path  # type: ignore[attr-defined]


def test_a_link_put_on_the_resolved_output_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partitioner.cli.main import _check_outputs

    d1, _ = _linked_dirs(tmp_path)
    paths = _paths(["m.py", "--out", "d1/plan.json"], tmp_path, monkeypatch)
    d1.rmdir()
    d1.symlink_to("d2")  # the resolved directory itself is now a link
    with pytest.raises(OutputError, match=r"--out d1/plan.json now leads to .*d2/plan.json"):
        _check_outputs(paths, [])  # type: ignore[arg-type]


RELINK_MODEL = (
    "import os\nimport keras\n{action}\n\n"
    "def build_model():\n"
    "    x = keras.Input((16,))\n"
    "    y = keras.layers.Dense(4, name='b')(keras.layers.Dense(32, name='a')(x))\n"
    "    return keras.Model(x, y)\n"
)


def _run_cli(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "400"}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "partitioner", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def _plan_relinking(
    tmp_path: Path, action: str, out: str
) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """The two directories, and a plan run whose model does ``action`` at import."""
    d1, d2 = _linked_dirs(tmp_path)
    (tmp_path / "model.py").write_text(RELINK_MODEL.format(action=action))
    args = ["model.py", "--gpus", "2", "--batch-size", "16", "--no-strategies", "--out", out]
    return d1, d2, _run_cli(args, tmp_path)


def test_out_through_a_dir_link_the_model_repoints_lands_where_it_led_at_start(
    tmp_path: Path,
) -> None:
    """The campaign's case (D3_symlinked_out_dir_repointed.sh), end to end."""
    d1, d2, proc = _plan_relinking(
        tmp_path, "os.remove('outdir'); os.symlink('d2', 'outdir')", "outdir/plan.json"
    )
    assert proc.returncode == 0, proc.stderr
    assert (d2 / "plan.json").read_text() == '{"mine": true}\n'  # never named: untouched
    plan = json.loads((d1 / "plan.json").read_text())
    assert set(plan["assignment"]) == {"a", "b"}
    assert f"Plan written to {os.path.realpath(d1 / 'plan.json')}\n" in proc.stdout, proc.stdout


def test_a_model_that_turns_the_output_dir_into_a_link_is_refused(tmp_path: Path) -> None:
    _, d2, proc = _plan_relinking(
        tmp_path, "os.rmdir('d1'); os.symlink('d2', 'd1')", "d1/plan.json"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("partition: error: --out"), proc.stderr
    assert "symbolic link" in lines[0] and "written to" not in proc.stdout
    assert (d2 / "plan.json").read_text() == '{"mine": true}\n'
