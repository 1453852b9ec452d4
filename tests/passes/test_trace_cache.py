"""The trace cache (:mod:`passes.trace_cache`): the second plan of a model traces nothing and is
the same plan; a cache that is shared, interrupted, full, not a directory or out of date never
costs a plan and never serves a trace of another model."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner
from partitioner.plan.model import Plan
from passes import trace_cache
from passes.trace import forward_signature, trace_model
from passes.trace_cache import TraceCache, decode_graph, encode_graph, trace_key

ROOT = Path(__file__).resolve().parents[2]

PARTITION = [
    sys.executable,
    "-c",
    "import sys; import passes.trace_cache as c; c.MIN_CACHED_TRACE_S = 0.0; "
    "from partitioner.cli.main import main; sys.exit(main())",
]
"""The ``partition`` command, storing every trace: these models trace in well under
:data:`~passes.trace_cache.MIN_CACHED_TRACE_S`, the shortest trace it stores."""


@pytest.fixture(autouse=True)
def _every_trace_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_cache, "MIN_CACHED_TRACE_S", 0.0)


def _mlp(units: int = 16, name: str = "cached_mlp") -> keras.Model:
    inputs = keras.Input((12,), name="x")
    hidden = keras.layers.Dense(units, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(hidden), name=name)


def _plan(model: keras.Model, cache: Path, **options: Any) -> Plan:
    return partitioner.partition(
        model, gpus=2, batch_size=16, trace_cache=True, cache_dir=str(cache), **options
    )


def _phases(plan: Plan) -> list[str]:
    return [name for name, _ in plan.phase_times_s]


_WALL_TIMES = {"phase_times_s", "solve_time_s", "search_time_s", "digest"}
"""The plan's wall times of the run itself (not predictions), which differ between any runs,
and the digest of them all."""


def _without_times(plan: Plan) -> Any:
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _WALL_TIMES}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(plan.to_json_dict())


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "traces").glob("*.json"))


def test_a_graph_survives_its_encoding() -> None:
    graph = trace_model(_mlp(), batch_size=8).graph
    assert decode_graph(json.loads(json.dumps(encode_graph(graph)))) == graph


def test_the_second_plan_traces_nothing_and_is_the_same_plan(tmp_path: Path) -> None:
    model = _mlp()
    uncached = partitioner.partition(model, gpus=2, batch_size=16)
    cold = _plan(model, tmp_path)
    assert "trace" in _phases(cold) and "trace cache" not in _phases(cold)
    assert len(_entries(tmp_path)) == 2  # the batch and its half, which the others derive from
    warm = _plan(model, tmp_path)
    assert "trace" not in _phases(warm) and "trace cache" in _phases(warm)
    assert _without_times(warm) == _without_times(cold) == _without_times(uncached)


def test_another_device_count_uses_the_same_two_traces(tmp_path: Path) -> None:
    model = _mlp()
    _plan(model, tmp_path)
    before = _entries(tmp_path)
    plan = partitioner.partition(
        model, gpus=4, batch_size=16, trace_cache=True, cache_dir=str(tmp_path)
    )
    assert "trace" not in _phases(plan)
    assert _entries(tmp_path) == before


def test_a_failed_run_leaves_no_entry(tmp_path: Path) -> None:
    with pytest.raises(partitioner.PartitionError):
        _plan(_mlp(), tmp_path, memory_limit_bytes=1000)
    assert not (tmp_path / "traces").exists()


def test_another_model_of_the_same_names_is_a_miss(tmp_path: Path) -> None:
    _plan(_mlp(units=16), tmp_path)
    wider = _mlp(units=24)
    plan = _plan(wider, tmp_path)
    assert "trace" in _phases(plan)
    assert _without_times(plan) == _without_times(
        partitioner.partition(wider, gpus=2, batch_size=16)
    )


def test_a_changed_keras_version_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp()
    key = trace_key(model, 16, None)
    monkeypatch.setattr(keras, "__version__", "99.0.0")
    assert trace_key(model, 16, None) != key


def test_an_edited_layer_class_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The configuration of a custom layer need not change when its ``call`` does: the file
    that defines it is in the key."""
    source = tmp_path / "my_layers.py"
    body = """
        import keras

        class Scale(keras.layers.Layer):
            def call(self, x):
                return x * {factor}
    """
    source.write_text(textwrap.dedent(body.format(factor=2.0)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_layers", raising=False)
    import my_layers  # type: ignore[import-not-found]

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(my_layers.Scale()(inputs)))
    key = trace_key(model, 8, None)
    assert trace_key(model, 8, None) == key
    source.write_text(textwrap.dedent(body.format(factor=3.0)))
    assert trace_key(model, 8, None) != key


def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    model = _mlp()
    traced = trace_model(model, batch_size=16)
    key = trace_key(model, 16, None)
    caches = [TraceCache(tmp_path) for _ in range(6)]
    forward = caches[0].forward_signature(model, 16, None)
    assert forward is not None and forward.startswith("any ")
    for cache in caches:
        cache.pending[key] = (traced, forward)
    threads = [threading.Thread(target=c.flush) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in (tmp_path / "traces").iterdir()] == [f"{key}.json"]
    reader = TraceCache(tmp_path)
    assert reader.trace(model, 16, None).graph == traced.graph and reader.hits == 1


def test_a_write_killed_midway_is_a_miss_and_its_leftover_goes(tmp_path: Path) -> None:
    """A kill between the temporary file and the rename leaves the temporary file (no entry);
    a truncated entry (a copy cut short) is a miss with a warning and is replaced."""
    model = _mlp()
    key = trace_key(model, 16, None)
    entries = tmp_path / "traces"
    entries.mkdir()
    leftover = entries / f".{key}.json.abc.tmp"
    leftover.write_text('{"schema": 1, "key": ')
    os.utime(leftover, (1.0, 1.0))  # older than an hour
    whole = json.dumps(
        {"schema": 1, "key": key, "graph": encode_graph(trace_model(model, batch_size=16).graph)}
    )
    (entries / f"{key}.json").write_text(whole[: len(whole) // 2])
    cache = TraceCache(tmp_path)
    cache.trace(model, 16, None)
    assert cache.hits == 0 and key in cache.pending
    cache.flush()
    assert not leftover.exists()
    again = TraceCache(tmp_path)
    again.trace(model, 16, None)
    assert again.hits == 1


def test_a_full_disk_costs_a_warning_not_the_plan(tmp_path: Path) -> None:
    """The file size limit stands in for a full disk: every write past 2 KiB fails (EFBIG),
    as a write to a full disk fails (ENOSPC), in the middle of the entry."""
    script = f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        import keras, partitioner
        import passes.trace_cache
        passes.trace_cache.MIN_CACHED_TRACE_S = 0.0  # store this small model's trace
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 11, 1 << 11))
        plan = partitioner.partition(model, gpus=2, batch_size=16, trace_cache=True,
                                     cache_dir={str(tmp_path)!r})
        print("planned", plan.strategy.describe())
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "planned" in done.stdout
    assert "traces not cached" in done.stderr and "File too large" in done.stderr
    assert list((tmp_path / "traces").iterdir()) == []  # no partial entry, no temporary file


def test_a_cache_directory_that_is_a_file_costs_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("mine\n")
    with caplog.at_level(logging.WARNING, logger="passes.trace_cache"):
        plan = _plan(_mlp(), not_a_dir)
    assert plan.num_devices == 2
    assert "traces not cached" in caplog.text
    assert not_a_dir.read_text() == "mine\n"


def test_an_entry_that_is_a_link_or_a_fifo_is_a_miss_never_followed(tmp_path: Path) -> None:
    model = _mlp()
    key = trace_key(model, 16, None)
    entries = tmp_path / "traces"
    entries.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (entries / f"{key}.json").symlink_to(victim)
    cache = TraceCache(tmp_path)
    cache.trace(model, 16, None)
    cache.flush()
    assert victim.read_text() == "keep me\n"
    assert not (entries / f"{key}.json").is_symlink()
    other = trace_key(model, 8, None)
    os.mkfifo(entries / f"{other}.json")
    cache = TraceCache(tmp_path)
    cache.trace(model, 8, None)  # would block for ever on a read
    assert cache.hits == 0


def test_the_least_recently_used_entries_go_past_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _mlp()
    cache = TraceCache(tmp_path)
    for batch in (4, 8):
        cache.trace(model, batch, None)
    cache.flush()
    sizes = {p.name: p.stat().st_size for p in _entries(tmp_path)}
    oldest = trace_key(model, 4, None) + ".json"
    os.utime(tmp_path / "traces" / oldest, (1.0, 1.0))
    # room for two entries (an entry's size varies by a few digits with its batch), not three
    monkeypatch.setattr(trace_cache, "MAX_TRACE_CACHE_BYTES", sum(sizes.values()) + 100)
    cache.trace(model, 16, None)
    cache.flush()
    kept = {p.name for p in _entries(tmp_path)}
    assert oldest not in kept and len(kept) == 2


@pytest.mark.slow
def test_the_command_plans_again_from_the_cache_at_another_device_count(tmp_path: Path) -> None:
    """The user's path: ``partition`` twice in fresh processes; the second, at another
    ``--gpus``, reads both traces (its own phases say so), and ``--no-trace-cache`` traces."""
    env = {**os.environ, "PARTITIONER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    model = str(ROOT / "examples" / "mnist_mlp.py")

    def phases(*flags: str) -> list[str]:
        out = tmp_path / "p.json"
        done = subprocess.run(
            [*PARTITION, model, "--out", str(out), *flags],
            capture_output=True, text=True, env=env, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return list(json.loads(out.read_text())["phase_times_s"])

    assert "trace" in phases("--gpus", "2")
    warm = phases("--gpus", "4")
    assert "trace cache" in warm and "trace" not in warm
    assert "trace" in phases("--gpus", "4", "--no-trace-cache")


# -- campaign 34m: what the key covers, what the cache reads, what it removes -----------------


def test_an_environment_variable_the_model_may_read_is_in_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Campaign 34m b (DEF1a): a layer's ``call`` repeated a matmul ``$REPEAT`` times; the
    second run at another ``REPEAT`` was planned from the first's trace. Every environment
    variable but the few a shell changes between runs is in the key."""
    model = _mlp()
    monkeypatch.setenv("REPEAT", "1")
    key = trace_key(model, 16, None)
    monkeypatch.setenv("REPEAT", "20")
    assert trace_key(model, 16, None) != key
    monkeypatch.setenv("REPEAT", "1")
    monkeypatch.setenv("OLDPWD", "/somewhere/else")  # a shell's, not the model's
    assert trace_key(model, 16, None) == key


def test_a_data_file_the_model_read_is_in_the_key(tmp_path: Path) -> None:
    """Campaign 34m b (DEF1b): the model read ``settings.json`` at import; the command records
    the files the model's code read, and their content joins the key."""
    model, settings = _mlp(), tmp_path / "settings.json"
    settings.write_text('{"repeat": 1}')
    key = trace_key(model, 16, None, [str(settings)])
    settings.write_text('{"repeat": 20}')
    assert trace_key(model, 16, None, [str(settings)]) != key


def test_a_module_imported_from_a_zip_is_in_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Campaign 34m c (x2, x3): a helper imported from a zip on ``sys.path`` (or a ``.pyc``
    without source) was read as "unreadable", the same every run: an edit of it was a hit."""
    import importlib
    import zipfile

    archive = tmp_path / "lib.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped_helper.py", "REPEAT = 1\n")
    monkeypatch.syspath_prepend(str(archive))
    monkeypatch.delitem(sys.modules, "zipped_helper", raising=False)
    importlib.invalidate_caches()
    import zipped_helper  # type: ignore[import-not-found]  # noqa: F401

    model = _mlp()
    key = trace_key(model, 16, None)
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped_helper.py", "REPEAT = 20\n")
    assert trace_key(model, 16, None) != key


def test_eviction_removes_only_the_caches_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Campaign 34m a (T3): after a plan, eviction removed the user's ``.notes`` (a dot-file
    older than an hour) and the oldest ``*.json`` past the bound, whatever its name; a
    directory there stopped it with a false warning."""
    entries = tmp_path / "traces"
    entries.mkdir()
    notes, results = entries / ".notes", entries / "results.json"
    notes.write_text("mine\n")
    results.write_text("{}\n")
    os.utime(notes, (1.0, 1.0))
    os.utime(results, (1.0, 1.0))
    (entries / ".git").mkdir()
    monkeypatch.setattr(trace_cache, "MAX_TRACE_CACHE_BYTES", 1)
    model = _mlp()
    cache = TraceCache(tmp_path)
    cache.trace(model, 8, None)
    cache.flush()
    assert notes.read_text() == "mine\n" and results.read_text() == "{}\n"
    assert (entries / ".git").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_another_users_traces_are_not_read(tmp_path: Path) -> None:
    """Campaign 34m a (T8): in a cache directory anyone may write, another user's link as
    ``traces/`` (to altered entries), or another user's entry, was read: a different plan,
    exit 0. Both are misses now."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    model = _mlp()
    mine = tmp_path / "mine"
    first = TraceCache(mine)
    first.trace(model, 8, None)
    first.flush()
    (shared / "traces").symlink_to(mine / "traces")
    os.chown(shared / "traces", 65534, 65534, follow_symlinks=False)
    linked = TraceCache(shared)
    linked.trace(model, 8, None)
    assert linked.hits == 0
    entry = _entries(mine)[0]
    os.chown(entry, 65534, 65534)
    foreign = TraceCache(mine)
    foreign.trace(model, 8, None)
    assert foreign.hits == 0


def test_an_entry_of_absurd_counts_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Campaign 34m a (T1), b (DEF2): an entry whose op claimed 10**80 FLOPs made a plan that
    ``partition show`` then refused; counts past 2**62 make the entry a miss."""
    model = _mlp()
    cache = TraceCache(tmp_path)
    cache.trace(model, 8, None)
    cache.flush()
    entry = _entries(tmp_path)[0]
    body = json.loads(entry.read_text())
    body["graph"]["ops"][3][7] = 10**80
    entry.write_text(json.dumps(body))
    again = TraceCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="passes.trace_cache"):
        again.trace(model, 8, None)
    assert again.hits == 0 and "expected an integer in -1..2**62" in caplog.text


@pytest.mark.slow
def test_a_run_that_fails_writing_its_outputs_leaves_no_entry(tmp_path: Path) -> None:
    """Campaign 34m a (T11): entries were written when the plan was made, before the outputs;
    a run refused at its outputs left them. They are written after the outputs now."""
    model = tmp_path / "model.py"
    out = tmp_path / "made.json"
    model.write_text(
        "import keras\n"
        "class Maker(keras.layers.Layer):\n"
        "    def call(self, x):\n"
        "        if x.shape[0] is not None:  # traced at a batch: after the first output check\n"
        f"            open({str(out)!r}, 'w').write('the model made me')\n"
        "        return x\n"
        "def build_model():\n"
        "    x = keras.Input((8,))\n"
        "    return keras.Model(x, keras.layers.Dense(2)(Maker()(keras.layers.Dense(4)(x))))\n"
    )
    env = {**os.environ, "PARTITIONER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*PARTITION, str(model), "--gpus", "2", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "something made it while the run went on" in done.stderr
    assert not (tmp_path / "cache" / "traces").exists()


def test_a_change_no_key_sees_is_caught_by_the_forward_signature(tmp_path: Path) -> None:
    """Campaign 34n b (DEF1-3), c (D2): a layer repeated a matmul as often as a file read
    through ``tf.io.gfile`` (or ``cat`` in a subprocess, or SQLite) said; the key cannot see
    those reads, and the stale trace was served. The entry's forward signature (the ops the
    forward pass makes) is compared before it is served."""
    import keras

    counts = tmp_path / "reps.txt"

    class Repeat(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            import tensorflow as tf

            for _ in range(int(tf.io.gfile.GFile(str(counts)).read())):
                x = x * 2.0
            return x

    counts.write_text("1")
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3)(Repeat()(keras.layers.Dense(6)(inputs))))
    first = TraceCache(tmp_path / "cache")
    few = first.trace(model, 8, None).graph
    first.flush()
    counts.write_text("20")
    second = TraceCache(tmp_path / "cache")
    many = second.trace(model, 8, None).graph
    assert second.hits == 0 and len(many.ops) > len(few.ops)
    counts.write_text("1")
    third = TraceCache(tmp_path / "cache")
    assert third.trace(model, 8, None).graph == few and third.hits == 1


def test_a_model_with_a_custom_gradient_is_never_served(tmp_path: Path) -> None:
    """Campaign 34o b (TC1): a custom gradient repeating a matmul as often as a file read
    through ``tf.io.gfile`` said changed only the backward pass, which the forward signature
    cannot see: the stale trace was served. A model with a custom gradient is not cached."""
    import keras
    import tensorflow as tf

    class Scaled(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            @tf.custom_gradient
            def f(t: Any) -> Any:
                return t * 2.0, lambda dy: dy * 2.0

            return f(x)

    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3)(Scaled()(keras.layers.Dense(6)(inputs))))
    assert forward_signature(model, batch_size=8) is None
    cache = TraceCache(tmp_path)
    cache.trace(model, 8, None)
    assert not cache.pending
