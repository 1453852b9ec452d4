"""Profiled costs: merging measured layer times, the on-disk cache, and its atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cost_model_graphs import mlp

from cost_models.estimate.costs import cost_graph
from cost_models.measure.profiled import (
    LayerTiming,
    ProfileResult,
    ProfileSettings,
    apply_profile,
    default_cache_dir,
)
from partitioner.core.errors import PartitionError
from partitioner.core.ir import Phase

FAST = ProfileSettings(warmup=0, min_repeats=1, max_repeats=1, min_time_s=0.0)


def fake_result(timings: dict[str, tuple[float, float]], devices: tuple[str, ...] = ("/device:CPU:0",)) -> ProfileResult:
    rows = tuple(
        LayerTiming(layer, dev, f, b, repeats=3, cached=False)
        for dev in devices
        for layer, (f, b) in timings.items()
    )
    return ProfileResult(
        model="m", batch_size=32, devices=devices, device_kinds=devices, timings=rows,
        skipped=(), measured_count=len(rows), cached_count=0, cache_dir=None, profile_time_s=0.0,
    )  # fmt: skip


def phase_sums(costed: object, row: int) -> dict[tuple[str | None, Phase], float]:
    out: dict[tuple[str | None, Phase], float] = {}
    for op, t in zip(costed.graph.ops, costed.op_compute_time_s[row]):  # type: ignore[attr-defined]
        key = (op.layer, op.phase)
        out[key] = out.get(key, 0.0) + t
    return out


def test_apply_profile_scales_measured_layers_only() -> None:
    costed = cost_graph(mlp(), device_type="cpu", num_devices=2)
    merged = apply_profile(costed, fake_result({"dense1": (1e-3, 3e-3)}))
    assert merged is not costed and merged.measured == ("dense1",)
    assert costed.measured == ()  # the input is unchanged
    for row in (0, 1):
        before, after = phase_sums(costed, row), phase_sums(merged, row)
        assert after[("dense1", Phase.FORWARD)] == pytest.approx(1e-3)
        assert after[("dense1", Phase.BACKWARD)] == pytest.approx(3e-3)
        for key in before:
            if key[0] != "dense1":  # dense2 and the glue keep their estimates
                assert after[key] == pytest.approx(before[key])
    # Within the layer the analytic split between ops is kept.
    ops = costed.graph.ops
    fwd = [i for i, op in enumerate(ops) if op.layer == "dense1" and op.phase is Phase.FORWARD]
    old = [costed.op_compute_time_s[0][i] for i in fwd]
    new = [merged.op_compute_time_s[0][i] for i in fwd]
    assert [n / sum(new) for n in new] == pytest.approx([o / sum(old) for o in old])
    assert merged.layer_compute_time_s[0][0] == pytest.approx(
        4e-3 + sum(t for op, t in zip(ops, costed.op_compute_time_s[0]) if op.layer is None and
                   costed.graph.layer_graph.op_owner[op.id] == "dense1")
    )  # fmt: skip


def test_apply_profile_device_rows() -> None:
    costed = cost_graph(mlp(), device_type="cpu", num_devices=2)
    result = fake_result({"dense2": (2e-3, 2e-3)}, devices=("/device:GPU:0", "/device:GPU:1"))
    only_first = apply_profile(costed, result, device_rows={0: "/device:GPU:1"})
    assert phase_sums(only_first, 0)[("dense2", Phase.FORWARD)] == pytest.approx(2e-3)
    assert only_first.op_compute_time_s[1] == costed.op_compute_time_s[1]
    with pytest.raises(PartitionError, match="was not profiled"):
        apply_profile(costed, result, device_rows={0: "/device:GPU:7"})
    with pytest.raises(PartitionError, match="outside the topology"):
        apply_profile(costed, result, device_rows={5: "/device:GPU:0"})


def test_apply_profile_spreads_time_over_zero_estimates() -> None:
    costed = cost_graph(mlp(), device_type="cpu", num_devices=1)
    zero_rows = (tuple(0.0 for _ in costed.graph.ops),)
    from partitioner.core.ir import CostedGraph

    zeroed = CostedGraph(costed.graph, costed.topology, zero_rows, costed.layer_memory)
    merged = apply_profile(zeroed, fake_result({"dense2": (6e-3, 0.0)}))
    fwd = [t for op, t in zip(costed.graph.ops, merged.op_compute_time_s[0])
           if op.layer == "dense2" and op.phase is Phase.FORWARD]  # fmt: skip
    assert fwd and sum(fwd) == pytest.approx(6e-3) and len(set(fwd)) == 1


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PARTITIONER_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "partitioner"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()  # a home that does not exist is no home (campaign 34u)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "partitioner"


# ---------------------------------------------------------------------------------------------
# TensorFlow: a tiny model measured for real


def tiny_model() -> object:
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="d1"),
            keras.layers.Dropout(0.1, name="drop"),
            keras.layers.Dense(32, activation="relu", name="d2"),
            keras.layers.Dense(4, name="out"),
        ],
        name="tiny",
    )


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "layers").glob("*")) if (cache / "layers").exists() else []


def test_second_profile_measures_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from cost_models.measure.profiled import profile_model

    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    model = tiny_model()
    seen: list[tuple[int, int, str]] = []
    first = profile_model(model, batch_size=8, settings=FAST, progress=lambda *a: seen.append(a))
    assert first.cache_dir == str(tmp_path)
    assert first.layers == ("d1", "drop", "d2", "out") and first.skipped == ()
    assert first.measured_count == 4 and first.cached_count == 0
    assert all(t.forward_time_s >= 0 and t.backward_time_s >= 0 for t in first.timings)
    assert seen[-1] == (4, 4, "done") and [s[0] for s in seen[:-1]] == [0, 1, 2, 3]
    files = entries(tmp_path)
    assert len(files) == 4 and all(f.suffix == ".json" for f in files)
    body = json.loads(files[0].read_text())
    assert body["signature"]["batch_size"] == 8 and body["signature"]["tf"]

    second = profile_model(tiny_model(), batch_size=8, settings=FAST)
    assert second.measured_count == 0 and second.cached_count == 4
    assert all(t.cached for t in second.timings)
    assert {(t.layer, t.forward_time_s, t.backward_time_s) for t in second.timings} == {
        (t.layer, t.forward_time_s, t.backward_time_s) for t in first.timings
    }
    # Another batch size is another key: everything is measured again.
    third = profile_model(tiny_model(), batch_size=4, settings=FAST)
    assert third.measured_count == 4 and len(entries(tmp_path)) == 8


def test_identical_layers_share_one_measurement(tmp_path: Path) -> None:
    import keras

    from cost_models.measure.profiled import profile_model

    model = keras.Sequential(
        [keras.Input((32,))] + [keras.layers.Dense(32, name=f"same_{k}") for k in range(3)]
    )
    result = profile_model(model, batch_size=4, settings=FAST, cache_dir=tmp_path)
    # The first Dense takes the model input (no input gradient), the other two are identical.
    assert result.measured_count == 2 and result.cached_count == 1
    assert len(entries(tmp_path)) == 2


def test_interrupted_profile_leaves_only_complete_entries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import cost_models.measure.profiled as profiled

    real = profiled._measure_unit
    calls = {"n": 0}

    def interrupt_second(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profiled, "_measure_unit", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        profiled.profile_model(tiny_model(), batch_size=8, settings=FAST, cache_dir=tmp_path)
    files = entries(tmp_path)
    assert len(files) == 1 and json.loads(files[0].read_text())["forward_time_s"] >= 0


def test_interrupted_cache_write_leaves_no_entry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import partitioner.plan.model as plan
    from cost_models.measure.profiled import profile_model

    def interrupted_fsync(fd: int) -> None:
        raise KeyboardInterrupt  # Ctrl-C after part of the entry was written

    monkeypatch.setattr(plan.os, "fsync", interrupted_fsync)
    with pytest.raises(KeyboardInterrupt):
        profile_model(tiny_model(), batch_size=8, settings=FAST, cache_dir=tmp_path)
    assert entries(tmp_path) == []  # neither an entry nor a temporary file


def test_profiled_costs_enter_the_costed_graph(tmp_path: Path) -> None:
    from cost_models.measure.profiled import profile_model
    from passes.trace import trace_model

    model = tiny_model()
    result = profile_model(model, batch_size=8, settings=FAST, cache_dir=tmp_path)
    costed = cost_graph(trace_model(model, batch_size=8).graph, device_type="cpu", num_devices=2)
    merged = apply_profile(costed, result)
    assert merged.measured == ("d1", "drop", "d2", "out")
    sums = phase_sums(merged, 1)
    for t in result.timings:
        assert sums[(t.layer, Phase.FORWARD)] == pytest.approx(t.forward_time_s)
        assert sums.get((t.layer, Phase.BACKWARD), 0.0) == pytest.approx(
            t.backward_time_s if (t.layer, Phase.BACKWARD) in sums else 0.0
        )


def test_unknown_device_and_bad_batch(tmp_path: Path) -> None:
    from cost_models.measure.profiled import profile_model

    with pytest.raises(PartitionError, match="not present"):
        profile_model(tiny_model(), batch_size=8, devices=["/device:GPU:9"], cache_dir=tmp_path)
    with pytest.raises(PartitionError, match="batch_size"):
        profile_model(tiny_model(), batch_size=0, cache_dir=tmp_path)


def test_cache_entries_are_read_through_their_schema(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cost_models.measure import profiled

    key = "0" * 64
    path = tmp_path / "layers" / f"{key}.json"
    path.parent.mkdir()
    assert profiled._read_entry(tmp_path, key) is None  # no entry: no warning
    good = {
        "schema": profiled.CACHE_SCHEMA, "key": key, "forward_time_s": 1.0,
        "backward_time_s": 2.0, "repeats": 3,
    }  # fmt: skip
    path.write_text(json.dumps(good))
    assert profiled._read_entry(tmp_path, key) == (1.0, 2.0, 3)
    path.write_text(json.dumps({**good, "schema": profiled.CACHE_SCHEMA + 1}))
    assert profiled._read_entry(tmp_path, key) is None  # another version: ignored quietly
    assert not caplog.records
    path.write_text(json.dumps({**good, "forward_time_s": -1.0}))
    assert profiled._read_entry(tmp_path, key) is None
    assert "forward_time_s: must be >= 0" in caplog.text
    path.write_text("{")
    assert profiled._read_entry(tmp_path, key) is None
    assert "is not valid JSON" in caplog.text
